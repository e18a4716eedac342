// The Arbiter on its own (daemon/core/arbiter.h, policy.h): admission against the budget and the device,
// the queue's order, the choice of whom a reclaim asks, and what its pool's policy does when the engine
// declines or lets the deadline pass. The device is the real host backend, made "full" with
// host_used_by_others; the pools the reclaims look at are the loads the test hands the arbiter, as the
// manager would. tests/daemon/arbitration_test.cc drives all of it through the real daemon.
#include "daemon/core/arbiter.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/core/layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::unique_ptr<Device> HostDevice(uint64_t capacity, uint64_t used_by_others) {
  absl::StatusOr<std::unique_ptr<Device>> device = OpenDevice({.backend = "host",
                                                               .host_capacity = capacity,
                                                               .host_granularity = 2 * kMiB,
                                                               .host_used_by_others = used_by_others});
  EXPECT_THAT(device.status(), IsOk());
  return *std::move(device);
}

// One layer, one head: a block is 64 KiB, 32 blocks a 2 MiB granule.
Geometry SmallGeometry() {
  return *Geometry::Compute(
      *Layout::Parse("LBNHC"),
      PoolDims{
          .layers = 1, .capacity_blocks = 4096, .heads = 1, .block_tokens = 16, .channels = 1024, .element_bytes = 4},
      2 * kMiB);
}

// The manager's side, as the test sets it: the pools' loads, and a record of what the arbiter asked.
struct FakeManager {
  absl::Mutex mu;
  std::vector<PoolLoad> loads ABSL_GUARDED_BY(mu);
  std::vector<std::string> asked ABSL_GUARDED_BY(mu);       // "pool:bytes"
  std::map<std::string, uint64_t> ids ABSL_GUARDED_BY(mu);  // pool -> its last reclaim id
  std::vector<std::string> acted ABSL_GUARDED_BY(mu);       // "shrink pool used min", "sleep pool"

  void Set(const std::string& name, uint64_t committed_bytes, uint64_t clients = 1) {
    absl::MutexLock lock(&mu);
    const Geometry g = SmallGeometry();
    for (PoolLoad& l : loads) {
      if (l.name == name) {
        l.committed_bytes = committed_bytes;
        return;
      }
    }
    loads.push_back({.name = name,
                     .owner_uid = 1001,
                     .committed_blocks = committed_bytes / (64 * 1024),
                     .committed_bytes = committed_bytes,
                     .clients = clients,
                     .geometry = g});
  }

  Arbiter::Hooks Hooks() {
    return {.loads =
                [this] {
                  absl::MutexLock lock(&mu);
                  return loads;
                },
            .ask = [this](const std::string& pool, uint64_t id, uint64_t bytes, absl::Time) -> size_t {
              absl::MutexLock lock(&mu);
              asked.push_back(absl::StrCat(pool, ":", bytes / kMiB));
              ids[pool] = id;
              return 1;
            },
            .shrink = [this](const std::string& pool, uint64_t used, uint64_t min) -> absl::StatusOr<uint64_t> {
              absl::MutexLock lock(&mu);
              acted.push_back(absl::StrCat("shrink ", pool, " ", used, " ", min / kMiB));
              return used;
            },
            .sleep = [this](const std::string& pool) -> absl::StatusOr<std::string> {
              absl::MutexLock lock(&mu);
              acted.push_back(absl::StrCat("sleep ", pool));
              return std::string("its contents lost");
            }};
  }
  std::vector<std::string> Asked() {
    absl::MutexLock lock(&mu);
    return asked;
  }
  std::vector<std::string> Acted() {
    absl::MutexLock lock(&mu);
    return acted;
  }
  uint64_t IdOf(const std::string& pool) {
    absl::MutexLock lock(&mu);
    return ids[pool];
  }
};

Arbiter::Ask Grow(const std::string& pool, uint64_t bytes, uint64_t committed = 0) {
  return {.pool = pool, .committed_bytes = committed, .bytes = bytes, .what = "growing"};
}

// `ask` tried by the waiting request that holds `ticket`, as PoolManager's waiting grow does.
absl::StatusOr<Arbiter::Admission> Retry(Arbiter& arbiter, const Arbiter::Ticket& ticket, const Arbiter::Ask& ask) {
  const Arbiter::Retry retry(ticket);
  return arbiter.Admit(ask);
}

