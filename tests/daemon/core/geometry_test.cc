#include "daemon/core/geometry.h"

#include <algorithm>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::HasSubstr;
__extension__ typedef unsigned __int128 u128;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// The placement derived independently of Geometry, from the definition of a segment: the dims before
// B pick the segment (row-major), B picks the block inside it, the dims after B are dense inside the
// block. Computed in 128 bits so it cannot overflow where Geometry would.
u128 ReferenceOffset(Layout layout, const PoolDims& d, uint64_t granularity, const std::array<uint64_t, 5>& idx) {
  const auto& order = layout.order();
  const int bp = layout.block_position();
  u128 inner = 0, block_bytes = d.element_bytes;
  for (int i = bp + 1; i < kNumDims; ++i) {
    inner = inner * d.size(order[i]) + idx[static_cast<int>(order[i])];
    block_bytes *= d.size(order[i]);
  }
  const u128 seg_bytes = block_bytes * d.capacity_blocks;
  const u128 seg_stride = (seg_bytes + granularity - 1) / granularity * granularity;
  u128 segment = 0;
  for (int i = 0; i < bp; ++i) segment = segment * d.size(order[i]) + idx[static_cast<int>(order[i])];
  return segment * seg_stride + u128{idx[1]} * block_bytes + inner * d.element_bytes;
}

u128 ReferenceSegmentStride(Layout layout, const PoolDims& d, uint64_t granularity) {
  u128 block_bytes = d.element_bytes;
  for (int i = layout.block_position() + 1; i < kNumDims; ++i) block_bytes *= d.size(layout.order()[i]);
  return (block_bytes * d.capacity_blocks + granularity - 1) / granularity * granularity;
}

uint64_t ReferenceSegments(Layout layout, const PoolDims& d) {
  uint64_t s = 1;
  for (int i = 0; i < layout.block_position(); ++i) s *= d.size(layout.order()[i]);
  return s;
}

std::string Name(Layout layout, const PoolDims& d) {
  return absl::StrCat(layout.name(), "_L", d.layers, "B", d.capacity_blocks, "H", d.heads, "N", d.block_tokens, "C",
                      d.channels, "e", d.element_bytes);
}

// ----- Small pools: every element, exhaustively -------------------------------------------------

// One test pool. Printed as its name, which ctest shows as the test's name.
struct GeometryCase {
  Layout layout;
  PoolDims dims;
  uint64_t granularity;
};
void PrintTo(const GeometryCase& c, std::ostream* os) { *os << Name(c.layout, c.dims) << "_g" << c.granularity; }

// Every layout with every one of `dims`.
std::vector<GeometryCase> AllLayoutsOf(const std::vector<std::pair<PoolDims, uint64_t>>& dims) {
  std::vector<GeometryCase> out;
  for (Layout layout : Layout::All()) {
    for (const auto& [d, granularity] : dims) out.push_back({layout, d, granularity});
  }
  return out;
}

class SmallGeometryTest : public ::testing::TestWithParam<GeometryCase> {
 protected:
  Layout layout() const { return GetParam().layout; }
  const PoolDims& dims() const { return GetParam().dims; }
  uint64_t granularity() const { return GetParam().granularity; }

  // Calls fn(idx) for every (l, b, h, n, c).
  template <typename Fn>
  void ForEachElement(Fn fn) const {
    const PoolDims& d = dims();
    for (uint64_t l = 0; l < d.layers; ++l)
      for (uint64_t b = 0; b < d.capacity_blocks; ++b)
        for (uint64_t h = 0; h < d.heads; ++h)
          for (uint64_t n = 0; n < d.block_tokens; ++n)
            for (uint64_t c = 0; c < d.channels; ++c) fn(std::array<uint64_t, 5>{l, b, h, n, c});
  }
};

