// VaBook: the device contract's bookkeeping (device.h, "Misuse"), written once for every backend.
// See Note [One device contract, one book] in docs/architecture.md.
// It tracks one Device's reservations, the mappings inside them and its live chunks, and it answers
// every misuse check of the contract with the contract's status, so host, CUDA and HIP give the same
// code for the same mistake. It knows nothing of any vendor: handles and addresses are uint64s.
//
// Order. Each mutating call takes the vendor call as a callback and runs it between the check and
// the record: check with the book -> vendor call -> record only if the vendor call succeeded. A failed
// vendor call therefore leaves the book as it was (Release, whose vendor call runs outside the lock,
// takes the chunk out first and puts it back on failure). Reserve, Create and Import call the vendor
// first (the vendor picks the address or handle) and then Add* the result; if Add* refuses, the caller
// undoes its vendor call.
//
// Threads. Every method is safe to call concurrently. Two mutexes, taken in this order:
//   va_mu_      reservations and mappings. Free/Map/Unmap hold it exclusively around their vendor
//               calls; UseRange/UseBlocks hold it shared while the device touches memory, so a
//               concurrent Unmap or Free waits until the copy or kernel is done.
//   chunks_mu_  live chunks. Map and WithLiveChunk hold it shared around their vendor calls, so a
//               concurrent Release cannot free a handle (close a memfd) under them; Create, Import
//               and Release never wait for a copy.
// Callbacks run with those locks held: they must not call back into the same VaBook.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvd/device.h"

namespace kvd {

// How a live chunk came to be: the host backend counts created chunks against its capacity.
enum class ChunkOrigin { kCreated, kImported };

// Where a Map is about to go, for vendor rules that depend on it (HIP's growth gate).
struct MapSite {
  uint64_t reservation_va = 0;
  uint64_t reservation_bytes = 0;
  size_t mappings = 0;  // mappings the reservation holds already
};

// A live chunk and the number of Create/Import results for it not yet released.
struct LiveChunk {
  Chunk chunk;
  int references = 0;
  ChunkOrigin origin = ChunkOrigin::kCreated;
};

class VaBook {
 public:
  // `granularity`: the device's; every size and address of a reservation, chunk or mapping is a
  // positive multiple of it.
  explicit VaBook(uint64_t granularity);

  VaBook(const VaBook&) = delete;
  VaBook& operator=(const VaBook&) = delete;

  uint64_t granularity() const { return granularity_; }

  // OK when `value` is a positive multiple of the granularity; otherwise INVALID_ARGUMENT
  // "<call>: <what> <value> is not a positive multiple of the granularity (<g> bytes)".
  [[nodiscard]] absl::Status CheckSize(absl::string_view call, absl::string_view what, uint64_t value) const;

  // Reservations. Records [va, va + bytes) that the vendor has just reserved: INVALID_ARGUMENT when
  // not aligned, INTERNAL when it overlaps a reservation the book already holds (the vendor handed
  // out the same address twice); the caller then gives the VA back.
  [[nodiscard]] absl::Status AddReservation(uint64_t va, uint64_t bytes);
  // INVALID_ARGUMENT unless [va, va + bytes) is exactly a reservation; FAILED_PRECONDITION while it
  // holds mappings. Then `vendor_free()`; the reservation is forgotten only if that succeeds.
  [[nodiscard]] absl::Status Free(uint64_t va, uint64_t bytes, absl::FunctionRef<absl::Status()> vendor_free);

  // Chunks. Records one more reference to `chunk` (a Create or Import result): INVALID_ARGUMENT when
  // its size is not aligned, or when the handle is live already with another size (an Import that
  // disagrees with what the device knows); the caller then releases the vendor handle.
  [[nodiscard]] absl::Status AddChunk(const Chunk& chunk, ChunkOrigin origin);
  // INVALID_ARGUMENT "<call>: chunk {handle H, N bytes} is not live on this device" unless a chunk
  // with that handle and size is live. Then drops one reference and runs `vendor_release(origin)`
  // without the book's locks (freeing memory can be slow); if that fails the reference is put back.
  [[nodiscard]] absl::Status Release(const Chunk& chunk, absl::FunctionRef<absl::Status(ChunkOrigin)> vendor_release);
  // INVALID_ARGUMENT (as Release) unless `chunk` is live; then runs `use()` while no Release of it can
  // run (Export duplicates the chunk's handle under it).
  [[nodiscard]] absl::Status WithLiveChunk(absl::string_view call, const Chunk& chunk,
                                           absl::FunctionRef<absl::Status()> use);
  // Every live chunk, for a destructor that gives back what the caller never released.
  std::vector<LiveChunk> LiveChunks() const;

