// MemoryStateStore: the complete in-memory StateStore (durable.h). It keeps the records and, where it plays
// a service manager's FD store (durability kFdStore), a dup() of every kept FD, so the chunks outlive the
// PoolManager that made them exactly as they outlive a daemon process under systemd. Tests run a restart on
// it (Shutdown(keep_pools), Reopen, a new manager, Restore); the daemon uses one (durability kNone) when
// nothing must outlive it, and a PoolManager made without a store owns one. Note [Durable pools] in
// docs/architecture.md.
//
// Thread-safe; its lock is a leaf (Note [Lock order]).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "daemon/core/durable.h"
#include "kvd/unique_fd.h"

namespace kvd::daemon {

class MemoryStateStore final : public StateStore {
 public:
  struct Options {
    // What durability() says. kFdStore: the store holds a dup() of every kept FD (as the service manager
    // does); kClients and kNone: it only notes the chunk ids, as a state directory without an FD store.
    Durability durability = Durability::kNone;
    // Most FDs held at once (kFdStore): KeepChunkFd is RESOURCE_EXHAUSTED past it, as --fdstore-max.
    uint64_t max_fds = std::numeric_limits<uint64_t>::max();
  };

  MemoryStateStore() : MemoryStateStore(Options{}) {}
  explicit MemoryStateStore(Options options) : options_(options) {}

  Durability durability() const override { return options_.durability; }
  [[nodiscard]] absl::Status SavePool(const SavedPool& pool) override ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::Status ForgetPool(absl::string_view name) override ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::Status KeepChunkFd(uint64_t id, int fd) override ABSL_LOCKS_EXCLUDED(mu_);
  void DropChunkFd(uint64_t id) override ABSL_LOCKS_EXCLUDED(mu_);
  // kFdStore: a dup() of the tier's memfd, handed to the successor as SavedState::host_tier_fd.
  [[nodiscard]] absl::Status KeepHostTierFd(int fd) override ABSL_LOCKS_EXCLUDED(mu_);
  void DropHostTierFd() override ABSL_LOCKS_EXCLUDED(mu_);

  // What a successor finds, as FileStateStore::Open reads it: the epoch of the last Reopen (0 the first
  // time), every record (by name) and a dup() of every FD held (a dup that fails is a problem line). The
  // store stays as it is, its epoch one on: the successor's.
  [[nodiscard]] SavedState Reopen() ABSL_LOCKS_EXCLUDED(mu_);

  // The record of `name`, if one was saved and not forgotten.
  std::optional<SavedPool> record(absl::string_view name) const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::string> pool_names() const ABSL_LOCKS_EXCLUDED(mu_);
  // Chunk ids whose FD was kept and not dropped (with kFdStore, the FDs held).
  std::set<uint64_t> kept_chunk_ids() const ABSL_LOCKS_EXCLUDED(mu_);
  bool holds_host_tier_fd() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const Options options_;
  mutable absl::Mutex mu_;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, SavedPool, std::less<>> records_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, UniqueFd> fds_ ABSL_GUARDED_BY(mu_);  // invalid UniqueFd where only the id is noted
  UniqueFd host_tier_fd_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvd::daemon
