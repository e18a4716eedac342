#include "daemon/core/transfer.h"

#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// How many times each byte of the pool's reservation is named: by the blocks element by element
// through the placement formula (the reference), or by the descriptors' runs.
std::vector<int> ReferenceBytes(const Geometry& g, const std::vector<uint64_t>& blocks) {
  std::vector<int> bytes(g.reserved_bytes(), 0);
  const PoolDims& d = g.dims();
  for (uint64_t b : blocks) {
    for (uint64_t l = 0; l < d.layers; ++l) {
      for (uint64_t h = 0; h < d.heads; ++h) {
        for (uint64_t n = 0; n < d.block_tokens; ++n) {
          for (uint64_t c = 0; c < d.channels; ++c) {
            const uint64_t at = g.ByteOffset(l, b, h, n, c);
            for (uint64_t e = 0; e < d.element_bytes; ++e) ++bytes[at + e];
          }
        }
      }
    }
  }
  return bytes;
}

std::vector<int> DescribedBytes(const Geometry& g, const std::vector<TransferDescriptor>& ds) {
  std::vector<int> bytes(g.reserved_bytes(), 0);
  for (const TransferDescriptor& d : ds) {
    EXPECT_GE(d.count, 1u);
    EXPECT_GT(d.bytes, 0u);
    EXPECT_EQ(d.segment, (d.offset - g.offset()) / g.segment_stride()) << "the first run's segment";
    if (d.count == 1) {
      EXPECT_EQ(d.stride, d.bytes);
    }
    if (d.count > 1) {
      EXPECT_GE(d.stride, d.bytes) << "runs of one descriptor do not overlap";
    }
    for (uint64_t i = 0; i < d.count; ++i) {
      const uint64_t start = d.offset + i * d.stride;
      EXPECT_LE(start + d.bytes, g.reserved_bytes());
      if (start + d.bytes > g.reserved_bytes()) return bytes;
      for (uint64_t k = 0; k < d.bytes; ++k) ++bytes[start + k];
    }
  }
  return bytes;
}

uint64_t RunCount(std::vector<uint64_t> blocks) {
  std::sort(blocks.begin(), blocks.end());
  uint64_t runs = 0;
  for (size_t i = 0; i < blocks.size(); ++i) runs += (i == 0 || blocks[i] != blocks[i - 1] + 1);
  return runs;
}

void CheckCover(const Geometry& g, uint64_t committed, const std::vector<uint64_t>& blocks) {
  absl::StatusOr<std::vector<TransferDescriptor>> ds = DescribeTransfer(g, committed, blocks);
  ASSERT_THAT(ds.status(), IsOk());
  std::vector<uint64_t> expected_blocks = blocks;
  if (blocks.empty()) {
    for (uint64_t b = 0; b < committed; ++b) expected_blocks.push_back(b);
  }
  ASSERT_EQ(DescribedBytes(g, *ds), ReferenceBytes(g, expected_blocks));
  // Never more descriptors than runs of blocks, whatever the layout.
  EXPECT_LE(ds->size(), RunCount(expected_blocks));
}

struct Dims {
  uint64_t l, b, h, n, c, e;
};

