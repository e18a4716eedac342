#include "daemon/core/memory_state_store.h"

#include <fcntl.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvd/status.h"

namespace kvd::daemon {

absl::Status MemoryStateStore::SavePool(const SavedPool& pool) {
  absl::MutexLock lock(&mu_);
  records_[pool.name] = pool;
  return absl::OkStatus();
}

absl::Status MemoryStateStore::ForgetPool(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  if (auto it = records_.find(name); it != records_.end()) records_.erase(it);
  return absl::OkStatus();
}

absl::Status MemoryStateStore::KeepChunkFd(uint64_t id, int fd) {
  absl::MutexLock lock(&mu_);
  if (options_.durability != Durability::kFdStore) {
    fds_[id] = UniqueFd();
    return absl::OkStatus();
  }
  if (fds_.size() >= options_.max_fds) {
    return absl::ResourceExhaustedError(
        absl::StrCat("chunks: the FD store holds ", fds_.size(), " of ", options_.max_fds, " chunk FDs"));
  }
  UniqueFd copy(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) return ErrnoStatus(errno, absl::StrCat("chunks: keeping chunk ", id, "'s FD"));
  fds_[id] = std::move(copy);
  return absl::OkStatus();
}

void MemoryStateStore::DropChunkFd(uint64_t id) {
  UniqueFd dropped;  // closed after the lock is let go
  absl::MutexLock lock(&mu_);
  auto it = fds_.find(id);
  if (it == fds_.end()) return;
  dropped = std::move(it->second);
  fds_.erase(it);
}

absl::Status MemoryStateStore::KeepHostTierFd(int fd) {
  if (options_.durability != Durability::kFdStore) return absl::OkStatus();
  UniqueFd copy(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) return ErrnoStatus(errno, "host tier: keeping its FD");
  absl::MutexLock lock(&mu_);
  std::swap(host_tier_fd_, copy);  // the one before closes after the lock is let go
  return absl::OkStatus();
}

void MemoryStateStore::DropHostTierFd() {
  UniqueFd dropped;
  absl::MutexLock lock(&mu_);
  std::swap(host_tier_fd_, dropped);
}

bool MemoryStateStore::holds_host_tier_fd() const {
  absl::MutexLock lock(&mu_);
  return host_tier_fd_.valid();
}

SavedState MemoryStateStore::Reopen() {
  absl::MutexLock lock(&mu_);
  SavedState saved{.epoch = epoch_};
  for (const auto& [name, record] : records_) saved.pools.push_back(record);
  for (const auto& [id, fd] : fds_) {
    if (!fd.valid()) continue;
    UniqueFd copy(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!copy.valid()) {
      saved.problems.push_back(
          absl::StrCat("chunk ", id, "'s FD could not be duplicated: ", ErrnoStatus(errno, "dup").message()));
      continue;
    }
    saved.fds[id] = std::move(copy);
  }
  if (host_tier_fd_.valid()) {
    saved.host_tier_fd = UniqueFd(fcntl(host_tier_fd_.get(), F_DUPFD_CLOEXEC, 0));
    if (!saved.host_tier_fd.valid()) {
      saved.problems.push_back(
          absl::StrCat("the host tier's FD could not be duplicated: ", ErrnoStatus(errno, "dup").message()));
    }
  }
  ++epoch_;
  return saved;
}

std::optional<SavedPool> MemoryStateStore::record(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(name);
  if (it == records_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> MemoryStateStore::pool_names() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (const auto& [name, record] : records_) names.push_back(name);
  return names;
}

std::set<uint64_t> MemoryStateStore::kept_chunk_ids() const {
  absl::MutexLock lock(&mu_);
  std::set<uint64_t> ids;
  for (const auto& [id, fd] : fds_) ids.insert(id);
  return ids;
}

}  // namespace kvd::daemon
