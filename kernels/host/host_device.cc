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
#include "kvd/status.h"

namespace kvd {
namespace {

constexpr char kName[] = "host memory (memfd)";
constexpr char kMemfdName[] = "kvd-chunk";  // shows in /proc/<pid>/maps as /memfd:kvd-chunk

// The one place errno becomes a Status (STYLE.md, Errors): the call, what it was asked, the errno.
absl::Status ErrnoError(absl::string_view call, absl::string_view detail, int err) {
  const char* text = strerrordesc_np(err);
  std::string message =
      absl::StrCat(call, "(", detail, "): ", text != nullptr ? text : "unknown error", " (errno ", err, ")");
  switch (err) {
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(message);
    case EINVAL:
    case EBADF:
      return absl::InvalidArgumentError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InternalError(message);
  }
}

std::string Hex(uint64_t value) { return absl::StrFormat("0x%x", value); }

std::string Range(uint64_t va, uint64_t bytes) { return absl::StrFormat("[0x%x, +%u)", va, bytes); }

std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

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

// The value of the entry of `by_start` (a map from start address to something with `bytes`) whose
// range holds all of [va, va + bytes), or nullptr.
template <typename Map>
auto FindContaining(Map& by_start, uint64_t va, uint64_t bytes) -> decltype(&by_start.begin()->second) {
  auto it = by_start.upper_bound(va);
  if (it == by_start.begin()) return nullptr;
  --it;
  std::optional<uint64_t> end = CheckedAdd(va, bytes);
  if (!end || *end > it->first + it->second.bytes) return nullptr;
  return &it->second;
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
  return std::unique_ptr<HostDevice>(
      new HostDevice(options.index, capacity, granularity, absl::StrCat("host-", HostBootId(), "-", options.index)));
}

HostDevice::HostDevice(int index, uint64_t capacity, uint64_t granularity, std::string uuid)
    : index_(index), capacity_(capacity), granularity_(granularity), uuid_(std::move(uuid)) {}

HostDevice::~HostDevice() {
  absl::MutexLock lock(&chunks_mu_);
  for (const auto& [fd, record] : chunks_) close(fd);
}

absl::Status HostDevice::CheckAligned(const char* call, const char* what, uint64_t value, bool allow_zero) const {
  if ((value == 0 && !allow_zero) || value % granularity_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", what, " ", value, " is not a positive multiple of the granularity ", granularity_));
  }
  return absl::OkStatus();
}

const HostDevice::Reservation* HostDevice::FindReservation(uint64_t va, uint64_t bytes) const {
  return FindContaining(reservations_, va, bytes);
}

HostDevice::Reservation* HostDevice::FindReservation(uint64_t va, uint64_t bytes) {
  return FindContaining(reservations_, va, bytes);
}

absl::Status HostDevice::CheckMapped(const char* call, uint64_t va, uint64_t bytes, bool write) const {
  if (bytes == 0) return absl::OkStatus();
  const Reservation* reservation = FindReservation(va, bytes);
  if (reservation == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", Range(va, bytes), " is not inside a reservation of this device"));
  }
  const std::map<uint64_t, Mapping>& mappings = reservation->mappings;
  const uint64_t end = va + bytes;  // FindReservation checked the overflow
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

absl::Status HostDevice::CheckSpanMapped(const char* call, const BlockSpan& span, bool write) const {
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
  for (uint64_t s = 0; s < span.segments; ++s) {
    KVD_RETURN_IF_ERROR(CheckMapped(call, span.base + s * span.segment_stride, *run, write));
  }
  return absl::OkStatus();
}

absl::Status HostDevice::CheckPackedMapped(const char* call, const BlockSpan& span, uint64_t va, uint64_t count,
                                           bool write) const {
  std::optional<uint64_t> packed = CheckedMul(span.segments, span.block_bytes);
  std::optional<uint64_t> bytes = packed ? CheckedMul(*packed, count) : std::nullopt;
  if (!bytes) return absl::InvalidArgumentError(absl::StrCat(call, ": the packed blocks' size overflows 64 bits"));
  return CheckMapped(call, va, *bytes, write);
}

absl::StatusOr<DeviceInfo> HostDevice::Info() {
  DeviceInfo info;
  info.backend = BackendKind::kHost;
  info.index = index_;
  info.name = kName;
  info.uuid = uuid_;
  info.total_bytes = capacity_;
  info.free_bytes = capacity_ - std::min(committed_.load(), capacity_);
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
  KVD_RETURN_IF_ERROR(CheckAligned("Reserve", "bytes", bytes, /*allow_zero=*/false));
  std::optional<uint64_t> padded = CheckedAdd(bytes, granularity_);
  if (!padded) return absl::InvalidArgumentError(absl::StrCat("Reserve: bytes ", bytes, " is too large"));
  // Over-reserve by one granule, then trim both ends so the reservation starts aligned.
  void* p = mmap(nullptr, *padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return ErrnoError("mmap", absl::StrCat("PROT_NONE, ", *padded, " bytes"), err);
  }
  const uint64_t raw = reinterpret_cast<uintptr_t>(p);
  const uint64_t va = (raw + granularity_ - 1) & ~(granularity_ - 1);
  const uint64_t head = va - raw;
  const uint64_t tail = granularity_ - head;
  if ((head != 0 && munmap(p, head) != 0) || (tail != 0 && munmap(Address(va + bytes), tail) != 0)) {
    const int err = errno;
    munmap(p, *padded);
    return ErrnoError("munmap", "trimming a reservation", err);
  }
  absl::MutexLock lock(&va_mu_);
  reservations_[va] = Reservation{.bytes = bytes, .mappings = {}};
  return va;
}

absl::Status HostDevice::Free(uint64_t va, uint64_t bytes) {
  absl::MutexLock lock(&va_mu_);
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second.bytes != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("Free: ", Range(va, bytes), " is not a reservation of this device"));
  }
  if (!it->second.mappings.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Free: ", it->second.mappings.size(), " mappings are still live in ", Range(va, bytes), "; unmap them first"));
  }
  if (munmap(Address(va), bytes) != 0) {
    const int err = errno;
    return ErrnoError("munmap", Range(va, bytes), err);
  }
  reservations_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<Chunk> HostDevice::Create(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(CheckAligned("Create", "bytes", bytes, /*allow_zero=*/false));
  // Claim the bytes against the capacity first, so concurrent Creates cannot overshoot it together.
  uint64_t committed = committed_.load();
  do {
    const uint64_t free = capacity_ - std::min(committed, capacity_);
    if (bytes > free) {
      return absl::ResourceExhaustedError(absl::StrCat("Create: ", bytes, " bytes asked, ", free,
                                                       " bytes free of the host capacity of ", capacity_, " bytes"));
    }
  } while (!committed_.compare_exchange_weak(committed, committed + bytes));
  absl::Cleanup unclaim = [this, bytes] { committed_.fetch_sub(bytes); };

  // Committing past what the kernel can give without swapping invites the OOM killer: refuse here.
  if (std::optional<uint64_t> available = MemAvailableBytes(); available && bytes > *available) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Create: ", bytes, " bytes asked, ", *available, " bytes free (MemAvailable in /proc/meminfo)"));
  }

