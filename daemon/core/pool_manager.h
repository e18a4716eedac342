// PoolManager: the daemon's domain model (docs/architecture.md, "Layers"; the API it serves: docs/api.md). It owns
// every pool of one device: their VA reservations, chunks (created, mapped into the daemon's own address space,
// exported once), attached clients, leases for the handle channel, release acknowledgements and the budget.
//
// Rooms. The manager finds pools and drives their changes; the state lives in rooms with their own locks:
// each Pool (pool.h: its clients and held transaction, the resize state machine's bookkeeping, and what it
// holds — chunk_table.h, release_ledger.h, pause_scope.h — under its state lock), the SessionTable and
// LeaseTable (sessions.h), the Budget (budget.h), the TransactionTable (transactions.h) and each client's
// EventQueue. On the device, chunks are made and given back by one ChunkMaker (chunk_maker.h), and shrinks
// that move bytes and compactions are the Reshaper's (reshaper.h), which the manager hands the services it
// needs (ReshapeServices, which it implements). The manager's own lock guards only its maps of pools and
// clients. Note [Lock order] in docs/architecture.md. Its implementation is in three files: pool_manager.cc
// (sessions, pools, the resize state machine, groups), pool_manager_blocks.cc (block operations, connectors,
// the handle channel) and pool_manager_durable.cc (records, restore, ReturnHandles, the recovery grace).
//
// One resize state machine (Note [One resize state machine]). Grow, Shrink, Sleep and Wake are a Prepare
// and a Commit in one call:
// Pool::Check, then (grow, wake) the memory is staged, then Pool::Apply. Engine groups run the same
// two steps across an RPC boundary, with the pool held in between.
//
// Threads. Every method is thread-safe. Requests on one pool are serialised by its op_mu; requests on
// different pools share no lock across device calls (the budget is the only state they share, and
// its lock is held for an addition). Methods that wait (Shrink and Sleep with wait_for_release) hold
// no lock while waiting.
//
// Identity. Every pool-facing call takes the Caller, whose uid the handle channel learned from
// SO_PEERCRED (a session). A caller may see and change a pool when its uid is the pool's owner, one of
// its allowed uids, root, or the daemon's own uid; otherwise the pool is NOT_FOUND, exactly as if it
// did not exist.
//
// Memory. A chunk released by Shrink/Sleep/Delete is unmapped and released by the daemon at once; the
// memory is free when every client that was handed it has acknowledged (or died). Until then its
// bytes are "pending release" and still count against the budget.
//
// Engine groups. A coordinator resizes the pools of one engine's ranks on several daemons in two
// phases: Prepare does everything that can fail (state checks, budget, creating, mapping and exporting
// a grow's or wake's memory) and holds the pool; Commit makes the change visible and cannot fail for
// want of memory; Abort gives the prepared memory back. While held, other resizes and deletes of the
// pool fail with ABORTED. A transaction belongs to the session that prepared it: closing that session
// (the coordinator died) or letting its ttl pass aborts it (presumed abort).
//
// Errors are absl::Status with the field or pool named: NOT_FOUND (pool, client, transaction),
// ALREADY_EXISTS, INVALID_ARGUMENT, FAILED_PRECONDITION (wrong state), RESOURCE_EXHAUSTED (asked and
// free bytes), PERMISSION_DENIED, UNAUTHENTICATED (unknown session), ABORTED (held by a transaction,
// or the transaction expired), and the device's own codes.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/core/arbiter.h"
#include "daemon/core/budget.h"
#include "daemon/core/chunk_maker.h"
#include "daemon/core/durable.h"
#include "daemon/core/event_queue.h"
#include "daemon/core/geometry.h"
#include "daemon/core/host_tier.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/limits.h"
#include "daemon/core/pool.h"
#include "daemon/core/pool_spec.h"
#include "daemon/core/pool_types.h"
#include "daemon/core/reshaper.h"
#include "daemon/core/sessions.h"
#include "daemon/core/transactions.h"
#include "daemon/core/transfer.h"
#include "kvd/device.h"

