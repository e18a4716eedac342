#include "daemon/core/chunk_table.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

namespace kvd::daemon {
namespace {

bool ByPlace(const ChunkRecord& a, const ChunkRecord& b) {
  return std::tie(a.info.segment, a.info.offset) < std::tie(b.info.segment, b.info.offset);
}

}  // namespace

std::vector<ChunkInfo> ChunkTable::Infos() const {
  std::vector<ChunkInfo> out;
  out.reserve(chunks_.size());
  for (const ChunkRecord& r : chunks_) out.push_back(r.info);
  return out;
}

uint64_t ChunkTable::TailBytes() const {
  uint64_t sum = 0;
  for (const ChunkRecord& r : chunks_) {
    const uint64_t start = StartInSegment(r.info);
    const uint64_t end = start + r.info.bytes;
    if (end > prefix_bytes_) sum += end - std::max(start, prefix_bytes_);
  }
  return sum;
}

const ChunkRecord* ChunkTable::Find(uint64_t id) const {
  auto r = std::find_if(chunks_.begin(), chunks_.end(), [&](const ChunkRecord& c) { return c.info.id == id; });
  return r == chunks_.end() ? nullptr : &*r;
}

ChunkRecord* ChunkTable::Find(uint64_t id) {
  return const_cast<ChunkRecord*>(static_cast<const ChunkTable*>(this)->Find(id));
}

std::vector<ChunkRecord*> ChunkTable::Unmapped() {
  std::vector<ChunkRecord*> out;
  for (ChunkRecord& r : chunks_) {
    if (!r.mapped && !missing_.contains(r.info.id)) out.push_back(&r);
  }
  return out;
}

std::vector<ChunkInfo> ChunkTable::Leaving(uint64_t prefix_bytes) const {
  std::vector<ChunkInfo> out;
  for (const ChunkRecord& r : chunks_) {
    if (missing_.contains(r.info.id)) continue;
    if (StartInSegment(r.info) >= prefix_bytes) out.push_back(r.info);
  }
  return out;
}

std::vector<ChunkInfo> ChunkTable::Publish(std::vector<ChunkRecord> chunks, uint64_t prefix_bytes) {
  std::vector<ChunkInfo> added;
  for (ChunkRecord& r : chunks) {
    added.push_back(r.info);
    chunks_.push_back(std::move(r));
  }
  std::sort(chunks_.begin(), chunks_.end(), ByPlace);
  prefix_bytes_ = prefix_bytes;
  return added;
}

std::vector<ChunkInfo> ChunkTable::TakeFrom(uint64_t prefix_bytes, std::vector<ChunkRecord>* released) {
  std::vector<ChunkInfo> taken;
  std::vector<ChunkRecord> kept;
  std::map<uint64_t, uint64_t> kept_end;  // segment -> the end of its last kept chunk
  for (uint64_t segment = 0; segment < geometry_->segments(); ++segment) kept_end[segment] = 0;
  for (ChunkRecord& r : chunks_) {
    const uint64_t start = StartInSegment(r.info);
    if (start >= prefix_bytes) {
      taken.push_back(r.info);
      released->push_back(std::move(r));
    } else {
      uint64_t& end = kept_end[r.info.segment];
      end = std::max(end, start + r.info.bytes);
      kept.push_back(std::move(r));
    }
  }
  chunks_.swap(kept);
  uint64_t kept_prefix = UINT64_MAX;
  for (const auto& [segment, end] : kept_end) kept_prefix = std::min(kept_prefix, end);
  prefix_bytes_ = kept_prefix == UINT64_MAX ? 0 : kept_prefix;
  return taken;
}

std::vector<ChunkInfo> ChunkTable::Replace(const std::set<uint64_t>& gone, std::vector<ChunkRecord> added,
                                           std::vector<ChunkRecord>* removed, uint64_t prefix_bytes) {
  std::vector<ChunkInfo> left;
  std::vector<ChunkRecord> kept;
  for (ChunkRecord& r : chunks_) {
    if (!gone.contains(r.info.id)) {
      kept.push_back(std::move(r));
      continue;
    }
    left.push_back(r.info);
    removed->push_back(std::move(r));
  }
  for (ChunkRecord& r : added) kept.push_back(std::move(r));
  std::sort(kept.begin(), kept.end(), ByPlace);
  chunks_.swap(kept);
  prefix_bytes_ = prefix_bytes;
  return left;
}

std::vector<ChunkInfo> ChunkTable::TakeAll(std::vector<ChunkRecord>* present) {
  std::vector<ChunkInfo> lost;
  for (ChunkRecord& r : chunks_) {
    if (missing_.contains(r.info.id)) {
      lost.push_back(r.info);
    } else {
      present->push_back(std::move(r));
    }
  }
  chunks_.clear();
  missing_.clear();
  prefix_bytes_ = 0;
  return lost;
}

void ChunkTable::Recover(std::vector<ChunkRecord> chunks, std::set<uint64_t> missing) {
  chunks_ = std::move(chunks);
  std::sort(chunks_.begin(), chunks_.end(), ByPlace);
  missing_ = std::move(missing);
}

bool ChunkTable::Adopt(ChunkRecord& chunk) {
  ChunkRecord* r = Find(chunk.info.id);
  if (r == nullptr || !missing_.erase(chunk.info.id)) return false;
  *r = std::move(chunk);
  return true;
}

}  // namespace kvd::daemon
