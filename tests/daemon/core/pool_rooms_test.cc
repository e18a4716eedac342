// Pool's rooms on their own: the chunk table, the reshape planner over it, the release ledger, the pause
// scope (daemon/core/chunk_table.h, reshape_plan.h, release_ledger.h, pause_scope.h), and the chunk maker
// (chunk_maker.h) against the host device behind a FaultDevice. PoolManager's tests cover how they work
// together.
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "daemon/core/budget.h"
#include "daemon/core/chunk_maker.h"
#include "daemon/core/chunk_table.h"
#include "daemon/core/memory_state_store.h"
#include "daemon/core/pause_scope.h"
#include "daemon/core/release_ledger.h"
#include "daemon/core/reshape_plan.h"
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
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Two segments (layers) of 64 blocks of 2 MiB each: a block is one granule, so block b of a segment is
// bytes [b * 2 MiB, (b + 1) * 2 MiB) of it, and segment s starts at s * 128 MiB.
Geometry TwoSegments() {
  const PoolDims dims{
      .layers = 2, .capacity_blocks = 64, .heads = 1, .block_tokens = 1, .channels = 512 * 1024, .element_bytes = 4};
  return *Geometry::Compute(Layout::Default(), dims, 2 * kMiB);
}

// A table whose segments have chunks of `sizes` (MiB, from offset 0 of each segment), with no memory behind
// them: the planner reads only their places.
ChunkTable Table(const Geometry* g, const std::vector<uint64_t>& sizes_mib, uint64_t prefix_mib) {
  ChunkTable table(g, prefix_mib * kMiB);
  std::vector<ChunkRecord> chunks;
  uint64_t id = 1;
  for (uint64_t s = 0; s < g->segments(); ++s) {
    uint64_t at = 0;
    for (uint64_t mib : sizes_mib) {
      chunks.push_back(
          {.info = {.id = id++, .segment = s, .offset = g->SegmentOffset(s) + at * kMiB, .bytes = mib * kMiB}});
      at += mib;
    }
  }
  table.Recover(std::move(chunks), {});
  return table;
}

TEST(ChunkTableTest, TakesWholeChunksFromAPrefixAndKeepsTheStraddlingOne) {
  const Geometry g = TwoSegments();
  ChunkTable table = Table(&g, {8, 8, 8}, 24);
  EXPECT_EQ(table.committed_blocks(), 12u);
  std::vector<ChunkRecord> released;
  const std::vector<ChunkInfo> taken = table.TakeFrom(12 * kMiB, &released);
  ASSERT_EQ(taken.size(), 2u);  // the third chunk of each segment
  EXPECT_EQ(released.size(), 2u);
  EXPECT_EQ(table.prefix_bytes(), 16 * kMiB) << "the straddling chunk stays, so the prefix ends after it";
  EXPECT_EQ(table.TailBytes(), 0u);
  EXPECT_EQ(table.size(), 4u);
}

TEST(ChunkTableTest, ReplacesChunksInPlaceAndCountsTails) {
  const Geometry g = TwoSegments();
  ChunkTable table = Table(&g, {8, 8}, 16);
  std::vector<ChunkRecord> removed;
  std::vector<ChunkRecord> added;
  added.push_back({.info = {.id = 100, .segment = 0, .offset = 8 * kMiB, .bytes = 4 * kMiB}});
  // Segment 0's second chunk is cut to 4 MiB, segment 1's keeps its 8: a tail of 4 MiB past the prefix.
  table.Replace({2}, std::move(added), &removed, 12 * kMiB);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0].info.id, 2u);
  EXPECT_EQ(table.TailBytes(), 4 * kMiB);
  std::vector<uint64_t> ids;
  for (const ChunkInfo& c : table.Infos()) ids.push_back(c.id);
  EXPECT_THAT(ids, ElementsAre(1, 100, 3, 4)) << "sorted by (segment, offset)";
}

