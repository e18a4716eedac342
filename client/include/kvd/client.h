// libkvd: the C++ client of a kvd daemon (docs/api.md, docs/integrating.md). An engine connects to the
// daemon of its GPU, creates or finds a pool, attaches it and gets a Mapping: the pool's memory mapped
// at one base address in this process, kept in step with the daemon's chunk table by a background
// follower thread (grow, shrink, sleep, wake, delete). Other languages use this library through its C API,
// kvd/kvd.h (docs/c_api.md); the Python package is a binding of it.
//
// Ownership. Client::Connect returns the only owner of a Client; a Mapping keeps what it needs of its
// Client alive, so either may be destroyed first. The Mapping owns the imported chunks, their mappings,
// one open FD per mapped chunk (closed when the chunk is unmapped: after a daemon restart it hands the
// chunks back with them) and the VA reservation, and gives all of them back when destroyed.
//
// Daemon restarts (docs/integrating.md, "When kvd restarts"). A call made while the daemon is away
// fails at once with UNAVAILABLE "kvd at SOCKET is not answering (restarting?): retry in 1s: ..."; the
// next call after it is back opens a new session transparently (the session token changes). A
// Mapping's follower reconnects on its own (ConnectOptions::reconnect_for), keeps every chunk that
// survived mapped where it is, and reports the restart once (AttachOptions::on_restart).
//
// Threads. Every method of Client and Mapping may be called from any thread, concurrently. Mapping
// callbacks run on the Mapping's follower thread, one at a time; they may call Mapping's read-only
// accessors and any Client method except those that wait for this Mapping's own acknowledgement
// (Shrink/Sleep with wait = true, any Shrink that is not whole_chunks_only, and Compact, of the same
// pool), and must not destroy the Mapping.
//
// Errors. absl::Status; a daemon error arrives with its canonical code and message unchanged (for
// example INVALID_ARGUMENT "dims.heads: must be > 0"); UNAVAILABLE when no daemon answers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace kvd {

// The default gRPC socket of device N: "/run/kvd/gpu<N>.sock".
std::string DefaultSocket(int device);
// The handle channel beside a gRPC socket: "X.sock" -> "X.handles" (else `socket` + ".handles").
std::string HandlesPathFor(absl::string_view socket);

// The kvd sockets of this node: every *.sock in `directory` (default $KVD_SOCKET_DIR, else $NVIDIA_DRA_LOCAL_IPC_DIR,
// else /run/kvd),
// sorted. NOT_FOUND when the directory cannot be read or holds none.
[[nodiscard]] absl::StatusOr<std::vector<std::string>> NodeSockets(absl::string_view directory = {});

// The socket of the kvd that serves the device `device_uuid` — a UUID as GetDeviceInfo reports it, or
// a unique case-insensitive prefix of one ("GPU-" may be left out) — among NodeSockets(directory).
// Processes number GPUs differently (CUDA_VISIBLE_DEVICES), so an engine finds its kvd by its GPU's
// UUID. NOT_FOUND naming the daemons and devices seen; INVALID_ARGUMENT when the prefix is ambiguous.
// `timeout`: the deadline of each daemon's answer (ConnectOptions::timeout).
[[nodiscard]] absl::StatusOr<std::string> FindSocket(absl::string_view device_uuid, absl::string_view directory = {},
                                                     absl::Duration timeout = absl::Seconds(30));

struct ConnectOptions {
  // The daemon's gRPC socket. Empty: $KVD_SOCKET, else DefaultSocket(device).
  std::string socket;
  int device = 0;
  // The session's name ([A-Za-z0-9._-]{0,64}); shown by kvctl. Empty: "libkvd".
  std::string client_name;
  // The deadline of each call (RPCs and handle-channel fetches). Shrink, Sleep, a forced DeletePool and a
  // shrink's or sleep's Prepare, which may pause other sessions' clients, use the larger of this, 65 s and
  // 2 x PauseOptions::timeout + 65 s; Compact and a Shrink that is not whole_chunks_only, which may go in
  // steps, 10 minutes at least.
  absl::Duration timeout = absl::Seconds(30);
  // How long a Mapping's follower keeps trying to reach a daemon that restarted (its event stream
  // said DAEMON_RESTARTING or broke with UNAVAILABLE), retrying after 50 ms, doubling up to 2 s.
  // Past it the Mapping is lost (UNAVAILABLE). Zero: never reconnect (the Mapping is lost at once).
  absl::Duration reconnect_for = absl::Minutes(5);
  // For tools that print the daemon's replies as they are (kvctl --json): called with every reply message
  // the daemon answered with OK (a kvd.v1 message, e.g. kvd.v1.Pool for GetPool) to this Client's methods,
  // before the method returns, on the calling thread. A Group calls it for each rank's Client, from
  // several threads at once. It must not call back into the Client. Engines leave it empty.
  std::function<void(const google::protobuf::Message& reply)> on_reply;
};

