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
      budget_(options_.budget_bytes != 0 ? options_.budget_bytes : device_info_.total_bytes,
              [this] { arbiter_.Kick(); }),
      arbiter_(&budget_, device,
               {.headroom_bytes = options_.device_headroom_bytes,
                .reshape_margin_bytes = kReshapeDeviceMargin,
                .reclaim_timeout = options_.reclaim_timeout}),
      host_tier_(options_.host_tier),
      sessions_(options_.limits),
      leases_(options_.lease_ttl),
      shared_{.leases = &leases_,
              .budget = &budget_,
              .next_chunk_id = &next_chunk_id_,
              .daemon_uid = options_.daemon_uid,
              .device_uuid = device_info_.uuid,
              .epoch = options_.epoch,
              .limits = &options_.limits,
              .arbiter = &arbiter_},
      maker_(device, store_, &next_chunk_id_, capabilities_.fabric.supported),
      reshaper_(device, &budget_, &arbiter_, &maker_, this,
                {.max_chunk_bytes = options_.max_chunk_bytes,
                 .pause_timeout = options_.pause_timeout,
                 .compact_chunks_per_pause = options_.compact_chunks_per_pause}) {
  arbiter_.SetHooks(ArbiterHooks());
  // Chunk ids are never reused, also across restarts: each epoch numbers its chunks from its own base.
  next_chunk_id_ = ((options_.epoch - 1) << 40) + 1;
  reaper_ = std::thread([this] { ReapExpired(); });
  saver_ = std::thread([this] { ResaveInBackground(); });
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
    ResaveIfSettled(pool);
    if (std::optional<std::string> id = pool->HeldBy(session); id.has_value()) {
      absl::MutexLock op(&pool->op_mu());
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
  if (absl::StatusOr<DeviceRoom> room = arbiter_.Room(); room.ok()) {
    s.headroom_bytes = room->headroom_bytes;
    s.foreign_bytes = room->foreign_bytes;
    s.available_bytes = room->available_bytes;
  }
  const ArbiterStats stats = ArbitrationStats();
  s.waiting_requests = static_cast<uint32_t>(stats.waiting);
  s.waiting_bytes = stats.waiting_bytes;
  s.driver_out_of_memory = stats.driver_out_of_memory;
  if (host_tier_ != nullptr) {
    const HostTierStats tier = host_tier_->Stats();
    s.host_tier_bytes = tier.bytes;
    s.host_tier_used_bytes = tier.used_bytes;
    s.host_tier_ready = tier.ready;
  }
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

absl::StatusOr<Staged> PoolManager::Stage(Pool& pool, uint64_t target_blocks, ChunkMaker::Observer* observer) {
  KVD_RETURN_IF_ERROR(CheckRunning());
  Staged staged;
  // The budget first, from arithmetic alone: a plan is built only for bytes the budget holds, so its
  // size is bounded by the budget (at most budget / max chunk chunks plus one per segment).
  KVD_ASSIGN_OR_RETURN(staged.bytes, pool.GrowBytes(target_blocks));
  // Taken now, so that concurrent grows of other pools see it: admitted against the budget and what the
  // device can back, with what other admitted grows are still making (Note [Arbitration]). The admission
  // ends (those bytes are no longer "being made") when this returns: made, or given back.
  const absl::Time admit_start = absl::Now();
  KVD_ASSIGN_OR_RETURN(Arbiter::Admission admission,
                       arbiter_.Admit({.pool = pool.name(),
                                       .committed_bytes = pool.Summary().committed_bytes,
                                       .bytes = staged.bytes,
                                       .what = absl::StrCat("growing to ", target_blocks, " blocks")}));
  staged.phases.admit = absl::Now() - admit_start;
  absl::StatusOr<std::vector<PlannedChunk>> plan = pool.PlanGrow(target_blocks, options_.max_chunk_bytes);
  if (!plan.ok()) {
    budget_.Give(staged.bytes);
    return plan.status();
  }
  // Mapped in the daemon's view only where it copies into them (a wake's kept contents): Note [The daemon maps
  // on demand].
  absl::StatusOr<std::vector<ChunkRecord>> made =
      maker_.Make(pool.base(), *plan,
                  absl::StrCat("pool ", pool.name(), ": growing to ", target_blocks, " blocks needs ", staged.bytes,
                               " bytes (", FormatBytes(staged.bytes), ")"),
                  observer != nullptr ? ChunkMaker::Map::kNow : ChunkMaker::Map::kOnDemand, observer, &staged.phases);
  if (!made.ok()) {
    budget_.Give(staged.bytes);
    return made.status();
  }
  staged.chunks = *std::move(made);
  return staged;
}

absl::Status PoolManager::MapView(Pool& pool) {
  if (absl::Status mapped = maker_.MapInView(pool.base(), pool.UnmappedChunks()); !mapped.ok()) {
    return absl::Status(mapped.code(),
                        absl::StrCat("pool ", pool.name(), ": mapping its chunks into kvd's view: ", mapped.message()));
  }
  return absl::OkStatus();
}

void PoolManager::Unstage(Pool& pool, Staged& staged) {
  pool.CancelPause();  // a prepared shrink's or sleep's pause, called off
  for (ChunkRecord& r : staged.chunks) maker_.Discard(pool.base(), r);
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
  const uint64_t capacity_bytes =
      plan.geometry.CommittedBytes(plan.geometry.PrefixBytes(plan.geometry.dims().capacity_blocks));
  KVD_ASSIGN_OR_RETURN(const PoolPolicy policy, arbiter_.CheckNew(spec.name, spec.policy, caller.uid, caller.uid,
                                                                  capacity_bytes, options_.limits));
  auto pool = std::make_shared<Pool>(spec, std::move(plan), caller.uid, shared_);
  absl::MutexLock op(&pool->op_mu());
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
  // The name is this pool's now: so is the arbiter's entry (its priority and cap admit the first grow).
  arbiter_.Add(spec.name, caller.uid, policy);
  // On failure the pool leaves the map again; requests that found it meanwhile find it deleted.
  auto forget = [&](absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->op_mu()) {
    std::vector<ChunkRecord> none;
    pool->Destroy(EventType::kPoolDeleted, &none);
    arbiter_.Remove(spec.name);
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
  absl::MutexLock op(&pool->op_mu());
  KVD_RETURN_IF_ERROR(pool->CheckDeletable(force));
  if (force) {
    KVD_RETURN_IF_ERROR(QuiesceLocked(*pool, caller.session, "deleting", pool->Leaving(0),
                                      ReleaseOptions{.force = true, .pause = pause}));
  }
  const uint64_t bytes = pool->Summary().committed_bytes;
  // While the name is still this pool's (a pool created with it later adds its own entry).
  arbiter_.Remove(pool->name());
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
  if (const std::string held = pool.Summary().transaction; !held.empty()) {
    transactions_.Remove(held, why == EventType::kPoolDeleted ? "its pool was deleted" : "kvd is shutting down");
  }
  const bool forget = why != EventType::kDaemonRestarting;
  if (forget) Forget(pool);
  if (std::optional<KeptContents> kept = pool.kept(); forget && kept.has_value()) {
    host_tier_->Give(kept->tier_offset, kept->extent_bytes);
  }
  if (std::optional<KeptContents> prepared = pool.held_kept(); prepared.has_value()) {
    host_tier_->Give(prepared->tier_offset, prepared->extent_bytes);  // a group's keeping sleep, never committed
  }
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
    maker_.Discard(pool.base(), r, forget ? ChunkMaker::StoreFd::kForget : ChunkMaker::StoreFd::kLeave);
  }
  if (pool.base() != 0) device_->Free(pool.base(), pool.geometry().reserved_bytes()).IgnoreError();
  pool.set_base(0);
}

// ---------------------------------------------------------------------------------------------
// Attach, detach, watch, acknowledge

absl::StatusOr<AttachResult> PoolManager::Attach(const Caller& caller, absl::string_view pool_name,
                                                 absl::string_view client_name, absl::string_view device_uuid,
                                                 bool pausable) {
  return *Attach(Wait::kYes, caller, pool_name, client_name, device_uuid, pausable);
}

std::optional<absl::StatusOr<AttachResult>> PoolManager::TryAttach(const Caller& caller, absl::string_view pool_name,
                                                                   absl::string_view client_name,
                                                                   absl::string_view device_uuid, bool pausable) {
  return Attach(Wait::kNo, caller, pool_name, client_name, device_uuid, pausable);
}

std::optional<absl::StatusOr<AttachResult>> PoolManager::Attach(Wait wait, const Caller& caller,
                                                                absl::string_view pool_name,
                                                                absl::string_view client_name,
                                                                absl::string_view device_uuid, bool pausable) {
  if (!client_name.empty()) KVD_RETURN_IF_ERROR(ValidateName(client_name, "client_name"));
  const bool peer = !device_uuid.empty() && device_uuid != device_info_.uuid;
  if (peer) KVD_RETURN_IF_ERROR(ValidateDeviceUuid(device_uuid, "device_uuid", false));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, pool_name));
  if (wait == Wait::kYes) {
    pool->op_mu().Lock();
  } else if (!pool->op_mu().TryLock()) {
    return std::nullopt;
  }
  absl::StatusOr<AttachResult> attached =
      pool->Attach(caller, client_name, peer ? device_uuid : absl::string_view(), pausable, sessions_);
  if (attached.ok()) {
    absl::MutexLock lock(&mu_);
    client_pools_[attached->client_id] = pool->name();
  }
  pool->op_mu().Unlock();
  if (!attached.ok()) return Refused(attached.status());
  return attached;
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
    { absl::MutexLock op(&pool->op_mu()); }
    return let_go() ? absl::OkStatus() : detached;
  }
  // A detached client that still holds chunks stays findable, so that it can acknowledge releases.
  if (!pool->IsHolder(client_id)) ForgetClients({std::string(client_id)});
  ResaveIfSettled(pool);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<EventQueue>> PoolManager::Watch(const Caller& caller, absl::string_view client_id) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindClient(client_id));
  return pool->Watch(caller, client_id);
}