TEST(ChunkTableTest, MissingChunksAreAdoptedOnceAndLeftOutOfLeaving) {
  const Geometry g = TwoSegments();
  ChunkTable table(&g, 8 * kMiB);
  std::vector<ChunkRecord> chunks;
  chunks.push_back({.info = {.id = 7, .segment = 1, .offset = g.SegmentOffset(1), .bytes = 8 * kMiB}});
  chunks.push_back({.info = {.id = 5, .segment = 0, .offset = 0, .bytes = 8 * kMiB}});
  table.Recover(std::move(chunks), {7});
  EXPECT_EQ(table.Infos().front().id, 5u) << "restored chunks are put in order";
  EXPECT_EQ(table.Leaving(0).size(), 1u) << "a missing chunk has no memory to release";
  ChunkRecord back{.info = {.id = 7, .segment = 1, .offset = g.SegmentOffset(1), .bytes = 8 * kMiB}};
  EXPECT_TRUE(table.Adopt(back));
  ChunkRecord again{.info = back.info};
  EXPECT_FALSE(table.Adopt(again)) << "no longer missing";
  EXPECT_TRUE(table.missing().empty());
  std::vector<ChunkRecord> present;
  EXPECT_THAT(table.TakeAll(&present), IsEmpty());
  EXPECT_EQ(present.size(), 2u);
  EXPECT_EQ(table.prefix_bytes(), 0u);
}

TEST(ReshapePlanTest, AnExactShrinkReplacesTheStraddlingChunksAndReleasesThoseWhollyPast) {
  const Geometry g = TwoSegments();
  const ChunkTable table = Table(&g, {8, 8, 8}, 24);
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan plan, PlanShrink(table, "p", 6, false, std::nullopt, std::nullopt));
  EXPECT_EQ(plan.prefix_bytes, 12 * kMiB);
  EXPECT_THAT(plan.replaced, ElementsAre(2, 5));
  EXPECT_THAT(plan.released, ElementsAre(3, 6));
  ASSERT_EQ(plan.added.size(), 2u);
  EXPECT_EQ(plan.added[0].offset, 8 * kMiB);
  EXPECT_EQ(plan.added[0].bytes, 4 * kMiB);
  EXPECT_EQ(plan.added[1].offset, g.SegmentOffset(1) + 8 * kMiB);
  EXPECT_EQ(plan.added_bytes(), 8 * kMiB);
  EXPECT_TRUE(plan.target_reached);
  EXPECT_TRUE(plan.moves_bytes());
  // Every segment has a boundary at 16 MiB, past the straddling chunks: the third chunks can go first.
  EXPECT_EQ(plan.release_first_from, 16 * kMiB);
  EXPECT_EQ(plan.release_first_bytes, 16 * kMiB);
}

TEST(ReshapePlanTest, WholeChunksOnlyStopsAtTheStraddlingChunk) {
  const Geometry g = TwoSegments();
  const ChunkTable table = Table(&g, {8, 8, 8}, 24);
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan plan, PlanShrink(table, "p", 6, true, std::nullopt, std::nullopt));
  EXPECT_FALSE(plan.moves_bytes());
  EXPECT_FALSE(plan.target_reached);
  EXPECT_EQ(plan.prefix_bytes, 16 * kMiB);
  EXPECT_THAT(plan.released, ElementsAre(3, 6));
  EXPECT_THAT(PlanShrink(table, "p", 6, true, std::vector<uint64_t>{1}, std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("live")));
}

