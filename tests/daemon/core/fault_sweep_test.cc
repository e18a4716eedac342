// The fault-injection sweep (docs/reliability.md, "Device failures roll back"): for each operation of
// the resize state machine and the pool lifecycle, walk N = 1, 2, ... over the fallible backend calls it
// makes (FaultDevice::FailNthCall) until it makes fewer than N. After every injected failure the
// operation must fail with the device's status, and everything must be as before it: the device's live
// chunks, mappings and reservations, the process's open FDs, the daemon's committed, pending and reserved
// bytes and its pool count (the budget), and the pool's table, state, generation and holder. Then the
// same operation, without the fault, must succeed: the pool is usable after. An operation in steps (an
// exact shrink or a compaction whose new chunks do not fit the free memory at once) may instead fail
// after its first step with the steps before it done, as its error says: then the pool must be
// consistent (the budget as its table says, nothing leaked) and the operation again must finish it.
#include <dirent.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/core/pool_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fault_device.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::FaultDevice;
using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// L=2, B=256, H=2, N=16, C=1024, bf16 under LBNHC: 2 segments, 64 KiB blocks, 16 MiB segments.
PoolSpec Spec(std::string name, uint64_t initial_blocks) {
  return {
      .name = std::move(name),
      .dims =
          {.layers = 2, .capacity_blocks = 256, .heads = 2, .block_tokens = 16, .channels = 1024, .element_bytes = 2},
      .initial_blocks = initial_blocks};
}

int OpenFds() {
  int n = 0;
  if (DIR* dir = opendir("/proc/self/fd"); dir != nullptr) {
    while (readdir(dir) != nullptr) ++n;
    closedir(dir);
  }
  return n;  // includes ".", ".." and the directory's own FD: constant, so comparable
}

// Everything a failed operation must leave as it was.
struct Snapshot {
  int chunks = 0, mappings = 0, reservations = 0, fds = 0;
  uint64_t committed = 0, pending = 0, reserved = 0;
  uint32_t pools = 0;
  std::optional<PoolView> pool;  // "p", if it exists
};

// One operation of the sweep: `setup` brings a fresh daemon to the state before it (no faults), `run`
// is the operation. Both use the fixture's manager and callers.
class FaultSweepTest;
struct Operation {
  std::string name;
  std::function<void(FaultSweepTest&)> setup;
  std::function<absl::Status(FaultSweepTest&)> run;
  bool in_steps = false;  // may leave the steps before a failed one done
  uint64_t budget_bytes = 256 * kMiB;
};

class FaultSweepTest : public ::testing::TestWithParam<Operation> {
 public:
  void Start(uint64_t budget_bytes = 256 * kMiB) {
    manager_.reset();
    absl::StatusOr<std::unique_ptr<Device>> host =
        OpenDevice({.backend = "host", .host_capacity = 512 * kMiB, .host_granularity = 2 * kMiB});
    ASSERT_THAT(host, IsOk());
    device_ = std::make_unique<FaultDevice>(*std::move(host));
    manager_ =
        std::make_unique<PoolManager>(device_.get(), ManagerOptions{.budget_bytes = budget_bytes, .daemon_uid = 4242});
    alice_ = *manager_->Authenticate(*manager_->OpenSession(1000, 1100, "alice"));
    transaction_.clear();
  }
  void Stop() {
    manager_.reset();
    EXPECT_EQ(device_->live_chunks(), 0);
    EXPECT_EQ(device_->live_mappings(), 0);
    EXPECT_EQ(device_->live_reservations(), 0);
  }

  Snapshot Take() {
    Snapshot s{.chunks = device_->live_chunks(),
               .mappings = device_->live_mappings(),
               .reservations = device_->live_reservations(),
               .fds = OpenFds()};
    absl::StatusOr<DeviceStatus> status = manager_->GetDeviceStatus();
    EXPECT_THAT(status, IsOk());
    if (status.ok()) {
      s.committed = status->committed_bytes;
      s.pending = status->pending_release_bytes;
      s.reserved = status->reserved_bytes;
      s.pools = status->pools;
    }
    if (absl::StatusOr<PoolView> pool = manager_->GetPool(alice_, "p"); pool.ok()) s.pool = *std::move(pool);
    return s;
  }