absl::StatusOr<uint64_t> PoolManager::Acknowledge(const Caller& caller, absl::string_view client_id,
                                                  uint64_t release_id) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindClient(client_id));
  absl::StatusOr<uint64_t> pending = pool->Acknowledge(caller, client_id, release_id);
  if (pending.ok()) ResaveIfSettled(pool);
  return pending;
}

absl::Status PoolManager::AcknowledgePause(const Caller& caller, absl::string_view client_id, uint64_t pause_id) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindClient(client_id));
  return pool->AcknowledgePause(caller, client_id, pause_id);
}

// ---------------------------------------------------------------------------------------------
// The resize state machine: grow, shrink, sleep, wake, plain or in two phases

absl::StatusOr<Change> PoolManager::PrepareLocked(Pool& pool, GroupOp op, uint64_t target_blocks,
                                                  absl::string_view session, const ReleaseOptions& release,
                                                  const KeepOptions& keep) {
  KVD_ASSIGN_OR_RETURN(Change change, pool.Check(op, target_blocks));
  if ((op == GroupOp::kGrow || op == GroupOp::kWake) && change.target_blocks > 0) {
    if (std::optional<KeptContents> kept = pool.kept(); op == GroupOp::kWake && kept.has_value()) {
      // Note [The host tier]: the kept contents land in the new chunks before any client sees them, each
      // chunk's while the next ones are made.
      HostTier::Copy copy(host_tier_, pool.base(), *kept, HostTier::Copy::Direction::kToDevice);
      struct CopyAsMapped : ChunkMaker::Observer {
        explicit CopyAsMapped(HostTier::Copy* c) : copy(c) {}
        void Mapped(const ChunkInfo& chunk) override { copy->Ready(chunk.offset, chunk.bytes); }
        void Undoing() override { copy->Stop(); }
        HostTier::Copy* copy;
      } observer(&copy);
      KVD_ASSIGN_OR_RETURN(change.staged, Stage(pool, change.target_blocks, &observer));
      if (absl::Status copied = copy.Finish(); !copied.ok()) {
        Unstage(pool, change.staged);
        return absl::Status(copied.code(), absl::StrCat("pool ", pool.name(), ": copying its kept contents back: ",
                                                        copied.message(), "; it still sleeps with them"));
      }
      change.restored = true;
    } else {
      KVD_ASSIGN_OR_RETURN(change.staged, Stage(pool, change.target_blocks));
    }
  }
  if (op == GroupOp::kSleep && keep.keep) {
    KVD_ASSIGN_OR_RETURN(change.kept, PlanKeep(pool, keep));
  } else if (!keep.live_blocks.empty()) {
    return absl::InvalidArgumentError("live_blocks: only a sleep that keeps its contents (keep) names live blocks");
  }
  absl::Cleanup give_back = [&] {
    pool.op_mu().AssertHeld();  // the lambda runs in this scope, under the caller's hold of op_mu
    Unprepare(pool, change);
  };
  // The copy to the host tier reads the pool through the daemon's view: mapped before the clients pause.
  if (change.kept.has_value()) KVD_RETURN_IF_ERROR(MapView(pool));
  if (op == GroupOp::kShrink || op == GroupOp::kSleep) {
    const uint64_t prefix = op == GroupOp::kSleep ? 0 : pool.geometry().PrefixBytes(target_blocks);
    KVD_RETURN_IF_ERROR(QuiesceLocked(
        pool, session, op == GroupOp::kSleep ? "sleeping" : absl::StrCat("shrinking to ", target_blocks, " blocks"),
        pool.Leaving(prefix), release));
    change.forced = release.force;
  }
  if (change.kept.has_value()) {
    // Under the pause: no client of another session writes while the bytes are copied.
    if (absl::Status copied = host_tier_->CopyOut(pool.base(), *change.kept); !copied.ok()) {
      return absl::Status(copied.code(), absl::StrCat("pool ", pool.name(), ": copying its contents to the host tier: ",
                                                      copied.message(), "; nothing changed"));
    }
  }
  std::move(give_back).Cancel();
  return change;
}

