// The values the daemon's pool model hands out: who asks (Caller), chunks, leases, snapshots of a pool
// (PoolView), the result of a change (PoolUpdate), group operations and the events clients watch.
// Plain values, no locks; the rooms that produce them are pool.h, sessions.h, event_queue.h and
// pool_manager.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "daemon/core/geometry.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/policy.h"
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
  // CU_MEM_HANDLE_TYPE_FABRIC bytes, exported once at creation where the device delivers fabric handles
  // (its probe succeeded); null otherwise. Shared, never changed: every copy of the chunk's info (views,
  // events, records) is its four numbers and a pointer, not a string of its own (Note [The daemon's own
  // memory] in docs/architecture.md).
  std::shared_ptr<const std::string> fabric_handle;
};

// One FD of a range export (PoolManager::ExportRanges): the pool's bytes [offset, offset + bytes) from its
// base, inside `segment`, found at `fd_offset` in the FD; `chunk_ids` are the chunks it covers (a release
// naming any of them means: deregister this FD first).
struct RangeHandle {
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t fd_offset = 0;
  std::vector<uint64_t> chunk_ids;
};

// A single-use capability to fetch the FDs of `chunk_ids` on the handle channel, for `uid`.
struct Lease {
  std::string token;
  std::vector<uint64_t> chunk_ids;
  absl::Time expires;
};

// kRecovering: restored after a restart without (some of) its memory, until clients give the chunks'
// FDs back or the recovery grace passes (Note [Durable pools] in docs/architecture.md).
enum class PoolState { kAwake, kSleeping, kRecovering };

// What keeps the pools' memory across a restart of the daemon (proto Durability).
enum class Durability { kNone, kClients, kFdStore };

// Whether the saved state is current, for DeviceInfo, metrics and the health service (docs/operations.md, "When saving
// the state fails"). A record that could not be written (or removed) makes its pool *stale*:
// a restart now would restore it as its last written record says. Sticky per pool until a later save (or
// removal) of that pool's record succeeds; a restart clears it (the new daemon starts from what was written).
struct StateHealth {
  uint64_t save_failures = 0;  // records not written or not removed since the daemon started
  uint32_t stale_pools = 0;    // pools whose saved record is not their current state
  std::string error;           // the latest failure among the stale pools; empty when none is stale
  bool degraded() const { return stale_pools > 0; }
};

// Engine-defined bytes kept with a pool across restarts (proto PoolMetadata).
struct PoolMetadata {
  uint64_t version = 0;  // 0 until the first set
  std::string data;
  absl::Time updated_at = absl::UnixEpoch();
};

struct ClientView {
  std::string id;
  std::string name;
  uint32_t uid = 0;
  int32_t pid = 0;
  uint64_t mapped_bytes = 0;  // handed to the client and not yet acknowledged as released
  absl::Time attached_at;
  std::string device_uuid;  // the device it maps from when not the daemon's own (peer access)
  bool pausable = false;    // it takes part in pauses (AttachRequest.pausable)
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
  uint64_t kept_bytes = 0;  // while sleeping: bytes kept in the host tier for Wake to copy back
  uint32_t owner_uid = 0;
  std::vector<uint32_t> allowed_uids;
  std::vector<ClientView> clients;  // empty when the view only counts them (ViewClients::kCounted)
  std::vector<ChunkInfo> chunks;    // by (segment, offset)
  uint64_t generation = 0;
  absl::Time created_at;
  GroupMembership group;
  std::vector<std::string> peer_devices;
  std::string transaction;  // the prepared transaction holding the pool, if any
  uint64_t epoch = 0;       // the daemon's
  uint64_t metadata_version = 0;
  uint64_t metadata_bytes = 0;
  std::vector<uint64_t> missing_chunk_ids;  // kRecovering: chunks no client has given back yet
  uint64_t client_count = 0;                // attached clients, whether or not `clients` lists them
  PoolClaim claim;                          // policy, usage report, reclaim and waiters (arbiter.h)
};

// A range export's handles and the lease that turns them into FDs on the handle channel (the lease's
// chunk_ids stay empty: its FDs are the handles', in order).
struct RangeExport {
  std::string pool;
  std::vector<RangeHandle> handles;
  Lease lease;
  uint64_t generation = 0;
};

// How long a pause may take to start, and what becomes of a client that does not acknowledge it (proto
// PauseOptions).
struct PauseOptions {
  absl::Duration timeout = absl::ZeroDuration();  // zero: the manager's default (--pause-timeout)
  bool detach_unresponsive = false;
};

// How a release treats the attached clients of other sessions (Note [Releases pause first] in
// docs/architecture.md): pausable ones are paused first (within `pause`); one that is not pausable makes
// the release FAILED_PRECONDITION naming it unless `force`, which also detaches a pausable client that
// does not acknowledge in time (as pause.detach_unresponsive does).
struct ReleaseOptions {
  bool force = false;
  PauseOptions pause;
};

