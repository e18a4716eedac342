#include "daemon/core/pool_manager.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "daemon/core/memory_state_store.h"
#include "kvd/status.h"
#include "kvd/units.h"

namespace kvd::daemon {
namespace {

absl::Status Stopping() { return absl::UnavailableError("kvd is shutting down"); }

// The daemon's address space left: the lower of RLIMIT_AS and the 47-bit user address space of x86-64
// and arm64 Linux, less the process's VmSize. VA reservations (host mmap, cuMemAddressReserve under
// UVA) come out of it.
uint64_t AddressSpaceFree() {
  uint64_t limit = uint64_t{1} << 47;
  if (rlimit rl{}; getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    limit = std::min<uint64_t>(limit, rl.rlim_cur);
  }
  uint64_t used = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    uint64_t kib = 0;
    if (absl::StartsWith(line, "VmSize:") &&
        absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(line.substr(7)), " kB"), &kib)) {
      used = kib * 1024;
    }
  }
  return used < limit ? limit - used : 0;
}

// Whether `fd` can be chunk memory of `bytes` (restore, ReturnHandles). On the host backend a chunk is a
// memfd of exactly its size; a GPU driver's FD is checked by importing and mapping it.
absl::Status CheckChunkFd(BackendKind backend, int fd, uint64_t bytes) {
  if (backend != BackendKind::kHost) return absl::OkStatus();
  struct stat st {};
  if (fstat(fd, &st) != 0) return absl::InvalidArgumentError("cannot be examined (fstat failed)");
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("has ", st.st_size, " bytes, the chunk ", bytes));
  }
  return absl::OkStatus();
}

ManagerOptions WithDaemonUid(ManagerOptions options) {
  options.limits.daemon_uid = options.daemon_uid;
  return options;
}

void Decrement(std::map<uint32_t, uint64_t>& counts, uint32_t uid, uint64_t by) {
  auto it = counts.find(uid);
  if (it == counts.end()) return;
  it->second -= std::min(it->second, by);
  if (it->second == 0) counts.erase(it);
}

}  // namespace

const char* GroupOpName(GroupOp op) {
  switch (op) {
    case GroupOp::kGrow:
      return "grow";
    case GroupOp::kShrink:
      return "shrink";
    case GroupOp::kSleep:
      return "sleep";
    case GroupOp::kWake:
      return "wake";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Construction, sessions, device

namespace {

DeviceInfo ReadInfo(Device* device) {
  absl::StatusOr<DeviceInfo> info = device->Info();
  DeviceInfo out = info.ok() ? *std::move(info) : DeviceInfo{};
  out.granularity = device->granularity();
  out.backend = device->kind();
  return out;
}

}  // namespace

PoolManager::PoolManager(Device* device, ManagerOptions options)
    : device_(device),
      options_(WithDaemonUid(std::move(options))),
      own_store_(options_.store == nullptr ? std::make_unique<MemoryStateStore>() : nullptr),
      store_(options_.store != nullptr ? options_.store : own_store_.get()),
      device_info_(ReadInfo(device)),
      capabilities_(device->Capabilities()),
      budget_(options_.budget_bytes != 0 ? options_.budget_bytes : device_info_.total_bytes),
      sessions_(options_.limits),
      leases_(options_.lease_ttl),
      shared_{.leases = &leases_,
              .budget = &budget_,
              .next_chunk_id = &next_chunk_id_,
              .daemon_uid = options_.daemon_uid,
              .device_uuid = device_info_.uuid,
              .epoch = options_.epoch,
              .limits = &options_.limits} {
  // Chunk ids are never reused, also across restarts: each epoch numbers its chunks from its own base.
  next_chunk_id_ = ((options_.epoch - 1) << 40) + 1;
  reaper_ = std::thread([this] { ReapExpired(); });
  if (options_.compact_above_chunks > 0) compactor_ = std::thread([this] { CompactInBackground(); });
}

PoolManager::~PoolManager() {
  Shutdown();
  if (recovery_.joinable()) recovery_.join();
}

void PoolManager::Warn(const std::string& line) const {
  if (options_.warn) options_.warn(line);
}

absl::StatusOr<std::string> PoolManager::OpenSession(uint32_t uid, int32_t pid, std::string name) {
  absl::StatusOr<std::string> token = sessions_.Open(uid, pid, std::move(name));
  if (!token.ok()) return Refused(token.status());
  return token;
}

absl::Status PoolManager::Refused(absl::Status status) const {
  if (const std::optional<LimitRefusal> refusal = LimitRefusalOf(status); refusal.has_value()) {
    refusals_[static_cast<size_t>(refusal->limit)].fetch_add(1, std::memory_order_relaxed);
  }
  return status;
}

std::map<std::string, uint64_t> PoolManager::LimitRefusals() const {
  std::map<std::string, uint64_t> out;
  for (size_t i = 0; i < kLimitFlags.size(); ++i) out[kLimitFlags[i]] = refusals_[i].load(std::memory_order_relaxed);
  return out;
}

TenantUsage PoolManager::Usage() const {
  TenantUsage usage;
  usage.sessions = sessions_.CountByUid();
  absl::MutexLock lock(&mu_);
  usage.pools = pools_by_uid_;
  usage.reserved_bytes = reserved_by_uid_;
  return usage;
}

void PoolManager::ErasePoolLocked(const Pool& pool) {
  auto it = pools_.find(pool.name());
  if (it == pools_.end() || it->second.get() != &pool) return;
  pools_.erase(it);
  const uint64_t reserved = pool.geometry().reserved_bytes();
  Decrement(pools_by_uid_, pool.owner_uid(), 1);
  Decrement(reserved_by_uid_, pool.owner_uid(), reserved);
  reserved_total_ -= std::min(reserved_total_, reserved);
}

bool PoolManager::LetGoLocked(absl::string_view session, absl::string_view client_id, uint64_t* freed) {
  bool found = false;
  for (auto it = orphaned_.begin(); it != orphaned_.end();) {
    std::map<std::string, std::string>& clients = it->held.clients;
    for (auto c = clients.begin(); c != clients.end();) {
      if (c->second == session && (client_id.empty() || c->first == client_id)) {
        c = clients.erase(c);
        found = true;
      } else {
        ++c;
      }
    }
    if (clients.empty()) {
      *freed += it->held.bytes;
      it = orphaned_.erase(it);
    } else {
      ++it;
    }
  }
  return found;
}

void PoolManager::CloseSession(absl::string_view session) {
  // The session goes first: an Attach or Prepare of it that finishes later finds it gone (they check
  // under their pool's lock), and everything it installed before is found below.
  if (!sessions_.Close(session)) return;
  leases_.DropSession(session);
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    LetGoLocked(session, {}, &freed);
  }
  budget_.Give(freed);  // after mu_: the budget's lock is a leaf too (Note [Lock order])
  for (const std::shared_ptr<Pool>& pool : Snapshot()) {
    ForgetClients(pool->DetachSession(session));
    if (std::optional<std::string> id = pool->HeldBy(session); id.has_value()) {
      absl::MutexLock op(&pool->op_mu);
      AbortLocked(*pool, *id, session, "its session closed (the coordinator ended or died) before Commit");
    }
  }
}

absl::StatusOr<Caller> PoolManager::Authenticate(absl::string_view session) const {
  return sessions_.Authenticate(session);
}

absl::StatusOr<DeviceStatus> PoolManager::GetDeviceStatus() const {
  KVD_ASSIGN_OR_RETURN(DeviceInfo info, device_->Info());
  DeviceStatus s{.info = info, .budget_bytes = budget_.limit(), .max_chunk_bytes = options_.max_chunk_bytes};
  const std::vector<std::shared_ptr<Pool>> pools = Snapshot();
  for (const std::shared_ptr<Pool>& pool : pools) {
    s.pending_release_bytes += pool->pending_bytes();
    s.reserved_bytes += pool->geometry().reserved_bytes();
  }
  {
    absl::MutexLock lock(&mu_);
    for (const Orphaned& o : orphaned_) s.pending_release_bytes += o.held.bytes;
  }
  s.committed_bytes = budget_.committed();
  s.pools = static_cast<uint32_t>(pools.size());
  s.capabilities = capabilities_;
  s.epoch = options_.epoch;
  s.started_at = options_.started_at;
  s.durability = store_->durability();
  s.state = state_health();
  return s;
}

absl::StatusOr<LayoutResolution> PoolManager::ResolveLayout(const LayoutRequest& request) const {
  return daemon::ResolveLayout(request, options_.layout_policy);
}

std::vector<std::shared_ptr<Pool>> PoolManager::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Pool>> out;
  out.reserve(pools_.size());
  for (const auto& [name, pool] : pools_) out.push_back(pool);
  return out;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolManager::Find(const Caller& caller, absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(name);
  // A pool the caller may not use is answered exactly as a missing one, so that no uid learns which
  // pool names exist by probing (CreatePool's ALREADY_EXISTS is the one exception: names are global).
  if (it == pools_.end() || !it->second->Allows(caller.uid)) return PoolGone(name);
  return it->second;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolManager::FindClient(absl::string_view client_id) const {
  absl::MutexLock lock(&mu_);
  auto it = client_pools_.find(client_id);
  if (it != client_pools_.end()) {
    // A pool being deleted or shut down leaves pools_ before its clients are gone: not attached.
    auto p = pools_.find(it->second);
    if (p != pools_.end()) return p->second;
  }
  return absl::NotFoundError(absl::StrCat("client_id: ", client_id, " is not attached"));
}

void PoolManager::ForgetClients(const std::vector<std::string>& ids) {
  if (ids.empty()) return;
  absl::MutexLock lock(&mu_);
  for (const std::string& id : ids) client_pools_.erase(id);
}

// ---------------------------------------------------------------------------------------------
// Chunks

absl::StatusOr<std::vector<ChunkRecord>> PoolManager::MakeChunks(uint64_t base, const std::vector<PlannedChunk>& plan) {
  std::vector<ChunkRecord> made;
  absl::Cleanup undo = [&] {
    for (ChunkRecord& r : made) DiscardChunk(base, r);
  };
  made.reserve(plan.size());
  for (const PlannedChunk& p : plan) {
    ChunkRecord r;
    r.info = {.id = next_chunk_id_.fetch_add(1), .segment = p.segment, .offset = p.offset, .bytes = p.bytes};
    KVD_ASSIGN_OR_RETURN(r.chunk, device_->Create(p.bytes));
    if (absl::Status s = device_->Map(base + p.offset, r.chunk, Access::kReadWrite); !s.ok()) {
      device_->Release(r.chunk).IgnoreError();
      return s;
    }
    absl::StatusOr<int> fd = device_->Export(r.chunk);
    if (!fd.ok()) {
      device_->Unmap(base + p.offset, p.bytes).IgnoreError();
      device_->Release(r.chunk).IgnoreError();
      return fd.status();
    }
    r.fd.reset(*fd);
    if (capabilities_.fabric.supported) {
      // Export once, like the FD: every reply and event then carries the same bytes.
      absl::StatusOr<std::string> fabric = device_->ExportFabricHandle(r.chunk);
      if (!fabric.ok()) {
        DiscardChunk(base, r);
        return fabric.status();
      }
      r.info.fabric_handle = *std::move(fabric);
    }
    made.push_back(std::move(r));
  }
  std::move(undo).Cancel();
  return made;
}

void PoolManager::DiscardChunk(uint64_t base, ChunkRecord& r) {
  device_->Unmap(base + r.info.offset, r.info.bytes).IgnoreError();
  device_->Release(r.chunk).IgnoreError();
  r.fd.reset();
}

absl::StatusOr<Staged> PoolManager::Stage(Pool& pool, uint64_t target_blocks) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return Stopping();
  }
  Staged staged;
  // The budget first, from arithmetic alone: a plan is built only for bytes the budget holds, so its
  // size is bounded by the budget (at most budget / max chunk chunks plus one per segment).
  KVD_ASSIGN_OR_RETURN(staged.bytes, pool.GrowBytes(target_blocks));
  // Taken now, so that concurrent grows of other pools see it.
  if (uint64_t free = 0; !budget_.TryTake(staged.bytes, &free)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pool ", pool.name(), ": growing to ", target_blocks, " blocks needs ", staged.bytes, " bytes (",
                     FormatBytes(staged.bytes), ") but only ", free, " bytes (", FormatBytes(free),
                     ") of the daemon's budget of ", FormatBytes(budget_.limit()), " are free"));
  }
  absl::StatusOr<std::vector<PlannedChunk>> plan = pool.PlanGrow(target_blocks, options_.max_chunk_bytes);
  if (!plan.ok()) {
    budget_.Give(staged.bytes);
    return plan.status();
  }
  absl::StatusOr<std::vector<ChunkRecord>> made = MakeChunks(pool.base(), *plan);
  if (!made.ok()) {
    budget_.Give(staged.bytes);
    // Out of memory is worded with the bytes asked and free; out of file descriptors is not about memory
    // and passes as the device said it.
    if (absl::IsResourceExhausted(made.status()) && !IsOutOfFileDescriptors(made.status())) {
      absl::StatusOr<DeviceInfo> info = device_->Info();
      return absl::ResourceExhaustedError(
          absl::StrCat("pool ", pool.name(), ": growing to ", target_blocks, " blocks needs ", staged.bytes, " bytes (",
                       FormatBytes(staged.bytes), ") but the device has ", info.ok() ? info->free_bytes : 0,
                       " bytes free: ", made.status().message()));
    }
    return made.status();
  }
  staged.chunks = *std::move(made);
  // Into the FD store before any client can see them: a restart after the commit finds them there.
  if (absl::Status kept = KeepFds(staged.chunks); !kept.ok()) {
    for (ChunkRecord& r : staged.chunks) DiscardChunk(pool.base(), r);
    budget_.Give(staged.bytes);
    return kept;
  }
  return staged;
}