TEST(ReshapePlanTest, AStepTakesOnlyTheReplacementsThatFitAndTailsFollow) {
  const Geometry g = TwoSegments();
  const ChunkTable table = Table(&g, {8, 8}, 16);
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan step, PlanShrink(table, "p", 6, false, std::nullopt, 5 * kMiB));
  EXPECT_THAT(step.replaced, ElementsAre(2)) << "segment 1's replacement waits for a later step";
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan none, PlanShrink(table, "p", 6, false, std::nullopt, 2 * kMiB));
  EXPECT_TRUE(none.added.empty());
  EXPECT_EQ(none.prefix_bytes, 12 * kMiB) << "the prefix is the target's either way";

  // After that step: the prefix is the target's and segment 1's chunk runs past it.
  const ChunkTable tails = Table(&g, {8, 8}, 12);
  const ReshapePlan all = PlanTails(tails, std::nullopt);
  EXPECT_THAT(all.replaced, ElementsAre(2, 4));
  EXPECT_THAT(PlanTails(tails, 4 * kMiB).replaced, ElementsAre(2));
  EXPECT_TRUE(PlanTails(Table(&g, {8, 8}, 16), std::nullopt).added.empty()) << "no tails, nothing to do";
}

TEST(ReshapePlanTest, LiveBlocksPastTheTargetMoveIntoFreeBlocksBelowIt) {
  const Geometry g = TwoSegments();
  const ChunkTable table = Table(&g, {8, 8}, 16);
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan plan,
                           PlanShrink(table, "p", 4, false, std::vector<uint64_t>{1, 7, 5}, std::nullopt));
  ASSERT_EQ(plan.moves.size(), 2u);
  EXPECT_EQ(plan.moves[0].src, 5u);
  EXPECT_EQ(plan.moves[0].dst, 0u);
  EXPECT_EQ(plan.moves[1].src, 7u);
  EXPECT_EQ(plan.moves[1].dst, 2u);
  EXPECT_THAT(PlanShrink(table, "p", 4, false, std::vector<uint64_t>{1, 8}, std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("live.blocks[1]")));
  EXPECT_THAT(PlanShrink(table, "p", 4, false, std::vector<uint64_t>{3, 3}, std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listed twice")));
  EXPECT_THAT(PlanShrink(table, "p", 1, false, std::vector<uint64_t>{0, 1}, std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("do not fit")));
}

TEST(ReshapePlanTest, ACompactionMakesTheGrowShapeInStepsAndSmallerWhereMemoryIsShort) {
  const Geometry g = TwoSegments();
  const ChunkTable table = Table(&g, {2, 2, 2, 2}, 8);
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan whole, PlanCompact(table, 8 * kMiB, std::nullopt, std::nullopt, false));
  EXPECT_EQ(whole.added.size(), 2u);
  EXPECT_EQ(whole.replaced.size(), 8u);
  EXPECT_TRUE(whole.target_reached);
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan step, PlanCompact(table, 8 * kMiB, 4, std::nullopt, false));
  EXPECT_EQ(step.added.size(), 1u) << "at most 4 old chunks a step, but at least one new chunk";
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan short_of_memory, PlanCompact(table, 8 * kMiB, std::nullopt, 4 * kMiB, false));
  EXPECT_TRUE(short_of_memory.added.empty());
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan smaller, PlanCompact(table, 8 * kMiB, std::nullopt, 4 * kMiB, true));
  ASSERT_EQ(smaller.added.size(), 1u);
  EXPECT_EQ(smaller.added[0].bytes, 4 * kMiB) << "two old chunks merged into one that fits";
  EXPECT_EQ(smaller.replaced.size(), 2u);
  EXPECT_FALSE(smaller.target_reached);
  KVD_ASSERT_OK_AND_ASSIGN(ReshapePlan in_shape,
                           PlanCompact(Table(&g, {8}, 8), 8 * kMiB, std::nullopt, std::nullopt, false));
  EXPECT_FALSE(in_shape.moves_bytes());
}