  const int fd = memfd_create(kMemfdName, MFD_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return ErrnoError("memfd_create", kMemfdName, err);
  }
  absl::Cleanup close_fd = [fd] { close(fd); };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    return ErrnoError("ftruncate", absl::StrCat(bytes, " bytes asked"), err);
  }
  // Allocate every page now: out of memory is an error here, not a SIGBUS at first touch. On a
  // signal, shmem gives back what this call had allocated and fails with EINTR: start again.
  int rc;
  do {
    rc = fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    return ErrnoError("fallocate", absl::StrCat(bytes, " bytes asked"), err);
  }

  {
    absl::MutexLock lock(&chunks_mu_);
    chunks_[fd] = ChunkRecord{.bytes = bytes, .created = true};
  }
  std::move(close_fd).Cancel();
  std::move(unclaim).Cancel();
  return Chunk{.handle = static_cast<uint64_t>(fd), .bytes = bytes};
}

absl::Status HostDevice::Release(const Chunk& chunk) {
  ChunkRecord record;
  {
    absl::MutexLock lock(&chunks_mu_);
    auto it = chunk.handle <= INT_MAX ? chunks_.find(static_cast<int>(chunk.handle)) : chunks_.end();
    if (it == chunks_.end() || it->second.bytes != chunk.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("Release: chunk {handle ", chunk.handle, ", ", chunk.bytes,
                                                     " bytes} is not live on this device"));
    }
    record = it->second;
    chunks_.erase(it);
  }
  // Closing the last reference to an unmapped memfd frees its pages, which takes a while for big
  // chunks: do it outside the lock. The FD number stays ours until close returns.
  const int rc = close(static_cast<int>(chunk.handle));
  const int err = errno;
  if (record.created) committed_.fetch_sub(record.bytes);
  // Linux releases the FD even when close reports EINTR or EIO; only EBADF means it was not ours.
  if (rc != 0 && err == EBADF) return ErrnoError("close", absl::StrCat("fd ", chunk.handle), err);
  return absl::OkStatus();
}