void PoolManager::Unstage(Pool& pool, Staged& staged) {
  pool.CancelPause();  // a prepared shrink's or sleep's pause, called off
  for (ChunkRecord& r : staged.chunks) {
    store_->DropChunkFd(r.info.id);
    DiscardChunk(pool.base(), r);
  }
  staged.chunks.clear();
  budget_.Give(staged.bytes);
  staged.bytes = 0;
}

// ---------------------------------------------------------------------------------------------
// Pools

absl::StatusOr<PoolView> PoolManager::CreatePool(const Caller& caller, const PoolSpec& spec) {
  KVD_ASSIGN_OR_RETURN(PoolPlan plan, PlanPool(spec, options_.layout_policy,
                                               {.granularity = device_->granularity(),
                                                .max_reserved_bytes = options_.max_pool_reserved_bytes}));
  auto pool = std::make_shared<Pool>(spec, std::move(plan), caller.uid, shared_);
  absl::MutexLock op(&pool->op_mu);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return Stopping();
    if (pools_.contains(spec.name)) {
      return absl::AlreadyExistsError(absl::StrCat("name: pool ", spec.name, " already exists"));
    }
    // Limits, before anything is reserved (limits.h): the pool counts against its owner, the caller.
    const Limits& limits = options_.limits;
    const uint32_t uid = caller.uid;
    const auto of = [uid](const std::map<uint32_t, uint64_t>& m) {
      auto it = m.find(uid);
      return it == m.end() ? uint64_t{0} : it->second;
    };
    KVD_RETURN_IF_ERROR(
        Refused(CheckCount("pools", uid, of(pools_by_uid_), limits.max_pools_per_uid, Limit::kMaxPoolsPerUid,
                           pools_.size(), limits.max_pools, Limit::kMaxPools, limits)));
    const uint64_t reserved = pool->geometry().reserved_bytes();
    KVD_RETURN_IF_ERROR(
        Refused(CheckBytes(absl::StrCat("reserved address space (pool ", spec.name, ")"), uid, reserved,
                           of(reserved_by_uid_), limits.max_reserved_bytes_per_uid, Limit::kMaxReservedPerUid,
                           reserved_total_, limits.max_reserved_bytes, Limit::kMaxReserved, limits)));
    if (!spec.group.name.empty()) {
      for (const auto& [other_name, other] : pools_) {
        if (other->group().name != spec.group.name) continue;
        if (other->group().size != spec.group.size) {
          return absl::InvalidArgumentError(absl::StrCat("group.size: group ", spec.group.name, " has size ",
                                                         other->group().size, " here (pool ", other_name, "), not ",
                                                         spec.group.size));
        }
        if (other->group().rank == spec.group.rank) {
          return absl::AlreadyExistsError(absl::StrCat("group.rank: rank ", spec.group.rank, " of group ",
                                                       spec.group.name, " is already pool ", other_name,
                                                       " on this daemon"));
        }
      }
    }
    // Visible at once so that a concurrent create of the same name fails; other requests on it wait
    // for op_mu and find it deleted if creation fails.
    pools_[spec.name] = pool;
    ++pools_by_uid_[uid];
    reserved_by_uid_[uid] += reserved;
    reserved_total_ += reserved;
  }
  // On failure the pool leaves the map again; requests that found it meanwhile find it deleted.
  auto forget = [&](absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->op_mu) {
    std::vector<ChunkRecord> none;
    pool->Destroy(EventType::kPoolDeleted, &none);
    absl::MutexLock lock(&mu_);
    ErasePoolLocked(*pool);
    return why;
  };
  absl::StatusOr<uint64_t> base = device_->Reserve(pool->geometry().reserved_bytes());
  if (!base.ok()) {
    if (!absl::IsResourceExhausted(base.status()) || IsOutOfFileDescriptors(base.status())) {
      return forget(base.status());
    }
    uint64_t reserved = 0;
    for (const std::shared_ptr<Pool>& other : Snapshot()) {
      if (other != pool) reserved += other->geometry().reserved_bytes();
    }
    const uint64_t asked = pool->geometry().reserved_bytes();
    return forget(absl::ResourceExhaustedError(
        absl::StrCat("dims.capacity_blocks: pool ", spec.name, " needs ", asked, " bytes (", FormatBytes(asked),
                     ") of address space but only ", AddressSpaceFree(), " bytes (", FormatBytes(AddressSpaceFree()),
                     ") are free (the other pools reserve ", reserved, " bytes, ", FormatBytes(reserved),
                     "): ", base.status().message())));
  }
  pool->set_base(*base);
  if (spec.initial_blocks > 0) {
    absl::StatusOr<Change> change = PrepareLocked(*pool, GroupOp::kGrow, spec.initial_blocks, caller.session, {});
    if (!change.ok()) {
      device_->Free(*base, pool->geometry().reserved_bytes()).IgnoreError();
      return forget(change.status());
    }
    CommitLocked(*pool, *std::move(change), caller.session, absl::Now());
  } else {
    Save(*pool);
  }
  return pool->View();
}

absl::StatusOr<PoolView> PoolManager::GetPool(const Caller& caller, absl::string_view name) const {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  return pool->View();
}

std::vector<PoolView> PoolManager::ListPools(const Caller& caller) const {
  std::vector<PoolView> out;
  for (const std::shared_ptr<Pool>& pool : Snapshot()) {
    if (pool->Allows(caller.uid)) out.push_back(pool->View());
  }
  return out;
}

PoolPage PoolManager::ListPools(const Caller& caller, absl::string_view after, size_t max_pools) const {
  std::vector<std::shared_ptr<Pool>> page;
  bool more = false;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = after.empty() ? pools_.begin() : pools_.upper_bound(after); it != pools_.end(); ++it) {
      if (!it->second->Allows(caller.uid)) continue;
      if (page.size() == max_pools) {
        more = true;
        break;
      }
      page.push_back(it->second);
    }
  }
  // Views outside the manager's lock: each takes its pool's state lock.
  PoolPage out{.more = more};
  out.pools.reserve(page.size());
  for (const std::shared_ptr<Pool>& pool : page) out.pools.push_back(pool->View());
  return out;
}

absl::StatusOr<uint64_t> PoolManager::DeletePool(const Caller& caller, absl::string_view name, bool force,
                                                 PauseOptions pause) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu);
  KVD_RETURN_IF_ERROR(pool->CheckDeletable(force));
  if (force) {
    KVD_RETURN_IF_ERROR(QuiesceLocked(*pool, caller.session, "deleting", pool->Leaving(0),
                                      ReleaseOptions{.force = true, .pause = pause}));
  }
  const uint64_t bytes = pool->View(ViewClients::kCounted).committed_bytes;
  {
    absl::MutexLock lock(&mu_);
    ErasePoolLocked(*pool);
  }
  Destroy(*pool, EventType::kPoolDeleted, caller.session);
  return bytes;
}