TEST_P(SmallGeometryTest, EveryElementSitsWhereTheFormulaSays) {
  KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout(), dims(), granularity()));
  ForEachElement([&](const std::array<uint64_t, 5>& i) {
    const uint64_t got = g.ByteOffset(i[0], i[1], i[2], i[3], i[4]);
    ASSERT_EQ(u128{got}, ReferenceOffset(layout(), dims(), granularity(), i))
        << "element (" << i[0] << "," << i[1] << "," << i[2] << "," << i[3] << "," << i[4] << ")";
    ASSERT_EQ(got, g.offset() + i[0] * g.stride(Dim::kL) + i[1] * g.stride(Dim::kB) + i[2] * g.stride(Dim::kH) +
                       i[3] * g.stride(Dim::kN) + i[4] * g.stride(Dim::kC));
    if (i[2] == 0 && i[3] == 0 && i[4] == 0) {
      ASSERT_EQ(got, g.offset() + i[0] * g.layer_stride() + i[1] * g.block_stride());
    }
  });
}

TEST_P(SmallGeometryTest, NoTwoElementsOverlapAndAllFitTheReservation) {
  KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout(), dims(), granularity()));
  std::vector<uint64_t> offsets;
  ForEachElement(
      [&](const std::array<uint64_t, 5>& i) { offsets.push_back(g.ByteOffset(i[0], i[1], i[2], i[3], i[4])); });
  std::sort(offsets.begin(), offsets.end());
  const uint64_t e = dims().element_bytes;
  for (size_t k = 1; k < offsets.size(); ++k) ASSERT_GE(offsets[k] - offsets[k - 1], e) << "at offset " << offsets[k];
  ASSERT_LE(offsets.back() + e, g.reserved_bytes());
  EXPECT_EQ(g.reserved_bytes(), g.segments() * g.segment_stride());
}

TEST_P(SmallGeometryTest, SegmentsAreTheDimsOutsideB) {
  KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout(), dims(), granularity()));
  EXPECT_EQ(g.segments(), ReferenceSegments(layout(), dims()));
  EXPECT_EQ(u128{g.segment_stride()}, ReferenceSegmentStride(layout(), dims(), granularity()));
  EXPECT_EQ(g.segment_stride() % granularity(), 0u);
  EXPECT_GE(g.segment_stride(), g.segment_bytes());
  EXPECT_EQ(g.segment_bytes(), g.block_stride() * dims().capacity_blocks);
}

TEST_P(SmallGeometryTest, CommittedBlocksLieInsideEverySegmentsCommittedPrefix) {
  KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout(), dims(), granularity()));
  for (uint64_t committed = 0; committed <= dims().capacity_blocks; ++committed) {
    const uint64_t prefix = g.PrefixBytes(committed);
    ASSERT_EQ(prefix % granularity(), 0u);
    ASSERT_LE(prefix, g.segment_stride());
    ASSERT_GE(g.BlocksInPrefix(prefix), committed);
    ForEachElement([&](const std::array<uint64_t, 5>& i) {
      if (i[1] >= committed) return;
      const uint64_t at = g.ByteOffset(i[0], i[1], i[2], i[3], i[4]) - g.offset();
      const uint64_t in_segment = at % g.segment_stride();
      ASSERT_LE(in_segment + dims().element_bytes, prefix) << "block " << i[1] << " of " << committed;
    });
  }
}

TEST_P(SmallGeometryTest, GrowingAddsChunksAfterThePrefixAndMovesNothing) {
  KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout(), dims(), granularity()));
  const uint64_t cap = dims().capacity_blocks;
  const uint64_t max_chunk = granularity();  // smallest cap: forces splitting wherever possible
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> backed(g.segments());  // [start, end) per segment
  uint64_t prefix = 0;
  for (uint64_t target : {uint64_t{1}, cap / 2, cap / 2, cap}) {
    KVD_ASSERT_OK_AND_ASSIGN(std::vector<PlannedChunk> plan, g.PlanGrow(prefix, target, max_chunk));
    for (const PlannedChunk& c : plan) {
      ASSERT_LT(c.segment, g.segments());
      ASSERT_GT(c.bytes, 0u);
      ASSERT_LE(c.bytes, max_chunk);
      ASSERT_EQ(c.bytes % granularity(), 0u);
      ASSERT_EQ(c.offset % granularity(), 0u);
      const uint64_t start = c.offset - g.SegmentOffset(c.segment);
      // Each chunk extends its segment's backed prefix exactly: no gap, no overlap.
      const uint64_t end_so_far = backed[c.segment].empty() ? 0 : backed[c.segment].back().second;
      ASSERT_EQ(start, end_so_far) << "segment " << c.segment;
      backed[c.segment].push_back({start, start + c.bytes});
    }
    prefix = std::max(prefix, g.PrefixBytes(target));
    for (uint64_t s = 0; s < g.segments(); ++s) {
      const uint64_t end = backed[s].empty() ? 0 : backed[s].back().second;
      ASSERT_EQ(end, prefix) << "segment " << s << " after growing to " << target;
    }
    EXPECT_GE(g.BlocksInPrefix(prefix), target);
  }
  // The geometry never depended on the committed size: block 0's first element never moved.
  EXPECT_EQ(g.ByteOffset(0, 0, 0, 0, 0), g.offset());
}

