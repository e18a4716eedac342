/* kvd/kvd.h: the C API of libkvd (library libkvd_c.so.1; docs/c_api.md), for engines and bindings written
 * in other languages (the Python package kvd is one: ctypes over these functions). It is libkvd itself,
 * behind plain C: one Mapping follower, one reconnection, one pause protocol, one group coordinator and one
 * device selection for every language (docs/integrating.md describes what they do).
 *
 * Handles. kvd_client, kvd_mapping and kvd_group are opaque; each is made by one call (kvd_connect,
 * kvd_client_attach, kvd_group_open) and given back by one (kvd_client_close, kvd_mapping_close,
 * kvd_group_close), exactly once, after every other call on it returned. A Mapping keeps what it needs of
 * its Client, so the two may be closed in either order. The option objects (kvd_*_options) are the
 * caller's: a call reads them and keeps nothing, so they may be destroyed or reused as soon as it returns.
 *
 * Memory. Every call that fails returns its canonical status code (KVD_OK is 0; the others are gRPC's,
 * as the daemon answered them) and, when `status` is not NULL, sets *status to a kvd_status with the code
 * and the message, unchanged from the daemon (INVALID_ARGUMENT "dims.heads: must be > 0"); the caller frees
 * it with kvd_status_free. What this API allocates for the caller is freed with the matching call:
 * kvd_buffer_free, kvd_free (strings and arrays), kvd_strings_free, kvd_group_change_free. Strings handed
 * in are NUL-terminated UTF-8; NULL stands for "" unless a function says otherwise.
 *
 * Replies. A call the daemon answers gives the reply as the serialized kvd.v1 message the function names,
 * into `reply` when it is not NULL (proto/kvd/v1/kvd.proto documents every field; decode it with any
 * protobuf library: prost, google.golang.org/protobuf, protobuf-c). The Mapping, which no message
 * describes, has plain accessors and structs.
 *
 * Threads. Every function may be called from any thread, and the calls on one kvd_client, kvd_mapping or
 * kvd_group from several threads at once (an option object is not for sharing while it is changed). A
 * Mapping's callbacks run on its follower thread, one at a time, with the `user` pointer given with them
 * (on_reclaim alone on a thread of its own); they must return (not unwind: no exception or longjmp may cross
 * them), must not close the Mapping, and, but for on_reclaim, must not wait for the Mapping's own
 * acknowledgement (a shrink, sleep or compact of its pool with wait, or any that moves bytes:
 * docs/integrating.md, "What the pause hook must do"). A Group's before_commit runs
 * on the thread of the call.
 *
 * Versions. KVD_C_API_VERSION_MAJOR is the library's soname (libkvd_c.so.1). Within a major version the API
 * only grows: new functions, new option setters, new fields at the end of the structs this API hands out
 * by pointer (kvd_geometry, kvd_restart, kvd_reclaim, kvd_group_change); kvd_buffer, kvd_dims, kvd_byte_range and
 * kvd_chunk, which callers allocate, never change. Anything else is a new major version and a new soname.
 * kvd_api_version() says which version is loaded.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVD_C_API_VERSION_MAJOR 1
#define KVD_C_API_VERSION_MINOR 1
/* major * 1000 + minor, of this header; kvd_api_version() is the loaded library's. */
#define KVD_C_API_VERSION (KVD_C_API_VERSION_MAJOR * 1000 + KVD_C_API_VERSION_MINOR)
int kvd_api_version(void);

/* ---- Status ---------------------------------------------------------------------------------------- */

/* The canonical status codes (google.rpc.Code), as every call returns them. */
enum {
  KVD_OK = 0,
  KVD_CANCELLED = 1,
  KVD_UNKNOWN = 2,
  KVD_INVALID_ARGUMENT = 3,
  KVD_DEADLINE_EXCEEDED = 4,
  KVD_NOT_FOUND = 5,
  KVD_ALREADY_EXISTS = 6,
  KVD_PERMISSION_DENIED = 7,
  KVD_RESOURCE_EXHAUSTED = 8,
  KVD_FAILED_PRECONDITION = 9,
  KVD_ABORTED = 10,
  KVD_OUT_OF_RANGE = 11,
  KVD_UNIMPLEMENTED = 12,
  KVD_INTERNAL = 13,
  KVD_UNAVAILABLE = 14,
  KVD_DATA_LOSS = 15,
  KVD_UNAUTHENTICATED = 16
};
/* "OK", "NOT_FOUND", ...; "UNKNOWN" for a number that is no code. Static storage. */
const char* kvd_code_name(int code);

