#include "daemon/core/pool.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvd/status.h"
#include "kvd/units.h"

namespace kvd::daemon {
namespace {

absl::Status Sleeping(absl::string_view pool) {
  return absl::FailedPreconditionError(absl::StrCat("pool ", pool, " is sleeping: wake it first"));
}

absl::Status Recovering(absl::string_view pool, size_t missing) {
  return absl::UnavailableError(absl::StrCat("pool ", pool, " is recovering after a kvd restart: ", missing,
                                             " chunks not yet given back by the clients that map them; retry"));
}

}  // namespace

absl::Status PoolGone(absl::string_view pool) {
  return absl::NotFoundError(absl::StrCat("pool ", pool, " does not exist"));
}

Pool::Pool(const PoolSpec& spec, PoolPlan plan, uint32_t owner_uid, const PoolShared& shared)
    : name_(spec.name),
      plan_(std::move(plan)),
      owner_uid_(owner_uid),
      allowed_uids_(spec.allowed_uids),
      group_(spec.group),
      created_at_(absl::Now()),
      shared_(shared),
      table_(&plan_.geometry),
      peer_devices_(spec.peer_devices),
      releases_(shared.budget) {}

Pool::Pool(const SavedPool& saved, PoolPlan plan, const PoolShared& shared)
    : name_(saved.name),
      plan_(std::move(plan)),
      owner_uid_(saved.owner_uid),
      allowed_uids_(saved.allowed_uids),
      group_(saved.group),
      created_at_(saved.created_at),
      shared_(shared),
      state_(saved.state),
      wake_blocks_(saved.wake_blocks),
      kept_(saved.kept),
      table_(&plan_.geometry, saved.prefix_bytes),
      generation_(saved.generation),
      peer_devices_(saved.peer_devices),
      releases_(shared.budget, saved.pending_release_bytes),
      metadata_(saved.metadata),
      resume_state_(saved.state) {}

bool Pool::Allows(uint32_t uid) const {
  return uid == 0 || uid == shared_.daemon_uid || uid == owner_uid_ ||
         std::find(allowed_uids_.begin(), allowed_uids_.end(), uid) != allowed_uids_.end();
}

// ---------------------------------------------------------------------------------------------
// Views

PoolView Pool::View(ViewClients clients) const {
  absl::MutexLock lock(&mu_);
  return ViewLocked(clients);
}

PoolSummary Pool::Summary() const {
  absl::MutexLock lock(&mu_);
  return PoolSummary{.state = state_,
                     .committed_blocks = committed_blocks(),
                     .committed_bytes = committed_bytes(),
                     .chunks = table_.size(),
                     .clients = clients_.size(),
                     .transaction = txn_.has_value() ? txn_->id : std::string()};
}

PoolState Pool::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

bool Pool::deleted() const {
  absl::MutexLock lock(&mu_);
  return deleted_;
}

uint64_t Pool::pending_bytes() const {
  absl::MutexLock lock(&mu_);
  return releases_.PendingBytes();
}

PoolView Pool::ViewLocked(ViewClients clients) const {
  PoolView v{.name = name_,
             .state = state_,
             .geometry = plan_.geometry,
             .layout = plan_.layout,
             .committed_blocks = committed_blocks(),
             .committed_bytes = committed_bytes(),
             .reserved_bytes = plan_.geometry.reserved_bytes(),
             .pending_release_bytes = releases_.PendingBytes(),
             .wake_blocks = wake_blocks_,
             .kept_bytes = kept_ ? kept_->bytes : 0,
             .owner_uid = owner_uid_,
             .allowed_uids = allowed_uids_,
             .generation = generation_,
             .created_at = created_at_,
             .group = group_,
             .peer_devices = peer_devices_,
             .transaction = txn_.has_value() ? txn_->id : std::string(),
             .epoch = shared_.epoch,
             .metadata_version = metadata_.version,
             .metadata_bytes = metadata_.data.size(),
             .missing_chunk_ids = {table_.missing().begin(), table_.missing().end()},
             .client_count = clients_.size()};
  for (const auto& [id, c] : clients_) {
    if (clients == ViewClients::kCounted) break;
    uint64_t mapped = 0;
    for (const auto& [chunk, bytes] : c.handed) mapped += bytes;
    v.clients.push_back({.id = c.id,
                         .name = c.name,
                         .uid = c.uid,
                         .pid = c.pid,
                         .mapped_bytes = mapped,
                         .attached_at = c.attached_at,
                         .device_uuid = c.device_uuid,
                         .pausable = c.pausable});
  }
  v.chunks = table_.Infos();
  if (shared_.arbiter != nullptr) v.claim = shared_.arbiter->Claim(name_);
  return v;
}

size_t Pool::AskReclaim(uint64_t reclaim_id, uint64_t bytes, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (deleted_) return 0;
  for (auto& [id, c] : clients_) {
    PoolEvent e = EventLocked(EventType::kReclaim);
    e.reclaim_id = reclaim_id;
    e.reclaim_bytes = bytes;
    e.reclaim_deadline = deadline;
    c.events->Push(std::move(e));
  }
  return clients_.size();
}

PoolEvent Pool::EventLocked(EventType type) {
  PoolEvent e;
  e.sequence = ++event_sequence_;
  e.pool = name_;
  e.type = type;
  e.committed_blocks = committed_blocks();
  e.state = state_;
  return e;
}

// ---------------------------------------------------------------------------------------------
// The resize state machine

absl::Status Pool::RequireLocked(unsigned needs) const {
  if (deleted_) return PoolGone(name_);
  if ((needs & (kNotRecovering | kAwake)) != 0 && state_ == PoolState::kRecovering) {
    return Recovering(name_, table_.missing().size());
  }
  if ((needs & kNotHeld) != 0 && txn_.has_value()) {
    return absl::AbortedError(
        absl::StrCat("pool ", name_, " is held by group transaction ", txn_->id, " (", GroupOpName(txn_->change.op),
                     ", prepared by pid ", txn_->pid, ") until it commits or aborts (at the latest in ",
                     absl::FormatDuration(absl::Trunc(txn_->expires - absl::Now(), absl::Milliseconds(1))), ")"));
  }
  if ((needs & kAwake) != 0 && state_ != PoolState::kAwake) return Sleeping(name_);
  return absl::OkStatus();
}

absl::StatusOr<Change> Pool::Check(GroupOp op, uint64_t target_blocks) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(op, target_blocks, /*tails_ok=*/false);
}

