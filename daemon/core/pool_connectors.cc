// Pool (pool.h): what KV connectors use of a pool: range exports and the FDs of a lease
// (docs/connectors.md).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "daemon/core/pool.h"
#include "kvd/status.h"

namespace kvd::daemon {

absl::StatusOr<RangeExport> Pool::PlanRangeExport(const Caller& caller, absl::string_view client_id,
                                                  const std::vector<ByteRange>& ranges, bool span_chunks) {
  constexpr size_t kMaxRanges = 65536;
  if (ranges.size() > kMaxRanges) {
    return absl::InvalidArgumentError(absl::StrCat("ranges: ", ranges.size(), " ranges, at most ", kMaxRanges));
  }
  const Geometry& g = plan_.geometry;
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(kExists));
  KVD_RETURN_IF_ERROR(OwnClientLocked(caller, client_id).status());
  KVD_RETURN_IF_ERROR(RequireLocked(kAwake));
  const uint64_t prefix_bytes = table_.prefix_bytes();
  const std::vector<ChunkRecord>& chunks = table_.chunks();

  // The requested ranges, each inside one segment's committed prefix.
  std::vector<ByteRange> wanted;
  if (ranges.empty()) {
    if (prefix_bytes > 0) {
      for (uint64_t s = 0; s < g.segments(); ++s) wanted.push_back({s, g.SegmentOffset(s), prefix_bytes});
    }
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    const ByteRange& r = ranges[i];
    const uint64_t gran = g.granularity();
    if (r.bytes == 0) return absl::InvalidArgumentError(absl::StrCat("ranges[", i, "].bytes: must be > 0"));
    if (r.offset % gran != 0 || r.bytes % gran != 0) {
      return absl::InvalidArgumentError(absl::StrCat("ranges[", i, "]: offset ", r.offset, " and bytes ", r.bytes,
                                                     " must be multiples of the granularity ", gran));
    }
    const uint64_t segment = (r.offset - g.offset()) / g.segment_stride();
    const uint64_t start = segment < g.segments() ? g.SegmentOffset(segment) : 0;
    if (segment >= g.segments() || r.bytes > prefix_bytes || r.offset - start > prefix_bytes - r.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("ranges[", i, "]: [", r.offset, ", +", r.bytes,
                                                     ") is not inside one segment's committed prefix (", prefix_bytes,
                                                     " bytes at offset s * ", g.segment_stride(), ")"));
    }
    wanted.push_back({segment, r.offset, r.bytes});
  }

  RangeExport out;
  out.pool = name_;
  out.generation = generation_;
  for (const ByteRange& r : wanted) {
    const uint64_t end = r.offset + r.bytes;
    RangeHandle whole{.segment = r.segment, .offset = r.offset, .bytes = r.bytes};
    // The table is sorted by (segment, offset) and offsets grow with the segment: start at the last chunk
    // that begins at or before the range.
    auto first = std::upper_bound(chunks.begin(), chunks.end(), r.offset,
                                  [](uint64_t offset, const ChunkRecord& c) { return offset < c.info.offset; });
    if (first != chunks.begin()) --first;
    for (auto c_it = first; c_it != chunks.end() && c_it->info.offset < end; ++c_it) {
      const ChunkRecord& c = *c_it;
      const uint64_t c_end = c.info.offset + c.info.bytes;
      if (c.info.segment != r.segment || c_end <= r.offset) continue;
      if (span_chunks) {
        whole.chunk_ids.push_back(c.info.id);
        continue;
      }
      const uint64_t from = std::max(r.offset, c.info.offset);
      out.handles.push_back({.segment = r.segment,
                             .offset = from,
                             .bytes = std::min(end, c_end) - from,
                             .fd_offset = from - c.info.offset,
                             .chunk_ids = {c.info.id}});
    }
    if (span_chunks) out.handles.push_back(std::move(whole));
  }
  out.lease = shared_.leases->IssueRanges(name_, caller.session, client_id, out.handles, span_chunks);
  return out;
}

absl::Status Pool::CheckChunksLive(absl::string_view client_id, const std::vector<uint64_t>& chunk_ids) {
  absl::MutexLock lock(&mu_);
  if (deleted_) return absl::FailedPreconditionError(absl::StrCat("pool ", name_, " was deleted"));
  KVD_ASSIGN_OR_RETURN(Client * client, LeaseClientLocked(client_id));
  for (uint64_t id : chunk_ids) {
    if (table_.Find(id) == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", id, " of pool ", name_, " was released after the lease was issued"));
    }
  }
  client->fetched.insert(chunk_ids.begin(), chunk_ids.end());
  return absl::OkStatus();
}

absl::StatusOr<Pool::Client*> Pool::LeaseClientLocked(absl::string_view client_id) {
  // A lease ends with its client's attachment (Detach revokes it too; this closes the race with a
  // redemption already under way).
  auto it = clients_.find(client_id);
  if (it == clients_.end()) {
    return absl::NotFoundError(absl::StrCat("lease_token: its client ", client_id, " detached from pool ", name_,
                                            "; a detached client's leases are revoked"));
  }
  return &it->second;
}

absl::StatusOr<std::vector<Pool::LeasedFd>> Pool::DupFds(absl::string_view client_id,
                                                         const std::vector<uint64_t>& chunk_ids, bool skip_released,
                                                         uint64_t pause_id) {
  absl::MutexLock lock(&mu_);
  if (deleted_) return absl::FailedPreconditionError(absl::StrCat("pool ", name_, " was deleted"));
  KVD_ASSIGN_OR_RETURN(Client * client, LeaseClientLocked(client_id));
  if (pause_id != 0 && client->called_off.erase(pause_id) > 0) {  // Note [A called-off pause's lease]
    return absl::AbortedError(absl::StrCat("pause ", pause_id, " of pool ", name_,
                                           " was called off before its lease was fetched: nothing changed, its "
                                           "RESUME (applied = false) follows"));
  }
  std::vector<LeasedFd> out;
  absl::Cleanup close_all = [&] {
    for (const LeasedFd& f : out) close(f.fd);
  };
  for (uint64_t id : chunk_ids) {
    const ChunkRecord* r = table_.Find(id);
    int own = -1;
    if (r != nullptr && !table_.IsMissing(id)) {
      own = r->fd();
    } else if (pause_.FdOf(id) >= 0) {
      own = pause_.FdOf(id);  // a new chunk of the pause under way (the PAUSE's lease)
    } else if (skip_released) {
      continue;  // Note [A lease yields what is still in the pool]
    } else {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", id, " of pool ", name_, " was released after the lease was issued"));
    }
    const int fd = fcntl(own, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return ErrnoStatus(errno, "fcntl(F_DUPFD_CLOEXEC)");
    out.push_back({id, fd});
  }
  std::move(close_all).Cancel();
  // From here the client may map these chunks: Note [A detached client still holds its chunks].
  for (const LeasedFd& f : out) client->fetched.insert(f.chunk_id);
  return out;
}

}  // namespace kvd::daemon