// How a long request learns that its caller gave up; consulted between slices of work.
struct Interrupt {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty: never cancelled
};

// What a shrink or compact did to a pool's physical shape (proto Reshape).
struct ReshapeReport {
  uint32_t chunks_before = 0;
  uint32_t chunks_after = 0;
  uint32_t chunks_replaced = 0;
  uint32_t chunks_added = 0;
  uint64_t copied_bytes = 0;
  absl::Duration copy;
  uint32_t paused_clients = 0;
  absl::Duration pause;
  uint32_t resumed_clients = 0;
  std::vector<std::string> detached_client_ids;
  std::vector<BlockCopy> moved_blocks;
  bool target_reached = false;
  uint32_t steps = 0;        // pauses (or copies, with no client attached) the change took
  absl::Duration max_pause;  // the longest of them
};

// Where a resize's time went in the daemon, summed over its chunks (the service's debug line); zero for a step
// that did not run.
struct ResizePhases {
  absl::Duration admit;     // the arbiter's admission (the device's free count)
  absl::Duration create;    // Device::Create
  absl::Duration exported;  // Device::Export (and the fabric handle)
  absl::Duration map;       // Device::Map into the daemon's view (Note [The daemon maps on demand])
  absl::Duration store;     // the FDs into the state store
  absl::Duration apply;     // the table, the events and the leases
  absl::Duration save;      // the pool's record
  absl::Duration release;   // the daemon's own references to released chunks
};

// The result of one change to a pool's chunk table.
struct PoolUpdate {
  PoolView pool;
  std::vector<ChunkInfo> added;
  std::optional<Lease> lease;  // the caller's FDs of `added`
  std::vector<uint64_t> released_chunk_ids;
  uint64_t release_id = 0;  // 0: nothing to acknowledge
  absl::Duration elapsed;
  ResizePhases phases;                   // grow, shrink, sleep and wake
  std::optional<ReshapeReport> reshape;  // shrink and compact
};

// The four resizes. Plain Grow/Shrink/Sleep/Wake and engine groups' Prepare/Commit run the same
// state machine (pool.h): a plain resize is a prepare and a commit in one call.
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

enum class EventType {
  kChunksAdded,
  kChunksReleased,
  kPoolDeleted,
  kDaemonStopping,
  kDaemonRestarting,
  kPause,
  kResume,
  kReclaim
};

// One contiguous byte range of a pool, from its base address.
struct ByteRange {
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;

  bool operator==(const ByteRange&) const = default;
};

struct PoolEvent {
  uint64_t sequence = 0;
  std::string pool;
  EventType type = EventType::kChunksAdded;
  std::vector<ChunkInfo> chunks;
  std::optional<Lease> lease;  // kChunksAdded: this client's FDs of `chunks`
  uint64_t release_id = 0;     // kChunksReleased and an applied kResume: what to acknowledge
  uint64_t committed_blocks = 0;
  PoolState state = PoolState::kAwake;
  uint64_t pause_id = 0;  // kPause and kResume
  bool applied = false;   // kResume
  // kPause of a release (no new chunks): the bytes going away; empty: the ranges of `chunks`.
  std::vector<ByteRange> ranges;
  // kChunksReleased and kPoolDeleted: forced past this client, which is not pausable and did not ask for
  // it (Note [Releases pause first] in docs/architecture.md).
  bool forced = false;
  // kReclaim: give back `reclaim_bytes` by `reclaim_deadline`, or DeclineReclaim(reclaim_id).
  uint64_t reclaim_id = 0;
  uint64_t reclaim_bytes = 0;
  absl::Time reclaim_deadline;
};

struct DeviceStatus {
  DeviceInfo info;
  uint64_t committed_bytes = 0;  // all pools, including bytes pending release
  uint64_t pending_release_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t budget_bytes = 0;
  uint64_t max_chunk_bytes = 0;
  uint32_t pools = 0;
  // As the device probed them, less what this daemon's API does not deliver (fabric handles).
  DeviceCapabilities capabilities;
  uint64_t epoch = 0;
  absl::Time started_at;
  Durability durability = Durability::kNone;
  StateHealth state;
  // Admission (arbiter.h): --device-headroom, the device memory other processes use, what a grow could be
  // admitted for now, and the requests waiting for memory.
  uint64_t headroom_bytes = 0;
  uint64_t foreign_bytes = 0;
  uint64_t available_bytes = 0;
  uint32_t waiting_requests = 0;
  uint64_t waiting_bytes = 0;
  uint64_t driver_out_of_memory = 0;  // creations the driver refused after admission
  uint64_t host_tier_bytes = 0;       // 0: no host tier
  uint64_t host_tier_used_bytes = 0;
  bool host_tier_ready = false;
};

}  // namespace kvd::daemon
