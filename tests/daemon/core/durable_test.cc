// Durability (Note [Durable pools] in docs/architecture.md) on the in-memory store: a restart rebuilds
// the pools from their records and FDs, clients give back what the store did not keep, the recovery grace
// loses the rest, a failed save is sticky and visible, and an FD the store refuses leaves nothing behind.
// A restart here is what it is for a daemon: Shutdown(keep_pools), then a new PoolManager (epoch + 1) on
// what the store kept (MemoryStateStore::Reopen), restored before anything else. FaultDevice counts the
// handles across restarts; FaultStore fails the store's calls.
#include "daemon/core/durable.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "daemon/core/memory_state_store.h"
#include "daemon/core/pool_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fault_device.h"
#include "tests/testing/fault_store.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::FaultDevice;
using ::kvd::testing::FaultStore;
using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;
using ::testing::UnorderedElementsAreArray;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// L=2, B=256, H=2, N=16, C=1024, bf16 under LBNHC: 2 segments, 64 KiB blocks, 16 MiB segments; with a
// 2 MiB granularity 32 blocks are one 2 MiB chunk per segment.
PoolSpec Spec(std::string name, uint64_t initial_blocks) {
  return {
      .name = std::move(name),
      .dims =
          {.layers = 2, .capacity_blocks = 256, .heads = 2, .block_tokens = 16, .channels = 1024, .element_bytes = 2},
      .initial_blocks = initial_blocks};
}

std::vector<uint64_t> Ids(const std::vector<ChunkInfo>& chunks) {
  std::vector<uint64_t> ids;
  for (const ChunkInfo& c : chunks) ids.push_back(c.id);
  return ids;
}

// A memfd of `bytes`: the host backend's chunk memory, as a client or a stray FD would hold it.
UniqueFd Memfd(uint64_t bytes) {
  UniqueFd fd(memfd_create("durable_test", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(ftruncate(fd.get(), static_cast<off_t>(bytes)), 0);
  return fd;
}

// Writes (or, with `check`, compares) a pattern naming chunk `id` at the start of the chunk's memory.
bool Pattern(int fd, uint64_t id, bool check) {
  const std::string text = absl::StrCat("chunk ", id);
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return false;
  bool same = true;
  if (check) {
    same = std::memcmp(p, text.data(), text.size()) == 0;
  } else {
    std::memcpy(p, text.data(), text.size());
  }
  munmap(p, 4096);
  return same;
}

class DurableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> host =
        OpenDevice({.backend = "host", .host_capacity = 512 * kMiB, .host_granularity = 2 * kMiB});
    ASSERT_THAT(host, IsOk());
    device_ = std::make_unique<FaultDevice>(*std::move(host));
  }
  void TearDown() override {
    manager_.reset();
    tier_.reset();
    EXPECT_EQ(device_->live_chunks(), 0);
    EXPECT_EQ(device_->live_mappings(), 0);
    EXPECT_EQ(device_->live_reservations(), 0);
  }

  // A daemon's first start on `store` (whose predecessor state is `memory`'s).
  void Start(StateStore* store, MemoryStateStore* memory, absl::Duration grace = absl::Seconds(60)) {
    store_ = store;
    memory_ = memory;
    grace_ = grace;
    SavedState saved = memory_->Reopen();
    Launch(saved.epoch + 1);
    alice_ = Session(1000, "alice");
  }
  // Stops the daemon keeping its pools and starts the next one on what the store kept, with a host tier of
  // `tier_bytes` (0: none) made as the daemon makes it: on the predecessor's memfd when the store kept one.
  RestoreReport Restart(uint64_t tier_bytes = 0) {
    manager_->Shutdown(/*keep_pools=*/true);
    manager_.reset();
    tier_.reset();
    EXPECT_EQ(device_->live_chunks(), 0) << "the stopped daemon keeps no handle";
    SavedState saved = memory_->Reopen();
    if (tier_bytes > 0) {
      MakeTier(tier_bytes, std::move(saved.host_tier_fd));
      if (!tier_->adopted()) {
        EXPECT_THAT(store_->KeepHostTierFd(tier_->fd()), IsOk());
      }
    }
    Launch(saved.epoch + 1);
    RestoreReport report = manager_->Restore(std::move(saved));
    alice_ = Session(1000, "alice");
    return report;
  }
  void Launch(uint64_t epoch) {
    manager_ = std::make_unique<PoolManager>(device_.get(), ManagerOptions{.budget_bytes = 256 * kMiB,
                                                                           .daemon_uid = 4242,
                                                                           .store = store_,
                                                                           .epoch = epoch,
                                                                           .recovery_grace = grace_,
                                                                           .host_tier = tier_.get()});
  }

  void MakeTier(uint64_t bytes, UniqueFd predecessor = {}) {
    absl::StatusOr<std::unique_ptr<HostTier>> tier =
        HostTier::Create(device_.get(), {.bytes = bytes, .copy_threads = 2}, 2 * kMiB, std::move(predecessor));
    ASSERT_THAT(tier, IsOk());
    tier_ = *std::move(tier);
  }

  Caller Session(uint32_t uid, std::string name) {
    const std::string token = *manager_->OpenSession(uid, 100 + uid, std::move(name));
    return *manager_->Authenticate(token);
  }
  uint64_t Committed() { return manager_->GetDeviceStatus()->committed_bytes; }

  // Attaches a client to `pool` and fetches its chunks' FDs, as an engine does; by chunk id.
  std::map<uint64_t, UniqueFd> Fetch(const std::string& pool) {
    std::map<uint64_t, UniqueFd> out;
    absl::StatusOr<AttachResult> attached = manager_->Attach(alice_, pool, "engine");
    EXPECT_THAT(attached, IsOk());
    if (!attached.ok()) return out;
    absl::StatusOr<std::vector<PoolManager::LeasedFd>> fds =
        manager_->RedeemLease(alice_.session, attached->lease.token, alice_.uid);
    EXPECT_THAT(fds, IsOk());
    if (!fds.ok()) return out;
    for (const PoolManager::LeasedFd& f : *fds) out[f.chunk_id] = UniqueFd(f.fd);
    return out;
  }

  // Stores that outlive the manager (declared before it).
  MemoryStateStore& MakeMemory(MemoryStateStore::Options options) {
    memories_.push_back(std::make_unique<MemoryStateStore>(options));
    return *memories_.back();
  }
  FaultStore& MakeFaulty(StateStore* inner) {
    faulties_.push_back(std::make_unique<FaultStore>(inner));
    return *faulties_.back();
  }

  std::unique_ptr<FaultDevice> device_;
  std::vector<std::unique_ptr<MemoryStateStore>> memories_;
  std::vector<std::unique_ptr<FaultStore>> faulties_;
  StateStore* store_ = nullptr;
  MemoryStateStore* memory_ = nullptr;
  absl::Duration grace_;
  std::unique_ptr<HostTier> tier_;  // made before the manager that uses it, destroyed after it
  std::unique_ptr<PoolManager> manager_;
  Caller alice_;
};

