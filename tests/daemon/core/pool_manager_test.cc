#include "daemon/core/pool_manager.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fault_device.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::FaultDevice;
using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr uint64_t kMiB = uint64_t{1} << 20;
// A whole-chunk shrink forced past clients that are not pausable (Note [Releases pause first]).
const PoolManager::ShrinkOptions kForced{.force = true};

// L=2, B=256, H=2, N=16, C=1024, bf16 under LBNHC: 2 segments, 64 KiB blocks, 16 MiB segments.
PoolSpec Spec(std::string name, uint64_t initial_blocks = 0) {
  return {
      .name = std::move(name),
      .dims =
          {.layers = 2, .capacity_blocks = 256, .heads = 2, .block_tokens = 16, .channels = 1024, .element_bytes = 2},
      .initial_blocks = initial_blocks};
}

class PoolManagerTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}); }

  void Start(ManagerOptions options) {
    manager_.reset();
    absl::StatusOr<std::unique_ptr<Device>> host =
        OpenDevice({.backend = "host", .host_capacity = 512 * kMiB, .host_granularity = 2 * kMiB});
    ASSERT_THAT(host, IsOk());
    device_ = std::make_unique<FaultDevice>(*std::move(host));
    if (options.budget_bytes == 0) options.budget_bytes = 256 * kMiB;
    options.daemon_uid = 4242;
    manager_ = std::make_unique<PoolManager>(device_.get(), options);
    alice_ = Session(1000, "alice");
  }
  void TearDown() override {
    manager_.reset();
    if (device_) {
      EXPECT_EQ(device_->live_chunks(), 0);
      EXPECT_EQ(device_->live_mappings(), 0);
      EXPECT_EQ(device_->live_reservations(), 0);
    }
  }

  Caller Session(uint32_t uid, std::string name) {
    const std::string token = *manager_->OpenSession(uid, 100 + uid, name);
    return *manager_->Authenticate(token);
  }

  uint64_t Committed() { return manager_->GetDeviceStatus()->committed_bytes; }

  // Maps every FD of `lease` where the pool's layout puts it, in a fresh reservation of this test, as
  // an engine would; returns the base. The FDs are closed right after mapping.
  uint64_t MapLease(const Caller& who, const PoolView& pool, const Lease& lease, uint64_t base = 0) {
    if (base == 0) {
      void* p = mmap(nullptr, pool.reserved_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      EXPECT_NE(p, MAP_FAILED);
      base = reinterpret_cast<uint64_t>(p);
      reservations_.push_back({base, pool.reserved_bytes});
    }
    absl::StatusOr<std::vector<PoolManager::LeasedFd>> fds = manager_->RedeemLease(who.session, lease.token, who.uid);
    EXPECT_THAT(fds, IsOk());
    if (!fds.ok()) return base;
    for (const PoolManager::LeasedFd& f : *fds) {
      auto chunk =
          std::find_if(pool.chunks.begin(), pool.chunks.end(), [&](const ChunkInfo& c) { return c.id == f.chunk_id; });
      EXPECT_NE(chunk, pool.chunks.end());
      void* at = mmap(reinterpret_cast<void*>(base + chunk->offset), chunk->bytes, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_FIXED, f.fd, 0);
      EXPECT_NE(at, MAP_FAILED);
      close(f.fd);
    }
    return base;
  }

 public:
  uint64_t MapLeasePublic(const Caller& who, const PoolView& pool, const Lease& lease) {
    return MapLease(who, pool, lease);
  }

 protected:
  void TearDownMappings() {
    for (auto [base, bytes] : reservations_) munmap(reinterpret_cast<void*>(base), bytes);
    reservations_.clear();
  }
  ~PoolManagerTest() override { TearDownMappings(); }

  std::unique_ptr<FaultDevice> device_;
  std::unique_ptr<PoolManager> manager_;
  Caller alice_;
  std::vector<std::pair<uint64_t, uint64_t>> reservations_;
};

TEST_F(PoolManagerTest, CreateCommitsOneChunkPerSegmentAndReportsWhatIsBacked) {
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, Spec("p", 40)));
  EXPECT_EQ(pool.geometry.layout().name(), "LBNHC");
  EXPECT_EQ(pool.geometry.segments(), 2u);
  EXPECT_EQ(pool.geometry.block_stride(), 64 * 1024u);
  // 40 blocks = 2.5 MiB per segment, committed as 4 MiB: 64 blocks are really backed.
  EXPECT_EQ(pool.committed_blocks, 64u);
  EXPECT_EQ(pool.committed_bytes, 8 * kMiB);
  ASSERT_THAT(pool.chunks, SizeIs(2));
  EXPECT_EQ(pool.chunks[0].offset, 0u);
  EXPECT_EQ(pool.chunks[1].offset, pool.geometry.segment_stride());
  EXPECT_EQ(pool.owner_uid, 1000u);
  EXPECT_EQ(Committed(), 8 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 2);
}

TEST_F(PoolManagerTest, GrowAddsChunksAfterThePrefixAndTwoClientsShareTheBytes) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 1)), IsOk());
  Caller bob = Session(1000, "bob");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult a, manager_->Attach(alice_, "p", "engine"));
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", "connector"));
  const uint64_t abase = MapLease(alice_, a.pool, a.lease);
  const uint64_t bbase = MapLease(bob, b.pool, b.lease);
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> bob_events, manager_->Watch(bob, b.client_id));

  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate grown, manager_->Grow(alice_, "p", 200));
  EXPECT_EQ(grown.pool.committed_blocks, 224u);  // 12.5 MiB per segment, committed as 14 MiB
  ASSERT_THAT(grown.added, SizeIs(2));           // one chunk per segment for the whole delta
  EXPECT_EQ(grown.added[0].offset, 2 * kMiB);
  ASSERT_TRUE(grown.lease.has_value()) << "alice's own client gets its lease in the reply";
  MapLease(alice_, grown.pool, *grown.lease, abase);

  std::optional<PoolEvent> e = bob_events->Pop(absl::Seconds(5));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->type, EventType::kChunksAdded);
  EXPECT_EQ(e->committed_blocks, 224u);
  ASSERT_TRUE(e->lease.has_value());
  MapLease(bob, grown.pool, *e->lease, bbase);

  // Alice writes block 150 of layer 1; Bob reads it where the geometry says, and vice versa.
  const uint64_t at = grown.pool.geometry.ByteOffset(1, 150, 1, 3, 7);
  std::memcpy(reinterpret_cast<void*>(abase + at), "kv!", 3);
  EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(bbase + at), "kv!", 3), 0);
  std::memcpy(reinterpret_cast<void*>(bbase), "b0", 2);
  EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(abase), "b0", 2), 0);
}

TEST_F(PoolManagerTest, GrowSplitsChunksOnlyPastTheMaximum) {
  ManagerOptions options;
  options.max_chunk_bytes = 4 * kMiB;
  Start(options);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p")), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate grown, manager_->Grow(alice_, "p", 160));  // 10 MiB per segment
  EXPECT_THAT(grown.added, SizeIs(6));
  for (const ChunkInfo& c : grown.added) EXPECT_LE(c.bytes, 4 * kMiB);
}

struct Fault {
  FaultDevice::Op op;
  int nth;
};
void PrintTo(const Fault& f, std::ostream* os) {
  static constexpr const char* kOps[] = {"Reserve",    "Create", "Map", "Export", "Info", "ExportFabricHandle",
                                         "ExportRange"};
  *os << kOps[static_cast<int>(f.op)] << f.nth;
}
class GrowRollbackTest : public PoolManagerTest, public ::testing::WithParamInterface<Fault> {};

TEST_P(GrowRollbackTest, AFailedGrowLeavesThePoolAndTheDeviceAsTheyWere) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 1)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  const int chunks = device_->live_chunks(), mappings = device_->live_mappings();
  const uint64_t committed = Committed();
  device_->FailNth(GetParam().op, GetParam().nth, absl::ResourceExhaustedError("injected: out of memory"));
  EXPECT_THAT(manager_->Grow(alice_, "p", 250),
              StatusIs(absl::StatusCode::kResourceExhausted, AllOf(HasSubstr("injected"), HasSubstr("needs"))));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(after.committed_blocks, before.committed_blocks);
  EXPECT_EQ(after.chunks.size(), before.chunks.size());
  EXPECT_EQ(after.generation, before.generation);
  EXPECT_EQ(device_->live_chunks(), chunks);
  EXPECT_EQ(device_->live_mappings(), mappings);
  EXPECT_EQ(Committed(), committed);
  // And the same grow works once the fault is gone.
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate grown, manager_->Grow(alice_, "p", 250));
  EXPECT_EQ(grown.pool.committed_blocks, 256u);
}

// A grow on host creates each chunk and nothing more: it maps none into the daemon's view (Note [The daemon maps on
// demand]) and exports none (the handle is the chunk's memfd: Note [FD hygiene]).
INSTANTIATE_TEST_SUITE_P(EveryStep, GrowRollbackTest,
                         ::testing::Values(Fault{FaultDevice::Op::kCreate, 1}, Fault{FaultDevice::Op::kCreate, 2}));

// A range export (CUDA's DMA-BUF over several chunks) is made of the daemon's view of the pool, which is mapped
// on demand (Note [The daemon maps on demand]): the redemption maps it first, and a map that fails refuses the
// redemption with the device's error naming the pool, mapping nothing.
TEST_F(PoolManagerTest, ARangeExportMapsTheDaemonsViewBeforeTheDeviceExportsIt) {
  manager_.reset();
  device_->PretendRangeExport();
  manager_ =
      std::make_unique<PoolManager>(device_.get(), ManagerOptions{.budget_bytes = 256 * kMiB, .daemon_uid = 4242});
  alice_ = Session(1000, "alice");
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 128), IsOk());  // two chunks a segment: each range spans both
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult a, manager_->Attach(alice_, "p", "connector"));
  ASSERT_EQ(device_->live_chunks(), 4);
  ASSERT_EQ(device_->live_mappings(), 0);
  KVD_ASSERT_OK_AND_ASSIGN(RangeExport whole, manager_->ExportRanges(alice_, a.client_id, {}));
  ASSERT_THAT(whole.handles, SizeIs(2));
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolManager::LeasedFd> fds,
                           manager_->RedeemLease(alice_.session, whole.lease.token, alice_.uid));
  EXPECT_THAT(fds, SizeIs(2));
  for (const PoolManager::LeasedFd& f : fds) close(f.fd);
  EXPECT_EQ(device_->live_mappings(), 4) << "the view was mapped for the export, and stays mapped";

  ASSERT_THAT(manager_->Grow(alice_, "p", 192), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(RangeExport grown, manager_->ExportRanges(alice_, a.client_id, {}));
  device_->FailNth(FaultDevice::Op::kMap, 2, absl::ResourceExhaustedError("injected: no page tables"));
  EXPECT_THAT(manager_->RedeemLease(alice_.session, grown.lease.token, alice_.uid),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("pool p: mapping its chunks into kvd's view"), HasSubstr("injected"))));
  EXPECT_EQ(device_->live_mappings(), 4) << "the grown chunks stay unmapped";
  EXPECT_THAT(manager_->Detach(alice_, a.client_id, /*released=*/true), IsOk());
}

TEST_F(PoolManagerTest, AGrowMapsNothingInTheDaemonUntilItTouchesTheBytes) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_GT(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);
  // A block operation touches the bytes through the daemon's view: the pool is mapped then, and stays so.
  ASSERT_THAT(manager_->ZeroBlocks(alice_, "p", {0, 1}), IsOk());
  EXPECT_EQ(device_->live_mappings(), device_->live_chunks());
  ASSERT_THAT(manager_->Grow(alice_, "p", 128), IsOk());
  EXPECT_LT(device_->live_mappings(), device_->live_chunks());
  ASSERT_THAT(manager_->ZeroBlocks(alice_, "p", {127}), IsOk());
  EXPECT_EQ(device_->live_mappings(), device_->live_chunks());
  // A map that fails answers the block operation with the device's error naming the pool, and maps nothing.
  ASSERT_THAT(manager_->Grow(alice_, "p", 192), IsOk());
  const int mapped = device_->live_mappings();
  device_->FailNth(FaultDevice::Op::kMap, 2, absl::InternalError("injected: map failed"));
  EXPECT_THAT(manager_->ZeroBlocks(alice_, "p", {0}),
              StatusIs(absl::StatusCode::kInternal, AllOf(HasSubstr("pool p"), HasSubstr("injected"))));
  EXPECT_EQ(device_->live_mappings(), mapped);
  ASSERT_THAT(manager_->Shrink(alice_, "p", 64, true, absl::Now() + absl::Seconds(5)), IsOk());
  EXPECT_LE(device_->live_mappings(), device_->live_chunks());
  ASSERT_THAT(manager_->DeletePool(alice_, "p", false), IsOk());
  EXPECT_EQ(device_->live_mappings(), 0);
  EXPECT_EQ(device_->live_chunks(), 0);
}

TEST_F(PoolManagerTest, TheBudgetIsNeverExceededAndTheErrorSaysAskedAndFree) {
  Start({.budget_bytes = 30 * kMiB});
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("a", 128)), IsOk());  // 16 MiB
  EXPECT_THAT(
      manager_->CreatePool(alice_, Spec("b", 256)),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("needs 33554432 bytes"), HasSubstr("only 14680064 bytes"), HasSubstr("budget"))));
  EXPECT_THAT(manager_->GetPool(alice_, "b"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("b")));
  EXPECT_EQ(Committed(), 16 * kMiB);
  EXPECT_THAT(manager_->Grow(alice_, "a", 256), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
  ASSERT_THAT(manager_->Grow(alice_, "a", 192), IsOk());
  EXPECT_EQ(Committed(), 24 * kMiB);
}

