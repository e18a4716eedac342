#include "block_launch.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvd {

absl::StatusOr<BlockLaunch> PlanBlockLaunch(const char* call, BlockOp op, const BlockSpan& span, uint64_t runs,
                                            uint64_t packed) {
  BlockLaunch launch;
  uint64_t bits = span.base | span.block_bytes | packed;
  if (span.segments > 1) bits |= span.segment_stride;
  launch.aligned = (bits & 15) == 0;
  constexpr uint64_t kTileUnits = uint64_t{kBlockKernelThreads} * kBlockKernelUnroll;
  BlockRunParams& p = launch.params;
  p.base = span.base;
  p.segment_stride = span.segment_stride;
  p.block_bytes = span.block_bytes;
  p.segments = span.segments;
  p.packed = packed;
  // At least one tile per run: the unaligned kernel's first tile also moves the head and tail bytes.
  p.tiles_per_run = std::max<uint64_t>(1, (span.block_bytes / 16 + kTileUnits - 1) / kTileUnits);
  p.op = op;
  if (__builtin_mul_overflow(runs, p.tiles_per_run, &p.total_tiles)) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": too many tiles"));
  }
  return launch;
}

}  // namespace kvd