typedef struct kvd_status kvd_status;
int kvd_status_code(const kvd_status* status);
/* Valid until kvd_status_free. */
const char* kvd_status_message(const kvd_status* status);
void kvd_status_free(kvd_status* status);

/* ---- Memory the API hands out ------------------------------------------------------------------------ */

/* Bytes the API allocated (a serialized reply). Caller-allocated and never changing; start it {NULL, 0}. */
typedef struct kvd_buffer {
  void* data;
  size_t size;
} kvd_buffer;
/* Frees buffer->data and sets it {NULL, 0}. */
void kvd_buffer_free(kvd_buffer* buffer);
/* Frees a string or an array this API returned. */
void kvd_free(void* p);
void kvd_strings_free(char** strings, size_t count);

/* ---- The node's daemons ------------------------------------------------------------------------------- */

/* The socket kvd_connect uses when none is given: $KVD_SOCKET, else /run/kvd/gpu<device>.sock. kvd_free. */
char* kvd_default_socket(int device);
/* The handle channel beside a gRPC socket: X.sock -> X.handles (else socket + ".handles"). kvd_free. */
char* kvd_handles_path(const char* socket);
/* Every *.sock in `directory` (NULL or "": $KVD_SOCKET_DIR, else /run/kvd), sorted; kvd_strings_free.
 * NOT_FOUND when the directory cannot be read or holds none. */
int kvd_node_sockets(const char* directory, char*** sockets, size_t* count, kvd_status** status);
/* The socket of the kvd that serves `device_uuid` (a UUID or a unique prefix; "GPU-" may be left out)
 * among kvd_node_sockets(directory), each asked within `timeout_us` (0: 30 s); kvd_free. NOT_FOUND naming
 * the daemons and devices seen; INVALID_ARGUMENT when the prefix is ambiguous. */
int kvd_find_socket(const char* device_uuid, const char* directory, int64_t timeout_us, char** socket,
                    kvd_status** status);

/* ---- Client ----------------------------------------------------------------------------------------- */

typedef struct kvd_client kvd_client;
typedef struct kvd_connect_options kvd_connect_options;

kvd_connect_options* kvd_connect_options_create(void);
void kvd_connect_options_destroy(kvd_connect_options* options);
/* The daemon's gRPC socket; unset: kvd_default_socket(device). */
void kvd_connect_options_set_socket(kvd_connect_options* options, const char* socket);
void kvd_connect_options_set_device(kvd_connect_options* options, int device);
/* The session's name ([A-Za-z0-9._-]{0,64}); unset: "libkvd". */
void kvd_connect_options_set_client_name(kvd_connect_options* options, const char* name);
/* The deadline of each call (default 30 s; changes that may pause other sessions get more). */
void kvd_connect_options_set_timeout_us(kvd_connect_options* options, int64_t timeout_us);
/* How long a Mapping's follower tries to reach a daemon that restarted (default 5 min; 0: never). */
void kvd_connect_options_set_reconnect_for_us(kvd_connect_options* options, int64_t reconnect_for_us);

/* Opens a session with the daemon; `options` may be NULL. UNAVAILABLE when no daemon listens. While the
 * daemon is away every call fails at once with UNAVAILABLE "kvd at S is not answering (restarting?): retry
 * in 1s: ..."; the next call once it is back opens a new session. */
int kvd_connect(const kvd_connect_options* options, kvd_client** client, kvd_status** status);
/* Ends the session; the client's Mappings stay usable until they are closed. */
void kvd_client_close(kvd_client* client);
/* Valid while the client lives. */
const char* kvd_client_socket(const kvd_client* client);

/* GetDeviceInfo: kvd.v1.DeviceInfo. */
int kvd_client_device_info(kvd_client* client, kvd_buffer* reply, kvd_status** status);
/* ListPools, every page: kvd.v1.ListPoolsResponse with every pool this uid may use, by name. */
int kvd_client_list_pools(kvd_client* client, kvd_buffer* reply, kvd_status** status);
/* GetPool: kvd.v1.Pool. */
int kvd_client_get_pool(kvd_client* client, const char* name, kvd_buffer* reply, kvd_status** status);

