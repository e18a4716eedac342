// The pool model's small rooms on their own: Budget, SessionTable, LeaseTable, TransactionTable and
// EventQueue (daemon/core/budget.h, sessions.h, transactions.h, event_queue.h). PoolManager's tests
// cover how they work together.
#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/core/budget.h"
#include "daemon/core/event_queue.h"
#include "daemon/core/sessions.h"
#include "daemon/core/transactions.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::HasSubstr;

TEST(BudgetTest, TakesWhatFitsAndSaysWhatWasFreeOtherwise) {
  Budget budget(100);
  uint64_t free = 0;
  EXPECT_TRUE(budget.TryTake(60, &free));
  EXPECT_FALSE(budget.TryTake(41, &free));
  EXPECT_EQ(free, 40u);
  EXPECT_EQ(budget.committed(), 60u);
  EXPECT_TRUE(budget.TryTake(40, &free));
  budget.Give(100);
  EXPECT_EQ(budget.committed(), 0u);
}

TEST(BudgetTest, ConcurrentTakersNeverOvercommit) {
  Budget budget(1000);
  std::vector<std::thread> threads;
  std::atomic<int> taken{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      uint64_t free = 0;
      for (int i = 0; i < 100; ++i) {
        if (budget.TryTake(3, &free)) taken.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(taken.load(), 333);
  EXPECT_EQ(budget.committed(), 999u);
}

TEST(SessionTableTest, AClosedSessionNoLongerAuthenticates) {
  SessionTable sessions;
  const std::string token = sessions.Open(1000, 42, "engine");
  absl::StatusOr<Caller> caller = sessions.Authenticate(token);
  ASSERT_THAT(caller.status(), IsOk());
  EXPECT_EQ(caller->uid, 1000u);
  EXPECT_EQ(caller->pid, 42);
  EXPECT_EQ(caller->name, "engine");
  EXPECT_TRUE(sessions.Close(token));
  EXPECT_FALSE(sessions.Close(token));
  EXPECT_FALSE(sessions.Contains(token));
  EXPECT_THAT(sessions.Authenticate(token).status(), StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
}

TEST(LeaseTableTest, ALeaseIsRedeemedOnceByItsSession) {
  LeaseTable leases(absl::Seconds(30));
  const Lease lease = leases.Issue("kv", "s-1", "c-1", {7, 8});
  EXPECT_THAT(leases.Redeem("s-2", lease.token).status(), StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  absl::StatusOr<LeaseRecord> record = leases.Redeem("s-1", lease.token);
  ASSERT_THAT(record.status(), IsOk());
  EXPECT_EQ(record->pool, "kv");
  EXPECT_EQ(record->client, "c-1");
  EXPECT_THAT(record->chunk_ids, ::testing::ElementsAre(7, 8));
  EXPECT_THAT(leases.Redeem("s-1", lease.token).status(), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST(LeaseTableTest, ExpiredLeasesAreRefusedAndDroppedLeasesAreGone) {
  LeaseTable expiring(absl::ZeroDuration());
  const Lease old = expiring.Issue("kv", "s-1", "c-1", {1});
  absl::SleepFor(absl::Milliseconds(1));
  EXPECT_THAT(expiring.Redeem("s-1", old.token).status(), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));

  LeaseTable leases(absl::Seconds(30));
  const Lease a = leases.Issue("kv", "s-1", "c-1", {1});
  const Lease b = leases.Issue("other", "s-2", "c-2", {2});
  const Lease c = leases.Issue("other", "s-1", "c-3", {3});
  const Lease d = leases.Issue("other", "s-1", "c-4", {4});
  leases.DropPool("kv");
  leases.DropSession("s-2");
  leases.DropClient("c-4");
  EXPECT_THAT(leases.Redeem("s-1", a.token).status(), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(leases.Redeem("s-2", b.token).status(), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(leases.Redeem("s-1", d.token).status(), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(leases.Redeem("s-1", c.token).status(), IsOk());
}

TEST(TransactionTableTest, LookupNamesThePoolOrWhyTheDaemonAbortedIt) {
  TransactionTable txns;
  txns.Add("t-1", "kv", absl::InfiniteFuture());
  EXPECT_THAT(txns.Lookup("t-1").value(), "kv");
  txns.Remove("t-1", "not committed within its ttl");
  EXPECT_THAT(txns.Lookup("t-1").status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("aborted by the daemon: not committed within its ttl")));
  EXPECT_THAT(txns.Lookup("t-2").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("unknown")));
}

TEST(TransactionTableTest, TheReaperWakesForANewTransactionAndStops) {
  TransactionTable txns;
  std::optional<std::vector<std::pair<std::string, std::string>>> expired;
  std::thread reaper([&] { expired = txns.AwaitExpired(); });
  txns.Add("t-1", "kv", absl::Now() + absl::Milliseconds(20));
  reaper.join();
  ASSERT_TRUE(expired.has_value());
  ASSERT_EQ(expired->size(), 1u);
  EXPECT_EQ((*expired)[0].first, "t-1");
  EXPECT_EQ((*expired)[0].second, "kv");

  txns.Remove("t-1", "");
  std::thread stopped([&] { expired = txns.AwaitExpired(); });
  txns.Stop();
  stopped.join();
  EXPECT_FALSE(expired.has_value());
}

TEST(EventQueueTest, PopDrainsInOrderThenEndsOnceClosed) {
  EventQueue queue;
  queue.Push(PoolEvent{.sequence = 1});
  queue.Push(PoolEvent{.sequence = 2});
  queue.Close();
  queue.Push(PoolEvent{.sequence = 3});  // dropped: closed
  EXPECT_EQ(queue.Pop(absl::ZeroDuration())->sequence, 1u);
  EXPECT_EQ(queue.Pop(absl::ZeroDuration())->sequence, 2u);
  EXPECT_FALSE(queue.Pop(absl::Seconds(5)).has_value());
  EXPECT_TRUE(queue.closed());
}

}  // namespace
}  // namespace kvd::daemon
