#include "daemon/core/chunk_maker.h"

#include <sys/stat.h>

#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvd/status.h"

namespace kvd::daemon {
namespace {

// Whether `fd` can be chunk memory of `bytes`. On the host backend a chunk is a memfd of exactly its size;
// a GPU driver's FD is checked by importing and mapping it.
absl::Status CheckChunkFd(BackendKind backend, int fd, uint64_t bytes) {
  if (backend != BackendKind::kHost) return absl::OkStatus();
  struct stat st {};
  if (fstat(fd, &st) != 0) return absl::InvalidArgumentError("cannot be examined (fstat failed)");
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("has ", st.st_size, " bytes, the chunk ", bytes));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ChunkRecord> ChunkMaker::MakeOne(uint64_t base, const PlannedChunk& p, Map map, ResizePhases& phases) {
  ChunkRecord r;
  r.info = {.id = next_id_->fetch_add(1), .segment = p.segment, .offset = p.offset, .bytes = p.bytes};
  absl::Time start = absl::Now();
  KVD_ASSIGN_OR_RETURN(r.chunk, device_->Create(p.bytes));
  absl::Cleanup undo = [&] { Discard(base, r, StoreFd::kLeave); };
  const auto lap = [&start](absl::Duration& phase) {
    const absl::Time now = absl::Now();
    phase += now - start;
    start = now;
  };
  lap(phases.create);
  // Note [FD hygiene]: where the handle is the chunk's FD, a dup of it beside it would be a second FD per chunk
  // held for nothing.
  r.handle_is_fd = HandleIsFd();
  if (!r.handle_is_fd) {
    KVD_ASSIGN_OR_RETURN(const int fd, device_->Export(r.chunk));
    r.exported.reset(fd);
  }
  if (fabric_) {
    // Export once, like the FD: every reply and event then carries the same bytes.
    KVD_ASSIGN_OR_RETURN(std::string fabric, device_->ExportFabricHandle(r.chunk));
    r.info.fabric_handle = std::make_shared<const std::string>(std::move(fabric));
  }
  lap(phases.exported);
  if (map == Map::kNow) {
    KVD_RETURN_IF_ERROR(device_->Map(base + p.offset, r.chunk, Access::kReadWrite));
    r.mapped = true;
    lap(phases.map);
  }
  std::move(undo).Cancel();
  return r;
}

absl::StatusOr<std::vector<ChunkRecord>> ChunkMaker::Make(uint64_t base, const std::vector<PlannedChunk>& plan,
                                                          absl::string_view needs, Map map, Observer* observer,
                                                          ResizePhases* phases) {
  ResizePhases unused;
  ResizePhases& times = phases != nullptr ? *phases : unused;
  std::vector<ChunkRecord> made;
  absl::Cleanup undo = [&] {
    if (observer != nullptr) observer->Undoing();
    for (ChunkRecord& r : made) Discard(base, r, StoreFd::kLeave);
  };
  made.reserve(plan.size());
  for (const PlannedChunk& p : plan) {
    absl::StatusOr<ChunkRecord> r = MakeOne(base, p, map, times);
    if (!r.ok()) {
      // Out of memory is worded with the bytes asked and free; out of file descriptors is not about memory
      // and passes as the device said it.
      if (!absl::IsResourceExhausted(r.status()) || IsOutOfFileDescriptors(r.status())) return r.status();
      out_of_memory_.fetch_add(1, std::memory_order_relaxed);
      absl::StatusOr<DeviceInfo> info = device_->Info();
      return absl::ResourceExhaustedError(absl::StrCat(needs, " but the device has ", info.ok() ? info->free_bytes : 0,
                                                       " bytes free: ", r.status().message()));
    }
    made.push_back(*std::move(r));
    if (observer != nullptr && made.back().mapped) observer->Mapped(made.back().info);
  }
  // Into the FD store before any client can see them: a restart after the commit finds them there.
  const absl::Time keep_start = absl::Now();
  KVD_RETURN_IF_ERROR(Keep(made));
  times.store += absl::Now() - keep_start;
  std::move(undo).Cancel();
  return made;
}

absl::Status ChunkMaker::MapInView(uint64_t base, absl::Span<ChunkRecord* const> chunks) {
  std::vector<ChunkRecord*> mapped;
  for (ChunkRecord* r : chunks) {
    if (r->mapped) continue;
    if (absl::Status s = device_->Map(base + r->info.offset, r->chunk, Access::kReadWrite); !s.ok()) {
      for (ChunkRecord* m : mapped) {
        device_->Unmap(base + m->info.offset, m->info.bytes).IgnoreError();
        m->mapped = false;
      }
      return s;
    }
    r->mapped = true;
    mapped.push_back(r);
  }
  return absl::OkStatus();
}

absl::StatusOr<ChunkRecord> ChunkMaker::Adopt(uint64_t base, const ChunkInfo& info, UniqueFd fd) {
  KVD_RETURN_IF_ERROR(CheckChunkFd(device_->kind(), fd.get(), info.bytes));
  absl::StatusOr<Chunk> chunk = device_->Import(fd.get(), info.bytes);
  if (!chunk.ok()) {
    return absl::Status(chunk.status().code(), absl::StrCat("cannot be imported: ", chunk.status().message()));
  }
  if (absl::Status mapped = device_->Map(base + info.offset, *chunk, Access::kReadWrite); !mapped.ok()) {
    device_->Release(*chunk).IgnoreError();
    return absl::Status(mapped.code(), absl::StrCat("cannot be mapped: ", mapped.message()));
  }
  ChunkRecord r{.info = info, .chunk = *chunk, .handle_is_fd = HandleIsFd(), .mapped = true};
  if (!r.handle_is_fd) r.exported = std::move(fd);
  return r;
}

absl::Status ChunkMaker::Keep(absl::Span<const ChunkRecord> chunks) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (absl::Status kept = store_->KeepChunkFd(chunks[i].info.id, chunks[i].fd()); !kept.ok()) {
      for (size_t j = 0; j < i; ++j) store_->DropChunkFd(chunks[j].info.id);
      return kept;
    }
  }
  return absl::OkStatus();
}

void ChunkMaker::Discard(uint64_t base, ChunkRecord& r, StoreFd store_fd) {
  if (store_fd == StoreFd::kForget) store_->DropChunkFd(r.info.id);
  if (r.mapped) device_->Unmap(base + r.info.offset, r.info.bytes).IgnoreError();
  r.mapped = false;
  device_->Release(r.chunk).IgnoreError();
  r.exported.reset();
}

}  // namespace kvd::daemon