  // What a change in steps that failed after its first step must leave: the daemon's view of pool p
  // only (no client is attached in the sweep), the budget as its table says.
  static void ExpectConsistent(const Snapshot& before, const Snapshot& after) {
    ASSERT_TRUE(after.pool.has_value());
    uint64_t held = 0;
    for (const ChunkInfo& c : after.pool->chunks) held += c.bytes;
    EXPECT_EQ(after.chunks, static_cast<int>(after.pool->chunks.size())) << "live chunks";
    EXPECT_EQ(after.mappings, after.chunks) << "live mappings";
    EXPECT_EQ(after.reservations, before.reservations) << "live reservations";
    EXPECT_EQ(after.committed, held) << "committed bytes (the budget)";
    EXPECT_EQ(after.pending, 0u) << "bytes pending release";
    EXPECT_EQ(after.reserved, before.reserved) << "reserved address space";
    EXPECT_GT(after.pool->generation, before.pool->generation);
  }

  static void ExpectSame(const Snapshot& before, const Snapshot& after) {
    EXPECT_EQ(after.chunks, before.chunks) << "live chunks";
    // The daemon maps its view on demand (Note [The daemon maps on demand]): a change that failed after it mapped
    // the whole view for a copy leaves it mapped, and maps nothing else.
    if (after.mappings != before.mappings) {
      EXPECT_EQ(after.mappings, after.chunks) << "live mappings";
    }
    EXPECT_EQ(after.reservations, before.reservations) << "live reservations";
    EXPECT_EQ(after.fds, before.fds) << "open FDs";
    EXPECT_EQ(after.committed, before.committed) << "committed bytes (the budget)";
    EXPECT_EQ(after.pending, before.pending) << "bytes pending release";
    EXPECT_EQ(after.reserved, before.reserved) << "reserved address space";
    EXPECT_EQ(after.pools, before.pools) << "pools";
    ASSERT_EQ(after.pool.has_value(), before.pool.has_value()) << "pool p exists";
    if (!before.pool.has_value()) return;
    const PoolView& b = *before.pool;
    const PoolView& a = *after.pool;
    EXPECT_EQ(a.state, b.state);
    EXPECT_EQ(a.committed_blocks, b.committed_blocks);
    EXPECT_EQ(a.committed_bytes, b.committed_bytes);
    EXPECT_EQ(a.wake_blocks, b.wake_blocks);
    EXPECT_EQ(a.generation, b.generation);
    EXPECT_EQ(a.transaction, b.transaction) << "the transaction holding the pool";
    EXPECT_EQ(a.clients.size(), b.clients.size());
    ASSERT_EQ(a.chunks.size(), b.chunks.size());
    for (size_t i = 0; i < a.chunks.size(); ++i) {
      EXPECT_EQ(a.chunks[i].id, b.chunks[i].id);
      EXPECT_EQ(a.chunks[i].offset, b.chunks[i].offset);
      EXPECT_EQ(a.chunks[i].bytes, b.chunks[i].bytes);
    }
  }

  std::unique_ptr<FaultDevice> device_;
  std::unique_ptr<PoolManager> manager_;
  Caller alice_;
  std::string transaction_;  // what a setup prepared, for Commit
};

// Every failure injected, over all operations (the figure docs/reliability.md quotes).
int faults_injected = 0;

