#include "daemon/core/pool_manager.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvd/status.h"
#include "kvd/units.h"

namespace kvd::daemon {
namespace {

// 128 random bits as hex: session tokens, lease tokens and client ids.
std::string RandomToken(absl::string_view prefix) {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::StrCat(prefix,
                      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes))));
}

absl::Status Stopping() { return absl::UnavailableError("kvd is shutting down"); }

absl::Status Sleeping(absl::string_view pool) {
  return absl::FailedPreconditionError(absl::StrCat("pool ", pool, " is sleeping: wake it first"));
}

absl::Status Gone(absl::string_view pool) {
  return absl::NotFoundError(absl::StrCat("pool ", pool, " does not exist"));
}

constexpr size_t kMaxAbortedRecords = 1024;

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
// EventQueue

void EventQueue::Push(PoolEvent event) {
  absl::MutexLock lock(&mu_);
  if (!closed_) events_.push_back(std::move(event));
}

void EventQueue::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

std::optional<PoolEvent> EventQueue::Pop(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !events_.empty() || closed_; };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (events_.empty()) return std::nullopt;
  PoolEvent e = std::move(events_.front());
  events_.erase(events_.begin());
  return e;
}

bool EventQueue::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

// ---------------------------------------------------------------------------------------------
// State

struct PoolManager::ChunkRecord {
  ChunkInfo info;
  Chunk chunk;  // the daemon's own handle, mapped at base + info.offset
  int fd = -1;  // exported once at creation; consumers get dup()s
};

// Memory made for a grow or wake that no client can see yet.
struct PoolManager::Staged {
  std::vector<ChunkRecord> chunks;
  uint64_t bytes = 0;  // counted in committed_bytes_ (the budget) from the start
};

// A prepared group operation holding one pool.
struct PoolManager::Transaction {
  std::string id;
  GroupOp op = GroupOp::kGrow;
  uint64_t target_blocks = 0;
  std::string session;
  int32_t pid = 0;
  absl::Time expires;
  Staged staged;
};

struct PoolManager::Client {
  std::string id;
  std::string name;
  uint32_t uid = 0;
  int32_t pid = 0;
  std::string session;
  absl::Time attached_at;
  std::string device_uuid;
  std::map<uint64_t, uint64_t> handed;  // chunk id -> bytes, until acknowledged as released
  std::shared_ptr<EventQueue> events = std::make_shared<EventQueue>();
  bool watching = false;
};

struct PoolManager::Pool {
  absl::Mutex op_mu;  // serialises operations on this pool; held across device calls

  // Everything below is guarded by the manager's mu_.
  std::string name;
  PoolPlan plan;
  uint32_t owner_uid = 0;
  std::vector<uint32_t> allowed_uids;
  GroupMembership group;
  std::vector<std::string> peer_devices;
  std::optional<Transaction> txn;
  uint64_t base = 0;  // the daemon's own VA reservation
  PoolState state = PoolState::kAwake;
  uint64_t prefix_bytes = 0;  // committed bytes of every segment
  uint64_t wake_blocks = 0;
  std::vector<ChunkRecord> chunks;  // by (segment, offset)
  uint64_t generation = 0;
  uint64_t event_sequence = 0;
  absl::Time created_at;
  std::map<std::string, Client, std::less<>> clients;
  struct Release {
    std::vector<ChunkInfo> chunks;
    uint64_t bytes = 0;
    std::set<std::string> waiting;  // client ids that still map some of the chunks
  };
  std::map<uint64_t, Release> releases;
  uint64_t next_release_id = 1;
  bool deleted = false;

  uint64_t committed_blocks() const { return plan.geometry.BlocksInPrefix(prefix_bytes); }
  uint64_t committed_bytes() const { return plan.geometry.CommittedBytes(prefix_bytes); }
  uint64_t pending_bytes() const {
    uint64_t sum = 0;
    for (const auto& [id, r] : releases) sum += r.bytes;
    return sum;
  }
  bool allows(uint32_t uid, uint32_t daemon_uid) const {
    return uid == 0 || uid == daemon_uid || uid == owner_uid ||
           std::find(allowed_uids.begin(), allowed_uids.end(), uid) != allowed_uids.end();
  }
  PoolEvent Event(EventType type) {
    PoolEvent e;
    e.sequence = ++event_sequence;
    e.pool = name;
    e.type = type;
    e.committed_blocks = committed_blocks();
    e.state = state;
    return e;
  }
};

// ---------------------------------------------------------------------------------------------
// Construction, sessions, device

PoolManager::PoolManager(Device* device, ManagerOptions options) : device_(device), options_(std::move(options)) {
  absl::StatusOr<DeviceInfo> info = device_->Info();
  if (info.ok()) device_info_ = *info;
  device_info_.granularity = device_->granularity();
  device_info_.backend = device_->kind();
  budget_bytes_ = options_.budget_bytes != 0 ? options_.budget_bytes : device_info_.total_bytes;
  reaper_ = std::thread([this] { ReapExpired(); });
}

PoolManager::~PoolManager() { Shutdown(); }

std::string PoolManager::OpenSession(uint32_t uid, int32_t pid, std::string name) {
  std::string token = RandomToken("s-");
  absl::MutexLock lock(&mu_);
  sessions_[token] = Caller{.uid = uid, .pid = pid, .session = token, .name = std::move(name)};
  return token;
}

void PoolManager::CloseSession(absl::string_view session) {
  // The session goes first, in the same critical section that collects its transactions: a Prepare
  // of it that finishes later finds the session gone and gives its memory back itself.
  std::vector<std::shared_ptr<Pool>> held;
  {
    absl::MutexLock lock(&mu_);
    auto s = sessions_.find(session);
    if (s == sessions_.end()) return;
    sessions_.erase(s);
    for (auto& [name, pool] : pools_) {
      std::vector<std::string> gone;
      for (const auto& [id, client] : pool->clients) {
        if (client.session == session) gone.push_back(id);
      }
      for (const std::string& id : gone) DetachLocked(*pool, id);
      if (pool->txn.has_value() && pool->txn->session == session) held.push_back(pool);
    }
    for (auto it = leases_.begin(); it != leases_.end();) {
      it = it->second.session == session ? leases_.erase(it) : std::next(it);
    }
  }
  for (const std::shared_ptr<Pool>& pool : held) {
    absl::MutexLock op(&pool->op_mu);
    std::string id;
    {
      absl::MutexLock lock(&mu_);
      if (pool->txn.has_value() && pool->txn->session == session) id = pool->txn->id;
    }
    if (!id.empty()) AbortLocked(*pool, id, "its session closed (the coordinator ended or died) before Commit");
  }
}

