#include "daemon/core/host_tier.h"

#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvd/status.h"
#include "kvd/units.h"

namespace kvd::daemon {
namespace {

absl::Status Errno(int error, absl::string_view call) {
  return absl::Status(
      error == ENOMEM || error == ENOSPC ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal,
      absl::StrCat(call, ": ", std::strerror(error)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostTier>> HostTier::Create(Device* device, const HostTierOptions& options,
                                                           uint64_t alignment, UniqueFd predecessor) {
  if (options.bytes == 0 || options.bytes % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--host-tier-bytes: ", options.bytes,
                                                   " is not a positive multiple of the device granularity (", alignment,
                                                   " bytes)"));
  }
  if (options.register_piece_bytes == 0 || options.register_piece_bytes % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("host tier: register_piece_bytes ", options.register_piece_bytes,
                                                   " is not a positive multiple of ", alignment));
  }
  UniqueFd fd;
  if (predecessor.valid()) {
    struct stat st {};
    if (fstat(predecessor.get(), &st) == 0 && static_cast<uint64_t>(st.st_size) == options.bytes) {
      fd = std::move(predecessor);
    } else if (options.info) {
      options.info(absl::StrCat("host tier: the previous daemon's tier was ", static_cast<uint64_t>(st.st_size),
                                " bytes, --host-tier-bytes is ", options.bytes,
                                ": a new, empty tier; what sleeping pools kept in the old one is dropped"));
    }
  }
  const bool adopted = fd.valid();
  if (!adopted) {
    fd = UniqueFd(memfd_create("kvd-host-tier", MFD_CLOEXEC));
    if (!fd) return Errno(errno, "memfd_create(kvd-host-tier)");
    if (ftruncate(fd.get(), static_cast<off_t>(options.bytes)) != 0) {
      return Errno(errno, absl::StrCat("ftruncate(host tier, ", options.bytes, ")"));
    }
  }
  void* map = mmap(nullptr, options.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) return Errno(errno, absl::StrCat("mmap(host tier, ", options.bytes, ")"));
  return std::unique_ptr<HostTier>(
      new HostTier(device, options, alignment, std::move(fd), static_cast<uint8_t*>(map), adopted));
}

HostTier::HostTier(Device* device, const HostTierOptions& options, uint64_t alignment, UniqueFd fd, uint8_t* map,
                   bool adopted)
    : device_(device),
      options_(options),
      alignment_(alignment),
      bytes_(options.bytes),
      piece_(options.register_piece_bytes),
      fd_(std::move(fd)),
      map_(map),
      adopted_(adopted) {
  free_[0] = bytes_;
  preparer_ = std::thread([this] { Prepare(); });
}

HostTier::~HostTier() {
  if (preparer_.joinable()) preparer_.join();
  bool registered = false;
  {
    absl::MutexLock lock(&mu_);
    registered = registered_;
  }
  if (registered) {
    for (size_t i = 0; i < Pieces(); ++i) device_->UnregisterHost(map_ + i * piece_).IgnoreError();
  }
  munmap(map_, bytes_);
}

// Note [The host tier]: bound to the GPU's node before any page exists (the memfd's shared policy then
// places every page), allocated whole, then registered; all before the first sleep needs it.
void HostTier::Prepare() {
  auto info = [&](const std::string& line) {
    if (options_.info) options_.info(line);
  };
  const int node = device_->NumaNode();
  bool bound = false;
  if (node >= 0 && node < 64) {
    // MPOL_PREFERRED: the node's memory first, another node's rather than failing when it runs out.
    const unsigned long mask = 1UL << node;
    if (syscall(SYS_mbind, map_, bytes_, MPOL_PREFERRED, &mask, 64, 0) == 0) {
      bound = true;
    } else {
      info(absl::StrCat("host tier: mbind to NUMA node ", node, " failed (", std::strerror(errno),
                        "); its pages go where the kernel puts them"));
    }
  } else {
    info("host tier: the device's NUMA node is unknown (no NUMA, or sysfs does not say): not bound to a node");
  }
  // Three passes, each timed in the log line (what the H200 showed: Note [The host tier]). 1. fallocate: the
  // memfd's pages. 2. Every page mapped writable into the daemon's page tables, by up to 8 threads a piece at a
  // time (madvise(MADV_POPULATE_WRITE); Linux 5.14, skipped before): registration pins pages, and pages that
  // are allocated but not mapped it faults in one by one. 3. Registration, one piece after another: one call
  // over the whole tier kept the daemon from answering for as long as it ran, and 8 registering threads were
  // no faster and kept GetDeviceInfo's cuMemGetInfo waiting. An adopted tier's pages stay as they are.
  const absl::Time start = absl::Now();
  absl::Status status;
  if (fallocate(fd_.get(), 0, 0, static_cast<off_t>(bytes_)) != 0) {
    status = Errno(errno, absl::StrCat("fallocate(host tier, ", bytes_, ")"));
  }
  const absl::Time allocated = absl::Now();
  const size_t piece_count = Pieces();
  const size_t threads = std::min<size_t>(std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8), piece_count);
  if (status.ok()) {
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i = next.fetch_add(1); i < piece_count; i = next.fetch_add(1)) {
        const uint64_t offset = i * piece_;
        if (madvise(map_ + offset, std::min(piece_, bytes_ - offset), MADV_POPULATE_WRITE) != 0) {
          next.store(piece_count);  // an older kernel (EINVAL): registration faults the pages in itself
        }
      }
    };
    std::vector<std::thread> workers;
    for (size_t t = 1; t < threads; ++t) workers.emplace_back(work);
    work();
    for (std::thread& w : workers) w.join();
  }
  const absl::Time mapped = absl::Now();
  size_t registered = 0;
  for (; status.ok() && registered < piece_count; ++registered) {
    const uint64_t offset = registered * piece_;
    status = device_->RegisterHost(map_ + offset, std::min(piece_, bytes_ - offset));
    if (!status.ok()) break;
    std::this_thread::yield();  // a thread waiting for the driver's lock takes it now
  }
  if (!status.ok()) {  // all or nothing: the tier is then used unregistered
    for (size_t i = 0; i < registered; ++i) device_->UnregisterHost(map_ + i * piece_).IgnoreError();
  }
  info(status.ok() ? absl::StrCat("host tier: ", FormatBytes(bytes_), " allocated",
                                  bound ? absl::StrCat(" on NUMA node ", node) : "", " in ",
                                  absl::FormatDuration(allocated - start), ", mapped in ",
                                  absl::FormatDuration(mapped - allocated), " (", threads,
                                  " threads) and registered in ", absl::FormatDuration(absl::Now() - mapped), " (",
                                  piece_count, " pieces of ", FormatBytes(std::min(piece_, bytes_)), ")")
                   : absl::StrCat("host tier: ", FormatBytes(bytes_), " not registered (", status.message(),
                                  "); sleeps keep their contents there at pageable-copy speed"));
  absl::MutexLock lock(&mu_);
  registered_ = status.ok();
  numa_node_ = bound ? node : -1;
  ready_ = true;
}

