// ChunkMaker: the one place a pool's chunks are made and given back on the device — for a grow or wake
// (staging), a reshape's new chunks, and chunks adopted from an FD (a restore, ReturnHandles). A chunk is
// made by creating it, exporting it once (its FD, and its fabric handle where the device has them) and
// keeping its FD in the state store before any client can see it (Note [Durable pools] in
// docs/architecture.md); it is mapped into the daemon's view at `base` only where the daemon touches its
// bytes (Note [The daemon maps on demand]). A failure at any step undoes every step before it.
// Thread-safe as the device and the store are; callers hold the pool's op_mu.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "daemon/core/chunk_table.h"
#include "daemon/core/durable.h"
#include "daemon/core/geometry.h"
#include "daemon/core/pool_types.h"
#include "kvd/device.h"

namespace kvd::daemon {

class ChunkMaker {
 public:
  // Everything must outlive the maker. `next_id` numbers the chunks (never reused: Note [Durable pools]).
  ChunkMaker(Device* device, StateStore* store, std::atomic<uint64_t>* next_id, bool fabric)
      : device_(device), store_(store), next_id_(next_id), fabric_(fabric) {}

  // Told, while Make runs, of each chunk once it is mapped in the daemon's view (a wake copies its kept
  // contents into it while the next chunks are made: Note [The host tier]), and, before a failure undoes
  // them, that they are about to be unmapped.
  class Observer {
   public:
    virtual ~Observer() = default;
    virtual void Mapped(const ChunkInfo& chunk) = 0;
    virtual void Undoing() = 0;
  };

  // Whether Make maps the chunks into the daemon's view: now (a reshape copies into them, a wake its kept
  // contents), or only when the daemon first touches their bytes (MapInView).
  enum class Map { kNow, kOnDemand };

  // Makes the chunks of `plan` for the view at `base`, their FDs kept in the store. All or nothing. A device
  // out of memory (not of file descriptors) is RESOURCE_EXHAUSTED "<needs> but the device has N bytes free:
  // <the device's words>"; every other failure (a store that refuses an FD too) passes as it is.
  // `observer` (with Map::kNow) is told of each chunk once it is mapped; `phases`, where given, gets the time
  // of each step added (create, exported, map, store).
  [[nodiscard]] absl::StatusOr<std::vector<ChunkRecord>> Make(uint64_t base, const std::vector<PlannedChunk>& plan,
                                                              absl::string_view needs, Map map,
                                                              Observer* observer = nullptr,
                                                              ResizePhases* phases = nullptr);
  // Maps `chunks` (a pool's; those mapped already are skipped) into the daemon's view at `base`, before the
  // daemon touches their bytes. All or nothing: on the device's failure the ones this call mapped are unmapped.
  [[nodiscard]] absl::Status MapInView(uint64_t base, absl::Span<ChunkRecord* const> chunks);
  // The record of chunk `info` with the memory of `fd`, imported and mapped at `base`; it keeps `fd` as its
  // export where the device's handle is not an FD itself (on the host backend the import is a dup of it,
  // and `fd` is closed). INVALID_ARGUMENT when the FD cannot be that chunk (on the host backend, a memfd of
  // another size), and the device's own codes worded "cannot be imported: ..." or "cannot be mapped: ...".
  // Nothing is left on a failure (`fd` is closed).
  [[nodiscard]] absl::StatusOr<ChunkRecord> Adopt(uint64_t base, const ChunkInfo& info, UniqueFd fd);
  // Hands each chunk's FD to the store; on a refusal takes back the ones it handed and returns why.
  [[nodiscard]] absl::Status Keep(absl::Span<const ChunkRecord> chunks);

  // Whether a discarded chunk's FD leaves the store (kForget) or stays for the next daemon (kLeave: a
  // restart, or a chunk whose FD was never kept).
  enum class StoreFd { kForget, kLeave };
  // Unmaps the chunk from the view at `base` (where it is mapped), releases the daemon's handle and closes its
  // export.
  void Discard(uint64_t base, ChunkRecord& chunk, StoreFd store_fd = StoreFd::kForget);
  // The pool's record no longer names chunk `id`: its FD leaves the store (its memory goes later).
  void ForgetFd(uint64_t id) { store_->DropChunkFd(id); }
  // Creations the device refused for want of memory (admission should have kept them from it: Note
  // [Arbitration]), since the maker was made.
  uint64_t out_of_memory() const { return out_of_memory_.load(std::memory_order_relaxed); }

 private:
  // Whether a chunk's handle is an FD of its memory (host: the memfd; kvd/device.h, Chunk), so that a record
  // keeps no export beside it.
  bool HandleIsFd() const { return device_->kind() == BackendKind::kHost; }
  // Create, export and (Map::kNow) map, without the store.
  [[nodiscard]] absl::StatusOr<ChunkRecord> MakeOne(uint64_t base, const PlannedChunk& planned, Map map,
                                                    ResizePhases& phases);

  Device* const device_;
  StateStore* const store_;
  std::atomic<uint64_t>* const next_id_;
  const bool fabric_;
  std::atomic<uint64_t> out_of_memory_{0};
};

}  // namespace kvd::daemon