// Every layout, a grid of small dims and two granularities (1: segments unpadded and back to back;
// 64: padded), every subset of the committed blocks.
TEST(TransferTest, EverySubsetOfSmallPoolsMatchesPerByteReference) {
  int cases = 0;
  for (const Layout& layout : Layout::All()) {
    for (const Dims& dm : std::vector<Dims>{
             {1, 5, 1, 2, 3, 2}, {3, 6, 2, 1, 1, 2}, {2, 4, 3, 2, 1, 1}, {3, 1, 2, 2, 2, 1}, {2, 6, 2, 2, 3, 2}}) {
      for (uint64_t gran : {uint64_t{1}, uint64_t{64}}) {
        const PoolDims dims{dm.l, dm.b, dm.h, dm.n, dm.c, dm.e};
        absl::StatusOr<Geometry> g = Geometry::Compute(layout, dims, gran);
        ASSERT_THAT(g.status(), IsOk());
        for (uint64_t committed : {dm.b, dm.b > 1 ? dm.b - 1 : dm.b}) {
          for (uint64_t mask = 0; mask < (uint64_t{1} << committed); ++mask) {
            std::vector<uint64_t> blocks;
            for (uint64_t b = 0; b < committed; ++b) {
              if (mask & (uint64_t{1} << b)) blocks.push_back(b);
            }
            SCOPED_TRACE(absl::StrCat(layout.name(), " L", dm.l, " B", dm.b, " H", dm.h, " N", dm.n, " C", dm.c, " e",
                                      dm.e, " gran ", gran, " committed ", committed, " mask ", mask));
            CheckCover(*g, committed, blocks);
            ++cases;
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

// Larger pools, random block sets in random order (the order of block_ids does not matter).
TEST(TransferTest, RandomBlockSetsMatchPerByteReference) {
  std::mt19937_64 rng(16);
  for (const Layout& layout : Layout::All()) {
    for (int round = 0; round < 40; ++round) {
      const PoolDims dims{1 + rng() % 4, 8 + rng() % 40, 1 + rng() % 3, 1 + rng() % 3, 1 + rng() % 4, 1 + rng() % 2};
      const uint64_t gran = uint64_t{1} << (rng() % 9);
      absl::StatusOr<Geometry> g = Geometry::Compute(layout, dims, gran);
      ASSERT_THAT(g.status(), IsOk());
      const uint64_t committed = 1 + rng() % dims.capacity_blocks;
      std::vector<uint64_t> blocks;
      const int density = static_cast<int>(rng() % 4);
      for (uint64_t b = 0; b < committed; ++b) {
        // Dense, sparse, strided and empty-ish sets.
        if ((density == 0 && rng() % 4 != 0) || (density == 1 && rng() % 4 == 0) || (density == 2 && b % 3 == 1) ||
            (density == 3 && b >= committed / 2)) {
          blocks.push_back(b);
        }
      }
      std::shuffle(blocks.begin(), blocks.end(), rng);
      SCOPED_TRACE(absl::StrCat(layout.name(), " round ", round, " committed ", committed));
      CheckCover(*g, committed, blocks);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

constexpr uint64_t kMiB = uint64_t{1} << 20;

Geometry Make(absl::string_view layout, uint64_t capacity, uint64_t gran = 2 * kMiB) {
  // L = 4, H = 2, N = 16, C = 128, e = 2: one block of one layer is 8 KiB.
  return *Geometry::Compute(*Layout::Parse(layout), PoolDims{4, capacity, 2, 16, 128, 2}, gran);
}

TEST(TransferTest, AllCommittedOfLayerMajorPoolIsOneDescriptorOverSegments) {
  const Geometry g = Make("LBNHC", 1000);
  auto ds = DescribeTransfer(g, 300, {});
  ASSERT_THAT(ds.status(), IsOk());
  EXPECT_THAT(*ds, ElementsAre(TransferDescriptor{0, 0, 300 * 8192, g.segment_stride(), 4}));
}

TEST(TransferTest, AllCommittedOfBlockOutermostPoolIsOneRun) {
  const Geometry g = Make("BLHNC", 1000);
  auto ds = DescribeTransfer(g, 300, {});
  ASSERT_THAT(ds.status(), IsOk());
  EXPECT_THAT(*ds, ElementsAre(TransferDescriptor{0, 0, 300 * g.block_stride(), 300 * g.block_stride(), 1}));
}

TEST(TransferTest, FullUnpaddedSegmentsMergeIntoOneRun) {
  // 256 blocks of 8 KiB = 2 MiB per segment: no padding, segments back to back.
  const Geometry g = Make("LBNHC", 256);
  ASSERT_EQ(g.segment_stride(), g.segment_bytes());
  auto ds = DescribeTransfer(g, 256, {});
  ASSERT_THAT(ds.status(), IsOk());
  EXPECT_THAT(*ds, ElementsAre(TransferDescriptor{0, 0, 4 * 2 * kMiB, 4 * 2 * kMiB, 1}));
}

TEST(TransferTest, EqualRunsAtEqualSpacingFoldIntoOneDescriptor) {
  const Geometry g = Make("BLNHC", 1000);
  const uint64_t bs = g.block_stride();
  std::vector<uint64_t> blocks;
  for (uint64_t b = 10; b < 410; b += 4) {
    blocks.push_back(b);
    blocks.push_back(b + 1);
  }
  auto ds = DescribeTransfer(g, 500, blocks);
  ASSERT_THAT(ds.status(), IsOk());
  EXPECT_THAT(*ds, ElementsAre(TransferDescriptor{0, 10 * bs, 2 * bs, 4 * bs, 100}));
}

TEST(TransferTest, ManyRunsOverFewSegmentsFoldPerSegment) {
  // LHBNC: L*H = 8 segments. 100 runs every other block fold to one descriptor per segment.
  const Geometry g = Make("LHBNC", 1000);
  std::vector<uint64_t> blocks;
  for (uint64_t b = 0; b < 200; b += 2) blocks.push_back(b);
  auto ds = DescribeTransfer(g, 200, blocks);
  ASSERT_THAT(ds.status(), IsOk());
  ASSERT_EQ(ds->size(), 8u);
  EXPECT_EQ((*ds)[3], (TransferDescriptor{3, 3 * g.segment_stride(), g.block_stride(), 2 * g.block_stride(), 100}));
}

TEST(TransferTest, OutOfRangeAndRepeatedIdsNameTheField) {
  const Geometry g = Make("LBNHC", 1000);
  EXPECT_THAT(DescribeTransfer(g, 10, {1, 2, 10}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block_ids[2]: 10 is not a committed block")));
  EXPECT_THAT(DescribeTransfer(g, 10, {5, 1, 5, 1}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block_ids[2]: 5 repeats block_ids[0]")));
}

TEST(TransferTest, NothingCommittedDescribesNothing) {
  const Geometry g = Make("LBNHC", 1000);
  auto ds = DescribeTransfer(g, 0, {});
  ASSERT_THAT(ds.status(), IsOk());
  EXPECT_TRUE(ds->empty());
}

TEST(TransferTest, MergeChunkRangesJoinsTouchingChunksOfOneSegment) {
  std::vector<ChunkInfo> chunks = {{7, 1, 100, 10}, {3, 0, 0, 10}, {4, 0, 10, 10}, {8, 1, 110, 5}, {9, 1, 200, 5}};
  EXPECT_THAT(MergeChunkRanges(chunks), ElementsAre(ByteRange{0, 0, 20}, ByteRange{1, 100, 15}, ByteRange{1, 200, 5}));
}

}  // namespace
}  // namespace kvd::daemon