absl::StatusOr<Change> Pool::CheckLocked(GroupOp op, uint64_t target_blocks, bool tails_ok) const {
  KVD_RETURN_IF_ERROR(RequireLocked(kNotRecovering | kNotHeld));
  const uint64_t committed = committed_blocks();
  const bool awake = state_ == PoolState::kAwake;
  // A grow would plan new chunks over the tails, a release of whole chunks would keep them: both wait
  // until the tails are replaced (see the invariants in pool.h).
  if (awake && !tails_ok && (op == GroupOp::kGrow || op == GroupOp::kShrink)) {
    if (const uint64_t tails = table_.TailBytes(); tails > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("pool ", name_, ": an exact shrink stopped between its steps, and ", tails, " bytes (",
                       FormatBytes(tails), ") of chunks still run past its ", committed,
                       " committed blocks: Compact the pool (or shrink it exactly) to replace them first"));
    }
  }
  Change change{.op = op, .target_blocks = target_blocks};
  switch (op) {
    case GroupOp::kGrow:
      if (!awake) return Sleeping(name_);
      if (target_blocks <= committed) {
        return absl::InvalidArgumentError(absl::StrCat("target_blocks: ", target_blocks, " is not more than the ",
                                                       committed, " blocks pool ", name_,
                                                       " already has committed (use Shrink to release)"));
      }
      break;
    case GroupOp::kShrink:
      if (!awake) return Sleeping(name_);
      if (target_blocks >= committed) {
        return absl::InvalidArgumentError(absl::StrCat("target_blocks: ", target_blocks, " is not less than the ",
                                                       committed, " blocks pool ", name_,
                                                       " has committed (use Grow to add)"));
      }
      break;
    case GroupOp::kSleep:
      if (!awake) return absl::FailedPreconditionError(absl::StrCat("pool ", name_, " is already sleeping"));
      break;
    case GroupOp::kWake:
      if (awake) return absl::FailedPreconditionError(absl::StrCat("pool ", name_, " is already awake"));
      change.target_blocks = wake_blocks_;
      break;
  }
  return change;
}

absl::StatusOr<uint64_t> Pool::GrowBytes(uint64_t target_blocks) const {
  const Geometry& g = plan_.geometry;
  if (target_blocks > g.dims().capacity_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("target_blocks: ", target_blocks, " exceeds the capacity of ",
                                                   g.dims().capacity_blocks, " blocks"));
  }
  const uint64_t to = g.PrefixBytes(target_blocks);
  absl::MutexLock lock(&mu_);
  // Both prefixes lie inside the reservation, so the product cannot overflow.
  const uint64_t prefix = table_.prefix_bytes();
  return to > prefix ? (to - prefix) * g.segments() : 0;
}

absl::StatusOr<std::vector<PlannedChunk>> Pool::PlanGrow(uint64_t target_blocks, uint64_t max_chunk_bytes) const {
  uint64_t prefix = 0;
  {
    absl::MutexLock lock(&mu_);
    prefix = table_.prefix_bytes();
  }
  // Planned outside the state lock: readers (views, the handle channel, metrics) never wait for it.
  return plan_.geometry.PlanGrow(prefix, target_blocks, max_chunk_bytes);
}