absl::Status PoolManager::QuiesceLocked(Pool& pool, absl::string_view session, absl::string_view what,
                                        const std::vector<ChunkInfo>& leaving, const ReleaseOptions& options) {
  if (leaving.empty()) return absl::OkStatus();
  Pool::Bystanders bystanders = pool.BystandersOf(session);
  if (!bystanders.unpausable.empty() && !options.force) {
    const ClientView& c = bystanders.unpausable.front();
    const size_t more = bystanders.unpausable.size() - 1;
    return absl::FailedPreconditionError(absl::StrCat(
        "pool ", pool.name(), ": ", what, " takes memory that client ", c.id, " (\"", c.name, "\", pid ", c.pid, ")",
        more > 0 ? absl::StrCat(" and ", more, " more") : "",
        " maps, which is not pausable (AttachRequest.pausable) and would fault if it touched it: detach it, attach "
        "it pausable, or force the release (its memory then stays mapped, and counted, until it detaches)"));
  }
  if (bystanders.pausable.empty()) return absl::OkStatus();
  const absl::Duration timeout =
      options.pause.timeout > absl::ZeroDuration() ? options.pause.timeout : options_.pause_timeout;
  if (pool.BeginPause({}, &bystanders.pausable, MergeChunkRanges(leaving)) == 0) return absl::OkStatus();
  const Pool::PauseOutcome outcome = pool.AwaitPause(absl::Now() + timeout);
  std::vector<std::string> detached;
  absl::Status settled =
      SettleLatePause(pool, what, outcome, timeout, options.force || options.pause.detach_unresponsive, &detached);
  if (!settled.ok()) pool.CancelPause();
  return settled;
}

absl::Status PoolManager::SettleLatePause(Pool& pool, absl::string_view what, const Pool::PauseOutcome& outcome,
                                          absl::Duration timeout, bool detach, std::vector<std::string>* detached) {
  const std::vector<ClientView>& late = outcome.late;
  if (!late.empty() && !detach) {
    const ClientView& c = late.front();
    return absl::DeadlineExceededError(
        absl::StrCat("pool ", pool.name(), ": ", what, " paused its clients, but client ", c.id, " (\"", c.name,
                     "\", pid ", c.pid, ")", late.size() > 1 ? absl::StrCat(" and ", late.size() - 1, " more") : "",
                     " did not acknowledge the pause within ", absl::FormatDuration(timeout),
                     "; nothing changed (PauseOptions.detach_unresponsive detaches such clients instead; so does force "
                     "for a release of whole chunks)"));
  }
  for (const ClientView& c : late) {
    pool.DetachUnresponsive(c.id);
    if (!pool.IsHolder(c.id)) ForgetClients({c.id});
    detached->push_back(c.id);
    Warn(absl::StrCat("pool ", pool.name(), ": ", what, ": detached client ", c.id, " (pid ", c.pid,
                      ") for not acknowledging a pause within ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

void PoolManager::Destroy(Pool& pool, EventType why, absl::string_view session) {
  if (const std::string held = pool.View(ViewClients::kCounted).transaction; !held.empty()) {
    transactions_.Remove(held, why == EventType::kPoolDeleted ? "its pool was deleted" : "kvd is shutting down");
  }
  const bool forget = why != EventType::kDaemonRestarting;
  if (forget) Forget(pool);
  std::vector<ChunkRecord> chunks;
  Pool::Held held;
  const bool deleted = why == EventType::kPoolDeleted;
  const std::vector<std::string> gone = pool.Destroy(why, &chunks, deleted ? &held : nullptr, session,
                                                     /*forced=*/deleted);
  // Held before the clients stop being findable, so that a Detach with `released` always finds one or the
  // other (one found in between waits for op_mu: see Detach).
  if (deleted && held.bytes > 0) {
    absl::MutexLock lock(&mu_);
    orphaned_.push_back({.pool = pool.name(), .held = std::move(held)});
  }
  ForgetClients(gone);
  for (ChunkRecord& r : chunks) {
    if (forget) store_->DropChunkFd(r.info.id);
    DiscardChunk(pool.base(), r);
  }
  if (pool.base() != 0) device_->Free(pool.base(), pool.geometry().reserved_bytes()).IgnoreError();
  pool.set_base(0);
}

// ---------------------------------------------------------------------------------------------
// Attach, detach, watch, acknowledge

absl::StatusOr<AttachResult> PoolManager::Attach(const Caller& caller, absl::string_view pool_name,
                                                 absl::string_view client_name, absl::string_view device_uuid,
                                                 bool pausable) {
  if (!client_name.empty()) KVD_RETURN_IF_ERROR(ValidateName(client_name, "client_name"));
  const bool peer = !device_uuid.empty() && device_uuid != device_info_.uuid;
  if (peer) KVD_RETURN_IF_ERROR(ValidateDeviceUuid(device_uuid, "device_uuid", false));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, pool_name));
  absl::MutexLock op(&pool->op_mu);
  absl::StatusOr<AttachResult> attached =
      pool->Attach(caller, client_name, peer ? device_uuid : absl::string_view(), pausable, sessions_);
  if (!attached.ok()) return Refused(attached.status());
  AttachResult result = *std::move(attached);
  absl::MutexLock lock(&mu_);
  client_pools_[result.client_id] = pool->name();
  return result;
}

absl::Status PoolManager::Detach(const Caller& caller, absl::string_view client_id, bool released) {
  // A client of a deleted pool declaring that it let go of the pool's memory.
  auto let_go = [&]() -> bool {
    uint64_t freed = 0;
    bool found = false;
    {
      absl::MutexLock lock(&mu_);
      found = released && LetGoLocked(caller.session, client_id, &freed);
    }
    budget_.Give(freed);
    return found;
  };
  absl::StatusOr<std::shared_ptr<Pool>> found = FindClient(client_id);
  if (!found.ok()) return let_go() ? absl::OkStatus() : found.status();
  std::shared_ptr<Pool> pool = *std::move(found);
  if (absl::Status detached = pool->Detach(caller, client_id, released); !detached.ok()) {
    // Its pool is being deleted (the client was told before the delete finished): once the delete is done
    // (it holds op_mu), what the client held is an orphan to let go of.
    if (!released || !pool->deleted()) return detached;
    { absl::MutexLock op(&pool->op_mu); }
    return let_go() ? absl::OkStatus() : detached;
  }
  // A detached client that still holds chunks stays findable, so that it can acknowledge releases.
  if (!pool->IsHolder(client_id)) ForgetClients({std::string(client_id)});
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<EventQueue>> PoolManager::Watch(const Caller& caller, absl::string_view client_id) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindClient(client_id));
  return pool->Watch(caller, client_id);
}

absl::StatusOr<uint64_t> PoolManager::Acknowledge(const Caller& caller, absl::string_view client_id,
                                                  uint64_t release_id) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindClient(client_id));
  return pool->Acknowledge(caller, client_id, release_id);
}

absl::Status PoolManager::AcknowledgePause(const Caller& caller, absl::string_view client_id, uint64_t pause_id) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindClient(client_id));
  return pool->AcknowledgePause(caller, client_id, pause_id);
}

// ---------------------------------------------------------------------------------------------
// The resize state machine: grow, shrink, sleep, wake, plain or in two phases

absl::StatusOr<Change> PoolManager::PrepareLocked(Pool& pool, GroupOp op, uint64_t target_blocks,
                                                  absl::string_view session, const ReleaseOptions& release) {
  KVD_ASSIGN_OR_RETURN(Change change, pool.Check(op, target_blocks));
  if ((op == GroupOp::kGrow || op == GroupOp::kWake) && change.target_blocks > 0) {
    KVD_ASSIGN_OR_RETURN(change.staged, Stage(pool, change.target_blocks));
  }
  if (op == GroupOp::kShrink || op == GroupOp::kSleep) {
    const uint64_t prefix = op == GroupOp::kSleep ? 0 : pool.geometry().PrefixBytes(target_blocks);
    KVD_RETURN_IF_ERROR(QuiesceLocked(
        pool, session, op == GroupOp::kSleep ? "sleeping" : absl::StrCat("shrinking to ", target_blocks, " blocks"),
        pool.Leaving(prefix), release));
    change.forced = release.force;
  }
  return change;
}

PoolUpdate PoolManager::CommitLocked(Pool& pool, Change change, absl::string_view session, absl::Time start) {
  std::vector<ChunkRecord> released;
  const GroupOp op = change.op;
  const uint64_t target_blocks = change.target_blocks;
  const size_t chunks_before = pool.View(ViewClients::kCounted).chunks.size();
  PoolUpdate update = pool.Apply(std::move(change), session, &released);
  if (op == GroupOp::kShrink) {
    // Whole chunks only: say whether that reached the target.
    const Geometry& g = pool.geometry();
    update.reshape =
        ReshapeReport{.chunks_before = static_cast<uint32_t>(chunks_before),
                      .chunks_after = static_cast<uint32_t>(update.pool.chunks.size()),
                      .target_reached = update.pool.committed_bytes == g.CommittedBytes(g.PrefixBytes(target_blocks))};
  }
  Save(pool);
  // The daemon's own references go now; clients' mappings keep the memory until they acknowledge.
  for (ChunkRecord& r : released) {
    store_->DropChunkFd(r.info.id);
    DiscardChunk(pool.base(), r);
  }
  update.elapsed = absl::Now() - start;
  return update;
}

absl::StatusOr<PoolUpdate> PoolManager::Resize(const Caller& caller, const std::shared_ptr<Pool>& pool, GroupOp op,
                                               uint64_t target_blocks, bool wait, absl::Time deadline,
                                               const ReleaseOptions& release) {
  PoolUpdate update;
  {
    absl::MutexLock lock(&pool->op_mu);
    const absl::Time start = absl::Now();
    KVD_ASSIGN_OR_RETURN(Change change, PrepareLocked(*pool, op, target_blocks, caller.session, release));
    update = CommitLocked(*pool, std::move(change), caller.session, start);
  }
  if (wait && update.release_id != 0) {
    pool->AwaitRelease(update.release_id, deadline);
    update.pool = pool->View(ViewClients::kCounted);
  }
  return update;
}