namespace kvd::daemon {

struct ManagerOptions {
  uint64_t budget_bytes = 0;                             // 0: the device's total memory
  uint64_t max_chunk_bytes = uint64_t{4} << 30;          // grows split into chunks of at most this
  uint64_t max_pool_reserved_bytes = uint64_t{1} << 46;  // VA one pool may reserve (64 TiB)
  absl::Duration lease_ttl = absl::Seconds(30);
  // ZeroBlocks and CopyBlocks touch at most this many bytes between two looks at the caller's deadline,
  // cancellation and the daemon's shutdown.
  uint64_t block_slice_bytes = uint64_t{64} << 20;
  LayoutPolicy layout_policy;
  uint32_t daemon_uid = 0;
  uint64_t max_metadata_bytes = uint64_t{1} << 20;  // PoolMetadata.data
  // Durability (Note [Durable pools]). `store` (not owned, outlives the manager) is told of every change;
  // null: the manager makes and owns a MemoryStateStore of durability kNone (nothing outlives the
  // daemon). Either way the manager always has a store (PoolManager::store()). `epoch` is this daemon's
  // (1 + the restored state's).
  StateStore* store = nullptr;
  uint64_t epoch = 1;
  absl::Time started_at = absl::Now();
  // How long a restored pool waits for its clients to give missing chunks back, and how long bytes
  // released before the restart stay counted.
  absl::Duration recovery_grace = absl::Seconds(60);
  // How long a pause waits for every attached client to acknowledge it (and then for their RESUME
  // acknowledgements) unless the request says otherwise (PauseOptions.timeout).
  absl::Duration pause_timeout = absl::Seconds(5);
  // A pool that a grow leaves with more chunks than this is compacted in the background, when every
  // attached client is pausable (otherwise it stays as it is); 0: never on the daemon's own.
  size_t compact_above_chunks = 0;
  // How many chunks a compaction replaces under one pause, at most (CompactRequest.max_chunks_per_pause):
  // a client unmaps each old chunk before it maps the new ones, ~17 us a chunk on an H200.
  uint32_t compact_chunks_per_pause = 512;
  // Host memory where sleeps keep pools' contents (not owned, outlives the manager); null: none, and a
  // keeping sleep is FAILED_PRECONDITION.
  HostTier* host_tier = nullptr;
  // Where the manager reports what it did on its own that is not a problem (background compactions).
  std::function<void(const std::string&)> info;
  // Where the manager reports what it did on its own (restore, lost chunks), one line each.
  std::function<void(const std::string&)> warn;
  // What tenants may hold (limits.h); its daemon_uid is set from daemon_uid above.
  Limits limits;
  // Admission and reclaims (arbiter.h): the device memory no grow may take (--device-headroom), and how long
  // an engine has to answer a reclaim when its pool's policy does not say (--reclaim-timeout).
  uint64_t device_headroom_bytes = 0;
  absl::Duration reclaim_timeout = absl::Seconds(5);
};

// Whether a grow or wake short of memory waits for it (GrowRequest.wait, WakeRequest.wait): in the arbiter's
// queue, until `deadline` or `cancelled`, instead of failing at once.
struct WaitOptions {
  bool wait = false;
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty
};

// A sleep that keeps the pool's contents in the host tier (Note [The host tier] in docs/architecture.md):
// every committed byte, or with `live_blocks` only those blocks (each committed, none repeated).
struct KeepOptions {
  bool keep = false;
  std::vector<uint64_t> live_blocks;  // empty: every committed byte
  // How long the sleep waits for the host tier's background preparation (Note [The host tier]).
  absl::Time tier_ready_by = absl::InfiniteFuture();
};
// One page of ListPools: pools by name, after the page before.
struct PoolPage {
  std::vector<PoolView> pools;
  bool more = false;  // pools the caller may see come after the last one here
};

// What tenants hold now, for metrics: by uid (uids holding nothing are absent).
struct TenantUsage {
  std::map<uint32_t, uint64_t> pools;
  std::map<uint32_t, uint64_t> reserved_bytes;
  std::map<uint32_t, uint64_t> sessions;
};

class PoolManager : private ReshapeServices {
 public:
  // `device` must outlive the manager.
  PoolManager(Device* device, ManagerOptions options);
  // Releases every chunk and reservation (as Shutdown).
  ~PoolManager() override;
  PoolManager(const PoolManager&) = delete;
  PoolManager& operator=(const PoolManager&) = delete;

  // Sessions: opened on the handle channel (uid and pid from SO_PEERCRED); closing one detaches
  // every client attached through it and drops its pending acknowledgements. RESOURCE_EXHAUSTED past
  // --max-sessions-per-uid or --max-sessions (limits.h).
  [[nodiscard]] absl::StatusOr<std::string> OpenSession(uint32_t uid, int32_t pid, std::string name);
  void CloseSession(absl::string_view session);
  // UNAUTHENTICATED for an unknown or closed session.
  [[nodiscard]] absl::StatusOr<Caller> Authenticate(absl::string_view session) const;

  [[nodiscard]] absl::StatusOr<DeviceStatus> GetDeviceStatus() const;
  [[nodiscard]] absl::StatusOr<LayoutResolution> ResolveLayout(const LayoutRequest& request) const;
  const ManagerOptions& options() const { return options_; }
  // The store every change is saved to: options().store, or the manager's own MemoryStateStore.
  StateStore& store() const { return *store_; }
  // Whether the saved state is current (durable.h); also in GetDeviceStatus().
  StateHealth state_health() const ABSL_LOCKS_EXCLUDED(state_mu_);
  // Whether one range FD of ExportRanges may span several chunks (the device's capability).
  bool range_spans_chunks() const { return capabilities_.range_spans_chunks; }