TEST(ArbiterTest, AdmitsOnlyWhatTheDeviceCanBackBesidesItsHeadroom) {
  // 128 MiB, 96 of them used by others: 32 free, 8 kept as headroom.
  std::unique_ptr<Device> device = HostDevice(128 * kMiB, 96 * kMiB);
  Budget budget(100 * kMiB);
  Arbiter arbiter(&budget, device.get(), {.headroom_bytes = 8 * kMiB});
  arbiter.Add("a", 1001, {});
  absl::StatusOr<Arbiter::Admission> refused = arbiter.Admit(Grow("a", 32 * kMiB));
  EXPECT_THAT(refused.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("the device can back only")));
  EXPECT_TRUE(Arbiter::IsShortOfMemory(refused.status()));
  EXPECT_THAT(refused.status().message(), HasSubstr("other processes use"));
  EXPECT_EQ(budget.committed(), 0u) << "a refusal takes nothing";
  EXPECT_THAT(arbiter.Admit(Grow("a", 24 * kMiB)).status(), IsOk());
  EXPECT_EQ(budget.committed(), 24 * kMiB);
  const DeviceRoom room = *arbiter.Room();
  EXPECT_EQ(room.headroom_bytes, 8 * kMiB);
  EXPECT_EQ(room.foreign_bytes, 96 * kMiB - 24 * kMiB) << "the budget holds 24 MiB the device does not have yet";
}

TEST(ArbiterTest, CountsWhatAdmittedCommitsAreStillMaking) {
  std::unique_ptr<Device> device = HostDevice(128 * kMiB, 96 * kMiB);
  Budget budget(100 * kMiB);
  Arbiter arbiter(&budget, device.get(), {.headroom_bytes = 8 * kMiB});
  std::optional<Arbiter::Admission> first(*arbiter.Admit(Grow("a", 16 * kMiB)));
  // The device still has 32 MiB free: only the first admission, not yet made, stands in the way.
  EXPECT_THAT(arbiter.Admit(Grow("b", 16 * kMiB)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("other commits are making")));
  first.reset();  // its creation ended (here: it made nothing)
  EXPECT_THAT(arbiter.Admit(Grow("b", 16 * kMiB)).status(), IsOk());
}

TEST(ArbiterTest, ACapRefusesAtOnceAndWaitingDoesNotCureIt) {
  std::unique_ptr<Device> device = HostDevice(512 * kMiB, 0);
  Budget budget(256 * kMiB);
  Arbiter arbiter(&budget, device.get(), {});
  arbiter.Add("a", 1001, {.max_bytes = 32 * kMiB});
  absl::StatusOr<Arbiter::Admission> refused = arbiter.Admit(Grow("a", 16 * kMiB, 24 * kMiB));
  EXPECT_THAT(refused.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("policy.max_bytes")));
  EXPECT_FALSE(Arbiter::IsShortOfMemory(refused.status()));
}

