/* The C API (client/include/kvd/kvd.h) from a C program against two real kvd processes on the host backend
 * (devices 0 and 1 of one "node", sockets gpu0.sock and gpu1.sock in a fresh directory): errors with their
 * codes and messages, the node's sockets, pools, two Mappings of one pool sharing bytes and following
 * another session's grow, an exact shrink that pauses them, sleep and wake, the raw call and lease, pool
 * metadata, a forced delete, policies, usage reports and reclaims answered from a callback (given back with
 * kvd_client_shrink_for_reclaim, or declined with a reason), and a two-rank group (all or none, a coordinator
 * that gives up before the commit). Replies are decoded with the few lines of protobuf wire format below (what
 * any language's protobuf library does). Every wait is a bounded poll of a condition; no check is on wall-clock
 * time. Exit status 0 when every check passed.
 *
 * Run: c_api_test [KVD_BINARY]   (default: $KVD_BINARY, else the build's kvd) */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvd/kvd.h"

#ifndef KVD_BINARY
#define KVD_BINARY "kvd"
#endif

extern char** environ;

static int failures = 0;
static int checks = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    ++checks;                                                                  \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

/* Checks that a call returned `want` and, when it failed, that its message contains `needle`; frees it. */
static void expect_status(int line, const char* call, int got, kvd_status* st, int want, const char* needle) {
  ++checks;
  const char* message = st != NULL ? kvd_status_message(st) : "";
  if (got != want || (got != KVD_OK && (st == NULL || kvd_status_code(st) != got)) ||
      (needle != NULL && strstr(message, needle) == NULL)) {
    fprintf(stderr, "%s:%d: %s: expected %s%s%s, got %s: %s\n", __FILE__, line, call, kvd_code_name(want),
            needle ? " with " : "", needle ? needle : "", kvd_code_name(got), message);
    ++failures;
  }
  if (st != NULL) kvd_status_free(st);
}
/* EXPECT(code, needle or NULL, call using ST as its status argument). */
#define EXPECT(want, needle, ...)                                      \
  do {                                                                 \
    kvd_status* ST = NULL;                                             \
    int got_ = (__VA_ARGS__);                                          \
    expect_status(__LINE__, #__VA_ARGS__, got_, ST, (want), (needle)); \
  } while (0)
#define EXPECT_OK(...) EXPECT(KVD_OK, NULL, __VA_ARGS__)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}
/* Polls `cond` for up to 30 s. */
#define WAIT_FOR(cond)                                   \
  do {                                                   \
    const double until_ = now() + 30;                    \
    while (!(cond) && now() < until_) usleep(10 * 1000); \
    CHECK(cond);                                         \
  } while (0)

/* ---- The protobuf wire format, as much as the checks read -------------------------------------------- */

typedef struct {
  const uint8_t* p;
  size_t n;
} bytes;

static bytes of(kvd_buffer b) { return (bytes){(const uint8_t*)b.data, b.size}; }

static bool varint(const uint8_t** p, const uint8_t* end, uint64_t* v) {
  *v = 0;
  for (int shift = 0; *p < end && shift < 64; shift += 7) {
    const uint8_t b = *(*p)++;
    *v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

/* Calls `each` for every occurrence of field `field` of message `m`: its varint, or its bytes. */
typedef bool (*field_fn)(void* arg, uint64_t value, bytes data);
static void fields(bytes m, uint32_t field, field_fn each, void* arg) {
  const uint8_t *p = m.p, *end = m.p + m.n;
  while (p < end) {
    uint64_t key, v = 0;
    if (!varint(&p, end, &key)) return;
    bytes data = {NULL, 0};
    switch (key & 7) {
      case 0:
        if (!varint(&p, end, &v)) return;
        break;
      case 1:
        p += 8;
        break;
      case 2:
        if (!varint(&p, end, &v) || v > (uint64_t)(end - p)) return;
        data = (bytes){p, (size_t)v};
        p += v;
        break;
      case 5:
        p += 4;
        break;
      default:
        return;
    }
    if ((key >> 3) == field && !each(arg, v, data)) return;
  }
}

struct nth {
  int want, seen;
  uint64_t value;
  bytes data;
};
static bool take_nth(void* arg, uint64_t value, bytes data) {
  struct nth* n = arg;
  if (n->seen++ != n->want) return true;
  n->value = value;
  n->data = data;
  return false;
}
/* The varint field (0 when absent), the i-th length-delimited one ({NULL, 0}), how many there are. */
static uint64_t u64(bytes m, uint32_t field) {
  struct nth n = {0, 0, 0, {NULL, 0}};
  fields(m, field, take_nth, &n);
  return n.value;
}
static bytes sub(bytes m, uint32_t field, int i) {
  struct nth n = {i, 0, 0, {NULL, 0}};
  fields(m, field, take_nth, &n);
  return n.data;
}
static int count(bytes m, uint32_t field) {
  struct nth n = {-1, 0, 0, {NULL, 0}};
  fields(m, field, take_nth, &n);
  return n.seen;
}
static bool is(bytes s, const char* text) { return s.n == strlen(text) && memcmp(s.p, text, s.n) == 0; }

/* A message of string fields: `field` = `text`, appended to `out` (at most 512 bytes in all). */
static size_t put_string(uint8_t* out, size_t at, uint32_t field, const char* text) {
  const size_t n = strlen(text);
  out[at++] = (uint8_t)(field << 3 | 2);
  out[at++] = (uint8_t)n; /* the names here are short */
  memcpy(out + at, text, n);
  return at + n;
}

/* kvd.v1 field numbers (proto/kvd/v1/kvd.proto). */
enum {
  kDeviceInfoBackend = 1,
  kDeviceInfoUuid = 4,
  kPoolName = 1,
  kPoolState = 2,
  kPoolCommittedBlocks = 5,
  kPoolClients = 12,
  kPoolChunks = 13,
  kPoolTransaction = 18,
  kClientPausable = 8,
  kListPools = 1,
  kUpdatePool = 1,
  kUpdateReshape = 7,
  kReshapePausedClients = 7,
  kUpdatesUpdates = 1,
  kReleasedBytes = 1,
  kAttachClientId = 1,
  kAttachPool = 2,
  kAttachLease = 3,
  kLeaseToken = 1,
  kMetadataVersion = 2,
  kMetadataData = 3,
  kResolutionLayout = 1,
  kBackendHost = 1,
  kPoolStateSleeping = 2,
  kPoolPolicy = 25,
  kPoolUsage = 27,
  kPoolReclaim = 28,
  kPolicyPriority = 1,
  kPolicyMinBytes = 2,
  kPolicyMaxBytes = 3,
  kPolicyReclaimTimeoutMs = 4,
  kPolicyOnReclaimTimeout = 5,
  kUsageLiveBlocks = 1,
  kUsageUsedBlocks = 3,
  kReclaimLastOutcome = 6,
};

/* ---- The daemons ----------------------------------------------------------------------------------- */

static char dir[64];

typedef struct {
  pid_t pid;
  char socket[128];
  char log[128];
} daemon_t;

static char* read_file(const char* path) {
  FILE* f = fopen(path, "r");
  if (f == NULL) return NULL;
  static char text[1 << 16];
  const size_t n = fread(text, 1, sizeof text - 1, f);
  text[n] = '\0';
  fclose(f);
  return text;
}

static bool start_daemon(daemon_t* d, const char* binary, int device) {
  char device_flag[32], socket_flag[160];
  snprintf(d->socket, sizeof d->socket, "%s/gpu%d.sock", dir, device);
  snprintf(d->log, sizeof d->log, "%s/kvd%d.log", dir, device);
  snprintf(device_flag, sizeof device_flag, "--device=%d", device);
  snprintf(socket_flag, sizeof socket_flag, "--socket=%s", d->socket);
  char* argv[] = {(char*)binary,     "--backend=host",          device_flag, socket_flag, "--host-capacity=1GiB",
                  "--budget=512MiB", "--host-granularity=2MiB", NULL};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, d->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  const int rc = posix_spawn(&d->pid, binary, &actions, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    fprintf(stderr, "posix_spawn %s: %s\n", binary, strerror(rc));
    return false;
  }
  for (const double until = now() + 30; now() < until; usleep(20 * 1000)) {
    const char* log = read_file(d->log);
    if (log != NULL && strstr(log, " ready: ") != NULL) return true;
    if (waitpid(d->pid, NULL, WNOHANG) == d->pid) break;
  }
  fprintf(stderr, "kvd %d did not become ready: %s\n", device, read_file(d->log));
  return false;
}

static void stop_daemon(daemon_t* d) {
  if (d->pid <= 0) return;
  kill(d->pid, SIGTERM);
  waitpid(d->pid, NULL, 0);
  d->pid = 0;
}

/* ---- What a Mapping's callbacks saw ---------------------------------------------------------------- */

typedef struct {
  atomic_int grows, releases, lost, pauses, resumes, restarts;
  atomic_ullong blocks;
  atomic_int lost_code;
  pthread_mutex_t mu;
  char lost_message[512];
} recorder;

static void on_grow(void* user, uint64_t committed) {
  recorder* r = user;
  atomic_store(&r->blocks, committed);
  atomic_fetch_add(&r->grows, 1);
}
static void on_release(void* user, uint64_t committed) {
  recorder* r = user;
  atomic_store(&r->blocks, committed);
  atomic_fetch_add(&r->releases, 1);
}
static void on_lost(void* user, int code, const char* message) {
  recorder* r = user;
  pthread_mutex_lock(&r->mu);
  snprintf(r->lost_message, sizeof r->lost_message, "%s", message);
  pthread_mutex_unlock(&r->mu);
  atomic_store(&r->lost_code, code);
  atomic_fetch_add(&r->lost, 1);
}
static void on_restart(void* user, const kvd_restart* restart) {
  (void)restart;
  atomic_fetch_add(&((recorder*)user)->restarts, 1);
}
static void on_pause(void* user, const kvd_byte_range* ranges, size_t count) {
  (void)ranges;
  (void)count;
  atomic_fetch_add(&((recorder*)user)->pauses, 1);
}
static void on_resume(void* user, int applied) {
  (void)applied;
  atomic_fetch_add(&((recorder*)user)->resumes, 1);
}

static void on_pause_noop(void* user, const kvd_byte_range* ranges, size_t count) {
  (void)user;
  (void)ranges;
  (void)count;
}
static void on_resume_noop(void* user, int applied) {
  (void)user;
  (void)applied;
}

static kvd_mapping* attach(kvd_client* c, const char* pool, recorder* r, bool pausable) {
  kvd_attach_options* o = kvd_attach_options_create();
  kvd_attach_options_set_user(o, r);
  kvd_attach_options_set_on_grow(o, on_grow);
  kvd_attach_options_set_on_release(o, on_release);
  kvd_attach_options_set_on_lost(o, on_lost);
  kvd_attach_options_set_on_restart(o, on_restart);
  if (pausable) {
    kvd_attach_options_set_on_pause(o, on_pause);
    kvd_attach_options_set_on_resume(o, on_resume);
  }
  kvd_mapping* m = NULL;
  EXPECT_OK(kvd_client_attach(c, pool, o, &m, &ST));
  kvd_attach_options_destroy(o);
  return m;
}

static kvd_client* connect_to(const char* socket, const char* name) {
  kvd_connect_options* o = kvd_connect_options_create();
  kvd_connect_options_set_socket(o, socket);
  kvd_connect_options_set_client_name(o, name);
  kvd_connect_options_set_timeout_us(o, 10 * 1000 * 1000);
  kvd_client* c = NULL;
  EXPECT_OK(kvd_connect(o, &c, &ST));
  kvd_connect_options_destroy(o);
  return c;
}

/* 2 layers, 8 heads, 16 tokens, 128 channels, fp16: 32 KiB a block and segment, 64 blocks a 2 MiB chunk. */
static const kvd_dims kDims = {
    .layers = 2, .capacity_blocks = 512, .heads = 8, .block_tokens = 16, .channels = 128, .element_bytes = 2};

static kvd_pool_options* pool_options(const char* name, uint64_t initial_blocks) {
  kvd_pool_options* o = kvd_pool_options_create(name);
  kvd_pool_options_set_dims(o, &kDims);
  kvd_pool_options_set_initial_blocks(o, initial_blocks);
  return o;
}

static size_t chunk_count(const kvd_mapping* m) { return kvd_mapping_chunks(m, NULL, 0); }

static uint8_t* at(const kvd_mapping* m, uint64_t layer, uint64_t block) {
  return (uint8_t*)kvd_mapping_layer(m, layer) + block * kvd_mapping_geometry(m)->stride_b;
}

/* ---- The checks ------------------------------------------------------------------------------------ */

static void test_node_and_errors(const daemon_t* d0, const daemon_t* d1) {
  CHECK(kvd_api_version() == KVD_C_API_VERSION);
  CHECK(strcmp(kvd_code_name(KVD_NOT_FOUND), "NOT_FOUND") == 0);
  CHECK(strcmp(kvd_code_name(99), "UNKNOWN") == 0);
  char* path = kvd_handles_path("/run/kvd/gpu3.sock");
  CHECK(strcmp(path, "/run/kvd/gpu3.handles") == 0);
  kvd_free(path);
  unsetenv("KVD_SOCKET");
  path = kvd_default_socket(3);
  CHECK(strcmp(path, "/run/kvd/gpu3.sock") == 0);
  kvd_free(path);

  char** sockets = NULL;
  size_t n = 0;
  EXPECT_OK(kvd_node_sockets(dir, &sockets, &n, &ST));
  CHECK(n == 2 && strcmp(sockets[0], d0->socket) == 0 && strcmp(sockets[1], d1->socket) == 0);
  kvd_strings_free(sockets, n);
  EXPECT(KVD_NOT_FOUND, "socket directory", kvd_node_sockets("/nonexistent-kvd-dir", &sockets, &n, &ST));

  kvd_client* c1 = connect_to(d1->socket, "c-api-probe");
  kvd_buffer info = {NULL, 0};
  EXPECT_OK(kvd_client_device_info(c1, &info, &ST));
  CHECK(u64(of(info), kDeviceInfoBackend) == kBackendHost);
  bytes uuid = sub(of(info), kDeviceInfoUuid, 0);
  char uuid1[128] = {0};
  memcpy(uuid1, uuid.p, uuid.n < sizeof uuid1 - 1 ? uuid.n : sizeof uuid1 - 1);
  kvd_buffer_free(&info);
  CHECK(info.data == NULL && info.size == 0);
  kvd_client_close(c1);
  char* found = NULL;
  EXPECT_OK(kvd_find_socket(uuid1, dir, 0, &found, &ST));
  CHECK(found != NULL && strcmp(found, d1->socket) == 0);
  kvd_free(found);
  EXPECT(KVD_NOT_FOUND, "no kvd serves it", kvd_find_socket("GPU-0000", dir, 0, &found, &ST));

  char missing[128];
  snprintf(missing, sizeof missing, "%s/missing.sock", dir);
  kvd_connect_options* o = kvd_connect_options_create();
  kvd_connect_options_set_socket(o, missing);
  kvd_client* c = NULL;
  EXPECT(KVD_UNAVAILABLE, "no kvd daemon at", kvd_connect(o, &c, &ST));
  kvd_connect_options_destroy(o);
  CHECK(c == NULL);
}

static void test_pools(const daemon_t* d0) {
  kvd_client* c = connect_to(d0->socket, "c-api-pools");
  CHECK(strcmp(kvd_client_socket(c), d0->socket) == 0);
  kvd_pool_options* o = pool_options("c-pool", 64);
  const char* outer[] = {"block-outermost"};
  kvd_pool_options_add_backend_requirement(o, "FLASHINFER", outer, 1);
  kvd_pool_options_add_connector_preference(o, "nixl", "BLNHC");
  kvd_buffer pool = {NULL, 0};
  EXPECT_OK(kvd_client_create_pool(c, o, &pool, &ST));
  CHECK(is(sub(of(pool), kPoolName, 0), "c-pool"));
  CHECK(u64(of(pool), kPoolCommittedBlocks) == 64);
  kvd_buffer_free(&pool);
  kvd_buffer resolved = {NULL, 0};
  EXPECT_OK(kvd_client_resolve_layout(c, o, &resolved, &ST)); /* the dry run of the same options */
  CHECK(is(sub(sub(of(resolved), 1, 0), kResolutionLayout, 0), "BLNHC"));
  kvd_buffer_free(&resolved);
  EXPECT(KVD_ALREADY_EXISTS, "c-pool", kvd_client_create_pool(c, o, NULL, &ST));
  kvd_pool_options_destroy(o);

  kvd_dims bad = kDims;
  bad.heads = 0;
  o = kvd_pool_options_create("c-bad");
  kvd_pool_options_set_dims(o, &bad);
  EXPECT(KVD_INVALID_ARGUMENT, "dims.heads", kvd_client_create_pool(c, o, NULL, &ST));
  kvd_pool_options_destroy(o);
  EXPECT(KVD_NOT_FOUND, "pool nope does not exist", kvd_client_get_pool(c, "nope", NULL, &ST));
  EXPECT(KVD_INVALID_ARGUMENT, NULL, kvd_client_grow(c, "c-pool", kDims.capacity_blocks + 1, NULL, &ST));

  kvd_buffer list = {NULL, 0};
  EXPECT_OK(kvd_client_list_pools(c, &list, &ST));
  CHECK(count(of(list), kListPools) == 1 && is(sub(sub(of(list), kListPools, 0), kPoolName, 0), "c-pool"));
  kvd_buffer_free(&list);

  /* Metadata: a compare-and-set. */
  kvd_buffer md = {NULL, 0};
  EXPECT_OK(kvd_client_set_metadata(c, "c-pool", 0, "index", 5, &md, &ST));
  CHECK(u64(of(md), kMetadataVersion) == 1);
  kvd_buffer_free(&md);
  EXPECT(KVD_ABORTED, "version 1", kvd_client_set_metadata(c, "c-pool", 0, "other", 5, NULL, &ST));
  EXPECT_OK(kvd_client_get_metadata(c, "c-pool", &md, &ST));
  CHECK(is(sub(of(md), kMetadataData, 0), "index"));
  kvd_buffer_free(&md);

  kvd_buffer deleted = {NULL, 0};
  EXPECT_OK(kvd_client_delete_pool(c, "c-pool", NULL, &deleted, &ST));
  CHECK(u64(of(deleted), kReleasedBytes) == 64 * 2 * 32 * 1024); /* 64 blocks of 2 layers x 32 KiB */
  kvd_buffer_free(&deleted);
  kvd_client_close(c);
}

static void test_mappings(const daemon_t* d0) {
  kvd_client* engine = connect_to(d0->socket, "c-api-engine");
  kvd_client* other = connect_to(d0->socket, "c-api-operator");
  kvd_pool_options* o = pool_options("kv", 64);
  kvd_pool_options_set_override_layout(o, "LBNHC");
  EXPECT_OK(kvd_client_create_pool(engine, o, NULL, &ST));
  kvd_pool_options_destroy(o);

  recorder r1 = {0}, r2 = {0};
  pthread_mutex_init(&r1.mu, NULL);
  pthread_mutex_init(&r2.mu, NULL);
  kvd_mapping* m1 = attach(engine, "kv", &r1, true);
  kvd_mapping* m2 = attach(other, "kv", &r2, true);
  if (m1 == NULL || m2 == NULL) return;
  EXPECT(KVD_ALREADY_EXISTS, "already attached by this client", kvd_client_attach(engine, "kv", NULL, &m1, &ST));

  const kvd_geometry* g = kvd_mapping_geometry(m1);
  CHECK(strcmp(g->layout, "LBNHC") == 0 && g->segments == 2 && g->dims.heads == kDims.heads);
  CHECK(g->stride_b == 8 * 16 * 128 * 2 && g->reserved_bytes == 2 * 512 * g->stride_b);
  CHECK(strcmp(kvd_mapping_pool(m1), "kv") == 0);
  CHECK(kvd_mapping_committed_blocks(m1) == 64 && chunk_count(m1) == 2);
  CHECK(kvd_mapping_state(m1) == KVD_MAPPING_AWAKE && kvd_mapping_epoch(m1) == 1);
  CHECK(strcmp(kvd_mapping_device_backend(m1), "host") == 0 && kvd_mapping_device_index(m1) == 0);
  CHECK(strncmp(kvd_mapping_device_uuid(m1), "host-", 5) == 0);
  CHECK(kvd_mapping_layer(m1, 2) == NULL);
  kvd_buffer layout = {NULL, 0};
  EXPECT_OK(kvd_mapping_layout(m1, &layout));
  CHECK(is(sub(of(layout), kResolutionLayout, 0), "LBNHC") && u64(of(layout), 2) == 1 /* REQUEST_OVERRIDE */);
  kvd_buffer_free(&layout);
  char* id1 = kvd_mapping_client_id(m1);
  char* id2 = kvd_mapping_client_id(m2);
  CHECK(id1[0] != '\0' && strcmp(id1, id2) != 0);
  kvd_free(id2);

  /* One memory, two mappings: what one writes, the other reads. */
  *at(m1, 1, 10) = 0x5a;
  CHECK(*at(m2, 1, 10) == 0x5a);
  CHECK(*at(m2, 1, 10) != *at(m2, 0, 10));

  /* Grown by the engine's own client: mapped before the call returns, without an event; the other Mapping
   * follows on its follower. */
  kvd_buffer update = {NULL, 0};
  EXPECT_OK(kvd_client_grow(engine, "kv", 192, &update, &ST));
  CHECK(u64(sub(of(update), kUpdatePool, 0), kPoolCommittedBlocks) == 192);
  kvd_buffer_free(&update);
  CHECK(kvd_mapping_committed_blocks(m1) == 192 && chunk_count(m1) == 4 && kvd_mapping_events(m1) == 0);
  WAIT_FOR(atomic_load(&r2.grows) == 1 && kvd_mapping_committed_blocks(m2) == 192 && chunk_count(m2) == 4);
  CHECK(atomic_load(&r2.blocks) == 192 && kvd_mapping_events(m2) >= 1);
  *at(m2, 1, 150) = 0x77;
  CHECK(*at(m1, 1, 150) == 0x77);

  /* An exact shrink inside the grown chunks: both (pausable) Mappings pause while the kept bytes are
   * copied into new chunks at the same addresses. */
  kvd_change_options* change = kvd_change_options_create();
  kvd_change_options_set_pause_timeout_us(change, 10 * 1000 * 1000);
  EXPECT_OK(kvd_client_shrink(other, "kv", 100, change, &update, &ST));
  bytes reshape = sub(of(update), kUpdateReshape, 0);
  CHECK(u64(reshape, kReshapePausedClients) == 2);
  const uint64_t shrunk = u64(sub(of(update), kUpdatePool, 0), kPoolCommittedBlocks);
  CHECK(shrunk >= 100 && shrunk < 192);
  kvd_buffer_free(&update);
  CHECK(kvd_mapping_committed_blocks(m2) == shrunk);
  WAIT_FOR(kvd_mapping_committed_blocks(m1) == shrunk && kvd_mapping_resumes(m1) == kvd_mapping_pauses(m1));
  CHECK(atomic_load(&r1.pauses) >= 1 && atomic_load(&r1.pauses) == atomic_load(&r1.resumes));
  CHECK(kvd_mapping_pauses(m2) >= 1 && kvd_mapping_pauses(m2) == (uint64_t)atomic_load(&r2.pauses));
  CHECK(*at(m1, 1, 10) == 0x5a && *at(m2, 1, 10) == 0x5a);

  /* Sleep from the other session (both Mappings pause first), then wake from the engine's. */
  kvd_change_options_set_wait(change, 1);
  kvd_buffer updates = {NULL, 0};
  EXPECT_OK(kvd_client_sleep(other, "kv", change, &updates, &ST));
  CHECK(count(of(updates), kUpdatesUpdates) == 1);
  CHECK(u64(sub(sub(of(updates), kUpdatesUpdates, 0), kUpdatePool, 0), kPoolState) == kPoolStateSleeping);
  kvd_buffer_free(&updates);
  CHECK(chunk_count(m2) == 0 && kvd_mapping_state(m2) == KVD_MAPPING_SLEEPING);
  WAIT_FOR(chunk_count(m1) == 0 && kvd_mapping_state(m1) == KVD_MAPPING_SLEEPING);
  EXPECT_OK(kvd_client_wake(engine, "kv", NULL, &ST));
  CHECK(kvd_mapping_state(m1) == KVD_MAPPING_AWAKE && chunk_count(m1) == 2 && *at(m1, 1, 10) == 0);
  WAIT_FOR(kvd_mapping_state(m2) == KVD_MAPPING_AWAKE && chunk_count(m2) == 2);
  kvd_change_options_destroy(change);

  /* The raw protocol: any RPC by name, and a lease redeemed on the client's session. */
  uint8_t request[512];
  size_t n = put_string(request, 0, 1, "kv");
  kvd_buffer reply = {NULL, 0};
  EXPECT_OK(kvd_client_call(other, "GetPool", request, n, 0, &reply, &ST));
  CHECK(is(sub(of(reply), kPoolName, 0), "kv") && count(of(reply), kPoolClients) == 2);
  for (int i = 0; i < 2; ++i) CHECK(u64(sub(of(reply), kPoolClients, i), kClientPausable) == 1);
  kvd_buffer_free(&reply);
  EXPECT(KVD_INVALID_ARGUMENT, "not a unary RPC", kvd_client_call(other, "Watch", request, n, 0, NULL, &ST));
  EXPECT(KVD_INVALID_ARGUMENT, "not a unary RPC", kvd_client_call(other, "Nope", request, n, 0, NULL, &ST));
  kvd_client* raw = connect_to(d0->socket, "c-api-raw");
  EXPECT_OK(kvd_client_call(raw, "Attach", request, n, 0, &reply, &ST));
  bytes token = sub(sub(of(reply), kAttachLease, 0), kLeaseToken, 0);
  char lease[256] = {0}, client_id[128] = {0};
  memcpy(lease, token.p, token.n < sizeof lease - 1 ? token.n : sizeof lease - 1);
  bytes cid = sub(of(reply), kAttachClientId, 0);
  memcpy(client_id, cid.p, cid.n < sizeof client_id - 1 ? cid.n : sizeof client_id - 1);
  const int listed = count(sub(of(reply), kAttachPool, 0), kPoolChunks);
  kvd_buffer_free(&reply);
  uint64_t* ids = NULL;
  int* fds = NULL;
  size_t fetched = 0;
  EXPECT_OK(kvd_client_fetch_lease(raw, lease, &ids, &fds, &fetched, &ST));
  CHECK(fetched == 2 && (int)fetched == listed);
  for (size_t i = 0; i < fetched; ++i) CHECK(fds[i] >= 0 && close(fds[i]) == 0);
  kvd_free(ids);
  kvd_free(fds);
  EXPECT(KVD_NOT_FOUND, NULL, kvd_client_fetch_lease(raw, lease, &ids, &fds, &fetched, &ST)); /* single use */
  char* session = NULL;
  uint32_t uid = 0;
  int32_t pid = 0;
  EXPECT_OK(kvd_client_session(raw, &session, &uid, &pid, &ST));
  CHECK(session != NULL && session[0] != '\0' && uid == getuid() && pid == getpid());
  kvd_free(session);
  n = put_string(request, put_string(request, 0, 1, "kv"), 2, client_id);
  EXPECT_OK(kvd_client_call(raw, "Detach", request, n, 0, NULL, &ST));
  kvd_client_close(raw);

  /* A range export for the engine's Mapping: one FD a chunk on host, the caller's to close. */
  size_t fd_count = 0;
  EXPECT_OK(kvd_client_export_ranges(engine, id1, NULL, 0, &reply, &fds, &fd_count, &ST));
  CHECK(fd_count == 2 && count(of(reply), 2) == 2);
  for (size_t i = 0; i < fd_count; ++i) CHECK(close(fds[i]) == 0);
  kvd_free(fds);
  kvd_buffer_free(&reply);
  kvd_free(id1);

  /* Deleted by force from the other session: the pausable engine pauses, then its Mapping is lost. */
  change = kvd_change_options_create();
  kvd_change_options_set_force(change, 1);
  EXPECT_OK(kvd_client_delete_pool(other, "kv", change, NULL, &ST));
  kvd_change_options_destroy(change);
  WAIT_FOR(atomic_load(&r1.lost) == 1 && kvd_mapping_state(m1) == KVD_MAPPING_LOST);
  CHECK(atomic_load(&r1.lost_code) == KVD_NOT_FOUND);
  pthread_mutex_lock(&r1.mu);
  CHECK(strcmp(r1.lost_message, "pool kv was deleted") == 0);
  pthread_mutex_unlock(&r1.mu);
  CHECK(kvd_mapping_pool_state(m1) == KVD_MAPPING_AWAKE && chunk_count(m1) == 0 &&
        kvd_mapping_committed_blocks(m1) == 0);
  CHECK(atomic_load(&r1.restarts) == 0);
  kvd_mapping_close(m1);
  kvd_mapping_close(m2);
  kvd_client_close(other);
  kvd_client_close(engine);
  pthread_mutex_destroy(&r1.mu);
  pthread_mutex_destroy(&r2.mu);
}

struct coordinator {
  atomic_int calls;
  int answer;
};
static int before_commit(void* user) {
  struct coordinator* c = user;
  atomic_fetch_add(&c->calls, 1);
  return c->answer;
}

/* An engine answering reclaims from its on_reclaim callback (on libkvd's reclaim thread): with
 * kvd_client_shrink_for_reclaim, or by declining with a reason. */
typedef struct {
  kvd_client* client;
  atomic_int calls, answered;
  atomic_int decline;
  atomic_ullong asked;
  atomic_int shrink_code;
} reclaimer;

static int on_reclaim(void* user, const kvd_reclaim* request, char* reason, size_t capacity) {
  reclaimer* e = user;
  atomic_fetch_add(&e->calls, 1);
  atomic_store(&e->asked, request->bytes);
  int code = KVD_OK;
  if (atomic_load(&e->decline)) {
    snprintf(reason, capacity, "busy serving");
    code = KVD_UNAVAILABLE;
  } else {
    const uint64_t live[] = {0, 1, 2, 3, 4, 5};
    kvd_status* st = NULL;
    code = kvd_client_shrink_for_reclaim(e->client, request->pool, request->bytes, live, 6, NULL, NULL, &st);
    atomic_store(&e->shrink_code, code);
    if (st != NULL) kvd_status_free(st);
  }
  atomic_fetch_add(&e->answered, 1);
  return code;
}

/* 2 layers of 32 KiB blocks, 8192 of them: 512 MiB, the daemon's whole budget. */
static kvd_pool_options* big_pool(const char* name, kvd_policy_options* policy) {
  kvd_pool_options* o = kvd_pool_options_create(name);
  kvd_dims dims = kDims;
  dims.capacity_blocks = 8192;
  kvd_pool_options_set_dims(o, &dims);
  kvd_pool_options_set_policy(o, policy);
  return o;
}

static void test_arbitration(const daemon_t* d) {
  kvd_client* operator_ = connect_to(d->socket, "c-api-operator");
  reclaimer lo = {.client = connect_to(d->socket, "c-api-lo")};

  /* A policy at CreatePool, its fields in the reply; an action that is none of KVD_RECLAIM_* refused. */
  kvd_policy_options* p = kvd_policy_options_create();
  kvd_policy_options_set_on_reclaim_timeout(p, 9);
  kvd_pool_options* o = big_pool("arb-lo", p);
  EXPECT(KVD_INVALID_ARGUMENT, "policy.on_reclaim_timeout: 9", kvd_client_create_pool(lo.client, o, NULL, &ST));
  kvd_pool_options_destroy(o);
  kvd_policy_options_set_priority(p, 1);
  kvd_policy_options_set_min_bytes(p, 4 * 1024 * 1024);
  kvd_policy_options_set_max_bytes(p, 448 * 1024 * 1024);
  kvd_policy_options_set_reclaim_timeout_us(p, 1500 * 1000);
  kvd_policy_options_set_on_reclaim_timeout(p, KVD_RECLAIM_NONE);
  o = big_pool("arb-lo", p);
  kvd_buffer pool = {NULL, 0};
  EXPECT_OK(kvd_client_create_pool(lo.client, o, &pool, &ST));
  kvd_pool_options_destroy(o);
  kvd_policy_options_destroy(p);
  bytes policy = sub(of(pool), kPoolPolicy, 0);
  CHECK(u64(policy, kPolicyPriority) == 1 && u64(policy, kPolicyMinBytes) == 4 * 1024 * 1024);
  CHECK(u64(policy, kPolicyMaxBytes) == 448 * 1024 * 1024 && u64(policy, kPolicyReclaimTimeoutMs) == 1500);
  CHECK(u64(policy, kPolicyOnReclaimTimeout) == KVD_RECLAIM_NONE);
  kvd_buffer_free(&pool);

  /* SetPoolPolicy changes only the fields set; none set is refused. */
  p = kvd_policy_options_create();
  EXPECT(KVD_INVALID_ARGUMENT, "set at least one", kvd_client_set_pool_policy(lo.client, "arb-lo", p, NULL, &ST));
  kvd_policy_options_set_priority(p, 0);
  EXPECT_OK(kvd_client_set_pool_policy(lo.client, "arb-lo", p, &pool, &ST));
  kvd_policy_options_destroy(p);
  policy = sub(of(pool), kPoolPolicy, 0);
  CHECK(u64(policy, kPolicyPriority) == 0 && u64(policy, kPolicyMinBytes) == 4 * 1024 * 1024);
  kvd_buffer_free(&pool);

  EXPECT(KVD_NOT_FOUND, "reclaim", kvd_client_decline_reclaim(lo.client, "arb-lo", 77, "no such reclaim", NULL, &ST));

  /* lo holds 384 of the 512 MiB (chunks ending every 2048 blocks) and answers reclaims. */
  kvd_attach_options* a = kvd_attach_options_create();
  kvd_attach_options_set_user(a, &lo);
  kvd_attach_options_set_on_reclaim(a, on_reclaim);
  kvd_attach_options_set_on_pause(a, on_pause_noop);
  kvd_attach_options_set_on_resume(a, on_resume_noop);
  kvd_mapping* m = NULL;
  EXPECT_OK(kvd_client_attach(lo.client, "arb-lo", a, &m, &ST));
  kvd_attach_options_destroy(a);
  if (m == NULL) return;
  for (uint64_t blocks = 2048; blocks <= 6144; blocks += 2048) {
    EXPECT_OK(kvd_client_grow(lo.client, "arb-lo", blocks, NULL, &ST));
  }
  *at(m, 1, 5) = 0x3c;

  /* ReportUsage shows in the pool (and a report past the committed blocks is refused). */
  EXPECT(KVD_INVALID_ARGUMENT, "used_blocks: 9000",
         kvd_client_report_usage(lo.client, "arb-lo", 6, 10, 9000, NULL, &ST));
  EXPECT_OK(kvd_client_report_usage(lo.client, "arb-lo", 6, 10, 16, NULL, &ST));
  EXPECT_OK(kvd_client_get_pool(operator_, "arb-lo", &pool, &ST));
  const bytes usage = sub(of(pool), kPoolUsage, 0);
  CHECK(u64(usage, kUsageLiveBlocks) == 6 && u64(usage, kUsageUsedBlocks) == 16);
  kvd_buffer_free(&pool);

  /* hi (priority 10) asks for 256 MiB: refused at once without waiting, served by lo's reclaim with it. */
  p = kvd_policy_options_create();
  kvd_policy_options_set_priority(p, 10);
  o = big_pool("arb-hi", p);
  EXPECT_OK(kvd_client_create_pool(operator_, o, NULL, &ST));
  kvd_pool_options_destroy(o);
  kvd_policy_options_destroy(p);
  EXPECT(KVD_RESOURCE_EXHAUSTED, "budget", kvd_client_grow(operator_, "arb-hi", 4096, NULL, &ST));
  kvd_buffer update = {NULL, 0};
  EXPECT_OK(kvd_client_grow_waiting(operator_, "arb-hi", 4096, 20 * 1000 * 1000, &update, &ST));
  CHECK(u64(sub(of(update), kUpdatePool, 0), kPoolCommittedBlocks) == 4096);
  kvd_buffer_free(&update);
  WAIT_FOR(atomic_load(&lo.answered) == 1);
  CHECK(atomic_load(&lo.calls) == 1 && atomic_load(&lo.shrink_code) == KVD_OK);
  CHECK(atomic_load(&lo.asked) == 128 * 1024 * 1024);
  WAIT_FOR(kvd_mapping_committed_blocks(m) == 4096);
  CHECK(*at(m, 1, 5) == 0x3c);
  EXPECT_OK(kvd_client_get_pool(operator_, "arb-lo", &pool, &ST));
  const bytes outcome = sub(sub(of(pool), kPoolReclaim, 0), kReclaimLastOutcome, 0);
  CHECK(outcome.n > 0 && memmem(outcome.p, outcome.n, "gave", 4) != NULL);
  kvd_buffer_free(&pool);

  /* A callback that declines: its reason ends the wait, named in the error. */
  atomic_store(&lo.decline, 1);
  EXPECT(KVD_RESOURCE_EXHAUSTED, "declined (busy serving)",
         kvd_client_grow_waiting(operator_, "arb-hi", 6144, 3 * 1000 * 1000, NULL, &ST));
  WAIT_FOR(atomic_load(&lo.answered) == 2);
  CHECK(kvd_mapping_committed_blocks(m) == 4096);

  kvd_mapping_close(m);
  kvd_change_options* force = kvd_change_options_create();
  kvd_change_options_set_force(force, 1);
  EXPECT_OK(kvd_client_delete_pool(operator_, "arb-lo", force, NULL, &ST));
  EXPECT_OK(kvd_client_delete_pool(operator_, "arb-hi", force, NULL, &ST));
  kvd_change_options_destroy(force);
  kvd_client_close(lo.client);
  kvd_client_close(operator_);
}

static void test_group(const daemon_t* d0, const daemon_t* d1) {
  kvd_client* ranks[2] = {connect_to(d0->socket, "c-api-rank0"), connect_to(d1->socket, "c-api-rank1")};
  for (int r = 0; r < 2; ++r) {
    char name[32];
    snprintf(name, sizeof name, "g-r%d", r);
    kvd_pool_options* o = pool_options(name, 64);
    kvd_pool_options_set_group(o, "g", (uint32_t)r, 2);
    EXPECT_OK(kvd_client_create_pool(ranks[r], o, NULL, &ST));
    kvd_pool_options_destroy(o);
  }
  struct coordinator coordinator = {0, KVD_OK};
  kvd_group_options* o = kvd_group_options_create();
  kvd_group_options_set_client_name(o, "c-api-group");
  kvd_group_options_set_before_commit(o, before_commit, &coordinator);
  const char* one[] = {d0->socket};
  kvd_group* g = NULL;
  EXPECT(KVD_FAILED_PRECONDITION, "rank 1 of 2 not found", kvd_group_open("g", one, 1, o, &g, &ST));
  const char* both[] = {d1->socket, d0->socket};
  EXPECT_OK(kvd_group_open("g", both, 2, o, &g, &ST));
  kvd_group_options_destroy(o);
  if (g == NULL) return;
  CHECK(kvd_group_rank_count(g) == 2);
  CHECK(strcmp(kvd_group_rank_socket(g, 0), d0->socket) == 0 && strcmp(kvd_group_rank_socket(g, 1), d1->socket) == 0);
  CHECK(strncmp(kvd_group_rank_device_uuid(g, 1), "host-", 5) == 0);
  CHECK(kvd_group_rank_socket(g, 2) == NULL);
  kvd_buffer pool = {NULL, 0};
  EXPECT_OK(kvd_group_rank_pool(g, 1, &pool, &ST));
  CHECK(is(sub(of(pool), kPoolName, 0), "g-r1") && u64(of(pool), kPoolCommittedBlocks) == 64);
  kvd_buffer_free(&pool);
  EXPECT(KVD_OUT_OF_RANGE, "rank", kvd_group_rank_pool(g, 2, &pool, &ST));

  kvd_group_change* change = NULL;
  EXPECT_OK(kvd_group_grow(g, 128, &change, &ST));
  if (change != NULL) {
    CHECK(change->op == KVD_OP_GROW && change->rank_count == 2 && atomic_load(&coordinator.calls) == 1);
    CHECK(change->prepared_bytes == 2 * 2 * 2 * 1024 * 1024); /* 2 ranks x 2 segments x 2 MiB */
    for (size_t r = 0; r < change->rank_count; ++r) {
      bytes p = sub(of(change->updates[r]), kUpdatePool, 0);
      char name[32];
      snprintf(name, sizeof name, "g-r%zu", r);
      CHECK(is(sub(p, kPoolName, 0), name) && u64(p, kPoolCommittedBlocks) == 128);
    }
    kvd_group_change_free(change);
  }
  EXPECT_OK(kvd_group_rank_pool(g, 0, &pool, &ST));
  CHECK(u64(of(pool), kPoolCommittedBlocks) == 128);
  kvd_buffer_free(&pool);

  /* The coordinator gives up between the phases: every rank is aborted, nothing changed. */
  coordinator.answer = KVD_CANCELLED;
  change = NULL;
  EXPECT(KVD_CANCELLED, "no rank changed (prepared ranks rolled back: 0, 1)", kvd_group_grow(g, 256, &change, &ST));
  CHECK(change == NULL);
  for (int r = 0; r < 2; ++r) {
    char name[32];
    snprintf(name, sizeof name, "g-r%d", r);
    EXPECT_OK(kvd_client_get_pool(ranks[r], name, &pool, &ST));
    CHECK(u64(of(pool), kPoolCommittedBlocks) == 128 && sub(of(pool), kPoolTransaction, 0).n == 0);
    kvd_buffer_free(&pool);
  }
  coordinator.answer = KVD_OK;
  EXPECT_OK(kvd_group_sleep(g, 1, 0, 0, &change, &ST));
  kvd_group_change_free(change);
  EXPECT_OK(kvd_group_refresh(g, &ST));
  EXPECT_OK(kvd_group_rank_pool(g, 1, &pool, &ST));
  CHECK(u64(of(pool), kPoolState) == kPoolStateSleeping);
  kvd_buffer_free(&pool);
  kvd_group_close(g);
  for (int r = 0; r < 2; ++r) kvd_client_close(ranks[r]);
}

int main(int argc, char** argv) {
  const char* binary = argc > 1 ? argv[1] : getenv("KVD_BINARY") != NULL ? getenv("KVD_BINARY") : KVD_BINARY;
  snprintf(dir, sizeof dir, "/tmp/kvd-c-api-test-XXXXXX");
  if (mkdtemp(dir) == NULL || chmod(dir, 0750) != 0) return 2;
  daemon_t d0 = {0}, d1 = {0};
  if (start_daemon(&d0, binary, 0) && start_daemon(&d1, binary, 1)) {
    test_node_and_errors(&d0, &d1);
    test_pools(&d0);
    test_mappings(&d0);
    test_arbitration(&d1);
    test_group(&d0, &d1);
  } else {
    ++failures;
  }
  stop_daemon(&d1);
  stop_daemon(&d0);
  char command[128];
  snprintf(command, sizeof command, "rm -rf %s", dir);
  if (system(command) != 0) fprintf(stderr, "could not remove %s\n", dir);
  printf("c_api_test: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