// What the device's memory can be shared as (proto Capabilities), probed when the daemon started; an
// item is `supported` only when this daemon's API delivers it. docs/connectors.md.
struct CapabilityReport {
  struct Item {
    bool supported = false;
    std::string detail;  // how it was established, or why not
  };
  struct Peer {
    uint32_t device_index = 0;
    std::string device_uuid;
    bool access = false;
    std::string detail;
  };
  Item posix_fd;
  Item fabric;
  Item dma_buf;
  Item gpu_direct_rdma_vmm;
  bool range_spans_chunks = false;
  std::vector<Peer> peers;
  uint64_t granularity_bytes = 0;
  uint64_t max_chunk_bytes = 0;
};

// GetDeviceInfo.
struct DeviceStatus {
  std::string backend;  // "host", "cuda", "hip"
  uint32_t device_index = 0;
  std::string name;
  std::string uuid;
  std::string driver_version;
  std::string daemon_version;
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t committed_bytes = 0;
  uint64_t budget_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t granularity_bytes = 0;
  uint64_t max_chunk_bytes = 0;
  uint32_t pool_count = 0;
  // Restarts: 1 for a daemon that started without saved state, +1 for each start that restored it.
  uint64_t epoch = 0;
  uint64_t started_at_unix_ms = 0;
  // What keeps the pools' memory across a restart (proto Durability): "none", "clients", "fd_store"
  // ("unspecified" from a daemon that does not say).
  std::string durability;
  // The saved state (docs/operations.md): degraded while a pool's record could not be written or removed;
  // state_error names the latest such failure and its pool; state_save_failures counts them since start.
  bool state_degraded = false;
  std::string state_error;
  uint64_t state_save_failures = 0;
  std::vector<std::string> handle_types;  // "posix_fd", "fabric", "dma_buf": what the API delivers
  CapabilityReport capabilities;
  // Admission (docs/api.md, "Policy, waiting and reclaim"): the device memory no grow may take, what other
  // processes use, what one grow could be admitted for now, and the grows and wakes waiting for memory.
  uint64_t headroom_bytes = 0;
  uint64_t foreign_bytes = 0;
  uint64_t available_bytes = 0;
  uint32_t waiting_requests = 0;
  uint64_t waiting_bytes = 0;
  uint64_t driver_out_of_memory = 0;  // creations the driver refused after admission (should stay 0)
  uint64_t host_tier_bytes = 0;       // where sleeps keep their contents; 0: none
  uint64_t host_tier_used_bytes = 0;
  bool host_tier_ready = false;  // allocated and registered: a keeping sleep waits for it
};

// [L, B, H, N, C] and the element size (proto PoolDims).
struct PoolDims {
  uint64_t layers = 0;
  uint64_t capacity_blocks = 0;
  uint64_t heads = 0;
  uint64_t block_tokens = 0;
  uint64_t channels = 0;
  uint64_t element_bytes = 0;
};

// The layout precedence chain's inputs (proto LayoutRequest). Layouts are "LBHNC" ... "BHLNC" or, in
// a requirement, a class ("block-outermost", "layer-outermost", "any").
struct LayoutRequest {
  std::string override_layout;
  struct Requirement {
    std::string backend;
    std::vector<std::string> layouts;
  };
  std::vector<Requirement> backend_requirements;
  struct Preference {
    std::string connector;
    std::string layout;
  };
  std::vector<Preference> connector_preferences;
  // The engine's KVD_KV_CACHE_LAYOUT. Unset: the client fills it from this process's environment
  // (an unset or empty variable sends nothing and the daemon's own environment applies).
  bool env_layout_set = false;
  std::string env_layout;
};

// Which rule decided and why (proto LayoutResolution); `rule` is the enum name without its prefix in
// lower case: "request_override", "operator_override", "backend_requirement", "client_env",
// "daemon_env", "connector_preference", "default".
struct LayoutResolution {
  std::string layout;
  std::string rule;
  std::string rule_detail;
  std::vector<std::string> allowed_layouts;
  std::vector<std::string> warnings;
};

// Where every byte of a pool lives (proto Geometry): byte (l, b, h, n, c) is at
//   offset + l*stride_l + b*stride_b + h*stride_h + n*stride_n + c*stride_c
// from the pool's base address.
struct Geometry {
  std::string layout;
  PoolDims dims;
  uint64_t stride_l = 0;
  uint64_t stride_b = 0;
  uint64_t stride_h = 0;
  uint64_t stride_n = 0;
  uint64_t stride_c = 0;
  uint64_t offset = 0;
  uint64_t layer_stride = 0;
  uint64_t block_stride = 0;
  uint64_t segments = 0;
  uint64_t segment_stride = 0;
  uint64_t reserved_bytes = 0;
  uint64_t granularity_bytes = 0;
  // Bytes of one block across all layers (L*H*N*C*e): what `--bytes` sizes are divided by.
  uint64_t block_bytes() const {
    return dims.layers * dims.heads * dims.block_tokens * dims.channels * dims.element_bytes;
  }
};

struct ChunkInfo {
  uint64_t id = 0;
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  // CU_MEM_HANDLE_TYPE_FABRIC bytes where the daemon delivers them (DeviceStatus::handle_types has
  // "fabric"): importers across an NVLink domain pass them to cuMemImportFromShareableHandle.
  std::string fabric_handle;
};

