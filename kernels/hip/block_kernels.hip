// The HIP block kernels (DESIGN.md section 10): zero, copy, pack and unpack over kvd::BlockSpan's
// placement. Built by hipcc --genco into a code-object bundle (one code object per
// KVD_HIP_ARCHITECTURES entry), embedded into kvd_device as a byte array, and loaded at run time with
// hipModuleLoadData; the argument layout and the meaning of each kernel are in block_kernels.h.
//
// Correct for any block_bytes and any alignment: the host picks the widest access `unit` (16, 8, 4
// or 1 bytes) that divides every address and block_bytes, and each kernel dispatches on it once.
#include <hip/hip_runtime.h>

#include <cstdint>

#include "block_kernels.h"

namespace {

using kvd::hip::BlockKernelArgs;

struct alignas(16) Bytes16 {
  uint64_t lo;
  uint64_t hi;
};

template <typename T>
__device__ void CopyRunAs(uint64_t dst, uint64_t src, uint64_t bytes) {
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  const uint64_t n = bytes / sizeof(T);
  for (uint64_t k = threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
}

template <typename T>
__device__ void ZeroRunAs(uint64_t dst, uint64_t bytes) {
  T* d = reinterpret_cast<T*>(dst);
  const uint64_t n = bytes / sizeof(T);
  for (uint64_t k = threadIdx.x; k < n; k += blockDim.x) d[k] = T{};
}

__device__ void CopyRun(uint64_t unit, uint64_t dst, uint64_t src, uint64_t bytes) {
  switch (unit) {
    case 16:
      CopyRunAs<Bytes16>(dst, src, bytes);
      break;
    case 8:
      CopyRunAs<uint64_t>(dst, src, bytes);
      break;
    case 4:
      CopyRunAs<uint32_t>(dst, src, bytes);
      break;
    default:
      CopyRunAs<uint8_t>(dst, src, bytes);
      break;
  }
}

__device__ void ZeroRun(uint64_t unit, uint64_t dst, uint64_t bytes) {
  switch (unit) {
    case 16:
      ZeroRunAs<Bytes16>(dst, bytes);
      break;
    case 8:
      ZeroRunAs<uint64_t>(dst, bytes);
      break;
    case 4:
      ZeroRunAs<uint32_t>(dst, bytes);
      break;
    default:
      ZeroRunAs<uint8_t>(dst, bytes);
      break;
  }
}

// Address of block `id` of segment `s`.
__device__ uint64_t RunAddress(const BlockKernelArgs& a, uint64_t id, uint64_t s) {
  return a.base + s * a.segment_stride + id * a.block_bytes;
}

// Address of segment `s` of packed block `i` in the pack/unpack buffer.
__device__ uint64_t PackedAddress(const BlockKernelArgs& a, uint64_t i, uint64_t s) {
  return a.buffer + (i * a.segments + s) * a.block_bytes;
}

}  // namespace

extern "C" __global__ void kvd_zero_blocks(BlockKernelArgs a) {
  const uint64_t* ids = reinterpret_cast<const uint64_t*>(a.ids);
  const uint64_t runs = a.count * a.segments;
  for (uint64_t r = blockIdx.x; r < runs; r += gridDim.x) {
    const uint64_t i = r / a.segments;
    const uint64_t s = r % a.segments;
    ZeroRun(a.unit, RunAddress(a, ids[i], s), a.block_bytes);
  }
}

extern "C" __global__ void kvd_copy_blocks(BlockKernelArgs a) {
  const uint64_t* pairs = reinterpret_cast<const uint64_t*>(a.ids);
  const uint64_t runs = a.count * a.segments;
  // No destination repeats or is also a source (ValidateCopies), so runs never race.
  for (uint64_t r = blockIdx.x; r < runs; r += gridDim.x) {
    const uint64_t i = r / a.segments;
    const uint64_t s = r % a.segments;
    CopyRun(a.unit, RunAddress(a, pairs[2 * i + 1], s), RunAddress(a, pairs[2 * i], s), a.block_bytes);
  }
}

extern "C" __global__ void kvd_pack_blocks(BlockKernelArgs a) {
  const uint64_t* ids = reinterpret_cast<const uint64_t*>(a.ids);
  const uint64_t runs = a.count * a.segments;
  for (uint64_t r = blockIdx.x; r < runs; r += gridDim.x) {
    const uint64_t i = r / a.segments;
    const uint64_t s = r % a.segments;
    CopyRun(a.unit, PackedAddress(a, i, s), RunAddress(a, ids[i], s), a.block_bytes);
  }
}

extern "C" __global__ void kvd_unpack_blocks(BlockKernelArgs a) {
  const uint64_t* ids = reinterpret_cast<const uint64_t*>(a.ids);
  const uint64_t runs = a.count * a.segments;
  for (uint64_t r = blockIdx.x; r < runs; r += gridDim.x) {
    const uint64_t i = r / a.segments;
    const uint64_t s = r % a.segments;
    CopyRun(a.unit, RunAddress(a, ids[i], s), PackedAddress(a, i, s), a.block_bytes);
  }
}