absl::StatusOr<Caller> PoolManager::Authenticate(absl::string_view session) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::UnauthenticatedError("kvd-session: unknown or closed session; open one on the handle channel");
  }
  return it->second;
}

absl::StatusOr<DeviceStatus> PoolManager::GetDeviceStatus() const {
  KVD_ASSIGN_OR_RETURN(DeviceInfo info, device_->Info());
  absl::MutexLock lock(&mu_);
  DeviceStatus s{.info = info, .budget_bytes = budget_bytes_, .max_chunk_bytes = options_.max_chunk_bytes};
  s.committed_bytes = committed_bytes_;
  for (const auto& [name, pool] : pools_) {
    s.pending_release_bytes += pool->pending_bytes();
    s.reserved_bytes += pool->plan.geometry.reserved_bytes();
  }
  s.pools = static_cast<uint32_t>(pools_.size());
  return s;
}

absl::StatusOr<LayoutResolution> PoolManager::ResolveLayout(const LayoutRequest& request) const {
  return daemon::ResolveLayout(request, options_.layout_policy);
}

absl::StatusOr<std::shared_ptr<PoolManager::Pool>> PoolManager::Find(const Caller& caller,
                                                                     absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(name);
  if (it == pools_.end()) return Gone(name);
  if (!it->second->allows(caller.uid, options_.daemon_uid)) {
    return absl::PermissionDeniedError(
        absl::StrCat("uid ", caller.uid, " may not use pool ", name, " (owner uid ", it->second->owner_uid, ")"));
  }
  return it->second;
}

// ---------------------------------------------------------------------------------------------
// Chunks

absl::StatusOr<std::vector<PoolManager::ChunkRecord>> PoolManager::MakeChunks(const Pool& pool,
                                                                              const std::vector<PlannedChunk>& plan) {
  std::vector<ChunkRecord> made;
  absl::Cleanup undo = [&] {
    for (ChunkRecord& r : made) DiscardChunk(pool, r);
  };
  made.reserve(plan.size());
  for (const PlannedChunk& p : plan) {
    ChunkRecord r;
    r.info = {.id = 0, .segment = p.segment, .offset = p.offset, .bytes = p.bytes};
    KVD_ASSIGN_OR_RETURN(r.chunk, device_->Create(p.bytes));
    if (absl::Status s = device_->Map(pool.base + p.offset, r.chunk, Access::kReadWrite); !s.ok()) {
      device_->Release(r.chunk).IgnoreError();
      return s;
    }
    absl::StatusOr<int> fd = device_->Export(r.chunk);
    if (!fd.ok()) {
      device_->Unmap(pool.base + p.offset, p.bytes).IgnoreError();
      device_->Release(r.chunk).IgnoreError();
      return fd.status();
    }
    r.fd = *fd;
    made.push_back(r);
  }
  std::move(undo).Cancel();
  return made;
}

void PoolManager::DiscardChunk(const Pool& pool, ChunkRecord& r) {
  device_->Unmap(pool.base + r.info.offset, r.info.bytes).IgnoreError();
  device_->Release(r.chunk).IgnoreError();
  if (r.fd >= 0) close(r.fd);
  r.fd = -1;
}

Lease PoolManager::IssueLeaseLocked(const Pool& pool, const std::string& session, std::vector<uint64_t> chunk_ids) {
  const absl::Time now = absl::Now();
  for (auto it = leases_.begin(); it != leases_.end();) {
    it = it->second.expires < now ? leases_.erase(it) : std::next(it);
  }
  Lease lease{.token = RandomToken("l-"), .chunk_ids = std::move(chunk_ids), .expires = now + options_.lease_ttl};
  leases_[lease.token] = {
      .pool = pool.name, .session = session, .chunk_ids = lease.chunk_ids, .expires = lease.expires};
  return lease;
}

