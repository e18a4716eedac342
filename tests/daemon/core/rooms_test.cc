// The pool model's small rooms on their own: Budget, SessionTable, LeaseTable, TransactionTable and
// EventQueue (daemon/core/budget.h, sessions.h, transactions.h, event_queue.h). PoolManager's tests
// cover how they work together.
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/core/budget.h"
#include "daemon/core/event_queue.h"
#include "daemon/core/limits.h"
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
  const std::string token = *sessions.Open(1000, 42, "engine");
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

TEST(SessionTableTest, SessionsAreLimitedPerUidAndInTotalWithAShareForOperators) {
  // 6 in total, 1 kept for operators (ceil(6 * 10%)); 2 per ordinary uid; uid 990 is the daemon's.
  SessionTable sessions(
      Limits{.max_sessions = 6, .max_sessions_per_uid = 2, .operator_reserve_percent = 10, .daemon_uid = 990});
  const std::string first = *sessions.Open(1000, 1, "a");
  ASSERT_THAT(sessions.Open(1000, 1, "a").status(), IsOk());
  EXPECT_THAT(sessions.Open(1000, 1, "a").status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "sessions of uid 1000: 2 of 2 (--max-sessions-per-uid)"));
  ASSERT_THAT(sessions.Open(1001, 2, "b").status(), IsOk());
  ASSERT_THAT(sessions.Open(1001, 2, "b").status(), IsOk());
  ASSERT_THAT(sessions.Open(1002, 3, "c").status(), IsOk());
  EXPECT_THAT(sessions.Open(1003, 4, "d").status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "sessions of all uids: 5 of 5 for uid 1003 (--max-sessions=6, less 1 kept for root and uid "
                       "990 by --operator-reserve=10%)"));
  // The operator's share, beyond any per-uid limit; then the total binds operators too.
  const std::string probe = *sessions.Open(990, 5, "probe");
  EXPECT_THAT(
      sessions.Open(0, 6, "root").status(),
      StatusIs(absl::StatusCode::kResourceExhausted, "sessions of all uids: 6 of 6 for uid 0 (--max-sessions)"));
  EXPECT_EQ(sessions.CountByUid(), (std::map<uint32_t, uint64_t>{{990, 1}, {1000, 2}, {1001, 2}, {1002, 1}}));
  // A closed session frees its slot; the operator's session counts in the total.
  EXPECT_TRUE(sessions.Close(first));
  EXPECT_THAT(sessions.Open(1000, 1, "a").status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("5 of 5")));
  EXPECT_TRUE(sessions.Close(probe));
  EXPECT_THAT(sessions.Open(1000, 1, "a").status(), IsOk());
}

TEST(LimitsTest, TheOperatorShareIsRoundedUp) {
  EXPECT_EQ(OperatorShare(1024, 5), 52u);
  EXPECT_EQ(OperatorShare(8, 5), 1u);
  EXPECT_EQ(OperatorShare(100, 0), 0u);
  EXPECT_EQ(OperatorShare(uint64_t{96} << 40, 5), 5277655813325u);
  EXPECT_EQ(OperatorShare(~uint64_t{0}, 50), uint64_t{1} << 63);
  const Limits limits{.operator_reserve_percent = 5, .daemon_uid = 990};
  EXPECT_EQ(UsableShare(1024, limits, 1000), 972u);
  EXPECT_EQ(UsableShare(1024, limits, 990), 1024u);
  EXPECT_EQ(UsableShare(1024, limits, 0), 1024u);
}