TEST_F(DurableTest, AManagerWithoutAStoreHasItsOwnInMemoryOne) {
  manager_ = std::make_unique<PoolManager>(device_.get(), ManagerOptions{.budget_bytes = 256 * kMiB});
  EXPECT_EQ(manager_->store().durability(), Durability::kNone);
  EXPECT_EQ(manager_->GetDeviceStatus()->durability, Durability::kNone);
  alice_ = Session(1000, "alice");
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 64), IsOk());
  auto* memory = dynamic_cast<MemoryStateStore*>(&manager_->store());
  ASSERT_NE(memory, nullptr);
  std::optional<SavedPool> record = memory->record("p");
  ASSERT_TRUE(record.has_value());
  EXPECT_THAT(record->chunks, SizeIs(4));
  EXPECT_FALSE(manager_->GetDeviceStatus()->state.degraded());
}

TEST_F(DurableTest, ARestartRebuildsEveryPoolFromItsRecordAndItsFds) {
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kFdStore});
  Start(&memory, &memory);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 64), IsOk());
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("q", 32)), IsOk());
  ASSERT_THAT(manager_->Sleep(alice_, "q", false, absl::InfiniteFuture()), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  ASSERT_THAT(before.chunks, SizeIs(4));
  {
    std::map<uint64_t, UniqueFd> fds = Fetch("p");
    for (const auto& [id, fd] : fds) ASSERT_TRUE(Pattern(fd.get(), id, /*check=*/false));
  }  // the client closed every FD and unmapped: only the store keeps the memory now
  EXPECT_THAT(memory.kept_chunk_ids(), UnorderedElementsAreArray(Ids(before.chunks)));

  const RestoreReport report = Restart();
  EXPECT_EQ(report.pools_restored, 2u);
  EXPECT_EQ(report.pools_recovering, 0u);
  EXPECT_EQ(report.chunks_adopted, 4u);
  EXPECT_EQ(report.bytes_adopted, 8 * kMiB);
  EXPECT_EQ(report.fds_released, 0u);
  EXPECT_THAT(report.lines, IsEmpty());
  EXPECT_EQ(manager_->GetDeviceStatus()->epoch, 2u);

  KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(after.state, PoolState::kAwake);
  EXPECT_EQ(after.committed_blocks, before.committed_blocks);
  EXPECT_EQ(after.generation, before.generation);
  EXPECT_EQ(Ids(after.chunks), Ids(before.chunks));
  for (size_t i = 0; i < after.chunks.size(); ++i) EXPECT_EQ(after.chunks[i].offset, before.chunks[i].offset);
  KVD_ASSERT_OK_AND_ASSIGN(PoolView q, manager_->GetPool(alice_, "q"));
  EXPECT_EQ(q.state, PoolState::kSleeping);
  EXPECT_EQ(Committed(), 8 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 4);
  for (const auto& [id, fd] : Fetch("p")) EXPECT_TRUE(Pattern(fd.get(), id, /*check=*/true)) << "chunk " << id;

  // The restored pool is an ordinary one: it grows with chunks of the new epoch, and is saved again.
  KVD_ASSERT_OK_AND_ASSIGN(PoolUpdate grown, manager_->Grow(alice_, "p", 96));
  ASSERT_THAT(grown.added, SizeIs(2));
  EXPECT_GT(grown.added[0].id, uint64_t{1} << 40);
  EXPECT_THAT(memory.record("p")->chunks, SizeIs(6));
}

// Writes (or, with `check`, compares) a pattern of `seed` over every byte of the awake pool's chunks.
bool PoolBytes(std::map<uint64_t, UniqueFd>& fds, const PoolView& pool, uint8_t seed, bool check) {
  bool same = true;
  for (const ChunkInfo& c : pool.chunks) {
    void* p = mmap(nullptr, c.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds.at(c.id).get(), 0);
    if (p == MAP_FAILED) return false;
    auto* bytes = static_cast<uint8_t*>(p);
    for (uint64_t i = 0; i < c.bytes; i += 4096) {
      const auto want = static_cast<uint8_t>(seed + c.segment * 31 + (c.offset + i) / 4096);
      if (check) {
        same = same && bytes[i] == want;
      } else {
        bytes[i] = want;
      }
    }
    munmap(p, c.bytes);
  }
  return same;
}