PoolView PoolManager::ViewLocked(const Pool& pool) const {
  PoolView v{.name = pool.name,
             .state = pool.state,
             .geometry = pool.plan.geometry,
             .layout = pool.plan.layout,
             .committed_blocks = pool.committed_blocks(),
             .committed_bytes = pool.committed_bytes(),
             .reserved_bytes = pool.plan.geometry.reserved_bytes(),
             .pending_release_bytes = pool.pending_bytes(),
             .wake_blocks = pool.wake_blocks,
             .owner_uid = pool.owner_uid,
             .allowed_uids = pool.allowed_uids,
             .generation = pool.generation,
             .created_at = pool.created_at,
             .group = pool.group,
             .peer_devices = pool.peer_devices,
             .transaction = pool.txn.has_value() ? pool.txn->id : std::string()};
  for (const auto& [id, c] : pool.clients) {
    uint64_t mapped = 0;
    for (const auto& [chunk, bytes] : c.handed) mapped += bytes;
    v.clients.push_back({.id = c.id,
                         .name = c.name,
                         .uid = c.uid,
                         .pid = c.pid,
                         .mapped_bytes = mapped,
                         .attached_at = c.attached_at,
                         .device_uuid = c.device_uuid});
  }
  for (const ChunkRecord& r : pool.chunks) v.chunks.push_back(r.info);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Pools

absl::StatusOr<PoolView> PoolManager::CreatePool(const Caller& caller, const PoolSpec& spec) {
  KVD_ASSIGN_OR_RETURN(PoolPlan plan, PlanPool(spec, options_.layout_policy,
                                               {.granularity = device_->granularity(),
                                                .max_reserved_bytes = options_.max_pool_reserved_bytes}));
  auto pool = std::make_shared<Pool>();
  absl::MutexLock op(&pool->op_mu);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return Stopping();
    if (pools_.contains(spec.name)) {
      return absl::AlreadyExistsError(absl::StrCat("name: pool ", spec.name, " already exists"));
    }
    if (!spec.group.name.empty()) {
      for (const auto& [other_name, other] : pools_) {
        if (other->group.name != spec.group.name) continue;
        if (other->group.size != spec.group.size) {
          return absl::InvalidArgumentError(absl::StrCat("group.size: group ", spec.group.name, " has size ",
                                                         other->group.size, " here (pool ", other_name, "), not ",
                                                         spec.group.size));
        }
        if (other->group.rank == spec.group.rank) {
          return absl::AlreadyExistsError(absl::StrCat("group.rank: rank ", spec.group.rank, " of group ",
                                                       spec.group.name, " is already pool ", other_name,
                                                       " on this daemon"));
        }
      }
    }
    pool->name = spec.name;
    pool->group = spec.group;
    pool->peer_devices = spec.peer_devices;
    pool->plan = std::move(plan);
    pool->owner_uid = caller.uid;
    pool->allowed_uids = spec.allowed_uids;
    pool->created_at = absl::Now();
    // Visible at once so that a concurrent create of the same name fails; other requests on it wait
    // for op_mu and find it deleted if creation fails.
    pools_[spec.name] = pool;
  }
  absl::Cleanup forget = [&] {
    absl::MutexLock lock(&mu_);
    pool->deleted = true;
    pools_.erase(spec.name);
  };
  KVD_ASSIGN_OR_RETURN(pool->base, device_->Reserve(pool->plan.geometry.reserved_bytes()));
  if (spec.initial_blocks > 0) {
    absl::StatusOr<PoolUpdate> grown = GrowLocked(*pool, caller, spec.initial_blocks);
    if (!grown.ok()) {
      device_->Free(pool->base, pool->plan.geometry.reserved_bytes()).IgnoreError();
      return grown.status();
    }
  }
  std::move(forget).Cancel();
  absl::MutexLock lock(&mu_);
  return ViewLocked(*pool);
}

absl::StatusOr<PoolView> PoolManager::GetPool(const Caller& caller, absl::string_view name) const {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock lock(&mu_);
  return ViewLocked(*pool);
}

std::vector<PoolView> PoolManager::ListPools(const Caller& caller) const {
  absl::MutexLock lock(&mu_);
  std::vector<PoolView> out;
  for (const auto& [name, pool] : pools_) {
    if (pool->allows(caller.uid, options_.daemon_uid)) out.push_back(ViewLocked(*pool));
  }
  return out;
}

absl::StatusOr<uint64_t> PoolManager::DeletePool(const Caller& caller, absl::string_view name, bool force) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu);
  uint64_t bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    if (pool->deleted) return Gone(name);
    if (!force) KVD_RETURN_IF_ERROR(CheckNotHeldLocked(*pool));
    if (!pool->clients.empty() && !force) {
      return absl::FailedPreconditionError(absl::StrCat("pool ", name, " has ", pool->clients.size(),
                                                        " attached clients: detach them or delete with force"));
    }
    bytes = pool->committed_bytes();
    pools_.erase(pool->name);
  }
  DestroyLocked(*pool, EventType::kPoolDeleted);
  return bytes;
}

void PoolManager::DestroyLocked(Pool& pool, EventType why) {
  std::vector<ChunkRecord> chunks;
  std::optional<Transaction> txn;
  {
    absl::MutexLock lock(&mu_);
    pool.deleted = true;
    if (pool.txn.has_value()) {
      transactions_.erase(pool.txn->id);
      committed_bytes_ -= pool.txn->staged.bytes;
      txn = std::move(pool.txn);
      pool.txn.reset();
    }
    for (auto& [id, client] : pool.clients) {
      client.events->Push(pool.Event(why));
      client.events->Close();
      client_pools_.erase(id);
    }
    pool.clients.clear();
    // Clients still mapping released chunks free them when they unmap; the daemon stops counting.
    committed_bytes_ -= pool.committed_bytes() + pool.pending_bytes();
    pool.releases.clear();
    chunks.swap(pool.chunks);
    pool.prefix_bytes = 0;
    for (auto it = leases_.begin(); it != leases_.end();) {
      it = it->second.pool == pool.name ? leases_.erase(it) : std::next(it);
    }
  }
  for (ChunkRecord& r : chunks) DiscardChunk(pool, r);
  if (txn.has_value()) {
    for (ChunkRecord& r : txn->staged.chunks) DiscardChunk(pool, r);
  }
  if (pool.base != 0) device_->Free(pool.base, pool.plan.geometry.reserved_bytes()).IgnoreError();
  pool.base = 0;
}

// ---------------------------------------------------------------------------------------------
// Attach, detach, watch, acknowledge

absl::StatusOr<AttachResult> PoolManager::Attach(const Caller& caller, absl::string_view pool_name,
                                                 absl::string_view client_name, absl::string_view device_uuid) {
  if (!client_name.empty()) KVD_RETURN_IF_ERROR(ValidateName(client_name, "client_name"));
  const bool peer = !device_uuid.empty() && device_uuid != device_info_.uuid;
  if (peer) KVD_RETURN_IF_ERROR(ValidateDeviceUuid(device_uuid, "device_uuid", false));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, pool_name));
  absl::MutexLock op(&pool->op_mu);
  absl::MutexLock lock(&mu_);
  if (pool->deleted) return Gone(pool_name);
  if (peer && std::none_of(pool->peer_devices.begin(), pool->peer_devices.end(),
                           [&](const std::string& d) { return d == "*" || d == device_uuid; })) {
    return absl::PermissionDeniedError(absl::StrCat(
        "device_uuid: pool ", pool_name, " lives on device ", device_info_.uuid, " and is not granted to device ",
        device_uuid, " (grant it: kvctl grant ", pool_name, " ", device_uuid, ", or create it with peer_devices)"));
  }
  if (!sessions_.contains(caller.session)) return absl::UnauthenticatedError("kvd-session: the session has closed");
  Client c{.id = RandomToken("c-"),
           .name = client_name.empty() ? caller.name : std::string(client_name),
           .uid = caller.uid,
           .pid = caller.pid,
           .session = caller.session,
           .attached_at = absl::Now(),
           .device_uuid = peer ? std::string(device_uuid) : std::string()};
  std::vector<uint64_t> ids;
  for (const ChunkRecord& r : pool->chunks) {
    ids.push_back(r.info.id);
    c.handed[r.info.id] = r.info.bytes;
  }
  AttachResult result{.client_id = c.id};
  result.lease = IssueLeaseLocked(*pool, caller.session, std::move(ids));
  client_pools_[c.id] = pool->name;
  pool->clients.emplace(c.id, std::move(c));
  result.pool = ViewLocked(*pool);
  return result;
}

void PoolManager::DetachLocked(Pool& pool, const std::string& client_id) {
  auto it = pool.clients.find(client_id);
  if (it == pool.clients.end()) return;
  it->second.events->Close();
  pool.clients.erase(it);
  client_pools_.erase(client_id);
  for (auto& [id, release] : pool.releases) release.waiting.erase(client_id);
  SettleReleasesLocked(pool);
}

void PoolManager::SettleReleasesLocked(Pool& pool) {
  for (auto it = pool.releases.begin(); it != pool.releases.end();) {
    if (it->second.waiting.empty()) {
      committed_bytes_ -= it->second.bytes;
      it = pool.releases.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<std::pair<PoolManager::Pool*, PoolManager::Client*>> PoolManager::FindClientLocked(
    absl::string_view client_id) {
  auto it = client_pools_.find(client_id);
  if (it != client_pools_.end()) {
    // A pool being deleted or shut down leaves pools_ before its clients are gone: not attached.
    auto p = pools_.find(it->second);
    if (p != pools_.end()) {
      auto c = p->second->clients.find(client_id);
      if (c != p->second->clients.end()) return std::pair{p->second.get(), &c->second};
    }
  }
  return absl::NotFoundError(absl::StrCat("client_id: ", client_id, " is not attached"));
}

absl::Status PoolManager::Detach(const Caller& caller, absl::string_view client_id) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(auto found, FindClientLocked(client_id));
  Pool& pool = *found.first;
  const Client& c = *found.second;
  if (c.session != caller.session && !pool.allows(caller.uid, options_.daemon_uid)) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", caller.uid, " may not detach client ", client_id));
  }
  DetachLocked(pool, std::string(client_id));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<EventQueue>> PoolManager::Watch(const Caller& caller, absl::string_view client_id) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(auto found, FindClientLocked(client_id));
  Client& c = *found.second;
  if (c.session != caller.session) {
    return absl::PermissionDeniedError(absl::StrCat("client_id: ", client_id, " belongs to another session"));
  }
  if (c.watching) {
    return absl::FailedPreconditionError(absl::StrCat("client_id: ", client_id, " already has a Watch stream"));
  }
  c.watching = true;
  return c.events;
}

absl::StatusOr<uint64_t> PoolManager::Acknowledge(const Caller& caller, absl::string_view client_id,
                                                  uint64_t release_id) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(auto found, FindClientLocked(client_id));
  Pool& pool = *found.first;
  Client& c = *found.second;
  if (c.session != caller.session) {
    return absl::PermissionDeniedError(absl::StrCat("client_id: ", client_id, " belongs to another session"));
  }
  auto r = pool.releases.find(release_id);
  if (r == pool.releases.end() || !r->second.waiting.contains(c.id)) {
    return absl::NotFoundError(
        absl::StrCat("release_id: ", release_id, " is not awaiting an acknowledgement from client ", client_id));
  }
  r->second.waiting.erase(c.id);
  for (const ChunkInfo& chunk : r->second.chunks) c.handed.erase(chunk.id);
  SettleReleasesLocked(pool);
  return pool.pending_bytes();
}

// ---------------------------------------------------------------------------------------------
// Grow, shrink, sleep, wake

absl::Status PoolManager::CheckNotHeldLocked(const Pool& pool) const {
  if (!pool.txn.has_value()) return absl::OkStatus();
  return absl::AbortedError(
      absl::StrCat("pool ", pool.name, " is held by group transaction ", pool.txn->id, " (", GroupOpName(pool.txn->op),
                   ", prepared by pid ", pool.txn->pid, ") until it commits or aborts (at the latest in ",
                   absl::FormatDuration(absl::Trunc(pool.txn->expires - absl::Now(), absl::Milliseconds(1))), ")"));
}

absl::StatusOr<PoolUpdate> PoolManager::Grow(const Caller& caller, absl::string_view name, uint64_t target_blocks) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu);
  {
    absl::MutexLock lock(&mu_);
    if (pool->deleted) return Gone(name);
    KVD_RETURN_IF_ERROR(CheckNotHeldLocked(*pool));
    if (pool->state == PoolState::kSleeping) return Sleeping(name);
    if (target_blocks <= pool->committed_blocks()) {
      return absl::InvalidArgumentError(absl::StrCat("target_blocks: ", target_blocks, " is not more than the ",
                                                     pool->committed_blocks(), " blocks pool ", name,
                                                     " already has committed (use Shrink to release)"));
    }
  }
  return GrowLocked(*pool, caller, target_blocks);
}

absl::StatusOr<PoolUpdate> PoolManager::GrowLocked(Pool& pool, const Caller& caller, uint64_t target_blocks) {
  const absl::Time start = absl::Now();
  KVD_ASSIGN_OR_RETURN(Staged staged, StageLocked(pool, target_blocks));
  absl::MutexLock lock(&mu_);
  return PublishLocked(pool, caller, std::move(staged), target_blocks, start);
}

