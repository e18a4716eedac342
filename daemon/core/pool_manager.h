// PoolManager: the daemon's domain model (DESIGN.md sections 5-7). It owns every pool of one device:
// their VA reservations, chunks (created, mapped into the daemon's own address space, exported once),
// attached clients, leases for the handle channel, release acknowledgements and the budget.
//
// Threads. Every method is thread-safe. Requests on one pool are serialised; requests on different
// pools proceed in parallel (the budget is the only state they share). Methods that wait (Shrink and
// Sleep with wait_for_release) hold no lock while waiting.
//
// Identity. Every pool-facing call takes the Caller, whose uid the handle channel learned from
// SO_PEERCRED (a session). A caller may see and change a pool when its uid is the pool's owner, one of
// its allowed uids, root, or the daemon's own uid; otherwise PERMISSION_DENIED naming the uid.
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

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/geometry.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/pool_spec.h"
#include "kvd/device.h"

namespace kvd::daemon {

// Who is asking: from the session token the RPC carried.
struct Caller {
  uint32_t uid = 0;
  int32_t pid = 0;
  std::string session;  // the session token
  std::string name;     // what the client called itself when it opened the session
};

struct ChunkInfo {
  uint64_t id = 0;  // unique for the daemon's lifetime
  uint64_t segment = 0;
  uint64_t offset = 0;  // from the pool's base
  uint64_t bytes = 0;
};

// A single-use capability to fetch the FDs of `chunk_ids` on the handle channel, for `uid`.
struct Lease {
  std::string token;
  std::vector<uint64_t> chunk_ids;
  absl::Time expires;
};

enum class PoolState { kAwake, kSleeping };

struct ClientView {
  std::string id;
  std::string name;
  uint32_t uid = 0;
  int32_t pid = 0;
  uint64_t mapped_bytes = 0;  // handed to the client and not yet acknowledged as released
  absl::Time attached_at;
  std::string device_uuid;  // the device it maps from when not the daemon's own (peer access)
};

// A consistent snapshot of one pool.
struct PoolView {
  std::string name;
  PoolState state = PoolState::kAwake;
  Geometry geometry;
  LayoutResolution layout;
  uint64_t committed_blocks = 0;
  uint64_t committed_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t pending_release_bytes = 0;
  uint64_t wake_blocks = 0;
  uint32_t owner_uid = 0;
  std::vector<uint32_t> allowed_uids;
  std::vector<ClientView> clients;
  std::vector<ChunkInfo> chunks;  // by (segment, offset)
  uint64_t generation = 0;
  absl::Time created_at;
  GroupMembership group;
  std::vector<std::string> peer_devices;
  std::string transaction;  // the prepared transaction holding the pool, if any
};

// The result of one change to a pool's chunk table.
struct PoolUpdate {
  PoolView pool;
  std::vector<ChunkInfo> added;
  std::optional<Lease> lease;  // the caller's FDs of `added`
  std::vector<uint64_t> released_chunk_ids;
  uint64_t release_id = 0;  // 0: nothing to acknowledge
  absl::Duration elapsed;
};

enum class GroupOp { kGrow, kShrink, kSleep, kWake };
// "grow", "shrink", "sleep", "wake".
const char* GroupOpName(GroupOp op);

struct PreparedOp {
  std::string transaction;
  PoolView pool;
  uint64_t prepared_bytes = 0;  // created for a grow or wake, not yet visible to clients
  absl::Time expires;
  absl::Duration elapsed;
};

struct CommittedOp {
  GroupOp op = GroupOp::kGrow;
  PoolUpdate update;
};

struct AttachResult {
  std::string client_id;
  PoolView pool;
  Lease lease;  // every chunk of pool.chunks
};

enum class EventType { kChunksAdded, kChunksReleased, kPoolDeleted, kDaemonStopping };

struct PoolEvent {
  uint64_t sequence = 0;
  std::string pool;
  EventType type = EventType::kChunksAdded;
  std::vector<ChunkInfo> chunks;
  std::optional<Lease> lease;  // kChunksAdded: this client's FDs of `chunks`
  uint64_t release_id = 0;     // kChunksReleased: what to acknowledge
  uint64_t committed_blocks = 0;
  PoolState state = PoolState::kAwake;
};

// One attached client's events, in order. Closed when the client detaches, its pool is deleted or
// the daemon stops; Pop then drains what is left and returns nullopt.
class EventQueue {
 public:
  void Push(PoolEvent event);
  void Close();
  // The next event, or nullopt after `timeout` or once closed and drained.
  std::optional<PoolEvent> Pop(absl::Duration timeout);
  bool closed() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<PoolEvent> events_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

struct DeviceStatus {
  DeviceInfo info;
  uint64_t committed_bytes = 0;  // all pools, including bytes pending release
  uint64_t pending_release_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t budget_bytes = 0;
  uint64_t max_chunk_bytes = 0;
  uint32_t pools = 0;
};

struct ManagerOptions {
  uint64_t budget_bytes = 0;                             // 0: the device's total memory
  uint64_t max_chunk_bytes = uint64_t{4} << 30;          // grows split into chunks of at most this
  uint64_t max_pool_reserved_bytes = uint64_t{1} << 46;  // VA one pool may reserve (64 TiB)
  absl::Duration lease_ttl = absl::Seconds(30);
  LayoutPolicy layout_policy;
  uint32_t daemon_uid = 0;
};

class PoolManager {
 public:
  // `device` must outlive the manager.
  PoolManager(Device* device, ManagerOptions options);
  // Releases every chunk and reservation (as Shutdown).
  ~PoolManager();
  PoolManager(const PoolManager&) = delete;
  PoolManager& operator=(const PoolManager&) = delete;