absl::StatusOr<PoolUpdate> PoolManager::Grow(const Caller& caller, absl::string_view name, uint64_t target_blocks) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  KVD_ASSIGN_OR_RETURN(PoolUpdate update,
                       Resize(caller, pool, GroupOp::kGrow, target_blocks, false, absl::InfinitePast()));
  CompactLaterIfFragmented(update.pool);
  return update;
}

absl::StatusOr<PoolUpdate> PoolManager::Shrink(const Caller& caller, absl::string_view name, uint64_t target_blocks,
                                               bool wait, absl::Time deadline) {
  return Shrink(caller, name, target_blocks, ShrinkOptions{.wait = wait, .deadline = deadline});
}

absl::StatusOr<std::vector<PoolUpdate>> PoolManager::Sleep(const Caller& caller, absl::string_view name, bool wait,
                                                           absl::Time deadline, const ReleaseOptions& release) {
  std::vector<PoolUpdate> updates;
  if (!name.empty()) {
    KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
    KVD_ASSIGN_OR_RETURN(PoolUpdate update, Resize(caller, pool, GroupOp::kSleep, 0, wait, deadline, release));
    updates.push_back(std::move(update));
    return updates;
  }
  // --all: every awake pool the caller may change. Releases are started on every pool first, then
  // awaited together. A pool that went to sleep or away meanwhile is skipped.
  std::vector<std::shared_ptr<Pool>> slept;
  for (const std::shared_ptr<Pool>& pool : Snapshot()) {
    if (!pool->Allows(caller.uid) || pool->state() != PoolState::kAwake) continue;
    absl::StatusOr<PoolUpdate> update = Resize(caller, pool, GroupOp::kSleep, 0, false, deadline, release);
    if (!update.ok()) {
      // Gone or asleep meanwhile: skipped. Any other refusal (a client that is not pausable) stops here, the
      // pools before it asleep.
      if (absl::IsNotFound(update.status()) || pool->deleted() || pool->state() != PoolState::kAwake) continue;
      return update.status();
    }
    updates.push_back(*std::move(update));
    slept.push_back(pool);
  }
  if (wait) {
    for (size_t i = 0; i < updates.size(); ++i) {
      slept[i]->AwaitRelease(updates[i].release_id, deadline);
      updates[i].pool = slept[i]->View(ViewClients::kCounted);
    }
  }
  return updates;
}

absl::StatusOr<std::vector<PoolUpdate>> PoolManager::Wake(const Caller& caller, absl::string_view name) {
  std::vector<PoolUpdate> updates;
  if (!name.empty()) {
    KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
    KVD_ASSIGN_OR_RETURN(PoolUpdate update, Resize(caller, pool, GroupOp::kWake, 0, false, absl::InfinitePast()));
    updates.push_back(std::move(update));
    return updates;
  }
  // --all: on failure the pools woken so far stay awake and the failing one stays asleep.
  for (const std::shared_ptr<Pool>& pool : Snapshot()) {
    if (!pool->Allows(caller.uid) || pool->state() != PoolState::kSleeping) continue;
    absl::StatusOr<PoolUpdate> update = Resize(caller, pool, GroupOp::kWake, 0, false, absl::InfinitePast());
    if (!update.ok()) {
      if (absl::IsNotFound(update.status()) || absl::IsFailedPrecondition(update.status())) continue;
      return update.status();
    }
    updates.push_back(*std::move(update));
  }
  return updates;
}

// ---------------------------------------------------------------------------------------------
// Reshaping: see Note [Chunks are replaced, not cut] in docs/architecture.md.

absl::StatusOr<PoolManager::StepRoom> PoolManager::Room() const {
  KVD_ASSIGN_OR_RETURN(DeviceInfo info, device_->Info());
  const uint64_t committed = budget_.committed();
  StepRoom room{.budget_free = committed < budget_.limit() ? budget_.limit() - committed : 0,
                .device_free = info.free_bytes,
                .margin = std::max<uint64_t>(kReshapeDeviceMargin, device_->granularity())};
  room.bytes = std::min(room.budget_free, room.device_free > room.margin ? room.device_free - room.margin : 0);
  return room;
}

absl::Status PoolManager::NoRoom(const Pool& pool, absl::string_view what, uint64_t needed, absl::string_view for_what,
                                 const StepRoom& room, uint64_t freed_first) const {
  return absl::ResourceExhaustedError(
      absl::StrCat("pool ", pool.name(), ": ", what, " needs ", needed, " bytes (", FormatBytes(needed), ") free for ",
                   for_what, " while the chunks it replaces still hold theirs, but only ", room.budget_free, " bytes (",
                   FormatBytes(room.budget_free), ") of the daemon's budget of ", FormatBytes(budget_.limit()),
                   " are free and the device has ", room.device_free, " bytes (", FormatBytes(room.device_free),
                   ") free, less ", room.margin, " bytes (", FormatBytes(room.margin), ") kept for its own use",
                   freed_first > 0 ? absl::StrCat(", even with the ", freed_first, " bytes (", FormatBytes(freed_first),
                                                  ") of the whole chunks past the target released first")
                                   : ""));
}

namespace {

// Adds one step of a reshape in steps to the sum of those before: chunks_before is the first step's,
// chunks_after, the clients and the release the last one's, the rest summed (max_pause the longest).
void AddStep(std::optional<PoolUpdate>& total, PoolUpdate step) {
  if (!total.has_value()) {
    total = std::move(step);
    return;
  }
  ReshapeReport& sum = *total->reshape;
  const ReshapeReport& r = *step.reshape;
  sum.chunks_after = r.chunks_after;
  sum.chunks_replaced += r.chunks_replaced;
  sum.chunks_added += r.chunks_added;
  sum.copied_bytes += r.copied_bytes;
  sum.copy += r.copy;
  sum.paused_clients = r.paused_clients;
  sum.pause += r.pause;
  sum.max_pause = std::max(sum.max_pause, r.max_pause);
  sum.resumed_clients = r.resumed_clients;
  sum.detached_client_ids.insert(sum.detached_client_ids.end(), r.detached_client_ids.begin(),
                                 r.detached_client_ids.end());
  sum.moved_blocks.insert(sum.moved_blocks.end(), r.moved_blocks.begin(), r.moved_blocks.end());
  sum.target_reached = sum.target_reached && r.target_reached;
  sum.steps += r.steps;
  total->pool = std::move(step.pool);
  total->added.insert(total->added.end(), step.added.begin(), step.added.end());
  total->released_chunk_ids.insert(total->released_chunk_ids.end(), step.released_chunk_ids.begin(),
                                   step.released_chunk_ids.end());
  total->release_id = step.release_id;
}

// A step's error once steps before it changed the pool: they stay done, and the error says so.
absl::Status StepsStayDone(const absl::Status& failed, absl::string_view kind, uint32_t steps, size_t chunks_before,
                           size_t chunks_now, absl::string_view go_on) {
  return absl::Status(failed.code(),
                      absl::StrCat(failed.message(), "; what the ", kind, " steps before it did stays done (", steps,
                                   " of them: ", chunks_before, " -> ", chunks_now, " chunks): ", go_on));
}

}  // namespace

absl::StatusOr<PoolUpdate> PoolManager::Shrink(const Caller& caller, absl::string_view name, uint64_t target_blocks,
                                               const ShrinkOptions& options) {
  if (options.live.has_value()) {
    KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("live.blocks", options.live->size(), caller.uid, options_.limits)));
  }
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  const absl::Time start = absl::Now();
  const absl::Duration timeout =
      options.pause.timeout > absl::ZeroDuration() ? options.pause.timeout : options_.pause_timeout;
  PoolUpdate update;
  absl::Time paused_at = absl::InfinitePast();
  std::set<std::string> paused;
  OldView old;
  std::optional<std::vector<uint64_t>> stepped;  // an exact shrink in steps: the releases of its steps
  {
    absl::MutexLock lock(&pool->op_mu);
    KVD_ASSIGN_OR_RETURN(ReshapePlan plan, pool->PlanShrink(target_blocks, options.whole_chunks_only, options.live));
    if (!plan.moves_bytes()) {
      // Whole chunks go and nothing moves: the plain resize, which needs no pause.
      KVD_ASSIGN_OR_RETURN(Change change,
                           PrepareLocked(*pool, GroupOp::kShrink, target_blocks, caller.session,
                                         ReleaseOptions{.force = options.force, .pause = options.pause}));
      update = CommitLocked(*pool, std::move(change), caller.session, start);
    } else {
      KVD_ASSIGN_OR_RETURN(StepRoom room, Room());
      uint64_t bytes = 0;
      for (const PlannedChunk& p : plan.added) bytes += p.bytes;
      if (bytes > room.bytes) {
        // Not in one step: see Note [Chunks are replaced, not cut] in docs/architecture.md.
        stepped.emplace();
        KVD_ASSIGN_OR_RETURN(
            update, ShrinkInStepsLocked(*pool, caller.session, target_blocks, options, plan, room, start, &*stepped));
      } else {
        KVD_ASSIGN_OR_RETURN(
            update, ReshapeLocked(*pool, plan, options.pause, absl::StrCat("shrinking to ", target_blocks, " blocks"),
                                  &paused_at, &paused, &old, nullptr));
      }
    }
  }
  if (stepped.has_value()) {
    // Each step was finished under op_mu; with wait, every step's release is awaited.
    if (options.wait) {
      for (uint64_t id : *stepped) pool->AwaitRelease(id, options.deadline);
      if (!stepped->empty()) update.pool = pool->View(ViewClients::kCounted);
    }
    update.elapsed = absl::Now() - start;
    return update;
  }
  // Replied once the paused clients resumed (so that the caller's own Mapping has remapped), at most a
  // pause timeout later; with wait, once every release is acknowledged or the caller's deadline passed.
  FinishReshape(*pool, update, paused_at, paused, absl::Now() + timeout,
                options.wait ? std::optional<absl::Time>(options.deadline) : std::nullopt, start);
  TakeDown(old);
  if (update.reshape.has_value() && update.reshape->steps > 0) ObserveStep(*update.reshape);
  return update;
}