  // RESOURCE_EXHAUSTED, before anything is reserved, when the caller's uid (the owner) would pass
  // --max-pools-per-uid or --max-reserved-per-uid, or all uids their share of --max-pools or
  // --max-reserved (limits.h).
  [[nodiscard]] absl::StatusOr<PoolView> CreatePool(const Caller& caller, const PoolSpec& spec);
  [[nodiscard]] absl::StatusOr<PoolView> GetPool(const Caller& caller, absl::string_view name) const;
  // The pools `caller` may see, by name.
  std::vector<PoolView> ListPools(const Caller& caller) const;
  // At most `max_pools` of them whose names come after `after` (empty: from the first), by name.
  PoolPage ListPools(const Caller& caller, absl::string_view after, size_t max_pools) const;
  // Pools, reserved bytes and sessions by uid now.
  TenantUsage Usage() const;
  // Requests refused by a limit since start, by the limit's flag ("--max-pools-per-uid").
  std::map<std::string, uint64_t> LimitRefusals() const;
  // What the manager reports as it works, for metrics; called from its own threads too.
  struct Observers {
    // Each step of a reshape that moved bytes: a shrink's, each of a compact's, a background compaction's.
    std::function<void(const ReshapeReport&)> reshape_step;
    // A compaction the manager ran on its own (ManagerOptions::compact_above_chunks).
    std::function<void(absl::Duration elapsed, bool ok)> background_compaction;
    // Whether the saved state is degraded (StateHealth::degraded): called once when installed and then at
    // every change, in order.
    std::function<void(bool degraded)> state_degraded;
    // An ended reclaim or wait (arbiter.h), from the waiting request's thread.
    std::function<void(const ArbiterEvent&)> arbitration;
  };
  // Replaces the observers before (empty: none) and returns once no call to those runs.
  void Observe(Observers observers) ABSL_LOCKS_EXCLUDED(observer_mu_);
  // FAILED_PRECONDITION while clients are attached unless `force`; forced, the clients of other sessions
  // are released as ReleaseOptions{.force = true} says. Returns the bytes released.
  [[nodiscard]] absl::StatusOr<uint64_t> DeletePool(const Caller& caller, absl::string_view name, bool force,
                                                    PauseOptions pause = {});

  // `device_uuid`: the device the client maps from; empty or the daemon's own device needs no grant,
  // any other must be granted by the pool (PERMISSION_DENIED naming both devices otherwise).
  // `pausable`: the client takes part in pauses (AttachRequest.pausable).
  [[nodiscard]] absl::StatusOr<AttachResult> Attach(const Caller& caller, absl::string_view pool,
                                                    absl::string_view client_name, absl::string_view device_uuid = {},
                                                    bool pausable = false);
  // Attach without waiting: nullopt, having done nothing, while another operation holds the pool's op_mu (a
  // resize, a reshape, a delete); then Attach waits for it (Note [Attach answers inline when it can] in
  // docs/architecture.md).
  [[nodiscard]] std::optional<absl::StatusOr<AttachResult>> TryAttach(const Caller& caller, absl::string_view pool,
                                                                      absl::string_view client_name,
                                                                      absl::string_view device_uuid, bool pausable);
  // Adds (or with `revoke` removes) a device UUID or "*" to the pool's peer devices. Attached clients
  // keep their mappings when a grant is revoked.
  [[nodiscard]] absl::StatusOr<PoolView> GrantPeerAccess(const Caller& caller, absl::string_view pool,
                                                         absl::string_view device_uuid, bool revoke);
  // `released`: the client's own session declares every chunk of the pool unmapped (DetachRequest.released).
  [[nodiscard]] absl::Status Detach(const Caller& caller, absl::string_view client_id, bool released = false);