TEST(ReleaseLedgerTest, AReleaseWaitsForEveryClientThatHoldsOneOfItsChunks) {
  EXPECT_TRUE(ReleaseLedger::Holds({{1, 10}, {2, 10}}, {ChunkInfo{.id = 2}}));
  EXPECT_FALSE(ReleaseLedger::Holds({{1, 10}}, {ChunkInfo{.id = 2}}));

  Budget budget(100);
  budget.Take(60);
  ReleaseLedger ledger(&budget);
  // Nobody holds it: settled at once, its bytes back in the budget.
  EXPECT_EQ(ledger.Open(ledger.NextId(), {.chunks = {{.id = 1, .bytes = 20}}, .bytes = 20}), 0u);
  EXPECT_EQ(budget.committed(), 40u);

  const uint64_t id = ledger.Open(ledger.NextId(), {.chunks = {{.id = 2, .bytes = 40}}, .bytes = 40, .waiting = {"c"}});
  ASSERT_NE(id, 0u);
  EXPECT_EQ(ledger.PendingBytes(), 40u);
  Handed handed{{2, 40}, {3, 10}};
  EXPECT_FALSE(ledger.Acknowledge(id, "other", &handed));
  EXPECT_TRUE(ledger.Acknowledge(id, "c", &handed));
  EXPECT_EQ(handed.size(), 1u) << "the released chunk left what the client holds";
  EXPECT_FALSE(ledger.Pending(id));
  EXPECT_EQ(budget.committed(), 0u);
}

TEST(ReleaseLedgerTest, ADetachedClientHoldsWhatItFetchedUntilItsSessionLetsGo) {
  Budget budget(100);
  budget.Take(30);
  ReleaseLedger ledger(&budget);
  const uint64_t first =
      ledger.Open(ledger.NextId(), {.chunks = {{.id = 1, .bytes = 10}}, .bytes = 10, .waiting = {"c"}});
  ledger.Detach("c", "s", {{1, 10}, {2, 10}}, /*keep_holding=*/true);
  EXPECT_TRUE(ledger.Pending(first));
  ASSERT_TRUE(ledger.IsHolder("c"));
  // A later release of a chunk it holds waits for it too.
  const uint64_t second = ledger.Open(ledger.NextId(), {.chunks = {{.id = 2, .bytes = 10}}, .bytes = 10});
  EXPECT_NE(second, 0u);
  EXPECT_TRUE(ledger.HolderAcknowledge(first, "c"));
  EXPECT_TRUE(ledger.IsHolder("c")) << "it still holds chunk 2";
  EXPECT_THAT(ledger.HoldersOf("s"), ElementsAre("c"));
  // Its session attaches again: the new client is told of the unsettled release and waits for it instead.
  Handed handed;
  std::set<uint64_t> fetched;
  std::vector<uint64_t> told;
  ledger.HandOver("s", "c2", &handed, &fetched, [&](uint64_t id, const Release&) { told.push_back(id); });
  EXPECT_THAT(told, ElementsAre(second));
  EXPECT_FALSE(ledger.IsHolder("c"));
  EXPECT_EQ(fetched, std::set<uint64_t>{2});
  ledger.Forget("c2");
  EXPECT_FALSE(ledger.Pending(second));
  EXPECT_EQ(budget.committed(), 10u) << "the two releases' bytes are back";
}

TEST(PauseScopeTest, WaitsForEveryClientAskedAndLendsTheNewChunksFds) {
  PauseScope scope;
  std::vector<ChunkRecord> added(1);
  added[0].info = {.id = 9, .bytes = 2 * kMiB};
  added[0].exported.reset(dup(0));
  const uint64_t id = scope.Begin(added, {}).id;
  scope.Ask("a");
  scope.Ask("b");
  EXPECT_EQ(scope.Seal(), 2u);
  EXPECT_EQ(scope.FdOf(9), added[0].fd());
  EXPECT_EQ(scope.FdOf(8), -1);
  EXPECT_FALSE(scope.Acknowledge("a", id + 1)) << "another pause";
  EXPECT_TRUE(scope.Acknowledge("a", id));
  EXPECT_FALSE(scope.Settled());
  scope.Forget("b");
  EXPECT_TRUE(scope.Settled());
  std::optional<Pause> ended = scope.End();
  ASSERT_TRUE(ended.has_value());
  EXPECT_EQ(ended->acknowledged, std::set<std::string>{"a"});
  EXPECT_EQ(ended->asked, std::set<std::string>{"a"});
  EXPECT_FALSE(scope.active());
  EXPECT_EQ(scope.FdOf(9), -1);
}

class ChunkMakerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> host =
        OpenDevice({.backend = "host", .host_capacity = 64 * kMiB, .host_granularity = 2 * kMiB});
    ASSERT_THAT(host.status(), IsOk());
    device_ = std::make_unique<FaultDevice>(*std::move(host));
    base_ = *device_->Reserve(32 * kMiB);
  }
  void TearDown() override { device_->Free(base_, 32 * kMiB).IgnoreError(); }

  std::vector<PlannedChunk> Plan() const {
    return {{.segment = 0, .offset = 0, .bytes = 2 * kMiB},
            {.segment = 0, .offset = 2 * kMiB, .bytes = 4 * kMiB},
            {.segment = 0, .offset = 6 * kMiB, .bytes = 2 * kMiB}};
  }

  std::unique_ptr<FaultDevice> device_;
  MemoryStateStore inner_{{.durability = Durability::kFdStore}};
  FaultStore store_{&inner_};
  std::atomic<uint64_t> next_id_{1};
  uint64_t base_ = 0;
};

// The FDs this process has open.
size_t OpenFds() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

TEST_F(ChunkMakerTest, MakesMapsExportsAndKeepsEveryChunkAndDiscardsThem) {
  ChunkMaker maker(device_.get(), &store_, &next_id_, false);
  const size_t fds_before = OpenFds();
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<ChunkRecord> made, maker.Make(base_, Plan(), "needs", ChunkMaker::Map::kNow));
  ASSERT_EQ(made.size(), 3u);
  EXPECT_EQ(device_->live_chunks(), 3);
  EXPECT_EQ(device_->live_mappings(), 3);
  EXPECT_EQ(inner_.kept_chunk_ids(), (std::set<uint64_t>{1, 2, 3}));
  // On host a chunk's handle is its memfd: the record keeps no export beside it (Note [FD hygiene]), so each
  // chunk is one FD here and one in the (in-memory) FD store.
  for (const ChunkRecord& r : made) {
    EXPECT_TRUE(r.handle_is_fd);
    EXPECT_TRUE(r.mapped);
    EXPECT_FALSE(r.exported.valid());
    EXPECT_EQ(r.fd(), static_cast<int>(r.chunk.handle));
  }
  EXPECT_EQ(OpenFds() - fds_before, 2 * made.size());
  for (ChunkRecord& r : made) maker.Discard(base_, r);
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);
  EXPECT_TRUE(inner_.kept_chunk_ids().empty());
}

// Note [The daemon maps on demand]: a grow's chunks are made unmapped, mapped by MapInView when the daemon
// touches them, and a discard unmaps exactly the ones that are.
TEST_F(ChunkMakerTest, MakesChunksUnmappedUntilTheDaemonMapsThemInItsView) {
  ChunkMaker maker(device_.get(), &store_, &next_id_, false);
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<ChunkRecord> made,
                           maker.Make(base_, Plan(), "needs", ChunkMaker::Map::kOnDemand));
  ASSERT_EQ(made.size(), 3u);
  EXPECT_EQ(device_->live_chunks(), 3);
  EXPECT_EQ(device_->live_mappings(), 0);
  for (const ChunkRecord& r : made) EXPECT_FALSE(r.mapped);
  // Unmapped chunks are discarded without an unmap.
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<ChunkRecord> spare,
                           maker.Make(base_, {Plan()[0]}, "needs", ChunkMaker::Map::kOnDemand));
  maker.Discard(base_, spare[0]);
  EXPECT_EQ(device_->live_chunks(), 3);
  // A map that fails part way leaves none of them mapped; the next call maps them all, and one after it none.
  std::vector<ChunkRecord*> all{&made[0], &made[1], &made[2]};
  device_->FailNth(FaultDevice::Op::kMap, 2, absl::InternalError("map failed"));
  EXPECT_THAT(maker.MapInView(base_, all), StatusIs(absl::StatusCode::kInternal, "map failed"));
  for (const ChunkRecord& r : made) EXPECT_FALSE(r.mapped);
  EXPECT_EQ(device_->live_mappings(), 0);
  ASSERT_THAT(maker.MapInView(base_, all), IsOk());
  ASSERT_THAT(maker.MapInView(base_, all), IsOk());
  EXPECT_EQ(device_->live_mappings(), 3);
  // The daemon's view holds the chunks' bytes: what one mapping writes the chunk's FD reads.
  const uint64_t va = base_ + made[2].info.offset;
  std::memset(reinterpret_cast<void*>(va), 0x5a, 4096);
  char back = 0;
  ASSERT_EQ(pread(made[2].fd(), &back, 1, 4095), 1);
  EXPECT_EQ(back, 0x5a);
  for (ChunkRecord& r : made) maker.Discard(base_, r);
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);
}