absl::StatusOr<PoolUpdate> PoolManager::ShrinkInStepsLocked(Pool& pool, absl::string_view session,
                                                            uint64_t target_blocks, const ShrinkOptions& options,
                                                            const ReshapePlan& whole, const StepRoom& room,
                                                            absl::Time start, std::vector<uint64_t>* releases) {
  const std::string what = absl::StrCat("shrinking to ", target_blocks, " blocks");
  const absl::Duration timeout =
      options.pause.timeout > absl::ZeroDuration() ? options.pause.timeout : options_.pause_timeout;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return Stopping();
  }
  KVD_RETURN_IF_ERROR(pool.CheckPausable(what));
  // Nothing changed yet: refuse unless the largest replacement (one segment's) fits once the whole chunks
  // past the target are released. Free memory only grows from step to step (each gives back at least
  // what it takes), so every later step fits one too unless someone else takes the memory meanwhile.
  uint64_t largest = 0, all = 0;
  for (const PlannedChunk& p : whole.added) {
    largest = std::max(largest, p.bytes);
    all += p.bytes;
  }
  if (largest > room.bytes + whole.release_first_bytes) {
    return NoRoom(pool, what, largest,
                  absl::StrCat("the new chunk of one segment (", all, " bytes for all ", whole.added.size(), ")"), room,
                  whole.release_first_bytes);
  }

  // First the whole chunks at or past a boundary every segment shares: a plain release (the clients of other
  // sessions paused for it first: Note [Releases pause first]), whose memory is free for the steps once the
  // clients that map it acknowledged.
  std::vector<uint64_t> released_first;
  if (whole.release_first_bytes > 0) {
    KVD_RETURN_IF_ERROR(QuiesceLocked(pool, session, what, pool.Leaving(whole.release_first_from),
                                      ReleaseOptions{.pause = options.pause}));
    std::vector<ChunkRecord> released;
    PoolUpdate freed = pool.ReleaseFrom(whole.release_first_from, &released, session);
    Save(pool);
    for (ChunkRecord& r : released) {
      store_->DropChunkFd(r.info.id);
      DiscardChunk(pool.base(), r);
    }
    if (freed.release_id != 0) {
      releases->push_back(freed.release_id);
      pool.AwaitRelease(freed.release_id, absl::Now() + timeout);
    }
    released_first = std::move(freed.released_chunk_ids);
  }

  // Then the straddling chunks, as many segments' a step as the free memory holds. The first step also
  // releases every chunk past the target and moves the live blocks; from it on the prefix is the target's
  // and the segments not yet replaced keep tails past it (the invariants in pool.h) until a later step.
  std::optional<PoolUpdate> total;
  OldView spare;  // the view the step before left, to be the next one (ReshapeLocked)
  absl::Cleanup take_down_spare = [&] { TakeDown(spare); };
  for (bool first = true;; first = false) {
    absl::Time paused_at = absl::InfinitePast();
    std::set<std::string> paused;
    OldView old;
    const absl::Time step_start = absl::Now();
    absl::StatusOr<PoolUpdate> made;
    // What is left first (after the first step: no tail left, done), then what of it fits now.
    absl::StatusOr<ReshapePlan> rest =
        first ? pool.PlanShrink(target_blocks, false, options.live) : pool.PlanTails(std::nullopt);
    absl::Status failed = rest.status();
    if (failed.ok() && !first && !rest->moves_bytes()) break;
    absl::StatusOr<StepRoom> now = failed.ok() ? Room() : absl::StatusOr<StepRoom>(failed);
    failed = now.status();
    if (failed.ok()) {
      absl::StatusOr<ReshapePlan> plan =
          first ? pool.PlanShrink(target_blocks, false, options.live, now->bytes) : pool.PlanTails(now->bytes);
      failed = plan.status();
      if (failed.ok() && plan->added.empty()) {
        // Memory not given back yet (a client slow to acknowledge), or taken by others meanwhile.
        failed = NoRoom(pool, what, rest->added.empty() ? 0 : rest->added.front().bytes, "the new chunk of one segment",
                        *now, 0);
      }
      if (failed.ok()) {
        made = ReshapeLocked(pool, *plan, options.pause, what, &paused_at, &paused, &old, &spare);
        failed = made.status();
      }
    }
    if (!failed.ok()) {
      if (!total.has_value() && released_first.empty()) return failed;
      const size_t chunks_now = pool.View(ViewClients::kCounted).chunks.size();
      return StepsStayDone(
          failed, "shrink", total.has_value() ? total->reshape->steps : 0, whole.chunks_before, chunks_now,
          total.has_value()
              ? "the pool has the target's blocks committed, but the chunks of the segments not yet replaced still "
                "run past them: Compact the pool (or shrink it exactly again) to replace them"
              : "whole chunks past the target were released first; shrink again to go on");
    }
    PoolUpdate update = *std::move(made);
    FinishReshape(pool, update, paused_at, paused, absl::Now() + timeout, std::nullopt, step_start);
    if (update.release_id != 0) releases->push_back(update.release_id);
    KeepForNextStep(old, update.pool, spare);
    ObserveStep(*update.reshape);
    AddStep(total, std::move(update));
  }
  total->reshape->chunks_before = whole.chunks_before;
  total->released_chunk_ids.insert(total->released_chunk_ids.begin(), released_first.begin(), released_first.end());
  std::set<uint64_t> now;
  for (const ChunkInfo& c : total->pool.chunks) now.insert(c.id);
  std::erase_if(total->added, [&](const ChunkInfo& c) { return !now.contains(c.id); });
  total->elapsed = absl::Now() - start;
  return *std::move(total);
}

absl::StatusOr<PoolUpdate> PoolManager::Compact(const Caller& caller, absl::string_view name,
                                                const CompactOptions& options) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  const absl::Time start = absl::Now();
  const absl::Duration timeout =
      options.pause.timeout > absl::ZeroDuration() ? options.pause.timeout : options_.pause_timeout;
  const size_t per_pause =
      options.max_chunks_per_pause > 0 ? options.max_chunks_per_pause : options_.compact_chunks_per_pause;
  // Each step: plan the next new chunks (at most per_pause old ones replaced with clients to pause, and
  // no more bytes than are free), reshape under op_mu, let the clients resume without it. Planned afresh
  // each time, from the memory the step before gave back, so that a grow between steps is compacted too.
  std::optional<PoolUpdate> total;
  OldView spare;  // the view the step before left, to be the next one (ReshapeLocked)
  absl::Cleanup take_down_spare = [&] { TakeDown(spare); };
  for (;;) {
    PoolUpdate update;
    absl::Time paused_at = absl::InfinitePast();
    std::set<std::string> paused;
    OldView old;
    const absl::Time step_start = absl::Now();
    {
      absl::MutexLock lock(&pool->op_mu);
      // With nobody attached the daemon is the only mapper: a new chunk that does not fit may be made of
      // runs of the old ones that do (fewer chunks, if not one a segment).
      const bool alone = pool->View(ViewClients::kCounted).client_count == 0;
      // What is left to do first (nothing: in shape), then what of it fits now: no look at the device
      // once the work is done.
      absl::StatusOr<ReshapePlan> rest = pool->PlanCompact(options_.max_chunk_bytes, std::nullopt);
      absl::Status failed = rest.status();
      if (failed.ok() && !rest->moves_bytes()) {
        if (!total.has_value()) {  // already in shape
          total.emplace();
          total->pool = pool->View(ViewClients::kCounted);
          total->reshape = ReshapeReport{.chunks_before = rest->chunks_before,
                                         .chunks_after = static_cast<uint32_t>(total->pool.chunks.size()),
                                         .target_reached = true};
        }
        break;
      }
      absl::StatusOr<StepRoom> room = failed.ok() ? Room() : absl::StatusOr<StepRoom>(failed);
      failed = room.status();
      absl::StatusOr<ReshapePlan> plan = ReshapePlan{};
      if (failed.ok()) {
        plan = pool->PlanCompact(options_.max_chunk_bytes, alone ? std::nullopt : std::optional<size_t>(per_pause),
                                 room->bytes, /*smaller=*/alone);
        failed = plan.status();
      }
      if (failed.ok() && !plan->moves_bytes()) {
        // The next new chunk does not fit; after smaller ones, that is as far as the free memory goes.
        if (total.has_value() && !total->reshape->target_reached) break;
        failed = NoRoom(*pool, "compacting", rest->added.front().bytes,
                        alone ? "a new chunk of at least two old ones" : "its next new chunk", *room, 0);
      }
      if (failed.ok() && total.has_value()) {
        if (absl::Now() >= options.interrupt.deadline) {
          failed = absl::DeadlineExceededError(absl::StrCat("pool ", name, ": the deadline of the call passed"));
        } else if (options.interrupt.cancelled && options.interrupt.cancelled()) {
          failed = absl::CancelledError(absl::StrCat("pool ", name, ": the caller cancelled the call"));
        }
      }
      if (failed.ok()) {
        absl::StatusOr<PoolUpdate> made =
            ReshapeLocked(*pool, *plan, options.pause, "compacting", &paused_at, &paused, &old, &spare);
        failed = made.status();
        if (made.ok()) update = *std::move(made);
      }
      if (!failed.ok()) {
        if (!total.has_value()) return failed;
        // The steps before stay done: the pool is whole, only less fragmented than asked.
        return StepsStayDone(failed, "compaction", total->reshape->steps, total->reshape->chunks_before,
                             pool->View(ViewClients::kCounted).chunks.size(), "Compact again to go on");
      }
    }
    FinishReshape(*pool, update, paused_at, paused, absl::Now() + timeout, std::nullopt, step_start);
    KeepForNextStep(old, update.pool, spare);
    ObserveStep(*update.reshape);
    AddStep(total, std::move(update));
  }
  // A later step may have replaced a chunk an earlier one added (a grow between them moved the last
  // chunk's end): `added` names only the new chunks in the table.
  std::set<uint64_t> now;
  for (const ChunkInfo& c : total->pool.chunks) now.insert(c.id);
  std::erase_if(total->added, [&](const ChunkInfo& c) { return !now.contains(c.id); });
  total->elapsed = absl::Now() - start;
  return *std::move(total);
}

