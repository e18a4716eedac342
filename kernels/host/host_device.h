// The host backend (docs/backends.md, "host"): kvd's embedded default and the backend CI runs on. Device
// memory is ordinary host memory held in memfds, so every lifecycle step of a GPU backend has a real,
// observable counterpart here:
//
//   Reserve  mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE), trimmed to a
//            granularity-aligned start; Free munmaps it.
//   Create   memfd_create + ftruncate + fallocate: the pages are allocated now, so running out of
//            memory is RESOURCE_EXHAUSTED from Create, never a SIGBUS on first touch.
//   Map      mmap(MAP_SHARED | MAP_FIXED) of the whole memfd over part of a reservation: one
//            mapping per chunk, never per page (vm.max_map_count is 65530 by default).
//   Unmap    maps the range back to PROT_NONE anonymous memory, so the VA stays reserved and can be
//            mapped again.
//   Export   a CLOEXEC dup of the memfd; Import keeps a CLOEXEC dup of the FD it is given.
//   Release  closes this holder's memfd. The kernel frees the pages once the last FD and the last
//            mapping in every process are gone (visible as a drop of "Shmem:" in /proc/meminfo).
//
// Capacity. `DeviceOptions.host_capacity` (0: the machine's physical memory) bounds the bytes of
// chunks this Device has created and not yet released; Create also refuses more than the kernel's
// MemAvailable estimate, since committing past it would invite the OOM killer. Imported chunks are
// not counted: they are memory some Create already counted (in this or another process), and
// counting them again would charge the same pages twice. A chunk counts until Release, even if it is
// still mapped afterwards.
//
// Granularity. `DeviceOptions.host_granularity` (default 2 MiB, like the GPUs): a power of two and a
// multiple of the page size. Every size and address given to Reserve/Free/Create/Map/Unmap/Import
// must be a multiple of it.
//
// Checks. Misuse is an error rather than memory corruption, with the codes of device.h's contract
// ("Misuse"): the device's VaBook (va_book.h) tracks its reservations, mappings and chunks (memfds)
// and checks every call against them before any system call.
//
// Threads. Every method is safe to call concurrently. Copies and block operations hold the book's
// address-space lock shared while they touch memory, so a concurrent Map/Unmap/Free waits for them;
// Create and Release never wait for a copy (va_book.h).
//
// Destruction. Destroying the Device closes the FDs of chunks the caller never released (mappings
// keep their memory); reservations and mappings are left in place for the caller to give back.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvd/device.h"
#include "va_book.h"

namespace kvd {

class HostDevice final : public Device {
 public:
  // INVALID_ARGUMENT naming `host_granularity` when it is not a power of two and a multiple of the
  // page size; INVALID_ARGUMENT naming `index` when it is negative. Any other index opens: each is a
  // distinct device (its own UUID) standing in for one GPU of a node, all backed by host memory.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HostDevice>> Open(const DeviceOptions& options);

  HostDevice(const HostDevice&) = delete;
  HostDevice& operator=(const HostDevice&) = delete;
  ~HostDevice() override;

  BackendKind kind() const override { return BackendKind::kHost; }
  uint64_t granularity() const override { return granularity_; }
  // total_bytes is the capacity; free_bytes is min(capacity - committed, MemAvailable); the UUID is
  // "host-<boot id>-<index>", stable until the machine reboots and distinct for every index.
  [[nodiscard]] absl::StatusOr<DeviceInfo> Info() override;

  [[nodiscard]] absl::StatusOr<uint64_t> Reserve(uint64_t bytes) override;
  // `va` and `bytes` must be exactly a live reservation (INVALID_ARGUMENT) with no mappings left
  // (FAILED_PRECONDITION).
  [[nodiscard]] absl::Status Free(uint64_t va, uint64_t bytes) override;

  // RESOURCE_EXHAUSTED naming the bytes asked and free when past the capacity or MemAvailable, or
  // when the kernel refuses the pages.
  [[nodiscard]] absl::StatusOr<Chunk> Create(uint64_t bytes) override;
  [[nodiscard]] absl::Status Release(const Chunk& chunk) override;

  // INVALID_ARGUMENT unless [va, va + chunk.bytes) lies inside a live reservation of this Device;
  // FAILED_PRECONDITION if part of it is already mapped.
  [[nodiscard]] absl::Status Map(uint64_t va, const Chunk& chunk, Access access) override;
  // Every mapping the range touches must lie entirely inside it; unmapped parts are left as they are.
  [[nodiscard]] absl::Status Unmap(uint64_t va, uint64_t bytes) override;

  [[nodiscard]] absl::StatusOr<int> Export(const Chunk& chunk) override;
  // `fd` must be a memfd (or other shmem file) of at least `bytes` bytes: INVALID_ARGUMENT otherwise.
  [[nodiscard]] absl::StatusOr<Chunk> Import(int fd, uint64_t bytes) override;

  [[nodiscard]] absl::Status CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) override;
  [[nodiscard]] absl::Status CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) override;
  [[nodiscard]] absl::Status CopyRange(uint64_t dst_va, uint64_t src_va, uint64_t bytes) override;

  [[nodiscard]] absl::Status ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) override;
  [[nodiscard]] absl::Status CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) override;
  [[nodiscard]] absl::Status PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks,
                                        uint64_t dst) override;
  [[nodiscard]] absl::Status UnpackBlocks(const BlockSpan& span, uint64_t src,
                                          absl::Span<const uint64_t> blocks) override;

  // OK for every "host-<this boot id>-<N>" (host memory is reachable from every host device);
  // FAILED_PRECONDITION for a host UUID of another boot or machine, or a device of another backend.
  [[nodiscard]] absl::Status CheckPeerAccess(absl::string_view owner_uuid) override;
  DeviceCapabilities Capabilities() const override;

 private:
  HostDevice(int index, uint64_t capacity, uint64_t used_by_others, uint64_t granularity, std::string uuid);
  // The capacity less the bytes other processes "use" and the live created chunks'.
  uint64_t FreeOf(uint64_t committed) const;

  const int index_;
  const uint64_t capacity_;
  const uint64_t used_by_others_;  // DeviceOptions::host_used_by_others
  const uint64_t granularity_;
  const std::string uuid_;

  // Bytes of live created chunks, and of live imports of memory another process created (a restarted
  // daemon's pools, chunks clients give back): what this process holds of the host's memory, as a GPU
  // driver counts device memory. Create reserves its bytes here before allocating (so concurrent Creates
  // cannot overshoot the capacity together) and gives them back if it fails. An import of this device's
  // own chunk is not counted again.
  std::atomic<uint64_t> committed_{0};
  absl::Mutex imports_mu_;
  absl::btree_map<uint64_t, uint64_t> created_inodes_ ABSL_GUARDED_BY(imports_mu_);   // inode -> live created chunks
  absl::btree_map<uint64_t, uint64_t> counted_imports_ ABSL_GUARDED_BY(imports_mu_);  // handle -> bytes counted

  // Reservations, mappings and live chunks (memfds), and every misuse check of the contract.
  VaBook book_;
};

}  // namespace kvd