TEST_F(DurableTest, WhatASleepKeptInTheHostTierComesBackAfterARestart) {
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kFdStore});
  MakeTier(32 * kMiB);
  ASSERT_THAT(memory.KeepHostTierFd(tier_->fd()), IsOk());
  Start(&memory, &memory);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 64), IsOk());
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("q", 32)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  {
    std::map<uint64_t, UniqueFd> fds = Fetch("p");
    ASSERT_TRUE(PoolBytes(fds, before, 7, /*check=*/false));
  }
  ASSERT_THAT(manager_->Sleep(alice_, "p", false, absl::InfiniteFuture(), {}, {.keep = true}), IsOk());
  ASSERT_THAT(manager_->Sleep(alice_, "q", false, absl::InfiniteFuture(), {}, {.keep = true}), IsOk());
  ASSERT_TRUE(memory.record("p")->kept.has_value());
  EXPECT_EQ(memory.record("p")->kept->bytes, 8 * kMiB);
  EXPECT_EQ(tier_->Stats().used_bytes, 12 * kMiB);

  const RestoreReport report = Restart(32 * kMiB);
  EXPECT_TRUE(tier_->adopted());
  EXPECT_THAT(report.lines, IsEmpty());
  EXPECT_EQ(tier_->Stats().used_bytes, 12 * kMiB) << "each restored pool holds its extent again";
  KVD_ASSERT_OK_AND_ASSIGN(PoolView asleep, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(asleep.state, PoolState::kSleeping);
  EXPECT_EQ(asleep.kept_bytes, 8 * kMiB);
  // A pool kept before the restart and a pool kept after it share the tier without overlapping.
  ASSERT_THAT(manager_->Wake(alice_, "q"), IsOk());
  ASSERT_THAT(manager_->Sleep(alice_, "q", false, absl::InfiniteFuture(), {}, {.keep = true}), IsOk());
  ASSERT_THAT(manager_->Wake(alice_, "p"), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView woken, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(woken.committed_blocks, before.committed_blocks);
  EXPECT_EQ(woken.kept_bytes, 0u);
  std::map<uint64_t, UniqueFd> fds = Fetch("p");
  EXPECT_TRUE(PoolBytes(fds, woken, 7, /*check=*/true)) << "every byte the pool kept, at the same offsets";
  EXPECT_EQ(tier_->Stats().used_bytes, 4 * kMiB);
}

// Note [The daemon maps on demand]: a keeping sleep reads the pool through kvd's view, mapped before anything else.
// One whose view cannot be mapped is refused with the device's error naming the pool; the pool stays awake with
// every byte, the tier holds nothing for it and nothing stays mapped; the next try keeps it all.
TEST_F(DurableTest, AKeepingSleepWhoseViewCannotBeMappedChangesNothing) {
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kFdStore});
  MakeTier(32 * kMiB);
  Start(&memory, &memory);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  ASSERT_THAT(before.chunks, SizeIs(2));
  {
    std::map<uint64_t, UniqueFd> fds = Fetch("p");
    ASSERT_TRUE(PoolBytes(fds, before, 5, /*check=*/false));
  }
  EXPECT_EQ(device_->live_mappings(), 0) << "a grow maps nothing into kvd's view";
  device_->FailNth(FaultDevice::Op::kMap, 2, absl::ResourceExhaustedError("injected: no page tables"));
  EXPECT_THAT(manager_->Sleep(alice_, "p", false, absl::InfiniteFuture(), {}, {.keep = true}),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("pool p: mapping its chunks into kvd's view"), HasSubstr("injected"))));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView after, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(after.state, PoolState::kAwake);
  EXPECT_EQ(after.generation, before.generation);
  EXPECT_EQ(after.kept_bytes, 0u);
  EXPECT_EQ(tier_->Stats().used_bytes, 0u) << "the extent the sleep took is back";
  EXPECT_EQ(device_->live_mappings(), 0) << "the one chunk mapped before the failure is unmapped again";
  {
    std::map<uint64_t, UniqueFd> fds = Fetch("p");
    EXPECT_TRUE(PoolBytes(fds, after, 5, /*check=*/true));
  }
  ASSERT_THAT(manager_->Sleep(alice_, "p", false, absl::InfiniteFuture(), {}, {.keep = true}), IsOk());
  ASSERT_THAT(manager_->Wake(alice_, "p"), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView woken, manager_->GetPool(alice_, "p"));
  std::map<uint64_t, UniqueFd> fds = Fetch("p");
  EXPECT_TRUE(PoolBytes(fds, woken, 5, /*check=*/true)) << "every byte kept through the retried sleep";
}

// A daemon with a 32 MiB host tier and pool p of 64 blocks, one 4 MiB chunk per segment.
class KeptWakeTest : public DurableTest {
 protected:
  // Starts it, writes `seed`'s pattern over p and puts p to sleep keeping its contents.
  void SleepKeeping(uint8_t seed) {
    MemoryStateStore& memory = MakeMemory({.durability = Durability::kFdStore});
    MakeTier(32 * kMiB);
    Start(&memory, &memory);
    ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
    KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
    ASSERT_THAT(before.chunks, SizeIs(2));
    {
      std::map<uint64_t, UniqueFd> fds = Fetch("p");
      ASSERT_TRUE(PoolBytes(fds, before, seed, /*check=*/false));
    }
    ASSERT_THAT(manager_->Sleep(alice_, "p", false, absl::InfiniteFuture(), {}, {.keep = true}), IsOk());
  }
};

// Note [The host tier]: a wake copies the kept bytes into its first chunk while the next one is being made.
TEST_F(KeptWakeTest, AWakeCopiesIntoItsFirstChunkWhileTheNextIsMade) {
  ASSERT_NO_FATAL_FAILURE(SleepKeeping(3));

  absl::Notification copied, second_may_go;
  device_->NotifyNextCopyFromHost(&copied);
  device_->HoldCreatesAfter(1, &second_may_go);  // the wake's second chunk waits
  absl::Status woke;
  std::thread waker([&] { woke = manager_->Wake(alice_, "p").status(); });
  const bool overlapped = copied.WaitForNotificationWithTimeout(absl::Seconds(30));
  second_may_go.Notify();
  waker.join();
  device_->HoldCreatesAfter(0, nullptr);
  EXPECT_TRUE(overlapped) << "no byte was copied back while the second chunk was being made";
  ASSERT_THAT(woke, IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView woken, manager_->GetPool(alice_, "p"));
  std::map<uint64_t, UniqueFd> fds = Fetch("p");
  EXPECT_TRUE(PoolBytes(fds, woken, 3, /*check=*/true)) << "every byte the pool kept, at the same offsets";
  EXPECT_EQ(tier_->Stats().copied_to_device_bytes, 8 * kMiB);
}

