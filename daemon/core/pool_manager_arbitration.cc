// PoolManager (pool_manager.h): the arbitration of the device's memory among the pools: waiting grows and
// wakes, policies, usage reports, reclaims (arbiter.h; Note [Arbitration] in docs/architecture.md).
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/core/pool_manager.h"
#include "kvd/status.h"

namespace kvd::daemon {

absl::StatusOr<PoolUpdate> PoolManager::ResizeWaiting(const Caller& caller, const std::shared_ptr<Pool>& pool,
                                                      GroupOp op, uint64_t target_blocks, const WaitOptions& wait) {
  if (!wait.wait) return Resize(caller, pool, op, target_blocks, false, absl::InfinitePast());
  // In the queue from the start, so that its place is its arrival's; it waits holding no lock of the pool's.
  const Arbiter::Ticket ticket = arbiter_.Join(
      pool->name(), caller.uid,
      op == GroupOp::kGrow ? absl::StrCat("growing to ", target_blocks, " blocks") : std::string("waking"));
  const Arbiter::Retry retry(ticket);
  while (true) {
    absl::StatusOr<PoolUpdate> update = Resize(caller, pool, op, target_blocks, false, absl::InfinitePast());
    if (update.ok() || !Arbiter::IsShortOfMemory(update.status())) return update;
    absl::Status waited = arbiter_.AwaitRoom(ticket, wait.deadline, wait.cancelled);
    if (absl::IsUnavailable(waited)) return waited;
    if (!waited.ok()) {
      return arbiter_.WaitFailed(ticket, update.status(),
                                 [&](const std::string& other) { return Find(caller, other).ok(); });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Arbitration: policies, usage reports, reclaims (arbiter.h; Note [Arbitration] in docs/architecture.md)

ArbiterStats PoolManager::ArbitrationStats() const {
  ArbiterStats stats = arbiter_.Stats();
  stats.driver_out_of_memory = maker_.out_of_memory();
  return stats;
}

Caller PoolManager::DaemonCaller() const {
  return Caller{.uid = options_.daemon_uid, .pid = getpid(), .session = "", .name = "kvd"};
}

absl::StatusOr<PoolView> PoolManager::SetPoolPolicy(const Caller& caller, absl::string_view name,
                                                    const PolicyChange& change) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu());  // one pool's records are written in order (Note [Durable pools])
  if (pool->deleted()) return PoolGone(name);
  const Geometry& g = pool->geometry();
  KVD_RETURN_IF_ERROR(arbiter_
                          .Change(pool->name(), change, caller.uid,
                                  g.CommittedBytes(g.PrefixBytes(g.dims().capacity_blocks)), options_.limits)
                          .status());
  Save(*pool);
  return pool->View();
}

absl::Status PoolManager::ReportUsage(const Caller& caller, absl::string_view name, UsageReport usage) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  usage.reported_at = absl::Now();
  return arbiter_.Report(pool->name(), usage, pool->Summary().committed_blocks);
}

absl::Status PoolManager::DeclineReclaim(const Caller& caller, absl::string_view name, uint64_t reclaim_id,
                                         std::string reason) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  return arbiter_.Decline(pool->name(), reclaim_id, std::move(reason));
}

Arbiter::Hooks PoolManager::ArbiterHooks() {
  Arbiter::Hooks hooks;
  hooks.loads = [this] {
    std::vector<PoolLoad> loads;
    for (const std::shared_ptr<Pool>& pool : Snapshot()) {
      const PoolSummary v = pool->Summary();
      loads.push_back({.name = pool->name(),
                       .owner_uid = pool->owner_uid(),
                       .state = v.state,
                       .committed_blocks = v.committed_blocks,
                       .committed_bytes = v.committed_bytes,
                       .clients = v.clients,
                       .geometry = pool->geometry()});
    }
    return loads;
  };
  hooks.ask = [this](const std::string& name, uint64_t id, uint64_t bytes, absl::Time deadline) -> size_t {
    absl::StatusOr<std::shared_ptr<Pool>> pool = Find(DaemonCaller(), name);
    return pool.ok() ? (*pool)->AskReclaim(id, bytes, deadline) : 0;
  };
  // The deadline actions are the daemon's own releases: every attached client is paused first, or the
  // release is refused for one that is not pausable (Note [Releases pause first]).
  hooks.shrink = [this](const std::string& name, uint64_t used_blocks, uint64_t min_bytes) -> absl::StatusOr<uint64_t> {
    const Caller daemon = DaemonCaller();
    KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(daemon, name));
    const PoolSummary v = pool->Summary();
    const Geometry& g = pool->geometry();
    // The fewest blocks that hold min_bytes: the guarantee is never shrunk away.
    uint64_t lo = 0;
    uint64_t hi = v.committed_blocks;
    while (lo < hi) {
      const uint64_t mid = lo + (hi - lo) / 2;
      if (g.CommittedBytes(g.PrefixBytes(mid)) >= min_bytes) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const uint64_t target = std::max(used_blocks, lo);
    if (target >= v.committed_blocks) return v.committed_blocks;
    KVD_ASSIGN_OR_RETURN(PoolUpdate update, Shrink(daemon, name, target, ShrinkOptions{}));
    return update.pool.committed_blocks;
  };
  // A sleep keeps the pool's contents where the host tier can hold them (SleepKeeping), else loses them.
  hooks.sleep = [this](const std::string& name) -> absl::StatusOr<std::string> {
    if (host_tier_ != nullptr) {
      absl::StatusOr<PoolUpdate> kept = SleepKeeping(name);
      if (kept.ok()) return std::string("its contents kept in the host tier");
      if (!absl::IsResourceExhausted(kept.status())) return kept.status();
      KVD_RETURN_IF_ERROR(Sleep(DaemonCaller(), name, false, absl::InfinitePast()).status());
      return absl::StrCat("its contents lost (", kept.status().message(), ")");
    }
    KVD_RETURN_IF_ERROR(Sleep(DaemonCaller(), name, false, absl::InfinitePast()).status());
    return std::string("its contents lost (no host tier: --host-tier-bytes)");
  };
  hooks.observe = [this](const ArbiterEvent& event) {
    absl::MutexLock lock(&observer_mu_);
    if (observers_.arbitration) observers_.arbitration(event);
  };
  return hooks;
}

}  // namespace kvd::daemon