void PoolManager::Observe(Observers observers) {
  absl::MutexLock lock(&observer_mu_);
  observers_ = std::move(observers);
  if (observers_.state_degraded) observers_.state_degraded(state_degraded_.load(std::memory_order_acquire));
}

void PoolManager::ObserveStep(const ReshapeReport& step) {
  absl::MutexLock lock(&observer_mu_);
  if (observers_.reshape_step) observers_.reshape_step(step);
}

absl::StatusOr<PoolUpdate> PoolManager::ReshapeLocked(Pool& pool, const ReshapePlan& plan, const PauseOptions& pause,
                                                      absl::string_view what, absl::Time* paused_at,
                                                      std::set<std::string>* paused, OldView* teardown,
                                                      OldView* spare) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return Stopping();
  }
  KVD_RETURN_IF_ERROR(pool.CheckPausable(what));
  const absl::Duration timeout = pause.timeout > absl::ZeroDuration() ? pause.timeout : options_.pause_timeout;
  ReshapeReport report{.chunks_before = plan.chunks_before,
                       .chunks_replaced = static_cast<uint32_t>(plan.replaced.size()),
                       .chunks_added = static_cast<uint32_t>(plan.added.size()),
                       .moved_blocks = plan.moves,
                       .target_reached = plan.target_reached,
                       .steps = 1};

  // The new chunks hold their bytes before the old ones give theirs back.
  uint64_t bytes = 0;
  for (const PlannedChunk& p : plan.added) bytes += p.bytes;
  if (uint64_t free = 0; !budget_.TryTake(bytes, &free)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pool ", pool.name(), ": ", what, " needs ", bytes, " bytes (", FormatBytes(bytes),
                     ") for new chunks while the chunks they replace still hold theirs, but only ", free, " bytes (",
                     FormatBytes(free), ") of the daemon's budget of ", FormatBytes(budget_.limit()), " are free"));
  }
  absl::Cleanup give_back = [&] { budget_.Give(bytes); };

  std::set<uint64_t> leaving(plan.replaced.begin(), plan.replaced.end());
  leaving.insert(plan.released.begin(), plan.released.end());
  std::vector<uint64_t> staying_ids;
  const PoolView now = pool.View(ViewClients::kCounted);
  std::vector<ChunkInfo> mapped = now.chunks;
  for (const ChunkInfo& c : mapped) {
    if (!leaving.contains(c.id)) staying_ids.push_back(c.id);
  }

  // The daemon's next view of the pool: a reservation of the pool's size where the new chunks are made and
  // the chunks that stay are mapped again. After the copy the daemon switches its base to it, instead of
  // unmapping and mapping chunk by chunk while the clients wait (its base is its own; clients map at
  // theirs). The old view is taken down after the clients resumed (FinishReshape's caller), or handed
  // back in `*spare` for the next step of a compaction, which brings it up to date (Recycle) rather than
  // mapping every chunk of the pool again.
  const uint64_t reserved = pool.geometry().reserved_bytes();
  std::set<uint64_t> in_view;  // staying chunks `next` already maps
  uint64_t next = 0;
  if (spare != nullptr && spare->base != 0) {
    // Only a view of the table as this pool has it now: no other change came between the steps.
    if (spare->generation == now.generation && spare->bytes == reserved &&
        Recycle(*spare, std::set<uint64_t>(staying_ids.begin(), staying_ids.end()))) {
      next = spare->base;
      for (const ChunkInfo& c : spare->mapped) in_view.insert(c.id);
      *spare = OldView{};
    } else {
      TakeDown(*spare);
    }
  }
  if (next == 0) {
    KVD_ASSIGN_OR_RETURN(next, device_->Reserve(reserved));
  }
  absl::Cleanup free_next = [&] { device_->Free(next, reserved).IgnoreError(); };
  std::vector<ChunkRecord> added;
  {
    absl::StatusOr<std::vector<ChunkRecord>> made = MakeChunks(next, plan.added);
    if (!made.ok()) {
      if (absl::IsResourceExhausted(made.status()) && !IsOutOfFileDescriptors(made.status())) {
        absl::StatusOr<DeviceInfo> info = device_->Info();
        return absl::ResourceExhaustedError(absl::StrCat("pool ", pool.name(), ": ", what, " needs ", bytes, " bytes (",
                                                         FormatBytes(bytes), ") of new chunks but the device has ",
                                                         info.ok() ? info->free_bytes : 0,
                                                         " bytes free: ", made.status().message()));
      }
      return made.status();
    }
    added = *std::move(made);
  }
  bool fds_kept = false;
  // Until applied, the new chunks are the daemon's alone: a failure unmaps and releases them.
  absl::Cleanup discard = [&] {
    for (ChunkRecord& r : added) {
      if (fds_kept) store_->DropChunkFd(r.info.id);
      DiscardChunk(next, r);
    }
  };
  KVD_RETURN_IF_ERROR(KeepFds(added));
  fds_kept = true;
  const std::vector<ChunkRecord*> staying = pool.ChunksById(staying_ids);
  size_t remapped = 0;
  absl::Cleanup unmap_staying = [&] {
    for (size_t i = 0; i < staying.size(); ++i) {
      if (i >= remapped && !in_view.contains(staying[i]->info.id)) continue;
      device_->Unmap(next + staying[i]->info.offset, staying[i]->info.bytes).IgnoreError();
    }
  };
  for (; remapped < staying.size(); ++remapped) {
    const ChunkRecord& r = *staying[remapped];
    if (in_view.contains(r.info.id)) continue;
    KVD_RETURN_IF_ERROR(device_->Map(next + r.info.offset, r.chunk, Access::kReadWrite));
  }

  // The pause: every attached client imports the new chunks and stops touching the pool.
  const size_t asked = pool.BeginPause(added);
  absl::Cleanup resume = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu) { pool.CancelPause(); };
  if (asked > 0) {
    Pool::PauseOutcome outcome = pool.AwaitPause(absl::Now() + timeout);
    KVD_RETURN_IF_ERROR(
        SettleLatePause(pool, what, outcome, timeout, pause.detach_unresponsive, &report.detached_client_ids));
    report.paused_clients = static_cast<uint32_t>(outcome.paused.size());
    *paused = std::move(outcome.paused);
  }
  *paused_at = absl::Now();

  // The copies: live blocks first (they may land in a chunk that is replaced next), then every new chunk
  // from the bytes now at its place in the current view.
  const absl::Time copy_start = absl::Now();
  if (!plan.moves.empty()) {
    KVD_ASSIGN_OR_RETURN(BlockSpan span, pool.AwakeSpan());
    KVD_RETURN_IF_ERROR(device_->CopyBlocks(span, plan.moves));
  }
  const uint64_t base = pool.base();
  for (const PlannedChunk& p : plan.added) {
    KVD_RETURN_IF_ERROR(device_->CopyRange(next + p.offset, base + p.offset, p.bytes));
    report.copied_bytes += p.bytes;
  }
  report.copy = absl::Now() - copy_start;

  // Applied: nothing below can fail. The next view becomes the daemon's.
  std::move(resume).Cancel();
  std::move(unmap_staying).Cancel();
  std::move(discard).Cancel();
  std::move(free_next).Cancel();
  std::move(give_back).Cancel();
  pool.set_base(next);
  PoolUpdate update = pool.ApplyReshape(plan, std::move(added), &teardown->chunks);
  Save(pool);
  // The record no longer names them (Note [Durable pools]); their memory goes with the old view.
  for (const ChunkRecord& r : teardown->chunks) store_->DropChunkFd(r.info.id);
  teardown->base = base;
  teardown->bytes = reserved;
  teardown->mapped = std::move(mapped);
  report.chunks_after = static_cast<uint32_t>(update.pool.chunks.size());
  update.reshape = std::move(report);
  return update;
}

bool PoolManager::Recycle(OldView& old, const std::set<uint64_t>& staying) {
  std::vector<ChunkInfo> kept;
  for (size_t i = 0; i < old.mapped.size(); ++i) {
    const ChunkInfo& c = old.mapped[i];
    if (staying.contains(c.id)) {
      kept.push_back(c);
      continue;
    }
    if (!device_->Unmap(old.base + c.offset, c.bytes).ok()) {
      // TakeDown unmaps what is still mapped: the ones kept, this one (it may be), and the rest.
      kept.insert(kept.end(), old.mapped.begin() + static_cast<ptrdiff_t>(i), old.mapped.end());
      old.mapped = std::move(kept);
      return false;
    }
  }
  old.mapped = std::move(kept);
  for (ChunkRecord& r : old.chunks) {
    device_->Release(r.chunk).IgnoreError();
    r.fd.reset();
  }
  old.chunks.clear();
  return true;
}

void PoolManager::KeepForNextStep(OldView& old, const PoolView& pool, OldView& spare) {
  std::set<uint64_t> table;
  for (const ChunkInfo& c : pool.chunks) table.insert(c.id);
  if (Recycle(old, table)) {
    old.generation = pool.generation;
    spare = std::move(old);
  } else {
    TakeDown(old);
  }
}

void PoolManager::TakeDown(OldView& old) {
  if (old.base != 0) {
    for (const ChunkInfo& c : old.mapped) device_->Unmap(old.base + c.offset, c.bytes).IgnoreError();
    device_->Free(old.base, old.bytes).IgnoreError();
  }
  for (ChunkRecord& r : old.chunks) {
    device_->Release(r.chunk).IgnoreError();
    r.fd.reset();
  }
  old = OldView{};
}

void PoolManager::CompactLaterIfFragmented(const PoolView& pool) {
  if (options_.compact_above_chunks == 0 || pool.chunks.size() <= options_.compact_above_chunks) return;
  absl::MutexLock lock(&mu_);
  if (std::find(to_compact_.begin(), to_compact_.end(), pool.name) == to_compact_.end()) {
    to_compact_.push_back(pool.name);
  }
}

