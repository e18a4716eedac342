// The daemon's StateStore (daemon/core/durable.h): pool records as files under --state-dir and chunk FDs
// in the service manager's file-descriptor store (systemd's FDSTORE=1 over $NOTIFY_SOCKET, handed back
// on the next start as $LISTEN_FDS with $LISTEN_FDNAMES "c<chunk id>"), and the host tier's memfd as
// "host-tier". Note [Durable pools] in
// docs/architecture.md.
//
// Layout of the state directory (mode 0700, owned by the daemon's user):
//   daemon         kvd.state.DaemonRecord: the device and the epoch
//   pools/<name>   kvd.state.PoolRecord, one per pool, replaced atomically (write, rename)
//
// Thread-safe. Every failure to write is counted (write_errors); a record that is not written or removed
// is returned to the PoolManager, which reports it and keeps the pool stale (StateHealth in
// daemon/core/pool_types.h); a chunk FD that cannot be handed over or taken back is logged here.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "daemon/core/durable.h"
#include "kvd/device.h"

namespace kvd::daemon {

// A pool's record file (kvd.state.PoolRecord) as SavePool writes it, and read back as Open reads it: DATA_LOSS
// when the bytes are not a PoolRecord, FAILED_PRECONDITION for a record of another format, INVALID_ARGUMENT for
// fields that cannot be restored.
std::string SerializePoolRecord(const SavedPool& pool);
[[nodiscard]] absl::StatusOr<SavedPool> ParsePoolRecord(absl::string_view bytes);

class FileStateStore final : public StateStore {
 public:
  struct Options {
    std::string dir;
    // Chunk FDs go to the service manager ($NOTIFY_SOCKET must be set); at most `fd_store_max` of them.
    bool fd_store = false;
    uint64_t fd_store_max = 0;
  };

  // Creates `options.dir` (and pools/) where missing and reads what a predecessor left in it and in the
  // FD store: FAILED_PRECONDITION naming both devices when the state belongs to another device, or a
  // record of a newer format. Records that cannot be read are reported in SavedState::problems (and
  // moved aside as <name>.unreadable), not guessed at. Writes the daemon record of the new epoch
  // (SavedState::epoch + 1) before returning.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<FileStateStore>> Open(Options options, const DeviceInfo& device,
                                                                            SavedState* saved);

  Durability durability() const override { return options_.fd_store ? Durability::kFdStore : Durability::kClients; }
  [[nodiscard]] absl::Status SavePool(const SavedPool& pool) override;
  [[nodiscard]] absl::Status ForgetPool(absl::string_view name) override;
  [[nodiscard]] absl::Status KeepChunkFd(uint64_t id, int fd) override ABSL_LOCKS_EXCLUDED(mu_);
  void DropChunkFd(uint64_t id) override ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::Status KeepHostTierFd(int fd) override ABSL_LOCKS_EXCLUDED(mu_);
  void DropHostTierFd() override ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t write_errors() const { return write_errors_.load(std::memory_order_relaxed); }
  uint64_t stored_fds() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit FileStateStore(Options options) : options_(std::move(options)) {}
  std::string PoolPath(absl::string_view name) const;
  absl::Status Failed(absl::Status status, bool log = true);

  const Options options_;
  std::atomic<uint64_t> write_errors_{0};
  mutable absl::Mutex mu_;
  std::set<uint64_t> stored_ ABSL_GUARDED_BY(mu_);      // chunk ids whose FD the service manager holds
  bool host_tier_stored_ ABSL_GUARDED_BY(mu_) = false;  // and the host tier's ("host-tier")
};

}  // namespace kvd::daemon