absl::StatusOr<PoolManager::Staged> PoolManager::StageLocked(Pool& pool, uint64_t target_blocks) {
  std::vector<PlannedChunk> plan;
  Staged staged;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return Stopping();
    KVD_ASSIGN_OR_RETURN(plan, pool.plan.geometry.PlanGrow(pool.prefix_bytes, target_blocks, options_.max_chunk_bytes));
    for (const PlannedChunk& p : plan) staged.bytes += p.bytes;
    if (committed_bytes_ + staged.bytes > budget_bytes_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pool ", pool.name, ": growing to ", target_blocks, " blocks needs ", staged.bytes, " bytes (",
                       FormatBytes(staged.bytes), ") but only ", budget_bytes_ - committed_bytes_, " bytes (",
                       FormatBytes(budget_bytes_ - committed_bytes_), ") of the daemon's budget of ",
                       FormatBytes(budget_bytes_), " are free"));
    }
    committed_bytes_ += staged.bytes;  // reserved now so that concurrent grows of other pools see it
  }
  absl::StatusOr<std::vector<ChunkRecord>> made = MakeChunks(pool, plan);
  if (!made.ok()) {
    {
      absl::MutexLock lock(&mu_);
      committed_bytes_ -= staged.bytes;
    }
    if (absl::IsResourceExhausted(made.status())) {
      absl::StatusOr<DeviceInfo> info = device_->Info();
      return absl::ResourceExhaustedError(
          absl::StrCat("pool ", pool.name, ": growing to ", target_blocks, " blocks needs ", staged.bytes, " bytes (",
                       FormatBytes(staged.bytes), ") but the device has ", info.ok() ? info->free_bytes : 0,
                       " bytes free: ", made.status().message()));
    }
    return made.status();
  }
  staged.chunks = *std::move(made);
  return staged;
}

void PoolManager::Unstage(const Pool& pool, Staged& staged) {
  for (ChunkRecord& r : staged.chunks) DiscardChunk(pool, r);
  staged.chunks.clear();
  absl::MutexLock lock(&mu_);
  committed_bytes_ -= staged.bytes;
  staged.bytes = 0;
}

PoolUpdate PoolManager::PublishLocked(Pool& pool, const Caller& caller, Staged staged, uint64_t target_blocks,
                                      absl::Time start) {
  PoolUpdate update;
  for (ChunkRecord& r : staged.chunks) {
    r.info.id = next_chunk_id_++;
    update.added.push_back(r.info);
    pool.chunks.push_back(std::move(r));
  }
  std::sort(pool.chunks.begin(), pool.chunks.end(), [](const ChunkRecord& a, const ChunkRecord& b) {
    return std::tie(a.info.segment, a.info.offset) < std::tie(b.info.segment, b.info.offset);
  });
  pool.prefix_bytes = pool.plan.geometry.PrefixBytes(target_blocks);
  ++pool.generation;
  std::vector<uint64_t> ids;
  for (const ChunkInfo& c : update.added) ids.push_back(c.id);
  // A client of the caller's own session gets its lease in the reply, so it can map the new blocks
  // before Grow returns; every other attached client learns of them through Watch.
  bool replied = false;
  for (auto& [id, client] : pool.clients) {
    for (const ChunkInfo& c : update.added) client.handed[c.id] = c.bytes;
    if (!replied && client.session == caller.session) {
      update.lease = IssueLeaseLocked(pool, client.session, ids);
      replied = true;
      continue;
    }
    PoolEvent e = pool.Event(EventType::kChunksAdded);
    e.chunks = update.added;
    e.lease = IssueLeaseLocked(pool, client.session, ids);
    client.events->Push(std::move(e));
  }
  update.pool = ViewLocked(pool);
  update.elapsed = absl::Now() - start;
  return update;
}

PoolUpdate PoolManager::ReleaseLocked(Pool& pool, uint64_t prefix_bytes) {
  const absl::Time start = absl::Now();
  std::vector<ChunkRecord> gone;
  PoolUpdate update;
  {
    absl::MutexLock lock(&mu_);
    // Whole chunks only: a chunk that straddles the new prefix stays, and the prefix ends after it.
    std::vector<ChunkRecord> kept;
    uint64_t kept_prefix = 0;
    for (ChunkRecord& r : pool.chunks) {
      const uint64_t start_in_segment = r.info.offset - pool.plan.geometry.SegmentOffset(r.info.segment);
      if (start_in_segment >= prefix_bytes) {
        gone.push_back(std::move(r));
      } else {
        kept_prefix = std::max(kept_prefix, start_in_segment + r.info.bytes);
        kept.push_back(std::move(r));
      }
    }
    pool.chunks.swap(kept);
    pool.prefix_bytes = kept_prefix;
    if (!gone.empty()) {
      ++pool.generation;
      Pool::Release release;
      for (const ChunkRecord& r : gone) {
        release.chunks.push_back(r.info);
        release.bytes += r.info.bytes;
        update.released_chunk_ids.push_back(r.info.id);
      }
      const uint64_t id = pool.next_release_id++;
      for (auto& [client_id, client] : pool.clients) {
        const bool holds = std::any_of(release.chunks.begin(), release.chunks.end(),
                                       [&](const ChunkInfo& c) { return client.handed.contains(c.id); });
        if (!holds) continue;
        release.waiting.insert(client_id);
        PoolEvent e = pool.Event(EventType::kChunksReleased);
        e.chunks = release.chunks;
        e.release_id = id;
        client.events->Push(std::move(e));
      }
      pool.releases.emplace(id, std::move(release));
      SettleReleasesLocked(pool);
      if (pool.releases.contains(id)) update.release_id = id;
    }
  }
  // The daemon's own references go now; clients' mappings keep the memory until they acknowledge.
  for (ChunkRecord& r : gone) DiscardChunk(pool, r);
  absl::MutexLock lock(&mu_);
  update.pool = ViewLocked(pool);
  update.elapsed = absl::Now() - start;
  return update;
}

void PoolManager::AwaitRelease(const Pool& pool, uint64_t release_id, absl::Time deadline) {
  if (release_id == 0) return;
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return pool.deleted || !pool.releases.contains(release_id); };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
}