TEST_F(ChunkMakerTest, AFailureAtAnyStepLeavesNothing) {
  ChunkMaker maker(device_.get(), &store_, &next_id_, false);
  device_->FailNth(FaultDevice::Op::kMap, 3, absl::InternalError("map failed"));
  EXPECT_THAT(maker.Make(base_, Plan(), "needs", ChunkMaker::Map::kNow),
              StatusIs(absl::StatusCode::kInternal, "map failed"));
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);
  // Out of device memory is worded with what was needed.
  device_->FailNth(FaultDevice::Op::kCreate, 2, absl::ResourceExhaustedError("out of memory"));
  EXPECT_THAT(maker.Make(base_, Plan(), "pool p: growing needs 8 MiB", ChunkMaker::Map::kOnDemand),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       ::testing::AllOf(HasSubstr("pool p: growing needs 8 MiB but the device has "),
                                        HasSubstr("bytes free: out of memory"))));
  EXPECT_EQ(device_->live_chunks(), 0);
  // A store that refuses an FD: the ones it took are taken back.
  store_.FailNth(FaultStore::Op::kKeep, 2, absl::ResourceExhaustedError("store full"));
  EXPECT_THAT(maker.Make(base_, Plan(), "needs", ChunkMaker::Map::kNow),
              StatusIs(absl::StatusCode::kResourceExhausted, "store full"));
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(device_->live_mappings(), 0);
  EXPECT_TRUE(inner_.kept_chunk_ids().empty());
}

TEST_F(ChunkMakerTest, AdoptsAChunkFromItsFdAndRefusesOneOfAnotherSize) {
  ChunkMaker maker(device_.get(), &store_, &next_id_, false);
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<ChunkRecord> made,
                           maker.Make(base_, {Plan()[1]}, "needs", ChunkMaker::Map::kOnDemand));
  const ChunkInfo info = made[0].info;
  const UniqueFd fd(dup(made[0].fd()));
  maker.Discard(base_, made[0], ChunkMaker::StoreFd::kLeave);
  EXPECT_THAT(maker.Adopt(base_, {.id = info.id, .offset = info.offset, .bytes = 2 * kMiB}, UniqueFd(dup(fd.get()))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes, the chunk")));
  const size_t fds_before = OpenFds();
  KVD_ASSERT_OK_AND_ASSIGN(ChunkRecord adopted, maker.Adopt(base_, info, UniqueFd(dup(fd.get()))));
  EXPECT_EQ(device_->live_mappings(), 1);
  // The import is a dup of the FD given, which is closed: one FD for the chunk.
  EXPECT_TRUE(adopted.handle_is_fd);
  EXPECT_FALSE(adopted.exported.valid());
  EXPECT_EQ(OpenFds() - fds_before, 1u);
  maker.Discard(base_, adopted, ChunkMaker::StoreFd::kLeave);
  EXPECT_EQ(device_->live_mappings(), 0);
  EXPECT_EQ(device_->live_chunks(), 0);
  EXPECT_EQ(OpenFds(), fds_before);
}

}  // namespace
}  // namespace kvd::daemon
