// The contract between the HIP block kernels (block_kernels.hip, compiled by hipcc into a code-object
// bundle) and the host code that launches them (hip_device.cc, compiled by g++): kernel names and
// the one by-value argument every kernel takes. Plain C++ so both compilers read the same layout.
//
// Every kernel walks "runs": run (i, s) is block ids[i] of segment s, `block_bytes` bytes at
// base + s * segment_stride + ids[i] * block_bytes (kvd::BlockSpan's placement). Work-groups take
// runs grid-stride; the threads of a work-group stride over the run in `unit`-byte accesses.
//   kvd_zero_blocks    run (i, s) := 0
//   kvd_copy_blocks    ids holds (src, dst) pairs; run (dst_i, s) := run (src_i, s)
//   kvd_pack_blocks    buffer + (i * segments + s) * block_bytes := run (i, s)
//   kvd_unpack_blocks  run (i, s) := buffer + (i * segments + s) * block_bytes
#pragma once

#include <cstdint>

namespace kvd::hip {

inline constexpr char kZeroBlocksKernel[] = "kvd_zero_blocks";
inline constexpr char kCopyBlocksKernel[] = "kvd_copy_blocks";
inline constexpr char kPackBlocksKernel[] = "kvd_pack_blocks";
inline constexpr char kUnpackBlocksKernel[] = "kvd_unpack_blocks";

// Threads per work-group the host launches with.
inline constexpr unsigned int kBlockKernelThreads = 256;

struct BlockKernelArgs {
  uint64_t base = 0;
  uint64_t segments = 0;
  uint64_t segment_stride = 0;
  uint64_t block_bytes = 0;
  uint64_t ids = 0;     // device address of `count` block ids (copy: `count` (src, dst) pairs)
  uint64_t count = 0;   // ids (copy: pairs)
  uint64_t buffer = 0;  // pack: destination, unpack: source; otherwise 0
  uint64_t unit = 1;    // bytes per access: 16, 8, 4 or 1; every address and block_bytes divide by it
};
static_assert(sizeof(BlockKernelArgs) == 64, "the kernel argument buffer is eight 64-bit words");

}  // namespace kvd::hip