absl::StatusOr<PoolUpdate> PoolManager::Shrink(const Caller& caller, absl::string_view name, uint64_t target_blocks,
                                               bool wait, absl::Time deadline) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  PoolUpdate update;
  {
    absl::MutexLock op(&pool->op_mu);
    {
      absl::MutexLock lock(&mu_);
      if (pool->deleted) return Gone(name);
      KVD_RETURN_IF_ERROR(CheckNotHeldLocked(*pool));
      if (pool->state == PoolState::kSleeping) return Sleeping(name);
      if (target_blocks >= pool->committed_blocks()) {
        return absl::InvalidArgumentError(absl::StrCat("target_blocks: ", target_blocks, " is not less than the ",
                                                       pool->committed_blocks(), " blocks pool ", name,
                                                       " has committed (use Grow to add)"));
      }
    }
    update = ReleaseLocked(*pool, pool->plan.geometry.PrefixBytes(target_blocks));
  }
  if (wait) {
    AwaitRelease(*pool, update.release_id, deadline);
    absl::MutexLock lock(&mu_);
    update.pool = ViewLocked(*pool);
  }
  return update;
}

absl::StatusOr<std::vector<PoolUpdate>> PoolManager::Sleep(const Caller& caller, absl::string_view name, bool wait,
                                                           absl::Time deadline) {
  std::vector<std::shared_ptr<Pool>> targets;
  if (name.empty()) {
    absl::MutexLock lock(&mu_);
    for (const auto& [n, pool] : pools_) {
      if (pool->allows(caller.uid, options_.daemon_uid) && pool->state == PoolState::kAwake) targets.push_back(pool);
    }
  } else {
    KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
    targets.push_back(std::move(pool));
  }
  std::vector<PoolUpdate> updates;
  for (const std::shared_ptr<Pool>& pool : targets) {
    absl::MutexLock op(&pool->op_mu);
    {
      absl::MutexLock lock(&mu_);
      if (pool->deleted || pool->state == PoolState::kSleeping) {
        if (name.empty()) continue;  // raced with another sleep or delete: nothing to do for --all
        if (pool->deleted) return Gone(name);
        return absl::FailedPreconditionError(absl::StrCat("pool ", name, " is already sleeping"));
      }
      KVD_RETURN_IF_ERROR(CheckNotHeldLocked(*pool));
      pool->wake_blocks = pool->committed_blocks();
      pool->state = PoolState::kSleeping;
    }
    updates.push_back(ReleaseLocked(*pool, 0));
  }
  if (wait) {
    for (size_t i = 0; i < updates.size(); ++i) {
      AwaitRelease(*targets[i], updates[i].release_id, deadline);
      absl::MutexLock lock(&mu_);
      updates[i].pool = ViewLocked(*targets[i]);
    }
  }
  return updates;
}

absl::StatusOr<std::vector<PoolUpdate>> PoolManager::Wake(const Caller& caller, absl::string_view name) {
  std::vector<std::shared_ptr<Pool>> targets;
  if (name.empty()) {
    absl::MutexLock lock(&mu_);
    for (const auto& [n, pool] : pools_) {
      if (pool->allows(caller.uid, options_.daemon_uid) && pool->state == PoolState::kSleeping) {
        targets.push_back(pool);
      }
    }
  } else {
    KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
    targets.push_back(std::move(pool));
  }
  std::vector<PoolUpdate> updates;
  for (const std::shared_ptr<Pool>& pool : targets) {
    absl::MutexLock op(&pool->op_mu);
    const absl::Time start = absl::Now();
    uint64_t blocks = 0;
    {
      absl::MutexLock lock(&mu_);
      if (pool->deleted || pool->state == PoolState::kAwake) {
        if (name.empty()) continue;
        if (pool->deleted) return Gone(name);
        return absl::FailedPreconditionError(absl::StrCat("pool ", name, " is already awake"));
      }
      KVD_RETURN_IF_ERROR(CheckNotHeldLocked(*pool));
      blocks = pool->wake_blocks;
    }
    // One chunk per segment for the whole previous size: sleep/wake also defragments. On failure the
    // pools woken so far stay awake and this one stays asleep.
    Staged staged;
    if (blocks > 0) {
      KVD_ASSIGN_OR_RETURN(staged, StageLocked(*pool, blocks));
    }
    absl::MutexLock lock(&mu_);
    // Awake before publishing, so that the CHUNKS_ADDED events say so.
    pool->state = PoolState::kAwake;
    pool->wake_blocks = 0;
    if (blocks > 0) {
      updates.push_back(PublishLocked(*pool, caller, std::move(staged), blocks, start));
    } else {
      updates.push_back(PoolUpdate{.pool = ViewLocked(*pool), .elapsed = absl::Now() - start});
    }
  }
  return updates;
}

// ---------------------------------------------------------------------------------------------
// Engine groups: prepare, commit, abort

absl::StatusOr<PreparedOp> PoolManager::Prepare(const Caller& caller, absl::string_view name, GroupOp op,
                                                uint64_t target_blocks, absl::Duration ttl) {
  const absl::Time start = absl::Now();
  if ((op == GroupOp::kSleep || op == GroupOp::kWake) && target_blocks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_blocks: must be unset for ", GroupOpName(op), " (it applies to grow and shrink)"));
  }
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op_lock(&pool->op_mu);
  uint64_t stage_blocks = 0;  // grow and wake: the committed blocks after Commit
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return Stopping();
    if (pool->deleted) return Gone(name);
    KVD_RETURN_IF_ERROR(CheckNotHeldLocked(*pool));
    const uint64_t committed = pool->committed_blocks();
    const bool awake = pool->state == PoolState::kAwake;
    switch (op) {
      case GroupOp::kGrow:
        if (!awake) return Sleeping(name);
        if (target_blocks <= committed) {
          return absl::InvalidArgumentError(absl::StrCat("target_blocks: ", target_blocks, " is not more than the ",
                                                         committed, " blocks pool ", name, " has committed"));
        }
        stage_blocks = target_blocks;
        break;
      case GroupOp::kShrink:
        if (!awake) return Sleeping(name);
        if (target_blocks >= committed) {
          return absl::InvalidArgumentError(absl::StrCat("target_blocks: ", target_blocks, " is not less than the ",
                                                         committed, " blocks pool ", name, " has committed"));
        }
        break;
      case GroupOp::kSleep:
        if (!awake) return absl::FailedPreconditionError(absl::StrCat("pool ", name, " is already sleeping"));
        break;
      case GroupOp::kWake:
        if (awake) return absl::FailedPreconditionError(absl::StrCat("pool ", name, " is already awake"));
        stage_blocks = pool->wake_blocks;
        break;
    }
  }
  Transaction txn{
      .id = RandomToken("t-"), .op = op, .target_blocks = target_blocks, .session = caller.session, .pid = caller.pid};
  if (stage_blocks > 0) {
    KVD_ASSIGN_OR_RETURN(txn.staged, StageLocked(*pool, stage_blocks));
  }
  {
    absl::MutexLock lock(&mu_);
    // Installed only while the session lives; CloseSession erases it under mu_ before it looks for
    // the transactions to abort, so no transaction outlives its session.
    if (sessions_.contains(caller.session)) {
      txn.expires = absl::Now() + ttl;
      PreparedOp prepared{.transaction = txn.id, .prepared_bytes = txn.staged.bytes, .expires = txn.expires};
      transactions_[txn.id] = pool->name;
      pool->txn = std::move(txn);
      reaper_kick_ = true;
      prepared.pool = ViewLocked(*pool);
      prepared.elapsed = absl::Now() - start;
      return prepared;
    }
  }
  // The session closed while the memory was made: nobody could commit this.
  Unstage(*pool, txn.staged);
  return absl::UnauthenticatedError("kvd-session: the session has closed");
}

absl::StatusOr<std::shared_ptr<PoolManager::Pool>> PoolManager::FindTransactionLocked(
    const Caller& caller, absl::string_view transaction) const {
  auto t = transactions_.find(transaction);
  if (t == transactions_.end()) {
    auto a = aborted_.find(transaction);
    if (a != aborted_.end()) {
      return absl::NotFoundError(absl::StrCat("transaction: ", transaction, " was aborted by the daemon: ", a->second));
    }
    return absl::NotFoundError(absl::StrCat("transaction: ", transaction, " is unknown or already ended"));
  }
  auto p = pools_.find(t->second);
  if (p == pools_.end() || !p->second->txn.has_value() || p->second->txn->id != transaction) {
    return absl::NotFoundError(absl::StrCat("transaction: ", transaction, " ended with its pool ", t->second));
  }
  if (p->second->txn->session != caller.session) {
    return absl::PermissionDeniedError(absl::StrCat("transaction: ", transaction,
                                                    " was prepared by another session (pid ", p->second->txn->pid,
                                                    "); only it may commit or abort"));
  }
  return p->second;
}

uint64_t PoolManager::AbortLocked(Pool& pool, absl::string_view transaction, absl::string_view why) {
  std::optional<Transaction> txn;
  {
    absl::MutexLock lock(&mu_);
    if (!pool.txn.has_value() || (!transaction.empty() && pool.txn->id != transaction)) return 0;
    txn = std::move(pool.txn);
    pool.txn.reset();
    transactions_.erase(txn->id);
    if (!why.empty()) {
      if (aborted_order_.size() >= kMaxAbortedRecords) {
        aborted_.erase(aborted_order_.front());
        aborted_order_.erase(aborted_order_.begin());
      }
      aborted_[txn->id] = std::string(why);
      aborted_order_.push_back(txn->id);
    }
  }
  const uint64_t bytes = txn->staged.bytes;
  Unstage(pool, txn->staged);
  return bytes;
}

absl::StatusOr<CommittedOp> PoolManager::Commit(const Caller& caller, absl::string_view transaction, bool wait,
                                                absl::Time deadline) {
  const absl::Time start = absl::Now();
  std::shared_ptr<Pool> pool;
  {
    absl::MutexLock lock(&mu_);
    KVD_ASSIGN_OR_RETURN(pool, FindTransactionLocked(caller, transaction));
  }
  CommittedOp result;
  {
    absl::MutexLock op(&pool->op_mu);
    uint64_t release_prefix = 0;
    absl::Duration late = absl::ZeroDuration();
    {
      absl::MutexLock lock(&mu_);
      // Ended (reaper, a closed session, a forced delete) between the lookup and op_mu?
      KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> again, FindTransactionLocked(caller, transaction));
      (void)again;
      late = absl::Now() - pool->txn->expires;
    }
    if (late > absl::ZeroDuration()) {
      AbortLocked(*pool, transaction, "not committed within its ttl");
      return absl::AbortedError(absl::StrCat("transaction: ", transaction, " expired ",
                                             absl::FormatDuration(absl::Trunc(late, absl::Milliseconds(1))),
                                             " ago and was aborted; prepare again"));
    }
    {
      absl::MutexLock lock(&mu_);
      Transaction txn = *std::move(pool->txn);
      pool->txn.reset();
      transactions_.erase(txn.id);
      result.op = txn.op;
      switch (txn.op) {
        case GroupOp::kGrow:
          result.update = PublishLocked(*pool, caller, std::move(txn.staged), txn.target_blocks, start);
          break;
        case GroupOp::kWake: {
          const uint64_t blocks = pool->wake_blocks;
          pool->state = PoolState::kAwake;
          pool->wake_blocks = 0;
          if (blocks > 0) {
            result.update = PublishLocked(*pool, caller, std::move(txn.staged), blocks, start);
          } else {
            result.update.pool = ViewLocked(*pool);
          }
          break;
        }
        case GroupOp::kShrink:
          release_prefix = pool->plan.geometry.PrefixBytes(txn.target_blocks);
          break;
        case GroupOp::kSleep:
          pool->wake_blocks = pool->committed_blocks();
          pool->state = PoolState::kSleeping;
          break;
      }
    }
    if (result.op == GroupOp::kShrink || result.op == GroupOp::kSleep) {
      result.update = ReleaseLocked(*pool, release_prefix);
    }
  }
  if (wait) {
    AwaitRelease(*pool, result.update.release_id, deadline);
    absl::MutexLock lock(&mu_);
    result.update.pool = ViewLocked(*pool);
  }
  result.update.elapsed = absl::Now() - start;
  return result;
}

absl::StatusOr<uint64_t> PoolManager::Abort(const Caller& caller, absl::string_view transaction) {
  std::shared_ptr<Pool> pool;
  {
    absl::MutexLock lock(&mu_);
    KVD_ASSIGN_OR_RETURN(pool, FindTransactionLocked(caller, transaction));
  }
  absl::MutexLock op(&pool->op_mu);
  {
    absl::MutexLock lock(&mu_);
    KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> again, FindTransactionLocked(caller, transaction));
    (void)again;
  }
  return AbortLocked(*pool, transaction, "");
}

void PoolManager::ReapExpired() {
  mu_.Lock();
  while (!stopping_) {
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    std::vector<std::shared_ptr<Pool>> expired;
    for (const auto& [name, pool] : pools_) {
      if (!pool->txn.has_value()) continue;
      if (pool->txn->expires <= now) {
        expired.push_back(pool);
      } else {
        next = std::min(next, pool->txn->expires);
      }
    }
    if (!expired.empty()) {
      mu_.Unlock();
      for (const std::shared_ptr<Pool>& pool : expired) {
        absl::MutexLock op(&pool->op_mu);
        std::string id;
        {
          absl::MutexLock lock(&mu_);
          if (pool->txn.has_value() && pool->txn->expires <= absl::Now()) id = pool->txn->id;
        }
        if (!id.empty()) AbortLocked(*pool, id, "not committed within its ttl");
      }
      mu_.Lock();
      continue;
    }
    reaper_kick_ = false;
    auto woken = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || reaper_kick_; };
    mu_.AwaitWithDeadline(absl::Condition(&woken), next);
  }
  mu_.Unlock();
}

absl::StatusOr<PoolView> PoolManager::GrantPeerAccess(const Caller& caller, absl::string_view name,
                                                      absl::string_view device_uuid, bool revoke) {
  KVD_RETURN_IF_ERROR(ValidateDeviceUuid(device_uuid, "device_uuid", true));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock lock(&mu_);
  if (pool->deleted) return Gone(name);
  auto it = std::find(pool->peer_devices.begin(), pool->peer_devices.end(), device_uuid);
  if (revoke) {
    if (it == pool->peer_devices.end()) {
      return absl::NotFoundError(absl::StrCat("device_uuid: ", device_uuid, " is not granted on pool ", name));
    }
    pool->peer_devices.erase(it);
  } else if (it == pool->peer_devices.end()) {
    pool->peer_devices.emplace_back(device_uuid);
  }
  return ViewLocked(*pool);
}

// ---------------------------------------------------------------------------------------------
// Block operations

absl::Status PoolManager::ZeroBlocks(const Caller& caller, absl::string_view name, absl::Span<const uint64_t> blocks) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu);
  BlockSpan span;
  {
    absl::MutexLock lock(&mu_);
    if (pool->deleted) return Gone(name);
    if (pool->state == PoolState::kSleeping) return Sleeping(name);
    span = pool->plan.geometry.Span(pool->base, pool->committed_blocks());
  }
  return device_->ZeroBlocks(span, blocks);
}

absl::Status PoolManager::CopyBlocks(const Caller& caller, absl::string_view name, absl::Span<const BlockCopy> copies) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu);
  BlockSpan span;
  {
    absl::MutexLock lock(&mu_);
    if (pool->deleted) return Gone(name);
    if (pool->state == PoolState::kSleeping) return Sleeping(name);
    span = pool->plan.geometry.Span(pool->base, pool->committed_blocks());
  }
  return device_->CopyBlocks(span, copies);
}

// ---------------------------------------------------------------------------------------------
// Handle channel and shutdown

absl::StatusOr<std::vector<PoolManager::LeasedFd>> PoolManager::RedeemLease(absl::string_view session,
                                                                            absl::string_view lease_token,
                                                                            uint32_t peer_uid) {
  absl::MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return absl::UnauthenticatedError("session_token: unknown or closed session");
  if (s->second.uid != peer_uid) {
    return absl::PermissionDeniedError(
        absl::StrCat("uid ", peer_uid, " may not use the session of uid ", s->second.uid));
  }
  auto l = leases_.find(lease_token);
  if (l == leases_.end()) return absl::NotFoundError("lease_token: unknown or already used lease");
  if (l->second.session != session) return absl::PermissionDeniedError("lease_token: issued to another session");
  const LeaseRecord lease = std::move(l->second);
  leases_.erase(l);  // single use, whatever happens next
  if (lease.expires < absl::Now()) {
    return absl::DeadlineExceededError(absl::StrCat("lease_token: expired ",
                                                    absl::FormatDuration(absl::Now() - lease.expires),
                                                    " ago; attach again for a new lease"));
  }
  auto p = pools_.find(lease.pool);
  if (p == pools_.end()) return absl::FailedPreconditionError(absl::StrCat("pool ", lease.pool, " was deleted"));
  std::vector<LeasedFd> out;
  absl::Cleanup close_all = [&] {
    for (const LeasedFd& f : out) close(f.fd);
  };
  for (uint64_t id : lease.chunk_ids) {
    auto r = std::find_if(p->second->chunks.begin(), p->second->chunks.end(),
                          [&](const ChunkRecord& c) { return c.info.id == id; });
    if (r == p->second->chunks.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", id, " of pool ", lease.pool, " was released after the lease was issued"));
    }
    const int fd = fcntl(r->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      const int err = errno;
      return absl::ResourceExhaustedError(absl::StrCat("fcntl(F_DUPFD_CLOEXEC): ", std::strerror(err)));
    }
    out.push_back({id, fd});
  }
  std::move(close_all).Cancel();
  return out;
}

void PoolManager::Shutdown() {
  std::vector<std::shared_ptr<Pool>> pools;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [name, pool] : pools_) pools.push_back(pool);
    pools_.clear();
  }
  if (reaper_.joinable()) reaper_.join();
  for (const std::shared_ptr<Pool>& pool : pools) {
    absl::MutexLock op(&pool->op_mu);
    DestroyLocked(*pool, EventType::kDaemonStopping);
  }
}

}  // namespace kvd::daemon
