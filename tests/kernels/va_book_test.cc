// Tests VaBook (kernels/va_book.h) directly, with made-up addresses and handles: the contract's
// codes for every misuse, and that a failed vendor call leaves the book as it was.
#include "kernels/va_book.h"

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kG = uint64_t{2} << 20;
constexpr uint64_t kBase = uint64_t{1} << 40;  // never dereferenced

absl::Status Ok() { return absl::OkStatus(); }
absl::Status Vendor(const MapSite&) { return absl::OkStatus(); }
absl::Status VendorRange(uint64_t, uint64_t) { return absl::OkStatus(); }
absl::Status VendorRelease(ChunkOrigin) { return absl::OkStatus(); }

class VaBookTest : public ::testing::Test {
 protected:
  // A reservation of 4 granules at kBase and a live chunk of 1 granule (handle 7).
  void SetUp() override {
    ASSERT_THAT(book_.AddReservation(kBase, 4 * kG), IsOk());
    ASSERT_THAT(book_.AddChunk(chunk_, ChunkOrigin::kCreated), IsOk());
  }

  VaBook book_{kG};
  const Chunk chunk_{.handle = 7, .bytes = kG};
};

TEST_F(VaBookTest, SizesMustBePositiveMultiplesOfTheGranularity) {
  EXPECT_THAT(book_.CheckSize("Create", "bytes", 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Create")));
  EXPECT_THAT(book_.CheckSize("Create", "bytes", kG + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("granularity")));
  EXPECT_THAT(book_.CheckSize("Create", "bytes", 3 * kG), IsOk());
  EXPECT_THAT(book_.AddChunk(Chunk{.handle = 8, .bytes = kG / 2}, ChunkOrigin::kCreated),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST_F(VaBookTest, ReservationsThatOverlapAreAnInternalError) {
  EXPECT_THAT(book_.AddReservation(kBase + kG, kG), StatusIs(absl::StatusCode::kInternal, HasSubstr("overlaps")));
  EXPECT_THAT(book_.AddReservation(kBase - kG, 2 * kG), StatusIs(absl::StatusCode::kInternal, ::testing::_));
  EXPECT_THAT(book_.AddReservation(kBase + 4 * kG, kG), IsOk()) << "adjacent is fine";
  EXPECT_EQ(book_.reservation_count(), 2u);
}

TEST_F(VaBookTest, MapRecordsOnlyWhenTheVendorCallSucceeds) {
  EXPECT_THAT(
      book_.Map(kBase, chunk_, Access::kReadWrite, [](const MapSite&) { return absl::InternalError("driver"); }),
      StatusIs(absl::StatusCode::kInternal, "driver"));
  EXPECT_EQ(book_.mapping_count(), 0u) << "a failed vendor map leaves the book unchanged";
  MapSite seen;
  ASSERT_THAT(book_.Map(kBase + kG, chunk_, Access::kReadWrite,
                        [&](const MapSite& site) {
                          seen = site;
                          return absl::OkStatus();
                        }),
              IsOk());
  EXPECT_EQ(seen.reservation_va, kBase);
  EXPECT_EQ(seen.reservation_bytes, 4 * kG);
  EXPECT_EQ(seen.mappings, 0u);
  EXPECT_EQ(book_.mapping_count(), 1u);
}

TEST_F(VaBookTest, MapMisuseGivesTheContractsCodes) {
  ASSERT_THAT(book_.Map(kBase + kG, chunk_, Access::kReadWrite, Vendor), IsOk());
  EXPECT_THAT(book_.Map(kBase + kG, chunk_, Access::kReadWrite, Vendor),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("overlaps")))
      << "over a mapping";
  EXPECT_THAT(book_.Map(kBase + kG / 2, chunk_, Access::kReadWrite, Vendor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("granularity")))
      << "unaligned";
  EXPECT_THAT(book_.Map(kBase + 8 * kG, chunk_, Access::kReadWrite, Vendor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not inside a reservation")))
      << "outside any reservation";
  const Chunk big{.handle = 9, .bytes = 2 * kG};
  ASSERT_THAT(book_.AddChunk(big, ChunkOrigin::kCreated), IsOk());
  EXPECT_THAT(book_.Map(kBase + 3 * kG, big, Access::kReadWrite, Vendor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not inside a reservation")))
      << "hanging past the end of the reservation";
  EXPECT_THAT(book_.Map(kBase, Chunk{.handle = 8, .bytes = kG}, Access::kReadWrite, Vendor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")))
      << "unknown handle";
  EXPECT_THAT(book_.Map(kBase, Chunk{.handle = 7, .bytes = 2 * kG}, Access::kReadWrite, Vendor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")))
      << "known handle, wrong size";
}

TEST_F(VaBookTest, FreeNeedsTheExactReservationWithoutMappings) {
  ASSERT_THAT(book_.Map(kBase, chunk_, Access::kReadWrite, Vendor), IsOk());
  EXPECT_THAT(book_.Free(kBase, 2 * kG, Ok),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a reservation")));
  EXPECT_THAT(book_.Free(kBase + kG, 3 * kG, Ok), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(book_.Free(kBase, 4 * kG, Ok),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unmap them first")));
  ASSERT_THAT(book_.Unmap(kBase, kG, VendorRange), IsOk());
  EXPECT_THAT(book_.Free(kBase, 4 * kG, [] { return absl::InternalError("driver"); }),
              StatusIs(absl::StatusCode::kInternal, "driver"));
  EXPECT_EQ(book_.reservation_count(), 1u) << "a failed vendor free keeps the reservation";
  EXPECT_THAT(book_.Free(kBase, 4 * kG, Ok), IsOk());
  EXPECT_EQ(book_.reservation_count(), 0u);
  EXPECT_THAT(book_.Free(kBase, 4 * kG, Ok), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_))
      << "freed twice";
}

TEST_F(VaBookTest, UnmapRefusesToCutAMappingAndCallsTheVendorPerMapping) {
  const Chunk two{.handle = 9, .bytes = 2 * kG};
  ASSERT_THAT(book_.AddChunk(two, ChunkOrigin::kCreated), IsOk());
  ASSERT_THAT(book_.Map(kBase, chunk_, Access::kReadWrite, Vendor), IsOk());
  ASSERT_THAT(book_.Map(kBase + 2 * kG, two, Access::kReadWrite, Vendor), IsOk());
  EXPECT_THAT(book_.Unmap(kBase + 3 * kG, kG, VendorRange),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuts")));
  EXPECT_THAT(book_.Unmap(kBase, 3 * kG, VendorRange), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuts")));
  EXPECT_THAT(book_.Unmap(kBase + kG / 2, kG, VendorRange),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("granularity")));
  EXPECT_THAT(book_.Unmap(kBase + 4 * kG, kG, VendorRange),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not inside a reservation")));
  EXPECT_EQ(book_.mapping_count(), 2u) << "refused unmaps change nothing";

  // The whole reservation: two mappings and a hole; the second vendor call fails.
  std::vector<uint64_t> called;
  EXPECT_THAT(book_.Unmap(kBase, 4 * kG,
                          [&](uint64_t va, uint64_t) {
                            called.push_back(va);
                            return called.size() == 1 ? absl::OkStatus() : absl::InternalError("driver");
                          }),
              StatusIs(absl::StatusCode::kInternal, "driver"));
  EXPECT_THAT(called, ::testing::ElementsAre(kBase, kBase + 2 * kG)) << "one call per mapping, never for the hole";
  EXPECT_EQ(book_.mapping_count(), 1u) << "the mapping whose unmap succeeded is forgotten, the other kept";
  EXPECT_THAT(book_.Unmap(kBase, 4 * kG, VendorRange), IsOk());
  EXPECT_EQ(book_.mapping_count(), 0u);
  EXPECT_THAT(book_.Unmap(kBase, 4 * kG, VendorRange), IsOk()) << "unmapping nothing is fine";
}

// Hundreds of mappings and chunks, as a large pool has: the books hold many entries per node, and an unmap of a
// run in the middle of them calls the vendor once per mapping, in order, and keeps everything outside the run.
TEST_F(VaBookTest, AnUnmapOfARunAmongManyMappingsForgetsExactlyThatRun) {
  constexpr uint64_t kN = 300;
  const uint64_t base = kBase + (uint64_t{1} << 36);
  ASSERT_THAT(book_.AddReservation(base, kN * kG), IsOk());
  for (uint64_t i = 0; i < kN; ++i) {
    const Chunk c{.handle = 100 + i, .bytes = kG};
    ASSERT_THAT(book_.AddChunk(c, ChunkOrigin::kCreated), IsOk());
    ASSERT_THAT(book_.Map(base + i * kG, c, Access::kReadWrite, Vendor), IsOk());
  }
  EXPECT_EQ(book_.live_chunk_count(), kN + 1);
  EXPECT_EQ(book_.mapping_count(), kN);

  std::vector<uint64_t> called;
  EXPECT_THAT(book_.Unmap(base + 100 * kG, 150 * kG,
                          [&](uint64_t va, uint64_t bytes) {
                            called.push_back(va);
                            return bytes == kG ? absl::OkStatus() : absl::InternalError("not one mapping");
                          }),
              IsOk());
  ASSERT_EQ(called.size(), 150u);
  for (uint64_t i = 0; i < 150; ++i) EXPECT_EQ(called[i], base + (100 + i) * kG) << i;
  EXPECT_EQ(book_.mapping_count(), kN - 150);
  EXPECT_THAT(book_.UseRange("CopyToHost", base, 100 * kG, /*write=*/true, Ok), IsOk());
  EXPECT_THAT(book_.UseRange("CopyToHost", base + 250 * kG, 50 * kG, /*write=*/true, Ok), IsOk());
  EXPECT_THAT(book_.UseRange("CopyToHost", base + 99 * kG, 2 * kG, /*write=*/false, Ok),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("reserved but not mapped")));

  for (uint64_t i = 0; i < kN; i += 2)
    ASSERT_THAT(book_.Release({.handle = 100 + i, .bytes = kG}, VendorRelease), IsOk());
  EXPECT_EQ(book_.live_chunk_count(), kN / 2 + 1);
  EXPECT_THAT(book_.Map(base + 100 * kG, {.handle = 100, .bytes = kG}, Access::kReadWrite, Vendor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")));
  EXPECT_THAT(book_.Map(base + 100 * kG, {.handle = 101, .bytes = kG}, Access::kReadWrite, Vendor), IsOk());
}

TEST_F(VaBookTest, ReleaseCountsReferencesAndPutsBackOnVendorFailure) {
  ASSERT_THAT(book_.AddChunk(chunk_, ChunkOrigin::kImported), IsOk()) << "a second reference to the same handle";
  EXPECT_THAT(book_.AddChunk(Chunk{.handle = 7, .bytes = 2 * kG}, ChunkOrigin::kImported),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("live already")));
  EXPECT_THAT(book_.Release(chunk_, [](ChunkOrigin) { return absl::InternalError("driver"); }),
              StatusIs(absl::StatusCode::kInternal, "driver"));
  ASSERT_EQ(book_.LiveChunks().size(), 1u);
  EXPECT_EQ(book_.LiveChunks()[0].references, 2) << "a failed vendor release keeps the reference";
  ChunkOrigin origin = ChunkOrigin::kImported;
  EXPECT_THAT(book_.Release(chunk_,
                            [&](ChunkOrigin o) {
                              origin = o;
                              return absl::OkStatus();
                            }),
              IsOk());
  EXPECT_EQ(origin, ChunkOrigin::kCreated) << "the origin of the first reference";
  EXPECT_EQ(book_.live_chunk_count(), 1u);
  EXPECT_THAT(book_.Release(chunk_, VendorRelease), IsOk());
  EXPECT_EQ(book_.live_chunk_count(), 0u);
  EXPECT_THAT(book_.Release(chunk_, VendorRelease), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")))
      << "released twice";
  EXPECT_THAT(book_.Release(Chunk{.handle = 99, .bytes = kG}, VendorRelease),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Release")));
}

TEST_F(VaBookTest, ExportOfAChunkThatIsNotLiveNeverReachesTheVendor) {
  bool called = false;
  auto vendor = [&] {
    called = true;
    return absl::OkStatus();
  };
  EXPECT_THAT(book_.WithLiveChunk("Export", Chunk{.handle = 8, .bytes = kG}, vendor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Export")));
  EXPECT_FALSE(called);
  ASSERT_THAT(book_.Release(chunk_, VendorRelease), IsOk());
  EXPECT_THAT(book_.WithLiveChunk("Export", chunk_, vendor),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")));
  EXPECT_FALSE(called) << "a released chunk";
}

TEST_F(VaBookTest, MemoryUseNeedsMappedMemoryOfThisDevice) {
  ASSERT_THAT(book_.Map(kBase, chunk_, Access::kReadWrite, Vendor), IsOk());
  const Chunk ro{.handle = 9, .bytes = kG};
  ASSERT_THAT(book_.AddChunk(ro, ChunkOrigin::kCreated), IsOk());
  ASSERT_THAT(book_.Map(kBase + kG, ro, Access::kRead, Vendor), IsOk());
  int touched = 0;
  auto touch = [&] {
    ++touched;
    return absl::OkStatus();
  };
  EXPECT_THAT(book_.UseRange("CopyToHost", kBase, 2 * kG, /*write=*/false, touch), IsOk());
  EXPECT_THAT(book_.UseRange("CopyToHost", kBase + 100, 0, /*write=*/false, touch), IsOk()) << "nothing to check";
  EXPECT_EQ(touched, 2);
  EXPECT_THAT(book_.UseRange("CopyFromHost", kBase, 2 * kG, /*write=*/true, touch),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("read-only")));
  EXPECT_THAT(book_.UseRange("CopyToHost", kBase, 3 * kG, /*write=*/false, touch),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not mapped")));
  EXPECT_THAT(book_.UseRange("CopyToHost", kBase + 8 * kG, 1, /*write=*/false, touch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not inside a reservation")));
  EXPECT_THAT(book_.UseRange("CopyToHost", UINT64_MAX - 4, 16, /*write=*/false, touch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("wraps")));
  EXPECT_EQ(touched, 2) << "refused uses never touch memory";
}

TEST_F(VaBookTest, CopyUseChecksBothRangesAndRefusesOverlap) {
  // kBase: read-write; kBase + kG: read-only; kBase + 2kG: unmapped; kBase + 3kG: read-write. A second
  // reservation of two granules right after the first, both mapped read-write.
  ASSERT_THAT(book_.Map(kBase, chunk_, Access::kReadWrite, Vendor), IsOk());
  const Chunk ro{.handle = 9, .bytes = kG};
  ASSERT_THAT(book_.AddChunk(ro, ChunkOrigin::kCreated), IsOk());
  ASSERT_THAT(book_.Map(kBase + kG, ro, Access::kRead, Vendor), IsOk());
  ASSERT_THAT(book_.Map(kBase + 3 * kG, chunk_, Access::kReadWrite, Vendor), IsOk());
  const uint64_t next = kBase + 4 * kG;
  ASSERT_THAT(book_.AddReservation(next, 2 * kG), IsOk());
  ASSERT_THAT(book_.Map(next, chunk_, Access::kReadWrite, Vendor), IsOk());
  ASSERT_THAT(book_.Map(next + kG, chunk_, Access::kReadWrite, Vendor), IsOk());
  int touched = 0;
  auto touch = [&] {
    ++touched;
    return absl::OkStatus();
  };
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase, kBase + kG, kG, touch), IsOk()) << "from read-only into read-write";
  EXPECT_THAT(book_.UseCopy("CopyRange", next + 5, kBase + kG / 2, kG, touch), IsOk())
      << "across two mappings into another reservation";
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase + 100, kBase, 100, touch), IsOk()) << "adjacent, not overlapping";
  EXPECT_EQ(touched, 3);
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase + 2 * kG, kBase + 2 * kG, 0, touch), IsOk()) << "nothing to copy";
  EXPECT_EQ(touched, 3) << "a copy of no bytes touches nothing";

  const auto refused = [](absl::StatusCode code, const char* text) {
    return StatusIs(code, ::testing::AllOf(HasSubstr("CopyRange"), HasSubstr(text)));
  };
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase + 10, kBase, 100, touch),
              refused(absl::StatusCode::kInvalidArgument, "overlap"));
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase, kBase + 99, 100, touch),
              refused(absl::StatusCode::kInvalidArgument, "overlap"));
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase + 2 * kG, kBase + 2 * kG, 1, touch),
              refused(absl::StatusCode::kInvalidArgument, "overlap"))
      << "overlap is refused before anything is looked up";
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase + kG, kBase, 16, touch),
              refused(absl::StatusCode::kFailedPrecondition, "read-only"));
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase, kBase + 2 * kG, 16, touch),
              refused(absl::StatusCode::kFailedPrecondition, "not mapped"))
      << "src unmapped";
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase + 2 * kG + 8, kBase, 16, touch),
              refused(absl::StatusCode::kFailedPrecondition, "not mapped"))
      << "dst unmapped";
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase, kBase + 4 * kG - 8, 16, touch),
              refused(absl::StatusCode::kInvalidArgument, "not inside a reservation"))
      << "src spans two reservations, though every byte of it is mapped";
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase + 16 * kG, kBase, 16, touch),
              refused(absl::StatusCode::kInvalidArgument, "not inside a reservation"));
  EXPECT_THAT(book_.UseCopy("CopyRange", kBase, UINT64_MAX - 4, 16, touch),
              refused(absl::StatusCode::kInvalidArgument, "wraps"));
  EXPECT_EQ(touched, 3) << "refused copies never touch memory";
}