// A wake whose second chunk cannot be made while the first one's bytes are copied back: the copy stops
// before the first chunk is unmapped, and the pool sleeps on with its contents (Note [The host tier]).
TEST_F(KeptWakeTest, AWakeThatCannotMakeAChunkStopsItsCopyAndTheContentsStayKept) {
  ASSERT_NO_FATAL_FAILURE(SleepKeeping(5));
  for (int i = 0; i < 8; ++i) {  // the failure lands at various points of the first chunk's copy
    device_->FailNth(FaultDevice::Op::kCreate, 2, absl::ResourceExhaustedError("out of memory"));
    EXPECT_THAT(manager_->Wake(alice_, "p"),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("out of memory")));
    KVD_ASSERT_OK_AND_ASSIGN(PoolView asleep, manager_->GetPool(alice_, "p"));
    EXPECT_EQ(asleep.state, PoolState::kSleeping);
    EXPECT_EQ(asleep.kept_bytes, 8 * kMiB);
    EXPECT_EQ(device_->live_chunks(), 0) << "the first chunk went back";
  }
  ASSERT_THAT(manager_->Wake(alice_, "p"), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView woken, manager_->GetPool(alice_, "p"));
  std::map<uint64_t, UniqueFd> fds = Fetch("p");
  EXPECT_TRUE(PoolBytes(fds, woken, 5, /*check=*/true));
}

TEST_F(DurableTest, KeptContentsATierOfAnotherSizeOrNoneCannotHoldAreDroppedAndSaid) {
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kFdStore});
  MakeTier(32 * kMiB);
  ASSERT_THAT(memory.KeepHostTierFd(tier_->fd()), IsOk());
  Start(&memory, &memory);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Sleep(alice_, "p", false, absl::InfiniteFuture(), {}, {.keep = true}), IsOk());

  RestoreReport report = Restart(64 * kMiB);  // --host-tier-bytes changed
  EXPECT_FALSE(tier_->adopted());
  EXPECT_THAT(report.lines, ElementsAre(HasSubstr("pool p: the 4194304 bytes it kept in the host tier are lost")));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView p, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(p.state, PoolState::kSleeping);
  EXPECT_EQ(p.kept_bytes, 0u);
  EXPECT_EQ(tier_->Stats().used_bytes, 0u);
  ASSERT_THAT(manager_->Wake(alice_, "p"), IsOk());
  EXPECT_EQ(manager_->GetPool(alice_, "p")->committed_blocks, 32u) << "it wakes with fresh memory";

  ASSERT_THAT(manager_->Sleep(alice_, "p", false, absl::InfiniteFuture(), {}, {.keep = true}), IsOk());
  report = Restart(/*tier_bytes=*/0);  // no tier at all now
  EXPECT_THAT(report.lines, ElementsAre(HasSubstr("kvd has no host tier now")));
  ASSERT_THAT(manager_->Wake(alice_, "p"), IsOk());
}

TEST(HostTierTest, ClaimTakesExactlyTheNamedExtentAndOnlyAFreeOne) {
  absl::StatusOr<std::unique_ptr<Device>> device =
      OpenDevice({.backend = "host", .host_capacity = 64 * kMiB, .host_granularity = 2 * kMiB});
  ASSERT_THAT(device, IsOk());
  absl::StatusOr<std::unique_ptr<HostTier>> tier = HostTier::Create(device->get(), {.bytes = 16 * kMiB}, 2 * kMiB);
  ASSERT_THAT(tier, IsOk());
  HostTier& t = **tier;
  EXPECT_FALSE(t.adopted());
  ASSERT_THAT(t.Claim(4 * kMiB, 4 * kMiB), IsOk());
  EXPECT_THAT(t.Claim(6 * kMiB, 2 * kMiB), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not free")));
  EXPECT_THAT(t.Claim(14 * kMiB, 4 * kMiB), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not free")));
  EXPECT_THAT(t.Claim(~uint64_t{0}, 2 * kMiB), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not free")));
  EXPECT_EQ(t.Stats().used_bytes, 4 * kMiB);
  uint64_t extent = 0;
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t first, t.Take("p", 4 * kMiB, &extent));
  EXPECT_EQ(first, 0u) << "first fit, before the claimed extent";
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t second, t.Take("p", 6 * kMiB, &extent));
  EXPECT_EQ(second, 8 * kMiB) << "after it";
  t.Give(4 * kMiB, 4 * kMiB);
  t.Give(first, 4 * kMiB);
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t whole, t.Take("p", 8 * kMiB, &extent));
  EXPECT_EQ(whole, 0u) << "given-back extents coalesce";
}