PoolUpdate Pool::Apply(Change change, absl::string_view session, std::vector<ChunkRecord>* released) {
  absl::MutexLock lock(&mu_);
  switch (change.op) {
    case GroupOp::kGrow:
      return PublishLocked(std::move(change.staged), change.target_blocks, session);
    case GroupOp::kWake:
      // Awake before publishing, so that the CHUNKS_ADDED events say so. One chunk per segment for the
      // whole previous size: sleep and wake also defragment.
      state_ = PoolState::kAwake;
      wake_blocks_ = 0;
      if (change.restored) kept_.reset();
      if (change.target_blocks > 0) return PublishLocked(std::move(change.staged), change.target_blocks, session);
      return PoolUpdate{.pool = ViewLocked(ViewClients::kCounted)};
    case GroupOp::kShrink:
      return ReleaseLocked(plan_.geometry.PrefixBytes(change.target_blocks), released, session, change.forced);
    case GroupOp::kSleep:
      wake_blocks_ = committed_blocks();
      state_ = PoolState::kSleeping;
      kept_ = std::move(change.kept);
      return ReleaseLocked(0, released, session, change.forced);
  }
  return PoolUpdate{.pool = ViewLocked(ViewClients::kCounted)};
}

PoolUpdate Pool::PublishLocked(Staged staged, uint64_t target_blocks, absl::string_view session) {
  PoolUpdate update;
  update.added = table_.Publish(std::move(staged.chunks), plan_.geometry.PrefixBytes(target_blocks));
  ++generation_;
  std::vector<uint64_t> ids;
  for (const ChunkInfo& c : update.added) ids.push_back(c.id);
  // See Note [The grower maps first] in docs/architecture.md.
  // A client of the caller's own session gets its lease in the reply, so it can map the new blocks
  // before the call returns; every other attached client learns of them through Watch.
  bool replied = false;
  for (auto& [id, client] : clients_) {
    for (const ChunkInfo& c : update.added) client.handed[c.id] = c.bytes;
    if (!replied && client.session == session) {
      update.lease = shared_.leases->Issue(name_, client.session, id, ids);
      replied = true;
      continue;
    }
    PoolEvent e = EventLocked(EventType::kChunksAdded);
    e.chunks = update.added;
    e.lease = shared_.leases->Issue(name_, client.session, id, ids);
    client.events->Push(std::move(e));
  }
  update.pool = ViewLocked(ViewClients::kCounted);
  return update;
}

PoolUpdate Pool::ReleaseLocked(uint64_t prefix_bytes, std::vector<ChunkRecord>* released, absl::string_view session,
                               bool forced) {
  PoolUpdate update;
  Release release;
  release.chunks = table_.TakeFrom(prefix_bytes, released);
  if (!release.chunks.empty()) {
    ++generation_;
    for (const ChunkInfo& info : release.chunks) {
      release.bytes += info.bytes;
      update.released_chunk_ids.push_back(info.id);
    }
  }
  update.release_id = AnnounceReleaseLocked(std::move(release), session, forced);
  update.pool = ViewLocked(ViewClients::kCounted);
  return update;
}

uint64_t Pool::AnnounceReleaseLocked(Release release, absl::string_view session, bool forced) {
  const uint64_t id = release.chunks.empty() ? 0 : releases_.NextId();
  const std::optional<Pause> pause = pause_.End();
  for (auto& [client_id, client] : clients_) {
    const bool holds = ReleaseLedger::Holds(client.handed, release.chunks);
    if (holds) release.waiting.insert(client_id);
    if (pause.has_value() && pause->asked.contains(client_id)) {
      // Paused for this release: it unmaps the chunks and then resumes.
      PoolEvent e = EventLocked(EventType::kResume);
      e.pause_id = pause->id;
      e.applied = true;
      e.chunks = release.chunks;
      e.release_id = holds ? id : 0;
      client.events->Push(std::move(e));
      continue;
    }
    if (!holds) continue;
    PoolEvent e = EventLocked(EventType::kChunksReleased);
    e.chunks = release.chunks;
    e.release_id = id;
    e.forced = forced && client.session != session;
    client.events->Push(std::move(e));
  }
  return releases_.Open(id, std::move(release));
}

Pool::Bystanders Pool::BystandersOf(absl::string_view session) const {
  absl::MutexLock lock(&mu_);
  Bystanders out;
  for (const auto& [id, c] : clients_) {
    if (!session.empty() && c.session == session) continue;
    if (c.pausable) {
      out.pausable.insert(id);
    } else {
      out.unpausable.push_back({.id = c.id, .name = c.name, .uid = c.uid, .pid = c.pid, .pausable = false});
    }
  }
  return out;
}