absl::Status HostDevice::Map(uint64_t va, const Chunk& chunk, Access access) {
  KVD_RETURN_IF_ERROR(CheckAligned("Map", "va", va, /*allow_zero=*/false));
  KVD_RETURN_IF_ERROR(CheckAligned("Map", "chunk.bytes", chunk.bytes, /*allow_zero=*/false));
  absl::MutexLock va_lock(&va_mu_);
  // Held through the mmap, so a concurrent Release cannot close the memfd under it.
  absl::ReaderMutexLock chunks_lock(&chunks_mu_);
  auto chunk_it = chunk.handle <= INT_MAX ? chunks_.find(static_cast<int>(chunk.handle)) : chunks_.end();
  if (chunk_it == chunks_.end() || chunk_it->second.bytes != chunk.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Map: chunk {handle ", chunk.handle, ", ", chunk.bytes, " bytes} is not live on this device"));
  }
  Reservation* reservation = FindReservation(va, chunk.bytes);
  if (reservation == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Map: ", Range(va, chunk.bytes), " is not inside a reservation of this device"));
  }
  // Mappings do not overlap, so only the last one starting below the end can reach into the range.
  auto next = reservation->mappings.lower_bound(va + chunk.bytes);
  if (next != reservation->mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > va) {
      return absl::FailedPreconditionError(absl::StrCat("Map: ", Range(va, chunk.bytes), " overlaps the mapping ",
                                                        Range(prev->first, prev->second.bytes)));
    }
  }
  const int prot = access == Access::kRead ? PROT_READ : PROT_READ | PROT_WRITE;
  void* p = mmap(Address(va), chunk.bytes, prot, MAP_SHARED | MAP_FIXED, static_cast<int>(chunk.handle), 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    // A failed MAP_FIXED may already have unmapped the range: put the reservation back.
    RemapReserved(va, chunk.bytes);
    return ErrnoError("mmap", absl::StrCat("MAP_SHARED | MAP_FIXED, ", Range(va, chunk.bytes)), err);
  }
  reservation->mappings[va] = Mapping{.bytes = chunk.bytes, .access = access};
  return absl::OkStatus();
}

absl::Status HostDevice::Unmap(uint64_t va, uint64_t bytes) {
  KVD_RETURN_IF_ERROR(CheckAligned("Unmap", "va", va, /*allow_zero=*/false));
  KVD_RETURN_IF_ERROR(CheckAligned("Unmap", "bytes", bytes, /*allow_zero=*/false));
  absl::MutexLock lock(&va_mu_);
  Reservation* reservation = FindReservation(va, bytes);
  if (reservation == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unmap: ", Range(va, bytes), " is not inside a reservation of this device"));
  }
  std::map<uint64_t, Mapping>& mappings = reservation->mappings;
  const uint64_t end = va + bytes;
  auto first = mappings.lower_bound(va);
  if (first != mappings.begin()) {
    auto prev = std::prev(first);
    if (prev->first + prev->second.bytes > va) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unmap: ", Range(va, bytes), " cuts the mapping ", Range(prev->first, prev->second.bytes)));
    }
  }
  auto last = first;
  for (; last != mappings.end() && last->first < end; ++last) {
    if (last->first + last->second.bytes > end) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unmap: ", Range(va, bytes), " cuts the mapping ", Range(last->first, last->second.bytes)));
    }
  }
  if (RemapReserved(va, bytes) != 0) {
    const int err = errno;
    return ErrnoError("mmap", absl::StrCat("PROT_NONE | MAP_FIXED, ", Range(va, bytes)), err);
  }
  mappings.erase(first, last);
  return absl::OkStatus();
}

absl::StatusOr<int> HostDevice::Export(const Chunk& chunk) {
  // Shared lock: a concurrent Release cannot close the FD while it is being duplicated.
  absl::ReaderMutexLock lock(&chunks_mu_);
  auto it = chunk.handle <= INT_MAX ? chunks_.find(static_cast<int>(chunk.handle)) : chunks_.end();
  if (it == chunks_.end() || it->second.bytes != chunk.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Export: chunk {handle ", chunk.handle, ", ", chunk.bytes, " bytes} is not live on this device"));
  }
  const int fd = fcntl(static_cast<int>(chunk.handle), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    return ErrnoError("fcntl", absl::StrCat("F_DUPFD_CLOEXEC, fd ", chunk.handle), err);
  }
  return fd;
}

