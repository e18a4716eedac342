// Pool: one pool's state, its invariants and the resize state machine's bookkeeping, behind the
// pool's own locks. PoolManager (pool_manager.h) finds pools, makes and releases their memory on the
// device and drives the state machine, and Reshaper (reshaper.h) runs its reshapes; everything here is
// bookkeeping and never calls the device. What a pool holds lives in rooms of its own, each guarded by the
// state lock: the chunk table (chunk_table.h), the release ledger and its holders (release_ledger.h), the
// pause under way (pause_scope.h); the reshape planner (reshape_plan.h) plans from the table.
//
// Two locks (Note [Lock order] in docs/architecture.md).
// - `op_mu()` serialises the changes of this pool and is held across the device calls that make or
//   release its memory, so requests on one pool are ordered while other pools proceed in parallel.
// - The state lock (private) guards the chunk table, clients, releases and the held transaction. It
//   is held for bookkeeping only, never across a device call; readers (views, the handle channel,
//   metrics) take only it.
// Order: op_mu, then the state lock, then leaf locks (sessions, leases, budget, event queues, the
// manager's maps). No lock is taken while a leaf lock is held.
//
// Invariants, under the state lock:
// - the chunk table's (chunk_table.h), with tails: only a step of an exact shrink that failed leaves tails
//   behind its op_mu, and then Grow and whole-chunk shrinks refuse until a Compact or an exact Shrink has
//   replaced them;
// - the budget holds the table's committed bytes and tails + pending_bytes() + the held transaction's
//   staged bytes;
// - a sleeping pool has no chunks and remembers the blocks it wakes to;
// - every chunk id in a client's `handed` is in chunks_ or in an unsettled release;
// - a detached client's Holder has a non-empty `handed`, and its session is open.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/arbiter.h"
#include "daemon/core/budget.h"
#include "daemon/core/chunk_table.h"
#include "daemon/core/durable.h"
#include "daemon/core/event_queue.h"
#include "daemon/core/limits.h"
#include "daemon/core/pause_scope.h"
#include "daemon/core/pool_spec.h"
#include "daemon/core/pool_types.h"
#include "daemon/core/release_ledger.h"
#include "daemon/core/reshape_plan.h"
#include "daemon/core/sessions.h"
#include "daemon/core/transfer.h"
#include "kvd/device.h"

namespace kvd::daemon {

// Memory made for a grow or wake that no client can see yet; its bytes are already in the budget.
struct Staged {
  std::vector<ChunkRecord> chunks;
  uint64_t bytes = 0;
  ResizePhases phases;  // admit, create, exported, map and store
};

// One resize between its prepare (checks, and the memory a grow or wake needs) and its commit.
struct Change {
  GroupOp op = GroupOp::kGrow;
  uint64_t target_blocks = 0;  // grow and shrink: as asked; wake: the blocks it recommits; sleep: 0
  Staged staged;               // grow and wake
  // Shrink and sleep: forced past the clients that are not pausable (Note [Releases pause first]).
  bool forced = false;
  // Sleep keeping the contents: what the sleep copied into the host tier (the pool keeps it until its
  // wake). Wake: whether the staged chunks hold the kept contents already (the pool then lets them go).
  std::optional<KeptContents> kept;
  bool restored = false;
};

// A prepared group resize holding its pool until Commit, Abort, its session's end or its ttl.
struct Transaction {
  std::string id;
  std::string session;
  int32_t pid = 0;
  absl::Time expires;
  Change change;
};

// What the pools of one manager share: leaf-locked rooms and the daemon-wide chunk id counter.
struct PoolShared {
  LeaseTable* leases = nullptr;
  Budget* budget = nullptr;
  std::atomic<uint64_t>* next_chunk_id = nullptr;
  uint32_t daemon_uid = 0;
  std::string device_uuid;           // the daemon's own device: attaching from it needs no grant
  uint64_t epoch = 0;                // the daemon's, shown in every view
  const Limits* limits = nullptr;    // the manager's; null: no limits (max_clients_per_pool)
  const Arbiter* arbiter = nullptr;  // the pool's policy and claim for its views and record; null: defaults
};

// What a view says of the attached clients: each of them (GetPool, ListPools), or only their number
// (the pool in replies to Attach and resizes, so that a reply's size does not grow with the clients).
enum class ViewClients { kListed, kCounted };

// A view's counts, without the lists a PoolView copies (every chunk, every client): for the checks that need
// a number or two of a pool, so that they cost no copy of its chunk table (Note [The daemon's own memory]
// in docs/architecture.md).
struct PoolSummary {
  PoolState state = PoolState::kAwake;
  uint64_t committed_blocks = 0;
  uint64_t committed_bytes = 0;
  size_t chunks = 0;        // as many as PoolView::chunks lists
  size_t clients = 0;       // attached clients
  std::string transaction;  // the prepared transaction holding the pool, if any
};

// NOT_FOUND "pool P does not exist".
absl::Status PoolGone(absl::string_view pool);

class Pool {
 public:
  Pool(const PoolSpec& spec, PoolPlan plan, uint32_t owner_uid, const PoolShared& shared);
  // A pool restored from its record after a restart, without chunks until Recover.
  Pool(const SavedPool& saved, PoolPlan plan, const PoolShared& shared);
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Serialises changes of this pool; held across device calls. Taken before the state lock.
  absl::Mutex& op_mu() const ABSL_LOCK_RETURNED(op_mu_) { return op_mu_; }