  // Sessions: opened on the handle channel (uid and pid from SO_PEERCRED); closing one detaches
  // every client attached through it and drops its pending acknowledgements.
  std::string OpenSession(uint32_t uid, int32_t pid, std::string name);
  void CloseSession(absl::string_view session);
  // UNAUTHENTICATED for an unknown or closed session.
  [[nodiscard]] absl::StatusOr<Caller> Authenticate(absl::string_view session) const;

  [[nodiscard]] absl::StatusOr<DeviceStatus> GetDeviceStatus() const;
  [[nodiscard]] absl::StatusOr<LayoutResolution> ResolveLayout(const LayoutRequest& request) const;
  const ManagerOptions& options() const { return options_; }

  [[nodiscard]] absl::StatusOr<PoolView> CreatePool(const Caller& caller, const PoolSpec& spec);
  [[nodiscard]] absl::StatusOr<PoolView> GetPool(const Caller& caller, absl::string_view name) const;
  // The pools `caller` may see, by name.
  std::vector<PoolView> ListPools(const Caller& caller) const;
  // FAILED_PRECONDITION while clients are attached unless `force`. Returns the bytes released.
  [[nodiscard]] absl::StatusOr<uint64_t> DeletePool(const Caller& caller, absl::string_view name, bool force);

  // `device_uuid`: the device the client maps from; empty or the daemon's own device needs no grant,
  // any other must be granted by the pool (PERMISSION_DENIED naming both devices otherwise).
  [[nodiscard]] absl::StatusOr<AttachResult> Attach(const Caller& caller, absl::string_view pool,
                                                    absl::string_view client_name, absl::string_view device_uuid = {});
  // Adds (or with `revoke` removes) a device UUID or "*" to the pool's peer devices. Attached clients
  // keep their mappings when a grant is revoked.
  [[nodiscard]] absl::StatusOr<PoolView> GrantPeerAccess(const Caller& caller, absl::string_view pool,
                                                         absl::string_view device_uuid, bool revoke);
  [[nodiscard]] absl::Status Detach(const Caller& caller, absl::string_view client_id);

  // All-or-nothing: on failure every chunk this call made is released and the pool is as before.
  [[nodiscard]] absl::StatusOr<PoolUpdate> Grow(const Caller& caller, absl::string_view pool, uint64_t target_blocks);
  // With `wait`, returns once every client acknowledged or `deadline` passed (then with bytes still
  // pending in the view).
  [[nodiscard]] absl::StatusOr<PoolUpdate> Shrink(const Caller& caller, absl::string_view pool, uint64_t target_blocks,
                                                  bool wait, absl::Time deadline);
  // `pool` empty: every awake (Sleep) or sleeping (Wake) pool the caller may change.
  [[nodiscard]] absl::StatusOr<std::vector<PoolUpdate>> Sleep(const Caller& caller, absl::string_view pool, bool wait,
                                                              absl::Time deadline);
  [[nodiscard]] absl::StatusOr<std::vector<PoolUpdate>> Wake(const Caller& caller, absl::string_view pool);

  // Two-phase resizes for engine groups (see the top of this file). `target_blocks` is for kGrow and
  // kShrink and must be 0 otherwise; `ttl` is how long the pool stays held before the daemon aborts.
  [[nodiscard]] absl::StatusOr<PreparedOp> Prepare(const Caller& caller, absl::string_view pool, GroupOp op,
                                                   uint64_t target_blocks, absl::Duration ttl);
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

  [[nodiscard]] absl::Status ZeroBlocks(const Caller& caller, absl::string_view pool,
                                        absl::Span<const uint64_t> blocks);
  [[nodiscard]] absl::Status CopyBlocks(const Caller& caller, absl::string_view pool,
                                        absl::Span<const BlockCopy> copies);

  // The handle channel: a session's single-use lease becomes dup()s of its chunks' exported FDs (the
  // caller owns and closes them), in lease order. UNAUTHENTICATED for an unknown session;
  // PERMISSION_DENIED when `peer_uid` (SO_PEERCRED of the fetching connection) is not the session's
  // uid or the lease was issued to another session; NOT_FOUND for unknown or used leases;
  // DEADLINE_EXCEEDED for expired ones; FAILED_PRECONDITION if a chunk was released since.
  struct LeasedFd {
    uint64_t chunk_id;
    int fd;
  };
  [[nodiscard]] absl::StatusOr<std::vector<LeasedFd>> RedeemLease(absl::string_view session,
                                                                  absl::string_view lease_token, uint32_t peer_uid);

  // Tells every watcher the daemon is stopping, closes their streams and releases all memory.
  // Idempotent; later calls that change pools fail with UNAVAILABLE.
  void Shutdown();

 private:
  struct Pool;
  struct Client;
  struct ChunkRecord;
  struct Staged;
  struct Transaction;
  struct LeaseRecord {
    std::string pool;
    std::string session;
    std::vector<uint64_t> chunk_ids;
    absl::Time expires;
  };

  // The pool `name` if `caller` may see and change it: NOT_FOUND / PERMISSION_DENIED otherwise.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Pool>> Find(const Caller& caller, absl::string_view name) const;
  // Creates, maps and exports the planned chunks; on failure releases every one of them.
  [[nodiscard]] absl::StatusOr<std::vector<ChunkRecord>> MakeChunks(const Pool& pool,
                                                                    const std::vector<PlannedChunk>& plan);
  void DiscardChunk(const Pool& pool, ChunkRecord& record);
  // Grows `pool` (op_mu held) to `target_blocks`: StageLocked, then PublishLocked.
  [[nodiscard]] absl::StatusOr<PoolUpdate> GrowLocked(Pool& pool, const Caller& caller, uint64_t target_blocks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu);
  // The budget and memory for growing `pool` (op_mu held) from its prefix to `target_blocks`: chunks
  // created, mapped in the daemon and exported, but not in the table. On failure nothing is left.
  [[nodiscard]] absl::StatusOr<Staged> StageLocked(Pool& pool, uint64_t target_blocks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu);
  // Puts staged chunks into the table (mu_ held): prefix, generation, leases and events.
  PoolUpdate PublishLocked(Pool& pool, const Caller& caller, Staged staged, uint64_t target_blocks, absl::Time start)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives staged memory back (op_mu held, mu_ not).
  void Unstage(const Pool& pool, Staged& staged);
  // ABORTED while a transaction holds `pool` (mu_ held).
  absl::Status CheckNotHeldLocked(const Pool& pool) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The pool of `transaction` if `caller` may commit or abort it (mu_ held).
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Pool>> FindTransactionLocked(const Caller& caller,
                                                                            absl::string_view transaction) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Aborts the transaction holding `pool` (op_mu held) if it is `transaction` (any when empty),
  // recording `why` for a later Commit. Returns the prepared bytes given back.
  uint64_t AbortLocked(Pool& pool, absl::string_view transaction, absl::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu);
  // The reaper thread: aborts transactions whose ttl passed.
  void ReapExpired();
  // Takes every chunk at or past `prefix_bytes` of each segment out of the table (op_mu held), tells
  // the clients that were handed them (a lease naming such a chunk fails when redeemed), and
  // releases the daemon's own references.
  PoolUpdate ReleaseLocked(Pool& pool, uint64_t prefix_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu);
  // Waits (no lock held) until `release_id` of `pool` completed or `deadline` passed.
  void AwaitRelease(const Pool& pool, uint64_t release_id, absl::Time deadline);
  Lease IssueLeaseLocked(const Pool& pool, const std::string& session, std::vector<uint64_t> chunk_ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PoolView ViewLocked(const Pool& pool) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void DetachLocked(Pool& pool, const std::string& client_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The attached client `client_id` and its pool; NOT_FOUND naming client_id otherwise.
  [[nodiscard]] absl::StatusOr<std::pair<Pool*, Client*>> FindClientLocked(absl::string_view client_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets a completed release: its bytes leave the budget.
  void SettleReleasesLocked(Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unmaps and releases everything of a pool being deleted or shut down (op_mu held, pool out of pools_).
  void DestroyLocked(Pool& pool, EventType why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu);

  Device* const device_;
  const ManagerOptions options_;
  DeviceInfo device_info_;
  uint64_t budget_bytes_ = 0;

  // Guards the pool map and every pool's table, clients, releases and leases; never held across a
  // device call. Lock order: a pool's op_mu, then mu_.
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Pool>, std::less<>> pools_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Caller, std::less<>> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, LeaseRecord, std::less<>> leases_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string, std::less<>> client_pools_ ABSL_GUARDED_BY(mu_);  // client id -> pool
  uint64_t committed_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // all pools, including bytes pending release
  uint64_t next_chunk_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::string, std::less<>> transactions_ ABSL_GUARDED_BY(mu_);  // id -> pool
  // Why the daemon aborted recent transactions (the last kMaxAbortedRecords), for Commit's message.
  std::map<std::string, std::string, std::less<>> aborted_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> aborted_order_ ABSL_GUARDED_BY(mu_);
  bool reaper_kick_ ABSL_GUARDED_BY(mu_) = false;  // a transaction was prepared: recompute the deadline
  std::thread reaper_;
};

}  // namespace kvd::daemon