TEST_F(VaBookTest, BlockUseChecksEverySegmentAndThePackedBuffer) {
  ASSERT_THAT(book_.Map(kBase, chunk_, Access::kReadWrite, Vendor), IsOk());
  int touched = 0;
  auto touch = [&] {
    ++touched;
    return absl::OkStatus();
  };
  const BlockSpan one{.base = kBase, .segments = 1, .segment_stride = kG, .block_bytes = 4096, .blocks = 4};
  EXPECT_THAT(book_.UseBlocks("PackBlocks", one, false, kBase + 4 * 4096, 2, true, touch), IsOk());
  EXPECT_THAT(book_.UseBlocks("PackBlocks", one, false, kBase + kG, 2, true, touch),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not mapped")))
      << "the packed buffer lies in reserved, unmapped space";
  EXPECT_THAT(book_.UseBlocks("PackBlocks", one, false, 0, 2, true, touch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  const BlockSpan two{.base = kBase, .segments = 2, .segment_stride = kG, .block_bytes = 4096, .blocks = 4};
  EXPECT_THAT(book_.UseBlocks("ZeroBlocks", two, true, 0, 0, false, touch),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ZeroBlocks")))
      << "the second segment is unmapped";
  const BlockSpan overlapping{.base = kBase, .segments = 2, .segment_stride = 4096, .block_bytes = 4096, .blocks = 4};
  EXPECT_THAT(book_.UseBlocks("ZeroBlocks", overlapping, true, 0, 0, false, touch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("segment_stride")));
  const BlockSpan huge{.base = kBase, .segments = 3, .segment_stride = UINT64_MAX / 2, .block_bytes = 1, .blocks = 1};
  EXPECT_THAT(book_.UseBlocks("ZeroBlocks", huge, true, 0, 0, false, touch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
  EXPECT_EQ(touched, 1);
}

TEST_F(VaBookTest, ConcurrentMapsOfOneRangeAdmitExactlyOne) {
  std::vector<Chunk> chunks;
  for (uint64_t h = 100; h < 108; ++h) {
    chunks.push_back(Chunk{.handle = h, .bytes = kG});
    ASSERT_THAT(book_.AddChunk(chunks.back(), ChunkOrigin::kCreated), IsOk());
  }
  std::atomic<int> mapped{0};
  std::vector<std::thread> threads;
  for (const Chunk& c : chunks) {
    threads.emplace_back([&, c] {
      if (book_.Map(kBase, c, Access::kReadWrite, Vendor).ok()) ++mapped;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(mapped.load(), 1);
  EXPECT_EQ(book_.mapping_count(), 1u);
}

}  // namespace
}  // namespace kvd