TEST_P(SmallGeometryTest, SpanDescribesEachBlockAsOneRunPerSegment) {
  KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout(), dims(), granularity()));
  const uint64_t base = uint64_t{1} << 40;
  const BlockSpan span = g.Span(base, dims().capacity_blocks);
  ForEachElement([&](const std::array<uint64_t, 5>& i) {
    const uint64_t at = base + g.ByteOffset(i[0], i[1], i[2], i[3], i[4]);
    const uint64_t s = (at - span.base) / span.segment_stride;
    const uint64_t run = span.base + s * span.segment_stride + i[1] * span.block_bytes;
    ASSERT_LT(s, span.segments);
    ASSERT_GE(at, run);
    ASSERT_LE(at + dims().element_bytes, run + span.block_bytes);
  });
  EXPECT_EQ(span.packed_block_bytes() * dims().capacity_blocks, dims().layers * dims().capacity_blocks * dims().heads *
                                                                    dims().block_tokens * dims().channels *
                                                                    dims().element_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    AllLayouts, SmallGeometryTest,
    ::testing::ValuesIn(AllLayoutsOf({
        {{.layers = 2, .capacity_blocks = 3, .heads = 2, .block_tokens = 2, .channels = 4, .element_bytes = 2}, 64},
        // MLA: H = 1.
        {{.layers = 3, .capacity_blocks = 5, .heads = 1, .block_tokens = 4, .channels = 7, .element_bytes = 1}, 32},
        // Odd sizes, and a granularity far larger than a segment.
        {{.layers = 3, .capacity_blocks = 7, .heads = 3, .block_tokens = 5, .channels = 3, .element_bytes = 3}, 4096},
        // Segments that are exact multiples of the granularity (no padding).
        {{.layers = 4, .capacity_blocks = 8, .heads = 2, .block_tokens = 4, .channels = 2, .element_bytes = 2}, 128},
        // One of everything.
        {{.layers = 1, .capacity_blocks = 1, .heads = 1, .block_tokens = 1, .channels = 1, .element_bytes = 1}, 1},
        // Granularity smaller than a block: chunks split inside a block.
        {{.layers = 2, .capacity_blocks = 6, .heads = 5, .block_tokens = 3, .channels = 8, .element_bytes = 2}, 16},
    })));

// ----- Big pools: sampled ----------------------------------------------------------------------

class BigGeometryTest : public ::testing::TestWithParam<GeometryCase> {};

TEST_P(BigGeometryTest, SampledElementsSitWhereTheFormulaSaysAndDoNotOverlap) {
  const auto& [layout, d, g2m] = GetParam();
  KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout, d, g2m));
  std::mt19937_64 rng(42);
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  std::vector<std::pair<std::array<uint64_t, 5>, uint64_t>> samples;
  for (int k = 0; k < 20000; ++k) {
    std::array<uint64_t, 5> i{pick(d.layers), pick(d.capacity_blocks), pick(d.heads), pick(d.block_tokens),
                              pick(d.channels)};
    if (k < 32)
      i = {k & 1 ? d.layers - 1 : 0, k & 2 ? d.capacity_blocks - 1 : 0, k & 4 ? d.heads - 1 : 0,
           k & 8 ? d.block_tokens - 1 : 0, k & 16 ? d.channels - 1 : 0};  // the corners
    const uint64_t got = g.ByteOffset(i[0], i[1], i[2], i[3], i[4]);
    ASSERT_EQ(u128{got}, ReferenceOffset(layout, d, g2m, i));
    ASSERT_LE(u128{got} + d.element_bytes, u128{g.reserved_bytes()});
    samples.push_back({i, got});
  }
  // Distinct elements never share a byte.
  std::sort(samples.begin(), samples.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  for (size_t k = 1; k < samples.size(); ++k) {
    if (samples[k].first == samples[k - 1].first) continue;
    ASSERT_GE(samples[k].second - samples[k - 1].second, d.element_bytes);
  }
}