// Note [The host tier]: registered in pieces, each its own registration, and no copy crosses a piece's end.
TEST(HostTierTest, RegistersInPiecesAndNoCopyCrossesOne) {
  absl::StatusOr<std::unique_ptr<Device>> host =
      OpenDevice({.backend = "host", .host_capacity = 64 * kMiB, .host_granularity = 2 * kMiB});
  ASSERT_THAT(host, IsOk());
  FaultDevice device(*std::move(host));
  auto tier = HostTier::Create(
      &device, {.bytes = 10 * kMiB, .copy_threads = 3, .copy_piece_bytes = 6 * kMiB, .register_piece_bytes = 4 * kMiB},
      2 * kMiB);
  ASSERT_THAT(tier, IsOk());
  uint64_t extent = 0;
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t offset, (*tier)->Take("p", 10 * kMiB, &extent));  // waits for the preparation
  EXPECT_TRUE((*tier)->Stats().registered);
  std::vector<uint64_t> sizes;
  for (const auto& [start, bytes] : device.registered_host()) sizes.push_back(bytes);
  EXPECT_THAT(sizes, ElementsAre(4 * kMiB, 4 * kMiB, 2 * kMiB));

  // A run of the whole tier from a mapped chunk: copied in pieces cut at each registration's end, and back.
  KVD_ASSERT_OK_AND_ASSIGN(const uint64_t va, device.Reserve(16 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(const Chunk chunk, device.Create(16 * kMiB));
  ASSERT_THAT(device.Map(va, chunk, Access::kReadWrite), IsOk());
  auto* bytes = reinterpret_cast<uint32_t*>(va);
  for (uint64_t i = 0; i < 10 * kMiB / 4; ++i) bytes[i] = static_cast<uint32_t>(i * 2654435761u);
  const KeptContents kept{.tier_offset = offset,
                          .extent_bytes = extent,
                          .bytes = 10 * kMiB,
                          .runs = {{.pool_offset = 0, .bytes = 10 * kMiB}}};
  ASSERT_THAT((*tier)->CopyOut(va, kept), IsOk());
  std::memset(bytes, 0, 10 * kMiB);
  ASSERT_THAT((*tier)->CopyIn(va, kept), IsOk());
  uint64_t differ = 0;
  for (uint64_t i = 0; i < 10 * kMiB / 4; ++i) differ += bytes[i] != static_cast<uint32_t>(i * 2654435761u);
  EXPECT_EQ(differ, 0u);
  EXPECT_EQ(device.copies_outside_one_registration(), 0);
  ASSERT_THAT(device.Unmap(va, 16 * kMiB), IsOk());
  ASSERT_THAT(device.Release(chunk), IsOk());
  ASSERT_THAT(device.Free(va, 16 * kMiB), IsOk());
  tier->reset();
  EXPECT_THAT(device.registered_host(), ::testing::IsEmpty()) << "every piece is unregistered";
}

// A Copy starts a piece only once its whole range is ready (a piece across two chunks waits for both), and
// Finish names the first byte that never was.
TEST(HostTierTest, ACopyStartsAPieceOnceItsWholeRangeIsReadyAndFinishNamesWhatNeverWas) {
  absl::StatusOr<std::unique_ptr<Device>> device =
      OpenDevice({.backend = "host", .host_capacity = 64 * kMiB, .host_granularity = 2 * kMiB});
  ASSERT_THAT(device, IsOk());
  auto tier =
      HostTier::Create(device->get(), {.bytes = 8 * kMiB, .copy_threads = 2, .copy_piece_bytes = 4 * kMiB}, 2 * kMiB);
  ASSERT_THAT(tier, IsOk());
  uint64_t extent = 0;
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t offset, (*tier)->Take("p", 6 * kMiB, &extent));
  Device& d = **device;
  KVD_ASSERT_OK_AND_ASSIGN(const uint64_t va, d.Reserve(8 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(const Chunk chunk, d.Create(8 * kMiB));
  ASSERT_THAT(d.Map(va, chunk, Access::kReadWrite), IsOk());
  auto* bytes = reinterpret_cast<uint8_t*>(va);
  for (uint64_t i = 0; i < 6 * kMiB; ++i) bytes[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  const KeptContents kept{.tier_offset = offset,
                          .extent_bytes = extent,
                          .bytes = 6 * kMiB,
                          .runs = {{.pool_offset = 0, .bytes = 6 * kMiB}}};  // pieces [0, 4) and [4, 6) MiB
  ASSERT_THAT((*tier)->CopyOut(va, kept), IsOk());
  std::memset(bytes, 0, 6 * kMiB);
  {
    HostTier::Copy copy(tier->get(), va, kept, HostTier::Copy::Direction::kToDevice);
    copy.Ready(0, 2 * kMiB);
    copy.Ready(2 * kMiB, 1 * kMiB);  // the first piece is still not whole
    copy.Ready(3 * kMiB, 1 * kMiB);  // now it is
    EXPECT_THAT(copy.Finish(), StatusIs(absl::StatusCode::kInternal, HasSubstr("offset 4194304 (2097152 bytes)")));
  }
  EXPECT_EQ(bytes[4 * kMiB - 1], static_cast<uint8_t>((4 * kMiB - 1) * 7 + (4 * kMiB - 1) / 4096));
  EXPECT_EQ(bytes[4 * kMiB], 0) << "the piece never made ready was not copied";
  {
    HostTier::Copy copy(tier->get(), va, kept, HostTier::Copy::Direction::kToDevice);
    copy.Ready(4 * kMiB, 2 * kMiB);
    copy.Ready(0, 4 * kMiB);
    EXPECT_THAT(copy.Finish(), IsOk());
  }
  uint64_t differ = 0;
  for (uint64_t i = 0; i < 6 * kMiB; ++i) differ += bytes[i] != static_cast<uint8_t>(i * 7 + i / 4096);
  EXPECT_EQ(differ, 0u);
  {
    HostTier::Copy copy(tier->get(), va, kept, HostTier::Copy::Direction::kToDevice);
    copy.Stop();
    EXPECT_THAT(copy.Finish(), StatusIs(absl::StatusCode::kCancelled, HasSubstr("stopped")));
  }
  ASSERT_THAT(d.Unmap(va, 8 * kMiB), IsOk());
  ASSERT_THAT(d.Release(chunk), IsOk());
  ASSERT_THAT(d.Free(va, 8 * kMiB), IsOk());
}

TEST(HostTierTest, ARegistrationThatFailsLeavesNoPieceRegisteredAndTheTierUsable) {
  absl::StatusOr<std::unique_ptr<Device>> host =
      OpenDevice({.backend = "host", .host_capacity = 64 * kMiB, .host_granularity = 2 * kMiB});
  ASSERT_THAT(host, IsOk());
  FaultDevice device(*std::move(host));
  device.FailNth(FaultDevice::Op::kRegisterHost, 2, absl::ResourceExhaustedError("no pinnable memory"));
  std::vector<std::string> lines;
  absl::Mutex lines_mu;
  auto tier = HostTier::Create(&device,
                               {.bytes = 10 * kMiB,
                                .register_piece_bytes = 2 * kMiB,
                                .info =
                                    [&](const std::string& line) {
                                      absl::MutexLock lock(&lines_mu);
                                      lines.push_back(line);
                                    }},
                               2 * kMiB);
  ASSERT_THAT(tier, IsOk());
  uint64_t extent = 0;
  ASSERT_THAT((*tier)->Take("p", 2 * kMiB, &extent), IsOk());
  const HostTierStats stats = (*tier)->Stats();
  EXPECT_TRUE(stats.ready);
  EXPECT_FALSE(stats.registered);
  EXPECT_THAT(device.registered_host(), ::testing::IsEmpty());
  absl::MutexLock lock(&lines_mu);
  EXPECT_THAT(lines, ::testing::Contains(HasSubstr("not registered (no pinnable memory)")));
}

TEST(HostTierTest, TakeWaitsForThePreparationOnlyUntilItsDeadline) {
  absl::StatusOr<std::unique_ptr<Device>> host =
      OpenDevice({.backend = "host", .host_capacity = 64 * kMiB, .host_granularity = 2 * kMiB});
  ASSERT_THAT(host, IsOk());
  FaultDevice device(*std::move(host));
  absl::Notification registered;
  device.HoldRegistrations(&registered);
  auto tier = HostTier::Create(&device, {.bytes = 8 * kMiB}, 2 * kMiB);
  ASSERT_THAT(tier, IsOk());
  uint64_t extent = 0;
  EXPECT_THAT((*tier)->Take("p", 2 * kMiB, &extent, absl::Now() + absl::Milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("still being allocated and registered")));
  EXPECT_FALSE((*tier)->Stats().ready);
  EXPECT_EQ((*tier)->Stats().used_bytes, 0u) << "nothing taken";
  registered.Notify();
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t offset, (*tier)->Take("p", 2 * kMiB, &extent, absl::Now() + absl::Seconds(60)));
  EXPECT_EQ(offset, 0u);
  EXPECT_TRUE((*tier)->Stats().registered);
}

TEST(HostTierTest, ARegistrationPieceThatIsNotAMultipleOfTheAlignmentIsRefused) {
  absl::StatusOr<std::unique_ptr<Device>> host =
      OpenDevice({.backend = "host", .host_capacity = 64 * kMiB, .host_granularity = 2 * kMiB});
  ASSERT_THAT(host, IsOk());
  EXPECT_THAT(HostTier::Create(host->get(), {.bytes = 4 * kMiB, .register_piece_bytes = 3 * kMiB}, 2 * kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("register_piece_bytes")));
}

TEST_F(DurableTest, ARecordWithoutItsFdRecoversAndAnFdWithoutARecordIsReleased) {
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kFdStore});
  Start(&memory, &memory);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  ASSERT_THAT(before.chunks, SizeIs(2));
  const uint64_t lost = before.chunks[1].id;
  manager_->Shutdown(/*keep_pools=*/true);
  // The crash windows of Note [Durable pools]: a chunk whose FD the store lost, and an FD of a grow that
  // never committed (no record names it).
  memory.DropChunkFd(lost);
  constexpr uint64_t kStray = 77;
  ASSERT_THAT(memory.KeepChunkFd(kStray, Memfd(4 * kMiB).get()), IsOk());

  const RestoreReport report = Restart();
  EXPECT_EQ(report.pools_restored, 0u);
  EXPECT_EQ(report.pools_recovering, 1u);
  EXPECT_EQ(report.chunks_adopted, 1u);
  EXPECT_EQ(report.chunks_missing, 1u);
  EXPECT_EQ(report.fds_released, 1u);
  EXPECT_THAT(report.lines, ::testing::Contains(HasSubstr(absl::StrCat("chunk ", kStray))));
  EXPECT_FALSE(memory.kept_chunk_ids().contains(kStray)) << "the stray FD left the store";
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(pool.state, PoolState::kRecovering);
  EXPECT_THAT(pool.missing_chunk_ids, ElementsAre(lost));
  // The missing bytes stay counted: a client may still map them.
  EXPECT_EQ(Committed(), 8 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 1);
}