struct ClientInfo {
  std::string client_id;
  std::string name;
  uint32_t uid = 0;
  int32_t pid = 0;
  uint64_t mapped_bytes = 0;
  uint64_t attached_at_unix_ms = 0;
  std::string device_uuid;  // the device it maps from when not the daemon's own (peer access)
  bool pausable = false;    // it takes part in pauses (AttachOptions::on_pause)
};

// One rank of an engine group: the pools of one engine's tensor-parallel ranks, one per daemon
// (kvd/group.h resizes them together). An empty name: the pool is in no group.
struct GroupMembership {
  std::string name;
  uint32_t rank = 0;
  uint32_t size = 0;
};

// kRecovering: restored after a daemon restart without its memory, waiting for clients to hand the
// chunks back (proto POOL_STATE_RECOVERING).
enum class PoolState { kUnknown, kAwake, kSleeping, kRecovering };
// "awake", "sleeping", "recovering", "unknown".
const char* PoolStateName(PoolState state);

// Arbitration of the device's memory among its pools (docs/api.md, "Policy, waiting and reclaim").
// What kvd does to a pool whose engine did not give back what a reclaim asked (proto ReclaimAction).
enum class ReclaimAction { kNone, kShrink, kSleep };
// "none", "shrink", "sleep".
const char* ReclaimActionName(ReclaimAction action);

// A pool's claim on the device's memory (proto PoolPolicy).
struct PoolPolicy {
  uint32_t priority = 0;   // 0..1000; waiting grows of higher priority are served first and may reclaim
  uint64_t min_bytes = 0;  // guaranteed: a reclaim never asks for, nor shrinks the pool below, this
  uint64_t max_bytes = 0;  // cap on the committed bytes; 0: none
  absl::Duration reclaim_timeout = absl::ZeroDuration();  // zero: the daemon's --reclaim-timeout
  ReclaimAction on_reclaim_timeout = ReclaimAction::kNone;
};

// A change of a pool's policy (SetPoolPolicy): the fields set replace the pool's.
struct PolicyChange {
  std::optional<uint32_t> priority;
  std::optional<uint64_t> min_bytes;
  std::optional<uint64_t> max_bytes;
  std::optional<absl::Duration> reclaim_timeout;
  std::optional<ReclaimAction> on_reclaim_timeout;
};

// What the engine last reported of its pool (ReportUsage).
struct PoolUsage {
  uint64_t live_blocks = 0;
  uint64_t evictable_blocks = 0;
  uint64_t used_blocks = 0;
  uint64_t reported_at_unix_ms = 0;
};

// The reclaim asked of a pool (id 0: none under way), and how the last one ended (proto ReclaimState).
struct ReclaimState {
  uint64_t reclaim_id = 0;
  uint64_t asked_bytes = 0;
  uint64_t given_bytes = 0;
  uint64_t asked_at_unix_ms = 0;
  uint64_t deadline_unix_ms = 0;
  std::string last_outcome;
};

// A grow or wake of the pool waiting for memory (proto WaitingRequest).
struct WaitingRequest {
  uint64_t asked_bytes = 0;
  uint64_t waiting_since_unix_ms = 0;
  uint32_t position = 0;  // 1: the first of every waiting request of the device
};

// A pool's snapshot (proto Pool).
struct PoolInfo {
  std::string name;
  PoolState state = PoolState::kUnknown;
  Geometry geometry;
  LayoutResolution layout;
  uint64_t committed_blocks = 0;
  uint64_t committed_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t pending_release_bytes = 0;
  uint64_t wake_blocks = 0;
  uint64_t kept_bytes = 0;  // while sleeping: bytes kept in the host tier that Wake copies back
  uint32_t owner_uid = 0;
  std::vector<uint32_t> allowed_uids;
  // Listed by GetPool, ListPools and CreatePool; empty in the pool of Attach's and resizes' replies.
  std::vector<ClientInfo> clients;
  std::vector<ChunkInfo> chunks;
  uint64_t generation = 0;
  uint64_t created_at_unix_ms = 0;
  GroupMembership group;
  std::vector<std::string> peer_devices;  // device UUIDs (or "*") whose clients may attach
  std::string transaction;                // the prepared group operation holding the pool, if any
  uint64_t epoch = 0;                     // the answering daemon's epoch (DeviceStatus::epoch)
  uint64_t metadata_version = 0;          // the pool metadata's version; 0: never set
  uint64_t metadata_bytes = 0;
  std::vector<uint64_t> missing_chunk_ids;  // kRecovering: chunks no client has handed back yet
  uint32_t client_count = 0;                // attached clients, in every reply
  PoolPolicy policy;
  bool policy_operator_bounds = false;  // an operator set its cap or reclaim policy: tenants may only tighten them
  std::optional<PoolUsage> usage;       // unset until the engine reports
  ReclaimState reclaim;
  std::vector<WaitingRequest> waiting;
};

struct PoolOptions {
  std::string name;
  PoolDims dims;
  uint64_t initial_blocks = 0;
  LayoutRequest layout;
  std::vector<uint32_t> allowed_uids;
  GroupMembership group;
  std::vector<std::string> peer_devices;
  PoolPolicy policy;  // checked as SetPoolPolicy checks a change from the defaults
};