TEST_F(PoolManagerTest, ShrinkCompletesWhenEveryHolderAcknowledges) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 256)), IsOk());
  Caller bob = Session(1000, "bob");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", "connector"));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> events, manager_->Watch(bob, b.client_id));

  // An exact shrink would replace the straddling chunks, which needs the connector to pause.
  EXPECT_THAT(manager_->Shrink(alice_, "p", 64, false, absl::Now()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(b.client_id), HasSubstr("connector"), HasSubstr("AttachRequest.pausable"))));
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate shrunk,
                           manager_->Shrink(alice_, "p", 64, PoolManager::ShrinkOptions{.whole_chunks_only = true}));
  EXPECT_EQ(shrunk.pool.committed_blocks, 256u) << "one chunk per segment backs all 256 blocks: none is whole above 64";
  EXPECT_THAT(shrunk.released_chunk_ids, SizeIs(0));
  ASSERT_TRUE(shrunk.reshape.has_value());
  EXPECT_FALSE(shrunk.reshape->target_reached);

  // Commit in two steps so that there is a whole chunk above the target to release.
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("q", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "q", 256), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult bq, manager_->Attach(bob, "q", "connector"));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> qevents, manager_->Watch(bob, bq.client_id));
  const uint64_t before = Committed();
  // Forced past bob's client, which is not pausable (Note [Releases pause first]).
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate q, manager_->Shrink(alice_, "q", 64, kForced));
  EXPECT_EQ(q.pool.committed_blocks, 64u);
  EXPECT_THAT(q.released_chunk_ids, SizeIs(2));
  EXPECT_EQ(q.pool.pending_release_bytes, 24 * kMiB);
  ASSERT_NE(q.release_id, 0u);
  EXPECT_EQ(Committed(), before) << "pending bytes still count against the budget";

  std::optional<PoolEvent> e = qevents->Pop(absl::Seconds(5));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->type, EventType::kChunksReleased);
  EXPECT_EQ(e->release_id, q.release_id);
  EXPECT_THAT(manager_->Acknowledge(bob, bq.client_id, q.release_id + 7),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("release_id")));
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t pending, manager_->Acknowledge(bob, bq.client_id, q.release_id));
  EXPECT_EQ(pending, 0u);
  EXPECT_EQ(Committed(), before - 24 * kMiB);
  EXPECT_THAT(manager_->Acknowledge(bob, bq.client_id, q.release_id),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("release_id")));
  EXPECT_FALSE(events->Pop(absl::ZeroDuration()).has_value());
}

TEST_F(PoolManagerTest, ShrinkWithWaitReturnsOnceAcknowledged) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 256), IsOk());
  Caller bob = Session(1000, "bob");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", ""));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> events, manager_->Watch(bob, b.client_id));
  std::thread follower([&] {
    std::optional<PoolEvent> e = events->Pop(absl::Seconds(30));
    if (e && e->type == EventType::kChunksReleased)
      manager_->Acknowledge(bob, b.client_id, e->release_id).IgnoreError();
  });
  KVD_ASSERT_OK_AND_ASSIGN(
      PoolUpdate shrunk,
      manager_->Shrink(alice_, "p", 64, {.wait = true, .deadline = absl::Now() + absl::Seconds(30), .force = true}));
  follower.join();
  EXPECT_EQ(shrunk.pool.pending_release_bytes, 0u);
  EXPECT_EQ(Committed(), 8 * kMiB);
}

TEST_F(PoolManagerTest, ADeadClientsAcknowledgementsAreDropped) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 256), IsOk());
  Caller bob = Session(1000, "bob");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", ""));
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate q, manager_->Shrink(alice_, "p", 64, kForced));
  EXPECT_GT(q.pool.pending_release_bytes, 0u);
  manager_->CloseSession(bob.session);  // the handle channel saw bob's connection close
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(pool.pending_release_bytes, 0u);
  EXPECT_THAT(pool.clients, SizeIs(0));
  EXPECT_EQ(Committed(), 8 * kMiB);
  EXPECT_THAT(manager_->Watch(bob, b.client_id), StatusIs(absl::StatusCode::kNotFound, HasSubstr("client_id")));
  EXPECT_THAT(manager_->Authenticate(bob.session),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("kvd-session")));
}

TEST_F(PoolManagerTest, SleepReleasesEverythingAndWakeRecommitsOneChunkPerSegment) {
  ManagerOptions options;
  options.max_chunk_bytes = 64 * kMiB;
  Start(options);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 96), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 200), IsOk());
  Caller bob = Session(1000, "bob");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", ""));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> events, manager_->Watch(bob, b.client_id));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  EXPECT_THAT(before.chunks, SizeIs(6));

  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolUpdate> slept,
                           manager_->Sleep(alice_, "p", false, absl::Now(), {.force = true}));
  ASSERT_THAT(slept, SizeIs(1));
  EXPECT_EQ(slept[0].pool.state, PoolState::kSleeping);
  EXPECT_EQ(slept[0].pool.committed_blocks, 0u);
  EXPECT_EQ(slept[0].pool.wake_blocks, before.committed_blocks);
  EXPECT_EQ(device_->live_chunks(), 0);
  std::optional<PoolEvent> released = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(released.has_value());
  EXPECT_EQ(released->type, EventType::kChunksReleased);
  EXPECT_EQ(released->state, PoolState::kSleeping);
  ASSERT_THAT(manager_->Acknowledge(bob, b.client_id, released->release_id), IsOk());

  EXPECT_THAT(manager_->Grow(alice_, "p", 250), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("sleeping")));
  EXPECT_THAT(manager_->Sleep(alice_, "p", false, absl::Now()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already sleeping")));

  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolUpdate> woken, manager_->Wake(alice_, ""));
  ASSERT_THAT(woken, SizeIs(1));
  EXPECT_EQ(woken[0].pool.state, PoolState::kAwake);
  EXPECT_EQ(woken[0].pool.committed_blocks, before.committed_blocks);
  EXPECT_THAT(woken[0].pool.chunks, SizeIs(2)) << "defragmented: one chunk per segment";
  std::optional<PoolEvent> added = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(added.has_value());
  EXPECT_EQ(added->type, EventType::kChunksAdded);
  EXPECT_EQ(added->state, PoolState::kAwake);
  EXPECT_THAT(added->chunks, SizeIs(2));
  EXPECT_THAT(manager_->Wake(alice_, "p"), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already awake")));
}

TEST_F(PoolManagerTest, AWakeTheBudgetCannotHoldLeavesThePoolAsleepWithItsSize) {
  Start({.budget_bytes = 40 * kMiB});
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 256)), IsOk());  // 32 MiB
  ASSERT_THAT(manager_->Sleep(alice_, "p", false, absl::Now()), IsOk());
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("q", 128)), IsOk());  // 16 MiB: 24 left, wake needs 32
  EXPECT_THAT(manager_->Wake(alice_, "p"), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView p, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(p.state, PoolState::kSleeping);
  EXPECT_EQ(p.wake_blocks, 256u);
  EXPECT_EQ(p.committed_bytes, 0u);
  EXPECT_EQ(Committed(), 16 * kMiB);
  ASSERT_THAT(manager_->DeletePool(alice_, "q", false), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolUpdate> woken, manager_->Wake(alice_, "p"));
  EXPECT_EQ(woken[0].pool.committed_blocks, 256u);
}

TEST_F(PoolManagerTest, LeasesAreSingleUseBoundToTheirSessionAndUid) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  Caller eve = Session(1000, "eve");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult a, manager_->Attach(alice_, "p", ""));
  EXPECT_THAT(manager_->RedeemLease(alice_.session, a.lease.token, 1001),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("uid 1001")));
  EXPECT_THAT(manager_->RedeemLease(eve.session, a.lease.token, 1000),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("another session")));
  EXPECT_THAT(manager_->RedeemLease("s-nope", a.lease.token, 1000),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("session")));
  // Refused attempts do not spend the lease; its rightful holder redeems it once.
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolManager::LeasedFd> fds,
                           manager_->RedeemLease(alice_.session, a.lease.token, 1000));
  EXPECT_THAT(fds, SizeIs(2));
  for (const PoolManager::LeasedFd& f : fds) close(f.fd);
  EXPECT_THAT(manager_->RedeemLease(alice_.session, a.lease.token, 1000),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("lease_token")));

  Start({.lease_ttl = absl::ZeroDuration()});
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult late, manager_->Attach(alice_, "p", ""));
  absl::SleepFor(absl::Milliseconds(1));
  EXPECT_THAT(manager_->RedeemLease(alice_.session, late.lease.token, 1000),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("expired")));
}

TEST_F(PoolManagerTest, ALeaseForAReleasedChunkFails) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 256), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult a, manager_->Attach(alice_, "p", ""));
  ASSERT_THAT(manager_->Shrink(alice_, "p", 64, false, absl::Now()), IsOk());
  EXPECT_THAT(manager_->RedeemLease(alice_.session, a.lease.token, 1000),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("released after the lease")));
}

// FetchHandles.skip_released: the same lease yields the chunks still in the table, in the lease's order, and
// leaves out the ones the shrink released.
TEST_F(PoolManagerTest, ALeaseThatSkipsReleasedChunksYieldsTheOnesStillInThePool) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 256), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult a, manager_->Attach(alice_, "p", ""));
  ASSERT_EQ(a.lease.chunk_ids.size(), 4u);  // two a segment
  ASSERT_THAT(manager_->Shrink(alice_, "p", 64, false, absl::Now()), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView p, manager_->GetPool(alice_, "p"));
  std::vector<uint64_t> live;
  for (const ChunkInfo& c : p.chunks) live.push_back(c.id);
  ASSERT_EQ(live.size(), 2u);
  std::vector<uint64_t> leased_live;
  for (uint64_t id : a.lease.chunk_ids) {
    if (std::find(live.begin(), live.end(), id) != live.end()) leased_live.push_back(id);
  }
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolManager::LeasedFd> fds,
                           manager_->RedeemLease(alice_.session, a.lease.token, 1000, /*skip_released=*/true));
  std::vector<uint64_t> yielded;
  for (const PoolManager::LeasedFd& f : fds) {
    yielded.push_back(f.chunk_id);
    EXPECT_GE(fcntl(f.fd, F_GETFD), 0);
    close(f.fd);
  }
  EXPECT_EQ(yielded, leased_live);
  EXPECT_THAT(manager_->RedeemLease(alice_.session, a.lease.token, 1000, /*skip_released=*/true),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("lease_token")));  // single use, as always
}

TEST_F(PoolManagerTest, OnlyTheOwnerAllowedUidsRootAndTheDaemonUserSeeAPool) {
  PoolSpec spec = Spec("p", 1);
  spec.allowed_uids = {2000};
  ASSERT_THAT(manager_->CreatePool(alice_, spec), IsOk());
  Caller mallory = Session(3000, "mallory");
  // To anyone else the pool is exactly as missing as one that does not exist.
  const absl::Status missing = manager_->GetPool(mallory, "q").status();
  EXPECT_THAT(missing, StatusIs(absl::StatusCode::kNotFound, HasSubstr("pool q does not exist")));
  for (const absl::Status& s : {manager_->GetPool(mallory, "p").status(), manager_->Grow(mallory, "p", 10).status(),
                                manager_->Attach(mallory, "p", "").status()}) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, "pool p does not exist"));
  }
  EXPECT_THAT(manager_->ListPools(mallory), SizeIs(0));
  for (uint32_t uid : {2000u, 0u, 4242u}) {
    Caller ok = Session(uid, "ok");
    EXPECT_THAT(manager_->GetPool(ok, "p"), IsOk()) << uid;
    EXPECT_THAT(manager_->ListPools(ok), SizeIs(1)) << uid;
  }
}