/* [L, B, H, N, C] and the element size (kvd.v1.PoolDims). Never changes. */
typedef struct kvd_dims {
  uint64_t layers;
  uint64_t capacity_blocks;
  uint64_t heads;
  uint64_t block_tokens;
  uint64_t channels;
  uint64_t element_bytes;
} kvd_dims;

typedef struct kvd_pool_options kvd_pool_options;
kvd_pool_options* kvd_pool_options_create(const char* name);
void kvd_pool_options_destroy(kvd_pool_options* options);
void kvd_pool_options_set_dims(kvd_pool_options* options, const kvd_dims* dims);
void kvd_pool_options_set_initial_blocks(kvd_pool_options* options, uint64_t blocks);
/* The layout request (docs/layouts.md): rule 1, rule 2 (one call per backend), rule 3 (unset: this process's
 * $KVD_KV_CACHE_LAYOUT), rule 4 (one call per connector). */
void kvd_pool_options_set_override_layout(kvd_pool_options* options, const char* layout);
void kvd_pool_options_add_backend_requirement(kvd_pool_options* options, const char* backend,
                                              const char* const* layouts, size_t count);
void kvd_pool_options_set_env_layout(kvd_pool_options* options, const char* layout);
void kvd_pool_options_add_connector_preference(kvd_pool_options* options, const char* connector, const char* layout);
void kvd_pool_options_add_allowed_uid(kvd_pool_options* options, uint32_t uid);
/* One rank of an engine group (kvd_group_open). */
void kvd_pool_options_set_group(kvd_pool_options* options, const char* name, uint32_t rank, uint32_t size);
/* A device UUID (or "*") whose processes may attach the pool. */
void kvd_pool_options_add_peer_device(kvd_pool_options* options, const char* device_uuid);

/* A pool's claim on the device's memory against the other pools' (kvd.v1.PoolPolicy; docs/api.md, "Policy,
 * waiting and reclaim"): an option object whose setters name the fields set. kvd_pool_options_set_policy
 * gives a new pool those fields (the others keep their defaults); kvd_client_set_pool_policy changes only
 * them. */
typedef struct kvd_policy_options kvd_policy_options;
kvd_policy_options* kvd_policy_options_create(void);
void kvd_policy_options_destroy(kvd_policy_options* options);
/* 0..1000: waiting grows of higher priority are served first and may reclaim from pools of lower priority. */
void kvd_policy_options_set_priority(kvd_policy_options* options, uint32_t priority);
/* Guaranteed: a reclaim never asks for, nor shrinks the pool below, this many committed bytes. */
void kvd_policy_options_set_min_bytes(kvd_policy_options* options, uint64_t bytes);
/* The cap on the pool's committed bytes; 0: none. */
void kvd_policy_options_set_max_bytes(kvd_policy_options* options, uint64_t bytes);
/* How long the engine has to answer a reclaim, rounded up to whole ms; 0: the daemon's --reclaim-timeout. */
void kvd_policy_options_set_reclaim_timeout_us(kvd_policy_options* options, int64_t timeout_us);
/* What kvd does at a reclaim's deadline (or at once on a decline): kvd.v1.ReclaimAction's values. */
enum { KVD_RECLAIM_NONE = 1, KVD_RECLAIM_SHRINK = 2, KVD_RECLAIM_SLEEP = 3 };
void kvd_policy_options_set_on_reclaim_timeout(kvd_policy_options* options, int action);
/* CreatePool with the policy's fields set (INVALID_ARGUMENT or PERMISSION_DENIED naming policy.<field>). */
void kvd_pool_options_set_policy(kvd_pool_options* options, const kvd_policy_options* policy);

/* CreatePool: kvd.v1.Pool. */
int kvd_client_create_pool(kvd_client* client, const kvd_pool_options* options, kvd_buffer* reply, kvd_status** status);
/* ResolveLayout, the dry run of kvd_client_create_pool: the options' layout request and, when
 * kvd_pool_options_set_dims was called, their dims (the reply has the geometry then); the name and the
 * rest are not read. kvd.v1.ResolveLayoutResponse. */
int kvd_client_resolve_layout(kvd_client* client, const kvd_pool_options* options, kvd_buffer* reply,
                              kvd_status** status);

/* The options of the changes that release memory or move it: each function reads the ones it names. */
typedef struct kvd_change_options kvd_change_options;
kvd_change_options* kvd_change_options_create(void);
void kvd_change_options_destroy(kvd_change_options* options);
/* Reply once every attached client acknowledged the release. */
void kvd_change_options_set_wait(kvd_change_options* options, int wait);
/* Go on past attached clients of other sessions that are not pausable (docs/api.md, "Releases and running
 * engines"). */
