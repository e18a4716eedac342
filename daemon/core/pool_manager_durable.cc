// PoolManager (pool_manager.h): durability — saving the records, restoring after a restart, the clients'
// ReturnHandles and the recovery grace.
#include <sys/stat.h>

#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/core/pool_manager.h"
#include "kvd/status.h"
#include "kvd/units.h"

namespace kvd::daemon {

// ---------------------------------------------------------------------------------------------
// Durability: see Note [Durable pools] in docs/architecture.md.

void PoolManager::Save(Pool& pool) {
  const SavedPool saved = pool.Saved();
  const absl::Status written = store_->SavePool(saved);
  NoteSaved(pool.name(), written, "written");
  if (!written.ok()) return;
  absl::MutexLock lock(&mu_);
  saved_pending_[pool.name()] = saved.pending_release_bytes;
}

void PoolManager::Forget(Pool& pool) {
  NoteSaved(pool.name(), store_->ForgetPool(pool.name()), "removed");
  absl::MutexLock lock(&mu_);
  if (auto it = saved_pending_.find(pool.name()); it != saved_pending_.end()) saved_pending_.erase(it);
}

// Note [A release that settles later is saved again]: a release's bytes stay in the record's
// pending_release_bytes until the last client acknowledges it, and a restart counts them for the recovery
// grace. That acknowledgement (or the client's detach, or its session's end) usually comes after the operation
// wrote the record, without op_mu, on a path that must not wait for it (a client's acknowledgement can wait
// behind the next step of a compaction that waits for that same client). So the record is written again by
// the saver thread, under op_mu, once the pool counts fewer pending bytes than its record; an RPC that waited for
// its release (wait_for_release) writes it itself before it replies, so that a restart after that reply counts
// nothing the clients already gave back.
void PoolManager::ResaveIfSettled(const std::shared_ptr<Pool>& pool) {
  const uint64_t pending = pool->pending_bytes();
  absl::MutexLock lock(&mu_);
  auto it = saved_pending_.find(pool->name());
  if (it == saved_pending_.end() || it->second <= pending) return;
  for (const std::weak_ptr<Pool>& queued : to_resave_) {
    if (queued.lock() == pool) return;
  }
  to_resave_.push_back(pool);
}

void PoolManager::ResaveInBackground() {
  for (;;) {
    std::shared_ptr<Pool> pool;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !to_resave_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      pool = to_resave_.front().lock();
      to_resave_.pop_front();
    }
    if (pool != nullptr) SaveIfSettled(*pool);
  }
}

void PoolManager::SaveIfSettled(Pool& pool) {
  absl::MutexLock op(&pool.op_mu());
  if (pool.deleted()) return;  // its record is gone: writing it would bring it back
  const uint64_t pending = pool.pending_bytes();
  {
    absl::MutexLock lock(&mu_);
    auto it = saved_pending_.find(pool.name());
    if (it == saved_pending_.end() || it->second <= pending) return;
  }
  Save(pool);
}

void PoolManager::NoteSaved(absl::string_view pool, const absl::Status& written, absl::string_view what) {
  bool degraded = false;
  {
    absl::MutexLock lock(&state_mu_);
    const bool was = !stale_.empty();
    if (written.ok()) {
      if (auto it = stale_.find(pool); it != stale_.end()) stale_.erase(it);
    } else {
      ++save_failures_;
      stale_[std::string(pool)] = {
          .error = absl::StrCat("pool ", pool, ": its saved record could not be ", what, ": ", written.message()),
          .sequence = save_failures_};
    }
    degraded = !stale_.empty();
    if (degraded == was && written.ok()) return;
    state_degraded_.store(degraded, std::memory_order_release);
  }
  if (!written.ok()) {
    Warn(absl::StrCat("pool ", pool, ": its saved record could not be ", what, " (", written.message(),
                      "): a restart now would restore it as its last saved record says; kvd reports the state as "
                      "degraded until a later save of the pool succeeds"));
  }
  absl::MutexLock lock(&observer_mu_);
  if (observers_.state_degraded) observers_.state_degraded(state_degraded_.load(std::memory_order_acquire));
}

StateHealth PoolManager::state_health() const {
  absl::MutexLock lock(&state_mu_);
  StateHealth health{.save_failures = save_failures_, .stale_pools = static_cast<uint32_t>(stale_.size())};
  uint64_t latest = 0;
  for (const auto& [name, stale] : stale_) {
    if (stale.sequence > latest) {
      latest = stale.sequence;
      health.error = stale.error;
    }
  }
  return health;
}