TEST_F(PoolManagerTest, MalformedRequestsNameTheirFieldAndChangeNothing) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  EXPECT_THAT(manager_->CreatePool(alice_, Spec("p")), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("name")));
  EXPECT_THAT(manager_->CreatePool(alice_, Spec("bad name")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name:")));
  EXPECT_THAT(manager_->CreatePool(alice_, Spec("big", 257)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("initial_blocks")));
  EXPECT_THAT(manager_->Grow(alice_, "p", 257),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_blocks")));
  EXPECT_THAT(manager_->Grow(alice_, "p", 10),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_blocks")));
  EXPECT_THAT(manager_->Shrink(alice_, "p", 64, false, absl::Now()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_blocks")));
  EXPECT_THAT(manager_->Grow(alice_, "nope", 10), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(manager_->Attach(alice_, "p", "bad/name"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("client_name")));
  EXPECT_THAT(manager_->Detach(alice_, "c-nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("client_id")));
  EXPECT_THAT(manager_->ZeroBlocks(alice_, "p", {64}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block_ids[0]")));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(pool.committed_blocks, 64u);
  EXPECT_EQ(pool.generation, 1u);
}

TEST_F(PoolManagerTest, QuickReadsDoNotWaitForAGrowInsideTheDevice) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  absl::Notification entered, release;
  device_->HoldCreates(&entered, &release);
  std::thread grow([&] { EXPECT_THAT(manager_->Grow(alice_, "p", 128), IsOk()); });
  entered.WaitForNotification();  // the grow holds the pool's op_mu, inside the device's Create
  // What the quick RPCs call (Note [Quick RPCs answer inline]): none may wait for that grow.
  absl::Notification read;
  std::thread reads([&] {
    EXPECT_THAT(manager_->GetPool(alice_, "p"), IsOk());
    EXPECT_THAT(manager_->ListPools(alice_, "", 10).pools, SizeIs(1));
    EXPECT_THAT(manager_->GetPoolMetadata(alice_, "p"), IsOk());
    EXPECT_THAT(manager_->DescribeTransfer(alice_, "p", {}), IsOk());
    EXPECT_THAT(manager_->ReportUsage(alice_, "p", {.used_blocks = 32}), IsOk());
    EXPECT_THAT(manager_->GetDeviceStatus(), IsOk());
    EXPECT_THAT(manager_->ResolveLayout({}), IsOk());
    read.Notify();
  });
  // A read that waited for the grow would never finish: the grow is held until the reads are done.
  EXPECT_TRUE(read.WaitForNotificationWithTimeout(absl::Seconds(60))) << "a quick read waited for the grow";
  device_->HoldCreates(nullptr, nullptr);
  release.Notify();
  grow.join();
  reads.join();
  EXPECT_GE(manager_->GetPool(alice_, "p")->committed_blocks, 128u);
}

TEST_F(PoolManagerTest, TryAttachDoesNothingWhileAGrowHoldsThePoolAndAttachWaitsForIt) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  std::optional<absl::StatusOr<AttachResult>> before = manager_->TryAttach(alice_, "p", "early", {}, false);
  ASSERT_TRUE(before.has_value());  // nothing holds the pool: attached at once
  ASSERT_THAT(*before, IsOk());
  absl::Notification entered, release;
  device_->HoldCreates(&entered, &release);
  std::thread grow([&] { EXPECT_THAT(manager_->Grow(alice_, "p", 128), IsOk()); });
  entered.WaitForNotification();  // the grow holds the pool's op_mu, inside the device's Create
  // Note [Attach answers inline when it can]: the try returns at once, having attached nobody.
  EXPECT_FALSE(manager_->TryAttach(alice_, "p", "late", {}, false).has_value());
  EXPECT_THAT(manager_->GetPool(alice_, "p")->clients, SizeIs(1));
  // Refusals that need no hold of the pool are answered as from Attach.
  std::optional<absl::StatusOr<AttachResult>> refused = manager_->TryAttach(alice_, "nope", "late", {}, false);
  ASSERT_TRUE(refused.has_value());
  EXPECT_THAT(*refused, StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  refused = manager_->TryAttach(alice_, "p", "bad/name", {}, false);
  ASSERT_TRUE(refused.has_value());
  EXPECT_THAT(*refused, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("client_name")));
  // Attach waits for the grow and is handed the grown pool.
  absl::Notification attached;
  absl::StatusOr<AttachResult> late = absl::UnknownError("not run");
  std::thread attach([&] {
    late = manager_->Attach(alice_, "p", "late");
    attached.Notify();
  });
  EXPECT_FALSE(attached.WaitForNotificationWithTimeout(absl::Milliseconds(100)));  // the grow is still held
  device_->HoldCreates(nullptr, nullptr);
  release.Notify();
  grow.join();
  attach.join();
  ASSERT_THAT(late, IsOk());
  EXPECT_EQ(late->pool.committed_blocks, 128u);
  EXPECT_THAT(manager_->GetPool(alice_, "p")->clients, SizeIs(2));
}

TEST_F(PoolManagerTest, DeleteRefusesWhileAttachedUnlessForcedAndFreesEverything) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult a, manager_->Attach(alice_, "p", ""));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> events, manager_->Watch(alice_, a.client_id));
  EXPECT_THAT(manager_->DeletePool(alice_, "p", false),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("1 attached clients")));
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t released, manager_->DeletePool(alice_, "p", true));
  EXPECT_EQ(released, 8 * kMiB);
  std::optional<PoolEvent> e = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->type, EventType::kPoolDeleted);
  EXPECT_FALSE(events->Pop(absl::ZeroDuration()).has_value());
  EXPECT_TRUE(events->closed());
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_reservations(), 0);
  EXPECT_EQ(Committed(), 0u);
}

TEST_F(PoolManagerTest, ShutdownTellsWatchersAndReleasesAllMemory) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("a", 64)), IsOk());
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("b", 64)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult a, manager_->Attach(alice_, "a", ""));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> events, manager_->Watch(alice_, a.client_id));
  manager_->Shutdown();
  std::optional<PoolEvent> e = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->type, EventType::kDaemonStopping);
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);
  EXPECT_EQ(device_->live_reservations(), 0);
  EXPECT_THAT(manager_->CreatePool(alice_, Spec("c", 1)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting down")));
}

TEST_F(PoolManagerTest, ConcurrentRequestsKeepTheAccountsStraight) {
  ManagerOptions options;
  options.budget_bytes = 200 * kMiB;
  Start(options);
  for (const char* name : {"a", "b", "c"}) ASSERT_THAT(manager_->CreatePool(alice_, Spec(name, 32)), IsOk());
  std::vector<std::thread> threads;
  std::atomic<int> exhausted = 0;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      const std::string name(1, static_cast<char>('a' + t % 3));
      for (int i = 0; i < 20; ++i) {
        absl::StatusOr<PoolUpdate> g = manager_->Grow(alice_, name, 64 + 32 * (i % 6));
        if (absl::IsResourceExhausted(g.status())) ++exhausted;
        manager_->Shrink(alice_, name, 32, false, absl::Now()).IgnoreError();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  uint64_t sum = 0;
  for (const PoolView& p : manager_->ListPools(alice_)) {
    sum += p.committed_bytes + p.pending_release_bytes;
    uint64_t chunk_bytes = 0;
    for (const ChunkInfo& c : p.chunks) chunk_bytes += c.bytes;
    EXPECT_EQ(chunk_bytes, p.committed_bytes) << p.name;
  }
  EXPECT_EQ(Committed(), sum);
  EXPECT_LE(Committed(), 200 * kMiB);
  EXPECT_LE(device_->live_mappings(), device_->live_chunks());
}

// ---------------------------------------------------------------------------------------------
// Engine groups: prepare, commit, abort

TEST_F(PoolManagerTest, APreparedGrowIsInvisibleUntilCommitAndHoldsThePool) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 1)), IsOk());
  Caller bob = Session(1000, "bob");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", ""));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> events, manager_->Watch(bob, b.client_id));
  const uint64_t before = Committed();

  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp prepared, manager_->Prepare(alice_, "p", GroupOp::kGrow, 128, absl::Seconds(30)));
  EXPECT_EQ(prepared.prepared_bytes, 12 * kMiB);  // 2 segments from 2 MiB to 8 MiB
  EXPECT_EQ(prepared.pool.transaction, prepared.transaction);
  EXPECT_EQ(prepared.pool.committed_blocks, 32u);
  EXPECT_EQ(Committed(), before + 12 * kMiB);  // counted against the budget at once
  EXPECT_FALSE(events->Pop(absl::ZeroDuration()).has_value());
  // Held: every other resize and a plain delete wait for the transaction.
  EXPECT_THAT(manager_->Grow(alice_, "p", 200), StatusIs(absl::StatusCode::kAborted, HasSubstr(prepared.transaction)));
  EXPECT_THAT(manager_->Shrink(alice_, "p", 0, false, absl::Now()), StatusIs(absl::StatusCode::kAborted, ::testing::_));
  EXPECT_THAT(manager_->Sleep(alice_, "p", false, absl::Now()), StatusIs(absl::StatusCode::kAborted, ::testing::_));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kShrink, 0, absl::Seconds(30)),
              StatusIs(absl::StatusCode::kAborted, ::testing::_));
  EXPECT_THAT(manager_->DeletePool(alice_, "p", false), StatusIs(absl::StatusCode::kAborted, ::testing::_));

  KVD_ASSERT_OK_AND_ASSIGN(CommittedOp committed, manager_->Commit(alice_, prepared.transaction, false, absl::Now()));
  EXPECT_EQ(committed.op, GroupOp::kGrow);
  EXPECT_EQ(committed.update.pool.committed_blocks, 128u);
  EXPECT_THAT(committed.update.added, SizeIs(2));
  EXPECT_TRUE(committed.update.pool.transaction.empty());
  EXPECT_EQ(Committed(), before + 12 * kMiB);
  std::optional<PoolEvent> added = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(added.has_value());
  EXPECT_EQ(added->type, EventType::kChunksAdded);
  EXPECT_EQ(added->committed_blocks, 128u);
  // Ended: a second commit or an abort finds nothing.
  EXPECT_THAT(manager_->Commit(alice_, prepared.transaction, false, absl::Now()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("transaction")));
  EXPECT_THAT(manager_->Abort(alice_, prepared.transaction), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(PoolManagerTest, AbortGivesThePreparedMemoryBackAndLeavesThePoolAsItWas) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 1)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  const uint64_t committed = Committed();
  const int chunks = device_->live_chunks();
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp prepared, manager_->Prepare(alice_, "p", GroupOp::kGrow, 256, absl::Seconds(30)));
  EXPECT_GT(device_->live_chunks(), chunks);
  EXPECT_THAT(manager_->Abort(alice_, prepared.transaction), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(after.committed_blocks, before.committed_blocks);
  EXPECT_EQ(after.generation, before.generation);
  EXPECT_TRUE(after.transaction.empty());
  EXPECT_EQ(Committed(), committed);
  EXPECT_EQ(device_->live_chunks(), chunks);
  EXPECT_THAT(manager_->Grow(alice_, "p", 256), IsOk());  // no longer held
}

TEST_F(PoolManagerTest, AFailedPrepareLeavesNothingPreparedOrHeld) {
  Start({.budget_bytes = 20 * kMiB});
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 1)), IsOk());
  const uint64_t committed = Committed();
  const int chunks = device_->live_chunks();
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kGrow, 256, absl::Seconds(30)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("budget")));
  device_->FailNth(FaultDevice::Op::kCreate, 2, absl::ResourceExhaustedError("injected: out of memory"));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kGrow, 64, absl::Seconds(30)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("injected")));
  EXPECT_EQ(Committed(), committed);
  EXPECT_EQ(device_->live_chunks(), chunks);
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  EXPECT_TRUE(pool.transaction.empty());
  EXPECT_THAT(manager_->Grow(alice_, "p", 64), IsOk());
}

TEST_F(PoolManagerTest, AWakeThatCannotBePreparedLeavesThePoolAsleepWithItsSize) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 96)), IsOk());
  ASSERT_THAT(manager_->Sleep(alice_, "p", true, absl::Now()), IsOk());
  device_->FailNth(FaultDevice::Op::kCreate, 2, absl::InternalError("injected: create failed"));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kWake, 0, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("injected")));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(pool.state, PoolState::kSleeping);
  EXPECT_EQ(pool.wake_blocks, 96u);
  EXPECT_TRUE(pool.transaction.empty());
  EXPECT_EQ(Committed(), 0u);
  EXPECT_EQ(device_->live_chunks(), 0);
  // The same wake works once the fault is gone.
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp wake, manager_->Prepare(alice_, "p", GroupOp::kWake, 0, absl::Minutes(1)));
  KVD_ASSERT_OK_AND_ASSIGN(CommittedOp woken, manager_->Commit(alice_, wake.transaction, false, absl::Now()));
  EXPECT_EQ(woken.update.pool.committed_blocks, 96u);
}

TEST_F(PoolManagerTest, ShutdownWithAPreparedTransactionReleasesItsMemory) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 1)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp prepared, manager_->Prepare(alice_, "p", GroupOp::kGrow, 200, absl::Minutes(10)));
  EXPECT_GT(device_->live_chunks(), 2);
  manager_->Shutdown();
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);
  EXPECT_EQ(device_->live_reservations(), 0);
  EXPECT_THAT(manager_->Commit(alice_, prepared.transaction, false, absl::Now()),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kGrow, 8, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(PoolManagerTest, TheDaemonAbortsATransactionWhoseTtlPasses) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 1)), IsOk());
  const uint64_t committed = Committed();
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp prepared,
                           manager_->Prepare(alice_, "p", GroupOp::kGrow, 128, absl::Milliseconds(50)));
  // The reaper gives the memory back without anyone touching the pool (bounded wait, no timing asserted).
  for (int i = 0; i < 1000 && Committed() != committed; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(Committed(), committed);
  EXPECT_THAT(manager_->Commit(alice_, prepared.transaction, false, absl::Now()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not committed within its ttl")));
  EXPECT_THAT(manager_->Grow(alice_, "p", 128), IsOk());
}

TEST_F(PoolManagerTest, ClosingThePreparingSessionAbortsItsTransactions) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("a", 1)), IsOk());
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("b", 1)), IsOk());
  const uint64_t committed = Committed();
  Caller coordinator = Session(1000, "kvctl");
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp a, manager_->Prepare(coordinator, "a", GroupOp::kGrow, 64, absl::Minutes(5)));
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp b, manager_->Prepare(coordinator, "b", GroupOp::kSleep, 0, absl::Minutes(5)));
  manager_->CloseSession(coordinator.session);
  EXPECT_EQ(Committed(), committed);
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pb, manager_->GetPool(alice_, "b"));
  EXPECT_EQ(pb.state, PoolState::kAwake);
  EXPECT_TRUE(pb.transaction.empty());
  EXPECT_THAT(manager_->Commit(alice_, a.transaction, false, absl::Now()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("session closed")));
}

TEST_F(PoolManagerTest, OnlyThePreparingSessionCommitsOrAborts) {
  PoolSpec spec = Spec("p", 1);
  spec.allowed_uids = {2000};
  ASSERT_THAT(manager_->CreatePool(alice_, spec), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp prepared, manager_->Prepare(alice_, "p", GroupOp::kGrow, 64, absl::Seconds(30)));
  Caller bob = Session(2000, "bob");
  EXPECT_THAT(manager_->Commit(bob, prepared.transaction, false, absl::Now()),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("another session")));
  EXPECT_THAT(manager_->Abort(bob, prepared.transaction), StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  EXPECT_THAT(manager_->Commit(alice_, prepared.transaction, false, absl::Now()), IsOk());
}