void kvd_change_options_set_force(kvd_change_options* options, int force);
/* A sleep that keeps the contents in the daemon's host tier, which the wake copies back (docs/api.md, "Sleep that
 * keeps the contents"); with a named pool and live blocks (below), only those blocks. */
void kvd_change_options_set_keep(kvd_change_options* options, int keep);
/* A shrink that releases whole chunks only and moves no byte. */
void kvd_change_options_set_whole_chunks_only(kvd_change_options* options, int whole_chunks_only);
/* A compaction shrink: the blocks the engine still uses (count 0: none); unset: no compaction. A keeping sleep: the
 * blocks it keeps (unset or count 0: every committed block). */
void kvd_change_options_set_live_blocks(kvd_change_options* options, const uint64_t* blocks, size_t count);
/* How long each client has to acknowledge a pause, rounded up to whole ms (0, the default: the daemon's
 * --pause-timeout), and whether one that does not is detached instead of failing the change. */
void kvd_change_options_set_pause_timeout_us(kvd_change_options* options, int64_t timeout_us);
void kvd_change_options_set_detach_unresponsive(kvd_change_options* options, int detach);
/* Compact: at most this many chunks replaced under one pause (0: the daemon's --compact-chunks-per-pause). */
void kvd_change_options_set_max_chunks_per_pause(kvd_change_options* options, uint32_t chunks);

/* Grow: kvd.v1.PoolUpdate. This client's Mapping of the pool has mapped the new chunks when it returns
 * ("pool P changed but mapping its new chunks failed: ..." with the failure's code otherwise). */
int kvd_client_grow(kvd_client* client, const char* pool, uint64_t target_blocks, kvd_buffer* reply,
                    kvd_status** status);
/* Grow that waits when memory is short (GrowRequest.wait): queued by the pool's priority, then by arrival,
 * memory reclaimed from pools of lower priority, for at most `wait_for_us` (0: the client's timeout); then
 * RESOURCE_EXHAUSTED saying what it asked of whom. kvd.v1.PoolUpdate, mapped as kvd_client_grow's. */
int kvd_client_grow_waiting(kvd_client* client, const char* pool, uint64_t target_blocks, int64_t wait_for_us,
                            kvd_buffer* reply, kvd_status** status);
/* Shrink (exact unless whole_chunks_only; wait, force, whole_chunks_only, live_blocks, the pause options):
 * kvd.v1.PoolUpdate. `options` may be NULL. This client's Mapping of the pool has remapped when it returns. */
int kvd_client_shrink(kvd_client* client, const char* pool, uint64_t target_blocks, const kvd_change_options* options,
                      kvd_buffer* reply, kvd_status** status);
/* Compact (the pause options, max_chunks_per_pause): kvd.v1.PoolUpdate. */
int kvd_client_compact(kvd_client* client, const char* pool, const kvd_change_options* options, kvd_buffer* reply,
                       kvd_status** status);
/* Sleep (wait, force, keep, live_blocks, the pause options); `pool` NULL or "": every awake pool.
 * kvd.v1.PoolUpdates. */
int kvd_client_sleep(kvd_client* client, const char* pool, const kvd_change_options* options, kvd_buffer* reply,
                     kvd_status** status);
/* Wake; `pool` NULL or "": every sleeping pool. kvd.v1.PoolUpdates; this client's Mappings have mapped. */
int kvd_client_wake(kvd_client* client, const char* pool, kvd_buffer* reply, kvd_status** status);
/* Wake of one pool that waits for memory as kvd_client_grow_waiting does: kvd.v1.PoolUpdates. */
int kvd_client_wake_waiting(kvd_client* client, const char* pool, int64_t wait_for_us, kvd_buffer* reply,
                            kvd_status** status);
/* DeletePool (force; the pause timeout for the pausable clients of other sessions):
 * kvd.v1.DeletePoolResponse. */
int kvd_client_delete_pool(kvd_client* client, const char* name, const kvd_change_options* options, kvd_buffer* reply,
                           kvd_status** status);
/* GrantPeerAccess (revoke: take the grant back): kvd.v1.Pool. */
int kvd_client_grant_peer_access(kvd_client* client, const char* pool, const char* device_uuid, int revoke,
                                 kvd_buffer* reply, kvd_status** status);