std::vector<ChunkInfo> Pool::Leaving(uint64_t prefix_bytes) const {
  absl::MutexLock lock(&mu_);
  return table_.Leaving(prefix_bytes);
}

size_t Pool::AwaitRelease(uint64_t release_id, absl::Time deadline) {
  if (release_id == 0) return 0;
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return deleted_ || !releases_.Pending(release_id); };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  const Release* r = releases_.Find(release_id);
  return r == nullptr ? 0 : r->waiting.size();
}

// ---------------------------------------------------------------------------------------------
// Reshaping: see Note [Chunks are replaced, not cut] in docs/architecture.md.

absl::StatusOr<ReshapePlan> Pool::PlanShrink(uint64_t target_blocks, bool whole_chunks_only,
                                             const std::optional<std::vector<uint64_t>>& live,
                                             std::optional<uint64_t> max_added_bytes) const {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(CheckLocked(GroupOp::kShrink, target_blocks, /*tails_ok=*/!whole_chunks_only).status());
  return daemon::PlanShrink(table_, name_, target_blocks, whole_chunks_only, live, max_added_bytes);
}

absl::StatusOr<ReshapePlan> Pool::PlanTails(std::optional<uint64_t> max_added_bytes) const {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(kAwake));
  return daemon::PlanTails(table_, max_added_bytes);
}

PoolUpdate Pool::ReleaseFrom(uint64_t prefix_bytes, std::vector<ChunkRecord>* released, absl::string_view session) {
  absl::MutexLock lock(&mu_);
  return ReleaseLocked(prefix_bytes, released, session, /*forced=*/false);
}

absl::StatusOr<ReshapePlan> Pool::PlanCompact(uint64_t max_chunk_bytes, std::optional<size_t> max_replaced,
                                              std::optional<uint64_t> max_added_bytes, bool smaller) const {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(kNotHeld | kAwake));
  return daemon::PlanCompact(table_, max_chunk_bytes, max_replaced, max_added_bytes, smaller);
}

absl::Status Pool::CheckPausable(absl::string_view what) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, c] : clients_) {
    if (c.pausable) continue;
    return absl::FailedPreconditionError(
        absl::StrCat(what, " moves bytes of pool ", name_,
                     " between chunks, which needs every attached client to pause, but client ", id, " (\"", c.name,
                     "\", pid ", c.pid, ") did not opt in to pauses (AttachRequest.pausable)"));
  }
  return absl::OkStatus();
}

size_t Pool::BeginPause(const std::vector<ChunkRecord>& added, const std::set<std::string>* only,
                        std::vector<ByteRange> ranges) {
  absl::MutexLock lock(&mu_);
  const Pause& pause = pause_.Begin(added, std::move(ranges));
  std::vector<uint64_t> ids;
  for (const ChunkRecord& r : added) ids.push_back(r.info.id);
  for (auto& [id, client] : clients_) {
    if (only != nullptr && !only->contains(id)) continue;
    PoolEvent e = EventLocked(EventType::kPause);
    e.pause_id = pause.id;
    e.chunks = pause.added;
    e.ranges = pause.ranges;
    if (!ids.empty()) e.lease = shared_.leases->Issue(name_, client.session, id, ids, pause.id);
    for (const ChunkInfo& c : pause.added) client.handed[c.id] = c.bytes;
    client.events->Push(std::move(e));
    pause_.Ask(id);
  }
  return pause_.Seal();
}

Pool::PauseOutcome Pool::AwaitPause(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return pause_.Settled(); };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  PauseOutcome outcome;
  const Pause* pause = pause_.get();
  if (pause == nullptr) return outcome;
  for (const std::string& id : pause->waiting) {
    const Client& c = clients_.at(id);
    outcome.late.push_back({.id = c.id, .name = c.name, .uid = c.uid, .pid = c.pid});
  }
  // A client that acknowledged and then went away (its session ended) no longer counts.
  for (const std::string& id : pause->acknowledged) {
    if (clients_.contains(id)) outcome.paused.insert(id);
  }
  return outcome;
}

size_t Pool::AwaitClients(uint64_t release_id, const std::set<std::string>& clients, absl::Time deadline) {
  if (release_id == 0 || clients.empty()) return 0;
  absl::MutexLock lock(&mu_);
  auto still = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) -> size_t {
    const Release* r = releases_.Find(release_id);
    if (deleted_ || r == nullptr) return 0;
    return static_cast<size_t>(
        std::count_if(clients.begin(), clients.end(), [&](const std::string& id) { return r->waiting.contains(id); }));
  };
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return still() == 0; };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  return still();
}

void Pool::DetachUnresponsive(const std::string& client_id) {
  absl::MutexLock lock(&mu_);
  if (clients_.contains(client_id)) DetachLocked(client_id, /*keep_holding=*/true);
}