absl::StatusOr<uint64_t> HostTier::Take(absl::string_view pool, uint64_t bytes, uint64_t* extent_bytes,
                                        absl::Time ready_by) {
  const uint64_t want = (bytes + alignment_ - 1) / alignment_ * alignment_;
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready_), ready_by)) {
    return absl::DeadlineExceededError(
        absl::StrCat("pool ", pool, ": the host tier (", FormatBytes(bytes_),
                     ") is still being allocated and registered after the daemon's start; nothing changed. Wait for "
                     "DeviceInfo.host_tier_ready (kvctl status) or give the sleep a longer deadline"));
  }
  uint64_t largest = 0;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    largest = std::max(largest, it->second);
    if (it->second < want) continue;
    const uint64_t offset = it->first;
    const uint64_t left = it->second - want;
    free_.erase(it);
    if (left > 0) free_[offset + want] = left;
    used_ += want;
    *extent_bytes = want;
    return offset;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("pool ", pool, ": keeping its contents needs ", bytes, " bytes (", FormatBytes(bytes),
                   ") of the host tier, but ", "its largest free extent is ", largest, " bytes (", FormatBytes(largest),
                   ") of ", bytes_, " (", FormatBytes(bytes_), ", --host-tier-bytes); nothing changed"));
}

absl::Status HostTier::Claim(uint64_t offset, uint64_t extent_bytes) {
  absl::MutexLock lock(&mu_);
  auto it = free_.upper_bound(offset);
  if (extent_bytes == 0 || offset > bytes_ || extent_bytes > bytes_ - offset || it == free_.begin() ||
      std::prev(it)->first + std::prev(it)->second < offset + extent_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("the host tier's extent of ", extent_bytes, " bytes at ", offset,
                                                      " is not free in a tier of ", bytes_, " bytes"));
  }
  --it;
  const uint64_t start = it->first;
  const uint64_t end = it->first + it->second;
  free_.erase(it);
  if (offset > start) free_[start] = offset - start;
  if (end > offset + extent_bytes) free_[offset + extent_bytes] = end - (offset + extent_bytes);
  used_ += extent_bytes;
  return absl::OkStatus();
}