TEST_F(PoolManagerTest, ShrinkSleepAndWakeGoThroughPrepareAndCommit) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 128), IsOk());  // chunks past block 32 that a shrink can release
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp shrink, manager_->Prepare(alice_, "p", GroupOp::kShrink, 32, absl::Minutes(1)));
  EXPECT_EQ(shrink.prepared_bytes, 0u);
  KVD_ASSERT_OK_AND_ASSIGN(PoolView held, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(held.committed_blocks, 128u);  // nothing released before Commit
  KVD_ASSERT_OK_AND_ASSIGN(CommittedOp shrunk, manager_->Commit(alice_, shrink.transaction, true, absl::Now()));
  EXPECT_EQ(shrunk.update.pool.committed_blocks, 32u);

  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp sleep, manager_->Prepare(alice_, "p", GroupOp::kSleep, 0, absl::Minutes(1)));
  KVD_ASSERT_OK_AND_ASSIGN(CommittedOp slept, manager_->Commit(alice_, sleep.transaction, true, absl::Now()));
  EXPECT_EQ(slept.update.pool.state, PoolState::kSleeping);
  EXPECT_EQ(slept.update.pool.wake_blocks, 32u);
  EXPECT_EQ(device_->live_chunks(), 0);

  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp wake, manager_->Prepare(alice_, "p", GroupOp::kWake, 0, absl::Minutes(1)));
  EXPECT_EQ(wake.prepared_bytes, 4 * kMiB);
  EXPECT_EQ(wake.pool.state, PoolState::kSleeping);
  KVD_ASSERT_OK_AND_ASSIGN(CommittedOp woken, manager_->Commit(alice_, wake.transaction, false, absl::Now()));
  EXPECT_EQ(woken.update.pool.state, PoolState::kAwake);
  EXPECT_EQ(woken.update.pool.committed_blocks, 32u);
  EXPECT_EQ(woken.update.pool.wake_blocks, 0u);
}

TEST_F(PoolManagerTest, PrepareRefusesWhatTheOperationCannotDo) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kSleep, 5, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_blocks")));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kGrow, 32, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_blocks")));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kGrow, 257, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kShrink, 32, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_blocks")));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kWake, 0, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already awake")));
  EXPECT_THAT(manager_->Prepare(alice_, "nope", GroupOp::kSleep, 0, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(manager_->Commit(alice_, "t-nope", false, absl::Now()),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  EXPECT_TRUE(pool.transaction.empty());
}

TEST_F(PoolManagerTest, AForcedDeleteEndsThePreparedTransaction) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 1)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp prepared, manager_->Prepare(alice_, "p", GroupOp::kGrow, 200, absl::Minutes(1)));
  EXPECT_THAT(manager_->DeletePool(alice_, "p", true), IsOk());
  EXPECT_EQ(Committed(), 0u);
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_THAT(manager_->Commit(alice_, prepared.transaction, false, absl::Now()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("aborted by the daemon: its pool was deleted")));
}

TEST_F(PoolManagerTest, GroupRanksAreUniqueAndAgreeOnTheSizePerDaemon) {
  PoolSpec r0 = Spec("llama-r0");
  r0.group = {.name = "llama", .rank = 0, .size = 2};
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, r0));
  EXPECT_EQ(pool.group, r0.group);
  PoolSpec again = Spec("llama-again");
  again.group = r0.group;
  EXPECT_THAT(manager_->CreatePool(alice_, again),
              StatusIs(absl::StatusCode::kAlreadyExists, AllOf(HasSubstr("group.rank"), HasSubstr("llama-r0"))));
  again.group = {.name = "llama", .rank = 1, .size = 4};
  EXPECT_THAT(manager_->CreatePool(alice_, again),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group.size")));
  again.group = {.name = "llama", .rank = 2, .size = 2};
  EXPECT_THAT(manager_->CreatePool(alice_, again),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group.rank")));
  again.group = {.name = "", .rank = 1, .size = 2};
  EXPECT_THAT(manager_->CreatePool(alice_, again),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group.name")));
  again.group = {.name = "bad name", .rank = 0, .size = 1};
  EXPECT_THAT(manager_->CreatePool(alice_, again),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group.name")));
}

TEST_F(PoolManagerTest, AClientOnAnotherDeviceAttachesOnlyWhereGranted) {
  PoolSpec spec = Spec("p", 1);
  ASSERT_THAT(manager_->CreatePool(alice_, spec), IsOk());
  const std::string own = manager_->GetDeviceStatus()->info.uuid;
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult same, manager_->Attach(alice_, "p", "local", own));
  // Attach's pool counts its clients; GetPool lists them.
  EXPECT_TRUE(same.pool.clients.empty());
  EXPECT_EQ(same.pool.client_count, 1u);
  KVD_ASSERT_OK_AND_ASSIGN(PoolView listed, manager_->GetPool(alice_, "p"));
  ASSERT_EQ(listed.clients.size(), 1u);
  EXPECT_TRUE(listed.clients[0].device_uuid.empty());
  EXPECT_THAT(manager_->Attach(alice_, "p", "peer", "GPU-peer-1"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       AllOf(HasSubstr("device_uuid"), HasSubstr("GPU-peer-1"), HasSubstr("kvctl grant"))));
  EXPECT_THAT(manager_->Attach(alice_, "p", "peer", "GPU/../x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device_uuid")));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView granted, manager_->GrantPeerAccess(alice_, "p", "GPU-peer-1", false));
  EXPECT_THAT(granted.peer_devices, ::testing::ElementsAre("GPU-peer-1"));
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult peer, manager_->Attach(alice_, "p", "peer", "GPU-peer-1"));
  EXPECT_THAT(manager_->Attach(alice_, "p", "other", "GPU-peer-2"),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  ASSERT_THAT(manager_->GrantPeerAccess(alice_, "p", "*", false), IsOk());
  EXPECT_THAT(manager_->Attach(alice_, "p", "other", "GPU-peer-2"), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView revoked, manager_->GrantPeerAccess(alice_, "p", "GPU-peer-1", true));
  EXPECT_THAT(revoked.peer_devices, ::testing::ElementsAre("*"));
  EXPECT_THAT(manager_->GrantPeerAccess(alice_, "p", "GPU-peer-1", true),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(manager_->GrantPeerAccess(alice_, "p", "", false),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  const auto peer_client = std::find_if(revoked.clients.begin(), revoked.clients.end(),
                                        [&](const ClientView& c) { return c.id == peer.client_id; });
  ASSERT_NE(peer_client, revoked.clients.end());
  EXPECT_EQ(peer_client->device_uuid, "GPU-peer-1");  // keeps its mapping after the revoke
}

TEST_F(PoolManagerTest, ConcurrentTransactionsOnManyPoolsKeepTheAccountsStraight) {
  constexpr int kPools = 6;
  for (int i = 0; i < kPools; ++i) ASSERT_THAT(manager_->CreatePool(alice_, Spec(absl::StrCat("p", i), 1)), IsOk());
  std::vector<std::thread> threads;
  for (int i = 0; i < kPools; ++i) {
    threads.emplace_back([&, i] {
      Caller me = Session(1000, absl::StrCat("t", i));
      const std::string name = absl::StrCat("p", i);
      for (int round = 0; round < 20; ++round) {
        absl::StatusOr<PreparedOp> p = manager_->Prepare(me, name, GroupOp::kGrow, 64, absl::Minutes(1));
        if (!p.ok()) continue;  // the budget is shared: some prepares fail, which is the point
        if (round % 2 == 0) {
          EXPECT_THAT(manager_->Abort(me, p->transaction), IsOk());
        } else {
          EXPECT_THAT(manager_->Commit(me, p->transaction, false, absl::Now()), IsOk());
          absl::StatusOr<PreparedOp> s = manager_->Prepare(me, name, GroupOp::kShrink, 0, absl::Minutes(1));
          EXPECT_THAT(s, IsOk());
          if (s.ok()) {
            EXPECT_THAT(manager_->Commit(me, s->transaction, true, absl::Now()), IsOk());
          }
        }
      }
      manager_->CloseSession(me.session);
    });
  }
  for (std::thread& t : threads) t.join();
  uint64_t sum = 0;
  for (const PoolView& p : manager_->ListPools(alice_)) sum += p.committed_bytes + p.pending_release_bytes;
  EXPECT_EQ(Committed(), sum);
}

// Where the device delivers fabric handles, every chunk carries its bytes from creation on (in the
// Attach view and the grow's added chunks), and the status advertises it; elsewhere nothing does.
TEST_F(PoolManagerTest, FabricHandlesTravelWithChunksOnlyWhereTheDeviceHasThem) {
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus plain, manager_->GetDeviceStatus());
  EXPECT_FALSE(plain.capabilities.fabric.supported);
  // The manager reads the capabilities when it starts: a new one over the device, now claiming fabric.
  manager_.reset();
  device_->PretendFabric();
  manager_ =
      std::make_unique<PoolManager>(device_.get(), ManagerOptions{.budget_bytes = 256 * kMiB, .daemon_uid = 4242});
  alice_ = Session(1000, "alice");
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus status, manager_->GetDeviceStatus());
  EXPECT_TRUE(status.capabilities.fabric.supported);
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, Spec("kv", 64)));
  ASSERT_FALSE(pool.chunks.empty());
  for (const ChunkInfo& c : pool.chunks) {
    ASSERT_NE(c.fabric_handle, nullptr);
    EXPECT_EQ(c.fabric_handle->size(), 64u);
    EXPECT_EQ(c.fabric_handle->rfind("fabric-", 0), 0u);
  }
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate grown, manager_->Grow(alice_, "kv", 256));
  ASSERT_FALSE(grown.added.empty());
  for (const ChunkInfo& c : grown.added) EXPECT_EQ(c.fabric_handle != nullptr ? c.fabric_handle->size() : 0u, 64u);
}

// ---------------------------------------------------------------------------------------------
// Reshaping: exact shrink, compact, compaction shrink and the pause (Note [Chunks are replaced, not cut])

// An engine of the test: a mapping of one pool in this process that follows PAUSE and RESUME as the
// client libraries do (import at PAUSE, remap at RESUME, acknowledge both).
class PausingEngine {
 public:
  PausingEngine(PoolManagerTest* test, PoolManager* manager, Caller who, const std::string& pool, bool pausable)
      : manager_(manager), who_(std::move(who)) {
    absl::StatusOr<AttachResult> a = manager_->Attach(who_, pool, "engine", {}, pausable);
    EXPECT_THAT(a, IsOk());
    attached_ = *a;
    base_ = test->MapLeasePublic(who_, attached_.pool, attached_.lease);
    events_ = *manager_->Watch(who_, attached_.client_id);
  }
  uint8_t* at(uint64_t offset) const { return reinterpret_cast<uint8_t*>(base_ + offset); }
  const std::string& id() const { return attached_.client_id; }
  EventQueue& events() { return *events_; }