absl::Status Pool::AcknowledgePause(const Caller& caller, absl::string_view client_id, uint64_t pause_id) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Client * c, OwnClientLocked(caller, client_id));
  if (!pause_.Acknowledge(c->id, pause_id)) {
    return absl::NotFoundError(
        absl::StrCat("pause_id: ", pause_id, " is not awaiting an acknowledgement from client ", client_id));
  }
  return absl::OkStatus();
}

void Pool::CancelPause() {
  absl::MutexLock lock(&mu_);
  const std::optional<Pause> pause = pause_.End();
  if (!pause.has_value()) return;
  for (const std::string& id : pause->asked) {
    auto it = clients_.find(id);
    if (it == clients_.end()) continue;
    for (const ChunkInfo& c : pause->added) it->second.handed.erase(c.id);
    // Its lease, not fetched yet, now answers ABORTED: Note [A called-off pause's lease].
    if (!pause->added.empty() && !it->second.fetched.contains(pause->added.front().id)) {
      it->second.called_off.insert(pause->id);
    }
    PoolEvent e = EventLocked(EventType::kResume);
    e.pause_id = pause->id;
    e.applied = false;
    it->second.events->Push(std::move(e));
  }
}

std::vector<ChunkRecord*> Pool::UnmappedChunks() {
  absl::MutexLock lock(&mu_);
  return table_.Unmapped();
}

std::vector<ChunkRecord*> Pool::ChunksById(const std::vector<uint64_t>& ids) {
  absl::MutexLock lock(&mu_);
  std::vector<ChunkRecord*> out;
  for (uint64_t id : ids) out.push_back(table_.Find(id));
  return out;
}

PoolUpdate Pool::ApplyReshape(const ReshapePlan& plan, std::vector<ChunkRecord> added,
                              std::vector<ChunkRecord>* removed) {
  absl::MutexLock lock(&mu_);
  std::set<uint64_t> gone(plan.replaced.begin(), plan.replaced.end());
  gone.insert(plan.released.begin(), plan.released.end());
  PoolUpdate update;
  for (const ChunkRecord& r : added) update.added.push_back(r.info);
  Release release;
  release.chunks = table_.Replace(gone, std::move(added), removed, plan.prefix_bytes);
  for (const ChunkInfo& c : release.chunks) {
    release.bytes += c.bytes;
    update.released_chunk_ids.push_back(c.id);
  }
  ++generation_;
  // Every attached client was asked to pause (Attach waits for op_mu): each gets its RESUME.
  update.release_id = AnnounceReleaseLocked(std::move(release), /*session=*/{}, /*forced=*/false);
  update.pool = ViewLocked(ViewClients::kCounted);
  return update;
}

// ---------------------------------------------------------------------------------------------
// Transactions

std::optional<Transaction> Pool::Hold(Transaction txn, const SessionTable& sessions) {
  absl::MutexLock lock(&mu_);
  // The session's end erases it from `sessions` before it looks for its transactions here, so checking
  // and installing under this lock means no transaction outlives its session.
  if (deleted_ || !sessions.Contains(txn.session)) return txn;
  txn_ = std::move(txn);
  return std::nullopt;
}

absl::StatusOr<Transaction> Pool::Unhold(absl::string_view id, std::optional<absl::string_view> session) {
  absl::MutexLock lock(&mu_);
  if (!txn_.has_value() || txn_->id != id) {
    return absl::NotFoundError(absl::StrCat("transaction: ", id, " ended with its pool ", name_));
  }
  if (session.has_value() && txn_->session != *session) {
    return absl::PermissionDeniedError(absl::StrCat("transaction: ", id, " was prepared by another session (pid ",
                                                    txn_->pid, "); only it may commit or abort"));
  }
  Transaction txn = *std::move(txn_);
  txn_.reset();
  return txn;
}