void HostTier::Give(uint64_t offset, uint64_t extent_bytes) {
  if (extent_bytes == 0) return;
  absl::MutexLock lock(&mu_);
  used_ -= extent_bytes;
  auto [it, inserted] = free_.emplace(offset, extent_bytes);
  if (auto next = std::next(it); next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    if (auto prev = std::prev(it); prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

void HostTier::Copied(bool out, uint64_t bytes, absl::Duration took) {
  absl::MutexLock lock(&mu_);
  (out ? copied_out_ : copied_in_) += bytes;
  (out ? out_time_ : in_time_) += took;
}

absl::Status HostTier::CopyOut(uint64_t base, const KeptContents& kept) {
  Copy copy(this, base, kept, Copy::Direction::kToHost);
  for (const KeptRun& run : kept.runs) copy.Ready(run.pool_offset, run.bytes);
  return copy.Finish();
}

absl::Status HostTier::CopyIn(uint64_t base, const KeptContents& kept) {
  Copy copy(this, base, kept, Copy::Direction::kToDevice);
  for (const KeptRun& run : kept.runs) copy.Ready(run.pool_offset, run.bytes);
  return copy.Finish();
}

HostTier::Copy::Copy(HostTier* tier, uint64_t base, const KeptContents& kept, Direction direction)
    : tier_(tier), base_(base), bytes_(kept.bytes), direction_(direction), start_(absl::Now()) {
  uint64_t at = kept.tier_offset;
  for (const KeptRun& run : kept.runs) {
    for (uint64_t done = 0; done < run.bytes;) {
      // Never across a registered piece's end: each copy's host range lies in one registration.
      const uint64_t host = at + done;
      const uint64_t n =
          std::min({tier->options_.copy_piece_bytes, run.bytes - done, tier->piece_ - host % tier->piece_});
      pieces_.push_back({.pool_offset = run.pool_offset + done, .host = tier->map_ + host, .bytes = n});
      done += n;
    }
    at += run.bytes;
  }
  std::sort(pieces_.begin(), pieces_.end(),
            [](const Piece& a, const Piece& b) { return a.pool_offset < b.pool_offset; });
  {
    absl::MutexLock lock(&mu_);
    queued_.assign(pieces_.size(), false);
    queue_.reserve(pieces_.size());
  }
  const size_t threads = std::min<size_t>(std::max<uint32_t>(tier->options_.copy_threads, 1), pieces_.size());
  try {
    for (size_t t = 0; t < threads; ++t) workers_.emplace_back([this] { Work(); });
  } catch (const std::system_error&) {
    // No thread to spare: fewer copy at once, and with none Finish copies on its caller's thread.
  }
}

HostTier::Copy::~Copy() { Stop(); }

bool HostTier::Copy::HasWorkOrEnds() const { return !queue_.empty() || stopping_ || finishing_; }

bool HostTier::Copy::Covered(uint64_t offset, uint64_t end) const {
  auto it = ready_.upper_bound(offset);
  if (it == ready_.begin()) return false;
  --it;
  return it->second >= end;
}

void HostTier::Copy::Ready(uint64_t pool_offset, uint64_t bytes) {
  if (bytes == 0) return;
  absl::MutexLock lock(&mu_);
  uint64_t start = pool_offset, end = pool_offset + bytes;
  // Coalesce with what touches it, so that a piece across two chunks is found whole.
  auto it = ready_.upper_bound(start);
  if (it != ready_.begin() && std::prev(it)->second >= start) --it;
  while (it != ready_.end() && it->first <= end) {
    start = std::min(start, it->first);
    end = std::max(end, it->second);
    it = ready_.erase(it);
  }
  ready_.emplace(start, end);
  // Only pieces that overlap the new range can have become whole; pieces are sorted and disjoint, so their ends
  // are sorted too.
  auto first = std::partition_point(pieces_.begin(), pieces_.end(),
                                    [&](const Piece& p) { return p.pool_offset + p.bytes <= pool_offset; });
  for (auto p = first; p != pieces_.end() && p->pool_offset < pool_offset + bytes; ++p) {
    const size_t i = static_cast<size_t>(p - pieces_.begin());
    if (!queued_[i] && Covered(p->pool_offset, p->pool_offset + p->bytes)) {
      queued_[i] = true;
      queue_.push_back(i);
    }
  }
}

void HostTier::Copy::Work() {
  Device* const device = tier_->device_;
  for (;;) {
    size_t i = 0;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Copy::HasWorkOrEnds));
      if (stopping_ || queue_.empty()) return;  // stopped, or finishing with nothing left that is ready
      i = queue_.back();
      queue_.pop_back();
      ++in_flight_;
    }
    const Piece& p = pieces_[i];
    const uint64_t va = base_ + p.pool_offset;
    absl::Status s = direction_ == Direction::kToHost ? device->CopyToHost(p.host, va, p.bytes)
                                                      : device->CopyFromHost(va, p.host, p.bytes);
    absl::MutexLock lock(&mu_);
    --in_flight_;
    if (s.ok()) {
      ++copied_;
    } else if (first_.ok()) {
      first_ = std::move(s);
      stopping_ = true;  // the others stop at their next piece
    }
  }
}