// Whether a Grow or Wake short of memory waits for it (GrowRequest.wait): queued by its pool's priority,
// then by arrival, memory reclaimed from pools of lower priority, for at most `wait_for` (zero: the
// Client's ConnectOptions::timeout). Then RESOURCE_EXHAUSTED saying what it asked of whom.
struct WaitOptions {
  bool wait = false;
  absl::Duration wait_for = absl::ZeroDuration();
};

// A RECLAIM event (AttachOptions::on_reclaim): give back `bytes` of the pool by `deadline`.
struct ReclaimRequest {
  std::string pool;
  uint64_t reclaim_id = 0;
  uint64_t bytes = 0;
  absl::Time deadline;
  uint64_t committed_blocks = 0;  // the pool's when asked
};

// The two-phase operations a group coordinator drives on each daemon (kvd/group.h).
enum class GroupOp { kGrow, kShrink, kSleep, kWake };
// "grow", "shrink", "sleep", "wake".
const char* GroupOpName(GroupOp op);

struct PreparedChange {
  std::string transaction;
  PoolInfo pool;                // as it is now, held by the transaction
  uint64_t prepared_bytes = 0;  // memory made ready for a grow or wake, not yet visible
  uint64_t expires_at_unix_ms = 0;
  uint64_t elapsed_us = 0;
};

// Live block `src` of a compaction shrink now lives at `dst` (proto BlockCopy).
struct BlockMove {
  uint64_t src = 0;
  uint64_t dst = 0;
};

// What a Shrink or Compact did to the pool's physical shape (proto Reshape; docs/api.md, "Pauses and
// reshaping").
struct Reshape {
  uint32_t chunks_before = 0;
  uint32_t chunks_after = 0;
  uint32_t chunks_replaced = 0;  // old chunks whose kept bytes were copied into new ones
  uint32_t chunks_added = 0;
  uint64_t copied_bytes = 0;  // copied on the device
  uint64_t copy_us = 0;
  uint32_t paused_clients = 0;
  uint64_t pause_us = 0;  // every client paused -> the last one resumed (summed over steps); 0: nobody paused
  uint32_t resumed_clients = 0;
  std::vector<std::string> detached_client_ids;  // PauseOptions::detach_unresponsive
  std::vector<BlockMove> moved_blocks;           // compaction shrink
  bool target_reached = false;                   // Shrink: every segment's prefix is at the target
  uint32_t steps = 0;                            // pauses it took (Compact: CompactOptions::max_chunks_per_pause)
  uint64_t max_pause_us = 0;                     // the longest of them
};

// The result of one change (proto PoolUpdate).
struct PoolChange {
  PoolInfo pool;
  std::vector<ChunkInfo> added;
  std::vector<uint64_t> released_chunk_ids;
  uint64_t release_id = 0;
  uint64_t elapsed_us = 0;         // the daemon's time
  std::optional<Reshape> reshape;  // Shrink, Compact and a shrink's Commit
};

// How long a pause may take to start, and what happens to a client that does not acknowledge it (proto
// PauseOptions).
struct PauseOptions {
  absl::Duration timeout = absl::ZeroDuration();  // zero: the daemon's --pause-timeout
  // Detach a client that does not acknowledge in time and go on; otherwise the change fails with
  // DEADLINE_EXCEEDED naming it and nothing changes.
  bool detach_unresponsive = false;
};

struct ShrinkOptions {
  bool wait = false;  // reply once every attached client acknowledged the release
  // Release whole chunks only and move no byte (the pool may stay above the target: see
  // PoolChange::reshape->target_reached and pool.committed_blocks).
  bool whole_chunks_only = false;
  // Compaction shrink: the blocks the engine still uses. Live blocks at or above the target are moved
  // into free blocks below it first (PoolChange::reshape->moved_blocks). nullopt: no compaction.
  std::optional<std::vector<uint64_t>> live_blocks;
  PauseOptions pause;
  // Whole chunks only: go on past attached clients of other sessions that are not pausable (they keep
  // what they map until they detach; docs/api.md, "Releases and running engines"); pausable ones that do
  // not acknowledge in time are detached.
  bool force = false;
};

struct SleepOptions {
  bool wait = false;   // reply once every attached client acknowledged the release
  bool force = false;  // as ShrinkOptions::force
  PauseOptions pause;  // for the pausable clients of other sessions, which pause first
  // Keep the contents in the daemon's host tier; Wake copies them back (docs/api.md, "Sleep that keeps the
  // contents"). With a named pool, `live_blocks` (non-empty) keeps only those blocks.
  bool keep = false;
  std::vector<uint64_t> live_blocks;
};

struct CompactOptions {
  PauseOptions pause;
  // With clients attached: at most this many chunks replaced under one pause, in as many steps as it
  // takes (the clients run between them). 0: the daemon's --compact-chunks-per-pause.
  uint32_t max_chunks_per_pause = 0;
};

struct ResolvedLayout {
  LayoutResolution resolution;
  bool has_geometry = false;  // dims were given
  Geometry geometry;
};