/* GetPoolMetadata / SetPoolMetadata (a compare-and-set): kvd.v1.PoolMetadata. */
int kvd_client_get_metadata(kvd_client* client, const char* pool, kvd_buffer* reply, kvd_status** status);
int kvd_client_set_metadata(kvd_client* client, const char* pool, uint64_t expected_version, const void* data,
                            size_t size, kvd_buffer* reply, kvd_status** status);
/* Arbitration (docs/api.md, "Policy, waiting and reclaim"). SetPoolPolicy of the fields `policy` sets:
 * kvd.v1.Pool; INVALID_ARGUMENT naming a field out of range (or none set), PERMISSION_DENIED naming one a
 * tenant may not raise. */
int kvd_client_set_pool_policy(kvd_client* client, const char* pool, const kvd_policy_options* policy,
                               kvd_buffer* reply, kvd_status** status);
/* ReportUsage: the blocks the engine needs (live), those it could drop (evictable), and the bound below which
 * all of them lie (used): kvd.v1.ReportUsageResponse. */
int kvd_client_report_usage(kvd_client* client, const char* pool, uint64_t live_blocks, uint64_t evictable_blocks,
                            uint64_t used_blocks, kvd_buffer* reply, kvd_status** status);
/* DeclineReclaim of reclaim `reclaim_id` of `pool` (the on_reclaim callback does it for a non-zero return):
 * kvd.v1.DeclineReclaimResponse. */
int kvd_client_decline_reclaim(kvd_client* client, const char* pool, uint64_t reclaim_id, const char* reason,
                               kvd_buffer* reply, kvd_status** status);
/* From "these blocks are live" to the compaction shrink that gives back `bytes` of `pool` (a reclaim's):
 * shrinks to the fewest blocks that give back at least `bytes`, never below `count` blocks, at a chunk
 * boundary where one lies between, moving the live blocks at or past the target below it, and waits for the
 * release (the pause options of `options`, which may be NULL). kvd.v1.PoolUpdate: reshape.moved_blocks says
 * where each moved live block went. FAILED_PRECONDITION when the live blocks fill the pool. */
int kvd_client_shrink_for_reclaim(kvd_client* client, const char* pool, uint64_t bytes, const uint64_t* live_blocks,
                                  size_t count, const kvd_change_options* options, kvd_buffer* reply,
                                  kvd_status** status);

/* DescribeTransfer of `block_ids` (count 0: every committed block): kvd.v1.DescribeTransferResponse. */
int kvd_client_describe_transfer(kvd_client* client, const char* pool, const uint64_t* block_ids, size_t count,
                                 kvd_buffer* reply, kvd_status** status);

/* A contiguous byte range of a pool, from its base address, inside one segment (kvd.v1.ByteRange). Never
 * changes. */
typedef struct kvd_byte_range {
  uint64_t segment;
  uint64_t offset;
  uint64_t bytes;
} kvd_byte_range;

/* ExportRanges for the attached client `client_id` of this client's session (kvd_mapping_client_id):
 * kvd.v1.ExportRangesResponse, and *fds (kvd_free) one FD per handle, in order, each the caller's to close.
 * count 0: every segment's whole committed prefix. */
int kvd_client_export_ranges(kvd_client* client, const char* client_id, const kvd_byte_range* ranges, size_t count,
                             kvd_buffer* reply, int** fds, size_t* fd_count, kvd_status** status);
/* ZeroBlocks / CopyBlocks (copies: src, dst pairs, 2 * count numbers): kvd.v1.ZeroBlocksResponse,
 * kvd.v1.CopyBlocksResponse. */
int kvd_client_zero_blocks(kvd_client* client, const char* pool, const uint64_t* block_ids, size_t count,
                           kvd_buffer* reply, kvd_status** status);
int kvd_client_copy_blocks(kvd_client* client, const char* pool, const uint64_t* copies, size_t count,
                           kvd_buffer* reply, kvd_status** status);

/* The two phases of a group operation on this daemon (kvd_group drives them on every rank). */
enum { KVD_OP_GROW = 1, KVD_OP_SHRINK = 2, KVD_OP_SLEEP = 3, KVD_OP_WAKE = 4 }; /* kvd.v1.Operation's values */
/* Prepare: kvd.v1.PrepareResponse. target_blocks for grow and shrink; the daemon holds the pool for `ttl_us`
 * (at least 1 ms); force as kvd_change_options'; keep: a sleep keeps the contents (copied at the prepare). */
int kvd_client_prepare(kvd_client* client, const char* pool, int op, uint64_t target_blocks, int64_t ttl_us, int force,
                       int keep, kvd_buffer* reply, kvd_status** status);
/* Commit: kvd.v1.PoolUpdate (this client's Mapping has mapped, as for a grow). Abort: kvd.v1.AbortResponse. */
int kvd_client_commit(kvd_client* client, const char* transaction, int wait, kvd_buffer* reply, kvd_status** status);
int kvd_client_abort(kvd_client* client, const char* transaction, kvd_buffer* reply, kvd_status** status);

/* The protocol underneath, for tools (engines use the functions above). One unary RPC of kvd.v1.Kvd by its
 * name ("GetPool"), request and reply serialized, on this client's session; nothing else happens (an Attach
 * so made maps nothing). timeout_us 0: the client's. INVALID_ARGUMENT for a name that is no unary RPC. */
int kvd_client_call(kvd_client* client, const char* method, const void* request, size_t request_size,
                    int64_t timeout_us, kvd_buffer* reply, kvd_status** status);
/* Redeems a lease (AttachResponse.lease, ...) on this client's session: *count chunk ids and FDs, in the
 * lease's order (both arrays kvd_free; the FDs the caller's). */
int kvd_client_fetch_lease(kvd_client* client, const char* lease_token, uint64_t** chunk_ids, int** fds, size_t* count,
                           kvd_status** status);
/* The session the next call uses (a new one after a daemon restart): its token (kvd_free), and the uid and
 * pid the daemon saw; any of them may be NULL. */
int kvd_client_session(kvd_client* client, char** token, uint32_t* uid, int32_t* pid, kvd_status** status);

/* ---- Mapping ---------------------------------------------------------------------------------------- */

typedef struct kvd_mapping kvd_mapping;

/* What a Mapping reports once it is attached again after its daemon restarted; valid during the callback. */
typedef struct kvd_restart {
  uint64_t epoch; /* the new daemon's */
  /* Chunks this Mapping had that the restarted daemon lacks: unmapped. 0 of them: nothing was lost. */
  const uint64_t* lost_chunk_ids;
  size_t lost_chunk_count;
  uint64_t lost_bytes;
  /* Chunks whose FDs it handed back to a RECOVERING pool (and the daemon adopted). */
  const uint64_t* returned_chunk_ids;
  size_t returned_chunk_count;
  uint64_t committed_blocks; /* the pool's, now */
} kvd_restart;

/* The callbacks (libkvd's AttachOptions; docs/integrating.md has when each runs). `ranges` is valid during
 * the call; `applied` and the other flags are 0 or 1. */
typedef void (*kvd_blocks_fn)(void* user, uint64_t committed_blocks);
typedef void (*kvd_lost_fn)(void* user, int code, const char* message);
typedef void (*kvd_restart_fn)(void* user, const kvd_restart* restart);
typedef void (*kvd_ranges_fn)(void* user, const kvd_byte_range* ranges, size_t count);
typedef void (*kvd_resume_fn)(void* user, int applied);
/* A RECLAIM event (docs/integrating.md, "Answering a reclaim"): give back `bytes` of the pool by the deadline.
 * Valid during the callback. */
typedef struct kvd_reclaim {
  const char* pool;
  uint64_t reclaim_id;
  uint64_t bytes;
  int64_t deadline_unix_ms;
  uint64_t committed_blocks; /* the pool's when asked */
} kvd_reclaim;
/* KVD_OK: answered (typically after kvd_client_shrink_for_reclaim). Any other code declines: the Mapping sends
 * DeclineReclaim with the NUL-terminated reason the callback may write into `reason` (`capacity` bytes, it
 * starts empty; left empty: "the on_reclaim callback returned <code>"), and the pool's policy applies at
 * once. */
typedef int (*kvd_reclaim_fn)(void* user, const kvd_reclaim* request, char* reason, size_t capacity);

typedef struct kvd_attach_options kvd_attach_options;
kvd_attach_options* kvd_attach_options_create(void);
void kvd_attach_options_destroy(kvd_attach_options* options);
/* Unset: the session's name. */
void kvd_attach_options_set_client_name(kvd_attach_options* options, const char* name);
/* The device this process maps from: an index or UUID (prefix) of the daemon's backend as this process
 * numbers them; unset: the daemon's own device. Another device is peer access (docs/integrating.md). */
void kvd_attach_options_set_device(kvd_attach_options* options, const char* selector);
/* Handed to every callback; it must stay valid until kvd_mapping_close returned. */
void kvd_attach_options_set_user(kvd_attach_options* options, void* user);
void kvd_attach_options_set_on_grow(kvd_attach_options* options, kvd_blocks_fn fn);
void kvd_attach_options_set_on_release(kvd_attach_options* options, kvd_blocks_fn fn);
void kvd_attach_options_set_on_lost(kvd_attach_options* options, kvd_lost_fn fn);
void kvd_attach_options_set_on_restart(kvd_attach_options* options, kvd_restart_fn fn);
/* Setting on_pause makes the Mapping pausable (docs/api.md, "Pauses and reshaping"). */
void kvd_attach_options_set_on_pause(kvd_attach_options* options, kvd_ranges_fn fn);
void kvd_attach_options_set_on_resume(kvd_attach_options* options, kvd_resume_fn fn);
/* KV connectors (docs/connectors.md). */
void kvd_attach_options_set_on_ranges_added(kvd_attach_options* options, kvd_ranges_fn fn);
void kvd_attach_options_set_on_ranges_released(kvd_attach_options* options, kvd_ranges_fn fn);
/* Reclaims: unlike the other callbacks, on_reclaim runs on a thread of its own (not the follower's), so it may
 * give back right there, shrinking the pool with wait; kvd_mapping_close waits for it. Unset: the event is
 * ignored and the pool's policy applies at the deadline. */
void kvd_attach_options_set_on_reclaim(kvd_attach_options* options, kvd_reclaim_fn fn);

/* Attaches the pool and maps its committed chunks; `options` may be NULL. One Mapping per pool per client:
 * ALREADY_EXISTS for a second. */
int kvd_client_attach(kvd_client* client, const char* pool, const kvd_attach_options* options, kvd_mapping** mapping,
                      kvd_status** status);
/* Stops the follower, unmaps every chunk, frees the VA and detaches. Not from the Mapping's own callbacks. */
void kvd_mapping_close(kvd_mapping* mapping);

/* Where every byte of the pool lives (kvd.v1.Geometry): byte (l, b, h, n, c) is at base + offset +
 * l*stride_l + b*stride_b + h*stride_h + n*stride_n + c*stride_c. Owned by the Mapping; fixed for its life. */
typedef struct kvd_geometry {
  const char* layout;
  kvd_dims dims;
  uint64_t stride_l;
  uint64_t stride_b;
  uint64_t stride_h;
  uint64_t stride_n;
  uint64_t stride_c;
  uint64_t offset;
  uint64_t layer_stride;
  uint64_t block_stride;
  uint64_t segments;
  uint64_t segment_stride;
  uint64_t reserved_bytes;
  uint64_t granularity_bytes;
} kvd_geometry;

/* The base address, reserved for the Mapping's life (only committed blocks are backed). */
void* kvd_mapping_base(const kvd_mapping* mapping);
/* Layer `layer` of block 0 (the strides are the geometry's); NULL past the last layer. */
void* kvd_mapping_layer(const kvd_mapping* mapping, uint64_t layer);
const kvd_geometry* kvd_mapping_geometry(const kvd_mapping* mapping);
/* How the layout was chosen: kvd.v1.LayoutResolution. */
int kvd_mapping_layout(const kvd_mapping* mapping, kvd_buffer* resolution);
/* Valid while the Mapping lives. */
const char* kvd_mapping_pool(const kvd_mapping* mapping);
/* The daemon's id of this attachment (a new one after each daemon restart); kvd_free. */
char* kvd_mapping_client_id(const kvd_mapping* mapping);
/* The epoch of the daemon it is attached to now. */
uint64_t kvd_mapping_epoch(const kvd_mapping* mapping);
/* The committed blocks as the daemon last reported them to this Mapping. */
uint64_t kvd_mapping_committed_blocks(const kvd_mapping* mapping);

/* AWAKE and SLEEPING are kvd.v1.PoolState's values. */
enum { KVD_MAPPING_AWAKE = 1, KVD_MAPPING_SLEEPING = 2, KVD_MAPPING_LOST = 4 };
int kvd_mapping_state(const kvd_mapping* mapping);
/* The pool's state as the Mapping last knew it (AWAKE or SLEEPING), also once it is lost. */
int kvd_mapping_pool_state(const kvd_mapping* mapping);

/* One mapped chunk. Never changes. */
typedef struct kvd_chunk {
  uint64_t id;
  uint64_t segment;
  uint64_t offset;
  uint64_t bytes;
} kvd_chunk;
/* The chunks mapped now, by offset: returns how many there are and fills the first min(that, capacity). */
size_t kvd_mapping_chunks(const kvd_mapping* mapping, kvd_chunk* chunks, size_t capacity);

/* The device of this process the chunks are mapped with: "host", "cuda" or "hip", its index as this
 * process numbers its devices, and its UUID. The strings are valid while the Mapping lives. */
const char* kvd_mapping_device_backend(const kvd_mapping* mapping);
int kvd_mapping_device_index(const kvd_mapping* mapping);
const char* kvd_mapping_device_uuid(const kvd_mapping* mapping);

/* What the follower did so far: the events it read, the PAUSEs whose chunks it imported, the RESUMEs it
 * acted on. */
uint64_t kvd_mapping_events(const kvd_mapping* mapping);
uint64_t kvd_mapping_pauses(const kvd_mapping* mapping);
uint64_t kvd_mapping_resumes(const kvd_mapping* mapping);

/* ---- Group: an engine's tensor-parallel ranks, one pool per daemon, resized all or none -------------- */

typedef struct kvd_group kvd_group;
/* Nonzero (a status code) aborts every rank; the operation then fails with that code. */
typedef int (*kvd_before_commit_fn)(void* user);

typedef struct kvd_group_options kvd_group_options;
kvd_group_options* kvd_group_options_create(void);
void kvd_group_options_destroy(kvd_group_options* options);
/* The sessions' name (unset: "kvd-group") and the deadline of each call. */
void kvd_group_options_set_client_name(kvd_group_options* options, const char* name);
void kvd_group_options_set_timeout_us(kvd_group_options* options, int64_t timeout_us);
/* How long each daemon holds a prepared pool before it aborts on its own (default 30 s). */
void kvd_group_options_set_ttl_us(kvd_group_options* options, int64_t ttl_us);
/* Runs after every rank prepared and before the first commit; `user` must outlive the group. */
void kvd_group_options_set_before_commit(kvd_group_options* options, kvd_before_commit_fn fn, void* user);

/* Finds the pools of group `name` on the daemons at `sockets` and checks they form the whole group (the
 * errors of docs/integrating.md, "Engine groups"); `options` may be NULL. */
int kvd_group_open(const char* name, const char* const* sockets, size_t count, const kvd_group_options* options,
                   kvd_group** group, kvd_status** status);
void kvd_group_close(kvd_group* group);
/* The ranks, 0 .. count-1: each one's socket and device UUID (valid while the group lives), and its pool as
 * last seen (open, refresh, the last operation): kvd.v1.Pool. */
size_t kvd_group_rank_count(const kvd_group* group);
const char* kvd_group_rank_socket(const kvd_group* group, size_t rank);
const char* kvd_group_rank_device_uuid(const kvd_group* group, size_t rank);
int kvd_group_rank_pool(const kvd_group* group, size_t rank, kvd_buffer* pool, kvd_status** status);
/* Re-reads every rank's pool. */
int kvd_group_refresh(kvd_group* group, kvd_status** status);

/* The result of one group operation; owned by the caller (kvd_group_change_free). */
typedef struct kvd_group_change {
  int op; /* KVD_OP_* */
  size_t rank_count;
  const kvd_buffer* updates; /* updates[r]: rank r's kvd.v1.PoolUpdate */
  uint64_t prepare_us;       /* first prepare sent to last prepare answered */
  uint64_t commit_us;
  uint64_t total_us;
  uint64_t prepared_bytes; /* memory made ready on all daemons (grow, wake) */
} kvd_group_change;
void kvd_group_change_free(kvd_group_change* change);

/* All ranks or none. wait, force and keep as kvd_change_options'. */
int kvd_group_grow(kvd_group* group, uint64_t target_blocks, kvd_group_change** change, kvd_status** status);
int kvd_group_shrink(kvd_group* group, uint64_t target_blocks, int wait, int force, kvd_group_change** change,
                     kvd_status** status);
int kvd_group_sleep(kvd_group* group, int wait, int force, int keep, kvd_group_change** change, kvd_status** status);
int kvd_group_wake(kvd_group* group, kvd_group_change** change, kvd_status** status);

#ifdef __cplusplus
} /* extern "C" */
#endif