std::optional<std::string> Pool::HeldBy(absl::string_view session) const {
  absl::MutexLock lock(&mu_);
  if (txn_.has_value() && txn_->session == session) return txn_->id;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Clients

absl::StatusOr<AttachResult> Pool::Attach(const Caller& caller, absl::string_view client_name,
                                          absl::string_view peer_device, bool pausable, const SessionTable& sessions) {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(kNotRecovering));
  if (!peer_device.empty() && std::none_of(peer_devices_.begin(), peer_devices_.end(),
                                           [&](const std::string& d) { return d == "*" || d == peer_device; })) {
    return absl::PermissionDeniedError(absl::StrCat(
        "device_uuid: pool ", name_, " lives on device ", shared_.device_uuid, " and is not granted to device ",
        peer_device, " (grant it: kvctl grant ", name_, " ", peer_device, ", or create it with peer_devices)"));
  }
  // Checked under this lock for the same reason as in Hold: a closing session detaches what it finds.
  if (!sessions.Contains(caller.session)) return absl::UnauthenticatedError("kvd-session: the session has closed");
  if (shared_.limits != nullptr) {
    KVD_RETURN_IF_ERROR(CheckCount(absl::StrCat("clients of pool ", name_), caller.uid, 0, 0, std::nullopt,
                                   clients_.size(), shared_.limits->max_clients_per_pool, Limit::kMaxClientsPerPool,
                                   *shared_.limits));
  }
  Client c{.id = RandomToken("c-"),
           .name = client_name.empty() ? caller.name : std::string(client_name),
           .uid = caller.uid,
           .pid = caller.pid,
           .session = caller.session,
           .attached_at = absl::Now(),
           .device_uuid = std::string(peer_device),
           .pausable = pausable};
  std::vector<uint64_t> ids;
  for (const ChunkRecord& r : table_.chunks()) {
    ids.push_back(r.info.id);
    c.handed[r.info.id] = r.info.bytes;
  }
  // The session's detached clients of this pool (a follower whose stream broke, re-attaching) hand what
  // they still hold to the new client: it is told of their unsettled releases, so that its
  // acknowledgement, not the session's end, settles them.
  releases_.HandOver(caller.session, c.id, &c.handed, &c.fetched,
                     [&](uint64_t release_id, const Release& release) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                       PoolEvent e = EventLocked(EventType::kChunksReleased);
                       e.chunks = release.chunks;
                       e.release_id = release_id;
                       c.events->Push(std::move(e));
                     });
  // A reclaim under way asks the new client too: it may be the engine coming back (after a restart, or
  // its stream broke) to answer it. Only what is still wanted is asked.
  if (shared_.arbiter != nullptr) {
    const ReclaimView r = shared_.arbiter->Claim(name_).reclaim;
    if (r.id != 0 && r.asked_bytes > r.given_bytes) {
      PoolEvent e = EventLocked(EventType::kReclaim);
      e.reclaim_id = r.id;
      e.reclaim_bytes = r.asked_bytes - r.given_bytes;
      e.reclaim_deadline = r.deadline;
      c.events->Push(std::move(e));
    }
  }
  AttachResult result{.client_id = c.id};
  result.lease = shared_.leases->Issue(name_, caller.session, c.id, std::move(ids));
  clients_.emplace(c.id, std::move(c));
  result.pool = ViewLocked(ViewClients::kCounted);
  return result;
}

// See Note [A detached client still holds its chunks] in docs/architecture.md.
void Pool::DetachLocked(const std::string& client_id, bool keep_holding) {
  shared_.leases->DropClient(client_id);
  pause_.Forget(client_id);
  auto it = clients_.find(client_id);
  if (it == clients_.end()) {
    releases_.Forget(client_id);
    return;
  }
  Client& c = it->second;
  c.events->Close();
  // What it may still map: the chunks it was handed and whose FDs it fetched. A chunk whose lease it
  // never redeemed (it expired, say) was never in its hands.
  Handed held;
  for (const auto& [id, bytes] : c.handed) {
    if (c.fetched.contains(id)) held[id] = bytes;
  }
  // Before the erase: `client_id` may be the map's own key.
  releases_.Detach(client_id, c.session, std::move(held), keep_holding);
  clients_.erase(it);
}

absl::Status Pool::Detach(const Caller& caller, absl::string_view client_id, bool released) {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client_id);
  if (it == clients_.end()) {
    // A client the daemon detached already (its Watch stream ended) declares what it held unmapped.
    const Holder* h = releases_.FindHolder(client_id);
    if (released && h != nullptr && h->session == caller.session) {
      DetachLocked(std::string(client_id), /*keep_holding=*/false);
      return absl::OkStatus();
    }
    return absl::NotFoundError(absl::StrCat("client_id: ", client_id, " is not attached"));
  }
  if (it->second.session != caller.session && !Allows(caller.uid)) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", caller.uid, " may not detach client ", client_id));
  }
  // Only the client's own session can say what it unmapped; anyone else's detach leaves it holding.
  DetachLocked(it->first, /*keep_holding=*/!(released && it->second.session == caller.session));
  return absl::OkStatus();
}

std::vector<std::string> Pool::DetachSession(absl::string_view session) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> gone;
  for (const auto& [id, client] : clients_) {
    if (client.session == session) gone.push_back(id);
  }
  std::vector<std::string> held = releases_.HoldersOf(session);
  for (const std::string& id : gone) DetachLocked(id, /*keep_holding=*/false);
  for (const std::string& id : held) DetachLocked(id, /*keep_holding=*/false);
  gone.insert(gone.end(), held.begin(), held.end());
  return gone;
}

bool Pool::IsHolder(absl::string_view client_id) const {
  absl::MutexLock lock(&mu_);
  return releases_.IsHolder(client_id);
}