TEST_F(DurableTest, ReturnHandlesAdoptsMissingChunksAndRefusesAWrongFdAllOrNothing) {
  // No FD store: the memory survives in the client that maps it.
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kClients});
  Start(&memory, &memory);
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  std::map<uint64_t, UniqueFd> held = Fetch("p");
  ASSERT_THAT(held, SizeIs(2));
  for (const auto& [id, fd] : held) ASSERT_TRUE(Pattern(fd.get(), id, /*check=*/false));
  const uint64_t a = held.begin()->first;
  const uint64_t b = std::next(held.begin())->first;

  const RestoreReport report = Restart();
  EXPECT_EQ(report.pools_recovering, 1u);
  EXPECT_EQ(report.chunks_missing, 2u);
  EXPECT_EQ(device_->live_chunks(), 0);
  auto give = [&](std::vector<std::pair<uint64_t, int>> what) {
    std::vector<std::pair<uint64_t, UniqueFd>> fds;
    for (auto [id, fd] : what) fds.emplace_back(id, UniqueFd(dup(fd)));
    return manager_->ReturnHandles(alice_.session, alice_.uid, "p", std::move(fds));
  };

  // An FD that is not chunk memory of the chunk's size: refused, and the good one beside it not adopted.
  UniqueFd small = Memfd(2 * kMiB - 4096);
  EXPECT_THAT(give({{a, held[a].get()}, {b, small.get()}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("chunk_ids[1]: the FD given for chunk ", b))));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(pool.state, PoolState::kRecovering);
  EXPECT_THAT(pool.missing_chunk_ids, SizeIs(2));
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);

  // One chunk back: adopted, the other still missing.
  KVD_ASSERT_OK_AND_ASSIGN(PoolManager::Returned one, give({{a, held[a].get()}}));
  EXPECT_THAT(one.adopted, ElementsAre(a));
  EXPECT_THAT(one.missing, ElementsAre(b));
  EXPECT_EQ(one.state, PoolState::kRecovering);
  EXPECT_EQ(device_->live_chunks(), 1);
  EXPECT_TRUE(memory.kept_chunk_ids().contains(a));

  // A chunk the daemon has, given with another chunk's FD: not that chunk's memory.
  EXPECT_THAT(give({{a, held[b].get()}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not that chunk's memory")));
  // A chunk not in the table.
  EXPECT_THAT(give({{12345, held[b].get()}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not in pool p's chunk table")));

  // The rest: the pool is as it was saved, every byte in place, the budget as before the restart.
  KVD_ASSERT_OK_AND_ASSIGN(PoolManager::Returned rest, give({{a, held[a].get()}, {b, held[b].get()}}));
  EXPECT_THAT(rest.adopted, ElementsAre(b));
  EXPECT_THAT(rest.missing, IsEmpty());
  EXPECT_EQ(rest.state, PoolState::kAwake);
  held.clear();  // the client lets go: the daemon's handles keep the memory
  EXPECT_EQ(Committed(), 8 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 2);
  for (const auto& [id, fd] : Fetch("p")) EXPECT_TRUE(Pattern(fd.get(), id, /*check=*/true)) << "chunk " << id;
}

TEST_F(DurableTest, TheRecoveryGraceLosesWhatWasNotGivenBackAndTheBudgetStaysExact) {
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kClients});
  Start(&memory, &memory, /*grace=*/absl::Milliseconds(300));
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 64)), IsOk());
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("whole", 32)), IsOk());
  std::map<uint64_t, UniqueFd> held = Fetch("p");
  std::map<uint64_t, UniqueFd> whole = Fetch("whole");
  ASSERT_THAT(held, SizeIs(2));
  const uint64_t a = held.begin()->first;

  Restart();
  EXPECT_EQ(Committed(), 12 * kMiB);
  std::vector<std::pair<uint64_t, UniqueFd>> back;
  back.emplace_back(a, std::move(held[a]));
  ASSERT_THAT(manager_->ReturnHandles(alice_.session, alice_.uid, "p", std::move(back)), IsOk());
  std::vector<std::pair<uint64_t, UniqueFd>> all;
  for (auto& [id, fd] : whole) all.emplace_back(id, std::move(fd));
  ASSERT_THAT(manager_->ReturnHandles(alice_.session, alice_.uid, "whole", std::move(all)), IsOk());
  EXPECT_EQ(device_->live_chunks(), 3);

  // Past the grace: p's missing chunk is lost, its present one released, and p sleeps with its size. The
  // recovery thread publishes the state first, then releases the present chunk and saves the record: wait
  // for all three.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  PoolView pool;
  do {
    absl::SleepFor(absl::Milliseconds(20));
    KVD_ASSERT_OK_AND_ASSIGN(pool, manager_->GetPool(alice_, "p"));
  } while ((pool.state == PoolState::kRecovering || memory.record("p")->state != PoolState::kSleeping ||
            device_->live_chunks() != 2) &&
           absl::Now() < deadline);
  EXPECT_EQ(pool.state, PoolState::kSleeping);
  EXPECT_EQ(pool.committed_bytes, 0u);
  EXPECT_THAT(pool.chunks, IsEmpty());
  EXPECT_EQ(pool.wake_blocks, 64u);
  EXPECT_EQ(memory.record("p")->state, PoolState::kSleeping) << "the loss is saved";
  EXPECT_EQ(memory.kept_chunk_ids().count(a), 0u);
  // The whole pool is untouched; the budget counts exactly its bytes, and then p's as it wakes.
  KVD_ASSERT_OK_AND_ASSIGN(PoolView other, manager_->GetPool(alice_, "whole"));
  EXPECT_EQ(other.state, PoolState::kAwake);
  EXPECT_EQ(Committed(), 4 * kMiB);
  EXPECT_EQ(device_->live_chunks(), 2);
  held.clear();
  ASSERT_THAT(manager_->Wake(alice_, "p"), IsOk());
  EXPECT_EQ(Committed(), 12 * kMiB);
  KVD_ASSERT_OK_AND_ASSIGN(pool, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(pool.committed_blocks, 64u);
}