TEST_P(FaultSweepTest, EveryFailedBackendCallRollsBackAndThePoolIsUsableAfter) {
  const Operation& op = GetParam();
  int n = 1, partial = 0;
  for (;; ++n) {
    SCOPED_TRACE(absl::StrCat(op.name, ": fallible backend call #", n, " fails"));
    Start(op.budget_bytes);
    op.setup(*this);
    if (HasFatalFailure()) return;
    const Snapshot before = Take();
    const absl::Status injected = absl::ResourceExhaustedError(absl::StrCat("injected fault #", n));
    device_->FailNthCall(n, injected);
    const absl::Status status = op.run(*this);
    if (device_->fault_pending()) {
      // The operation made fewer than n fallible calls: the walk is over, and it must have succeeded.
      EXPECT_THAT(status, IsOk());
      Stop();
      break;
    }
    ++faults_injected;
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("injected fault")));
    if (op.in_steps && absl::StrContains(status.message(), "steps before it did stays done")) {
      ++partial;
      ExpectConsistent(before, Take());
    } else {
      ExpectSame(before, Take());
    }
    // Usable after: the same operation, with no fault, succeeds.
    EXPECT_THAT(op.run(*this), IsOk()) << "the operation again, without the fault";
    Stop();
    if (HasFailure()) return;
  }
  if (n == 1) {
    std::printf("[ sweep    ] %s: makes no fallible backend call\n", op.name.c_str());
  } else if (op.in_steps) {
    EXPECT_GT(partial, 0) << "some fault must have hit a step after the first";
    std::printf(
        "[ sweep    ] %s: %d fallible backend calls, each failed once: rolled back, or (%d) the steps "
        "before it kept\n",
        op.name.c_str(), n - 1, partial);
  } else {
    std::printf("[ sweep    ] %s: %d fallible backend calls, each failed once and rolled back\n", op.name.c_str(),
                n - 1);
  }
  ::testing::Test::RecordProperty("faults_injected", n - 1);
}

template <typename T>
absl::Status Ok(const absl::StatusOr<T>& s) {
  return s.status();
}

void CreateP(FaultSweepTest& t, uint64_t blocks) {
  ASSERT_THAT(t.manager_->CreatePool(t.alice_, Spec("p", blocks)), IsOk());
}

// An attached client with a watcher, so that grows and wakes also issue leases and events.
void CreateAndAttachP(FaultSweepTest& t, uint64_t blocks) {
  CreateP(t, blocks);
  absl::StatusOr<AttachResult> a = t.manager_->Attach(t.alice_, "p", "engine");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(t.manager_->Watch(t.alice_, a->client_id), IsOk());
}