absl::StatusOr<Pool::Client*> Pool::OwnClientLocked(const Caller& caller, absl::string_view client_id) {
  auto it = clients_.find(client_id);
  if (it == clients_.end()) return absl::NotFoundError(absl::StrCat("client_id: ", client_id, " is not attached"));
  if (it->second.session != caller.session) {
    return absl::PermissionDeniedError(absl::StrCat("client_id: ", client_id, " belongs to another session"));
  }
  return &it->second;
}

absl::StatusOr<std::shared_ptr<EventQueue>> Pool::Watch(const Caller& caller, absl::string_view client_id) {
  absl::MutexLock lock(&mu_);
  KVD_ASSIGN_OR_RETURN(Client * found, OwnClientLocked(caller, client_id));
  Client& c = *found;
  if (c.watching) {
    return absl::FailedPreconditionError(absl::StrCat("client_id: ", client_id, " already has a Watch stream"));
  }
  c.watching = true;
  return c.events;
}

absl::StatusOr<uint64_t> Pool::Acknowledge(const Caller& caller, absl::string_view client_id, uint64_t release_id) {
  absl::MutexLock lock(&mu_);
  if (const Holder* h = releases_.FindHolder(client_id); h != nullptr && h->session == caller.session) {
    // A detached client acknowledging a release it was told of before it detached.
    if (!releases_.HolderAcknowledge(release_id, client_id)) {
      return absl::NotFoundError(absl::StrCat("client_id: ", client_id, " is detached and release_id ", release_id,
                                              " is not awaiting its acknowledgement"));
    }
    return releases_.PendingBytes();
  }
  KVD_ASSIGN_OR_RETURN(Client * c, OwnClientLocked(caller, client_id));
  if (!releases_.Acknowledge(release_id, c->id, &c->handed)) {
    return absl::NotFoundError(
        absl::StrCat("release_id: ", release_id, " is not awaiting an acknowledgement from client ", client_id));
  }
  return releases_.PendingBytes();
}

// ---------------------------------------------------------------------------------------------
// Everything else

absl::StatusOr<PoolView> Pool::GrantPeerAccess(absl::string_view device_uuid, bool revoke) {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(kExists));
  auto it = std::find(peer_devices_.begin(), peer_devices_.end(), device_uuid);
  if (revoke) {
    if (it == peer_devices_.end()) {
      return absl::NotFoundError(absl::StrCat("device_uuid: ", device_uuid, " is not granted on pool ", name_));
    }
    peer_devices_.erase(it);
  } else if (it == peer_devices_.end()) {
    peer_devices_.emplace_back(device_uuid);
  }
  return ViewLocked();
}

