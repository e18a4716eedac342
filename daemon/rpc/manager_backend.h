// ManagerBackend: the handle channel's view of the PoolManager (HandleChannelBackend). Sessions and
// leases live in the manager; this adapter only forwards. Thread-safe because the manager is; the
// manager must outlive the adapter, and the adapter the channel.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/core/pool_manager.h"
#include "daemon/rpc/convert.h"
#include "daemon/rpc/handle_channel.h"
#include "kvd/status.h"

namespace kvd::daemon {

class ManagerBackend final : public HandleChannelBackend {
 public:
  explicit ManagerBackend(PoolManager* manager) : manager_(manager) {}

  [[nodiscard]] absl::StatusOr<std::string> OpenSession(uint32_t uid, int32_t pid, std::string name) override {
    return manager_->OpenSession(uid, pid, std::move(name));
  }

  void CloseSession(absl::string_view session) override { manager_->CloseSession(session); }

  [[nodiscard]] absl::StatusOr<std::vector<LeasedFd>> RedeemLease(absl::string_view session, absl::string_view lease,
                                                                  uint32_t peer_uid, bool skip_released) override {
    KVD_ASSIGN_OR_RETURN(std::vector<PoolManager::LeasedFd> fds,
                         manager_->RedeemLease(session, lease, peer_uid, skip_released));
    std::vector<LeasedFd> out;
    out.reserve(fds.size());
    for (const PoolManager::LeasedFd& f : fds) out.push_back({.chunk_id = f.chunk_id, .fd = f.fd});
    return out;
  }

  [[nodiscard]] absl::StatusOr<v1::HandlesReturned> ReturnHandles(
      absl::string_view session, uint32_t peer_uid, absl::string_view pool,
      std::vector<std::pair<uint64_t, UniqueFd>> fds) override {
    KVD_ASSIGN_OR_RETURN(PoolManager::Returned returned,
                         manager_->ReturnHandles(session, peer_uid, pool, std::move(fds)));
    v1::HandlesReturned out;
    for (uint64_t id : returned.adopted) out.add_adopted_chunk_ids(id);
    for (uint64_t id : returned.missing) out.add_missing_chunk_ids(id);
    out.set_state(ToProto(returned.state));
    return out;
  }

 private:
  PoolManager* const manager_;
};

}  // namespace kvd::daemon