  // Handles the next PAUSE (after any CHUNKS_ADDED, which this engine does not map) and its RESUME;
  // returns the RESUME (nullopt when no PAUSE came within `wait`).
  std::optional<PoolEvent> FollowPause(absl::Duration wait = absl::Seconds(10)) {
    std::optional<PoolEvent> pause = events_->Pop(wait);
    while (pause.has_value() && (pause->type == EventType::kChunksAdded || pause->type == EventType::kChunksReleased)) {
      if (pause->type == EventType::kChunksReleased) {
        // A plain release (whole chunks an exact shrink in steps gives back first): unmap and acknowledge.
        released_events_.push_back(*pause);
        for (const ChunkInfo& c : pause->chunks) {
          mmap(at(c.offset), c.bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        }
        if (pause->release_id != 0) {
          EXPECT_THAT(manager_->Acknowledge(who_, id(), pause->release_id), IsOk());
        }
      }
      pause = events_->Pop(wait);
    }
    if (!pause.has_value() || pause->type != EventType::kPause) return std::nullopt;
    last_pause_ = *pause;
    // A release's pause brings no new chunks, and no lease.
    absl::StatusOr<std::vector<PoolManager::LeasedFd>> fds = std::vector<PoolManager::LeasedFd>{};
    if (pause->lease.has_value()) fds = manager_->RedeemLease(who_.session, pause->lease->token, who_.uid);
    EXPECT_THAT(fds, IsOk());
    EXPECT_THAT(manager_->AcknowledgePause(who_, id(), pause->pause_id), IsOk());
    std::optional<PoolEvent> resume = events_->Pop(absl::Seconds(10));
    EXPECT_TRUE(resume.has_value() && resume->type == EventType::kResume && resume->pause_id == pause->pause_id);
    if (resume.has_value() && resume->applied) {
      for (const ChunkInfo& c : resume->chunks) {
        mmap(at(c.offset), c.bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      }
      for (const PoolManager::LeasedFd& f : *fds) {
        auto c = std::find_if(pause->chunks.begin(), pause->chunks.end(),
                              [&](const ChunkInfo& x) { return x.id == f.chunk_id; });
        EXPECT_NE(mmap(at(c->offset), c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, f.fd, 0), MAP_FAILED);
      }
      if (resume->release_id != 0) {
        EXPECT_THAT(manager_->Acknowledge(who_, id(), resume->release_id), IsOk());
      }
    }
    for (const PoolManager::LeasedFd& f : *fds) close(f.fd);
    return resume;
  }
  // Follows every pause until `done` (the call that pauses returned).
  void FollowUntil(const std::atomic<bool>& done) {
    while (!done) FollowPause(absl::Milliseconds(20));
  }
  // The plain releases FollowPause acknowledged on the way.
  const std::vector<PoolEvent>& released_events() const { return released_events_; }

  // The PAUSE FollowPause handled last.
  const PoolEvent& last_pause() const { return last_pause_; }

 private:
  PoolEvent last_pause_;
  std::vector<PoolEvent> released_events_;
  PoolManager* manager_;
  Caller who_;
  AttachResult attached_;
  uint64_t base_ = 0;
  std::shared_ptr<EventQueue> events_;
};

// Byte i of segment s's committed prefix.
uint8_t Pattern(uint64_t s, uint64_t i) { return static_cast<uint8_t>((s * 131 + i / 4096 * 7 + i) & 0xff); }

void Fill(PausingEngine& e, const PoolView& pool, uint64_t bytes_per_segment) {
  for (uint64_t s = 0; s < pool.geometry.segments(); ++s) {
    uint8_t* p = e.at(pool.geometry.SegmentOffset(s));
    for (uint64_t i = 0; i < bytes_per_segment; ++i) p[i] = Pattern(s, i);
  }
}

// The first byte that differs, or -1.
int64_t FirstDifference(PausingEngine& e, const PoolView& pool, uint64_t bytes_per_segment) {
  for (uint64_t s = 0; s < pool.geometry.segments(); ++s) {
    const uint8_t* p = e.at(pool.geometry.SegmentOffset(s));
    for (uint64_t i = 0; i < bytes_per_segment; ++i) {
      if (p[i] != Pattern(s, i)) return static_cast<int64_t>(pool.geometry.SegmentOffset(s) + i);
    }
  }
  return -1;
}

TEST_F(PoolManagerTest, ExactShrinkReplacesTheStraddlingChunksWhileAPausableClientPauses) {
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, Spec("p", 256)));
  ASSERT_THAT(pool.chunks, SizeIs(2));
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/true);
  Fill(engine, pool, 16 * kMiB);

  absl::StatusOr<PoolUpdate> shrunk;
  std::thread shrink([&] { shrunk = manager_->Shrink(alice_, "p", 40, false, absl::Now()); });
  std::optional<PoolEvent> resume = engine.FollowPause();
  shrink.join();
  ASSERT_THAT(shrunk, IsOk());
  ASSERT_TRUE(resume.has_value());
  EXPECT_TRUE(resume->applied);
  // 40 blocks = 2.5 MiB per segment, rounded up to the 2 MiB granularity: 4 MiB, so 64 blocks.
  EXPECT_EQ(shrunk->pool.committed_blocks, 64u);
  EXPECT_EQ(shrunk->pool.committed_bytes, 8 * kMiB);
  ASSERT_THAT(shrunk->pool.chunks, SizeIs(2));
  EXPECT_EQ(shrunk->pool.chunks[0].bytes, 4 * kMiB);
  ASSERT_TRUE(shrunk->reshape.has_value());
  const ReshapeReport& r = *shrunk->reshape;
  EXPECT_TRUE(r.target_reached);
  EXPECT_EQ(r.chunks_replaced, 2u);
  EXPECT_EQ(r.chunks_added, 2u);
  EXPECT_EQ(r.copied_bytes, 8 * kMiB);
  EXPECT_EQ(r.paused_clients, 1u);
  EXPECT_EQ(r.resumed_clients, 1u);
  EXPECT_EQ(resume->committed_blocks, 64u);
  EXPECT_EQ(FirstDifference(engine, pool, 4 * kMiB), -1) << "the kept bytes read the same from the new chunks";
  EXPECT_EQ(Committed(), 8 * kMiB) << "the released bytes were acknowledged";
  EXPECT_EQ(device_->live_chunks(), 2);
}

TEST_F(PoolManagerTest, ExactShrinkWithoutClientsNeedsNoPause) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  for (uint64_t b = 96; b <= 256; b += 32) ASSERT_THAT(manager_->Grow(alice_, "p", b), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate shrunk, manager_->Shrink(alice_, "p", 100, false, absl::Now()));
  // 100 blocks = 6.25 MiB -> 8 MiB: the chunk [6, 8) MiB of each segment stays whole; nothing straddles.
  EXPECT_EQ(shrunk.pool.committed_bytes, 16 * kMiB);
  EXPECT_EQ(shrunk.reshape->chunks_added, 0u);
  EXPECT_TRUE(shrunk.reshape->target_reached);
  KVD_ASSERT_OK_AND_ASSIGN(shrunk, manager_->Shrink(alice_, "p", 1, false, absl::Now()));
  EXPECT_EQ(shrunk.pool.committed_bytes, 4 * kMiB);
  EXPECT_EQ(shrunk.pool.committed_blocks, 32u);
  EXPECT_EQ(shrunk.reshape->paused_clients, 0u);
  EXPECT_EQ(Committed(), 4 * kMiB);
}

TEST_F(PoolManagerTest, CompactRewritesAFragmentedPoolAsOneChunkPerSegmentKeepingEveryByte) {
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, Spec("p", 32)));
  for (uint64_t b = 64; b <= 256; b += 32) ASSERT_THAT(manager_->Grow(alice_, "p", b), IsOk());
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/true);
  KVD_ASSERT_OK_AND_ASSIGN(pool, manager_->GetPool(alice_, "p"));
  ASSERT_THAT(pool.chunks, SizeIs(16));
  Fill(engine, pool, 16 * kMiB);

  absl::StatusOr<PoolUpdate> compacted;
  std::thread compact([&] { compacted = manager_->Compact(alice_, "p", {}); });
  ASSERT_TRUE(engine.FollowPause().has_value());
  compact.join();
  ASSERT_THAT(compacted, IsOk());
  EXPECT_THAT(compacted->pool.chunks, SizeIs(2));
  EXPECT_EQ(compacted->reshape->chunks_before, 16u);
  EXPECT_EQ(compacted->reshape->chunks_after, 2u);
  EXPECT_EQ(compacted->reshape->copied_bytes, 32 * kMiB);
  EXPECT_EQ(compacted->pool.committed_blocks, 256u);
  EXPECT_EQ(FirstDifference(engine, pool, 16 * kMiB), -1);
  EXPECT_EQ(Committed(), 32 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 2);

  // Already in shape: nothing moves and nobody pauses.
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate again, manager_->Compact(alice_, "p", {}));
  EXPECT_EQ(again.reshape->chunks_added, 0u);
  EXPECT_EQ(again.reshape->paused_clients, 0u);
  EXPECT_FALSE(engine.events().Pop(absl::ZeroDuration()).has_value());
}

// A pool grown in 8 steps: 8 chunks a segment, one new chunk each once compacted.
PoolView GrowInSteps(PoolManager* manager, const Caller& who, const std::string& name = "p") {
  EXPECT_THAT(manager->CreatePool(who, Spec(name, 32)), IsOk());
  for (uint64_t b = 64; b <= 256; b += 32) EXPECT_THAT(manager->Grow(who, name, b), IsOk());
  absl::StatusOr<PoolView> pool = manager->GetPool(who, name);
  EXPECT_THAT(pool, IsOk());
  EXPECT_THAT(pool->chunks, SizeIs(16));
  return *pool;
}

// Note [Releases pause first]: a shrink or sleep by another session pauses a pausable client before the
// chunks go, and tells it of them in its RESUME; one that is not pausable refuses it unless forced.
TEST_F(PoolManagerTest, AReleasePausesThePausableClientsOfOtherSessionsFirst) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 256), IsOk());
  PausingEngine engine(this, manager_.get(), Session(alice_.uid, "engine"), "p", /*pausable=*/true);

  absl::StatusOr<PoolUpdate> shrunk;
  std::thread shrink([&] { shrunk = manager_->Shrink(alice_, "p", 64, {.wait = true, .whole_chunks_only = true}); });
  std::optional<PoolEvent> resume = engine.FollowPause();
  shrink.join();
  ASSERT_THAT(shrunk, IsOk());
  ASSERT_TRUE(resume.has_value() && resume->applied);
  EXPECT_THAT(engine.last_pause().chunks, ::testing::IsEmpty()) << "a release brings no new chunks";
  EXPECT_FALSE(engine.last_pause().ranges.empty()) << "but says which bytes go";
  EXPECT_THAT(resume->chunks, SizeIs(2));
  EXPECT_EQ(resume->committed_blocks, 64u);
  EXPECT_NE(resume->release_id, 0u);
  EXPECT_EQ(shrunk->pool.pending_release_bytes, 0u);

  absl::StatusOr<std::vector<PoolUpdate>> slept;
  std::thread sleep([&] { slept = manager_->Sleep(alice_, "p", /*wait=*/true, absl::Now() + absl::Seconds(30)); });
  resume = engine.FollowPause();
  sleep.join();
  ASSERT_THAT(slept, IsOk());
  ASSERT_TRUE(resume.has_value() && resume->applied);
  EXPECT_EQ(resume->state, PoolState::kSleeping);
  EXPECT_EQ((*slept)[0].pool.pending_release_bytes, 0u);
  EXPECT_EQ(Committed(), 0u);
  EXPECT_EQ(device_->live_chunks(), 0);
}

TEST_F(PoolManagerTest, AReleaseIsRefusedForAClientThatIsNotPausableUnlessForcedAndNeverForItsOwnSession) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 256), IsOk());
  const Caller bob = Session(alice_.uid, "bob");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", "plain"));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> events, manager_->Watch(bob, b.client_id));
  const uint64_t before = Committed();
  EXPECT_THAT(manager_->Shrink(alice_, "p", 64, PoolManager::ShrinkOptions{.whole_chunks_only = true}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(b.client_id)));
  EXPECT_THAT(manager_->Sleep(alice_, "p", false, absl::Now()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not pausable")));
  EXPECT_THAT(manager_->Prepare(alice_, "p", GroupOp::kSleep, 0, absl::Seconds(30)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(b.client_id)));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView unchanged, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(unchanged.committed_blocks, 256u);
  EXPECT_EQ(unchanged.state, PoolState::kAwake);
  EXPECT_EQ(Committed(), before);
  EXPECT_FALSE(events->Pop(absl::ZeroDuration()).has_value()) << "nobody was told of a change that did not happen";

  // bob's own session shrinks: bob asked for it, so it is told as ever.
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate own, manager_->Shrink(bob, "p", 64, PoolManager::ShrinkOptions{}));
  std::optional<PoolEvent> e = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->type, EventType::kChunksReleased);
  EXPECT_FALSE(e->forced);
  ASSERT_THAT(manager_->Acknowledge(bob, b.client_id, e->release_id), IsOk());

  // Forced by alice: bob is told so, and what it maps stays counted until it lets go.
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolUpdate> slept,
                           manager_->Sleep(alice_, "p", false, absl::Now(), {.force = true}));
  e = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->type, EventType::kChunksReleased);
  EXPECT_TRUE(e->forced);
  EXPECT_GT(slept[0].pool.pending_release_bytes, 0u);
  ASSERT_THAT(manager_->Detach(bob, b.client_id, /*released=*/true), IsOk());
  EXPECT_EQ(Committed(), 0u);
}

TEST_F(PoolManagerTest, AReleaseWhosePauseIsNotAcknowledgedChangesNothing) {
  ManagerOptions options;
  options.pause_timeout = absl::Milliseconds(50);
  Start(options);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 256), IsOk());
  const Caller bob = Session(alice_.uid, "bob");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", "stuck", {}, /*pausable=*/true));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> events, manager_->Watch(bob, b.client_id));
  const uint64_t before = Committed();
  EXPECT_THAT(manager_->Sleep(alice_, "p", false, absl::Now()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(b.client_id)));
  std::optional<PoolEvent> pause = events->Pop(absl::Seconds(5));
  std::optional<PoolEvent> resume = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(pause.has_value() && resume.has_value());
  EXPECT_EQ(pause->type, EventType::kPause);
  EXPECT_EQ(resume->type, EventType::kResume);
  EXPECT_FALSE(resume->applied);
  KVD_ASSERT_OK_AND_ASSIGN(PoolView unchanged, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(unchanged.state, PoolState::kAwake);
  EXPECT_EQ(Committed(), before);

  // A group's prepared sleep keeps the pause until it aborts (or commits).
  absl::StatusOr<PreparedOp> prepared;
  std::thread prepare([&] { prepared = manager_->Prepare(alice_, "p", GroupOp::kSleep, 0, absl::Seconds(30)); });
  pause = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(pause.has_value() && pause->type == EventType::kPause);
  ASSERT_THAT(manager_->AcknowledgePause(bob, b.client_id, pause->pause_id), IsOk());
  prepare.join();
  ASSERT_THAT(prepared, IsOk());
  EXPECT_FALSE(events->Pop(absl::Milliseconds(20)).has_value()) << "paused until the commit or abort";
  ASSERT_THAT(manager_->Abort(alice_, prepared->transaction), IsOk());
  resume = events->Pop(absl::Seconds(5));
  ASSERT_TRUE(resume.has_value() && resume->type == EventType::kResume);
  EXPECT_FALSE(resume->applied);
  EXPECT_EQ(Committed(), before);
}