TEST_P(BigGeometryTest, PlanGrowSplitsOnlyPastTheMaximumChunk) {
  const auto& [layout, d, granularity] = GetParam();
  KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout, d, granularity));
  const uint64_t max_chunk = uint64_t{4} << 30;
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PlannedChunk> plan, g.PlanGrow(0, d.capacity_blocks, max_chunk));
  const uint64_t per_segment = (g.segment_stride() + max_chunk - 1) / max_chunk;
  EXPECT_EQ(plan.size(), g.segments() * per_segment);
  uint64_t total = 0;
  for (const PlannedChunk& c : plan) {
    ASSERT_LE(c.bytes, max_chunk);
    total += c.bytes;
  }
  EXPECT_EQ(total, g.reserved_bytes());
}

INSTANTIATE_TEST_SUITE_P(
    AllLayouts, BigGeometryTest,
    ::testing::ValuesIn(AllLayoutsOf({
        // Llama-70B-like: 80 layers, GQA 8 KV heads x (K, V), 16-token blocks, bf16.
        {{.layers = 80,
          .capacity_blocks = 200003,
          .heads = 16,
          .block_tokens = 16,
          .channels = 128,
          .element_bytes = 2},
         2 * kMiB},
        // DeepSeek-like MLA: H = 1, 576 channels, fp8.
        {{.layers = 61,
          .capacity_blocks = 1000001,
          .heads = 1,
          .block_tokens = 64,
          .channels = 576,
          .element_bytes = 1},
         2 * kMiB},
        // Odd everything.
        {{.layers = 37, .capacity_blocks = 99991, .heads = 3, .block_tokens = 7, .channels = 129, .element_bytes = 3},
         2 * kMiB},
    })));

// ----- Overflow and validation -----------------------------------------------------------------

TEST(GeometryTest, SizesThatOverflow64BitsAreRejectedForEveryLayout) {
  // 2^20 * 2^30 * 2^3 * 2^4 * 2^6 * 2 = 2^64: one byte too many.
  const PoolDims over{.layers = 1 << 20,
                      .capacity_blocks = 1 << 30,
                      .heads = 8,
                      .block_tokens = 16,
                      .channels = 64,
                      .element_bytes = 2};
  // Half of it fits exactly (2^63 bytes, granularity-aligned, so no padding).
  PoolDims fits = over;
  fits.channels = 32;
  for (Layout layout : Layout::All()) {
    SCOPED_TRACE(layout.name());
    EXPECT_THAT(Geometry::Compute(layout, over, 2 * kMiB),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows 64 bits")));
    KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout, fits, 2 * kMiB));
    EXPECT_EQ(g.reserved_bytes(), uint64_t{1} << 63);
    const std::array<uint64_t, 5> last{fits.layers - 1, fits.capacity_blocks - 1, fits.heads - 1, fits.block_tokens - 1,
                                       fits.channels - 1};
    EXPECT_EQ(u128{g.ByteOffset(last[0], last[1], last[2], last[3], last[4])},
              ReferenceOffset(layout, fits, 2 * kMiB, last));
    EXPECT_EQ(g.ByteOffset(last[0], last[1], last[2], last[3], last[4]) + 2, g.reserved_bytes());
  }
}