// Note [Typed refusals]: each refusal carries its numbers; no other status does.
TEST(LimitsTest, ARefusalCarriesItsLimitAndNumbers) {
  const Limits limits{.max_block_ids = 4, .operator_reserve_percent = 5, .daemon_uid = 990};
  const auto numbers = [](const absl::Status& s) {
    const std::optional<LimitRefusal> r = LimitRefusalOf(s);
    return r.has_value() ? absl::StrCat(LimitFlag(r->limit), " uid ", r->uid, ": ", r->allowed, " allowed, ", r->used,
                                        " used, ", r->asked, " asked")
                         : std::string("none");
  };
  const absl::Status per_uid =
      CheckCount("pools", 1000, 2, 2, Limit::kMaxPoolsPerUid, 5, 1024, Limit::kMaxPools, limits);
  EXPECT_THAT(per_uid,
              StatusIs(absl::StatusCode::kResourceExhausted, "pools of uid 1000: 2 of 2 (--max-pools-per-uid)"));
  EXPECT_EQ(numbers(per_uid), "--max-pools-per-uid uid 1000: 2 allowed, 2 used, 1 asked");
  const absl::Status total =
      CheckCount("pools", 1000, 0, 2, Limit::kMaxPoolsPerUid, 972, 1024, Limit::kMaxPools, limits);
  EXPECT_EQ(numbers(total), "--max-pools uid 1000: 972 allowed, 972 used, 1 asked");
  EXPECT_EQ(numbers(CheckCount("clients of pool kv", 990, 0, 0, std::nullopt, 8, 8, Limit::kMaxClientsPerPool, limits)),
            "--max-clients-per-pool uid 990: 8 allowed, 8 used, 1 asked");
  EXPECT_EQ(numbers(CheckBytes("reserved", 1000, 10, 60, 64, Limit::kMaxReservedPerUid, 60, 1000, Limit::kMaxReserved,
                               limits)),
            "--max-reserved-per-uid uid 1000: 64 allowed, 60 used, 10 asked");
  EXPECT_EQ(numbers(CheckBlockIds("block_ids", 5, 1000, limits)),
            "--max-block-ids uid 1000: 4 allowed, 0 used, 5 asked");
  EXPECT_THAT(CheckBlockIds("block_ids", 4, 1000, limits), IsOk());
  // Only a refusal made here reads as one: not another RESOURCE_EXHAUSTED, nor the payload on another code.
  EXPECT_EQ(numbers(absl::ResourceExhaustedError("pools of uid 1000: 2 of 2 (--max-pools-per-uid)")), "none");
  absl::Status relabelled(absl::StatusCode::kInternal, per_uid.message());
  per_uid.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { relabelled.SetPayload(url, payload); });
  EXPECT_EQ(numbers(relabelled), "none");
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
  bool ended = false;
  EXPECT_FALSE(queue.TryPop(&ended).has_value());
  EXPECT_TRUE(ended);
}

// What a Watch stream's reactor relies on: told after every push and at the close, outside the queue's lock
// (it pops from inside Ready), and never once it is gone.
TEST(EventQueueTest, AListenerIsToldOfEveryPushAndTheCloseWhileItLives) {
  struct Reader final : EventQueue::Listener {
    explicit Reader(EventQueue* q) : queue(q) {}
    void Ready() override {
      ++told;
      bool ended = false;
      while (std::optional<PoolEvent> e = queue->TryPop(&ended)) read.push_back(e->sequence);
      if (ended) ++ends;
    }
    EventQueue* queue;
    int told = 0;
    int ends = 0;
    std::vector<uint64_t> read;
  };
  EventQueue queue;
  queue.Push(PoolEvent{.sequence = 1});  // before anyone listens: stays queued
  auto reader = std::make_shared<Reader>(&queue);
  queue.Listen(reader);
  bool ended = true;
  EXPECT_EQ(queue.TryPop(&ended)->sequence, 1u);
  EXPECT_FALSE(queue.TryPop(&ended).has_value());
  EXPECT_FALSE(ended);  // empty, but more may come
  queue.Push(PoolEvent{.sequence = 2});
  queue.Push(PoolEvent{.sequence = 3});
  EXPECT_EQ(reader->told, 2);
  EXPECT_THAT(reader->read, ::testing::ElementsAre(2u, 3u));
  EXPECT_EQ(reader->ends, 0);
  queue.Close();
  EXPECT_EQ(reader->told, 3);
  EXPECT_EQ(reader->ends, 1);
  queue.Push(PoolEvent{.sequence = 4});  // dropped, and nobody told
  EXPECT_EQ(reader->told, 3);

  EventQueue other;
  auto gone = std::make_shared<Reader>(&other);
  other.Listen(gone);
  gone.reset();
  other.Push(PoolEvent{.sequence = 1});  // its listener is gone: nothing is called
  EXPECT_EQ(other.TryPop(&ended)->sequence, 1u);
}

}  // namespace
}  // namespace kvd::daemon