TEST_F(PoolManagerTest, AForcedDeletePausesThePausableClientsAndForcesPastTheOthers) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  const Caller bob = Session(alice_.uid, "bob"), carol = Session(alice_.uid, "carol");
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult b, manager_->Attach(bob, "p", "pausable", {}, /*pausable=*/true));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> be, manager_->Watch(bob, b.client_id));
  KVD_ASSERT_OK_AND_ASSIGN(AttachResult c, manager_->Attach(carol, "p", "plain"));
  KVD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<EventQueue> ce, manager_->Watch(carol, c.client_id));
  absl::StatusOr<uint64_t> deleted;
  std::thread del([&] { deleted = manager_->DeletePool(alice_, "p", /*force=*/true); });
  std::optional<PoolEvent> pause = be->Pop(absl::Seconds(5));
  ASSERT_TRUE(pause.has_value() && pause->type == EventType::kPause);
  EXPECT_FALSE(ce->Pop(absl::Milliseconds(20)).has_value()) << "nothing goes before bob paused";
  ASSERT_THAT(manager_->AcknowledgePause(bob, b.client_id, pause->pause_id), IsOk());
  del.join();
  ASSERT_THAT(deleted, IsOk());
  std::optional<PoolEvent> gone = be->Pop(absl::Seconds(5));
  ASSERT_TRUE(gone.has_value() && gone->type == EventType::kPoolDeleted);
  EXPECT_FALSE(gone->forced) << "bob is paused";
  gone = ce->Pop(absl::Seconds(5));
  ASSERT_TRUE(gone.has_value() && gone->type == EventType::kPoolDeleted);
  EXPECT_TRUE(gone->forced) << "carol is not pausable: it keeps what it maps until it lets go";
}

TEST_F(PoolManagerTest, CompactWithClientsGoesInStepsOfAtMostMaxChunksPerPause) {
  const PoolView pool = GrowInSteps(manager_.get(), alice_);
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/true);
  Fill(engine, pool, 16 * kMiB);
  std::vector<ReshapeReport> steps;
  manager_->Observe({.reshape_step = [&](const ReshapeReport& r) { steps.push_back(r); }});

  // A step of at most 8 replaced chunks: one segment's new chunk at a time.
  absl::StatusOr<PoolUpdate> compacted;
  std::thread compact([&] { compacted = manager_->Compact(alice_, "p", {.max_chunks_per_pause = 8}); });
  std::optional<PoolEvent> first = engine.FollowPause();
  std::optional<PoolEvent> second = engine.FollowPause();
  compact.join();
  manager_->Observe({});
  ASSERT_THAT(compacted, IsOk());
  ASSERT_TRUE(first.has_value() && first->applied);
  ASSERT_TRUE(second.has_value() && second->applied);
  EXPECT_THAT(first->chunks, SizeIs(8)) << "the first step unmaps one segment's 8 old chunks";
  EXPECT_THAT(second->chunks, SizeIs(8));
  const ReshapeReport& r = *compacted->reshape;
  EXPECT_EQ(r.steps, 2u);
  EXPECT_EQ(r.chunks_before, 16u);
  EXPECT_EQ(r.chunks_after, 2u);
  EXPECT_EQ(r.chunks_replaced, 16u);
  EXPECT_EQ(r.chunks_added, 2u);
  EXPECT_EQ(r.copied_bytes, 32 * kMiB);
  EXPECT_EQ(r.paused_clients, 1u);
  EXPECT_EQ(r.resumed_clients, 1u);
  EXPECT_THAT(compacted->added, SizeIs(2));
  EXPECT_THAT(compacted->released_chunk_ids, SizeIs(16));
  ASSERT_THAT(steps, SizeIs(2));
  EXPECT_EQ(steps[0].chunks_replaced, 8u);
  EXPECT_EQ(steps[0].chunks_after, 9u);
  EXPECT_EQ(r.pause, steps[0].pause + steps[1].pause);
  EXPECT_EQ(r.max_pause, std::max(steps[0].pause, steps[1].pause));
  EXPECT_EQ(FirstDifference(engine, pool, 16 * kMiB), -1);
  EXPECT_EQ(Committed(), 32 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 2);

  // With nobody attached there is nobody to pause: one step, whatever the limit.
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("q", 32)), IsOk());
  for (uint64_t b = 64; b <= 256; b += 32) ASSERT_THAT(manager_->Grow(alice_, "q", b), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate alone, manager_->Compact(alice_, "q", {.max_chunks_per_pause = 1}));
  EXPECT_EQ(alone.reshape->steps, 1u);
  EXPECT_EQ(alone.reshape->chunks_after, 2u);
}

// A second step that fails (its PAUSE never acknowledged), or that the caller gives up before (consulted
// only between steps): the call says so, and the first step stays done.
TEST_F(PoolManagerTest, ACompactionStepThatFailsOrIsCancelledLeavesTheStepsBeforeItDone) {
  struct Case {
    std::string pool;
    PoolManager::CompactOptions options;
    absl::StatusCode code;
    std::string why;
  };
  const std::vector<Case> cases = {{"p",
                                    {.pause = {.timeout = absl::Milliseconds(200)}, .max_chunks_per_pause = 8},
                                    absl::StatusCode::kDeadlineExceeded,
                                    "did not acknowledge the pause"},
                                   {"q",
                                    {.max_chunks_per_pause = 8, .interrupt = {.cancelled = [] { return true; }}},
                                    absl::StatusCode::kCancelled,
                                    "the caller cancelled the call"}};
  int chunks = device_->live_chunks();
  for (const Case& c : cases) {
    const PoolView pool = GrowInSteps(manager_.get(), alice_, c.pool);
    PausingEngine engine(this, manager_.get(), alice_, c.pool, /*pausable=*/true);
    Fill(engine, pool, 16 * kMiB);
    absl::StatusOr<PoolUpdate> compacted;
    std::thread compact([&] { compacted = manager_->Compact(alice_, c.pool, c.options); });
    ASSERT_TRUE(engine.FollowPause().has_value()) << c.pool;  // only the first PAUSE is acknowledged
    compact.join();
    EXPECT_THAT(compacted, StatusIs(c.code, AllOf(HasSubstr(c.why), HasSubstr("steps before it did stays done (1 "
                                                                              "of them: 16 -> 9 chunks)"))));
    KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, c.pool));
    EXPECT_THAT(after.chunks, SizeIs(9));
    EXPECT_EQ(FirstDifference(engine, pool, 16 * kMiB), -1) << "the first step's chunk holds segment 0's bytes";
    chunks += 9;
    EXPECT_EQ(device_->live_chunks(), chunks) << c.pool << ": the views the steps left were taken down";
  }
  EXPECT_EQ(Committed(), 64 * kMiB);
}

// Every fallible backend call of a compaction in two steps, failed once: a failure in the first step
// changes nothing, one in the second leaves the first done; either way nothing leaks (chunks, mappings,
// reservations: the step's next view and the view the first step left), the engine's bytes read the
// same, and compacting again finishes the job.
TEST_F(PoolManagerTest, EveryFailedCallOfACompactionInStepsLeavesTheStepsBeforeItAndNothingElse) {
  int in_second_step = 0, faults = 0;
  for (int n = 1;; ++n) {
    faults = n - 1;
    const std::string name = absl::StrCat("p", n);
    const int chunks0 = device_->live_chunks(), mappings0 = device_->live_mappings(),
              reservations0 = device_->live_reservations();
    const uint64_t committed0 = Committed();
    const PoolView pool = GrowInSteps(manager_.get(), alice_, name);
    PausingEngine engine(this, manager_.get(), alice_, name, /*pausable=*/true);
    Fill(engine, pool, 16 * kMiB);
    auto compact = [&](int fault) {
      if (fault > 0) device_->FailNthCall(fault, absl::ResourceExhaustedError(absl::StrCat("injected fault #", fault)));
      std::atomic<bool> finished{false};
      absl::StatusOr<PoolUpdate> compacted;
      std::thread t([&] {
        compacted = manager_->Compact(alice_, name, {.max_chunks_per_pause = 8});
        finished = true;
      });
      while (!finished) engine.FollowPause(absl::Milliseconds(20));
      t.join();
      return compacted;
    };
    absl::StatusOr<PoolUpdate> compacted = compact(n);
    const bool walked_all = device_->fault_pending();
    device_->FailNthCall(0, absl::OkStatus());  // not pending any more either way
    KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, name));
    EXPECT_EQ(FirstDifference(engine, pool, 16 * kMiB), -1) << "fault #" << n;
    const int chunks = static_cast<int>(after.chunks.size());
    EXPECT_EQ(device_->live_chunks(), chunks0 + chunks) << "fault #" << n;
    // The daemon's view only: all of it, or (a fault before it was mapped: Note [The daemon maps on demand]) none.
    EXPECT_THAT(device_->live_mappings(), AnyOf(mappings0, mappings0 + chunks)) << "fault #" << n;
    EXPECT_EQ(device_->live_reservations(), reservations0 + 1) << "fault #" << n;
    EXPECT_EQ(Committed(), committed0 + 32 * kMiB) << "fault #" << n << ": the budget as the table says";
    if (walked_all) {  // the compaction made fewer than n fallible calls: the walk is over
      EXPECT_THAT(compacted, IsOk());
      EXPECT_EQ(chunks, 2);
    } else {
      EXPECT_THAT(compacted, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("injected fault")));
      if (chunks == 9) {
        ++in_second_step;
        EXPECT_THAT(compacted.status().message(), HasSubstr("stays done (1 of them: 16 -> 9 chunks)"));
      } else {
        EXPECT_EQ(chunks, 16) << "fault #" << n << ": the first step failed and changed nothing";
      }
      KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate again, compact(0));
      EXPECT_THAT(again.pool.chunks, SizeIs(2));
      EXPECT_EQ(FirstDifference(engine, pool, 16 * kMiB), -1) << "fault #" << n << ", compacted again";
    }
    // Gone without a trace.
    EXPECT_THAT(manager_->Detach(alice_, engine.id(), /*released=*/true), IsOk());
    EXPECT_THAT(manager_->DeletePool(alice_, name, /*force=*/false), IsOk());
    EXPECT_EQ(Committed(), committed0) << "fault #" << n;
    EXPECT_EQ(device_->live_chunks(), chunks0) << "fault #" << n;
    EXPECT_EQ(device_->live_mappings(), mappings0) << "fault #" << n;
    EXPECT_EQ(device_->live_reservations(), reservations0) << "fault #" << n;
    if (HasFailure() || walked_all) break;
  }
  EXPECT_GT(in_second_step, 0) << "some fault must have hit the second step";
  std::printf("[ sweep    ] compact in 2 steps: %d fallible backend calls, each failed once (%d in the second step)\n",
              faults, in_second_step);
}

TEST_F(PoolManagerTest, APauseNobodyAcknowledgesChangesNothing) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 64), IsOk());
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/true);
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  const uint64_t committed = Committed();
  const int chunks = device_->live_chunks();

  EXPECT_THAT(manager_->Compact(alice_, "p", {.pause = {.timeout = absl::Milliseconds(50)}}),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr(engine.id()), HasSubstr("did not acknowledge the pause"),
                             HasSubstr("nothing changed"))));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, "p"));
  ASSERT_EQ(after.chunks.size(), before.chunks.size());
  for (size_t i = 0; i < after.chunks.size(); ++i) EXPECT_EQ(after.chunks[i].id, before.chunks[i].id);
  EXPECT_EQ(after.generation, before.generation);
  EXPECT_EQ(Committed(), committed);
  EXPECT_EQ(device_->live_chunks(), chunks);
  std::optional<PoolEvent> pause = engine.events().Pop(absl::Seconds(1));
  ASSERT_TRUE(pause.has_value());
  EXPECT_EQ(pause->type, EventType::kPause);
  std::optional<PoolEvent> resume = engine.events().Pop(absl::Seconds(1));
  ASSERT_TRUE(resume.has_value());
  EXPECT_EQ(resume->type, EventType::kResume);
  EXPECT_FALSE(resume->applied);
  EXPECT_THAT(manager_->AcknowledgePause(alice_, engine.id(), pause->pause_id),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("pause_id")));
  // Its lease, fetched only now, says that the pause was called off (a client that was slow to read the
  // PAUSE keeps everything it maps); a lease is single-use all the same.
  ASSERT_TRUE(pause->lease.has_value());
  EXPECT_THAT(manager_->RedeemLease(alice_.session, pause->lease->token, alice_.uid),
              StatusIs(absl::StatusCode::kAborted,
                       AllOf(HasSubstr(absl::StrCat("pause ", pause->pause_id)), HasSubstr("called off"))));
  EXPECT_THAT(manager_->RedeemLease(alice_.session, pause->lease->token, alice_.uid),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("lease_token")));

  // detach_unresponsive: the silent client is detached and the change goes on.
  KVD_ASSERT_OK_AND_ASSIGN(
      PoolUpdate compacted,
      manager_->Compact(alice_, "p", {.pause = {.timeout = absl::Milliseconds(50), .detach_unresponsive = true}}));
  EXPECT_THAT(compacted.reshape->detached_client_ids, ::testing::ElementsAre(engine.id()));
  EXPECT_THAT(compacted.pool.chunks, SizeIs(2));
  EXPECT_EQ(compacted.pool.client_count, 0u);
}

TEST_F(PoolManagerTest, AClientThatDidNotOptInIsNeverPaused) {
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 64), IsOk());
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/false);
  EXPECT_THAT(manager_->Compact(alice_, "p", {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, AllOf(HasSubstr(engine.id()), HasSubstr("pausable"))));
  EXPECT_FALSE(engine.events().Pop(absl::ZeroDuration()).has_value());
}

