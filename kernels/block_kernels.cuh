// The block kernels (docs/backends.md, "One source for the block kernels"): zero, copy, pack and unpack over a
// BlockSpan, as runs of bytes (Note [Block runs] in block_kernels.h). The one source for both GPU backends, written in
// the CUDA dialect that HIP also speaks (uint4, make_uint4, __funnelshift_r, __launch_bounds__):
//   cuda/block_kernels.cu   includes it; nvcc --fatbin, embedded, loaded with cuModuleLoadData
//   hip/block_kernels.hip   includes it after <hip/hip_runtime.h>; hipcc --genco, embedded, loaded
//                           with hipModuleLoadData
// Nothing here may depend on the warp size (32 on NVIDIA, 64 on most AMD GPUs): no warp intrinsics,
// and "threadIdx.x < 32" below only picks 32 threads of the block for the head and tail bytes.
#pragma once

#include "block_kernels.h"

namespace kvd {
namespace {

// a / b, in 32 bits when both fit (the usual case): a 64-bit division is a long software sequence.
__device__ __forceinline__ uint64_t Div(uint64_t a, uint64_t b) {
  if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

// Where one tile's run lives: its source (0 for zero) and destination byte addresses.
struct RunAddresses {
  uint64_t src = 0;
  uint64_t dst = 0;
};

__device__ __forceinline__ RunAddresses Locate(const BlockRunParams& p, uint64_t run) {
  const uint64_t* ids = reinterpret_cast<const uint64_t*>(p.ids);
  const uint64_t item = Div(run, p.segments);
  const uint64_t segment_base = p.base + (run - item * p.segments) * p.segment_stride;
  RunAddresses a;
  switch (p.op) {
    case BlockOp::kZero:
      a.dst = segment_base + ids[item] * p.block_bytes;
      break;
    case BlockOp::kCopy:
      a.src = segment_base + ids[2 * item] * p.block_bytes;
      a.dst = segment_base + ids[2 * item + 1] * p.block_bytes;
      break;
    case BlockOp::kPack:
      a.src = segment_base + ids[item] * p.block_bytes;
      a.dst = p.packed + run * p.block_bytes;
      break;
    case BlockOp::kUnpack:
      a.src = p.packed + run * p.block_bytes;
      a.dst = segment_base + ids[item] * p.block_bytes;
      break;
  }
  return a;
}

// Copies (or, with `in` null, zeroes) units [first, first + count) of 16 bytes, each thread taking
// every kBlockKernelThreads-th unit so a warp's accesses are contiguous; all loads before any store.
// `load(in, e)` reads unit e.
template <typename Load>
__device__ __forceinline__ void MoveUnits(uint4* out, const uint8_t* in, uint64_t count, Load load) {
  if (in == nullptr) {
#pragma unroll
    for (unsigned k = 0; k < kBlockKernelUnroll; ++k) {
      const uint64_t e = threadIdx.x + k * kBlockKernelThreads;
      if (e < count) out[e] = make_uint4(0, 0, 0, 0);
    }
    return;
  }
  uint4 v[kBlockKernelUnroll];
#pragma unroll
  for (unsigned k = 0; k < kBlockKernelUnroll; ++k) {
    const uint64_t e = threadIdx.x + k * kBlockKernelThreads;
    if (e < count) v[k] = load(in, e);
  }
#pragma unroll
  for (unsigned k = 0; k < kBlockKernelUnroll; ++k) {
    const uint64_t e = threadIdx.x + k * kBlockKernelThreads;
    if (e < count) out[e] = v[k];
  }
}

// The 16 bytes at in + 16 * e, where in % 16 == off (the same for the whole run, so the switch does
// not diverge): the two aligned 16-byte words they straddle, funnel-shifted. Each aligned load holds
// at least one byte of the run, so it never leaves the run's (2 MiB aligned) mapping.
__device__ __forceinline__ uint4 LoadShifted(const uint8_t* in, uint64_t e, unsigned off) {
  const uint4* aligned = reinterpret_cast<const uint4*>(in - off) + e;
  const uint4 lo = aligned[0];
  const uint4 hi = aligned[1];
  const unsigned s = (off & 3) * 8;
  switch (off >> 2) {
    case 0:
      return make_uint4(__funnelshift_r(lo.x, lo.y, s), __funnelshift_r(lo.y, lo.z, s), __funnelshift_r(lo.z, lo.w, s),
                        __funnelshift_r(lo.w, hi.x, s));
    case 1:
      return make_uint4(__funnelshift_r(lo.y, lo.z, s), __funnelshift_r(lo.z, lo.w, s), __funnelshift_r(lo.w, hi.x, s),
                        __funnelshift_r(hi.x, hi.y, s));
    case 2:
      return make_uint4(__funnelshift_r(lo.z, lo.w, s), __funnelshift_r(lo.w, hi.x, s), __funnelshift_r(hi.x, hi.y, s),
                        __funnelshift_r(hi.y, hi.z, s));
    default:
      return make_uint4(__funnelshift_r(lo.w, hi.x, s), __funnelshift_r(hi.x, hi.y, s), __funnelshift_r(hi.y, hi.z, s),
                        __funnelshift_r(hi.z, hi.w, s));
  }
}

constexpr uint64_t kTileUnits = uint64_t{kBlockKernelThreads} * kBlockKernelUnroll;

// Every address and size a multiple of 16: a run is block_bytes / 16 aligned units.
__device__ __forceinline__ void RunTilesAligned(const BlockRunParams& p) {
  const uint64_t run_units = p.block_bytes / 16;
  for (uint64_t tile = blockIdx.x; tile < p.total_tiles; tile += gridDim.x) {
    const uint64_t run = Div(tile, p.tiles_per_run);
    const uint64_t first = (tile - run * p.tiles_per_run) * kTileUnits;
    const RunAddresses a = Locate(p, run);
    const uint64_t count = run_units - first < kTileUnits ? run_units - first : kTileUnits;
    const uint8_t* in = a.src ? reinterpret_cast<const uint8_t*>(a.src) + 16 * first : nullptr;
    MoveUnits(reinterpret_cast<uint4*>(a.dst) + first, in, count,
              [](const uint8_t* base, uint64_t e) { return reinterpret_cast<const uint4*>(base)[e]; });
  }
}

// Any alignment: per run, the bytes before the destination's first 16-byte boundary (head) and after
// its last (tail) go one by one, and the aligned units between them as 16-byte stores, each read as a
// 16-byte load when the source is aligned the same way and as two shifted ones otherwise.
__device__ __forceinline__ void RunTilesUnaligned(const BlockRunParams& p) {
  const uint64_t n = p.block_bytes;
  for (uint64_t tile = blockIdx.x; tile < p.total_tiles; tile += gridDim.x) {
    const uint64_t run = Div(tile, p.tiles_per_run);
    const uint64_t piece = tile - run * p.tiles_per_run;
    const RunAddresses a = Locate(p, run);
    const uint64_t to_boundary = (16 - (a.dst & 15)) & 15;
    const uint64_t head = to_boundary < n ? to_boundary : n;
    const uint64_t units = (n - head) / 16;
    const uint64_t tail = n - head - 16 * units;
    uint8_t* dst = reinterpret_cast<uint8_t*>(a.dst);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.src);
    if (piece == 0 && threadIdx.x < 32) {  // threads 0-15 the head, 16-31 the tail
      const uint64_t at = threadIdx.x < 16 ? threadIdx.x : head + 16 * units + (threadIdx.x - 16);
      if (threadIdx.x < 16 ? threadIdx.x < head : threadIdx.x - 16 < tail) dst[at] = src ? src[at] : 0;
    }
    const uint64_t first = piece * kTileUnits;
    if (first >= units) continue;
    const uint64_t count = units - first < kTileUnits ? units - first : kTileUnits;
    uint4* out = reinterpret_cast<uint4*>(dst + head) + first;
    const uint8_t* in = src ? src + head + 16 * first : nullptr;
    const unsigned off = static_cast<unsigned>(reinterpret_cast<uintptr_t>(in) & 15);
    if (off == 0) {
      MoveUnits(out, in, count,
                [](const uint8_t* base, uint64_t e) { return reinterpret_cast<const uint4*>(base)[e]; });
    } else {
      MoveUnits(out, in, count, [off](const uint8_t* base, uint64_t e) { return LoadShifted(base, e, off); });
    }
  }
}

}  // namespace
}  // namespace kvd

// Unmangled names, so cuModuleGetFunction finds them (kBlockKernelNames).
extern "C" __global__ void __launch_bounds__(kvd::kBlockKernelThreads) kvd_block_runs_aligned(kvd::BlockRunParams p) {
  kvd::RunTilesAligned(p);
}
extern "C" __global__ void __launch_bounds__(kvd::kBlockKernelThreads) kvd_block_runs_unaligned(kvd::BlockRunParams p) {
  kvd::RunTilesUnaligned(p);
}
