#include "daemon/core/reshape_plan.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "kvd/status.h"

namespace kvd::daemon {

uint64_t ReshapePlan::added_bytes() const {
  uint64_t bytes = 0;
  for (const PlannedChunk& p : added) bytes += p.bytes;
  return bytes;
}

absl::StatusOr<ReshapePlan> PlanShrink(const ChunkTable& table, absl::string_view pool, uint64_t target_blocks,
                                       bool whole_chunks_only, const std::optional<std::vector<uint64_t>>& live,
                                       std::optional<uint64_t> max_added_bytes) {
  const Geometry& g = table.geometry();
  const uint64_t to = g.PrefixBytes(target_blocks);
  if (whole_chunks_only && live.has_value()) {
    return absl::InvalidArgumentError("live: a compaction shrink moves bytes and cannot be whole_chunks_only");
  }
  ReshapePlan plan{.prefix_bytes = to, .chunks_before = static_cast<uint32_t>(table.size())};
  if (live.has_value()) {
    const uint64_t committed = table.committed_blocks();
    std::set<uint64_t> used;
    for (size_t i = 0; i < live->size(); ++i) {
      const uint64_t b = (*live)[i];
      if (b >= committed) {
        return absl::InvalidArgumentError(absl::StrCat("live.blocks[", i, "]: block ", b, " is not committed (pool ",
                                                       pool, " has ", committed, " blocks)"));
      }
      if (!used.insert(b).second) {
        return absl::InvalidArgumentError(absl::StrCat("live.blocks[", i, "]: block ", b, " is listed twice"));
      }
    }
    if (used.size() > target_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("live: ", used.size(), " live blocks do not fit in target_blocks ", target_blocks));
    }
    // The live blocks past the target, in order, into the free blocks below it, in order.
    uint64_t free = 0;
    for (auto it = used.lower_bound(target_blocks); it != used.end(); ++it) {
      while (used.contains(free)) ++free;
      plan.moves.push_back({.src = *it, .dst = free++});
    }
  }
  uint64_t added_bytes = 0;
  bool full = false;  // a replacement did not fit in max_added_bytes: the later ones wait for a later step
  // Chunk ends at or past the target, by place in a segment: how many segments have each.
  std::map<uint64_t, uint32_t> ends;
  for (const ChunkRecord& r : table.chunks()) {
    const uint64_t start = table.StartInSegment(r.info);
    if (start + r.info.bytes >= to) ++ends[start + r.info.bytes];
    if (start >= to) {
      plan.released.push_back(r.info.id);
    } else if (start + r.info.bytes > to) {
      if (whole_chunks_only) {
        plan.prefix_bytes = std::max(plan.prefix_bytes, start + r.info.bytes);
        plan.target_reached = false;
        continue;
      }
      // The kept bytes of a chunk that straddles the new prefix move into a chunk of just their size.
      const uint64_t kept = to - start;
      if (max_added_bytes.has_value() && (full || added_bytes + kept > *max_added_bytes)) {
        full = true;
        continue;
      }
      added_bytes += kept;
      plan.replaced.push_back(r.info.id);
      plan.added.push_back({.segment = r.info.segment, .offset = r.info.offset, .bytes = kept});
    }
  }
  // The first end every segment has (the prefix's end at the latest) is at or past every straddling chunk's.
  plan.release_first_from = table.prefix_bytes();
  for (const auto& [end, segments] : ends) {
    if (segments == g.segments()) {
      plan.release_first_from = end;
      break;
    }
  }
  for (const ChunkRecord& r : table.chunks()) {
    if (table.StartInSegment(r.info) >= plan.release_first_from) plan.release_first_bytes += r.info.bytes;
  }
  return plan;
}

ReshapePlan PlanTails(const ChunkTable& table, std::optional<uint64_t> max_added_bytes) {
  const uint64_t prefix = table.prefix_bytes();
  ReshapePlan plan{.prefix_bytes = prefix, .chunks_before = static_cast<uint32_t>(table.size())};
  uint64_t added_bytes = 0;
  for (const ChunkRecord& r : table.chunks()) {
    const uint64_t start = table.StartInSegment(r.info);
    if (start + r.info.bytes <= prefix) continue;
    if (start >= prefix) {  // not left by a shrink's steps, but released all the same
      plan.released.push_back(r.info.id);
      continue;
    }
    const uint64_t kept = prefix - start;
    if (max_added_bytes.has_value() && added_bytes + kept > *max_added_bytes) break;
    added_bytes += kept;
    plan.replaced.push_back(r.info.id);
    plan.added.push_back({.segment = r.info.segment, .offset = r.info.offset, .bytes = kept});
  }
  return plan;
}

absl::StatusOr<ReshapePlan> PlanCompact(const ChunkTable& table, uint64_t max_chunk_bytes,
                                        std::optional<size_t> max_replaced, std::optional<uint64_t> max_added_bytes,
                                        bool smaller) {
  const std::vector<ChunkRecord>& chunks = table.chunks();
  ReshapePlan plan{.prefix_bytes = table.prefix_bytes(), .chunks_before = static_cast<uint32_t>(chunks.size())};
  KVD_ASSIGN_OR_RETURN(std::vector<PlannedChunk> shape,
                       table.geometry().PlanRange(0, table.prefix_bytes(), max_chunk_bytes));
  // A planned chunk that is already one chunk stays; every other one replaces the chunks it overlaps.
  // Those overlap no chunk that stays (chunks that stay match a planned chunk exactly), so the
  // replacements cover the replaced chunks exactly, but for the tail of a chunk past the prefix (left by
  // an exact shrink that stopped between its steps), which goes with it.
  std::set<uint64_t> replaced;
  uint64_t room = max_added_bytes.value_or(UINT64_MAX);
  for (const PlannedChunk& p : shape) {
    auto first = std::lower_bound(chunks.begin(), chunks.end(), p.offset,
                                  [](const ChunkRecord& r, uint64_t at) { return r.info.offset + r.info.bytes <= at; });
    if (first != chunks.end() && first->info.offset == p.offset && first->info.bytes == p.bytes) continue;
    auto last = first;
    while (last != chunks.end() && last->info.offset < p.offset + p.bytes) ++last;
    const size_t overlapped = static_cast<size_t>(last - first);
    if (max_replaced.has_value() && !plan.added.empty() && replaced.size() + overlapped > *max_replaced) break;
    if (p.bytes <= room) {
      room -= p.bytes;
      for (auto it = first; it != last; ++it) replaced.insert(it->info.id);
      plan.added.push_back(p);
      continue;
    }
    if (!smaller) break;
    // Runs of consecutive old chunks of this planned chunk, each as one new chunk that fits the room left.
    const uint64_t p_end = p.offset + p.bytes;
    auto kept = [&](decltype(first) it) { return std::min(it->info.offset + it->info.bytes, p_end) - it->info.offset; };
    for (auto it = first; it != last;) {
      uint64_t bytes = 0;
      auto end = it;
      while (end != last && bytes + kept(end) <= room) bytes += kept(end++);
      const size_t run = static_cast<size_t>(end - it);
      // Two chunks or more become one; a lone chunk only sheds a tail past the prefix.
      if (run >= 2 || (run == 1 && kept(it) < it->info.bytes)) {
        room -= bytes;
        plan.added.push_back({.segment = p.segment, .offset = it->info.offset, .bytes = bytes});
        for (; it != end; ++it) replaced.insert(it->info.id);
        plan.target_reached = false;
      } else {
        ++it;
      }
    }
  }
  plan.replaced.assign(replaced.begin(), replaced.end());
  return plan;
}

}  // namespace kvd::daemon