  // All-or-nothing: on failure every chunk this call made is released and the pool is as before.
  // The budget is checked against the bytes asked before any chunk is planned.
  // With `wait`, a grow short of memory waits in the arbiter's queue (its pool's priority, then arrival) and
  // may have memory reclaimed from pools of lower priority; at its deadline it fails RESOURCE_EXHAUSTED
  // saying what it asked of whom (Arbiter::WaitFailed).
  [[nodiscard]] absl::StatusOr<PoolUpdate> Grow(const Caller& caller, absl::string_view pool, uint64_t target_blocks,
                                                const WaitOptions& wait = {});
  // With `wait`, returns once every client acknowledged or `deadline` passed (then with bytes still
  // pending in the view).
  [[nodiscard]] absl::StatusOr<PoolUpdate> Shrink(const Caller& caller, absl::string_view pool, uint64_t target_blocks,
                                                  bool wait, absl::Time deadline);
  // Shrink as the proto's ShrinkRequest says: exact unless `whole_chunks_only` (Pool::PlanShrink), pausing
  // the attached clients when bytes move, all or nothing when the replacements fit the free memory
  // (Reshaper::Room) at once; otherwise whole chunks past the target first, then steps of as many
  // replacements as fit, each all or nothing, the steps before a failed one done (Reshaper::Shrink).
  using ShrinkOptions = daemon::ShrinkOptions;
  [[nodiscard]] absl::StatusOr<PoolUpdate> Shrink(const Caller& caller, absl::string_view pool, uint64_t target_blocks,
                                                  const ShrinkOptions& options);
  // One chunk per segment per --max-chunk, as a single grow makes it (Pool::PlanCompact). In steps that
  // each make no more new chunks than the free memory holds (Reshaper::Room), and with clients attached replace at
  // most `max_chunks_per_pause` chunks (0: the manager's compact_chunks_per_pause) under a pause of their
  // own, the clients running between them. RESOURCE_EXHAUSTED when not even one new chunk fits, but with
  // no client attached, when runs of old chunks merged into smaller ones that fit (target_reached false).
  // Each step is all or nothing; a step that fails leaves the steps before it done and says so in its
  // error; so does a caller that gives up between steps (`interrupt`).
  using CompactOptions = daemon::CompactOptions;
  [[nodiscard]] absl::StatusOr<PoolUpdate> Compact(const Caller& caller, absl::string_view pool,
                                                   const CompactOptions& options);
  // `pool` empty: every awake (Sleep) or sleeping (Wake) pool the caller may change.
  // With `keep.keep` the contents go to the host tier first (under the release's pause) and Wake copies them
  // back: RESOURCE_EXHAUSTED naming the bytes, before any pause, when the tier cannot hold them; live blocks
  // only with a named pool.
  [[nodiscard]] absl::StatusOr<std::vector<PoolUpdate>> Sleep(const Caller& caller, absl::string_view pool, bool wait,
                                                              absl::Time deadline, const ReleaseOptions& release = {},
                                                              const KeepOptions& keep = {});
  // The arbitration's reclaim action (docs/api.md, "Sleep that keeps the contents"): sleeps `pool` as the
  // daemon, keeping its contents in the host tier, the clients paused first and forced past those that are
  // not pausable. Sleep's errors.
  [[nodiscard]] absl::StatusOr<PoolUpdate> SleepKeeping(absl::string_view pool, PauseOptions pause = {});
  // The host tier's size, use and copies (all zero without one).
  HostTierStats HostTierUsage() const;
  // `wait` as Grow's, for one pool only (INVALID_ARGUMENT naming `wait` with every pool).
  [[nodiscard]] absl::StatusOr<std::vector<PoolUpdate>> Wake(const Caller& caller, absl::string_view pool,
                                                             const WaitOptions& wait = {});

  // Arbitration (arbiter.h, policy.h). The fields `change` sets replace the pool's policy's, checked and
  // authorised as Arbiter::Change says; the record is saved. Returns the pool.
  [[nodiscard]] absl::StatusOr<PoolView> SetPoolPolicy(const Caller& caller, absl::string_view pool,
                                                       const PolicyChange& change);
  // The engine's report of what it uses of the pool (Arbiter::Report).
  [[nodiscard]] absl::Status ReportUsage(const Caller& caller, absl::string_view pool, UsageReport usage);
  // The engine declines reclaim `reclaim_id` of the pool (Arbiter::Decline).
  [[nodiscard]] absl::Status DeclineReclaim(const Caller& caller, absl::string_view pool, uint64_t reclaim_id,
                                            std::string reason);
  ArbiterStats ArbitrationStats() const;

  // Two-phase resizes for engine groups (see the top of this file). `target_blocks` is for kGrow and
  // kShrink and must be 0 otherwise; `ttl` is how long the pool stays held before the daemon aborts.
  // A shrink or sleep quiesces the clients of other sessions first (ReleaseOptions, with `force`), and the
  // pausable ones stay paused until the Commit or Abort.
  [[nodiscard]] absl::StatusOr<PreparedOp> Prepare(const Caller& caller, absl::string_view pool, GroupOp op,
                                                   uint64_t target_blocks, absl::Duration ttl, bool force = false,
                                                   const KeepOptions& keep = {});
  // Only the preparing session may commit or abort. NOT_FOUND (with the reason when the daemon aborted
  // it) for a transaction that is unknown or ended; ABORTED when its ttl passed. `wait` and `deadline`
  // are Shrink's, for shrink and sleep.
  [[nodiscard]] absl::StatusOr<CommittedOp> Commit(const Caller& caller, absl::string_view transaction, bool wait,
                                                   absl::Time deadline);
  // Returns the prepared bytes given back.
  [[nodiscard]] absl::StatusOr<uint64_t> Abort(const Caller& caller, absl::string_view transaction);