  // Mappings. INVALID_ARGUMENT when `va` is not aligned, when `chunk` is not live (unknown handle or
  // another size), or when [va, va + chunk.bytes) is not inside one reservation; FAILED_PRECONDITION
  // when it overlaps a mapping. Then `vendor_map(site)`; the mapping is recorded only if it succeeds.
  [[nodiscard]] absl::Status Map(uint64_t va, const Chunk& chunk, Access access,
                                 absl::FunctionRef<absl::Status(const MapSite&)> vendor_map);
  // INVALID_ARGUMENT when `va` or `bytes` is not aligned, when [va, va + bytes) is not inside one
  // reservation, or when it cuts a mapping (holds part of one). Unmapped parts of the range are left
  // as they are. Then `vendor_unmap(mapping_va, mapping_bytes)` once per mapping in the range, in
  // address order; each is forgotten as soon as its call succeeds, and the first failure stops there.
  [[nodiscard]] absl::Status Unmap(uint64_t va, uint64_t bytes,
                                   absl::FunctionRef<absl::Status(uint64_t, uint64_t)> vendor_unmap);

  // Memory use. Runs `touch()` once every byte of [va, va + bytes) is known to be mapped by this
  // device (and mapped read-write if `write`), holding off Unmap and Free until it returns. Nothing
  // to check for bytes == 0. INVALID_ARGUMENT when the range wraps or is not inside one reservation;
  // FAILED_PRECONDITION naming the first byte that is reserved but not mapped, or mapped read-only
  // where `write` is asked.
  [[nodiscard]] absl::Status UseRange(absl::string_view call, uint64_t va, uint64_t bytes, bool write,
                                      absl::FunctionRef<absl::Status()> touch);
  // The same for a device-to-device copy: [src, src + bytes) mapped, [dst, dst + bytes) mapped
  // read-write. INVALID_ARGUMENT also when the two ranges overlap.
  [[nodiscard]] absl::Status UseCopy(absl::string_view call, uint64_t dst, uint64_t src, uint64_t bytes,
                                     absl::FunctionRef<absl::Status()> touch);
  // The same for a block operation: the committed run (span.blocks * span.block_bytes bytes) of each
  // segment of `span` (written if `span_write`) and, when `packed_count` > 0, `packed_count` packed
  // blocks at `packed` (written if `packed_write`). INVALID_ARGUMENT also when the span's extent
  // overflows or its segments overlap (segment_stride smaller than the committed run).
  [[nodiscard]] absl::Status UseBlocks(absl::string_view call, const BlockSpan& span, bool span_write, uint64_t packed,
                                       uint64_t packed_count, bool packed_write,
                                       absl::FunctionRef<absl::Status()> touch);

  // For tests and metrics: counts of what the book holds now.
  size_t reservation_count() const;
  size_t mapping_count() const;
  size_t live_chunk_count() const;

 private:
  struct Mapping {
    uint64_t bytes = 0;
    Access access = Access::kReadWrite;
  };
  struct Reservation {
    uint64_t bytes = 0;
    absl::btree_map<uint64_t, Mapping> mappings;  // by start address
  };
  struct ChunkRecord {
    uint64_t bytes = 0;
    int references = 0;
    ChunkOrigin origin = ChunkOrigin::kCreated;
  };
  using Reservations = std::map<uint64_t, Reservation>;

  // The reservation holding all of [va, va + bytes), or end(); `bytes` may be 0.
  Reservations::iterator FindReservation(uint64_t va, uint64_t bytes) ABSL_SHARED_LOCKS_REQUIRED(va_mu_);
  // INVALID_ARGUMENT unless `chunk` is live with its size.
  absl::Status CheckLive(absl::string_view call, const Chunk& chunk) const ABSL_SHARED_LOCKS_REQUIRED(chunks_mu_);
  // UseRange's check.
  absl::Status CheckMapped(absl::string_view call, uint64_t va, uint64_t bytes, bool write)
      ABSL_SHARED_LOCKS_REQUIRED(va_mu_);

  const uint64_t granularity_;

  mutable absl::Mutex va_mu_ ABSL_ACQUIRED_BEFORE(chunks_mu_);
  Reservations reservations_ ABSL_GUARDED_BY(va_mu_);  // by start address
  mutable absl::Mutex chunks_mu_;
  absl::btree_map<uint64_t, ChunkRecord> chunks_ ABSL_GUARDED_BY(chunks_mu_);  // by handle
};

}  // namespace kvd