// KV connectors (docs/connectors.md). `count` runs of `bytes` bytes; run i starts at
// offset + i*stride from the pool's base address (proto TransferDescriptor).
struct TransferDescriptor {
  uint64_t segment = 0;  // of the first run
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t stride = 0;  // == bytes when count == 1
  uint64_t count = 0;
};

// A contiguous byte range of a pool, from its base address, inside one segment (proto ByteRange).
struct ByteRange {
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// One FD of a range export: the pool's bytes [offset, offset + bytes) are at fd_offset in `fd` (CUDA: a
// DMA-BUF to register with ibv_reg_dmabuf_mr / UCX / NIXL; host: a memfd to mmap or ibv_reg_mr).
struct RangeHandle {
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t fd_offset = 0;
  std::vector<uint64_t> chunk_ids;  // a release naming one of them means: deregister this handle first
  int fd = -1;                      // the caller's: close it once registered (the registration keeps it)
};

struct RangeExport {
  std::string pool;
  std::vector<RangeHandle> handles;
  bool ranges_span_chunks = false;  // one FD per range (CUDA); else one per chunk a range touches (host)
  uint64_t generation = 0;
};

// The pool's metadata (proto PoolMetadata): engine-defined bytes kept with the pool across restarts of
// kvd and of the engine (docs/api.md, "Pool metadata").
struct PoolMetadata {
  std::string pool;
  uint64_t version = 0;  // 0 until the first set
  std::string data;
  absl::Time updated_at = absl::UnixEpoch();  // the epoch until the first set
};

// DescribeTransfer's reply: every byte of the blocks in exactly one run of one descriptor.
struct TransferPlan {
  std::vector<TransferDescriptor> descriptors;
  uint64_t blocks = 0;
  uint64_t bytes = 0;  // sum of bytes*count
  uint64_t committed_blocks = 0;
  uint64_t generation = 0;
};

// Layer l of every block: the bytes of (l, b, h, n, c) are at
//   data + b*stride_b + h*stride_h + n*stride_n + c*stride_c.
struct LayerView {
  void* data = nullptr;
  uint64_t stride_b = 0;
  uint64_t stride_h = 0;
  uint64_t stride_n = 0;
  uint64_t stride_c = 0;
  PoolDims dims;
};

// What a Mapping reports once it is attached again after its daemon restarted (AttachOptions::on_restart).
struct DaemonRestart {
  uint64_t epoch = 0;  // the new daemon's
  // The chunks this Mapping had mapped that the restarted daemon no longer has: they are unmapped, and
  // their bytes read as unbacked. Empty: nothing was lost, every byte is where it was.
  std::vector<uint64_t> lost_chunk_ids;
  uint64_t lost_bytes = 0;
  // Chunks whose FDs this Mapping handed back to a RECOVERING pool (and the daemon adopted).
  std::vector<uint64_t> returned_chunk_ids;
  uint64_t committed_blocks = 0;  // the pool's, now
};

// What a Mapping tells its owner, on its follower thread, after it has acted on an event.
struct AttachOptions {
  // Empty: the session's name.
  std::string client_name;
  // The device this process maps the pool from: empty for the daemon's own device; else a device index
  // or UUID (prefix) of the daemon's backend as this process numbers them. Another device than the
  // daemon's is peer access: the pool must grant it (PoolOptions::peer_devices, GrantPeerAccess) and
  // the pair must support it (FAILED_PRECONDITION naming both devices otherwise).
  std::string device;
  // New chunks are mapped (grow or wake by another session; this Client's own Grow/Wake map before
  // they return and do not call it). Argument: the committed blocks now. Not called when a release took
  // some of the new chunks before they were fetched: that release's event says the size (docs/api.md,
  // "Leases and concurrent releases").
  std::function<void(uint64_t committed_blocks)> on_grow;
  // Chunks were unmapped and acknowledged (shrink or sleep). Argument: the committed blocks now.
  std::function<void(uint64_t committed_blocks)> on_release;
  // The pool was deleted (NOT_FOUND "pool P was deleted"), the daemon stopped (UNAVAILABLE "kvd is
  // stopping"), the event stream ended or broke, or the follower could not map added chunks ("mapping
  // chunks added to pool P: ...", with the failure's code, e.g. an expired lease) or acknowledge a
  // release: everything is unmapped, the Mapping is lost (state() == kLost) and detached in the daemon.
  // After a daemon restart also: the pool did not survive it (NOT_FOUND "pool P did not survive the
  // restart of kvd ..."), or the daemon was not back within ConnectOptions::reconnect_for (UNAVAILABLE).
  // Argument: why.
  std::function<void(const absl::Status& why)> on_lost;
  // The daemon restarted (DAEMON_RESTARTING, or a crash: the stream broke with UNAVAILABLE) and this
  // Mapping is attached again under a new client id: it handed its chunks' FDs back if the pool was
  // RECOVERING, kept every chunk the daemon still has (same id, segment, offset and bytes) mapped
  // untouched, unmapped the ones it lost and mapped any new ones. Called once per restart.
  std::function<void(const DaemonRestart& restart)> on_restart;
  // KV connectors (docs/connectors.md). New bytes as contiguous ranges per segment, once mapped (grow or
  // wake by another session; this Client's own Grow/Wake reply carries `added` instead): export and
  // register just these (Client::ExportRanges with them).
  std::function<void(const std::vector<ByteRange>& ranges)> on_ranges_added;
  // Bytes being released (shrink or sleep), called *before* the follower unmaps and acknowledges:
  // deregister every registration overlapping them and close their FDs. The daemon's release (and a
  // Shrink/Sleep with wait) waits until this returns.
  std::function<void(const std::vector<ByteRange>& ranges)> on_ranges_released;
  // Pauses (docs/api.md, "Pauses and reshaping" and "Releases and running engines"). Setting on_pause
  // makes this Mapping pausable (AttachRequest.pausable): the daemon may then move the pool's bytes into
  // new chunks at the same addresses (an exact Shrink, Compact), and pauses it before another session's
  // Shrink, Sleep or forced delete takes memory away. On a PAUSE the follower imports the new chunks,
  // calls on_pause(ranges: the bytes that move or go) — stop every access to the pool (synchronise the
  // streams that use it) and return — and acknowledges. On the RESUME it unmaps the replaced and released
  // chunks, maps the new ones at the same addresses and calls on_resume(applied); applied is false when
  // the change was called off and nothing moved. After a sleep's RESUME the Mapping is kSleeping (touch
  // nothing until on_grow); after a delete's pause on_lost follows instead. The follower never unmaps
  // what the engine may be touching: before it unmaps for any other reason (the daemon stopping, chunks a
  // restart lost, an error) it calls on_pause itself. Connectors: on_ranges_released is called for the
  // moving bytes before on_pause and on_ranges_added after the remap. Without on_pause the Mapping is not
  // pausable: a change that moves its pool's bytes fails with FAILED_PRECONDITION while it is attached,
  // as does a release by another session unless forced; a forced release leaves the Mapping kLost with
  // every chunk still mapped until it is destroyed.
  std::function<void(const std::vector<ByteRange>& ranges)> on_pause;
  std::function<void(bool applied)> on_resume;
  // Reclaims (docs/integrating.md, "Answering a reclaim"): kvd asks this pool's engine to give memory back
  // for a waiting grow of higher priority. Called on a thread of its own (not the follower's), so it may
  // give back right there — drop prefix cache, then Client::ShrinkForReclaim with the live blocks (a
  // compaction shrink) — and return OK. Any other status declines: the Mapping sends DeclineReclaim with
  // its message, and the pool's policy applies at once (PoolPolicy::on_reclaim_timeout). Unset: the event
  // is ignored, and the policy applies at the deadline. Called once per reclaim, also when this Mapping
  // attaches (or follows a restarted kvd) while that reclaim is under way.
  std::function<absl::Status(const ReclaimRequest& request)> on_reclaim;
};

class Client;

// One attached pool, mapped into this process. Created by Client::Attach.
class Mapping {
 public:
  enum class State { kAwake, kSleeping, kLost };