std::vector<Operation> Operations() {
  return {Operation{"create", [](FaultSweepTest&) {},
                    [](FaultSweepTest& t) { return Ok(t.manager_->CreatePool(t.alice_, Spec("p", 200))); }},
          Operation{"grow", [](FaultSweepTest& t) { CreateAndAttachP(t, 1); },
                    [](FaultSweepTest& t) { return Ok(t.manager_->Grow(t.alice_, "p", 250)); }},
          Operation{"attach", [](FaultSweepTest& t) { CreateP(t, 200); },
                    [](FaultSweepTest& t) { return Ok(t.manager_->Attach(t.alice_, "p", "engine")); }},
          Operation{
              "shrink", [](FaultSweepTest& t) { CreateAndAttachP(t, 200); },
              [](FaultSweepTest& t) { return Ok(t.manager_->Shrink(t.alice_, "p", 40, {.whole_chunks_only = true})); }},
          // Exact: the chunk straddling 40 blocks is replaced (no client attached, so nobody pauses).
          Operation{"shrink_exact", [](FaultSweepTest& t) { CreateP(t, 200); },
                    [](FaultSweepTest& t) { return Ok(t.manager_->Shrink(t.alice_, "p", 40, false, absl::Now())); }},
          Operation{"compaction_shrink", [](FaultSweepTest& t) { CreateP(t, 200); },
                    [](FaultSweepTest& t) {
                      return Ok(t.manager_->Shrink(t.alice_, "p", 40,
                                                   {.live = std::optional<std::vector<uint64_t>>({3, 150, 199})}));
                    }},
          Operation{"compact",
                    [](FaultSweepTest& t) {
                      CreateP(t, 32);
                      for (uint64_t b = 64; b <= 192; b += 32) ASSERT_THAT(t.manager_->Grow(t.alice_, "p", b), IsOk());
                    },
                    [](FaultSweepTest& t) { return Ok(t.manager_->Compact(t.alice_, "p", {})); }},
          // In steps bounded by the free memory: 2 x 14 MiB under a 36 MiB budget, 8 MiB free, one segment's 8 MiB
          // replacement a step; the operation again finishes what a failed second step left (a tail).
          Operation{"shrink_exact_in_steps", [](FaultSweepTest& t) { CreateP(t, 224); },
                    [](FaultSweepTest& t) { return Ok(t.manager_->Shrink(t.alice_, "p", 112, false, absl::Now())); },
                    /*in_steps=*/true, /*budget_bytes=*/36 * kMiB},
          // 7 chunks of 2 MiB a segment under a 42 MiB budget: 14 MiB free, one segment's new chunk a step.
          Operation{"compact_in_steps",
                    [](FaultSweepTest& t) {
                      CreateP(t, 32);
                      for (uint64_t b = 64; b <= 224; b += 32) ASSERT_THAT(t.manager_->Grow(t.alice_, "p", b), IsOk());
                    },
                    [](FaultSweepTest& t) { return Ok(t.manager_->Compact(t.alice_, "p", {})); },
                    /*in_steps=*/true, /*budget_bytes=*/42 * kMiB},
          Operation{"sleep", [](FaultSweepTest& t) { CreateAndAttachP(t, 200); },
                    [](FaultSweepTest& t) {
                      return Ok(t.manager_->Sleep(t.alice_, "p", /*wait=*/false, absl::InfinitePast()));
                    }},
          Operation{"wake",
                    [](FaultSweepTest& t) {
                      CreateAndAttachP(t, 200);
                      ASSERT_THAT(t.manager_->Sleep(t.alice_, "p", false, absl::InfinitePast()), IsOk());
                    },
                    [](FaultSweepTest& t) { return Ok(t.manager_->Wake(t.alice_, "p")); }},
          Operation{"prepare_grow", [](FaultSweepTest& t) { CreateAndAttachP(t, 1); },
                    [](FaultSweepTest& t) {
                      return Ok(t.manager_->Prepare(t.alice_, "p", GroupOp::kGrow, 250, absl::Seconds(60)));
                    }},
          Operation{"prepare_wake",
                    [](FaultSweepTest& t) {
                      CreateAndAttachP(t, 200);
                      ASSERT_THAT(t.manager_->Sleep(t.alice_, "p", false, absl::InfinitePast()), IsOk());
                    },
                    [](FaultSweepTest& t) {
                      return Ok(t.manager_->Prepare(t.alice_, "p", GroupOp::kWake, 0, absl::Seconds(60)));
                    }},
          Operation{"commit_grow",
                    [](FaultSweepTest& t) {
                      CreateAndAttachP(t, 1);
                      absl::StatusOr<PreparedOp> prepared =
                          t.manager_->Prepare(t.alice_, "p", GroupOp::kGrow, 250, absl::Seconds(60));
                      ASSERT_THAT(prepared, IsOk());
                      t.transaction_ = prepared->transaction;
                    },
                    [](FaultSweepTest& t) {
                      absl::StatusOr<CommittedOp> committed =
                          t.manager_->Commit(t.alice_, t.transaction_, false, absl::InfinitePast());
                      if (committed.ok()) {
                        // Commit again must find nothing; prepare and commit once more so a retry succeeds.
                        absl::StatusOr<PreparedOp> again =
                            t.manager_->Prepare(t.alice_, "p", GroupOp::kShrink, 1, absl::Seconds(60));
                        if (again.ok()) t.transaction_ = again->transaction;
                      }
                      return Ok(committed);
                    }},
          Operation{"delete", [](FaultSweepTest& t) { CreateAndAttachP(t, 200); },
                    [](FaultSweepTest& t) { return Ok(t.manager_->DeletePool(t.alice_, "p", /*force=*/true)); }}};
}

std::string OperationName(const ::testing::TestParamInfo<Operation>& param) { return param.param.name; }

INSTANTIATE_TEST_SUITE_P(EveryOperation, FaultSweepTest, ::testing::ValuesIn(Operations()), OperationName);

// Prints the total once every instance ran (gtest runs the tests of one program in order).
class SweepTotal : public ::testing::Environment {
 public:
  void TearDown() override {
    if (faults_injected > 0) std::printf("[ sweep    ] %d faults injected in all\n", faults_injected);
  }
};
const ::testing::Environment* const kSweepTotal = ::testing::AddGlobalTestEnvironment(new SweepTotal);

}  // namespace
}  // namespace kvd::daemon