absl::Status Pool::CheckDeletable(bool force) const {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(force ? kExists : kNotHeld));
  if (force) return absl::OkStatus();
  if (!clients_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("pool ", name_, " has ", clients_.size(), " attached clients: detach them or delete with force"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockSpan> Pool::AwakeSpan() const {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(kAwake));
  return plan_.geometry.Span(base_, committed_blocks());
}

std::vector<std::string> Pool::Destroy(EventType why, std::vector<ChunkRecord>* chunks, Held* held,
                                       absl::string_view session, bool forced) {
  absl::MutexLock lock(&mu_);
  const std::optional<Pause> pause = pause_.End();
  const std::set<std::string> paused = pause.has_value() ? pause->asked : std::set<std::string>{};
  deleted_ = true;
  uint64_t bytes = committed_bytes() + table_.TailBytes() + releases_.PendingBytes();
  if (held != nullptr) {
    // Each chunk some client fetched (and may map still) is counted once, until every such client let go.
    std::map<uint64_t, uint64_t> fetched;
    for (const auto& [id, c] : clients_) {
      for (const auto& [chunk, chunk_bytes] : c.handed) {
        if (!c.fetched.contains(chunk)) continue;
        fetched[chunk] = chunk_bytes;
        held->clients[id] = c.session;
      }
    }
    for (const auto& [id, h] : releases_.holders()) {
      for (const auto& [chunk, chunk_bytes] : h.handed) fetched[chunk] = chunk_bytes;
      if (!h.handed.empty()) held->clients[id] = h.session;
    }
    for (const auto& [chunk, chunk_bytes] : fetched) held->bytes += chunk_bytes;
    held->bytes = std::min(held->bytes, bytes);
    bytes -= held->bytes;
  }
  if (txn_.has_value()) {
    bytes += txn_->change.staged.bytes;
    for (ChunkRecord& r : txn_->change.staged.chunks) chunks->push_back(std::move(r));
    txn_.reset();
  }
  std::vector<std::string> ids;
  for (auto& [id, client] : clients_) {
    PoolEvent e = EventLocked(why);
    e.forced = forced && client.session != session && !paused.contains(id);
    client.events->Push(std::move(e));
    client.events->Close();
    ids.push_back(id);
  }
  clients_.clear();
  for (const auto& [id, holder] : releases_.holders()) ids.push_back(id);
  // Clients still mapping released chunks free them when they unmap; the daemon stops counting.
  releases_.Clear();
  table_.TakeAll(chunks);
  shared_.budget->Give(bytes);
  shared_.leases->DropPool(name_);
  return ids;
}

// ---------------------------------------------------------------------------------------------
// Durability: see Note [Durable pools] in docs/architecture.md.

SavedPool Pool::Saved() const {
  absl::MutexLock lock(&mu_);
  SavedPool saved{.name = name_,
                  .dims = plan_.geometry.dims(),
                  .layout = plan_.layout,
                  .granularity = plan_.geometry.granularity(),
                  .owner_uid = owner_uid_,
                  .allowed_uids = allowed_uids_,
                  .group = group_,
                  .peer_devices = peer_devices_,
                  .created_at = created_at_,
                  .state = state_ == PoolState::kRecovering ? resume_state_ : state_,
                  .prefix_bytes = table_.prefix_bytes(),
                  .wake_blocks = wake_blocks_,
                  .generation = generation_,
                  .pending_release_bytes = releases_.PendingBytes(),
                  .metadata = metadata_,
                  .kept = kept_};
  saved.chunks = table_.Infos();
  if (shared_.arbiter != nullptr) saved.policy = shared_.arbiter->Claim(name_).policy;
  return saved;
}

void Pool::Recover(std::vector<ChunkRecord> chunks, std::set<uint64_t> missing) {
  absl::MutexLock lock(&mu_);
  table_.Recover(std::move(chunks), std::move(missing));
  if (!table_.missing().empty()) state_ = PoolState::kRecovering;
}

absl::StatusOr<std::vector<Pool::Returned>> Pool::PlanReturn(const std::vector<uint64_t>& chunk_ids) const {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(kExists));
  std::vector<Returned> out;
  std::set<uint64_t> seen;
  for (size_t i = 0; i < chunk_ids.size(); ++i) {
    const uint64_t id = chunk_ids[i];
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("chunk_ids[", i, "]: chunk ", id, " is given twice"));
    }
    const ChunkRecord* r = table_.Find(id);
    if (r == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk_ids[", i, "]: chunk ", id, " is not in pool ", name_, "'s chunk table"));
    }
    const bool missing = table_.IsMissing(id);
    out.push_back({.info = r->info, .missing = missing, .fd = missing ? -1 : r->fd()});
  }
  return out;
}

std::vector<uint64_t> Pool::Adopt(std::vector<ChunkRecord> adopted) {
  absl::MutexLock lock(&mu_);
  for (ChunkRecord& a : adopted) table_.Adopt(a);
  if (table_.missing().empty() && state_ == PoolState::kRecovering) state_ = resume_state_;
  return {table_.missing().begin(), table_.missing().end()};
}

std::vector<ChunkInfo> Pool::GiveUpRecovery(std::vector<ChunkRecord>* present) {
  absl::MutexLock lock(&mu_);
  std::vector<ChunkInfo> lost;
  if (state_ != PoolState::kRecovering) return lost;
  wake_blocks_ = resume_state_ == PoolState::kSleeping ? wake_blocks_ : committed_blocks();
  const size_t first_present = present->size();
  lost = table_.TakeAll(present);
  Release release;
  for (size_t i = first_present; i < present->size(); ++i) {
    release.chunks.push_back((*present)[i].info);
    release.bytes += (*present)[i].info.bytes;
  }
  uint64_t lost_bytes = 0;
  for (const ChunkInfo& c : lost) lost_bytes += c.bytes;
  // The present chunks' bytes stay counted until the clients that map them let go (a release).
  shared_.budget->Give(lost_bytes);
  state_ = PoolState::kSleeping;
  ++generation_;
  AnnounceReleaseLocked(std::move(release), /*session=*/{}, /*forced=*/true);
  return lost;
}

uint64_t Pool::ForgetRestartPending() {
  absl::MutexLock lock(&mu_);
  return releases_.ForgetRestartPending();
}

PoolMetadata Pool::metadata() const {
  absl::MutexLock lock(&mu_);
  return metadata_;
}

absl::StatusOr<PoolMetadata> Pool::SetMetadata(uint64_t expected_version, std::string data) {
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(RequireLocked(kExists));
  if (expected_version != metadata_.version) {
    return absl::AbortedError(absl::StrCat("expected_version: pool ", name_, "'s metadata is at version ",
                                           metadata_.version, ", not ", expected_version, "; read it again"));
  }
  metadata_ = {.version = metadata_.version + 1, .data = std::move(data), .updated_at = absl::Now()};
  return metadata_;
}

}  // namespace kvd::daemon