TEST_F(PoolManagerTest, CompactionShrinkMovesLiveBlocksBelowTheTarget) {
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, Spec("p", 256)));
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/true);
  const uint64_t block = pool.geometry.block_stride();
  // Block b of segment s starts with the bytes (s, b).
  for (uint64_t s = 0; s < 2; ++s) {
    for (uint64_t b = 0; b < 256; ++b) {
      uint8_t* p = engine.at(pool.geometry.SegmentOffset(s) + b * block);
      p[0] = static_cast<uint8_t>(s);
      p[1] = static_cast<uint8_t>(b);
    }
  }
  auto live = [](std::vector<uint64_t> blocks) { return std::optional<std::vector<uint64_t>>(std::move(blocks)); };
  EXPECT_THAT(manager_->Shrink(alice_, "p", 32, {.live = live({1, 300})}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("live.blocks[1]")));
  EXPECT_THAT(manager_->Shrink(alice_, "p", 32, {.live = live({1, 200, 1})}),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("live.blocks[2]"), HasSubstr("twice"))));
  EXPECT_THAT(manager_->Shrink(alice_, "p", 2, {.live = live({0, 1, 5})}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not fit")));
  EXPECT_THAT(manager_->Shrink(alice_, "p", 32, {.whole_chunks_only = true, .live = live({1})}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("whole_chunks_only")));
  EXPECT_FALSE(engine.events().Pop(absl::ZeroDuration()).has_value()) << "refused before any pause";

  absl::StatusOr<PoolUpdate> shrunk;
  std::thread shrink([&] { shrunk = manager_->Shrink(alice_, "p", 32, {.live = live({0, 2, 40, 255, 33})}); });
  ASSERT_TRUE(engine.FollowPause().has_value());
  shrink.join();
  ASSERT_THAT(shrunk, IsOk());
  // Live past 32, in order (33, 40, 255), into the free blocks below it, in order (1, 3, 4).
  ASSERT_THAT(shrunk->reshape->moved_blocks, SizeIs(3));
  const std::vector<std::pair<uint64_t, uint64_t>> want = {{33, 1}, {40, 3}, {255, 4}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(shrunk->reshape->moved_blocks[i].src, want[i].first);
    EXPECT_EQ(shrunk->reshape->moved_blocks[i].dst, want[i].second);
  }
  EXPECT_EQ(shrunk->pool.committed_blocks, 32u);
  for (uint64_t s = 0; s < 2; ++s) {
    for (auto [src, dst] : want) {
      const uint8_t* p = engine.at(pool.geometry.SegmentOffset(s) + dst * block);
      EXPECT_EQ(p[0], s);
      EXPECT_EQ(p[1], static_cast<uint8_t>(src)) << "block " << src << " now at " << dst;
    }
    for (uint64_t kept : {0, 2}) EXPECT_EQ(engine.at(pool.geometry.SegmentOffset(s) + kept * block)[1], kept);
  }
}

TEST_F(PoolManagerTest, AReplacementThatDoesNotFitTheBudgetChangesNothing) {
  Start({.budget_bytes = 40 * kMiB});
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 256)), IsOk());  // 32 MiB, one chunk per segment
  EXPECT_THAT(manager_->Shrink(alice_, "p", 160, false, absl::Now()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("20971520 bytes"), HasSubstr("8388608 bytes"), HasSubstr("still hold theirs"))));
  EXPECT_EQ(Committed(), 32 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 2);
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate shrunk, manager_->Shrink(alice_, "p", 32, false, absl::Now()));
  EXPECT_EQ(shrunk.pool.committed_bytes, 4 * kMiB);
}

TEST_F(PoolManagerTest, AGrowPastTheChunkThresholdCompactsOnItsOwnWhenEveryClientPauses) {
  // The daemon's notes, shared with its background compaction thread: it may still write one after the test's
  // body has returned and before the fixture stops the manager (ASan caught a write into a vector that was gone).
  struct Notes {
    absl::Mutex mu;
    std::vector<std::string> lines ABSL_GUARDED_BY(mu);
    std::string Last() {
      absl::MutexLock lock(&mu);
      return lines.empty() ? "" : lines.back();
    }
  };
  auto notes = std::make_shared<Notes>();
  Start({.compact_above_chunks = 6, .info = [notes](const std::string& line) {
           absl::MutexLock lock(&notes->mu);
           notes->lines.push_back(line);
         }});
  auto chunks = [&](const std::string& name) { return manager_->GetPool(alice_, name)->chunks.size(); };
  auto wait_for = [&](auto done) {
    for (int i = 0; i < 1000 && !done(); ++i) absl::SleepFor(absl::Milliseconds(5));
    return done();
  };

  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/true);
  for (uint64_t b = 64; b <= 96; b += 32) ASSERT_THAT(manager_->Grow(alice_, "p", b), IsOk());
  EXPECT_EQ(chunks("p"), 6u) << "not past the threshold yet";
  ASSERT_THAT(manager_->Grow(alice_, "p", 128), IsOk());
  ASSERT_TRUE(engine.FollowPause().has_value()) << "the daemon paused the pool to compact it";
  EXPECT_TRUE(wait_for([&] { return chunks("p") == 2; }));
  EXPECT_TRUE(wait_for([&] { return !notes->Last().empty(); }));
  EXPECT_THAT(notes->Last(), AllOf(HasSubstr("pool p: compacted on its own"), HasSubstr("8 -> 2 chunks")));

  // A client that did not opt in: the pool stays as it is, and the daemon says why.
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("q", 32)), IsOk());
  PausingEngine plain(this, manager_.get(), alice_, "q", /*pausable=*/false);
  for (uint64_t b = 64; b <= 160; b += 32) ASSERT_THAT(manager_->Grow(alice_, "q", b), IsOk());
  EXPECT_TRUE(wait_for([&] { return absl::StrContains(notes->Last(), "pool q: not compacted on its own"); }));
  EXPECT_EQ(chunks("q"), 10u);
}

// ---------------------------------------------------------------------------------------------
// Reshapes in steps bounded by the free memory (Note [Chunks are replaced, not cut])

// L=8 (8 segments), 64 KiB blocks, 16 MiB segments: 128 MiB at capacity.
PoolSpec WideSpec(std::string name, uint64_t initial_blocks) {
  PoolSpec spec = Spec(std::move(name), initial_blocks);
  spec.dims.layers = 8;
  return spec;
}

// Runs `call` on a thread while `engine` (if any) follows every pause it makes.
template <typename Call>
auto WhileFollowing(PausingEngine* engine, Call call) {
  std::atomic<bool> done{false};
  decltype(call()) result = absl::UnknownError("not run");
  std::thread t([&] {
    result = call();
    done = true;
  });
  if (engine != nullptr) engine->FollowUntil(done);
  t.join();
  return result;
}

class SteppedReshapeTest : public PoolManagerTest, public ::testing::WithParamInterface<bool> {
 protected:
  bool attached() const { return GetParam(); }

  // 14 MiB a segment (224 blocks) in 7 grows of 2 MiB: 56 chunks, 112 MiB of a 128 MiB budget (7/8), so
  // 16 MiB are free: one segment's 14 MiB new chunk at a time for a compaction. The pattern is written
  // through an engine, which stays attached (pausable) or detaches having let go of everything.
  PoolView Fill7Of8() {
    Start({.budget_bytes = 128 * kMiB});
    EXPECT_THAT(manager_->CreatePool(alice_, WideSpec("p", 32)), IsOk());
    for (uint64_t b = 64; b <= 224; b += 32) EXPECT_THAT(manager_->Grow(alice_, "p", b), IsOk());
    absl::StatusOr<PoolView> pool = manager_->GetPool(alice_, "p");
    EXPECT_THAT(pool, IsOk());
    EXPECT_THAT(pool->chunks, SizeIs(56));
    engine_ = std::make_unique<PausingEngine>(this, manager_.get(), alice_, "p", /*pausable=*/true);
    Fill(*engine_, *pool, 14 * kMiB);
    if (!attached()) {
      EXPECT_THAT(manager_->Detach(alice_, engine_->id(), /*released=*/true), IsOk());
      DropEngineMappings(*pool);
      engine_.reset();
    }
    return *pool;
  }
  void DropEngineMappings(const PoolView& pool) {
    for (auto [base, bytes] : reservations_) {
      mmap(reinterpret_cast<void*>(base), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
           0);
    }
    (void)pool;
  }
  // The first byte of the first `bytes` of every segment that differs from the pattern, through the
  // attached engine, or through a fresh mapping of the pool's current chunks.
  int64_t Check(const PoolView& pool, uint64_t bytes) {
    if (engine_ != nullptr) return FirstDifference(*engine_, pool, bytes);
    PausingEngine reader(this, manager_.get(), alice_, "p", /*pausable=*/true);
    const int64_t diff = FirstDifference(reader, pool, bytes);
    EXPECT_THAT(manager_->Detach(alice_, reader.id(), /*released=*/true), IsOk());
    DropEngineMappings(pool);
    return diff;
  }

  std::unique_ptr<PausingEngine> engine_;
};

TEST_P(SteppedReshapeTest, CompactAndExactShrinkGoInStepsThatFitTheFreeMemory) {
  const PoolView pool = Fill7Of8();
  std::vector<ReshapeReport> steps;
  manager_->Observe({.reshape_step = [&](const ReshapeReport& r) { steps.push_back(r); }});

  // 112 MiB of new chunks at once would not fit in 16 MiB; one segment's 14 MiB does.
  absl::StatusOr<PoolUpdate> compacted =
      WhileFollowing(engine_.get(), [&] { return manager_->Compact(alice_, "p", {}); });
  ASSERT_THAT(compacted, IsOk());
  const ReshapeReport& c = *compacted->reshape;
  EXPECT_EQ(c.steps, 8u);
  EXPECT_EQ(c.chunks_before, 56u);
  EXPECT_EQ(c.chunks_after, 8u);
  EXPECT_EQ(c.chunks_replaced, 56u);
  EXPECT_EQ(c.chunks_added, 8u);
  EXPECT_EQ(c.copied_bytes, 112 * kMiB);
  EXPECT_TRUE(c.target_reached);
  EXPECT_EQ(c.paused_clients, attached() ? 1u : 0u);
  ASSERT_THAT(steps, SizeIs(8));
  for (const ReshapeReport& r : steps) EXPECT_EQ(r.copied_bytes, 14 * kMiB) << "one segment a step";
  EXPECT_THAT(compacted->pool.chunks, SizeIs(8));
  EXPECT_THAT(compacted->added, SizeIs(8));
  EXPECT_EQ(compacted->pool.committed_blocks, 224u);
  EXPECT_EQ(Check(pool, 14 * kMiB), -1) << "every byte of every segment";
  EXPECT_EQ(Committed(), 112 * kMiB);
  EXPECT_EQ(manager_->GetDeviceStatus()->pending_release_bytes, 0u);
  EXPECT_EQ(device_->live_chunks(), 8);
  EXPECT_EQ(device_->live_reservations(), 1) << "the steps' views were taken down";

  // Exact shrink to half: 112 blocks = 7 MiB, 8 MiB a segment; 64 MiB of replacements at once would not
  // fit, two segments' 16 MiB do; each step gives back 14 MiB a segment for the next: 2, 3, 3 segments.
  steps.clear();
  absl::StatusOr<PoolUpdate> shrunk =
      WhileFollowing(engine_.get(), [&] { return manager_->Shrink(alice_, "p", 112, {.wait = true}); });
  manager_->Observe({});
  ASSERT_THAT(shrunk, IsOk());
  const ReshapeReport& s = *shrunk->reshape;
  EXPECT_EQ(s.steps, 3u);
  EXPECT_EQ(s.chunks_before, 8u);
  EXPECT_EQ(s.chunks_after, 8u);
  EXPECT_EQ(s.chunks_replaced, 8u);
  EXPECT_EQ(s.chunks_added, 8u);
  EXPECT_EQ(s.copied_bytes, 64 * kMiB);
  EXPECT_TRUE(s.target_reached);
  EXPECT_EQ(s.paused_clients, attached() ? 1u : 0u);
  ASSERT_THAT(steps, SizeIs(3));
  EXPECT_EQ(s.pause, steps[0].pause + steps[1].pause + steps[2].pause);
  EXPECT_EQ(s.max_pause, std::max({steps[0].pause, steps[1].pause, steps[2].pause}));
  if (!attached()) {
    EXPECT_EQ(s.pause, absl::ZeroDuration());
  }
  EXPECT_EQ(steps[0].copied_bytes, 16 * kMiB);
  EXPECT_EQ(steps[1].copied_bytes, 24 * kMiB);
  EXPECT_EQ(steps[2].copied_bytes, 24 * kMiB);
  EXPECT_THAT(shrunk->released_chunk_ids, SizeIs(8));
  EXPECT_THAT(shrunk->added, SizeIs(8));
  EXPECT_EQ(shrunk->pool.committed_blocks, 128u);
  EXPECT_EQ(shrunk->pool.committed_bytes, 64 * kMiB);
  for (const ChunkInfo& chunk : shrunk->pool.chunks) EXPECT_EQ(chunk.bytes, 8 * kMiB);
  EXPECT_EQ(Check(pool, 8 * kMiB), -1) << "every kept byte of every segment";
  EXPECT_EQ(Committed(), 64 * kMiB);
  EXPECT_EQ(manager_->GetDeviceStatus()->pending_release_bytes, 0u);
  EXPECT_EQ(device_->live_chunks(), 8);
  EXPECT_EQ(device_->live_reservations(), 1);
  // The pool grows again as any other.
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate grown, manager_->Grow(alice_, "p", 224));
  EXPECT_EQ(grown.pool.committed_blocks, 224u);
  EXPECT_EQ(Committed(), 112 * kMiB);
}

