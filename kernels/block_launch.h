// The host side of Note [Block runs] (block_kernels.h), shared by the backends that launch the block
// kernels (CUDA and HIP): the parameter block of one block operation and which kernel runs it.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "block_kernels.h"
#include "kvd/device.h"

namespace kvd {

struct BlockLaunch {
  BlockRunParams params{};
  bool aligned = false;  // every address and size the kernel touches is a multiple of 16
};

// The launch of `op` over `runs` runs (items * span.segments) of `span`; `packed` is the packed
// buffer's VA for pack and unpack, else 0. INVALID_ARGUMENT starting with `call` when the number of
// tiles overflows 64 bits. The ids' VA (params.ids) is the caller's to fill in.
[[nodiscard]] absl::StatusOr<BlockLaunch> PlanBlockLaunch(const char* call, BlockOp op, const BlockSpan& span,
                                                          uint64_t runs, uint64_t packed);

}  // namespace kvd
