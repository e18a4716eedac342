// The block kernels' launch contract, shared by their one source (block_kernels.cuh, compiled by nvcc
// into the CUDA fatbin and by hipcc into the HIP code-object bundle) and the backends that launch them
// (cuda_device.cc through cuLaunchKernel, hip_device.cc through hipModuleLaunchKernel). Plain data
// only: the parameter block is passed by value, so the device and host compilers must lay it out the
// same (the static_asserts below pin it).
//
// Note [Block runs]
// Every block operation is a list of runs: one run per (item, segment), item-major, each run
// block_bytes bytes (device.h's BlockSpan contract). Item i's run in segment s is at
//   span:   base + s * segment_stride + id * block_bytes
//   packed: packed + (i * segments + s) * block_bytes
// and the four ops differ only in where a run is read and written:
//   zero:   write span(ids[i])                        copy: span(ids[2i]) -> span(ids[2i+1])
//   pack:   span(ids[i]) -> packed                    unpack: packed -> span(ids[i])
// Runs are cut into tiles of kBlockKernelThreads * kBlockKernelUnroll units of 16 bytes; a grid-stride
// loop over tiles keeps every SM busy whether there are many small runs or a few huge ones, and each
// thread issues kBlockKernelUnroll independent 16-byte loads before its stores. Two kernels:
//   aligned    every address and size involved is a multiple of 16 (the usual case): plain 16-byte
//              loads and stores;
//   unaligned  any geometry: per run, the bytes before the destination's first 16-byte boundary and
//              after its last go one by one; the aligned units between them are 16-byte stores, read
//              with 16-byte loads, or, where the source is aligned differently, as two aligned loads
//              funnel-shifted together (never outside the run's aligned 16-byte words, so never
//              outside its mapping).
#pragma once

#include <stdint.h>

namespace kvd {

inline constexpr unsigned kBlockKernelThreads = 256;
inline constexpr unsigned kBlockKernelUnroll = 4;

enum class BlockOp : uint32_t { kZero = 0, kCopy = 1, kPack = 2, kUnpack = 3 };

struct BlockRunParams {
  uint64_t base;            // the span's base VA
  uint64_t segment_stride;  // bytes between segments
  uint64_t block_bytes;     // bytes of one run
  uint64_t segments;        // runs per item
  uint64_t packed;          // pack: destination VA; unpack: source VA; otherwise 0
  uint64_t ids;             // device VA of the block ids (copy: src, dst pairs), uint64 each
  uint64_t tiles_per_run;   // max(1, ceil((block_bytes / 16) / (threads * unroll)))
  uint64_t total_tiles;     // items * segments * tiles_per_run
  BlockOp op;
  uint32_t reserved;
};

static_assert(sizeof(BlockRunParams) == 72, "the kernel parameter block is nine 64-bit words");

// Kernel names in the fatbin and the code-object bundle (extern "C", so unmangled).
inline constexpr const char* kBlockKernelAligned = "kvd_block_runs_aligned";
inline constexpr const char* kBlockKernelUnaligned = "kvd_block_runs_unaligned";

}  // namespace kvd