// An exact shrink of a fragmented pool releases the whole chunks past the target first (no pause), and
// the straddling ones are then replaced with the memory that gave back.
TEST_P(SteppedReshapeTest, AnExactShrinkReleasesWholeChunksFirst) {
  Start({.budget_bytes = 120 * kMiB});
  ASSERT_THAT(manager_->CreatePool(alice_, WideSpec("p", 64)), IsOk());
  for (uint64_t b : {128, 192, 224}) ASSERT_THAT(manager_->Grow(alice_, "p", b), IsOk());  // 4+4+4+2 MiB
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  ASSERT_THAT(pool.chunks, SizeIs(32));
  engine_ = std::make_unique<PausingEngine>(this, manager_.get(), alice_, "p", /*pausable=*/true);
  Fill(*engine_, pool, 14 * kMiB);
  if (!attached()) {
    ASSERT_THAT(manager_->Detach(alice_, engine_->id(), /*released=*/true), IsOk());
    DropEngineMappings(pool);
    engine_.reset();
  }
  // 80 blocks = 5 MiB -> 6 MiB: [4, 8) MiB straddles; 8 x 2 MiB of replacements do not fit in 8 MiB free.
  absl::StatusOr<PoolUpdate> shrunk =
      WhileFollowing(engine_.get(), [&] { return manager_->Shrink(alice_, "p", 80, {.wait = true}); });
  ASSERT_THAT(shrunk, IsOk());
  EXPECT_EQ(shrunk->reshape->steps, 1u) << "the 48 MiB released first hold every replacement";
  EXPECT_EQ(shrunk->reshape->chunks_before, 32u);
  EXPECT_EQ(shrunk->reshape->chunks_replaced, 8u);
  EXPECT_EQ(shrunk->reshape->copied_bytes, 16 * kMiB);
  EXPECT_THAT(shrunk->released_chunk_ids, SizeIs(24));
  EXPECT_EQ(shrunk->pool.committed_bytes, 48 * kMiB);
  EXPECT_THAT(shrunk->pool.chunks, SizeIs(16));
  if (engine_ != nullptr) {
    ASSERT_THAT(engine_->released_events(), SizeIs(1));
    EXPECT_THAT(engine_->released_events()[0].chunks, SizeIs(16)) << "[8, 14) MiB of every segment";
    EXPECT_EQ(engine_->released_events()[0].committed_blocks, 128u);
  }
  EXPECT_EQ(Check(pool, 6 * kMiB), -1);
  EXPECT_EQ(Committed(), 48 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 16);
  EXPECT_EQ(device_->live_reservations(), 1);
}

// Where not even one segment's new chunk fits: refused with the bytes, nothing changed. Only a compaction
// with nobody attached goes on, into smaller new chunks.
TEST_P(SteppedReshapeTest, WhatCannotFitIsRefusedWithTheBytesAndNothingChanges) {
  Start({.budget_bytes = 32 * kMiB});
  std::optional<PausingEngine> engine;
  PoolView before;
  auto unchanged = [&](size_t chunks) {
    KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, "p"));
    EXPECT_EQ(after.generation, before.generation);
    EXPECT_EQ(after.committed_blocks, before.committed_blocks);
    ASSERT_EQ(after.chunks.size(), before.chunks.size());
    for (size_t i = 0; i < after.chunks.size(); ++i) EXPECT_EQ(after.chunks[i].id, before.chunks[i].id);
    EXPECT_EQ(Committed(), 28 * kMiB);
    EXPECT_EQ(device_->live_chunks(), static_cast<int>(chunks));
    EXPECT_EQ(device_->live_reservations(), 1);
    if (engine.has_value()) {
      EXPECT_FALSE(engine->events().Pop(absl::ZeroDuration()).has_value()) << "no pause";
    }
  };

  // 28 MiB in 7 grows of 2 MiB a segment: 4 MiB free, and a segment's 14 MiB new chunk does not fit.
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  for (uint64_t b = 64; b <= 224; b += 32) ASSERT_THAT(manager_->Grow(alice_, "p", b), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(before, manager_->GetPool(alice_, "p"));
  ASSERT_THAT(before.chunks, SizeIs(14));
  if (attached()) {
    engine.emplace(this, manager_.get(), alice_, "p", /*pausable=*/true);
    EXPECT_THAT(manager_->Compact(alice_, "p", {}),
                StatusIs(absl::StatusCode::kResourceExhausted,
                         AllOf(HasSubstr("compacting needs 14680064 bytes"), HasSubstr("only 4194304 bytes"),
                               HasSubstr("the device has"))));
    unchanged(14);
    EXPECT_THAT(manager_->Detach(alice_, engine->id(), /*released=*/true), IsOk());
    engine.reset();
  } else {
    // The daemon maps the pool alone: runs of two 2 MiB chunks into 4 MiB ones, as far as that goes.
    KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate compacted, manager_->Compact(alice_, "p", {}));
    EXPECT_FALSE(compacted.reshape->target_reached);
    EXPECT_EQ(compacted.reshape->chunks_before, 14u);
    EXPECT_EQ(compacted.reshape->chunks_after, 8u) << "4+4+4+2 MiB a segment";
    EXPECT_GT(compacted.reshape->steps, 1u);
    EXPECT_EQ(Committed(), 28 * kMiB);
    EXPECT_EQ(device_->live_chunks(), 8);
    EXPECT_EQ(device_->live_reservations(), 1);
  }
  ASSERT_THAT(manager_->DeletePool(alice_, "p", false), IsOk());
  EXPECT_EQ(Committed(), 0u);

  // One chunk a segment: the exact shrink's 8 MiB replacement of one segment does not fit in 4 MiB.
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 224)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(before, manager_->GetPool(alice_, "p"));
  if (attached()) engine.emplace(this, manager_.get(), alice_, "p", /*pausable=*/true);
  EXPECT_THAT(manager_->Shrink(alice_, "p", 112, false, absl::Now()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("shrinking to 112 blocks needs 8388608 bytes"),
                             HasSubstr("(16777216 bytes for all 2)"), HasSubstr("only 4194304 bytes"))));
  unchanged(2);
  // A compaction has nothing to do, and says so without a device call.
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate compacted, manager_->Compact(alice_, "p", {}));
  EXPECT_EQ(compacted.reshape->chunks_added, 0u);
  unchanged(2);
}

// A step of an exact shrink that fails (its PAUSE never acknowledged) leaves the steps before it done:
// the prefix is the target's, the segments not yet replaced keep tails past it, a grow waits until a
// compaction replaced them, and the budget counts them until then.
TEST_F(PoolManagerTest, AnExactShrinkStoppedBetweenStepsLeavesTailsACompactionReplaces) {
  Start({.budget_bytes = 128 * kMiB});
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, WideSpec("p", 224)));  // 8 x 14 MiB
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/true);
  Fill(engine, pool, 14 * kMiB);
  absl::StatusOr<PoolUpdate> shrunk;
  std::thread shrink(
      [&] { shrunk = manager_->Shrink(alice_, "p", 112, {.pause = {.timeout = absl::Milliseconds(200)}}); });
  ASSERT_TRUE(engine.FollowPause().has_value());  // only the first PAUSE is acknowledged
  shrink.join();
  EXPECT_THAT(shrunk, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               AllOf(HasSubstr("did not acknowledge the pause"),
                                     HasSubstr("shrink steps before it did stays done (1 of them: 8 -> 8 chunks)"),
                                     HasSubstr("Compact the pool"))));
  std::optional<PoolEvent> pause = engine.events().Pop(absl::Seconds(1));
  ASSERT_TRUE(pause.has_value() && pause->type == EventType::kPause);
  std::optional<PoolEvent> resume = engine.events().Pop(absl::Seconds(1));
  ASSERT_TRUE(resume.has_value() && resume->type == EventType::kResume && !resume->applied);

  KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(after.committed_blocks, 128u);
  EXPECT_EQ(after.committed_bytes, 64 * kMiB);
  uint64_t held = 0;
  for (const ChunkInfo& c : after.chunks) held += c.bytes;
  EXPECT_EQ(held, 2 * 8 * kMiB + 6 * 14 * kMiB) << "two segments replaced, six with their 14 MiB chunk";
  EXPECT_EQ(Committed(), held) << "the tails still count";
  EXPECT_EQ(FirstDifference(engine, pool, 8 * kMiB), -1);
  EXPECT_THAT(manager_->Grow(alice_, "p", 224),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("exact shrink stopped between its steps")));
  EXPECT_THAT(manager_->Shrink(alice_, "p", 64, {.whole_chunks_only = true}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("Compact the pool")));

  absl::StatusOr<PoolUpdate> compacted = WhileFollowing(&engine, [&] { return manager_->Compact(alice_, "p", {}); });
  ASSERT_THAT(compacted, IsOk());
  EXPECT_THAT(compacted->pool.chunks, SizeIs(8));
  for (const ChunkInfo& c : compacted->pool.chunks) EXPECT_EQ(c.bytes, 8 * kMiB);
  EXPECT_EQ(FirstDifference(engine, pool, 8 * kMiB), -1);
  EXPECT_EQ(Committed(), 64 * kMiB);
  ASSERT_THAT(manager_->Grow(alice_, "p", 224), IsOk());
  EXPECT_EQ(Committed(), 112 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 16);
}

// The same with the daemon's deletion of a pool with tails: every byte goes back.
TEST_F(PoolManagerTest, DeletingAPoolWithTailsGivesEveryByteBack) {
  Start({.budget_bytes = 128 * kMiB});
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, WideSpec("p", 224)));
  PausingEngine engine(this, manager_.get(), alice_, "p", /*pausable=*/true);
  absl::StatusOr<PoolUpdate> shrunk;
  std::thread shrink(
      [&] { shrunk = manager_->Shrink(alice_, "p", 112, {.pause = {.timeout = absl::Milliseconds(200)}}); });
  ASSERT_TRUE(engine.FollowPause().has_value());
  shrink.join();
  ASSERT_THAT(shrunk, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("stays done")));
  EXPECT_THAT(manager_->Detach(alice_, engine.id(), /*released=*/true), IsOk());
  ASSERT_THAT(manager_->DeletePool(alice_, "p", false), IsOk());
  EXPECT_EQ(Committed(), 0u);
  EXPECT_EQ(manager_->GetDeviceStatus()->pending_release_bytes, 0u);
  EXPECT_EQ(device_->live_chunks(), 0);
}

// Every fallible backend call of an exact shrink in steps (2 segments, one replacement a step), failed
// once: a failure in the first step changes nothing, one in the second leaves the first done (a tail in
// the other segment); nothing leaks, the bytes read the same, and a compaction finishes the job.
TEST_F(PoolManagerTest, EveryFailedCallOfAnExactShrinkInStepsLeavesTheStepsBeforeItAndNothingElse) {
  Start({.budget_bytes = 36 * kMiB});
  int in_second_step = 0, faults = 0;
  for (int n = 1;; ++n) {
    faults = n - 1;
    const std::string name = absl::StrCat("p", n);
    KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->CreatePool(alice_, Spec(name, 224)));  // 2 x 14 MiB
    PausingEngine engine(this, manager_.get(), alice_, name, /*pausable=*/true);
    Fill(engine, pool, 14 * kMiB);
    const int mappings0 = device_->live_mappings();
    device_->FailNthCall(n, absl::ResourceExhaustedError(absl::StrCat("injected fault #", n)));
    absl::StatusOr<PoolUpdate> shrunk =
        WhileFollowing(&engine, [&] { return manager_->Shrink(alice_, name, 112, false, absl::Now()); });
    const bool walked_all = device_->fault_pending();
    device_->FailNthCall(0, absl::OkStatus());
    KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, name));
    EXPECT_EQ(FirstDifference(engine, pool, 8 * kMiB), -1) << "fault #" << n;
    uint64_t held = 0;
    for (const ChunkInfo& c : after.chunks) held += c.bytes;
    EXPECT_EQ(Committed(), held) << "fault #" << n << ": the budget as the table says";
    EXPECT_EQ(device_->live_chunks(), 2) << "fault #" << n;
    // The engine's, and the daemon's view of the pool's two chunks where the shrink had mapped it (Note [The
    // daemon maps on demand]).
    EXPECT_THAT(device_->live_mappings(), AnyOf(mappings0, mappings0 + 2)) << "fault #" << n;
    EXPECT_EQ(device_->live_reservations(), 1) << "fault #" << n;
    if (walked_all) {
      EXPECT_THAT(shrunk, IsOk());
      EXPECT_EQ(shrunk->reshape->steps, 2u);
      EXPECT_EQ(held, 16 * kMiB);
    } else {
      EXPECT_THAT(shrunk, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("injected fault")));
      if (held == 22 * kMiB) {
        ++in_second_step;
        EXPECT_THAT(shrunk.status().message(), HasSubstr("stays done (1 of them: 2 -> 2 chunks)"));
        EXPECT_EQ(after.committed_blocks, 128u);
        absl::StatusOr<PoolUpdate> compacted =
            WhileFollowing(&engine, [&] { return manager_->Compact(alice_, name, {}); });
        ASSERT_THAT(compacted, IsOk()) << "fault #" << n;
        EXPECT_EQ(FirstDifference(engine, pool, 8 * kMiB), -1) << "fault #" << n << ", compacted";
        EXPECT_EQ(Committed(), 16 * kMiB);
      } else {
        EXPECT_EQ(held, 28 * kMiB) << "fault #" << n << ": the first step failed and changed nothing";
        EXPECT_EQ(after.generation, pool.generation) << "fault #" << n;
      }
    }
    EXPECT_THAT(manager_->Detach(alice_, engine.id(), /*released=*/true), IsOk());
    EXPECT_THAT(manager_->DeletePool(alice_, name, /*force=*/false), IsOk());
    EXPECT_EQ(Committed(), 0u) << "fault #" << n;
    EXPECT_EQ(device_->live_chunks(), 0) << "fault #" << n;
    EXPECT_EQ(device_->live_reservations(), 0) << "fault #" << n;
    TearDownMappings();
    if (HasFailure() || walked_all) break;
  }
  EXPECT_GT(in_second_step, 0) << "some fault must have hit the second step";
  std::printf(
      "[ sweep    ] exact shrink in 2 steps: %d fallible backend calls, each failed once (%d in the second step)\n",
      faults, in_second_step);
}

INSTANTIATE_TEST_SUITE_P(WithAndWithoutAClient, SteppedReshapeTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "Attached" : "Alone"; });

}  // namespace
}  // namespace kvd::daemon
