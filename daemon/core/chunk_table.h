// ChunkTable: one pool's chunks as the daemon holds them and every segment's committed prefix. A room of
// Pool (pool.h) with no lock of its own: the pool's state lock guards it, and it never calls the device.
//
// Invariants: chunks() are sorted by (segment, offset) and cover [0, prefix_bytes()) of every segment
// exactly, but for tails: from the first step of an exact shrink in steps on, the prefix is the target's
// while a segment's last chunk may still run past it until a later step replaces it (Note [Chunks are
// replaced, not cut] in docs/architecture.md). After a restart, the ids in missing() are placeholders (no
// memory, no FD) that clients may still give back.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

#include "daemon/core/geometry.h"
#include "daemon/core/pool_types.h"
#include "kvd/device.h"
#include "kvd/unique_fd.h"

namespace kvd::daemon {

// One physical allocation of a pool, as the daemon holds it.
struct ChunkRecord {
  ChunkInfo info;
  Chunk chunk;  // the daemon's own handle
  // Exported once at creation (or the FD it was adopted from). Empty where the handle is an FD itself (the
  // host backend's memfd; handle_is_fd): one FD per chunk either way (Note [FD hygiene] in docs/architecture.md).
  UniqueFd exported;
  bool handle_is_fd = false;
  // Whether the daemon maps it in its own view, at base + info.offset: only once the daemon touches its bytes
  // (Note [The daemon maps on demand] in docs/architecture.md).
  bool mapped = false;
  // The chunk's FD, borrowed (consumers get dup()s of it); -1 for a missing chunk (Recover).
  int fd() const { return handle_is_fd ? static_cast<int>(chunk.handle) : exported.get(); }
};

class ChunkTable {
 public:
  // `geometry` must outlive the table (the pool's).
  explicit ChunkTable(const Geometry* geometry, uint64_t prefix_bytes = 0)
      : geometry_(geometry), prefix_bytes_(prefix_bytes) {}

  const Geometry& geometry() const { return *geometry_; }
  const std::vector<ChunkRecord>& chunks() const { return chunks_; }
  size_t size() const { return chunks_.size(); }
  std::vector<ChunkInfo> Infos() const;
  uint64_t prefix_bytes() const { return prefix_bytes_; }
  uint64_t committed_blocks() const { return geometry_->BlocksInPrefix(prefix_bytes_); }
  uint64_t committed_bytes() const { return geometry_->CommittedBytes(prefix_bytes_); }
  // Where `chunk` starts in its segment.
  uint64_t StartInSegment(const ChunkInfo& chunk) const {
    return chunk.offset - geometry_->SegmentOffset(chunk.segment);
  }
  // The bytes of chunks past the prefix; 0 but between the steps of an exact shrink, or after one failed.
  uint64_t TailBytes() const;
  // The chunk `id` (a missing one too), or null.
  const ChunkRecord* Find(uint64_t id) const;
  ChunkRecord* Find(uint64_t id);
  // The chunks with memory that the daemon does not map in its view (ChunkRecord::mapped).
  std::vector<ChunkRecord*> Unmapped();
  // The chunks that have memory and start at or past `prefix_bytes` in their segment (0: all).
  std::vector<ChunkInfo> Leaving(uint64_t prefix_bytes) const;

  // Adds staged chunks and sets the prefix (a grow or wake). Returns what was added.
  std::vector<ChunkInfo> Publish(std::vector<ChunkRecord> chunks, uint64_t prefix_bytes);
  // Whole chunks only: takes every chunk that starts at or past `prefix_bytes` into `*released`; a chunk
  // that straddles it stays, and the prefix ends after the kept chunk that ends first across segments (so
  // that every segment still covers it; a longer one keeps a tail). Returns what was taken.
  std::vector<ChunkInfo> TakeFrom(uint64_t prefix_bytes, std::vector<ChunkRecord>* released);
  // A reshape: the chunks in `gone` go to `*removed`, `added` take their places, the prefix is `prefix_bytes`.
  // Returns what left.
  std::vector<ChunkInfo> Replace(const std::set<uint64_t>& gone, std::vector<ChunkRecord> added,
                                 std::vector<ChunkRecord>* removed, uint64_t prefix_bytes);
  // Empties the table: the chunks with memory go to `*present`; returns the missing ones.
  std::vector<ChunkInfo> TakeAll(std::vector<ChunkRecord>* present);

  // After a restart (Note [Durable pools]).
  const std::set<uint64_t>& missing() const { return missing_; }
  bool IsMissing(uint64_t id) const { return missing_.contains(id); }
  void Recover(std::vector<ChunkRecord> chunks, std::set<uint64_t> missing);
  // Fills the missing entry of `chunk`; false (nothing changed) when it is not missing.
  bool Adopt(ChunkRecord& chunk);

 private:
  const Geometry* geometry_;
  uint64_t prefix_bytes_ = 0;        // committed bytes of every segment
  std::vector<ChunkRecord> chunks_;  // by (segment, offset)
  std::set<uint64_t> missing_;
};

}  // namespace kvd::daemon