RestoreReport PoolManager::Restore(SavedState saved) {
  RestoreReport report;
  for (SavedPool& record : saved.pools) {
    // Note [The host tier]: kept contents come back with the tier's memfd, adopted from the FD store.
    if (record.kept.has_value()) {
      absl::Status claimed = host_tier_ == nullptr ? absl::FailedPreconditionError("kvd has no host tier now")
                             : !host_tier_->adopted()
                                 ? absl::FailedPreconditionError("the previous daemon's tier did not come back")
                                 : host_tier_->Claim(record.kept->tier_offset, record.kept->extent_bytes);
      if (!claimed.ok()) {
        report.lines.push_back(absl::StrCat("pool ", record.name, ": the ", record.kept->bytes,
                                            " bytes it kept in the host tier are lost (", claimed.message(),
                                            "): it wakes with fresh memory"));
        record.kept.reset();
      }
    }
    std::shared_ptr<Pool> pool = RestorePool(record, saved.fds, report);
    if (pool == nullptr) {
      if (record.kept.has_value()) host_tier_->Give(record.kept->tier_offset, record.kept->extent_bytes);
      continue;
    }
    arbiter_.Add(record.name, record.owner_uid, record.policy);
    // Counted against the owner's limits like a pool it creates, but never refused: it exists already.
    const uint64_t reserved = pool->geometry().reserved_bytes();
    absl::MutexLock lock(&mu_);
    pools_[pool->name()] = pool;
    ++pools_by_uid_[pool->owner_uid()];
    reserved_by_uid_[pool->owner_uid()] += reserved;
    reserved_total_ += reserved;
  }
  // FDs no record accounts for: chunks of a grow or group prepare that never committed, or of a pool
  // whose record was lost. Nobody can map them through this daemon; keeping them would hide memory.
  for (auto& [id, fd] : saved.fds) {
    report.lines.push_back(absl::StrCat("chunk ", id,
                                        ": its FD was in the store but no saved pool has it "
                                        "(an uncommitted grow or prepare): released"));
    store_->DropChunkFd(id);
    ++report.fds_released;
  }
  for (const std::string& line : report.lines) Warn(line);
  recovery_ = std::thread([this, deadline = absl::Now() + options_.recovery_grace] { ExpireRecovery(deadline); });
  return report;
}

std::shared_ptr<Pool> PoolManager::RestorePool(const SavedPool& saved, std::map<uint64_t, UniqueFd>& fds,
                                               RestoreReport& report) {
  auto fail = [&](absl::string_view why) -> std::shared_ptr<Pool> {
    report.lines.push_back(absl::StrCat("pool ", saved.name, ": not restored: ", why));
    return nullptr;
  };
  if (saved.granularity != device_->granularity()) {
    return fail(
        absl::StrCat("saved with granularity ", saved.granularity, ", the device has ", device_->granularity()));
  }
  absl::StatusOr<Geometry> geometry = Geometry::Compute(saved.layout.layout, saved.dims, saved.granularity);
  if (!geometry.ok()) return fail(geometry.status().message());
  auto pool = std::make_shared<Pool>(saved, PoolPlan{saved.layout, *std::move(geometry)}, shared_);
  absl::MutexLock op(&pool->op_mu());
  absl::StatusOr<uint64_t> base = device_->Reserve(pool->geometry().reserved_bytes());
  if (!base.ok()) return fail(base.status().ToString());
  pool->set_base(*base);
  uint64_t bytes = 0;
  std::vector<ChunkRecord> chunks;
  std::set<uint64_t> missing;
  for (const ChunkInfo& info : saved.chunks) {
    bytes += info.bytes;
    ChunkRecord r{.info = info};
    auto fd = fds.extract(info.id);
    absl::Status adopted =
        !fd.empty() ? absl::OkStatus()
        : store_->durability() == Durability::kFdStore
            ? absl::NotFoundError("no FD for it in the service manager's store")
            : absl::NotFoundError("no FD store: waiting for the clients that map it to give it back");
    if (adopted.ok()) {
      absl::StatusOr<ChunkRecord> chunk = maker_.Adopt(*base, info, std::move(fd.mapped()));
      adopted = chunk.status();
      if (adopted.ok()) r = *std::move(chunk);
    }
    // An FD that is not the chunk leaves the store: a client may give the real one back.
    if (!adopted.ok() && !fd.empty()) store_->DropChunkFd(info.id);
    if (adopted.ok()) {
      ++report.chunks_adopted;
      report.bytes_adopted += info.bytes;
    } else {
      ++report.chunks_missing;
      missing.insert(info.id);
      report.lines.push_back(absl::StrCat("pool ", saved.name, ": chunk ", info.id, " (segment ", info.segment,
                                          ", offset ", info.offset, ", ", FormatBytes(info.bytes),
                                          ") not restored: ", adopted.message()));
    }
    chunks.push_back(std::move(r));
  }
  // Counted whether or not the memory came back: clients may still map what is missing.
  budget_.Take(bytes + saved.pending_release_bytes);
  if (missing.empty()) {
    ++report.pools_restored;
  } else {
    ++report.pools_recovering;
  }
  pool->Recover(std::move(chunks), std::move(missing));
  return pool;
}

