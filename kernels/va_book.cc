#include "va_book.h"

#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvd/checked_math.h"
#include "kvd/status.h"

namespace kvd {
namespace {

std::string Hex(uint64_t value) { return absl::StrFormat("0x%x", value); }

std::string Range(uint64_t va, uint64_t bytes) { return absl::StrFormat("[0x%x, +%u)", va, bytes); }

std::string Describe(const Chunk& chunk) {
  return absl::StrCat("chunk {handle ", chunk.handle, ", ", chunk.bytes, " bytes}");
}

}  // namespace

VaBook::VaBook(uint64_t granularity) : granularity_(granularity) {}

absl::Status VaBook::CheckSize(absl::string_view call, absl::string_view what, uint64_t value) const {
  if (value == 0 || granularity_ == 0 || value % granularity_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": ", what, " ", value, " is not a positive multiple of the granularity (", granularity_, " bytes)"));
  }
  return absl::OkStatus();
}

VaBook::Reservations::iterator VaBook::FindReservation(uint64_t va, uint64_t bytes) {
  auto it = reservations_.upper_bound(va);
  if (it == reservations_.begin()) return reservations_.end();
  --it;
  const uint64_t offset = va - it->first;
  if (offset >= it->second.bytes || bytes > it->second.bytes - offset) return reservations_.end();
  return it;
}

absl::Status VaBook::AddReservation(uint64_t va, uint64_t bytes) {
  KVD_RETURN_IF_ERROR(CheckSize("Reserve", "bytes", bytes));
  KVD_RETURN_IF_ERROR(CheckSize("Reserve", "va", va));
  if (!CheckedAdd(va, bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("Reserve: ", Range(va, bytes), " wraps around the address space"));
  }
  absl::MutexLock lock(&va_mu_);
  auto next = reservations_.lower_bound(va);
  const bool overlaps_next = next != reservations_.end() && next->first < va + bytes;
  const bool overlaps_prev =
      next != reservations_.begin() && std::prev(next)->first + std::prev(next)->second.bytes > va;
  if (overlaps_next || overlaps_prev) {
    return absl::InternalError(absl::StrCat("Reserve: the driver returned ", Range(va, bytes),
                                            ", which overlaps a live reservation of this device"));
  }
  reservations_.emplace_hint(next, va, Reservation{.bytes = bytes, .mappings = {}});
  return absl::OkStatus();
}

absl::Status VaBook::Free(uint64_t va, uint64_t bytes, absl::FunctionRef<absl::Status()> vendor_free) {
  absl::MutexLock lock(&va_mu_);
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second.bytes != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("Free: ", Range(va, bytes), " is not a reservation of this device"));
  }
  if (!it->second.mappings.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("Free: ", it->second.mappings.size(),
                                                      " mapping(s) are still live in ", Range(va, bytes),
                                                      "; unmap them first"));
  }
  KVD_RETURN_IF_ERROR(vendor_free());
  reservations_.erase(it);
  return absl::OkStatus();
}

absl::Status VaBook::AddChunk(const Chunk& chunk, ChunkOrigin origin) {
  KVD_RETURN_IF_ERROR(CheckSize(origin == ChunkOrigin::kCreated ? "Create" : "Import", "bytes", chunk.bytes));
  absl::MutexLock lock(&chunks_mu_);
  auto [it, inserted] =
      chunks_.try_emplace(chunk.handle, ChunkRecord{.bytes = chunk.bytes, .references = 0, .origin = origin});
  if (!inserted && it->second.bytes != chunk.bytes) {
    return absl::InvalidArgumentError(absl::StrCat(origin == ChunkOrigin::kCreated ? "Create" : "Import", ": handle ",
                                                   chunk.handle, " is live already as a chunk of ", it->second.bytes,
                                                   " bytes, not ", chunk.bytes));
  }
  ++it->second.references;
  return absl::OkStatus();
}

absl::Status VaBook::CheckLive(absl::string_view call, const Chunk& chunk) const {
  auto it = chunks_.find(chunk.handle);
  if (it == chunks_.end() || it->second.bytes != chunk.bytes) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", Describe(chunk), " is not live on this device"));
  }
  return absl::OkStatus();
}