TEST_F(DurableTest, AFailedSaveIsStickyAndVisibleUntilThatPoolIsSavedAgain) {
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kFdStore});
  FaultStore& faulty = MakeFaulty(&memory);
  Start(&faulty, &memory);
  absl::Mutex mu;
  std::vector<bool> told;
  manager_->Observe({.state_degraded = [&](bool degraded) {
    absl::MutexLock lock(&mu);
    told.push_back(degraded);
  }});
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("q", 32)), IsOk());

  // The grow itself succeeds (the memory is there and in the store); its record is not written.
  faulty.FailNth(FaultStore::Op::kSave, 1, absl::PermissionDeniedError("open pools/.p.tmp: Permission denied"));
  ASSERT_THAT(manager_->Grow(alice_, "p", 64), IsOk());
  StateHealth health = manager_->state_health();
  EXPECT_TRUE(health.degraded());
  EXPECT_EQ(health.save_failures, 1u);
  EXPECT_EQ(health.stale_pools, 1u);
  EXPECT_THAT(health.error, HasSubstr("pool p: its saved record could not be written: open pools/.p.tmp"));
  const DeviceStatus status = *manager_->GetDeviceStatus();
  EXPECT_TRUE(status.state.degraded());
  EXPECT_EQ(status.state.error, health.error);
  EXPECT_THAT(memory.record("p")->chunks, SizeIs(2)) << "the store still has the record before the grow";

  // Sticky: another pool's save does not clear it.
  ASSERT_THAT(manager_->Grow(alice_, "q", 64), IsOk());
  EXPECT_TRUE(manager_->state_health().degraded());
  // The next save of p does, and the count of failures stays.
  ASSERT_THAT(manager_->SetPoolMetadata(alice_, "p", 0, "engine state"), IsOk());
  health = manager_->state_health();
  EXPECT_FALSE(health.degraded());
  EXPECT_EQ(health.error, "");
  EXPECT_EQ(health.save_failures, 1u);
  EXPECT_THAT(memory.record("p")->chunks, SizeIs(4));

  // A record a delete could not remove is stale too, until the name is saved (or removed) again.
  faulty.FailNth(FaultStore::Op::kForget, 1, absl::PermissionDeniedError("unlink pools/q: Permission denied"));
  ASSERT_THAT(manager_->DeletePool(alice_, "q", false), IsOk());
  health = manager_->state_health();
  EXPECT_TRUE(health.degraded());
  EXPECT_EQ(health.save_failures, 2u);
  EXPECT_THAT(health.error, HasSubstr("pool q: its saved record could not be removed: unlink pools/q"));
  EXPECT_TRUE(memory.record("q").has_value());
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("q", 32)), IsOk());
  EXPECT_FALSE(manager_->state_health().degraded());

  absl::MutexLock lock(&mu);
  EXPECT_THAT(told, ElementsAre(false, true, false, true, false));
}