void PoolManager::CompactInBackground() {
  const Caller daemon{.uid = options_.daemon_uid, .pid = getpid(), .name = "kvd"};
  for (;;) {
    std::string name;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !to_compact_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      name = std::move(to_compact_.front());
      to_compact_.pop_front();
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<PoolUpdate> compacted = Compact(daemon, name, {});
    {
      absl::MutexLock lock(&observer_mu_);
      if (observers_.background_compaction) observers_.background_compaction(absl::Now() - start, compacted.ok());
    }
    if (compacted.ok() && compacted->reshape.has_value() && compacted->reshape->chunks_added > 0) {
      const ReshapeReport& r = *compacted->reshape;
      if (options_.info) {
        options_.info(absl::StrCat("pool ", name, ": compacted on its own past ", options_.compact_above_chunks,
                                   " chunks (--compact-above-chunks): ", r.chunks_before, " -> ", r.chunks_after,
                                   " chunks, ", FormatBytes(r.copied_bytes), " copied in ", r.steps, " steps, ",
                                   r.paused_clients, " clients paused for ", absl::FormatDuration(r.pause),
                                   " (at most ", absl::FormatDuration(r.max_pause), " at a time)"));
      }
    } else if (!compacted.ok() && options_.info) {
      // A client that is not pausable, a pool deleted or put to sleep meanwhile: it stays as it is.
      options_.info(absl::StrCat("pool ", name, ": not compacted on its own: ", compacted.status().ToString()));
    }
  }
}

void PoolManager::FinishReshape(Pool& pool, PoolUpdate& update, absl::Time paused_at,
                                const std::set<std::string>& paused, absl::Time resume_deadline,
                                std::optional<absl::Time> release_deadline, absl::Time start) {
  if (!paused.empty()) {
    // Only the paused clients' RESUME acknowledgements: a detached holder of the old chunks keeps them
    // counted, but nobody waits for it here.
    const size_t still = pool.AwaitClients(update.release_id, paused, resume_deadline);
    update.reshape->resumed_clients = static_cast<uint32_t>(paused.size() - std::min(still, paused.size()));
    update.reshape->pause = absl::Now() - paused_at;
    update.reshape->max_pause = update.reshape->pause;
  }
  if (release_deadline.has_value()) pool.AwaitRelease(update.release_id, *release_deadline);
  if (update.release_id != 0) update.pool = pool.View(ViewClients::kCounted);
  update.elapsed = absl::Now() - start;
}

// ---------------------------------------------------------------------------------------------
// Engine groups: the same state machine, split at the RPC boundary

absl::StatusOr<PreparedOp> PoolManager::Prepare(const Caller& caller, absl::string_view name, GroupOp op,
                                                uint64_t target_blocks, absl::Duration ttl, bool force) {
  const absl::Time start = absl::Now();
  if ((op == GroupOp::kSleep || op == GroupOp::kWake) && target_blocks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_blocks: must be unset for ", GroupOpName(op), " (it applies to grow and shrink)"));
  }
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op_lock(&pool->op_mu);
  // A shrink or sleep pauses the pausable clients of other sessions until the commit or abort.
  KVD_ASSIGN_OR_RETURN(Change change,
                       PrepareLocked(*pool, op, target_blocks, caller.session, ReleaseOptions{.force = force}));
  const uint64_t prepared_bytes = change.staged.bytes;
  Transaction txn{.id = RandomToken("t-"),
                  .session = caller.session,
                  .pid = caller.pid,
                  .expires = absl::Now() + ttl,
                  .change = std::move(change)};
  const std::string id = txn.id;
  const absl::Time expires = txn.expires;
  if (std::optional<Transaction> refused = pool->Hold(std::move(txn), sessions_); refused.has_value()) {
    // The session closed (or the pool was deleted) while the memory was made: nobody could commit this.
    Unstage(*pool, refused->change.staged);
    if (pool->deleted()) return PoolGone(name);
    return absl::UnauthenticatedError("kvd-session: the session has closed");
  }
  transactions_.Add(id, pool->name(), expires);
  PreparedOp prepared{.transaction = id,
                      .pool = pool->View(ViewClients::kCounted),
                      .prepared_bytes = prepared_bytes,
                      .expires = expires};
  prepared.elapsed = absl::Now() - start;
  return prepared;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolManager::FindTransaction(absl::string_view transaction) const {
  KVD_ASSIGN_OR_RETURN(const std::string name, transactions_.Lookup(transaction));
  absl::MutexLock lock(&mu_);
  auto p = pools_.find(name);
  if (p == pools_.end()) {
    return absl::NotFoundError(absl::StrCat("transaction: ", transaction, " ended with its pool ", name));
  }
  return p->second;
}

uint64_t PoolManager::AbortLocked(Pool& pool, absl::string_view id, std::optional<absl::string_view> session,
                                  absl::string_view why) {
  absl::StatusOr<Transaction> txn = pool.Unhold(id, session);
  if (!txn.ok()) return 0;
  transactions_.Remove(id, why);
  const uint64_t bytes = txn->change.staged.bytes;
  Unstage(pool, txn->change.staged);
  return bytes;
}

absl::StatusOr<CommittedOp> PoolManager::Commit(const Caller& caller, absl::string_view transaction, bool wait,
                                                absl::Time deadline) {
  const absl::Time start = absl::Now();
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindTransaction(transaction));
  CommittedOp result;
  {
    absl::MutexLock op(&pool->op_mu);
    // Ended (reaper, a closed session, a forced delete) between the lookup and op_mu: Lookup says why.
    absl::StatusOr<Transaction> txn = pool->Unhold(transaction, caller.session);
    if (!txn.ok()) {
      if (absl::IsPermissionDenied(txn.status())) return txn.status();
      KVD_RETURN_IF_ERROR(transactions_.Lookup(transaction).status());
      return txn.status();
    }
    if (const absl::Duration late = absl::Now() - txn->expires; late > absl::ZeroDuration()) {
      transactions_.Remove(transaction, "not committed within its ttl");
      Unstage(*pool, txn->change.staged);
      return absl::AbortedError(absl::StrCat("transaction: ", transaction, " expired ",
                                             absl::FormatDuration(absl::Trunc(late, absl::Milliseconds(1))),
                                             " ago and was aborted; prepare again"));
    }
    transactions_.Remove(transaction, "");
    result.op = txn->change.op;
    result.update = CommitLocked(*pool, std::move(txn->change), caller.session, start);
  }
  if (wait && result.update.release_id != 0) {
    pool->AwaitRelease(result.update.release_id, deadline);
    result.update.pool = pool->View(ViewClients::kCounted);
  }
  if (result.op == GroupOp::kGrow) CompactLaterIfFragmented(result.update.pool);
  result.update.elapsed = absl::Now() - start;
  return result;
}

absl::StatusOr<uint64_t> PoolManager::Abort(const Caller& caller, absl::string_view transaction) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindTransaction(transaction));
  absl::MutexLock op(&pool->op_mu);
  absl::StatusOr<Transaction> txn = pool->Unhold(transaction, caller.session);
  if (!txn.ok()) {
    if (absl::IsPermissionDenied(txn.status())) return txn.status();
    KVD_RETURN_IF_ERROR(transactions_.Lookup(transaction).status());
    return txn.status();
  }
  transactions_.Remove(transaction, "");
  const uint64_t bytes = txn->change.staged.bytes;
  Unstage(*pool, txn->change.staged);
  return bytes;
}

void PoolManager::ReapExpired() {
  while (std::optional<std::vector<std::pair<std::string, std::string>>> expired = transactions_.AwaitExpired()) {
    for (const auto& [id, name] : *expired) {
      std::shared_ptr<Pool> pool;
      {
        absl::MutexLock lock(&mu_);
        auto p = pools_.find(name);
        if (p != pools_.end()) pool = p->second;
      }
      if (pool == nullptr) {
        transactions_.Remove(id, "its pool was deleted");
        continue;
      }
      absl::MutexLock op(&pool->op_mu);
      if (AbortLocked(*pool, id, std::nullopt, "not committed within its ttl") == 0) {
        // Committed, aborted or gone since AwaitExpired looked; make sure the reaper does not see it again.
        transactions_.Remove(id, "");
      }
    }
  }
}

absl::StatusOr<PoolView> PoolManager::GrantPeerAccess(const Caller& caller, absl::string_view name,
                                                      absl::string_view device_uuid, bool revoke) {
  KVD_RETURN_IF_ERROR(ValidateDeviceUuid(device_uuid, "device_uuid", true));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu);
  KVD_ASSIGN_OR_RETURN(PoolView view, pool->GrantPeerAccess(device_uuid, revoke));
  Save(*pool);
  return view;
}

// ---------------------------------------------------------------------------------------------
// Block operations

absl::StatusOr<TransferPlan> PoolManager::DescribeTransfer(const Caller& caller, absl::string_view name,
                                                           absl::Span<const uint64_t> block_ids) const {
  KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("block_ids", block_ids.size(), caller.uid, options_.limits)));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  const PoolView view = pool->View(ViewClients::kCounted);
  if (view.state == PoolState::kSleeping) {
    return absl::FailedPreconditionError(absl::StrCat("pool ", name, " is sleeping: it has no committed blocks"));
  }
  if (view.state == PoolState::kRecovering) {
    return absl::UnavailableError(absl::StrCat("pool ", name,
                                               " is recovering after a kvd restart: ", view.missing_chunk_ids.size(),
                                               " chunks not yet given back by the clients that map them; retry"));
  }
  TransferPlan plan;
  KVD_ASSIGN_OR_RETURN(plan.descriptors,
                       ::kvd::daemon::DescribeTransfer(view.geometry, view.committed_blocks, block_ids));
  plan.blocks = block_ids.empty() ? view.committed_blocks : block_ids.size();
  for (const TransferDescriptor& d : plan.descriptors) plan.bytes += d.bytes * d.count;
  plan.committed_blocks = view.committed_blocks;
  plan.generation = view.generation;
  return plan;
}

absl::Status PoolManager::CheckInterrupt(absl::string_view call, const Interrupt& interrupt, size_t done,
                                         size_t total) const {
  const std::string progress = absl::StrCat(" after ", done, " of ", total, " entries (those are done, the rest not)");
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError(absl::StrCat("kvd is shutting down: ", call, " stopped", progress));
  }
  // The deadline first: gRPC also cancels a call whose deadline passed.
  if (absl::Now() >= interrupt.deadline) {
    return absl::DeadlineExceededError(absl::StrCat(call, ": the deadline of the call passed", progress));
  }
  if (interrupt.cancelled && interrupt.cancelled()) {
    return absl::CancelledError(absl::StrCat(call, ": the caller cancelled the call", progress));
  }
  return absl::OkStatus();
}