void PoolManager::ExpireRecovery(absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (mu_.AwaitWithDeadline(absl::Condition(&stopping), deadline)) return;
  }
  for (const std::shared_ptr<Pool>& pool : Snapshot()) {
    absl::MutexLock op(&pool->op_mu());
    if (pool->state() != PoolState::kRecovering) {
      if (pool->ForgetRestartPending() > 0) Save(*pool);  // the record stops counting them too
      continue;
    }
    // The clients that gave chunks back map them: the pausable ones pause before the pool sleeps, the
    // others are forced past (Note [Releases pause first]).
    QuiesceLocked(*pool, /*session=*/{}, "the recovery grace's end", pool->Leaving(0), ReleaseOptions{.force = true})
        .IgnoreError();
    std::vector<ChunkRecord> present;
    const std::vector<ChunkInfo> lost = pool->GiveUpRecovery(&present);
    for (const ChunkInfo& c : lost) {
      Warn(absl::StrCat("pool ", pool->name(), ": chunk ", c.id, " (", FormatBytes(c.bytes),
                        ") was not given back within the recovery grace: lost; the pool sleeps"));
    }
    for (ChunkRecord& r : present) maker_.Discard(pool->base(), r);
    const uint64_t forgotten = pool->ForgetRestartPending();
    if (!lost.empty() || forgotten > 0) Save(*pool);
  }
}

absl::StatusOr<PoolManager::Returned> PoolManager::ReturnHandles(absl::string_view session, uint32_t peer_uid,
                                                                 absl::string_view pool_name,
                                                                 std::vector<std::pair<uint64_t, UniqueFd>> fds) {
  absl::StatusOr<Caller> caller = sessions_.Authenticate(session);
  if (!caller.ok()) return absl::UnauthenticatedError("return_handles.session_token: unknown or closed session");
  if (caller->uid != peer_uid) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", peer_uid, " may not use the session of uid ", caller->uid));
  }
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(*caller, pool_name));
  absl::MutexLock op(&pool->op_mu());
  std::vector<uint64_t> ids;
  for (const auto& [id, fd] : fds) ids.push_back(id);
  KVD_ASSIGN_OR_RETURN(std::vector<Pool::Returned> plan, pool->PlanReturn(ids));
  std::vector<ChunkRecord> adopted;
  const uint64_t base = pool->base();
  absl::Cleanup undo = [&] {
    for (ChunkRecord& r : adopted) maker_.Discard(base, r, ChunkMaker::StoreFd::kLeave);
  };
  const bool host = device_->kind() == BackendKind::kHost;
  for (size_t i = 0; i < plan.size(); ++i) {
    const ChunkInfo& info = plan[i].info;
    const int fd = fds[i].second.get();
    auto wrong = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk_ids[", i, "]: the FD given for chunk ", info.id, " of pool ", pool->name(), " ", why));
    };
    if (!plan[i].missing) {
      struct stat given {};
      struct stat held {};
      if (host && (fstat(fd, &given) != 0 || fstat(plan[i].fd, &held) != 0 || held.st_dev != given.st_dev ||
                   held.st_ino != given.st_ino)) {
        return wrong("is not that chunk's memory");
      }
      continue;
    }
    absl::StatusOr<ChunkRecord> chunk = maker_.Adopt(base, info, std::move(fds[i].second));
    if (!chunk.ok()) return wrong(chunk.status().message());
    adopted.push_back(*std::move(chunk));
  }
  KVD_RETURN_IF_ERROR(maker_.Keep(adopted));  // on failure `undo` releases what was adopted
  std::move(undo).Cancel();
  Returned out;
  for (const ChunkRecord& r : adopted) out.adopted.push_back(r.info.id);
  out.missing = pool->Adopt(std::move(adopted));
  out.state = pool->state();
  return out;
}

absl::StatusOr<PoolMetadata> PoolManager::GetPoolMetadata(const Caller& caller, absl::string_view name) const {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  return pool->metadata();
}

absl::StatusOr<PoolMetadata> PoolManager::SetPoolMetadata(const Caller& caller, absl::string_view name,
                                                          uint64_t expected_version, std::string data) {
  if (data.size() > options_.max_metadata_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("data: ", data.size(), " bytes, at most ",
                                                   options_.max_metadata_bytes, " allowed (--max-metadata-bytes)"));
  }
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu());
  KVD_ASSIGN_OR_RETURN(PoolMetadata metadata, pool->SetMetadata(expected_version, std::move(data)));
  Save(*pool);
  return metadata;
}

}  // namespace kvd::daemon
