// The reshape planner: which chunks a shrink or a compaction makes, replaces and releases, planned from a
// pool's chunk table alone (pure functions: no lock, no device). Pool (pool.h) checks the pool's state and
// calls these under its state lock; Reshaper (reshaper.h) runs the plans. See Note [Chunks are replaced, not
// cut] in docs/architecture.md.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/core/chunk_table.h"
#include "daemon/core/geometry.h"

namespace kvd::daemon {

// A change of a pool's physical shape (shrink, compact): new chunks that take over the bytes at their
// places from the old chunks they overlap, the old chunks wholly past the new prefix, and the prefix after.
struct ReshapePlan {
  std::vector<PlannedChunk> added;  // every byte of each was committed before: all of it is copied
  std::vector<uint64_t> replaced;   // old chunks an added chunk overlaps (covered exactly by `added`)
  std::vector<uint64_t> released;   // old chunks at or past the new prefix
  uint64_t prefix_bytes = 0;        // every segment's committed prefix after
  std::vector<BlockCopy> moves;     // compaction shrink: live blocks copied below the target first
  uint32_t chunks_before = 0;
  // Shrink: the prefix is the target's (false only for whole chunks). Compact: every new chunk has the
  // shape's size (false when free memory allowed only smaller ones).
  bool target_reached = true;
  // Exact shrink: the lowest place (in every segment) at or past every straddling chunk's end where every
  // segment has a chunk boundary, and the bytes of the chunks at or past it: whole chunks that a plain
  // release can give back first, leaving every segment's prefix there.
  uint64_t release_first_from = 0;
  uint64_t release_first_bytes = 0;
  // Whether clients must pause: bytes move between chunks or blocks while they could touch them.
  bool moves_bytes() const { return !added.empty() || !moves.empty(); }
  // The bytes of the new chunks.
  uint64_t added_bytes() const;
};

// A shrink of `table` to `target_blocks` (less than its committed blocks): exact, replacing a chunk that
// straddles the new prefix, unless `whole_chunks_only`. `live` (compaction shrink): the blocks still used;
// those at or past the target move to free blocks below it, in increasing order of both. INVALID_ARGUMENT
// naming live.blocks[i] for an id not committed or given twice, or for more live blocks than the target
// (`pool` names the pool). With `max_added_bytes` (one step of an exact shrink in steps): only the
// straddling chunks, by place, whose replacements fit in it together (maybe none); the chunks past the
// target are all released and the prefix is the target's either way, so the straddling chunks left out
// keep tails past it.
[[nodiscard]] absl::StatusOr<ReshapePlan> PlanShrink(const ChunkTable& table, absl::string_view pool,
                                                     uint64_t target_blocks, bool whole_chunks_only,
                                                     const std::optional<std::vector<uint64_t>>& live,
                                                     std::optional<uint64_t> max_added_bytes);
// The next step of an exact shrink in steps: the chunks that run past the prefix (tails), by place, each
// replaced by a chunk of its bytes below the prefix, as many as fit in `max_added_bytes` together (all
// without it). Empty when no chunk has a tail.
ReshapePlan PlanTails(const ChunkTable& table, std::optional<uint64_t> max_added_bytes);
// Every segment's prefix as one chunk per `max_chunk_bytes` (as a single grow makes it); chunks already in
// place stay, and a chunk with a tail past the prefix is replaced. With `max_replaced`, only the first new
// chunks (by place) that replace at most that many old ones, but at least one. With `max_added_bytes`,
// only the first new chunks (by place) that fit in it together (maybe none); with `smaller` too, a new
// chunk that does not fit is replaced instead by new chunks of runs of its old ones that do, each merging
// at least two (the plan's target_reached is then false).
[[nodiscard]] absl::StatusOr<ReshapePlan> PlanCompact(const ChunkTable& table, uint64_t max_chunk_bytes,
                                                      std::optional<size_t> max_replaced,
                                                      std::optional<uint64_t> max_added_bytes, bool smaller);

}  // namespace kvd::daemon
