// Geometry: where every byte of a pool lives (docs/layouts.md, "The placement formula").
//
// Strides are dense and computed innermost-out over the layout's order, in bytes (innermost = e).
// The dims before B in the order split the pool into segments, each one contiguous run of
// capacity_blocks blocks, padded up to the device granularity; the outer dims' strides are built on
// that padded segment stride. A pool commits a prefix of every segment, so growing never moves an
// element. A Geometry is an immutable value; all of its arithmetic was overflow-checked by Compute.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/core/layout.h"
#include "kvd/device.h"

namespace kvd::daemon {

// The logical dims [L, B, H, N, C] and the element size e of one pool.
struct PoolDims {
  uint64_t layers = 0;           // L
  uint64_t capacity_blocks = 0;  // B
  uint64_t heads = 0;            // H
  uint64_t block_tokens = 0;     // N
  uint64_t channels = 0;         // C
  uint64_t element_bytes = 0;    // e
  uint64_t size(Dim dim) const;
};

// One physical allocation a grow must create: `bytes` at `offset` from the pool's base.
struct PlannedChunk {
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

class Geometry {
 public:
  // An empty geometry (no dims, no bytes) until assigned one from Compute.
  Geometry() : layout_(Layout::Default()) {}

  // INVALID_ARGUMENT naming the field ("dims.heads: must be > 0") for zero dims, a granularity that
  // is not a power of two, or sizes whose arithmetic overflows 64 bits.
  [[nodiscard]] static absl::StatusOr<Geometry> Compute(Layout layout, const PoolDims& dims, uint64_t granularity);

  Layout layout() const { return layout_; }
  const PoolDims& dims() const { return dims_; }
  uint64_t granularity() const { return granularity_; }

  uint64_t stride(Dim dim) const { return strides_[static_cast<int>(dim)]; }
  uint64_t offset() const { return 0; }
  uint64_t layer_stride() const { return stride(Dim::kL); }
  uint64_t block_stride() const { return stride(Dim::kB); }
  uint64_t segments() const { return segments_; }
  uint64_t segment_stride() const { return segment_stride_; }
  // capacity_blocks * block_stride: the used part of each segment, before padding.
  uint64_t segment_bytes() const { return segment_bytes_; }
  // segments * segment_stride: the VA a pool reserves.
  uint64_t reserved_bytes() const { return reserved_bytes_; }

  // Byte offset of element (l, b, h, n, c) from the pool's base. Indices must be inside the dims.
  uint64_t ByteOffset(uint64_t l, uint64_t b, uint64_t h, uint64_t n, uint64_t c) const;
  uint64_t SegmentOffset(uint64_t segment) const { return offset() + segment * segment_stride_; }

  // Bytes of every segment's committed prefix needed to back `blocks` blocks (granularity-rounded).
  uint64_t PrefixBytes(uint64_t blocks) const;
  // Blocks fully backed when every segment has `prefix_bytes` committed.
  uint64_t BlocksInPrefix(uint64_t prefix_bytes) const;
  // Committed bytes of the whole pool when every segment has `prefix_bytes` committed.
  uint64_t CommittedBytes(uint64_t prefix_bytes) const { return prefix_bytes * segments_; }

  // The chunks a grow from `prefix_bytes` per segment to `target_blocks` creates: for each segment
  // in order, one chunk covering the delta, split only where it exceeds `max_chunk_bytes` (a
  // multiple of the granularity). INVALID_ARGUMENT if the target exceeds the capacity.
  [[nodiscard]] absl::StatusOr<std::vector<PlannedChunk>> PlanGrow(uint64_t prefix_bytes, uint64_t target_blocks,
                                                                   uint64_t max_chunk_bytes) const;

  // The chunks that commit [from_bytes, to_bytes) of every segment, split as PlanGrow splits a delta.
  // INVALID_ARGUMENT for unaligned or out-of-range bounds or a bad max_chunk_bytes.
  [[nodiscard]] absl::StatusOr<std::vector<PlannedChunk>> PlanRange(uint64_t from_bytes, uint64_t to_bytes,
                                                                    uint64_t max_chunk_bytes) const;

  // The block operations' view of a pool mapped at `base` with `committed_blocks` usable blocks.
  BlockSpan Span(uint64_t base, uint64_t committed_blocks) const;

 private:
  Geometry(Layout layout, const PoolDims& dims) : layout_(layout), dims_(dims) {}

  Layout layout_;
  PoolDims dims_;
  uint64_t granularity_ = 0;
  std::array<uint64_t, kNumDims> strides_{};
  uint64_t segments_ = 0;
  uint64_t segment_bytes_ = 0;
  uint64_t segment_stride_ = 0;
  uint64_t reserved_bytes_ = 0;
};

}  // namespace kvd::daemon