absl::Status VaBook::Release(const Chunk& chunk, absl::FunctionRef<absl::Status(ChunkOrigin)> vendor_release) {
  ChunkOrigin origin;
  {
    absl::MutexLock lock(&chunks_mu_);
    KVD_RETURN_IF_ERROR(CheckLive("Release", chunk));
    auto it = chunks_.find(chunk.handle);
    origin = it->second.origin;
    if (--it->second.references == 0) chunks_.erase(it);
  }
  absl::Status s = vendor_release(origin);
  if (!s.ok()) {
    absl::MutexLock lock(&chunks_mu_);
    auto [it, inserted] =
        chunks_.try_emplace(chunk.handle, ChunkRecord{.bytes = chunk.bytes, .references = 0, .origin = origin});
    ++it->second.references;
  }
  return s;
}

absl::Status VaBook::WithLiveChunk(absl::string_view call, const Chunk& chunk, absl::FunctionRef<absl::Status()> use) {
  absl::ReaderMutexLock lock(&chunks_mu_);
  KVD_RETURN_IF_ERROR(CheckLive(call, chunk));
  return use();
}

std::vector<LiveChunk> VaBook::LiveChunks() const {
  absl::ReaderMutexLock lock(&chunks_mu_);
  std::vector<LiveChunk> out;
  out.reserve(chunks_.size());
  for (const auto& [handle, record] : chunks_) {
    out.push_back(LiveChunk{.chunk = Chunk{.handle = handle, .bytes = record.bytes},
                            .references = record.references,
                            .origin = record.origin});
  }
  return out;
}

absl::Status VaBook::Map(uint64_t va, const Chunk& chunk, Access access,
                         absl::FunctionRef<absl::Status(const MapSite&)> vendor_map) {
  KVD_RETURN_IF_ERROR(CheckSize("Map", "va", va));
  absl::MutexLock va_lock(&va_mu_);
  // Held through the vendor call, so a concurrent Release cannot free the handle under it.
  absl::ReaderMutexLock chunks_lock(&chunks_mu_);
  KVD_RETURN_IF_ERROR(CheckLive("Map", chunk));
  auto reservation = FindReservation(va, chunk.bytes);
  if (reservation == reservations_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Map: ", Range(va, chunk.bytes), " is not inside a reservation of this device"));
  }
  absl::btree_map<uint64_t, Mapping>& mappings = reservation->second.mappings;
  // Mappings do not overlap, so only the last one starting below the end can reach into the range.
  auto next = mappings.lower_bound(va + chunk.bytes);
  if (next != mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > va) {
      return absl::FailedPreconditionError(absl::StrCat("Map: ", Range(va, chunk.bytes), " overlaps the mapping ",
                                                        Range(prev->first, prev->second.bytes)));
    }
  }
  KVD_RETURN_IF_ERROR(vendor_map(MapSite{.reservation_va = reservation->first,
                                         .reservation_bytes = reservation->second.bytes,
                                         .mappings = mappings.size()}));
  mappings.emplace_hint(next, va, Mapping{.bytes = chunk.bytes, .access = access});
  return absl::OkStatus();
}

absl::Status VaBook::Unmap(uint64_t va, uint64_t bytes,
                           absl::FunctionRef<absl::Status(uint64_t, uint64_t)> vendor_unmap) {
  KVD_RETURN_IF_ERROR(CheckSize("Unmap", "va", va));
  KVD_RETURN_IF_ERROR(CheckSize("Unmap", "bytes", bytes));
  absl::MutexLock lock(&va_mu_);
  auto reservation = FindReservation(va, bytes);
  if (reservation == reservations_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unmap: ", Range(va, bytes), " is not inside a reservation of this device"));
  }
  absl::btree_map<uint64_t, Mapping>& mappings = reservation->second.mappings;
  const uint64_t end = va + bytes;  // FindReservation ruled out a wrap
  auto first = mappings.lower_bound(va);
  if (first != mappings.begin()) {
    auto prev = std::prev(first);
    if (prev->first + prev->second.bytes > va) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unmap: ", Range(va, bytes), " cuts the mapping ", Range(prev->first, prev->second.bytes)));
    }
  }
  for (auto it = first; it != mappings.end() && it->first < end; ++it) {
    if (it->first + it->second.bytes > end) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unmap: ", Range(va, bytes), " cuts the mapping ", Range(it->first, it->second.bytes)));
    }
  }
  // One vendor call per mapping (the drivers cannot unmap part of one and need not see the holes);
  // each mapping is forgotten once its own call succeeded. An erase invalidates the btree's other
  // iterators, so the loop ends by address, not at an iterator taken before it.
  while (first != mappings.end() && first->first < end) {
    KVD_RETURN_IF_ERROR(vendor_unmap(first->first, first->second.bytes));
    first = mappings.erase(first);
  }
  return absl::OkStatus();
}