  ~Mapping();  // stops the follower, detaches, unmaps, releases and frees the VA
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  // The pool's base address; valid (reserved) for the Mapping's lifetime. Only committed blocks are
  // backed by memory.
  void* base() const;
  const std::string& pool() const;
  // The daemon's id of this attachment; a new one after each daemon restart.
  std::string client_id() const;
  // The epoch of the daemon this Mapping is attached to now (DeviceStatus::epoch).
  uint64_t epoch() const;
  const Geometry& geometry() const;
  const LayoutResolution& layout() const;
  // Layer l (< dims.layers) of block 0 with the byte strides of B, H, N, C.
  LayerView layer(uint64_t l) const;
  // The committed blocks as the daemon last reported them to this Mapping (its Client's Grow/Wake
  // reply, or an event): blocks below it are mapped once the follower handled every event.
  uint64_t committed_blocks() const;
  State state() const;
  // The pool's state as this Mapping last knew it (kAwake or kSleeping), also once it is lost.
  State pool_state() const;
  // The chunks mapped now, by offset.
  std::vector<ChunkInfo> chunks() const;

  // The device of this process the chunks are mapped with (AttachOptions::device, else the daemon's).
  struct MappedDevice {
    std::string backend;  // "host", "cuda", "hip"
    int index = 0;        // as this process numbers its devices (CUDA_VISIBLE_DEVICES counts)
    std::string uuid;
  };
  const MappedDevice& device() const;

  // What the follower did so far: every event it read from the daemon, the PAUSEs whose new chunks it
  // imported, and the RESUMEs it acted on (applied or not).
  struct Counts {
    uint64_t events = 0;
    uint64_t pauses = 0;
    uint64_t resumes = 0;
  };
  Counts counts() const;

  struct Impl;