absl::StatusOr<std::optional<KeptContents>> PoolManager::PlanKeep(Pool& pool, const KeepOptions& keep) {
  if (host_tier_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("keep: pool ", pool.name(),
                     " cannot keep its contents: kvd was started without a host tier (--host-tier-bytes)"));
  }
  const PoolSummary view = pool.Summary();
  const Geometry& g = pool.geometry();
  KeptContents kept;
  if (keep.live_blocks.empty()) {
    const uint64_t prefix = g.segments() == 0 ? 0 : view.committed_bytes / g.segments();
    if (prefix > 0) {
      for (uint64_t s = 0; s < g.segments(); ++s)
        kept.runs.push_back({.pool_offset = g.SegmentOffset(s), .bytes = prefix});
    }
  } else {
    std::vector<uint64_t> live = keep.live_blocks;
    for (size_t i = 0; i < live.size(); ++i) {
      if (live[i] >= view.committed_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("live_blocks[", i, "]: block ", live[i],
                                                       " is not committed (pool ", pool.name(), " has ",
                                                       view.committed_blocks, ")"));
      }
    }
    std::sort(live.begin(), live.end());
    if (auto dup = std::adjacent_find(live.begin(), live.end()); dup != live.end()) {
      return absl::InvalidArgumentError(absl::StrCat("live_blocks: block ", *dup, " is named more than once"));
    }
    kept.live_blocks = live.size();
    const uint64_t block = g.block_stride();
    for (uint64_t s = 0; s < g.segments(); ++s) {
      for (size_t i = 0; i < live.size();) {
        size_t j = i + 1;
        while (j < live.size() && live[j] == live[j - 1] + 1) ++j;
        kept.runs.push_back({.pool_offset = g.SegmentOffset(s) + live[i] * block, .bytes = (j - i) * block});
        i = j;
      }
    }
  }
  for (const KeptRun& run : kept.runs) kept.bytes += run.bytes;
  if (kept.bytes == 0) return std::nullopt;
  KVD_ASSIGN_OR_RETURN(kept.tier_offset,
                       host_tier_->Take(pool.name(), kept.bytes, &kept.extent_bytes, keep.tier_ready_by));
  return kept;
}

void PoolManager::Unprepare(Pool& pool, Change& change) {
  Unstage(pool, change.staged);
  if (change.kept.has_value()) host_tier_->Give(change.kept->tier_offset, change.kept->extent_bytes);
  change.kept.reset();
}

absl::StatusOr<PoolUpdate> PoolManager::SleepKeeping(absl::string_view name, PauseOptions pause) {
  std::shared_ptr<Pool> pool;
  {
    absl::MutexLock lock(&mu_);
    auto it = pools_.find(name);
    if (it == pools_.end()) return absl::NotFoundError(absl::StrCat("pool: ", name, " does not exist"));
    pool = it->second;
  }
  return Resize(Caller{.uid = options_.daemon_uid}, pool, GroupOp::kSleep, 0, false, absl::InfinitePast(),
                ReleaseOptions{.force = true, .pause = pause}, KeepOptions{.keep = true});
}

HostTierStats PoolManager::HostTierUsage() const {
  return host_tier_ != nullptr ? host_tier_->Stats() : HostTierStats{};
}

PoolUpdate PoolManager::CommitLocked(Pool& pool, Change change, absl::string_view session, absl::Time start) {
  std::vector<ChunkRecord> released;
  const GroupOp op = change.op;
  const uint64_t target_blocks = change.target_blocks;
  const size_t chunks_before = pool.Summary().chunks;
  const std::optional<KeptContents> restored = change.restored ? pool.kept() : std::nullopt;
  const ResizePhases staged = change.staged.phases;
  absl::Time lap = absl::Now();
  PoolUpdate update = pool.Apply(std::move(change), session, &released);
  update.phases = staged;
  const auto next = [&lap](absl::Duration& phase) {
    const absl::Time now = absl::Now();
    phase = now - lap;
    lap = now;
  };
  next(update.phases.apply);
  // Woken with its contents: the tier's copy is no longer needed.
  if (restored.has_value()) host_tier_->Give(restored->tier_offset, restored->extent_bytes);
  if (op == GroupOp::kShrink) {
    // Whole chunks only: say whether that reached the target.
    const Geometry& g = pool.geometry();
    update.reshape =
        ReshapeReport{.chunks_before = static_cast<uint32_t>(chunks_before),
                      .chunks_after = static_cast<uint32_t>(update.pool.chunks.size()),
                      .target_reached = update.pool.committed_bytes == g.CommittedBytes(g.PrefixBytes(target_blocks))};
  }
  lap = absl::Now();
  Save(pool);
  next(update.phases.save);
  // The daemon's own references go now; clients' mappings keep the memory until they acknowledge.
  if (!released.empty()) {
    for (ChunkRecord& r : released) maker_.Discard(pool.base(), r);
    next(update.phases.release);
  }
  update.elapsed = absl::Now() - start;
  return update;
}

absl::StatusOr<PoolUpdate> PoolManager::Resize(const Caller& caller, const std::shared_ptr<Pool>& pool, GroupOp op,
                                               uint64_t target_blocks, bool wait, absl::Time deadline,
                                               const ReleaseOptions& release, const KeepOptions& keep) {
  PoolUpdate update;
  {
    absl::MutexLock lock(&pool->op_mu());
    const absl::Time start = absl::Now();
    KVD_ASSIGN_OR_RETURN(Change change, PrepareLocked(*pool, op, target_blocks, caller.session, release, keep));
    update = CommitLocked(*pool, std::move(change), caller.session, start);
  }
  if (wait && update.release_id != 0) {
    pool->AwaitRelease(update.release_id, deadline);
    SaveIfSettled(*pool);
    update.pool = pool->View(ViewClients::kCounted);
  }
  return update;
}

absl::StatusOr<PoolUpdate> PoolManager::Grow(const Caller& caller, absl::string_view name, uint64_t target_blocks,
                                             const WaitOptions& wait) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  KVD_ASSIGN_OR_RETURN(PoolUpdate update, ResizeWaiting(caller, pool, GroupOp::kGrow, target_blocks, wait));
  CompactLaterIfFragmented(update.pool);
  return update;
}

absl::StatusOr<PoolUpdate> PoolManager::Shrink(const Caller& caller, absl::string_view name, uint64_t target_blocks,
                                               bool wait, absl::Time deadline) {
  return Shrink(caller, name, target_blocks, ShrinkOptions{.wait = wait, .deadline = deadline});
}

absl::StatusOr<std::vector<PoolUpdate>> PoolManager::Sleep(const Caller& caller, absl::string_view name, bool wait,
                                                           absl::Time deadline, const ReleaseOptions& release,
                                                           const KeepOptions& keep) {
  KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("live_blocks", keep.live_blocks.size(), caller.uid, options_.limits)));
  std::vector<PoolUpdate> updates;
  if (!name.empty()) {
    KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
    KVD_ASSIGN_OR_RETURN(PoolUpdate update, Resize(caller, pool, GroupOp::kSleep, 0, wait, deadline, release, keep));
    updates.push_back(std::move(update));
    return updates;
  }
  // --all: every awake pool the caller may change. Releases are started on every pool first, then
  // awaited together. A pool that went to sleep or away meanwhile is skipped.
  if (!keep.live_blocks.empty()) {
    return absl::InvalidArgumentError("live_blocks: name the pool they belong to (not all)");
  }
  std::vector<std::shared_ptr<Pool>> slept;
  for (const std::shared_ptr<Pool>& pool : Snapshot()) {
    if (!pool->Allows(caller.uid) || pool->state() != PoolState::kAwake) continue;
    absl::StatusOr<PoolUpdate> update = Resize(caller, pool, GroupOp::kSleep, 0, false, deadline, release, keep);
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
      SaveIfSettled(*slept[i]);
      updates[i].pool = slept[i]->View(ViewClients::kCounted);
    }
  }
  return updates;
}

absl::StatusOr<std::vector<PoolUpdate>> PoolManager::Wake(const Caller& caller, absl::string_view name,
                                                          const WaitOptions& wait) {
  std::vector<PoolUpdate> updates;
  if (wait.wait && name.empty()) {
    return absl::InvalidArgumentError("wait: a wake waits for one pool only (set pool, not all)");
  }
  if (!name.empty()) {
    KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
    KVD_ASSIGN_OR_RETURN(PoolUpdate update, ResizeWaiting(caller, pool, GroupOp::kWake, 0, wait));
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
// Reshaping: the Reshaper's (reshaper.h), with the services it is handed

absl::StatusOr<PoolUpdate> PoolManager::Shrink(const Caller& caller, absl::string_view name, uint64_t target_blocks,
                                               const ShrinkOptions& options) {
  if (options.live.has_value()) {
    KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("live.blocks", options.live->size(), caller.uid, options_.limits)));
  }
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::StatusOr<PoolUpdate> update = reshaper_.Shrink(*pool, caller.session, target_blocks, options);
  if (update.ok() && options.wait) SaveIfSettled(*pool);
  return update;
}

absl::StatusOr<PoolUpdate> PoolManager::Compact(const Caller& caller, absl::string_view name,
                                                const CompactOptions& options) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  return reshaper_.Compact(*pool, options);
}

absl::Status PoolManager::CheckRunning() const {
  absl::MutexLock lock(&mu_);
  return stopping_ ? Stopping() : absl::OkStatus();
}

absl::StatusOr<PoolUpdate> PoolManager::ReleaseWholeChunksLocked(Pool& pool, absl::string_view session,
                                                                 uint64_t target_blocks, const ReleaseOptions& release,
                                                                 absl::Time start) {
  KVD_ASSIGN_OR_RETURN(Change change, PrepareLocked(pool, GroupOp::kShrink, target_blocks, session, release));
  return CommitLocked(pool, std::move(change), session, start);
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
      absl::MutexLock op(&pool->op_mu());
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
  absl::MutexLock op(&pool->op_mu());
  KVD_ASSIGN_OR_RETURN(PoolView view, pool->GrantPeerAccess(device_uuid, revoke));
  Save(*pool);
  return view;
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
  arbiter_.Stop();  // waiting grows fail UNAVAILABLE
  if (reaper_.joinable()) reaper_.join();
  if (compactor_.joinable()) compactor_.join();
  if (saver_.joinable()) saver_.join();  // before Destroy: a drained pool's record must stay forgotten
  for (const std::shared_ptr<Pool>& pool : pools) {
    absl::MutexLock op(&pool->op_mu());
    Destroy(*pool, keep_pools ? EventType::kDaemonRestarting : EventType::kDaemonStopping);
  }
}

}  // namespace kvd::daemon