  // Immutable after construction: no lock.
  const std::string& name() const { return name_; }
  const Geometry& geometry() const { return plan_.geometry; }
  const GroupMembership& group() const { return group_; }
  uint32_t owner_uid() const { return owner_uid_; }
  // Whether `uid` may see and change the pool: its owner, an allowed uid, root or the daemon's uid.
  bool Allows(uint32_t uid) const;

  // The VA reservation: set once, while creating the pool, before any chunk exists.
  uint64_t base() const ABSL_SHARED_LOCKS_REQUIRED(op_mu_) { return base_; }
  void set_base(uint64_t base) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) { base_ = base; }

  PoolView View(ViewClients clients = ViewClients::kListed) const ABSL_LOCKS_EXCLUDED(mu_);
  PoolSummary Summary() const ABSL_LOCKS_EXCLUDED(mu_);
  PoolState state() const ABSL_LOCKS_EXCLUDED(mu_);
  // While sleeping with its contents: what it keeps in the host tier (Note [The host tier]).
  std::optional<KeptContents> kept() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return kept_;
  }
  // What the held transaction's keeping sleep took of the host tier, if it is one (given back on Destroy).
  std::optional<KeptContents> held_kept() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return txn_.has_value() ? txn_->change.kept : std::nullopt;
  }
  bool deleted() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t pending_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

  // --- Durability (Note [Durable pools] in docs/architecture.md) ---

  // The record a restart restores.
  SavedPool Saved() const ABSL_LOCKS_EXCLUDED(mu_);
  // Installs a restored pool's table: `chunks` in table order, where the ids in `missing` are placeholders
  // (no memory, no FD) that clients may still give back. With none missing the pool is as saved; otherwise
  // it is kRecovering. The budget already holds the saved committed and pending bytes.
  void Recover(std::vector<ChunkRecord> chunks, std::set<uint64_t> missing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // ReturnHandles: the table's entry of each of `chunk_ids` and whether it is missing. INVALID_ARGUMENT
  // naming chunk_ids[i] for an id not in the table or given twice.
  struct Returned {
    ChunkInfo info;
    bool missing = false;
    int fd = -1;  // the daemon's FD of a chunk it has (borrowed)
  };
  [[nodiscard]] absl::StatusOr<std::vector<Returned>> PlanReturn(const std::vector<uint64_t>& chunk_ids) const
      ABSL_SHARED_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Fills missing entries with `adopted` (imported and mapped by the manager); once none is missing the
  // pool returns to its saved state. Returns the ids still missing.
  std::vector<uint64_t> Adopt(std::vector<ChunkRecord> adopted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The recovery grace passed with chunks still missing: those are lost. The chunks present go to
  // `*present` for the caller to unmap and release, and to the clients that map them as a release (a
  // RESUME to those a pause holds, a forced CHUNKS_RELEASED to the others), counted until they let go; the
  // lost bytes leave the budget, and the pool sleeps with wake_blocks = the blocks it had. Returns the
  // lost chunks.
  std::vector<ChunkInfo> GiveUpRecovery(std::vector<ChunkRecord>* present) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The recovery grace passed: bytes released before the restart stop counting. Returns them.
  uint64_t ForgetRestartPending() ABSL_LOCKS_EXCLUDED(mu_);

  // Sends a RECLAIM event (reclaim `reclaim_id`: give back `bytes` by `deadline`) to every attached
  // client; returns how many there are (Arbiter::Hooks::ask).
  size_t AskReclaim(uint64_t reclaim_id, uint64_t bytes, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // --- Metadata ---

  PoolMetadata metadata() const ABSL_LOCKS_EXCLUDED(mu_);
  // Compare-and-set: ABORTED naming the current version unless it is `expected_version`.
  [[nodiscard]] absl::StatusOr<PoolMetadata> SetMetadata(uint64_t expected_version, std::string data)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  // --- The resize state machine. Check, then (grow, wake) the manager stages memory, then Apply. ---

  // Whether `op` may start now: NOT_FOUND once deleted, ABORTED while a transaction holds the pool,
  // FAILED_PRECONDITION for the wrong state, INVALID_ARGUMENT for a target on the wrong side of the
  // committed blocks. Returns the change with the blocks a wake recommits.
  [[nodiscard]] absl::StatusOr<Change> Check(GroupOp op, uint64_t target_blocks) const
      ABSL_SHARED_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes a grow to `target_blocks` commits (0 when not above the prefix), computed without
  // planning: the budget is checked against it before any plan is built. INVALID_ARGUMENT past the
  // capacity.
  [[nodiscard]] absl::StatusOr<uint64_t> GrowBytes(uint64_t target_blocks) const ABSL_SHARED_LOCKS_REQUIRED(op_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The chunks that take every segment's prefix from where it is to `target_blocks` (planned outside
  // the state lock).
  [[nodiscard]] absl::StatusOr<std::vector<PlannedChunk>> PlanGrow(uint64_t target_blocks,
                                                                   uint64_t max_chunk_bytes) const
      ABSL_SHARED_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Makes a checked (and staged) change visible. Grow and wake publish the staged chunks: ids, the
  // prefix, the generation, a lease in the reply for `session`'s client and CHUNKS_ADDED for the
  // others. Shrink and sleep take every chunk at or past the new prefix out of the table and ask the
  // clients that hold them to unmap (a RESUME to those a pause holds, CHUNKS_RELEASED to the others,
  // forced past those of other sessions when change.forced); the caller unmaps and releases the daemon's
  // references to `*released` (no lock but op_mu held).
  PoolUpdate Apply(Change change, absl::string_view session, std::vector<ChunkRecord>* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // --- Releases: Note [Releases pause first] in docs/architecture.md ---

  // The attached clients a release asked by `session` takes memory from: every client of another
  // session (the daemon's own releases pass an empty session), pausable or not.
  struct Bystanders {
    std::set<std::string> pausable;
    std::vector<ClientView> unpausable;
  };
  Bystanders BystandersOf(absl::string_view session) const ABSL_LOCKS_EXCLUDED(mu_);
  // The chunks a release to `prefix_bytes` takes out of the table (whole chunks at or past it; 0: all).
  std::vector<ChunkInfo> Leaving(uint64_t prefix_bytes) const ABSL_LOCKS_EXCLUDED(mu_);

  // Waits (holding no lock of the caller's) until release `release_id` completed or `deadline` passed.
  // Returns the clients still waited for.
  size_t AwaitRelease(uint64_t release_id, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // --- Reshaping: see Note [Chunks are replaced, not cut] in docs/architecture.md ---

  // The reshape planner's plans (reshape_plan.h) of this pool as it is now, after the checks: PlanShrink's are
  // Check's (tails allowed for an exact shrink); PlanTails's FAILED_PRECONDITION unless awake, NOT_FOUND once
  // deleted; PlanCompact's those and ABORTED while held.
  [[nodiscard]] absl::StatusOr<ReshapePlan> PlanShrink(uint64_t target_blocks, bool whole_chunks_only,
                                                       const std::optional<std::vector<uint64_t>>& live,
                                                       std::optional<uint64_t> max_added_bytes = std::nullopt) const
      ABSL_SHARED_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::StatusOr<ReshapePlan> PlanTails(std::optional<uint64_t> max_added_bytes) const
      ABSL_SHARED_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // A plain release of every chunk at or past `prefix_bytes` in its segment, which must be a chunk
  // boundary of every segment (ReshapePlan::release_first_from): the chunks go to `*released` for the
  // caller to unmap and release, clients holding them are told (a RESUME to those a pause holds,
  // CHUNKS_RELEASED to the others: see Apply) and the prefix is there.
  PoolUpdate ReleaseFrom(uint64_t prefix_bytes, std::vector<ChunkRecord>* released, absl::string_view session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::StatusOr<ReshapePlan> PlanCompact(uint64_t max_chunk_bytes, std::optional<size_t> max_replaced,
                                                        std::optional<uint64_t> max_added_bytes = std::nullopt,
                                                        bool smaller = false) const ABSL_SHARED_LOCKS_REQUIRED(op_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // FAILED_PRECONDITION naming the first attached client that did not opt in to pauses; `what` says what
  // needed the pause.
  [[nodiscard]] absl::Status CheckPausable(absl::string_view what) const ABSL_LOCKS_EXCLUDED(mu_);
  // Asks every attached client (or only those in `only`) to pause: a PAUSE event with `added` (made and
  // exported, not yet in the table; their FDs, borrowed from the caller until CancelPause or ApplyReshape,
  // are leased to each client) and the ranges they cover, or `ranges` when given (a release: nothing is
  // added, the bytes go away). Returns how many clients were asked (0: nobody to wait for). A release's
  // pause ends in Apply (or Destroy, GiveUpRecovery), which sends the asked clients their RESUME.
  size_t BeginPause(const std::vector<ChunkRecord>& added, const std::set<std::string>* only = nullptr,
                    std::vector<ByteRange> ranges = {}) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until every client asked acknowledged the pause (or detached), or `deadline`.
  struct PauseOutcome {
    std::vector<ClientView> late;  // attached, asked, and not acknowledged
    std::set<std::string> paused;  // acknowledged
  };
  PauseOutcome AwaitPause(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until none of `clients` is still to acknowledge release `release_id` (their RESUME), or
  // `deadline`. Returns how many still are.
  size_t AwaitClients(uint64_t release_id, const std::set<std::string>& clients, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Detaches `client_id` for not acknowledging the pause (it keeps holding what it fetched).
  void DetachUnresponsive(const std::string& client_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The pause is called off and nothing changed: a RESUME (not applied) to every client asked.
  void CancelPause() ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes have moved and the daemon maps `added` in place of `plan.replaced`: the table changes, the
  // replaced and released chunks go to `*removed` (already unmapped by the caller) and into one release,
  // and every client asked to pause gets the RESUME (applied) naming them.
  PoolUpdate ApplyReshape(const ReshapePlan& plan, std::vector<ChunkRecord> added, std::vector<ChunkRecord>* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon's chunks with memory that it does not map in its view yet (Note [The daemon maps on demand]).
  std::vector<ChunkRecord*> UnmappedChunks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon's chunks with these ids (for the manager's copy and remap), in the order asked.
  std::vector<ChunkRecord*> ChunksById(const std::vector<uint64_t>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);

  // --- Transactions ---

  // Installs `txn` if `sessions` still has its session (checked under the state lock, so that a
  // session closing concurrently finds it); otherwise gives it back.
  [[nodiscard]] std::optional<Transaction> Hold(Transaction txn, const SessionTable& sessions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the held transaction out if it is `id` and was prepared by `session` (any session when
  // nullopt: the daemon's own aborts): NOT_FOUND when the pool holds another (or none),
  // PERMISSION_DENIED for another session.
  [[nodiscard]] absl::StatusOr<Transaction> Unhold(absl::string_view id, std::optional<absl::string_view> session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // The held transaction's id if `session` prepared it.
  std::optional<std::string> HeldBy(absl::string_view session) const ABSL_LOCKS_EXCLUDED(mu_);

  // --- Clients ---

  // A new client of `caller`'s session with a lease of every chunk. PERMISSION_DENIED when
  // `peer_device` (not the daemon's own) is not granted; UNAUTHENTICATED once the session closed;
  // RESOURCE_EXHAUSTED when the pool has its share of --max-clients-per-pool (limits.h).
  [[nodiscard]] absl::StatusOr<AttachResult> Attach(const Caller& caller, absl::string_view client_name,
                                                    absl::string_view peer_device, bool pausable,
                                                    const SessionTable& sessions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND when not attached; PERMISSION_DENIED unless `caller` is its session or may use the pool.
  // The client's unredeemed leases are revoked. Its session still owes what the client was handed (see
  // Note [A detached client still holds its chunks] in docs/architecture.md): releases of those chunks
  // wait for its acknowledgement or its session's end.
  // `released`: the client's own session declares every chunk unmapped, so it holds nothing after (also
  // for a client already detached that still holds chunks).
  [[nodiscard]] absl::Status Detach(const Caller& caller, absl::string_view client_id, bool released = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Detaches every client of `session` and forgets what its detached clients held; returns the ids of
  // both.
  std::vector<std::string> DetachSession(absl::string_view session) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `client_id` detached and still holds chunks (a Holder).
  bool IsHolder(absl::string_view client_id) const ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::StatusOr<std::shared_ptr<EventQueue>> Watch(const Caller& caller, absl::string_view client_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Returns the bytes still pending release. A detached client of `caller`'s session may still
  // acknowledge the releases it was told of.
  [[nodiscard]] absl::StatusOr<uint64_t> Acknowledge(const Caller& caller, absl::string_view client_id,
                                                     uint64_t release_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The client has paused for pause `pause_id`: NOT_FOUND unless that pause is waiting for it.
  [[nodiscard]] absl::Status AcknowledgePause(const Caller& caller, absl::string_view client_id, uint64_t pause_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // --- Everything else ---

  [[nodiscard]] absl::StatusOr<PoolView> GrantPeerAccess(absl::string_view device_uuid, bool revoke)
      ABSL_LOCKS_EXCLUDED(mu_);
  // FAILED_PRECONDITION while clients are attached unless `force`; ABORTED while held unless `force`.
  [[nodiscard]] absl::Status CheckDeletable(bool force) const ABSL_LOCKS_EXCLUDED(mu_);
  // The committed blocks for block operations: NOT_FOUND once deleted, FAILED_PRECONDITION asleep.
  [[nodiscard]] absl::StatusOr<BlockSpan> AwakeSpan() const ABSL_SHARED_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // dup()s of the exported FDs of `chunk_ids`, in order, for a lease of client `client_id` (which is
  // then known to hold them): NOT_FOUND once that client detached; FAILED_PRECONDITION for a chunk
  // released since (naming it), or with `skip_released` no FD for it (FetchHandles.skip_released);
  // ABORTED for the lease of pause `pause_id` (a PAUSE's) called off before this fetch (Note [A called-off
  // pause's lease]). The caller owns the FDs.
  struct LeasedFd {
    uint64_t chunk_id;
    int fd;
  };
  [[nodiscard]] absl::StatusOr<std::vector<LeasedFd>> DupFds(absl::string_view client_id,
                                                             const std::vector<uint64_t>& chunk_ids,
                                                             bool skip_released = false, uint64_t pause_id = 0)
      ABSL_LOCKS_EXCLUDED(mu_);

  // --- Connectors (docs/connectors.md) ---

  // The handles of a range export for client `client_id` (attached through `caller`'s session, so every
  // release of a chunk it covers waits for that client's acknowledgement) and their lease. `ranges`
  // (offset and bytes from the base; empty: every segment's committed prefix) must be granularity
  // multiples inside one segment's committed prefix: INVALID_ARGUMENT naming ranges[i]. With
  // `span_chunks` each range is one handle; otherwise one handle per chunk it touches. NOT_FOUND for a
  // client not attached here, PERMISSION_DENIED for another session's, FAILED_PRECONDITION asleep.
  [[nodiscard]] absl::StatusOr<RangeExport> PlanRangeExport(const Caller& caller, absl::string_view client_id,
                                                            const std::vector<ByteRange>& ranges, bool span_chunks)
      ABSL_LOCKS_EXCLUDED(mu_);
  // OK when client `client_id` is still attached (NOT_FOUND otherwise) and every chunk of `chunk_ids` is
  // still in the table (FAILED_PRECONDITION naming one otherwise); the client is then known to hold
  // them (a range over them is exported to it next).
  [[nodiscard]] absl::Status CheckChunksLive(absl::string_view client_id, const std::vector<uint64_t>& chunk_ids)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Marks the pool deleted, tells every client `why` (forced past those of sessions other than `session`
  // that no pause holds, when `forced`) and closes its stream, gives every byte back to
  // the budget and hands the daemon's chunks (the table's and a held transaction's) to the caller to
  // unmap and release. Returns the ids of the clients it detached and of the detached holders.
  // With `held`, the bytes of every chunk some client fetched stay in the budget and are described there
  // instead (clients may map them still: Note [A deleted pool's memory is counted until its clients let
  // go] in docs/architecture.md).
  struct Held {
    uint64_t bytes = 0;
    std::map<std::string, std::string> clients;  // client id -> its session
  };
  std::vector<std::string> Destroy(EventType why, std::vector<ChunkRecord>* chunks, Held* held = nullptr,
                                   absl::string_view session = {}, bool forced = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Client {
    std::string id;
    std::string name;
    uint32_t uid = 0;
    int32_t pid = 0;
    std::string session;
    absl::Time attached_at;
    std::string device_uuid;
    Handed handed;               // chunk id -> bytes, until acknowledged as released
    std::set<uint64_t> fetched;  // chunk ids whose FDs a lease of this client yielded
    // Pauses called off before this client fetched their lease: Note [A called-off pause's lease].
    std::set<uint64_t> called_off;
    std::shared_ptr<EventQueue> events = std::make_shared<EventQueue>();
    bool watching = false;
    bool pausable = false;
  };
  // What an operation needs of the pool's state, checked in one place (RequireLocked), in this order: the
  // pool exists (NOT_FOUND), is not recovering (UNAVAILABLE), is not held by a transaction (ABORTED), is
  // awake (FAILED_PRECONDITION "sleeping").
  enum Need : unsigned {
    kExists = 0,
    kNotRecovering = 1u << 0,
    kNotHeld = 1u << 1,
    kAwake = 1u << 2,  // implies kNotRecovering
  };
  [[nodiscard]] absl::Status RequireLocked(unsigned needs) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  uint64_t committed_blocks() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return table_.committed_blocks(); }
  uint64_t committed_bytes() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return table_.committed_bytes(); }
  // Check's checks; `tails_ok`: an exact shrink, which replaces tails past the prefix.
  [[nodiscard]] absl::StatusOr<Change> CheckLocked(GroupOp op, uint64_t target_blocks, bool tails_ok) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  PoolView ViewLocked(ViewClients clients = ViewClients::kListed) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  PoolEvent EventLocked(EventType type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PoolUpdate PublishLocked(Staged staged, uint64_t target_blocks, absl::string_view session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the chunks at or past `prefix_bytes` out of the table (every chunk for `all`, a prefix of 0)
  // into `*released` and tells the clients that hold them (see Apply).
  PoolUpdate ReleaseLocked(uint64_t prefix_bytes, std::vector<ChunkRecord>* released, absl::string_view session,
                           bool forced) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the clients holding some of `release.chunks` and waits for them (a RESUME, applied, to those the
  // pause asked, which ends it; CHUNKS_RELEASED to the others); returns the release's id, 0 if none waits.
  uint64_t AnnounceReleaseLocked(Release release, absl::string_view session, bool forced)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With `keep_holding`, a client that fetched FDs of chunks it was handed stays a Holder of those
  // until it acknowledges or its session ends; without (its session ended), everything it owed is
  // dropped.
  void DetachLocked(const std::string& client_id, bool keep_holding) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The attached client `client_id` of `caller`'s session: NOT_FOUND, or PERMISSION_DENIED for another's.
  [[nodiscard]] absl::StatusOr<Client*> OwnClientLocked(const Caller& caller, absl::string_view client_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The attached client `client_id` a lease was issued to: NOT_FOUND (naming the lease) once detached.
  [[nodiscard]] absl::StatusOr<Client*> LeaseClientLocked(absl::string_view client_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string name_;
  const PoolPlan plan_;
  const uint32_t owner_uid_;
  const std::vector<uint32_t> allowed_uids_;
  const GroupMembership group_;
  const absl::Time created_at_;
  const PoolShared shared_;
  mutable absl::Mutex op_mu_;
  uint64_t base_ ABSL_GUARDED_BY(op_mu_) = 0;

  mutable absl::Mutex mu_ ABSL_ACQUIRED_AFTER(op_mu_);
  bool deleted_ ABSL_GUARDED_BY(mu_) = false;
  PoolState state_ ABSL_GUARDED_BY(mu_) = PoolState::kAwake;
  uint64_t wake_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<KeptContents> kept_ ABSL_GUARDED_BY(mu_);
  ChunkTable table_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t event_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> peer_devices_ ABSL_GUARDED_BY(mu_);
  std::optional<Transaction> txn_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Client, std::less<>> clients_ ABSL_GUARDED_BY(mu_);
  ReleaseLedger releases_ ABSL_GUARDED_BY(mu_);
  PauseScope pause_ ABSL_GUARDED_BY(mu_);
  PoolMetadata metadata_ ABSL_GUARDED_BY(mu_);
  // After a restart: the state to resume once no chunk is missing (the table's missing()).
  PoolState resume_state_ ABSL_GUARDED_BY(mu_) = PoolState::kAwake;
};

}  // namespace kvd::daemon