TEST(ArbiterTest, WaitersAreServedByPriorityThenArrival) {
  std::unique_ptr<Device> device = HostDevice(512 * kMiB, 0);
  Budget budget(256 * kMiB);
  Arbiter arbiter(&budget, device.get(), {});
  arbiter.Add("low", 1001, {.priority = 1});
  arbiter.Add("high1", 1001, {.priority = 5});
  arbiter.Add("high2", 1001, {.priority = 5});
  arbiter.Add("same", 1001, {.priority = 5});
  arbiter.Add("higher", 1001, {.priority = 6});
  const Arbiter::Ticket low = arbiter.Join("low", 1001, "growing");
  const Arbiter::Ticket high1 = arbiter.Join("high1", 1001, "growing");
  const Arbiter::Ticket high2 = arbiter.Join("high2", 1001, "growing");
  EXPECT_EQ(arbiter.Claim("high1").waiting.at(0).position, 1u);
  EXPECT_EQ(arbiter.Claim("high2").waiting.at(0).position, 2u);
  EXPECT_EQ(arbiter.Claim("low").waiting.at(0).position, 3u);
  // Memory is there, but nobody overtakes a waiter that comes first: not a later waiter, not a newcomer of
  // the same priority, not a request of the same pool that does not wait.
  EXPECT_THAT(Retry(arbiter, low, Grow("low", 2 * kMiB)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  EXPECT_THAT(Retry(arbiter, high2, Grow("high2", 2 * kMiB)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("first (the first: priority 5")));
  EXPECT_THAT(arbiter.Admit(Grow("same", 2 * kMiB)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("GrowRequest.wait queues behind them")));
  EXPECT_THAT(arbiter.Admit(Grow("high1", 2 * kMiB)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("2 grows or wakes waiting")));
  EXPECT_EQ(arbiter.Claim("high1").waiting.size(), 1u) << "a grow that does not wait serves no waiter";
  // A request of higher priority than every waiter goes first.
  EXPECT_THAT(arbiter.Admit(Grow("higher", 2 * kMiB)).status(), IsOk());
  EXPECT_THAT(Retry(arbiter, high1, Grow("high1", 2 * kMiB)).status(), IsOk());
  EXPECT_THAT(Retry(arbiter, low, Grow("low", 2 * kMiB)).status(), Not(IsOk()));
  EXPECT_THAT(Retry(arbiter, high2, Grow("high2", 2 * kMiB)).status(), IsOk());
  EXPECT_THAT(Retry(arbiter, low, Grow("low", 2 * kMiB)).status(), IsOk());
  EXPECT_EQ(arbiter.Stats().waiting, 0u) << "every waiter was served";
}

// A budget that is full: a waiter of `bytes` is short by all of them.
struct Full {
  explicit Full(uint64_t budget_bytes) : budget(budget_bytes) { budget.Take(budget_bytes); }
  std::unique_ptr<Device> device = HostDevice(1024 * kMiB, 0);
  Budget budget;
};

TEST(ArbiterTest, AReclaimAsksLowerPrioritiesAboveTheirMinimumMostReclaimableFirst) {
  Full full(256 * kMiB);
  FakeManager manager;
  Arbiter arbiter(&full.budget, full.device.get(), {.poll = absl::Milliseconds(1)});
  arbiter.SetHooks(manager.Hooks());
  arbiter.Add("hi", 1000, {.priority = 5});
  arbiter.Add("small", 1001, {.priority = 0});
  arbiter.Add("big", 1001, {.priority = 0});
  arbiter.Add("mid", 1001, {.priority = 3});
  arbiter.Add("guarded", 1001, {.priority = 0, .min_bytes = 48 * kMiB});
  arbiter.Add("peer", 1001, {.priority = 5});
  manager.Set("hi", 0);
  manager.Set("small", 32 * kMiB);
  manager.Set("big", 64 * kMiB);
  manager.Set("mid", 64 * kMiB);
  manager.Set("guarded", 48 * kMiB);
  manager.Set("peer", 128 * kMiB);
  const Arbiter::Ticket ticket = arbiter.Join("hi", 1000, "growing");
  EXPECT_THAT(Retry(arbiter, ticket, Grow("hi", 112 * kMiB)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  EXPECT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  // Priority 0 before 3, and the larger first within it; the pool at its minimum and the pool of the same
  // priority are never asked.
  EXPECT_THAT(manager.Asked(), ElementsAre("big:64", "small:32", "mid:16"));
  EXPECT_EQ(arbiter.Claim("big").reclaim.asked_bytes, 64 * kMiB);
  EXPECT_EQ(arbiter.Stats().reclaims_under_way, 3u);
}

TEST(ArbiterTest, LiveBlocksTheEngineReportedAreNotCountedReclaimable) {
  Full full(256 * kMiB);
  FakeManager manager;
  Arbiter arbiter(&full.budget, full.device.get(), {.poll = absl::Milliseconds(1)});
  arbiter.SetHooks(manager.Hooks());
  arbiter.Add("hi", 1000, {.priority = 5});
  arbiter.Add("a", 1001, {});
  arbiter.Add("b", 1001, {});
  manager.Set("hi", 0);
  manager.Set("a", 64 * kMiB);
  manager.Set("b", 48 * kMiB);
  // a holds 56 MiB of live blocks (896 of 64 KiB): 8 MiB reclaimable, less than b's 48.
  ASSERT_THAT(arbiter.Report("a", {.live_blocks = 896, .used_blocks = 896}, 1024), IsOk());
  const Arbiter::Ticket ticket = arbiter.Join("hi", 1000, "growing");
  (void)Retry(arbiter, ticket, Grow("hi", 40 * kMiB));
  EXPECT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  EXPECT_THAT(manager.Asked(), ElementsAre("b:40"));
}

TEST(ArbiterTest, GivingBackEndsTheReclaimAndTheWaiterIsServed) {
  Full full(128 * kMiB);
  FakeManager manager;
  Arbiter arbiter(&full.budget, full.device.get(), {.poll = absl::Milliseconds(1)});
  arbiter.SetHooks(manager.Hooks());
  arbiter.Add("hi", 1000, {.priority = 5});
  arbiter.Add("lo", 1001, {});
  manager.Set("hi", 0);
  manager.Set("lo", 64 * kMiB);
  const Arbiter::Ticket ticket = arbiter.Join("hi", 1000, "growing");
  (void)Retry(arbiter, ticket, Grow("hi", 32 * kMiB));
  ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  ASSERT_THAT(manager.Asked(), ElementsAre("lo:32"));
  // The engine shrinks its pool by what was asked; the memory comes back to the budget.
  manager.Set("lo", 32 * kMiB);
  full.budget.Give(32 * kMiB);
  ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  EXPECT_EQ(arbiter.Stats().reclaims.at("gave"), 1u);
  EXPECT_THAT(arbiter.Claim("lo").reclaim.last_outcome, HasSubstr("gave 32.0 MiB"));
  EXPECT_THAT(Retry(arbiter, ticket, Grow("hi", 32 * kMiB)).status(), IsOk());
  EXPECT_EQ(arbiter.Stats().given_bytes, 32 * kMiB);
}

TEST(ArbiterTest, AWaiterServedBeforeItsDriveSawTheGiveBackEndsTheReclaimAsGiven) {
  Full full(128 * kMiB);
  FakeManager manager;
  Arbiter arbiter(&full.budget, full.device.get(), {.poll = absl::Milliseconds(1)});
  arbiter.SetHooks(manager.Hooks());
  arbiter.Add("hi", 1000, {.priority = 5});
  arbiter.Add("lo", 1001, {});
  manager.Set("hi", 0);
  manager.Set("lo", 64 * kMiB);
  {
    const Arbiter::Ticket ticket = arbiter.Join("hi", 1000, "growing");
    (void)Retry(arbiter, ticket, Grow("hi", 32 * kMiB));
    ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
    ASSERT_THAT(manager.Asked(), ElementsAre("lo:32"));
    // The engine gives back and the waiter's next try is admitted at once, before any AwaitRoom.
    manager.Set("lo", 32 * kMiB);
    full.budget.Give(32 * kMiB);
    ASSERT_THAT(Retry(arbiter, ticket, Grow("hi", 32 * kMiB)).status(), IsOk());
  }
  EXPECT_EQ(arbiter.Stats().reclaims.count("called_off"), 0u);
  EXPECT_EQ(arbiter.Stats().reclaims.at("gave"), 1u);
  EXPECT_THAT(arbiter.Claim("lo").reclaim.last_outcome, HasSubstr("gave 32.0 MiB"));
  EXPECT_EQ(arbiter.Stats().given_bytes, 32 * kMiB);
}

TEST(ArbiterTest, ADeclineAppliesThePoolsPolicyAtOnceAndTheErrorSaysSo) {
  Full full(128 * kMiB);
  FakeManager manager;
  Arbiter arbiter(&full.budget, full.device.get(), {.poll = absl::Milliseconds(1)});
  arbiter.SetHooks(manager.Hooks());
  arbiter.Add("hi", 1000, {.priority = 5});
  arbiter.Add("lo", 1001, {.min_bytes = 8 * kMiB, .on_timeout = ReclaimAction::kShrink});
  manager.Set("hi", 0);
  manager.Set("lo", 64 * kMiB);
  ASSERT_THAT(arbiter.Report("lo", {.live_blocks = 100, .evictable_blocks = 28, .used_blocks = 200}, 1024), IsOk());
  const Arbiter::Ticket ticket = arbiter.Join("hi", 1000, "growing");
  const absl::Status short_of = Retry(arbiter, ticket, Grow("hi", 32 * kMiB)).status();
  ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  ASSERT_THAT(manager.Asked(), ElementsAre("lo:32"));
  EXPECT_THAT(arbiter.Decline("lo", manager.IdOf("lo") + 1, "busy"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  ASSERT_THAT(arbiter.Decline("lo", manager.IdOf("lo"), "busy"), IsOk());
  ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  // Shrunk to the blocks the engine reported in use, its guarantee kept.
  EXPECT_THAT(manager.Acted(), ElementsAre("shrink lo 200 8"));
  EXPECT_EQ(arbiter.Stats().reclaims.at("declined"), 1u);
  const absl::Status failed = arbiter.WaitFailed(ticket, short_of, [](const std::string&) { return true; });
  EXPECT_THAT(failed, StatusIs(absl::StatusCode::kResourceExhausted,
                               HasSubstr("pool lo (priority 0) was asked for 32.0 MiB: declined (busy)")));
  // A uid that may not use the pool does not learn its name.
  EXPECT_THAT(arbiter.WaitFailed(ticket, short_of, [](const std::string&) { return false; }).message(),
              HasSubstr("a pool of uid 1001 (priority 0)"));
}

TEST(ArbiterTest, ThePassedDeadlineAppliesThePolicyAndNobodyAttachedIsDueAtOnce) {
  Full full(128 * kMiB);
  FakeManager manager;
  Arbiter arbiter(&full.budget, full.device.get(), {.poll = absl::Milliseconds(1)});
  arbiter.SetHooks(manager.Hooks());
  arbiter.Add("hi", 1000, {.priority = 5});
  arbiter.Add("slow", 1001, {.reclaim_timeout = absl::Milliseconds(1), .on_timeout = ReclaimAction::kSleep});
  arbiter.Add("alone", 1001, {.on_timeout = ReclaimAction::kSleep});
  manager.Set("hi", 0);
  manager.Set("slow", 64 * kMiB);
  manager.Set("alone", 32 * kMiB, /*clients=*/0);
  const Arbiter::Ticket ticket = arbiter.Join("hi", 1000, "growing");
  (void)Retry(arbiter, ticket, Grow("hi", 96 * kMiB));
  ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  ASSERT_THAT(manager.Asked(), ElementsAre("slow:64", "alone:32"));
  absl::SleepFor(absl::Milliseconds(5));  // past slow's deadline; alone has nobody to answer
  ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  EXPECT_THAT(manager.Acted(), ElementsAre("sleep alone", "sleep slow"));
  EXPECT_EQ(arbiter.Stats().reclaims.at("timed_out"), 1u);
  EXPECT_EQ(arbiter.Stats().reclaims.at("no_answer"), 1u);
}

TEST(ArbiterTest, AWaiterWithinItsGuaranteeReclaimsFromAnyPriority) {
  Full full(128 * kMiB);
  FakeManager manager;
  Arbiter arbiter(&full.budget, full.device.get(), {.poll = absl::Milliseconds(1)});
  arbiter.SetHooks(manager.Hooks());
  arbiter.Add("guaranteed", 1000, {.priority = 0, .min_bytes = 64 * kMiB});
  arbiter.Add("important", 1001, {.priority = 9});
  manager.Set("guaranteed", 0);
  manager.Set("important", 128 * kMiB);
  const Arbiter::Ticket ticket = arbiter.Join("guaranteed", 1000, "growing");
  (void)Retry(arbiter, ticket, Grow("guaranteed", 32 * kMiB));
  ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
  EXPECT_THAT(manager.Asked(), ElementsAre("important:32"));
}

TEST(ArbiterTest, AWaitThatEndsCallsOffItsReclaims) {
  Full full(128 * kMiB);
  FakeManager manager;
  Arbiter arbiter(&full.budget, full.device.get(), {.poll = absl::Milliseconds(1)});
  arbiter.SetHooks(manager.Hooks());
  arbiter.Add("hi", 1000, {.priority = 5});
  arbiter.Add("lo", 1001, {.on_timeout = ReclaimAction::kSleep});
  manager.Set("hi", 0);
  manager.Set("lo", 64 * kMiB);
  {
    const Arbiter::Ticket ticket = arbiter.Join("hi", 1000, "growing");
    (void)Retry(arbiter, ticket, Grow("hi", 32 * kMiB));
    ASSERT_THAT(arbiter.AwaitRoom(ticket, absl::Now() + absl::Seconds(5), {}), IsOk());
    EXPECT_THAT(arbiter.AwaitRoom(ticket, absl::Now(), {}),
                StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  }
  EXPECT_EQ(arbiter.Claim("lo").reclaim.id, 0u);
  EXPECT_EQ(arbiter.Stats().reclaims.at("called_off"), 1u);
  EXPECT_TRUE(manager.Acted().empty()) << "nobody needs the memory: no deadline action";
}

TEST(ArbiterTest, PolicyChangesAreValidatedAndAuthorisedNamingTheField) {
  std::unique_ptr<Device> device = HostDevice(512 * kMiB, 0);
  Budget budget(256 * kMiB);
  Arbiter arbiter(&budget, device.get(), {});
  Limits limits{.daemon_uid = 990, .claim_per_uid = {.max_priority = 3, .guaranteed_bytes = 64 * kMiB}};
  limits.claim_of[1002] = {.max_priority = 9, .guaranteed_bytes = 0};
  const uint64_t capacity = 256 * kMiB;
  arbiter.Add("t1", 1001, {});
  arbiter.Add("t2", 1001, {});
  EXPECT_THAT(arbiter.Change("t1", {.priority = 1001}, 1001, capacity, limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.priority")));
  EXPECT_THAT(arbiter.Change("t1", {.priority = 4}, 1001, capacity, limits).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("policy.priority: uid 1001 may give")));
  EXPECT_THAT(arbiter.Change("t1", {.priority = 3, .min_bytes = 48 * kMiB}, 1001, capacity, limits).status(), IsOk());
  // The guarantee is the uid's over all its pools.
  EXPECT_THAT(arbiter.Change("t2", {.min_bytes = 32 * kMiB}, 1001, capacity, limits).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("policy.min_bytes")));
  EXPECT_THAT(arbiter.Change("t2", {.min_bytes = 16 * kMiB}, 1001, capacity, limits).status(), IsOk());
  EXPECT_THAT(arbiter.Change("t1", {.min_bytes = 300 * kMiB}, 1001, capacity, limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than the pool can hold")));
  EXPECT_THAT(arbiter.Change("t1", {.on_timeout = ReclaimAction::kSleep}, 1001, capacity, limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy.on_reclaim_timeout")));
  // An operator caps the tenant's pool: the tenant may tighten the cap, not loosen it.
  EXPECT_THAT(arbiter.Change("t1", {.max_bytes = 128 * kMiB}, 0, capacity, limits).status(), IsOk());
  EXPECT_TRUE(arbiter.Claim("t1").policy.operator_bounds);
  EXPECT_THAT(arbiter.Change("t1", {.max_bytes = 0}, 1001, capacity, limits).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("policy.max_bytes")));
  EXPECT_THAT(arbiter.Change("t1", {.max_bytes = 96 * kMiB}, 1001, capacity, limits).status(), IsOk());
  // Lowering is always allowed, even from above the grant.
  EXPECT_THAT(arbiter.Change("t1", {.priority = 900}, 0, capacity, limits).status(), IsOk());
  EXPECT_THAT(arbiter.Change("t1", {.priority = 800}, 1001, capacity, limits).status(), IsOk());
  // --uid-claim replaces the per-uid grant for its uid.
  arbiter.Add("u", 1002, {});
  EXPECT_THAT(arbiter.Change("u", {.priority = 9}, 1002, capacity, limits).status(), IsOk());
  EXPECT_THAT(arbiter.Change("u", {.min_bytes = 2 * kMiB}, 1002, capacity, limits).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("--uid-claim=1002")));
  // Guarantees together fit in the budget, whoever asks.
  arbiter.Add("op", 0, {});
  EXPECT_THAT(arbiter.Change("op", {.min_bytes = 240 * kMiB}, 0, capacity, limits).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("budget")));
  // A failed change changed nothing.
  EXPECT_EQ(arbiter.Claim("op").policy.min_bytes, 0u);
}

}  // namespace
}  // namespace kvd::daemon