size_t PoolManager::SliceEntries(const BlockSpan& span) const {
  const uint64_t per_entry = std::max<uint64_t>(1, span.segments * span.block_bytes);
  return static_cast<size_t>(std::max<uint64_t>(1, options_.block_slice_bytes / per_entry));
}

absl::Status PoolManager::ZeroBlocks(const Caller& caller, absl::string_view name, absl::Span<const uint64_t> blocks,
                                     const Interrupt& interrupt) {
  KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("block_ids", blocks.size(), caller.uid, options_.limits)));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  // Only this pool's op_mu is held across the slices: other pools, and the device's VA book that their
  // grows need, are free between slices.
  absl::MutexLock op(&pool->op_mu);
  KVD_ASSIGN_OR_RETURN(const BlockSpan span, pool->AwakeSpan());
  // Everything is checked before any work: the ids, and that none repeats (bounding the work by the
  // pool's committed blocks).
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  absl::flat_hash_map<uint64_t, size_t> first;
  first.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (auto [it, inserted] = first.try_emplace(blocks[i], i); !inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat("block_ids[", i, "]: block ", blocks[i], " repeats block_ids[", it->second, "]"));
    }
  }
  const size_t slice = SliceEntries(span);
  for (size_t done = 0; done < blocks.size(); done += slice) {
    KVD_RETURN_IF_ERROR(CheckInterrupt("ZeroBlocks", interrupt, done, blocks.size()));
    KVD_RETURN_IF_ERROR(device_->ZeroBlocks(span, blocks.subspan(done, slice)));
  }
  return absl::OkStatus();
}

absl::Status PoolManager::CopyBlocks(const Caller& caller, absl::string_view name, absl::Span<const BlockCopy> copies,
                                     const Interrupt& interrupt) {
  KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("copies", copies.size(), caller.uid, options_.limits)));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu);
  KVD_ASSIGN_OR_RETURN(const BlockSpan span, pool->AwakeSpan());
  // The whole request is checked first: no destination twice (which bounds the work by the committed
  // blocks), and none also a source, so the slices may run in any order.
  KVD_RETURN_IF_ERROR(ValidateCopies(span, copies));
  const size_t slice = SliceEntries(span);
  for (size_t done = 0; done < copies.size(); done += slice) {
    KVD_RETURN_IF_ERROR(CheckInterrupt("CopyBlocks", interrupt, done, copies.size()));
    KVD_RETURN_IF_ERROR(device_->CopyBlocks(span, copies.subspan(done, slice)));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Handle channel and shutdown

absl::StatusOr<std::vector<PoolManager::LeasedFd>> PoolManager::RedeemLease(absl::string_view session,
                                                                            absl::string_view lease_token,
                                                                            uint32_t peer_uid) {
  absl::StatusOr<Caller> owner = sessions_.Authenticate(session);
  if (!owner.ok()) return absl::UnauthenticatedError("session_token: unknown or closed session");
  if (owner->uid != peer_uid) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", peer_uid, " may not use the session of uid ", owner->uid));
  }
  KVD_ASSIGN_OR_RETURN(const LeaseRecord lease, leases_.Redeem(session, lease_token));
  std::shared_ptr<Pool> pool;
  {
    absl::MutexLock lock(&mu_);
    auto p = pools_.find(lease.pool);
    if (p != pools_.end()) pool = p->second;
  }
  if (pool == nullptr) return absl::FailedPreconditionError(absl::StrCat("pool ", lease.pool, " was deleted"));
  if (lease.ranges.empty()) return pool->DupFds(lease.client, lease.chunk_ids);
  return RedeemRanges(*pool, lease);
}

absl::StatusOr<RangeExport> PoolManager::ExportRanges(const Caller& caller, absl::string_view client_id,
                                                      const std::vector<ByteRange>& ranges) {
  if (!capabilities_.dma_buf.supported) {
    return absl::UnimplementedError(absl::StrCat("ExportRanges: the ", BackendName(device_->kind()),
                                                 " backend has no range export: ", capabilities_.dma_buf.detail));
  }
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindClient(client_id));
  if (!pool->Allows(caller.uid)) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", caller.uid, " may not use pool ", pool->name()));
  }
  return pool->PlanRangeExport(caller, client_id, ranges, capabilities_.range_spans_chunks);
}

absl::StatusOr<std::vector<PoolManager::LeasedFd>> PoolManager::RedeemRanges(Pool& pool, const LeaseRecord& lease) {
  std::vector<LeasedFd> out;
  absl::Cleanup close_all = [&] {
    for (const LeasedFd& f : out) close(f.fd);
  };
  if (!lease.ranges_span_chunks) {
    // One chunk per range: its exported FD, which the handle's fd_offset points into.
    for (size_t i = 0; i < lease.ranges.size(); ++i) {
      KVD_ASSIGN_OR_RETURN(std::vector<LeasedFd> one, pool.DupFds(lease.client, lease.ranges[i].chunk_ids));
      for (LeasedFd& f : one) out.push_back({.chunk_id = i, .fd = f.fd});
    }
  } else {
    // op_mu keeps every covered chunk mapped in the daemon while the device exports the range.
    absl::ReaderMutexLock op(&pool.op_mu);
    for (size_t i = 0; i < lease.ranges.size(); ++i) {
      const RangeHandle& r = lease.ranges[i];
      KVD_RETURN_IF_ERROR(pool.CheckChunksLive(lease.client, r.chunk_ids));
      KVD_ASSIGN_OR_RETURN(const int fd, device_->ExportRange(pool.base() + r.offset, r.bytes));
      out.push_back({.chunk_id = i, .fd = fd});
    }
  }
  std::move(close_all).Cancel();
  return out;
}

// ---------------------------------------------------------------------------------------------
// Durability: see Note [Durable pools] in docs/architecture.md.

void PoolManager::Save(Pool& pool) { NoteSaved(pool.name(), store_->SavePool(pool.Saved()), "written"); }

void PoolManager::Forget(Pool& pool) { NoteSaved(pool.name(), store_->ForgetPool(pool.name()), "removed"); }

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

absl::Status PoolManager::KeepFds(absl::Span<const ChunkRecord> chunks) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (absl::Status kept = store_->KeepChunkFd(chunks[i].info.id, chunks[i].fd.get()); !kept.ok()) {
      for (size_t j = 0; j < i; ++j) store_->DropChunkFd(chunks[j].info.id);
      return kept;
    }
  }
  return absl::OkStatus();
}

RestoreReport PoolManager::Restore(SavedState saved) {
  RestoreReport report;
  for (const SavedPool& record : saved.pools) {
    std::shared_ptr<Pool> pool = RestorePool(record, saved.fds, report);
    if (pool == nullptr) continue;
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
  absl::MutexLock op(&pool->op_mu);
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
    if (adopted.ok()) adopted = CheckChunkFd(device_->kind(), fd.mapped().get(), info.bytes);
    if (adopted.ok()) {
      absl::StatusOr<Chunk> chunk = device_->Import(fd.mapped().get(), info.bytes);
      adopted = chunk.status();
      if (adopted.ok()) {
        adopted = device_->Map(*base + info.offset, *chunk, Access::kReadWrite);
        if (!adopted.ok()) device_->Release(*chunk).IgnoreError();
      }
      if (adopted.ok()) {
        r.chunk = *chunk;
        r.fd = std::move(fd.mapped());
      }
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
    absl::MutexLock op(&pool->op_mu);
    if (pool->state() != PoolState::kRecovering) {
      pool->ForgetRestartPending();
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
    for (ChunkRecord& r : present) {
      store_->DropChunkFd(r.info.id);
      DiscardChunk(pool->base(), r);
    }
    if (!lost.empty()) Save(*pool);
    pool->ForgetRestartPending();
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
  absl::MutexLock op(&pool->op_mu);
  std::vector<uint64_t> ids;
  for (const auto& [id, fd] : fds) ids.push_back(id);
  KVD_ASSIGN_OR_RETURN(std::vector<Pool::Returned> plan, pool->PlanReturn(ids));
  std::vector<ChunkRecord> adopted;
  const uint64_t base = pool->base();
  absl::Cleanup undo = [&] {
    for (ChunkRecord& r : adopted) DiscardChunk(base, r);
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
    if (absl::Status fits = CheckChunkFd(device_->kind(), fd, info.bytes); !fits.ok()) return wrong(fits.message());
    absl::StatusOr<Chunk> chunk = device_->Import(fd, info.bytes);
    if (!chunk.ok()) return wrong(absl::StrCat("cannot be imported: ", chunk.status().message()));
    if (absl::Status mapped = device_->Map(base + info.offset, *chunk, Access::kReadWrite); !mapped.ok()) {
      device_->Release(*chunk).IgnoreError();
      return wrong(absl::StrCat("cannot be mapped: ", mapped.message()));
    }
    adopted.push_back({.info = info, .chunk = *chunk, .fd = std::move(fds[i].second)});
  }
  KVD_RETURN_IF_ERROR(KeepFds(adopted));  // on failure `undo` releases what was adopted
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
  absl::MutexLock op(&pool->op_mu);
  KVD_ASSIGN_OR_RETURN(PoolMetadata metadata, pool->SetMetadata(expected_version, std::move(data)));
  Save(*pool);
  return metadata;
}

void PoolManager::Shutdown(bool keep_pools) {
  std::vector<std::shared_ptr<Pool>> pools;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [name, pool] : pools_) pools.push_back(pool);
    pools_.clear();
    pools_by_uid_.clear();
    reserved_by_uid_.clear();
    reserved_total_ = 0;
  }
  transactions_.Stop();
  if (reaper_.joinable()) reaper_.join();
  if (compactor_.joinable()) compactor_.join();
  for (const std::shared_ptr<Pool>& pool : pools) {
    absl::MutexLock op(&pool->op_mu);
    Destroy(*pool, keep_pools ? EventType::kDaemonRestarting : EventType::kDaemonStopping);
  }
}

}  // namespace kvd::daemon
