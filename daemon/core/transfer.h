// Transfer descriptors: the bytes of a set of a pool's blocks, as few strided runs as the layout allows
// (issue 16, docs/connectors.md). A KV connector (NIXL, Mooncake, LMCache) that moves blocks between
// pools would otherwise expand every block into `segments` byte ranges — hundreds of thousands for a
// large transfer under a layer-major layout. kvd knows the strides, so it describes them once.
//
// A TransferDescriptor is `count` runs of `bytes` bytes; run i starts at `offset + i * stride` from the
// pool's base address. Every byte of every requested block is in exactly one run, and no other byte
// is. How runs are folded (Note [Transfer descriptor shapes] in docs/connectors.md):
// - consecutive block ids merge into one run per segment (block b of segment s is the block_stride
//   bytes at s * segment_stride + b * block_stride);
// - with several segments, one run of blocks becomes one descriptor over all segments
//   (stride = segment_stride, count = segments), unless folding runs of equal length at an equal
//   spacing inside each segment gives fewer descriptors (then one descriptor per segment and fold);
// - with one segment, runs of equal length at an equal spacing fold into one descriptor;
// - where the runs cover whole segments with no padding between them, segments merge into one run.
// The result is the smaller of the two shapes, each folded greedily from the lowest block up; it is
// not claimed to be the smallest possible cover by arbitrary strided runs.
//
// Pure functions of their arguments: no locks, no device.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "daemon/core/geometry.h"
#include "daemon/core/pool_types.h"

namespace kvd::daemon {

struct TransferDescriptor {
  uint64_t segment = 0;  // the segment of the first run (later runs may lie in later segments)
  uint64_t offset = 0;   // of the first run, from the pool's base address
  uint64_t bytes = 0;    // of each run
  uint64_t stride = 0;   // between the starts of consecutive runs; == bytes when count == 1
  uint64_t count = 0;    // runs, >= 1

  bool operator==(const TransferDescriptor&) const = default;
};

// The descriptors covering `block_ids` of a pool with `geometry` and `committed_blocks` committed; an
// empty `block_ids` means every committed block. Ordered by the offset of their first run, except that a
// descriptor spanning segments comes before the next block run's. INVALID_ARGUMENT naming
// "block_ids[i]" for an id >= committed_blocks or one that repeats an earlier id.
[[nodiscard]] absl::StatusOr<std::vector<TransferDescriptor>> DescribeTransfer(const Geometry& geometry,
                                                                               uint64_t committed_blocks,
                                                                               absl::Span<const uint64_t> block_ids);

// DescribeTransfer on a live pool (PoolManager::DescribeTransfer).
struct TransferPlan {
  std::vector<TransferDescriptor> descriptors;
  uint64_t blocks = 0;
  uint64_t bytes = 0;
  uint64_t committed_blocks = 0;
  uint64_t generation = 0;
};

// `chunks` (any order) as the fewest contiguous ranges: chunks of one segment that touch merge. What an
// event tells a connector to register (added) or deregister (released).
std::vector<ByteRange> MergeChunkRanges(std::vector<ChunkInfo> chunks);

}  // namespace kvd::daemon