  // The client's event stream; one watcher per client. Closing the stream is the client's death:
  // the caller of Watch calls Detach when its stream ends.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<EventQueue>> Watch(const Caller& caller, absl::string_view client_id);
  // Returns the pool's bytes still pending release.
  [[nodiscard]] absl::StatusOr<uint64_t> Acknowledge(const Caller& caller, absl::string_view client_id,
                                                     uint64_t release_id);
  // The client paused for `pause_id` (AcknowledgeRequest.pause_id).
  [[nodiscard]] absl::Status AcknowledgePause(const Caller& caller, absl::string_view client_id, uint64_t pause_id);

  // Block operations. RESOURCE_EXHAUSTED, before anything else, for more than --max-block-ids ids (or
  // copies). Every id is checked before any work: INVALID_ARGUMENT naming the entry for a block
  // that is not committed, a repeated block id (ZeroBlocks) or a destination written twice (CopyBlocks).
  // The work is done in slices of at most ManagerOptions::block_slice_bytes; between slices `interrupt`
  // is consulted (DEADLINE_EXCEEDED, CANCELLED) and so is the daemon's shutdown (UNAVAILABLE), each
  // saying how many entries were done. Only this pool's op_mu is held throughout, and the device's own
  // locks only for one slice.
  [[nodiscard]] absl::Status ZeroBlocks(const Caller& caller, absl::string_view pool, absl::Span<const uint64_t> blocks,
                                        const Interrupt& interrupt = {});
  [[nodiscard]] absl::Status CopyBlocks(const Caller& caller, absl::string_view pool,
                                        absl::Span<const BlockCopy> copies, const Interrupt& interrupt = {});

  // Connectors: the descriptors of `block_ids` (empty: every committed block) under the pool's layout
  // (transfer.h). INVALID_ARGUMENT naming block_ids[i]; FAILED_PRECONDITION while the pool sleeps.
  [[nodiscard]] absl::StatusOr<TransferPlan> DescribeTransfer(const Caller& caller, absl::string_view pool,
                                                              absl::Span<const uint64_t> block_ids) const;

  // Connectors: FDs over byte ranges of the pool that client `client_id` (attached through `caller`'s
  // session) belongs to, for RDMA registration (Pool::PlanRangeExport has the rules and errors). The
  // lease yields one FD per handle: a DMA-BUF over the range where the device's range export spans chunks
  // (CUDA), else a dup() of the one chunk's FD with fd_offset into it (host memfd). UNIMPLEMENTED when
  // the device has no range export.
  [[nodiscard]] absl::StatusOr<RangeExport> ExportRanges(const Caller& caller, absl::string_view client_id,
                                                         const std::vector<ByteRange>& ranges);

  // The handle channel: a session's single-use lease becomes dup()s of its chunks' exported FDs (the
  // caller owns and closes them), in lease order. UNAUTHENTICATED for an unknown session;
  // PERMISSION_DENIED when `peer_uid` (SO_PEERCRED of the fetching connection) is not the session's
  // uid or the lease was issued to another session; NOT_FOUND for unknown or used leases;
  // DEADLINE_EXCEEDED for expired ones; FAILED_PRECONDITION if a chunk was released since, unless
  // `skip_released` (FetchHandles.skip_released: the chunks still in the pool, the others left out). A
  // range lease (ExportRanges) yields one FD per range, with LeasedFd::chunk_id holding the range's index
  // (`skip_released` does not apply to it).
  using LeasedFd = Pool::LeasedFd;
  [[nodiscard]] absl::StatusOr<std::vector<LeasedFd>> RedeemLease(absl::string_view session,
                                                                  absl::string_view lease_token, uint32_t peer_uid,
                                                                  bool skip_released = false);
  // Attach's push_handles (docs/api.md, "Pushed handles"): redeems the chunk lease `lease_token` as RedeemLease
  // does and hands its FDs to `push` (they stay the manager's, closed after it). When `push` fails, the lease is
  // put back unredeemed, for a FetchHandles, and push's status returned.
  [[nodiscard]] absl::Status PushLease(absl::string_view session, absl::string_view lease_token, uint32_t peer_uid,
                                       absl::FunctionRef<absl::Status(absl::Span<const LeasedFd>)> push);

  // After a restart, before serving: rebuilds the pools of `saved` (their chunks imported from its FDs
  // and mapped; a chunk without an FD leaves its pool kRecovering) and releases FDs no record accounts
  // for. Starts the recovery grace.
  RestoreReport Restore(SavedState saved);