 private:
  friend class Client;
  explicit Mapping(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

class Client {
 public:
  // Opens a session on the handle channel and a gRPC channel to the daemon; UNAVAILABLE when no
  // daemon listens. Every method then fails with UNAVAILABLE (and a retry hint) while the daemon is
  // away, and re-opens the session once it is back.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Client>> Connect(ConnectOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& socket() const;

  [[nodiscard]] absl::StatusOr<DeviceStatus> DeviceInfo();
  // Every pool this uid may use, by name: all pages of the paginated ListPools.
  [[nodiscard]] absl::StatusOr<std::vector<PoolInfo>> ListPools();
  [[nodiscard]] absl::StatusOr<PoolInfo> GetPool(absl::string_view name);
  [[nodiscard]] absl::StatusOr<PoolInfo> CreatePool(const PoolOptions& options);
  // Dry run of the layout chain; with dims (all > 0) also the geometry such a pool would get.
  [[nodiscard]] absl::StatusOr<ResolvedLayout> ResolveLayout(const LayoutRequest& request,
                                                             const PoolDims* dims = nullptr);
  // Grow and Wake map this client's new chunks into its Mapping of the pool (if any) before
  // returning; new chunks that another session's release (a compaction, a shrink, a sleep) took before
  // they were fetched are left to that release's event, which the Mapping follows (docs/api.md, "Leases
  // and concurrent releases"). If the pool changed but mapping failed (its lease expired, say), the error
  // keeps the failure's code and says "pool P changed but mapping its new chunks failed: ..."; the Mapping
  // then keeps its previous committed_blocks().
  [[nodiscard]] absl::StatusOr<PoolChange> Grow(absl::string_view pool, uint64_t target_blocks);
  // With wait.wait, waits for memory as WaitOptions says instead of failing at once.
  [[nodiscard]] absl::StatusOr<PoolChange> Grow(absl::string_view pool, uint64_t target_blocks,
                                                const WaitOptions& wait);
  [[nodiscard]] absl::StatusOr<PoolChange> Shrink(absl::string_view pool, uint64_t target_blocks, bool wait);
  // Shrink to the exact target (rounded up to the granularity), pausing the attached clients when a chunk
  // straddles it; options as ShrinkOptions says. This client's own Mapping remaps before it returns: when
  // it has not within the call's deadline, DEADLINE_EXCEEDED "pool P changed but this client's Mapping of
  // it did not remap within ..." (the daemon did change the pool). The 3-argument Shrink is this one with
  // ShrinkOptions{.wait = wait}.
  [[nodiscard]] absl::StatusOr<PoolChange> Shrink(absl::string_view pool, uint64_t target_blocks,
                                                  const ShrinkOptions& options);
  // Rewrites a fragmented pool as one chunk per segment (split at the daemon's maximum chunk size) while
  // the attached clients pause, in steps (CompactOptions). This client's own Mapping remaps before it
  // returns. A step that fails leaves the steps before it done; the error says so.
  [[nodiscard]] absl::StatusOr<PoolChange> Compact(absl::string_view pool, const CompactOptions& options = {});
  // An empty `pool` means every pool (awake ones for Sleep, sleeping ones for Wake).
  [[nodiscard]] absl::StatusOr<std::vector<PoolChange>> Sleep(absl::string_view pool, bool wait);
  // Attached clients of other sessions pause first, or refuse the sleep when not pausable, unless forced
  // (docs/api.md, "Releases and running engines").
  [[nodiscard]] absl::StatusOr<std::vector<PoolChange>> Sleep(absl::string_view pool, const SleepOptions& options);
  [[nodiscard]] absl::StatusOr<std::vector<PoolChange>> Wake(absl::string_view pool);
  // One pool, waiting for memory as WaitOptions says.
  [[nodiscard]] absl::StatusOr<std::vector<PoolChange>> Wake(absl::string_view pool, const WaitOptions& wait);
  // Returns the released bytes.
  // `force`: even with clients attached; those of other sessions are released as SleepOptions::force says,
  // the pausable ones paused (within `pause`) before the delete.
  [[nodiscard]] absl::StatusOr<uint64_t> DeletePool(absl::string_view name, bool force, const PauseOptions& pause = {});
  // Attaches the pool and maps its committed chunks. One Mapping per pool per Client:
  // ALREADY_EXISTS for a second one.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<Mapping>> Attach(absl::string_view pool, AttachOptions options = {});
  // Grants (or with `revoke` takes back) peer access to the pool for a device UUID or "*".
  [[nodiscard]] absl::StatusOr<PoolInfo> GrantPeerAccess(absl::string_view pool, absl::string_view device_uuid,
                                                         bool revoke = false);

  // The pool's metadata. SetPoolMetadata is a compare-and-set: ABORTED (nothing changed) unless
  // `expected_version` is the current version; INVALID_ARGUMENT past the daemon's --max-metadata-bytes.
  [[nodiscard]] absl::StatusOr<PoolMetadata> GetPoolMetadata(absl::string_view pool);
  [[nodiscard]] absl::StatusOr<PoolMetadata> SetPoolMetadata(absl::string_view pool, uint64_t expected_version,
                                                             std::string data);

  // Arbitration (docs/api.md, "Policy, waiting and reclaim"). SetPoolPolicy changes the fields `change`
  // sets: INVALID_ARGUMENT or PERMISSION_DENIED naming the field (a uid other than root and kvd's may lower
  // its pool's claim, and raise it only within what the operator grants it).
  [[nodiscard]] absl::StatusOr<PoolInfo> SetPoolPolicy(absl::string_view pool, const PolicyChange& change);
  // What the engine uses of the pool: `live` blocks it needs, `evictable` blocks it could drop, and `used`,
  // the bound below which all of them lie (a policy's deadline shrink keeps the blocks below it).
  [[nodiscard]] absl::Status ReportUsage(absl::string_view pool, uint64_t live_blocks, uint64_t evictable_blocks,
                                         uint64_t used_blocks);
  // The engine will not give back what reclaim `request` asks (on_reclaim does this for a non-OK return).
  [[nodiscard]] absl::Status DeclineReclaim(const ReclaimRequest& request, absl::string_view reason);
  // The helper from "these blocks are live" to the compaction shrink that answers `request`: shrinks the
  // pool to the fewest blocks that give back at least request.bytes (its committed bytes less them), but
  // never below live_blocks.size(), moving the live blocks at or past the target below it. The reply's
  // reshape->moved_blocks says where each moved block went: apply it to the engine's block table.
  [[nodiscard]] absl::StatusOr<PoolChange> ShrinkForReclaim(const ReclaimRequest& request,
                                                            const std::vector<uint64_t>& live_blocks,
                                                            const PauseOptions& pause = {});

  // The strided descriptors covering `block_ids` (empty: every committed block) under the pool's layout.
  // INVALID_ARGUMENT naming block_ids[i] for an uncommitted or repeated id.
  [[nodiscard]] absl::StatusOr<TransferPlan> DescribeTransfer(absl::string_view pool,
                                                              const std::vector<uint64_t>& block_ids = {});

  // FDs over byte ranges of `mapping`'s pool for one-time RDMA registration, fetched on the handle channel
  // (docs/connectors.md). `ranges`: granularity multiples, each inside one segment's committed prefix;
  // empty: every segment's whole committed prefix. The caller owns (and closes) every handle's fd.
  // UNIMPLEMENTED where the daemon's device has no range export (kvctl caps says why).
  [[nodiscard]] absl::StatusOr<RangeExport> ExportRanges(const Mapping& mapping,
                                                         const std::vector<ByteRange>& ranges = {});
  // The same for the attached client `client_id` of this Client's session (Mapping::client_id()).
  [[nodiscard]] absl::StatusOr<RangeExport> ExportRanges(absl::string_view client_id,
                                                         const std::vector<ByteRange>& ranges = {});

  // Zeroes blocks of the pool on the device, and copies blocks (src -> dst) inside it: INVALID_ARGUMENT
  // naming the entry for an uncommitted block, an overlap or a repeated destination (docs/api.md).
  [[nodiscard]] absl::Status ZeroBlocks(absl::string_view pool, const std::vector<uint64_t>& block_ids);
  [[nodiscard]] absl::Status CopyBlocks(absl::string_view pool, const std::vector<BlockMove>& copies);

  // Two phases of one group operation on this daemon (kvd::Group drives them on every rank).
  // `target_blocks` is for grow and shrink; `ttl` how long the daemon holds the pool before it aborts.
  // `force`: a shrink or sleep goes on past attached clients of other sessions that are not pausable
  // (SleepOptions::force); the pausable ones are paused until the Commit or Abort.
  // `keep`: a sleep keeps the contents (SleepOptions::keep), copied at the Prepare.
  [[nodiscard]] absl::StatusOr<PreparedChange> Prepare(absl::string_view pool, GroupOp op, uint64_t target_blocks,
                                                       absl::Duration ttl, bool force = false, bool keep = false);
  // Commit maps this client's new chunks into its Mapping of the pool, as Grow does.
  [[nodiscard]] absl::StatusOr<PoolChange> Commit(absl::string_view transaction, bool wait);
  // Returns the prepared bytes given back.
  [[nodiscard]] absl::StatusOr<uint64_t> Abort(absl::string_view transaction);

  // The protocol underneath, for tools and language bindings (the C API, kvd/kvd.h) — engines use the
  // methods above. CallMethod makes one unary RPC of kvd.v1.Kvd by its name ("GetPool"), the request and
  // the reply serialized kvd.v1 messages, on this Client's session as every method (re-opened after a
  // daemon restart; UNAVAILABLE with the retry hint while it is away); nothing else happens (an Attach so
  // made maps nothing). `timeout` zero: ConnectOptions::timeout. INVALID_ARGUMENT for a name that is not
  // a unary RPC of kvd.v1.Kvd or a request that is not its request message.
  [[nodiscard]] absl::StatusOr<std::string> CallMethod(absl::string_view method, absl::string_view request,
                                                       absl::Duration timeout = absl::ZeroDuration());
  // Redeems a lease (AttachResponse.lease, ...) on the handle channel of this Client's session: (chunk id,
  // FD) in the lease's order. The FDs are the caller's.
  [[nodiscard]] absl::StatusOr<std::vector<std::pair<uint64_t, int>>> FetchLease(absl::string_view lease_token);
  // The handle-channel session the next call uses (docs/api.md, "Identity"): a new one after a daemon
  // restart. UNAVAILABLE while the daemon is away.
  struct Session {
    std::string token;  // the kvd-session metadata of every call
    uint32_t uid = 0;   // the peer identity the daemon saw
    int32_t pid = 0;
  };
  [[nodiscard]] absl::StatusOr<Session> CurrentSession();

  struct Impl;

 private:
  explicit Client(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvd
