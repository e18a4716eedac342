#include "daemon/core/geometry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvd/checked_math.h"

namespace kvd::daemon {
namespace {

constexpr std::array<const char*, kNumDims> kDimFields = {"dims.layers", "dims.capacity_blocks", "dims.heads",
                                                          "dims.block_tokens", "dims.channels"};

absl::Status Overflow(Dim dim, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(kDimFields[static_cast<int>(dim)], ": too large, ", what, " overflows 64 bits"));
}

}  // namespace

uint64_t PoolDims::size(Dim dim) const {
  switch (dim) {
    case Dim::kL:
      return layers;
    case Dim::kB:
      return capacity_blocks;
    case Dim::kH:
      return heads;
    case Dim::kN:
      return block_tokens;
    case Dim::kC:
      return channels;
  }
  return 0;
}

absl::StatusOr<Geometry> Geometry::Compute(Layout layout, const PoolDims& dims, uint64_t granularity) {
  for (int d = 0; d < kNumDims; ++d) {
    if (dims.size(static_cast<Dim>(d)) == 0)
      return absl::InvalidArgumentError(absl::StrCat(kDimFields[d], ": must be > 0"));
  }
  if (dims.element_bytes == 0) return absl::InvalidArgumentError("dims.element_bytes: must be > 0");
  if (granularity == 0 || (granularity & (granularity - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("granularity: ", granularity, " is not a power of two"));
  }

  Geometry g(layout, dims);
  g.granularity_ = granularity;
  const auto& order = layout.order();
  const int bp = layout.block_position();

  // Dense strides from the innermost dim out to B.
  g.strides_[static_cast<int>(order[kNumDims - 1])] = dims.element_bytes;
  for (int i = kNumDims - 2; i >= bp; --i) {
    const Dim inner = order[i + 1];
    std::optional<uint64_t> s = CheckedMul(g.strides_[static_cast<int>(inner)], dims.size(inner));
    if (!s) return Overflow(inner, absl::StrCat("the stride of ", std::string(1, DimName(order[i]))));
    g.strides_[static_cast<int>(order[i])] = *s;
  }
  std::optional<uint64_t> seg_bytes = CheckedMul(g.block_stride(), dims.capacity_blocks);
  if (!seg_bytes) return Overflow(Dim::kB, "capacity_blocks * block bytes");
  std::optional<uint64_t> seg_stride = CheckedRoundUp(*seg_bytes, granularity);
  if (!seg_stride) return Overflow(Dim::kB, "the granularity-padded segment");
  g.segment_bytes_ = *seg_bytes;
  g.segment_stride_ = *seg_stride;

  // The dims outside B are built on the padded segment stride.
  uint64_t outer = 1;
  for (int i = bp - 1; i >= 0; --i) {
    const Dim dim = order[i];
    if (i == bp - 1) {
      g.strides_[static_cast<int>(dim)] = g.segment_stride_;
    } else {
      const Dim inner = order[i + 1];
      std::optional<uint64_t> s = CheckedMul(g.strides_[static_cast<int>(inner)], dims.size(inner));
      if (!s) return Overflow(inner, absl::StrCat("the stride of ", std::string(1, DimName(dim))));
      g.strides_[static_cast<int>(dim)] = *s;
    }
    std::optional<uint64_t> o = CheckedMul(outer, dims.size(dim));
    if (!o) return Overflow(dim, "the segment count");
    outer = *o;
  }
  g.segments_ = outer;
  std::optional<uint64_t> reserved = CheckedMul(g.segments_, g.segment_stride_);
  if (!reserved) return Overflow(order[0], "segments * segment stride");
  g.reserved_bytes_ = *reserved;
  return g;
}

uint64_t Geometry::ByteOffset(uint64_t l, uint64_t b, uint64_t h, uint64_t n, uint64_t c) const {
  return offset() + l * stride(Dim::kL) + b * stride(Dim::kB) + h * stride(Dim::kH) + n * stride(Dim::kN) +
         c * stride(Dim::kC);
}

uint64_t Geometry::PrefixBytes(uint64_t blocks) const {
  blocks = std::min(blocks, dims_.capacity_blocks);
  // blocks * block_stride <= segment_bytes, and its round-up <= segment_stride: no overflow.
  return std::min(*CheckedRoundUp(blocks * block_stride(), granularity_), segment_stride_);
}

uint64_t Geometry::BlocksInPrefix(uint64_t prefix_bytes) const {
  if (block_stride() == 0) return 0;
  return std::min(prefix_bytes / block_stride(), dims_.capacity_blocks);
}

absl::StatusOr<std::vector<PlannedChunk>> Geometry::PlanGrow(uint64_t prefix_bytes, uint64_t target_blocks,
                                                             uint64_t max_chunk_bytes) const {
  if (target_blocks > dims_.capacity_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_blocks: ", target_blocks, " exceeds the capacity of ", dims_.capacity_blocks, " blocks"));
  }
  return PlanRange(prefix_bytes, PrefixBytes(target_blocks), max_chunk_bytes);
}

absl::StatusOr<std::vector<PlannedChunk>> Geometry::PlanRange(uint64_t prefix_bytes, uint64_t to,
                                                              uint64_t max_chunk_bytes) const {
  if (max_chunk_bytes == 0 || max_chunk_bytes % granularity_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_chunk_bytes: ", max_chunk_bytes,
                                                   " is not a positive multiple of the granularity ", granularity_));
  }
  if (prefix_bytes % granularity_ != 0 || prefix_bytes > segment_stride_) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_bytes: ", prefix_bytes, " is not a granularity-aligned prefix"));
  }
  if (to % granularity_ != 0 || to > segment_stride_) {
    return absl::InvalidArgumentError(absl::StrCat("to_bytes: ", to, " is not a granularity-aligned prefix"));
  }
  std::vector<PlannedChunk> plan;
  if (to <= prefix_bytes) return plan;
  // Split the delta evenly: 5 GiB under a 4 GiB cap becomes 2 x 2.5 GiB, not 4 + 1.
  const uint64_t delta = to - prefix_bytes;
  const uint64_t pieces = delta / max_chunk_bytes + (delta % max_chunk_bytes != 0);
  const uint64_t piece = *CheckedRoundUp(delta / pieces + (delta % pieces != 0), granularity_);
  plan.reserve(segments_ * pieces);
  for (uint64_t s = 0; s < segments_; ++s) {
    for (uint64_t at = prefix_bytes; at < to; at += piece) {
      plan.push_back({s, SegmentOffset(s) + at, std::min(piece, to - at)});
    }
  }
  return plan;
}

BlockSpan Geometry::Span(uint64_t base, uint64_t committed_blocks) const {
  return BlockSpan{.base = base + offset(),
                   .segments = segments_,
                   .segment_stride = segment_stride_,
                   .block_bytes = block_stride(),
                   .blocks = std::min(committed_blocks, dims_.capacity_blocks)};
}

}  // namespace kvd::daemon