  // The handle channel's ReturnHandles: FDs of pool chunks from a client that still maps them (after a
  // restart). Missing chunks are imported and mapped; chunks the daemon has are checked against the FD
  // (host: the same memfd). All or nothing: INVALID_ARGUMENT naming the chunk when an FD does not fit.
  struct Returned {
    std::vector<uint64_t> adopted;
    std::vector<uint64_t> missing;
    PoolState state = PoolState::kAwake;
  };
  [[nodiscard]] absl::StatusOr<Returned> ReturnHandles(absl::string_view session, uint32_t peer_uid,
                                                       absl::string_view pool,
                                                       std::vector<std::pair<uint64_t, UniqueFd>> fds);

  [[nodiscard]] absl::StatusOr<PoolMetadata> GetPoolMetadata(const Caller& caller, absl::string_view pool) const;
  [[nodiscard]] absl::StatusOr<PoolMetadata> SetPoolMetadata(const Caller& caller, absl::string_view pool,
                                                             uint64_t expected_version, std::string data);

  // Stops: tells every watcher, closes their streams and releases the daemon's own handles. With
  // `keep_pools` (a restart) the event is DAEMON_RESTARTING and the saved state and the FD store are left
  // as they are, so the next daemon restores every pool; otherwise DAEMON_STOPPING, and every pool is
  // deleted. Idempotent; later calls that change pools fail with UNAVAILABLE.
  void Shutdown(bool keep_pools = false);

 private:
  // The pool `name` if `caller` may see and change it: NOT_FOUND otherwise, the same for a pool that
  // does not exist and one the caller's uid may not use.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Pool>> Find(const Caller& caller, absl::string_view name) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The pool attached client `client_id` belongs to; NOT_FOUND naming client_id otherwise.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Pool>> FindClient(absl::string_view client_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::shared_ptr<Pool>> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  // Takes `pool` out of pools_ and its owner's usage.
  void ErasePoolLocked(const Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a refusal by a limit (a RESOURCE_EXHAUSTED from limits.h's checks) and passes it on.
  absl::Status Refused(absl::Status status) const;
  void ForgetClients(const std::vector<std::string>& ids) ABSL_LOCKS_EXCLUDED(mu_);

  // The resize state machine, op_mu held: Check, Stage (grow and wake), Apply, then the daemon's
  // references to released chunks go. Prepare and Commit split it at Stage.
  // A shrink or sleep first quiesces the clients of sessions other than `session` (QuiesceLocked).
  // Attach (kYes) and TryAttach (kNo, nullopt while op_mu is held).
  enum class Wait { kNo, kYes };
  [[nodiscard]] std::optional<absl::StatusOr<AttachResult>> Attach(Wait wait, const Caller& caller,
                                                                   absl::string_view pool,
                                                                   absl::string_view client_name,
                                                                   absl::string_view device_uuid, bool pausable);
  [[nodiscard]] absl::StatusOr<Change> PrepareLocked(Pool& pool, GroupOp op, uint64_t target_blocks,
                                                     absl::string_view session, const ReleaseOptions& release,
                                                     const KeepOptions& keep = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // The runs a keeping sleep of `pool` copies and the tier extent for them (nullopt: nothing committed).
  // FAILED_PRECONDITION without a tier, INVALID_ARGUMENT naming live_blocks[i], RESOURCE_EXHAUSTED when the
  // tier has no room.
  [[nodiscard]] absl::StatusOr<std::optional<KeptContents>> PlanKeep(Pool& pool, const KeepOptions& keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // Gives back what a prepared change holds and did not apply: its staged memory and a sleep's tier extent.
  void Unprepare(Pool& pool, Change& change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  PoolUpdate CommitLocked(Pool& pool, Change change, absl::string_view session, absl::Time start)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // A plain resize: PrepareLocked and CommitLocked under one hold of op_mu, then the wait.
  [[nodiscard]] absl::StatusOr<PoolUpdate> Resize(const Caller& caller, const std::shared_ptr<Pool>& pool, GroupOp op,
                                                  uint64_t target_blocks, bool wait, absl::Time deadline,
                                                  const ReleaseOptions& release = {}, const KeepOptions& keep = {});
  // Before a release of `leaving` asked by `session` (empty: the daemon's own): refuses for a client of
  // another session that is not pausable unless forced, then pauses the pausable ones and waits for their
  // acknowledgements; the pause stays for Pool::Apply, Destroy or GiveUpRecovery to end (or Unstage to
  // call off). On failure nothing changed and no pause is left. `what` names the release in errors.
  // After a pause's wait: DEADLINE_EXCEEDED naming the first client of `outcome.late`, or with `detach`
  // each of them detached (it keeps what it fetched, counted, as any holder), logged and added to
  // `*detached`. The caller calls the pause off on an error.
  [[nodiscard]] absl::Status SettleLatePause(Pool& pool, absl::string_view what, const Pool::PauseOutcome& outcome,
                                             absl::Duration timeout, bool detach,
                                             std::vector<std::string>* detached) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  [[nodiscard]] absl::Status QuiesceLocked(Pool& pool, absl::string_view session, absl::string_view what,
                                           const std::vector<ChunkInfo>& leaving,
                                           const ReleaseOptions& options) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // ReshapeServices: what the reshaper is handed (reshaper.h).
  [[nodiscard]] absl::Status CheckRunning() const override ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::StatusOr<PoolUpdate> ReleaseWholeChunksLocked(Pool& pool, absl::string_view session,
                                                                    uint64_t target_blocks,
                                                                    const ReleaseOptions& release,
                                                                    absl::Time start) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());

  // The budget and memory that take `pool` from its prefix to `target_blocks`: chunks created, mapped
  // in the daemon and exported, but not in the table. On failure nothing is left. `observer` is told of each
  // chunk as it is mapped (ChunkMaker::Make).
  [[nodiscard]] absl::StatusOr<Staged> Stage(Pool& pool, uint64_t target_blocks,
                                             ChunkMaker::Observer* observer = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // Gives staged memory back: the chunks and their budget.
  void Unstage(Pool& pool, Staged& staged) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());

  // After a grow: queues the pool for compactor_ when it has more chunks than compact_above_chunks.
  void CompactLaterIfFragmented(const PoolView& pool);
  // compactor_'s loop: compacts the queued pools as the daemon, one at a time, until Shutdown.
  void CompactInBackground();
  // Aborts transaction `id` of `pool` (op_mu held) if the pool still holds it, recording `why` (when not
  // empty) for a later Commit. Returns the prepared bytes given back.
  uint64_t AbortLocked(Pool& pool, absl::string_view id, std::optional<absl::string_view> session,
                       absl::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // The pool holding `transaction`, found through the transaction table.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Pool>> FindTransaction(absl::string_view transaction) const;
  // A range lease's FDs (RedeemLease).
  [[nodiscard]] absl::StatusOr<std::vector<LeasedFd>> RedeemRanges(Pool& pool, const LeaseRecord& lease)
      ABSL_LOCKS_EXCLUDED(pool.op_mu());
  // The reaper thread: aborts transactions whose ttl passed.
  void ReapExpired();
  // Unmaps and releases everything of a pool being deleted or shut down (op_mu held, pool out of pools_).
  // kDaemonRestarting keeps its record and FDs in the store; anything else forgets them.
  // A delete is forced past the clients of sessions other than `session` that no pause holds.
  void Destroy(Pool& pool, EventType why, absl::string_view session = {}) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // OK to go on with a sliced operation after `done` of `total` entries; else why not (see ZeroBlocks).
  [[nodiscard]] absl::Status CheckInterrupt(absl::string_view call, const Interrupt& interrupt, size_t done,
                                            size_t total) const ABSL_LOCKS_EXCLUDED(mu_);
  // The one slice loop of the block operations: `op` on at most ManagerOptions::block_slice_bytes of `span`'s
  // blocks' worth of `entries` (at least one entry) at a time, with CheckInterrupt before each slice.
  template <typename Entry, typename Op>
  [[nodiscard]] absl::Status InSlices(absl::string_view call, const Interrupt& interrupt, const BlockSpan& span,
                                      absl::Span<const Entry> entries, Op op) const ABSL_LOCKS_EXCLUDED(mu_);
  // Writes the pool's record (op_mu held, so one pool's records are written in order). A failure is
  // sticky: the pool is stale (StateHealth) until a later save of it succeeds.
  // Maps the pool's chunks that the daemon does not map yet into its view, before it touches their bytes
  // (Note [The daemon maps on demand]); the device's failure, naming the pool.
  [[nodiscard]] absl::Status MapView(Pool& pool) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  void Save(Pool& pool) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) ABSL_LOCKS_EXCLUDED(mu_);
  // After an acknowledgement, a detach or a session's end: when `pool`'s record counts more bytes pending
  // release than the pool now does (a release settled after the operation saved it), queues the pool for
  // saver_ to write again (Note [A release that settles later is saved again]).
  void ResaveIfSettled(const std::shared_ptr<Pool>& pool) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes `pool`'s record again (taking op_mu) when it counts more bytes pending release than the pool does
  // now: after a wait for a release, before the reply; and on the saver thread.
  void SaveIfSettled(Pool& pool) ABSL_LOCKS_EXCLUDED(mu_, pool.op_mu());
  // The saver thread: writes the records ResaveIfSettled queued.
  void ResaveInBackground();
  // Removes the pool's record (op_mu held); a failure leaves the pool stale as a failed Save does.
  void Forget(Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) ABSL_LOCKS_EXCLUDED(mu_);
  // Notes the outcome of writing or removing `pool`'s record; tells the observer when degraded changes.
  void NoteSaved(absl::string_view pool, const absl::Status& written, absl::string_view what)
      ABSL_LOCKS_EXCLUDED(state_mu_, observer_mu_);
  // Rebuilds one saved pool; nullptr (with the reasons in `report`) when it cannot be.
  std::shared_ptr<Pool> RestorePool(const SavedPool& saved, std::map<uint64_t, UniqueFd>& fds, RestoreReport& report);
  // The recovery grace: at `deadline` (or the daemon's stop) pools still recovering lose their missing chunks.
  void ExpireRecovery(absl::Time deadline);
  void Warn(const std::string& line) const;
  // The daemon itself, for the arbiter's deadline actions (Note [Releases pause first]: every client is
  // another session's).
  Caller DaemonCaller() const;
  // Resize, waiting for memory in the arbiter's queue when `wait` asks it (Grow, Wake).
  [[nodiscard]] absl::StatusOr<PoolUpdate> ResizeWaiting(const Caller& caller, const std::shared_ptr<Pool>& pool,
                                                         GroupOp op, uint64_t target_blocks, const WaitOptions& wait);
  // What the arbiter asks of the manager (Arbiter::Hooks).
  Arbiter::Hooks ArbiterHooks();

  Device* const device_;
  const ManagerOptions options_;
  const std::unique_ptr<StateStore> own_store_;  // when options_.store is null
  StateStore* const store_;                      // never null
  DeviceInfo device_info_;
  DeviceCapabilities capabilities_;  // probed when the device opened
  Budget budget_;
  Arbiter arbiter_;
  HostTier* const host_tier_;  // options_.host_tier
  SessionTable sessions_;
  LeaseTable leases_;
  TransactionTable transactions_;
  std::atomic<uint64_t> next_chunk_id_{1};
  PoolShared shared_;
  ChunkMaker maker_;
  Reshaper reshaper_;

  // Guards the maps of pools and of clients; a leaf: no pool lock is taken while it is held.
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Pool>, std::less<>> pools_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string, std::less<>> client_pools_ ABSL_GUARDED_BY(mu_);  // client id -> pool
  // Pools and reserved bytes by owner uid, and in total; owners with no pool are absent.
  std::map<uint32_t, uint64_t> pools_by_uid_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, uint64_t> reserved_by_uid_ ABSL_GUARDED_BY(mu_);
  uint64_t reserved_total_ ABSL_GUARDED_BY(mu_) = 0;
  // Refusals by limit, indexed as kLimitFlags (limits.h); atomics, so counting takes no lock.
  mutable std::array<std::atomic<uint64_t>, kLimitFlags.size()> refusals_{};
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
  std::thread recovery_;
  // Deleted pools whose chunks clients may map still: their bytes stay in the budget until every one of
  // those clients let go (Detach with released, or its session's end). See Note [A deleted pool's memory
  // is counted until its clients let go] in docs/architecture.md.
  struct Orphaned {
    std::string pool;
    Pool::Held held;
  };
  std::vector<Orphaned> orphaned_ ABSL_GUARDED_BY(mu_);
  // Settles `client_id` (every client of `session` when empty) in orphaned_; adds to `*freed` the bytes no
  // one holds any more, for the caller to give to the budget once mu_ is released (Note [Lock order]).
  // Returns whether it found the client.
  bool LetGoLocked(absl::string_view session, absl::string_view client_id, uint64_t* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pools a grow left past ManagerOptions::compact_above_chunks, for compactor_.
  std::deque<std::string> to_compact_ ABSL_GUARDED_BY(mu_);
  std::thread compactor_;
  // By pool: the pending_release_bytes of its last record written; and the pools saver_ writes again.
  std::map<std::string, uint64_t, std::less<>> saved_pending_ ABSL_GUARDED_BY(mu_);
  std::deque<std::weak_ptr<Pool>> to_resave_ ABSL_GUARDED_BY(mu_);
  std::thread saver_;
  // Whether the saved state is current (StateHealth). A leaf.
  mutable absl::Mutex state_mu_;
  struct Stale {
    std::string error;
    uint64_t sequence = 0;  // of the failure, for the latest
  };
  std::map<std::string, Stale, std::less<>> stale_ ABSL_GUARDED_BY(state_mu_);  // by pool
  uint64_t save_failures_ ABSL_GUARDED_BY(state_mu_) = 0;
  std::atomic<bool> state_degraded_{false};  // !stale_.empty(), read without state_mu_ by the observer
  // A leaf: held only while calling an observer.
  absl::Mutex observer_mu_;
  Observers observers_ ABSL_GUARDED_BY(observer_mu_);
  void ObserveStep(const ReshapeReport& step) override ABSL_LOCKS_EXCLUDED(observer_mu_);
};

}  // namespace kvd::daemon