TEST_F(DurableTest, AnFdTheStoreRefusesLeavesNothingBehindWhereverAChunkIsMade) {
  MemoryStateStore& memory = MakeMemory({.durability = Durability::kFdStore});
  FaultStore& faulty = MakeFaulty(&memory);
  Start(&faulty, &memory);
  const absl::Status full = absl::ResourceExhaustedError("chunks: the FD store is full");
  ASSERT_THAT(manager_->CreatePool(alice_, Spec("p", 32)), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 64), IsOk());
  ASSERT_THAT(manager_->Grow(alice_, "p", 96), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolView before, manager_->GetPool(alice_, "p"));
  ASSERT_THAT(before.chunks, SizeIs(6));
  const std::set<uint64_t> kept = memory.kept_chunk_ids();
  const uint64_t committed = Committed();
  auto unchanged = [&](absl::string_view where) {
    SCOPED_TRACE(where);
    KVD_ASSERT_OK_AND_ASSIGN(PoolView now, manager_->GetPool(alice_, "p"));
    EXPECT_EQ(Ids(now.chunks), Ids(before.chunks));
    EXPECT_EQ(now.state, before.state);
    EXPECT_EQ(memory.kept_chunk_ids(), kept);
    EXPECT_EQ(Committed(), committed);
    EXPECT_EQ(device_->live_chunks(), static_cast<int>(before.chunks.size()));
    // The daemon's view: unmapped until a change touched the bytes (Note [The daemon maps on demand]), then whole.
    EXPECT_THAT(device_->live_mappings(), AnyOf(0, static_cast<int>(before.chunks.size())));
    EXPECT_EQ(device_->live_reservations(), 1);
  };

  // A grow (Stage): the second of its two chunks is refused.
  faulty.FailNth(FaultStore::Op::kKeep, 2, full);
  EXPECT_THAT(manager_->Grow(alice_, "p", 128),
              StatusIs(absl::StatusCode::kResourceExhausted, "chunks: the FD store is full"));
  unchanged("grow");
  // A compaction (Reshaper::RunLocked): its new chunks, one per segment.
  faulty.FailNth(FaultStore::Op::kKeep, 2, full);
  EXPECT_THAT(manager_->Compact(alice_, "p", {}), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("full")));
  unchanged("compact");
  EXPECT_FALSE(manager_->state_health().degraded()) << "a refused FD fails the change, it is not a stale record";

  // ReturnHandles: a client gives back both chunks of a recovering pool; the store refuses the second.
  std::map<uint64_t, UniqueFd> held = Fetch("p");
  const RestoreReport report = [&] {
    manager_->Shutdown(true);
    for (uint64_t id : kept) memory.DropChunkFd(id);  // the store lost them all: the client has them
    manager_.reset();
    SavedState saved = memory.Reopen();
    Launch(saved.epoch + 1);
    return manager_->Restore(std::move(saved));
  }();
  alice_ = Session(1000, "alice");
  ASSERT_EQ(report.chunks_missing, 6u);
  std::vector<std::pair<uint64_t, UniqueFd>> back;
  for (const auto& [id, fd] : held) back.emplace_back(id, UniqueFd(dup(fd.get())));
  faulty.FailNth(FaultStore::Op::kKeep, 2, full);
  EXPECT_THAT(manager_->ReturnHandles(alice_.session, alice_.uid, "p", std::move(back)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("full")));
  KVD_ASSERT_OK_AND_ASSIGN(PoolView pool, manager_->GetPool(alice_, "p"));
  EXPECT_EQ(pool.state, PoolState::kRecovering);
  EXPECT_THAT(pool.missing_chunk_ids, SizeIs(6));
  EXPECT_THAT(memory.kept_chunk_ids(), IsEmpty());
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);
}

}  // namespace
}  // namespace kvd::daemon