TEST(GeometryTest, PaddingThatOverflowsIsRejected) {
  // One segment of 2^64 - 1 bytes: fine unpadded, but padding to 2 MiB overflows.
  const PoolDims d{.layers = 1,
                   .capacity_blocks = 0xFFFFFFFFull,
                   .heads = 1,
                   .block_tokens = 1,
                   .channels = 0x100000001ull,
                   .element_bytes = 1};
  EXPECT_THAT(Geometry::Compute(Layout::Default(), d, 2 * kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dims.capacity_blocks")));
}

TEST(GeometryTest, ZeroDimsAreRejectedNamingTheField) {
  const PoolDims ok{
      .layers = 2, .capacity_blocks = 4, .heads = 2, .block_tokens = 16, .channels = 64, .element_bytes = 2};
  const std::vector<std::pair<uint64_t PoolDims::*, const char*>> fields = {
      {&PoolDims::layers, "dims.layers"},     {&PoolDims::capacity_blocks, "dims.capacity_blocks"},
      {&PoolDims::heads, "dims.heads"},       {&PoolDims::block_tokens, "dims.block_tokens"},
      {&PoolDims::channels, "dims.channels"}, {&PoolDims::element_bytes, "dims.element_bytes"}};
  for (const auto& [member, field] : fields) {
    PoolDims d = ok;
    d.*member = 0;
    EXPECT_THAT(Geometry::Compute(Layout::Default(), d, 2 * kMiB),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(absl::StrCat(field, ": must be > 0"))));
  }
  EXPECT_THAT(Geometry::Compute(Layout::Default(), ok, 3000),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("granularity")));
}

TEST(GeometryTest, PlanGrowRejectsTargetsPastTheCapacityAndBadChunkSizes) {
  KVD_ASSERT_OK_AND_ASSIGN(
      Geometry g,
      Geometry::Compute(
          Layout::Default(),
          {.layers = 2, .capacity_blocks = 10, .heads = 2, .block_tokens = 16, .channels = 64, .element_bytes = 2},
          4096));
  EXPECT_THAT(g.PlanGrow(0, 11, 4096), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_blocks")));
  EXPECT_THAT(g.PlanGrow(0, 5, 1000), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_chunk_bytes")));
  EXPECT_THAT(g.PlanGrow(100, 5, 4096), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prefix_bytes")));
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PlannedChunk> none, g.PlanGrow(g.PrefixBytes(5), 3, 4096));
  EXPECT_TRUE(none.empty());
}

TEST(GeometryTest, WorkedExampleMatchesDocsLayoutsTable) {
  // The example pool of docs/layouts.md: L=32, B=1000, H=8, N=16, C=128, bf16, 2 MiB granularity.
  const PoolDims d{
      .layers = 32, .capacity_blocks = 1000, .heads = 8, .block_tokens = 16, .channels = 128, .element_bytes = 2};
  struct Row {
    const char* layout;
    uint64_t l, b, h, n, c, segments, segment_stride;
  };
  const Row rows[] = {
      {"LBHNC", 33554432, 32768, 4096, 256, 2, 32, 33554432},   {"LBNHC", 33554432, 32768, 256, 2048, 2, 32, 33554432},
      {"LHBNC", 33554432, 4096, 4194304, 256, 2, 256, 4194304}, {"BLHNC", 32768, 1048576, 4096, 256, 2, 1, 1048576000},
      {"BLNHC", 32768, 1048576, 256, 2048, 2, 1, 1048576000},   {"BHLNC", 4096, 1048576, 131072, 256, 2, 1, 1048576000},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.layout);
    KVD_ASSERT_OK_AND_ASSIGN(Layout layout, Layout::Parse(r.layout));
    KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout, d, 2 * kMiB));
    EXPECT_EQ(g.stride(Dim::kL), r.l);
    EXPECT_EQ(g.stride(Dim::kB), r.b);
    EXPECT_EQ(g.stride(Dim::kH), r.h);
    EXPECT_EQ(g.stride(Dim::kN), r.n);
    EXPECT_EQ(g.stride(Dim::kC), r.c);
    EXPECT_EQ(g.segments(), r.segments);
    EXPECT_EQ(g.segment_stride(), r.segment_stride);
  }
}

}  // namespace
}  // namespace kvd::daemon