absl::Status VaBook::CheckMapped(absl::string_view call, uint64_t va, uint64_t bytes, bool write) {
  if (bytes == 0) return absl::OkStatus();
  if (!CheckedAdd(va, bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", Range(va, bytes), " wraps around the address space"));
  }
  auto reservation = FindReservation(va, bytes);
  if (reservation == reservations_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", Range(va, bytes), " is not inside a reservation of this device"));
  }
  const absl::btree_map<uint64_t, Mapping>& mappings = reservation->second.mappings;
  const uint64_t end = va + bytes;
  uint64_t cursor = va;
  auto it = mappings.upper_bound(cursor);
  if (it != mappings.begin()) --it;
  for (;;) {
    if (it == mappings.end() || it->first > cursor || it->first + it->second.bytes <= cursor) {
      return absl::FailedPreconditionError(
          absl::StrCat(call, ": ", Hex(cursor), " in ", Range(va, bytes), " is reserved but not mapped"));
    }
    if (write && it->second.access == Access::kRead) {
      return absl::FailedPreconditionError(
          absl::StrCat(call, ": ", Hex(cursor), " in ", Range(va, bytes), " is mapped read-only"));
    }
    cursor = it->first + it->second.bytes;
    if (cursor >= end) return absl::OkStatus();
    ++it;
  }
}

absl::Status VaBook::UseRange(absl::string_view call, uint64_t va, uint64_t bytes, bool write,
                              absl::FunctionRef<absl::Status()> touch) {
  absl::ReaderMutexLock lock(&va_mu_);
  KVD_RETURN_IF_ERROR(CheckMapped(call, va, bytes, write));
  return touch();
}

absl::Status VaBook::UseCopy(absl::string_view call, uint64_t dst, uint64_t src, uint64_t bytes,
                             absl::FunctionRef<absl::Status()> touch) {
  if (bytes == 0) return absl::OkStatus();
  if (dst < src ? src - dst < bytes : dst - src < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": dst ", Hex(dst), " and src ", Hex(src), " overlap within ", bytes, " bytes"));
  }
  absl::ReaderMutexLock lock(&va_mu_);
  KVD_RETURN_IF_ERROR(CheckMapped(call, src, bytes, /*write=*/false));
  KVD_RETURN_IF_ERROR(CheckMapped(call, dst, bytes, /*write=*/true));
  return touch();
}

absl::Status VaBook::UseBlocks(absl::string_view call, const BlockSpan& span, bool span_write, uint64_t packed,
                               uint64_t packed_count, bool packed_write, absl::FunctionRef<absl::Status()> touch) {
  std::optional<uint64_t> run = CheckedMul(span.blocks, span.block_bytes);
  std::optional<uint64_t> last = uint64_t{0};
  if (span.segments > 1) last = CheckedMul(span.segments - 1, span.segment_stride);
  if (!run || !last || !CheckedAdd(span.base, *last) || !CheckedAdd(span.base + *last, *run)) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": span: its extent overflows 64 bits"));
  }
  if (span.segments > 1 && span.segment_stride < *run) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": span: segment_stride ", span.segment_stride,
                                                   " is smaller than the committed run of ", *run, " bytes"));
  }
  std::optional<uint64_t> packed_bytes = CheckedMul(span.segments, span.block_bytes);
  if (packed_bytes) packed_bytes = CheckedMul(*packed_bytes, packed_count);
  if (!packed_bytes)
    return absl::InvalidArgumentError(absl::StrCat(call, ": the packed blocks' size overflows 64 bits"));

  absl::ReaderMutexLock lock(&va_mu_);
  for (uint64_t s = 0; s < span.segments; ++s) {
    KVD_RETURN_IF_ERROR(CheckMapped(call, span.base + s * span.segment_stride, *run, span_write));
  }
  if (packed_count > 0) {
    if (packed == 0) return absl::InvalidArgumentError(absl::StrCat(call, ": the packed buffer is null"));
    KVD_RETURN_IF_ERROR(CheckMapped(call, packed, *packed_bytes, packed_write));
  }
  return touch();
}

size_t VaBook::reservation_count() const {
  absl::ReaderMutexLock lock(&va_mu_);
  return reservations_.size();
}

size_t VaBook::mapping_count() const {
  absl::ReaderMutexLock lock(&va_mu_);
  size_t n = 0;
  for (const auto& [va, reservation] : reservations_) n += reservation.mappings.size();
  return n;
}

size_t VaBook::live_chunk_count() const {
  absl::ReaderMutexLock lock(&chunks_mu_);
  return chunks_.size();
}

}  // namespace kvd
