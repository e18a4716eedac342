#include "host/host_device.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "backends.h"
#include "kvd/checked_math.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"

namespace kvd {
namespace {

constexpr char kName[] = "host memory (memfd)";
constexpr char kMemfdName[] = "kvd-chunk";  // shows in /proc/<pid>/maps as /memfd:kvd-chunk

std::string Range(uint64_t va, uint64_t bytes) { return absl::StrFormat("[0x%x, +%u)", va, bytes); }

// The kernel's estimate of memory available without swapping ("MemAvailable:" in /proc/meminfo).
std::optional<uint64_t> MemAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    absl::string_view rest(line);
    if (!absl::ConsumePrefix(&rest, "MemAvailable:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    uint64_t kib;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) return std::nullopt;
    return CheckedMul(kib, 1024);
  }
  return std::nullopt;
}

// The kernel's boot id: stable until reboot, different on every machine; else the host name.
std::string ReadBootId() {
  std::ifstream file("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (std::getline(file, boot_id)) {
    absl::StripAsciiWhitespace(&boot_id);
    if (!boot_id.empty()) return boot_id;
  }
  char hostname[HOST_NAME_MAX + 1] = {};
  if (gethostname(hostname, sizeof(hostname) - 1) == 0 && hostname[0] != '\0') return hostname;
  return "unknown";
}

std::byte* Address(uint64_t va) { return reinterpret_cast<std::byte*>(static_cast<uintptr_t>(va)); }

// Puts [va, va + bytes) back to reserved-but-unbacked address space. -1 with errno on failure.
int RemapReserved(uint64_t va, uint64_t bytes) {
  void* p = mmap(Address(va), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return p == MAP_FAILED ? -1 : 0;
}

// Block `id` of segment `s` (device.h, BlockSpan).
std::byte* SegmentBlock(const BlockSpan& span, uint64_t s, uint64_t id) {
  return Address(span.base + s * span.segment_stride + id * span.block_bytes);
}

}  // namespace

const std::string& HostBootId() {
  static const std::string* const boot_id = new std::string(ReadBootId());
  return *boot_id;
}

std::optional<int> ParseHostDeviceUuid(absl::string_view uuid) {
  const std::string prefix = absl::StrCat("host-", HostBootId(), "-");
  if (uuid.size() <= prefix.size() || !absl::StartsWithIgnoreCase(uuid, prefix)) return std::nullopt;
  const absl::string_view digits = uuid.substr(prefix.size());
  int index = 0;
  if (!std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit) || !absl::SimpleAtoi(digits, &index)) {
    return std::nullopt;
  }
  return index;
}

absl::StatusOr<std::unique_ptr<Device>> OpenHostDevice(const DeviceOptions& options) {
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<HostDevice> device, HostDevice::Open(options));
  return std::unique_ptr<Device>(std::move(device));
}

absl::StatusOr<std::unique_ptr<HostDevice>> HostDevice::Open(const DeviceOptions& options) {
  const long page = sysconf(_SC_PAGESIZE);
  if (page <= 0) return absl::InternalError("sysconf(_SC_PAGESIZE): no page size");
  const uint64_t granularity = options.host_granularity;
  if (granularity == 0 || (granularity & (granularity - 1)) != 0 || granularity % static_cast<uint64_t>(page) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("host_granularity: ", granularity,
                                                   " is not a power of two and a multiple of the page size (", page,
                                                   " bytes)"));
  }
  uint64_t capacity = options.host_capacity;
  if (capacity == 0) {
    const long pages = sysconf(_SC_PHYS_PAGES);
    if (pages <= 0) return absl::InternalError("sysconf(_SC_PHYS_PAGES): no physical memory size");
    capacity = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
  }
  if (options.index < 0) {
    return absl::InvalidArgumentError(absl::StrCat("index: host device ", options.index, " is negative"));
  }
  if (options.host_used_by_others >= capacity) {
    return absl::InvalidArgumentError(absl::StrCat("host_used_by_others: ", options.host_used_by_others,
                                                   " bytes leave nothing of the host capacity of ", capacity));
  }
  return std::unique_ptr<HostDevice>(new HostDevice(options.index, capacity, options.host_used_by_others, granularity,
                                                    absl::StrCat("host-", HostBootId(), "-", options.index)));
}

HostDevice::HostDevice(int index, uint64_t capacity, uint64_t used_by_others, uint64_t granularity, std::string uuid)
    : index_(index),
      capacity_(capacity),
      used_by_others_(used_by_others),
      granularity_(granularity),
      uuid_(std::move(uuid)),
      book_(granularity) {}

uint64_t HostDevice::FreeOf(uint64_t committed) const {
  const uint64_t used = committed + used_by_others_;
  return capacity_ > used ? capacity_ - used : 0;
}

HostDevice::~HostDevice() {
  for (const LiveChunk& live : book_.LiveChunks()) close(static_cast<int>(live.chunk.handle));
}

absl::StatusOr<DeviceInfo> HostDevice::Info() {
  DeviceInfo info;
  info.backend = BackendKind::kHost;
  info.index = index_;
  info.name = kName;
  info.uuid = uuid_;
  info.total_bytes = capacity_;
  info.free_bytes = FreeOf(committed_.load());
  if (std::optional<uint64_t> available = MemAvailableBytes()) info.free_bytes = std::min(info.free_bytes, *available);
  info.granularity = granularity_;
  info.fabric_handles = false;
  return info;
}

absl::Status HostDevice::CheckPeerAccess(absl::string_view owner_uuid) {
  if (owner_uuid.empty()) return absl::InvalidArgumentError("CheckPeerAccess: owner_uuid is empty");
  // Host memory is reachable from every host "device" of this boot: a memfd is a memfd.
  if (ParseHostDeviceUuid(owner_uuid).has_value()) return absl::OkStatus();
  if (absl::StartsWithIgnoreCase(owner_uuid, "host-")) {
    return absl::FailedPreconditionError(absl::StrCat("CheckPeerAccess: host device ", index_, " (", uuid_,
                                                      ") cannot import memory of ", owner_uuid,
                                                      ": that is host memory of another machine or boot"));
  }
  return absl::FailedPreconditionError(absl::StrCat("CheckPeerAccess: host device ", index_, " (", uuid_,
                                                    ") cannot import memory of device ", owner_uuid,
                                                    ": it belongs to another backend (host chunks are memfds)"));
}

absl::StatusOr<uint64_t> HostDevice::Reserve(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(book_.CheckSize("Reserve", "bytes", bytes));
  std::optional<uint64_t> padded = CheckedAdd(bytes, granularity_);
  if (!padded) return absl::InvalidArgumentError(absl::StrCat("Reserve: bytes ", bytes, " is too large"));
  // Over-reserve by one granule, then trim both ends so the reservation starts aligned.
  void* p = mmap(nullptr, *padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, absl::StrCat("mmap(PROT_NONE, ", *padded, " bytes)"));
  const uint64_t raw = reinterpret_cast<uintptr_t>(p);
  const uint64_t va = (raw + granularity_ - 1) & ~(granularity_ - 1);
  const uint64_t head = va - raw;
  const uint64_t tail = granularity_ - head;
  if ((head != 0 && munmap(p, head) != 0) || (tail != 0 && munmap(Address(va + bytes), tail) != 0)) {
    const int err = errno;
    munmap(p, *padded);
    return ErrnoStatus(err, "munmap(trimming a reservation)");
  }
  absl::Cleanup unreserve = [va, bytes] { munmap(Address(va), bytes); };
  KVD_RETURN_IF_ERROR(book_.AddReservation(va, bytes));
  std::move(unreserve).Cancel();
  return va;
}

absl::Status HostDevice::Free(uint64_t va, uint64_t bytes) {
  return book_.Free(va, bytes, [&] {
    if (munmap(Address(va), bytes) != 0) return ErrnoStatus(errno, absl::StrCat("munmap(", Range(va, bytes), ")"));
    return absl::OkStatus();
  });
}

absl::StatusOr<Chunk> HostDevice::Create(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(book_.CheckSize("Create", "bytes", bytes));
  // Claim the bytes against the capacity first, so concurrent Creates cannot overshoot it together.
  uint64_t committed = committed_.load();
  do {
    const uint64_t free = FreeOf(committed);
    if (bytes > free) {
      return absl::ResourceExhaustedError(
          absl::StrCat("Create: ", bytes, " bytes asked, ", free, " bytes free of the host capacity of ", capacity_,
                       " bytes", used_by_others_ > 0 ? absl::StrCat(" (", used_by_others_, " used by others)") : ""));
    }
  } while (!committed_.compare_exchange_weak(committed, committed + bytes));
  absl::Cleanup unclaim = [this, bytes] { committed_.fetch_sub(bytes); };

  // Committing past what the kernel can give without swapping invites the OOM killer: refuse here.
  if (std::optional<uint64_t> available = MemAvailableBytes(); available && bytes > *available) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Create: ", bytes, " bytes asked, ", *available, " bytes free (MemAvailable in /proc/meminfo)"));
  }

  UniqueFd fd(memfd_create(kMemfdName, MFD_CLOEXEC));
  if (!fd) return ErrnoStatus(errno, absl::StrCat("memfd_create(", kMemfdName, ")"));
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("ftruncate(", bytes, " bytes asked)"));
  }
  // Allocate every page now: out of memory is an error here, not a SIGBUS at first touch. On a
  // signal, shmem gives back what this call had allocated and fails with EINTR: start again.
  int rc;
  do {
    rc = fallocate(fd.get(), 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return ErrnoStatus(errno, absl::StrCat("fallocate(", bytes, " bytes asked)"));

  const Chunk chunk{.handle = static_cast<uint64_t>(fd.get()), .bytes = bytes};
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat(the new memfd)");
  KVD_RETURN_IF_ERROR(book_.AddChunk(chunk, ChunkOrigin::kCreated));
  (void)fd.release();  // the book's now: Release closes it
  std::move(unclaim).Cancel();
  absl::MutexLock lock(&imports_mu_);
  ++created_inodes_[st.st_ino];
  return chunk;
}

absl::Status HostDevice::Release(const Chunk& chunk) {
  absl::Status closed;
  // Closing the last reference to an unmapped memfd frees its pages, which takes a while for big
  // chunks: the book runs this without its locks. The FD number stays ours until close returns.
  struct stat st {};
  const bool known = fstat(static_cast<int>(chunk.handle), &st) == 0;
  KVD_RETURN_IF_ERROR(book_.Release(chunk, [&](ChunkOrigin origin) {
    const int rc = close(static_cast<int>(chunk.handle));
    const int err = errno;
    if (origin == ChunkOrigin::kCreated) {
      committed_.fetch_sub(chunk.bytes);
      absl::MutexLock lock(&imports_mu_);
      if (auto it = created_inodes_.find(st.st_ino); known && it != created_inodes_.end() && --it->second == 0) {
        created_inodes_.erase(it);
      }
    } else {
      absl::MutexLock lock(&imports_mu_);
      if (auto it = counted_imports_.find(chunk.handle); it != counted_imports_.end()) {
        committed_.fetch_sub(it->second);
        counted_imports_.erase(it);
      }
    }
    // Linux releases the FD even when close reports EINTR or EIO, so the chunk is gone either way
    // (the book must not take it back); only EBADF, which means it was not ours, is worth reporting.
    if (rc != 0 && err == EBADF) closed = ErrnoStatus(err, absl::StrCat("close(fd ", chunk.handle, ")"));
    return absl::OkStatus();
  }));
  return closed;
}

absl::Status HostDevice::Map(uint64_t va, const Chunk& chunk, Access access) {
  return book_.Map(va, chunk, access, [&](const MapSite&) {
    const int prot = access == Access::kRead ? PROT_READ : PROT_READ | PROT_WRITE;
    void* p = mmap(Address(va), chunk.bytes, prot, MAP_SHARED | MAP_FIXED, static_cast<int>(chunk.handle), 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      // A failed MAP_FIXED may already have unmapped the range: put the reservation back.
      RemapReserved(va, chunk.bytes);
      return ErrnoStatus(err, absl::StrCat("mmap(MAP_SHARED | MAP_FIXED, ", Range(va, chunk.bytes), ")"));
    }
    return absl::OkStatus();
  });
}

absl::Status HostDevice::Unmap(uint64_t va, uint64_t bytes) {
  return book_.Unmap(va, bytes, [](uint64_t mapping, uint64_t mapping_bytes) {
    if (RemapReserved(mapping, mapping_bytes) != 0) {
      return ErrnoStatus(errno, absl::StrCat("mmap(PROT_NONE | MAP_FIXED, ", Range(mapping, mapping_bytes), ")"));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<int> HostDevice::Export(const Chunk& chunk) {
  UniqueFd fd;
  // The book keeps a concurrent Release from closing the memfd while it is being duplicated.
  KVD_RETURN_IF_ERROR(book_.WithLiveChunk("Export", chunk, [&] {
    fd.reset(fcntl(static_cast<int>(chunk.handle), F_DUPFD_CLOEXEC, 0));
    if (!fd) return ErrnoStatus(errno, absl::StrCat("fcntl(F_DUPFD_CLOEXEC, fd ", chunk.handle, ")"));
    return absl::OkStatus();
  }));
  return fd.release();
}

absl::StatusOr<Chunk> HostDevice::Import(int fd, uint64_t bytes) {
  KVD_RETURN_IF_ERROR(book_.CheckSize("Import", "bytes", bytes));
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("Import: fd ", fd, " is not a file descriptor"));
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("fstat(fd ", fd, ")"));
  // Only shmem files (memfds) carry seals; anything else is not memory a host Device exported.
  if (!S_ISREG(st.st_mode) || fcntl(fd, F_GET_SEALS) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Import: fd ", fd, " is not a memfd"));
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Import: fd ", fd, " holds ", st.st_size, " bytes, fewer than the ", bytes, " bytes asked"));
  }
  UniqueFd own(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!own) return ErrnoStatus(errno, absl::StrCat("fcntl(F_DUPFD_CLOEXEC, fd ", fd, ")"));
  const Chunk chunk{.handle = static_cast<uint64_t>(own.get()), .bytes = bytes};
  KVD_RETURN_IF_ERROR(book_.AddChunk(chunk, ChunkOrigin::kImported));
  (void)own.release();  // the book's now: Release closes it
  // Memory another process created (a predecessor's pool, a chunk a client gives back) is this process's to
  // count now; an import of its own chunk is counted once, by its Create.
  absl::MutexLock lock(&imports_mu_);
  if (!created_inodes_.contains(st.st_ino)) {
    committed_.fetch_add(bytes);
    counted_imports_[chunk.handle] = bytes;
  }
  return chunk;
}

absl::Status HostDevice::CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("CopyToHost: dst is null");
  return book_.UseRange("CopyToHost", src_va, bytes, /*write=*/false, [&] {
    std::memcpy(dst, Address(src_va), bytes);
    return absl::OkStatus();
  });
}

absl::Status HostDevice::CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (src == nullptr) return absl::InvalidArgumentError("CopyFromHost: src is null");
  return book_.UseRange("CopyFromHost", dst_va, bytes, /*write=*/true, [&] {
    std::memcpy(Address(dst_va), src, bytes);
    return absl::OkStatus();
  });
}

absl::Status HostDevice::CopyRange(uint64_t dst_va, uint64_t src_va, uint64_t bytes) {
  return book_.UseCopy("CopyRange", dst_va, src_va, bytes, [&] {
    std::memcpy(Address(dst_va), Address(src_va), bytes);
    return absl::OkStatus();
  });
}

absl::Status HostDevice::ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  if (blocks.empty()) return absl::OkStatus();
  return book_.UseBlocks("ZeroBlocks", span, /*span_write=*/true, 0, 0, false, [&] {
    for (uint64_t s = 0; s < span.segments; ++s) {
      for (uint64_t id : blocks) std::memset(SegmentBlock(span, s, id), 0, span.block_bytes);
    }
    return absl::OkStatus();
  });
}

absl::Status HostDevice::CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) {
  KVD_RETURN_IF_ERROR(ValidateCopies(span, copies));
  if (copies.empty()) return absl::OkStatus();
  return book_.UseBlocks("CopyBlocks", span, /*span_write=*/true, 0, 0, false, [&] {
    // No destination is also a source (ValidateCopies), so the order of the copies does not matter.
    for (uint64_t s = 0; s < span.segments; ++s) {
      for (const BlockCopy& c : copies) {
        std::memcpy(SegmentBlock(span, s, c.dst), SegmentBlock(span, s, c.src), span.block_bytes);
      }
    }
    return absl::OkStatus();
  });
}

absl::Status HostDevice::PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks, uint64_t dst) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  if (blocks.empty()) return absl::OkStatus();
  return book_.UseBlocks("PackBlocks", span, /*span_write=*/false, dst, blocks.size(), /*packed_write=*/true, [&] {
    std::byte* out = Address(dst);
    for (uint64_t id : blocks) {
      for (uint64_t s = 0; s < span.segments; ++s, out += span.block_bytes) {
        std::memcpy(out, SegmentBlock(span, s, id), span.block_bytes);
      }
    }
    return absl::OkStatus();
  });
}

absl::Status HostDevice::UnpackBlocks(const BlockSpan& span, uint64_t src, absl::Span<const uint64_t> blocks) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  if (blocks.empty()) return absl::OkStatus();
  return book_.UseBlocks("UnpackBlocks", span, /*span_write=*/true, src, blocks.size(), /*packed_write=*/false, [&] {
    const std::byte* in = Address(src);
    for (uint64_t id : blocks) {
      for (uint64_t s = 0; s < span.segments; ++s, in += span.block_bytes) {
        std::memcpy(SegmentBlock(span, s, id), in, span.block_bytes);
      }
    }
    return absl::OkStatus();
  });
}

DeviceCapabilities HostDevice::Capabilities() const {
  DeviceCapabilities caps;
  caps.posix_fd = {true, "each chunk is a memfd, passed as an FD"};
  caps.fabric = {false, "host memory has no fabric handles"};
  caps.dma_buf = {true,
                  "memfd ranges: a range is exported chunk by chunk, each chunk's memfd with the offset into it "
                  "(what a host-memory connector maps or registers with ibv_reg_mr); no kernel DMA-BUF"};
  caps.range_spans_chunks = false;
  caps.gpu_direct_rdma = {false, "host memory: an RDMA NIC registers it as ordinary memory"};
  return caps;
}

}  // namespace kvd