void HostTier::Copy::Join() {
  for (std::thread& w : workers_) w.join();
  workers_.clear();
}

void HostTier::Copy::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  Join();  // the pieces in flight are done when their workers return
}

absl::Status HostTier::Copy::Finish() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && first_.ok()) return absl::CancelledError("the copy was stopped");
    finishing_ = true;
  }
  if (workers_.empty()) Work();
  Join();
  absl::MutexLock lock(&mu_);
  if (!first_.ok()) return first_;
  if (copied_ < pieces_.size()) {
    for (size_t i = 0; i < pieces_.size(); ++i) {
      if (!queued_[i]) {
        return absl::InternalError(absl::StrCat("pool bytes at offset ", pieces_[i].pool_offset, " (", pieces_[i].bytes,
                                                " bytes) were never mapped to copy ",
                                                direction_ == Direction::kToHost ? "from" : "into"));
      }
    }
  }
  stopping_ = true;  // done: the destructor has nothing to stop
  tier_->Copied(direction_ == Direction::kToHost, bytes_, absl::Now() - start_);
  return absl::OkStatus();
}

HostTierStats HostTier::Stats() const {
  absl::MutexLock lock(&mu_);
  return HostTierStats{.bytes = bytes_,
                       .used_bytes = used_,
                       .ready = ready_,
                       .registered = registered_,
                       .numa_node = numa_node_,
                       .copied_to_host_bytes = copied_out_,
                       .copied_to_device_bytes = copied_in_,
                       .copy_to_host_seconds = absl::ToDoubleSeconds(out_time_),
                       .copy_to_device_seconds = absl::ToDoubleSeconds(in_time_)};
}

}  // namespace kvd::daemon