absl::StatusOr<Chunk> HostDevice::Import(int fd, uint64_t bytes) {
  KVD_RETURN_IF_ERROR(CheckAligned("Import", "bytes", bytes, /*allow_zero=*/false));
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("Import: fd ", fd, " is not a file descriptor"));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    return ErrnoError("fstat", absl::StrCat("fd ", fd), err);
  }
  // Only shmem files (memfds) carry seals; anything else is not memory a host Device exported.
  if (!S_ISREG(st.st_mode) || fcntl(fd, F_GET_SEALS) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Import: fd ", fd, " is not a memfd"));
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Import: fd ", fd, " holds ", st.st_size, " bytes, fewer than the ", bytes, " bytes asked"));
  }
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) {
    const int err = errno;
    return ErrnoError("fcntl", absl::StrCat("F_DUPFD_CLOEXEC, fd ", fd), err);
  }
  absl::MutexLock lock(&chunks_mu_);
  chunks_[own] = ChunkRecord{.bytes = bytes, .created = false};
  return Chunk{.handle = static_cast<uint64_t>(own), .bytes = bytes};
}

absl::Status HostDevice::CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("CopyToHost: dst is null");
  absl::ReaderMutexLock lock(&va_mu_);
  KVD_RETURN_IF_ERROR(CheckMapped("CopyToHost", src_va, bytes, /*write=*/false));
  std::memcpy(dst, Address(src_va), bytes);
  return absl::OkStatus();
}

absl::Status HostDevice::CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (src == nullptr) return absl::InvalidArgumentError("CopyFromHost: src is null");
  absl::ReaderMutexLock lock(&va_mu_);
  KVD_RETURN_IF_ERROR(CheckMapped("CopyFromHost", dst_va, bytes, /*write=*/true));
  std::memcpy(Address(dst_va), src, bytes);
  return absl::OkStatus();
}

absl::Status HostDevice::ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  if (blocks.empty()) return absl::OkStatus();
  absl::ReaderMutexLock lock(&va_mu_);
  KVD_RETURN_IF_ERROR(CheckSpanMapped("ZeroBlocks", span, /*write=*/true));
  for (uint64_t s = 0; s < span.segments; ++s) {
    for (uint64_t id : blocks) std::memset(SegmentBlock(span, s, id), 0, span.block_bytes);
  }
  return absl::OkStatus();
}

absl::Status HostDevice::CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) {
  KVD_RETURN_IF_ERROR(ValidateCopies(span, copies));
  if (copies.empty()) return absl::OkStatus();
  absl::ReaderMutexLock lock(&va_mu_);
  KVD_RETURN_IF_ERROR(CheckSpanMapped("CopyBlocks", span, /*write=*/true));
  // No destination is also a source (ValidateCopies), so the order of the copies does not matter.
  for (uint64_t s = 0; s < span.segments; ++s) {
    for (const BlockCopy& c : copies) {
      std::memcpy(SegmentBlock(span, s, c.dst), SegmentBlock(span, s, c.src), span.block_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status HostDevice::PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks, uint64_t dst) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  if (blocks.empty()) return absl::OkStatus();
  absl::ReaderMutexLock lock(&va_mu_);
  KVD_RETURN_IF_ERROR(CheckSpanMapped("PackBlocks", span, /*write=*/false));
  KVD_RETURN_IF_ERROR(CheckPackedMapped("PackBlocks", span, dst, blocks.size(), /*write=*/true));
  std::byte* out = Address(dst);
  for (uint64_t id : blocks) {
    for (uint64_t s = 0; s < span.segments; ++s, out += span.block_bytes) {
      std::memcpy(out, SegmentBlock(span, s, id), span.block_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status HostDevice::UnpackBlocks(const BlockSpan& span, uint64_t src, absl::Span<const uint64_t> blocks) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  if (blocks.empty()) return absl::OkStatus();
  absl::ReaderMutexLock lock(&va_mu_);
  KVD_RETURN_IF_ERROR(CheckSpanMapped("UnpackBlocks", span, /*write=*/true));
  KVD_RETURN_IF_ERROR(CheckPackedMapped("UnpackBlocks", span, src, blocks.size(), /*write=*/false));
  const std::byte* in = Address(src);
  for (uint64_t id : blocks) {
    for (uint64_t s = 0; s < span.segments; ++s, in += span.block_bytes) {
      std::memcpy(SegmentBlock(span, s, id), in, span.block_bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvd
