// The C API (kvd/kvd.h) over libkvd: each function converts its arguments, makes one libkvd call and hands
// back the daemon's reply. See Note [The C API answers with the daemon's messages] in docs/architecture.md.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "kvd/client.h"
#include "kvd/group.h"
#include "kvd/kvd.h"
#include "kvd/v1/kvd.pb.h"
#include "kvd/wire.h"

// The C API's handles and option objects: plain holders of libkvd's objects.
struct kvd_status {
  int code;
  std::string message;
};
struct kvd_connect_options {
  kvd::ConnectOptions options;
};
struct kvd_client {
  std::unique_ptr<kvd::Client> client;
};
struct kvd_pool_options {
  kvd::PoolOptions options;
  bool has_dims = false;
  std::optional<absl::Status> bad_policy;  // kvd_pool_options_set_policy's refusal, kvd_client_create_pool's
};
struct kvd_policy_options {
  kvd::PolicyChange change;
  int action = 0;  // as set: one that is no kvd::ReclaimAction fails the call that reads it
};
struct kvd_change_options {
  kvd::ShrinkOptions shrink;  // wait, whole_chunks_only, live_blocks, pause, force: every change reads its own
  uint32_t max_chunks_per_pause = 0;
  bool keep = false;
};
struct kvd_attach_options {
  std::string client_name;
  std::string device;
  void* user = nullptr;
  kvd_blocks_fn on_grow = nullptr;
  kvd_blocks_fn on_release = nullptr;
  kvd_lost_fn on_lost = nullptr;
  kvd_restart_fn on_restart = nullptr;
  kvd_ranges_fn on_pause = nullptr;
  kvd_resume_fn on_resume = nullptr;
  kvd_ranges_fn on_ranges_added = nullptr;
  kvd_ranges_fn on_ranges_released = nullptr;
  kvd_reclaim_fn on_reclaim = nullptr;
};
struct kvd_mapping {
  std::unique_ptr<kvd::Mapping> mapping;
  std::string layout;  // geometry.layout points here
  kvd_geometry geometry;
};
struct kvd_group_options {
  kvd::GroupOptions options;
  kvd_before_commit_fn before_commit = nullptr;
  void* user = nullptr;
};

namespace kvd {
namespace {

int Fail(const absl::Status& s, kvd_status** status) {
  if (status != nullptr) *status = new kvd_status{static_cast<int>(s.code()), std::string(s.message())};
  return static_cast<int>(s.code());
}

int Done(const absl::Status& s, kvd_status** status) { return s.ok() ? KVD_OK : Fail(s, status); }

// malloc'd, for the caller's kvd_free.
char* Copy(absl::string_view s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return out;
}

template <typename T>
T* CopyArray(const std::vector<T>& v) {
  T* out = static_cast<T*>(std::malloc(std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) std::memcpy(out, v.data(), v.size() * sizeof(T));
  return out;
}

void Put(const std::string& bytes, kvd_buffer* out) {
  out->data = std::malloc(std::max<size_t>(bytes.size(), 1));  // never NULL: an empty message is 0 bytes
  if (!bytes.empty()) std::memcpy(out->data, bytes.data(), bytes.size());
  out->size = bytes.size();
}

std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

absl::StatusCode CodeOf(int code) {
  return code > KVD_OK && code <= KVD_UNAUTHENTICATED ? static_cast<absl::StatusCode>(code)
                                                      : absl::StatusCode::kUnknown;
}

// The reply of the libkvd call in progress on this thread. ConnectOptions::on_reply of every Client this
// API connects is Capture::Observe, and libkvd calls it on the calling thread before the method returns,
// so the reply of the right type is the call's own (a call's inner RPCs report nothing). `every`: keep
// every reply of the type, concatenated (ListPools' pages: concatenated encodings of a message merge, so
// the pages' pools become one list).
class Capture {
 public:
  Capture(const google::protobuf::Descriptor* type, kvd_buffer* out, bool every = false)
      : type_(type), out_(out), every_(every), outer_(current_) {
    current_ = this;
  }
  ~Capture() { current_ = outer_; }
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;

  static void Observe(const google::protobuf::Message& reply) {
    Capture* c = current_;
    if (c == nullptr || c->out_ == nullptr || reply.GetDescriptor() != c->type_ || (c->seen_ && !c->every_)) return;
    reply.AppendToString(&c->bytes_);
    c->seen_ = true;
  }

  // The call's status; on success the reply goes to the caller's buffer.
  int Deliver(const absl::Status& s, kvd_status** status) {
    if (!s.ok()) return Fail(s, status);
    if (out_ != nullptr) Put(bytes_, out_);
    return KVD_OK;
  }

 private:
  static thread_local Capture* current_;
  const google::protobuf::Descriptor* const type_;
  kvd_buffer* const out_;
  const bool every_;
  Capture* const outer_;
  bool seen_ = false;
  std::string bytes_;
};

thread_local Capture* Capture::current_ = nullptr;

std::vector<ByteRange> Ranges(const kvd_byte_range* ranges, size_t count) {
  std::vector<ByteRange> out;
  for (size_t i = 0; i < count; ++i) out.push_back({ranges[i].segment, ranges[i].offset, ranges[i].bytes});
  return out;
}

// A callback of kvd_ranges_fn's shape, for AttachOptions.
std::function<void(const std::vector<ByteRange>&)> RangesCallback(kvd_ranges_fn fn, void* user) {
  if (fn == nullptr) return nullptr;
  return [fn, user](const std::vector<ByteRange>& ranges) {
    std::vector<kvd_byte_range> out;
    for (const ByteRange& r : ranges) out.push_back({r.segment, r.offset, r.bytes});
    fn(user, out.data(), out.size());
  };
}

PauseOptions& Pause(kvd_change_options* o) { return o->shrink.pause; }

const kvd_change_options& OrDefault(const kvd_change_options* o) {
  static const kvd_change_options kDefault;
  return o == nullptr ? kDefault : *o;
}

// The change a kvd_policy_options sets; INVALID_ARGUMENT naming "<field>.on_reclaim_timeout" for an action
// that is none of KVD_RECLAIM_*.
absl::StatusOr<PolicyChange> PolicyOf(const kvd_policy_options* o, absl::string_view field) {
  if (o == nullptr) return PolicyChange{};
  PolicyChange change = o->change;
  if (o->action != 0) {
    static const std::map<int, ReclaimAction> kActions = {{KVD_RECLAIM_NONE, ReclaimAction::kNone},
                                                          {KVD_RECLAIM_SHRINK, ReclaimAction::kShrink},
                                                          {KVD_RECLAIM_SLEEP, ReclaimAction::kSleep}};
    auto it = kActions.find(o->action);
    if (it == kActions.end()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".on_reclaim_timeout: ", o->action,
                                                     " is not one of KVD_RECLAIM_NONE (1), KVD_RECLAIM_SHRINK (2), "
                                                     "KVD_RECLAIM_SLEEP (3)"));
    }
    change.on_reclaim_timeout = it->second;
  }
  return change;
}

absl::Duration Micros(int64_t us) { return absl::Microseconds(us); }

// The replies of a Group's Clients (GroupOptions::connect.on_reply: on the ranks' threads), kept while one
// operation of the group runs, so that the C API answers with the ranks' own messages.
class RankReplies {
 public:
  void Observe(const google::protobuf::Message& reply) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!armed_) return;
    std::unique_ptr<google::protobuf::Message> copy(reply.New());
    copy->CopyFrom(reply);
    replies_.push_back(std::move(copy));
  }
  void Begin() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    armed_ = true;
    replies_.clear();
  }
  std::vector<std::unique_ptr<google::protobuf::Message>> End() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    armed_ = false;
    return std::move(replies_);
  }

 private:
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<google::protobuf::Message>> replies_ ABSL_GUARDED_BY(mu_);
};

}  // namespace
}  // namespace kvd

struct kvd_group {
  std::unique_ptr<kvd::Group> group;
  std::shared_ptr<kvd::RankReplies> replies;
  std::string name;
  std::vector<std::string> sockets;  // by rank
  std::vector<std::string> uuids;
  absl::Mutex op_mu;  // one operation (and its replies) at a time
  mutable absl::Mutex mu ABSL_ACQUIRED_AFTER(op_mu);
  std::vector<std::string> pools ABSL_GUARDED_BY(mu);  // kvd.v1.Pool by rank, as last seen
};

namespace kvd {
namespace {

int StateCode(kvd::Mapping::State s) {
  switch (s) {
    case kvd::Mapping::State::kAwake:
      return KVD_MAPPING_AWAKE;
    case kvd::Mapping::State::kSleeping:
      return KVD_MAPPING_SLEEPING;
    case kvd::Mapping::State::kLost:
      return KVD_MAPPING_LOST;
  }
  return KVD_MAPPING_LOST;
}

// The ranks' replies of one group operation that carry a pool of the group (Open's listings, Refresh's
// GetPool, Run's commits), by rank: the pools, and the commits' updates.
struct RankMessages {
  std::map<uint32_t, std::string> pools;
  std::map<uint32_t, std::string> updates;
};

RankMessages ByRank(const std::string& group, std::vector<std::unique_ptr<google::protobuf::Message>> replies) {
  RankMessages out;
  auto pool = [&](const v1::Pool& p) {
    if (p.group().name() == group) out.pools[p.group().rank()] = p.SerializeAsString();
  };
  for (const auto& m : replies) {
    if (const auto* list = dynamic_cast<const v1::ListPoolsResponse*>(m.get())) {
      for (const v1::Pool& p : list->pools()) pool(p);
    } else if (const auto* p = dynamic_cast<const v1::Pool*>(m.get())) {
      pool(*p);
    } else if (const auto* u = dynamic_cast<const v1::PoolUpdate*>(m.get());
               u != nullptr && u->pool().group().name() == group) {
      pool(u->pool());
      out.updates[u->pool().group().rank()] = u->SerializeAsString();
    }
  }
  return out;
}

// Takes the pools of `got` as the ranks' last seen; INTERNAL when a rank's is missing.
absl::Status Remember(kvd_group* g, const RankMessages& got) ABSL_LOCKS_EXCLUDED(g->mu) {
  absl::MutexLock lock(&g->mu);
  for (size_t r = 0; r < g->pools.size(); ++r) {
    if (!got.pools.contains(r)) {
      return absl::InternalError(absl::StrCat("group ", g->name, ": the reply of rank ", r, " was not seen"));
    }
  }
  for (size_t r = 0; r < g->pools.size(); ++r) g->pools[r] = got.pools.at(r);
  return absl::OkStatus();
}

using GroupCall = std::function<absl::StatusOr<kvd::GroupChange>(kvd::Group&)>;

int RunGroup(kvd_group* g, const GroupCall& call, kvd_group_change** change, kvd_status** status)
    ABSL_LOCKS_EXCLUDED(g->op_mu) {
  absl::MutexLock op(&g->op_mu);
  g->replies->Begin();
  absl::StatusOr<kvd::GroupChange> done = call(*g->group);
  RankMessages got = ByRank(g->name, g->replies->End());
  if (!done.ok()) return Fail(done.status(), status);
  if (absl::Status s = Remember(g, got); !s.ok()) return Fail(s, status);
  const size_t n = done->ranks.size();
  auto* updates = static_cast<kvd_buffer*>(std::malloc(std::max<size_t>(n, 1) * sizeof(kvd_buffer)));
  for (size_t r = 0; r < n; ++r) {
    auto it = got.updates.find(r);
    kvd::Put(it == got.updates.end() ? std::string() : it->second, &updates[r]);
  }
  auto* out = static_cast<kvd_group_change*>(std::malloc(sizeof(kvd_group_change)));
  static const std::map<kvd::GroupOp, int> kOps = {{kvd::GroupOp::kGrow, KVD_OP_GROW},
                                                   {kvd::GroupOp::kShrink, KVD_OP_SHRINK},
                                                   {kvd::GroupOp::kSleep, KVD_OP_SLEEP},
                                                   {kvd::GroupOp::kWake, KVD_OP_WAKE}};
  *out = {.op = kOps.at(done->op),
          .rank_count = n,
          .updates = updates,
          .prepare_us = done->prepare_us,
          .commit_us = done->commit_us,
          .total_us = done->total_us,
          .prepared_bytes = done->prepared_bytes};
  *change = out;
  return KVD_OK;
}

}  // namespace
}  // namespace kvd

using kvd::Capture;
using kvd::Copy;
using kvd::Done;
using kvd::Fail;
using kvd::Str;
namespace v1 = kvd::v1;

extern "C" {

int kvd_api_version(void) { return KVD_C_API_VERSION; }

const char* kvd_code_name(int code) {
  static const char* const kNames[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  return code >= KVD_OK && code <= KVD_UNAUTHENTICATED ? kNames[code] : "UNKNOWN";
}

int kvd_status_code(const kvd_status* status) { return status->code; }
const char* kvd_status_message(const kvd_status* status) { return status->message.c_str(); }
void kvd_status_free(kvd_status* status) { delete status; }

void kvd_buffer_free(kvd_buffer* buffer) {
  if (buffer == nullptr) return;
  std::free(buffer->data);
  buffer->data = nullptr;
  buffer->size = 0;
}
void kvd_free(void* p) { std::free(p); }
void kvd_strings_free(char** strings, size_t count) {
  if (strings == nullptr) return;
  for (size_t i = 0; i < count; ++i) std::free(strings[i]);
  std::free(strings);
}

// ---- The node's daemons

char* kvd_default_socket(int device) { return Copy(kvd::wire::SocketFromEnvironment(device)); }
char* kvd_handles_path(const char* socket) { return Copy(kvd::HandlesPathFor(Str(socket))); }

int kvd_node_sockets(const char* directory, char*** sockets, size_t* count, kvd_status** status) {
  absl::StatusOr<std::vector<std::string>> found = kvd::NodeSockets(Str(directory));
  if (!found.ok()) return Fail(found.status(), status);
  char** out = static_cast<char**>(std::malloc(std::max<size_t>(found->size(), 1) * sizeof(char*)));
  for (size_t i = 0; i < found->size(); ++i) out[i] = Copy((*found)[i]);
  *sockets = out;
  *count = found->size();
  return KVD_OK;
}

int kvd_find_socket(const char* device_uuid, const char* directory, int64_t timeout_us, char** socket,
                    kvd_status** status) {
  absl::StatusOr<std::string> found = kvd::FindSocket(
      Str(device_uuid), Str(directory), timeout_us > 0 ? absl::Microseconds(timeout_us) : absl::Seconds(30));
  if (!found.ok()) return Fail(found.status(), status);
  *socket = Copy(*found);
  return KVD_OK;
}

// ---- Client

kvd_connect_options* kvd_connect_options_create(void) { return new kvd_connect_options; }
void kvd_connect_options_destroy(kvd_connect_options* options) { delete options; }
void kvd_connect_options_set_socket(kvd_connect_options* o, const char* socket) { o->options.socket = Str(socket); }
void kvd_connect_options_set_device(kvd_connect_options* o, int device) { o->options.device = device; }
void kvd_connect_options_set_client_name(kvd_connect_options* o, const char* name) {
  o->options.client_name = Str(name);
}
void kvd_connect_options_set_timeout_us(kvd_connect_options* o, int64_t timeout_us) {
  o->options.timeout = absl::Microseconds(timeout_us);
}
void kvd_connect_options_set_reconnect_for_us(kvd_connect_options* o, int64_t reconnect_for_us) {
  o->options.reconnect_for = absl::Microseconds(reconnect_for_us);
}

int kvd_connect(const kvd_connect_options* options, kvd_client** client, kvd_status** status) {
  kvd::ConnectOptions o = options == nullptr ? kvd::ConnectOptions{} : options->options;
  o.on_reply = &Capture::Observe;
  absl::StatusOr<std::unique_ptr<kvd::Client>> c = kvd::Client::Connect(std::move(o));
  if (!c.ok()) return Fail(c.status(), status);
  *client = new kvd_client{*std::move(c)};
  return KVD_OK;
}

void kvd_client_close(kvd_client* client) { delete client; }
const char* kvd_client_socket(const kvd_client* client) { return client->client->socket().c_str(); }

int kvd_client_device_info(kvd_client* c, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::DeviceInfo::descriptor(), reply);
  return r.Deliver(c->client->DeviceInfo().status(), status);
}

int kvd_client_list_pools(kvd_client* c, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::ListPoolsResponse::descriptor(), reply, /*every=*/true);
  return r.Deliver(c->client->ListPools().status(), status);
}

int kvd_client_get_pool(kvd_client* c, const char* name, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::Pool::descriptor(), reply);
  return r.Deliver(c->client->GetPool(Str(name)).status(), status);
}

kvd_pool_options* kvd_pool_options_create(const char* name) {
  auto* o = new kvd_pool_options;
  o->options.name = Str(name);
  return o;
}
void kvd_pool_options_destroy(kvd_pool_options* options) { delete options; }
void kvd_pool_options_set_dims(kvd_pool_options* o, const kvd_dims* d) {
  o->options.dims = {.layers = d->layers,
                     .capacity_blocks = d->capacity_blocks,
                     .heads = d->heads,
                     .block_tokens = d->block_tokens,
                     .channels = d->channels,
                     .element_bytes = d->element_bytes};
  o->has_dims = true;
}
void kvd_pool_options_set_initial_blocks(kvd_pool_options* o, uint64_t blocks) { o->options.initial_blocks = blocks; }
void kvd_pool_options_set_override_layout(kvd_pool_options* o, const char* layout) {
  o->options.layout.override_layout = Str(layout);
}
void kvd_pool_options_add_backend_requirement(kvd_pool_options* o, const char* backend, const char* const* layouts,
                                              size_t count) {
  kvd::LayoutRequest::Requirement r{.backend = Str(backend)};
  for (size_t i = 0; i < count; ++i) r.layouts.push_back(Str(layouts[i]));
  o->options.layout.backend_requirements.push_back(std::move(r));
}
void kvd_pool_options_set_env_layout(kvd_pool_options* o, const char* layout) {
  o->options.layout.env_layout_set = true;
  o->options.layout.env_layout = Str(layout);
}
void kvd_pool_options_add_connector_preference(kvd_pool_options* o, const char* connector, const char* layout) {
  o->options.layout.connector_preferences.push_back({.connector = Str(connector), .layout = Str(layout)});
}
void kvd_pool_options_add_allowed_uid(kvd_pool_options* o, uint32_t uid) { o->options.allowed_uids.push_back(uid); }
void kvd_pool_options_set_group(kvd_pool_options* o, const char* name, uint32_t rank, uint32_t size) {
  o->options.group = {.name = Str(name), .rank = rank, .size = size};
}
void kvd_pool_options_add_peer_device(kvd_pool_options* o, const char* device_uuid) {
  o->options.peer_devices.push_back(Str(device_uuid));
}

int kvd_client_create_pool(kvd_client* c, const kvd_pool_options* options, kvd_buffer* reply, kvd_status** status) {
  if (options->bad_policy.has_value()) return Fail(*options->bad_policy, status);
  Capture r(v1::Pool::descriptor(), reply);
  return r.Deliver(c->client->CreatePool(options->options).status(), status);
}

kvd_policy_options* kvd_policy_options_create(void) { return new kvd_policy_options; }
void kvd_policy_options_destroy(kvd_policy_options* options) { delete options; }
void kvd_policy_options_set_priority(kvd_policy_options* o, uint32_t priority) { o->change.priority = priority; }
void kvd_policy_options_set_min_bytes(kvd_policy_options* o, uint64_t bytes) { o->change.min_bytes = bytes; }
void kvd_policy_options_set_max_bytes(kvd_policy_options* o, uint64_t bytes) { o->change.max_bytes = bytes; }
void kvd_policy_options_set_reclaim_timeout_us(kvd_policy_options* o, int64_t timeout_us) {
  o->change.reclaim_timeout = kvd::Micros(timeout_us);
}
void kvd_policy_options_set_on_reclaim_timeout(kvd_policy_options* o, int action) { o->action = action; }

void kvd_pool_options_set_policy(kvd_pool_options* o, const kvd_policy_options* policy) {
  absl::StatusOr<kvd::PolicyChange> change = kvd::PolicyOf(policy, "policy");
  if (!change.ok()) {
    o->bad_policy = change.status();
    return;
  }
  o->bad_policy.reset();
  kvd::PoolPolicy& p = o->options.policy;
  p = kvd::PoolPolicy{};
  if (change->priority) p.priority = *change->priority;
  if (change->min_bytes) p.min_bytes = *change->min_bytes;
  if (change->max_bytes) p.max_bytes = *change->max_bytes;
  if (change->reclaim_timeout) p.reclaim_timeout = *change->reclaim_timeout;
  if (change->on_reclaim_timeout) p.on_reclaim_timeout = *change->on_reclaim_timeout;
}

int kvd_client_resolve_layout(kvd_client* c, const kvd_pool_options* options, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::ResolveLayoutResponse::descriptor(), reply);
  return r.Deliver(
      c->client->ResolveLayout(options->options.layout, options->has_dims ? &options->options.dims : nullptr).status(),
      status);
}

kvd_change_options* kvd_change_options_create(void) { return new kvd_change_options; }
void kvd_change_options_destroy(kvd_change_options* options) { delete options; }
void kvd_change_options_set_wait(kvd_change_options* o, int wait) { o->shrink.wait = wait != 0; }
void kvd_change_options_set_force(kvd_change_options* o, int force) { o->shrink.force = force != 0; }
void kvd_change_options_set_keep(kvd_change_options* o, int keep) { o->keep = keep != 0; }
void kvd_change_options_set_whole_chunks_only(kvd_change_options* o, int whole) {
  o->shrink.whole_chunks_only = whole != 0;
}
void kvd_change_options_set_live_blocks(kvd_change_options* o, const uint64_t* blocks, size_t count) {
  o->shrink.live_blocks.emplace(blocks, blocks + count);
}
void kvd_change_options_set_pause_timeout_us(kvd_change_options* o, int64_t timeout_us) {
  kvd::Pause(o).timeout = absl::Microseconds(timeout_us);
}
void kvd_change_options_set_detach_unresponsive(kvd_change_options* o, int detach) {
  kvd::Pause(o).detach_unresponsive = detach != 0;
}
void kvd_change_options_set_max_chunks_per_pause(kvd_change_options* o, uint32_t chunks) {
  o->max_chunks_per_pause = chunks;
}

int kvd_client_grow(kvd_client* c, const char* pool, uint64_t target_blocks, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::PoolUpdate::descriptor(), reply);
  return r.Deliver(c->client->Grow(Str(pool), target_blocks).status(), status);
}

int kvd_client_grow_waiting(kvd_client* c, const char* pool, uint64_t target_blocks, int64_t wait_for_us,
                            kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::PoolUpdate::descriptor(), reply);
  return r.Deliver(
      c->client->Grow(Str(pool), target_blocks, kvd::WaitOptions{.wait = true, .wait_for = kvd::Micros(wait_for_us)})
          .status(),
      status);
}

int kvd_client_shrink(kvd_client* c, const char* pool, uint64_t target_blocks, const kvd_change_options* options,
                      kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::PoolUpdate::descriptor(), reply);
  return r.Deliver(c->client->Shrink(Str(pool), target_blocks, kvd::OrDefault(options).shrink).status(), status);
}

int kvd_client_compact(kvd_client* c, const char* pool, const kvd_change_options* options, kvd_buffer* reply,
                       kvd_status** status) {
  const kvd_change_options& o = kvd::OrDefault(options);
  Capture r(v1::PoolUpdate::descriptor(), reply);
  return r.Deliver(
      c->client->Compact(Str(pool), {.pause = o.shrink.pause, .max_chunks_per_pause = o.max_chunks_per_pause}).status(),
      status);
}

int kvd_client_sleep(kvd_client* c, const char* pool, const kvd_change_options* options, kvd_buffer* reply,
                     kvd_status** status) {
  const kvd_change_options& o = kvd::OrDefault(options);
  Capture r(v1::PoolUpdates::descriptor(), reply);
  return r.Deliver(c->client
                       ->Sleep(Str(pool), {.wait = o.shrink.wait,
                                           .force = o.shrink.force,
                                           .pause = o.shrink.pause,
                                           .keep = o.keep,
                                           .live_blocks = o.shrink.live_blocks.value_or(std::vector<uint64_t>{})})
                       .status(),
                   status);
}

int kvd_client_wake(kvd_client* c, const char* pool, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::PoolUpdates::descriptor(), reply);
  return r.Deliver(c->client->Wake(Str(pool)).status(), status);
}

int kvd_client_wake_waiting(kvd_client* c, const char* pool, int64_t wait_for_us, kvd_buffer* reply,
                            kvd_status** status) {
  Capture r(v1::PoolUpdates::descriptor(), reply);
  return r.Deliver(
      c->client->Wake(Str(pool), kvd::WaitOptions{.wait = true, .wait_for = kvd::Micros(wait_for_us)}).status(),
      status);
}

int kvd_client_delete_pool(kvd_client* c, const char* name, const kvd_change_options* options, kvd_buffer* reply,
                           kvd_status** status) {
  const kvd::ShrinkOptions& o = kvd::OrDefault(options).shrink;
  Capture r(v1::DeletePoolResponse::descriptor(), reply);
  return r.Deliver(c->client->DeletePool(Str(name), o.force, o.pause).status(), status);
}

int kvd_client_grant_peer_access(kvd_client* c, const char* pool, const char* device_uuid, int revoke,
                                 kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::Pool::descriptor(), reply);
  return r.Deliver(c->client->GrantPeerAccess(Str(pool), Str(device_uuid), revoke != 0).status(), status);
}

int kvd_client_get_metadata(kvd_client* c, const char* pool, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::PoolMetadata::descriptor(), reply);
  return r.Deliver(c->client->GetPoolMetadata(Str(pool)).status(), status);
}

int kvd_client_set_metadata(kvd_client* c, const char* pool, uint64_t expected_version, const void* data, size_t size,
                            kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::PoolMetadata::descriptor(), reply);
  std::string bytes = size == 0 ? std::string() : std::string(static_cast<const char*>(data), size);
  return r.Deliver(c->client->SetPoolMetadata(Str(pool), expected_version, std::move(bytes)).status(), status);
}

int kvd_client_set_pool_policy(kvd_client* c, const char* pool, const kvd_policy_options* policy, kvd_buffer* reply,
                               kvd_status** status) {
  absl::StatusOr<kvd::PolicyChange> change = kvd::PolicyOf(policy, "policy");
  if (!change.ok()) return Fail(change.status(), status);
  Capture r(v1::Pool::descriptor(), reply);
  return r.Deliver(c->client->SetPoolPolicy(Str(pool), *change).status(), status);
}

int kvd_client_report_usage(kvd_client* c, const char* pool, uint64_t live_blocks, uint64_t evictable_blocks,
                            uint64_t used_blocks, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::ReportUsageResponse::descriptor(), reply);
  return r.Deliver(c->client->ReportUsage(Str(pool), live_blocks, evictable_blocks, used_blocks), status);
}

int kvd_client_decline_reclaim(kvd_client* c, const char* pool, uint64_t reclaim_id, const char* reason,
                               kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::DeclineReclaimResponse::descriptor(), reply);
  return r.Deliver(c->client->DeclineReclaim({.pool = Str(pool), .reclaim_id = reclaim_id}, Str(reason)), status);
}

int kvd_client_shrink_for_reclaim(kvd_client* c, const char* pool, uint64_t bytes, const uint64_t* live_blocks,
                                  size_t count, const kvd_change_options* options, kvd_buffer* reply,
                                  kvd_status** status) {
  Capture r(v1::PoolUpdate::descriptor(), reply);
  const std::vector<uint64_t> live(live_blocks, live_blocks + count);
  return r.Deliver(
      c->client->ShrinkForReclaim({.pool = Str(pool), .bytes = bytes}, live, kvd::OrDefault(options).shrink.pause)
          .status(),
      status);
}

int kvd_client_describe_transfer(kvd_client* c, const char* pool, const uint64_t* block_ids, size_t count,
                                 kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::DescribeTransferResponse::descriptor(), reply);
  const std::vector<uint64_t> ids(block_ids, block_ids + count);
  return r.Deliver(c->client->DescribeTransfer(Str(pool), ids).status(), status);
}

int kvd_client_export_ranges(kvd_client* c, const char* client_id, const kvd_byte_range* ranges, size_t count,
                             kvd_buffer* reply, int** fds, size_t* fd_count, kvd_status** status) {
  Capture r(v1::ExportRangesResponse::descriptor(), reply);
  absl::StatusOr<kvd::RangeExport> exported = c->client->ExportRanges(Str(client_id), kvd::Ranges(ranges, count));
  if (!exported.ok()) return Fail(exported.status(), status);
  std::vector<int> out;
  for (const kvd::RangeHandle& h : exported->handles) out.push_back(h.fd);
  *fds = kvd::CopyArray(out);
  *fd_count = out.size();
  return r.Deliver(absl::OkStatus(), status);
}

int kvd_client_zero_blocks(kvd_client* c, const char* pool, const uint64_t* block_ids, size_t count, kvd_buffer* reply,
                           kvd_status** status) {
  Capture r(v1::ZeroBlocksResponse::descriptor(), reply);
  return r.Deliver(c->client->ZeroBlocks(Str(pool), std::vector<uint64_t>(block_ids, block_ids + count)), status);
}

int kvd_client_copy_blocks(kvd_client* c, const char* pool, const uint64_t* copies, size_t count, kvd_buffer* reply,
                           kvd_status** status) {
  std::vector<kvd::BlockMove> moves;
  for (size_t i = 0; i < count; ++i) moves.push_back({.src = copies[2 * i], .dst = copies[2 * i + 1]});
  Capture r(v1::CopyBlocksResponse::descriptor(), reply);
  return r.Deliver(c->client->CopyBlocks(Str(pool), moves), status);
}

int kvd_client_prepare(kvd_client* c, const char* pool, int op, uint64_t target_blocks, int64_t ttl_us, int force,
                       int keep, kvd_buffer* reply, kvd_status** status) {
  static const std::map<int, kvd::GroupOp> kOps = {{KVD_OP_GROW, kvd::GroupOp::kGrow},
                                                   {KVD_OP_SHRINK, kvd::GroupOp::kShrink},
                                                   {KVD_OP_SLEEP, kvd::GroupOp::kSleep},
                                                   {KVD_OP_WAKE, kvd::GroupOp::kWake}};
  auto it = kOps.find(op);
  if (it == kOps.end()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("operation: ", op,
                                                        " is not one of KVD_OP_GROW (1), "
                                                        "KVD_OP_SHRINK (2), KVD_OP_SLEEP (3), KVD_OP_WAKE (4)")),
                status);
  }
  Capture r(v1::PrepareResponse::descriptor(), reply);
  return r.Deliver(
      c->client->Prepare(Str(pool), it->second, target_blocks, absl::Microseconds(ttl_us), force != 0, keep != 0)
          .status(),
      status);
}

int kvd_client_commit(kvd_client* c, const char* transaction, int wait, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::PoolUpdate::descriptor(), reply);
  return r.Deliver(c->client->Commit(Str(transaction), wait != 0).status(), status);
}

int kvd_client_abort(kvd_client* c, const char* transaction, kvd_buffer* reply, kvd_status** status) {
  Capture r(v1::AbortResponse::descriptor(), reply);
  return r.Deliver(c->client->Abort(Str(transaction)).status(), status);
}

int kvd_client_call(kvd_client* c, const char* method, const void* request, size_t request_size, int64_t timeout_us,
                    kvd_buffer* reply, kvd_status** status) {
  absl::StatusOr<std::string> got = c->client->CallMethod(
      Str(method), absl::string_view(request_size == 0 ? "" : static_cast<const char*>(request), request_size),
      absl::Microseconds(timeout_us));
  if (!got.ok()) return Fail(got.status(), status);
  if (reply != nullptr) kvd::Put(*got, reply);
  return KVD_OK;
}

int kvd_client_fetch_lease(kvd_client* c, const char* lease_token, uint64_t** chunk_ids, int** fds, size_t* count,
                           kvd_status** status) {
  absl::StatusOr<std::vector<std::pair<uint64_t, int>>> got = c->client->FetchLease(Str(lease_token));
  if (!got.ok()) return Fail(got.status(), status);
  std::vector<uint64_t> ids;
  std::vector<int> out;
  for (const auto& [id, fd] : *got) {
    ids.push_back(id);
    out.push_back(fd);
  }
  *chunk_ids = kvd::CopyArray(ids);
  *fds = kvd::CopyArray(out);
  *count = out.size();
  return KVD_OK;
}

int kvd_client_session(kvd_client* c, char** token, uint32_t* uid, int32_t* pid, kvd_status** status) {
  absl::StatusOr<kvd::Client::Session> s = c->client->CurrentSession();
  if (!s.ok()) return Fail(s.status(), status);
  if (token != nullptr) *token = Copy(s->token);
  if (uid != nullptr) *uid = s->uid;
  if (pid != nullptr) *pid = s->pid;
  return KVD_OK;
}

// ---- Mapping

kvd_attach_options* kvd_attach_options_create(void) { return new kvd_attach_options; }
void kvd_attach_options_destroy(kvd_attach_options* options) { delete options; }
void kvd_attach_options_set_client_name(kvd_attach_options* o, const char* name) { o->client_name = Str(name); }
void kvd_attach_options_set_device(kvd_attach_options* o, const char* selector) { o->device = Str(selector); }
void kvd_attach_options_set_user(kvd_attach_options* o, void* user) { o->user = user; }
void kvd_attach_options_set_on_grow(kvd_attach_options* o, kvd_blocks_fn fn) { o->on_grow = fn; }
void kvd_attach_options_set_on_release(kvd_attach_options* o, kvd_blocks_fn fn) { o->on_release = fn; }
void kvd_attach_options_set_on_lost(kvd_attach_options* o, kvd_lost_fn fn) { o->on_lost = fn; }
void kvd_attach_options_set_on_restart(kvd_attach_options* o, kvd_restart_fn fn) { o->on_restart = fn; }
void kvd_attach_options_set_on_pause(kvd_attach_options* o, kvd_ranges_fn fn) { o->on_pause = fn; }
void kvd_attach_options_set_on_resume(kvd_attach_options* o, kvd_resume_fn fn) { o->on_resume = fn; }
void kvd_attach_options_set_on_ranges_added(kvd_attach_options* o, kvd_ranges_fn fn) { o->on_ranges_added = fn; }
void kvd_attach_options_set_on_ranges_released(kvd_attach_options* o, kvd_ranges_fn fn) { o->on_ranges_released = fn; }
void kvd_attach_options_set_on_reclaim(kvd_attach_options* o, kvd_reclaim_fn fn) { o->on_reclaim = fn; }

int kvd_client_attach(kvd_client* c, const char* pool, const kvd_attach_options* options, kvd_mapping** mapping,
                      kvd_status** status) {
  static const kvd_attach_options kNone;
  const kvd_attach_options& o = options == nullptr ? kNone : *options;
  void* const user = o.user;
  kvd::AttachOptions a{.client_name = o.client_name, .device = o.device};
  if (kvd_blocks_fn fn = o.on_grow) a.on_grow = [fn, user](uint64_t blocks) { fn(user, blocks); };
  if (kvd_blocks_fn fn = o.on_release) a.on_release = [fn, user](uint64_t blocks) { fn(user, blocks); };
  if (kvd_lost_fn fn = o.on_lost) {
    a.on_lost = [fn, user](const absl::Status& why) {
      fn(user, static_cast<int>(why.code()), std::string(why.message()).c_str());
    };
  }
  if (kvd_restart_fn fn = o.on_restart) {
    a.on_restart = [fn, user](const kvd::DaemonRestart& r) {
      const kvd_restart out{.epoch = r.epoch,
                            .lost_chunk_ids = r.lost_chunk_ids.data(),
                            .lost_chunk_count = r.lost_chunk_ids.size(),
                            .lost_bytes = r.lost_bytes,
                            .returned_chunk_ids = r.returned_chunk_ids.data(),
                            .returned_chunk_count = r.returned_chunk_ids.size(),
                            .committed_blocks = r.committed_blocks};
      fn(user, &out);
    };
  }
  a.on_pause = kvd::RangesCallback(o.on_pause, user);
  if (kvd_resume_fn fn = o.on_resume) a.on_resume = [fn, user](bool applied) { fn(user, applied ? 1 : 0); };
  a.on_ranges_added = kvd::RangesCallback(o.on_ranges_added, user);
  a.on_ranges_released = kvd::RangesCallback(o.on_ranges_released, user);
  if (kvd_reclaim_fn fn = o.on_reclaim) {
    a.on_reclaim = [fn, user](const kvd::ReclaimRequest& r) -> absl::Status {
      const kvd_reclaim request{.pool = r.pool.c_str(),
                                .reclaim_id = r.reclaim_id,
                                .bytes = r.bytes,
                                .deadline_unix_ms = absl::ToUnixMillis(r.deadline),
                                .committed_blocks = r.committed_blocks};
      char reason[1024] = "";
      const int code = fn(user, &request, reason, sizeof reason);
      if (code == KVD_OK) return absl::OkStatus();
      reason[sizeof reason - 1] = '\0';
      return absl::Status(kvd::CodeOf(code),
                          reason[0] != '\0' ? std::string(reason)
                                            : absl::StrCat("the on_reclaim callback returned ", kvd_code_name(code)));
    };
  }
  absl::StatusOr<std::unique_ptr<kvd::Mapping>> m = c->client->Attach(Str(pool), std::move(a));
  if (!m.ok()) return Fail(m.status(), status);
  auto* out = new kvd_mapping{.mapping = *std::move(m)};
  const kvd::Geometry& g = out->mapping->geometry();
  out->layout = g.layout;
  out->geometry = {.layout = out->layout.c_str(),
                   .dims = {.layers = g.dims.layers,
                            .capacity_blocks = g.dims.capacity_blocks,
                            .heads = g.dims.heads,
                            .block_tokens = g.dims.block_tokens,
                            .channels = g.dims.channels,
                            .element_bytes = g.dims.element_bytes},
                   .stride_l = g.stride_l,
                   .stride_b = g.stride_b,
                   .stride_h = g.stride_h,
                   .stride_n = g.stride_n,
                   .stride_c = g.stride_c,
                   .offset = g.offset,
                   .layer_stride = g.layer_stride,
                   .block_stride = g.block_stride,
                   .segments = g.segments,
                   .segment_stride = g.segment_stride,
                   .reserved_bytes = g.reserved_bytes,
                   .granularity_bytes = g.granularity_bytes};
  *mapping = out;
  return KVD_OK;
}

void kvd_mapping_close(kvd_mapping* mapping) { delete mapping; }

void* kvd_mapping_base(const kvd_mapping* m) { return m->mapping->base(); }
void* kvd_mapping_layer(const kvd_mapping* m, uint64_t layer) { return m->mapping->layer(layer).data; }
const kvd_geometry* kvd_mapping_geometry(const kvd_mapping* m) { return &m->geometry; }

int kvd_mapping_layout(const kvd_mapping* m, kvd_buffer* resolution) {
  const kvd::LayoutResolution& l = m->mapping->layout();
  v1::LayoutResolution out;
  out.set_layout(l.layout);
  v1::LayoutRule rule = v1::LAYOUT_RULE_UNSPECIFIED;
  v1::LayoutRule_Parse(absl::StrCat("LAYOUT_RULE_", absl::AsciiStrToUpper(l.rule)), &rule);
  out.set_rule(rule);
  out.set_rule_detail(l.rule_detail);
  for (const std::string& a : l.allowed_layouts) out.add_allowed_layouts(a);
  for (const std::string& w : l.warnings) out.add_warnings(w);
  kvd::Put(out.SerializeAsString(), resolution);
  return KVD_OK;
}

const char* kvd_mapping_pool(const kvd_mapping* m) { return m->mapping->pool().c_str(); }
char* kvd_mapping_client_id(const kvd_mapping* m) { return Copy(m->mapping->client_id()); }
uint64_t kvd_mapping_epoch(const kvd_mapping* m) { return m->mapping->epoch(); }
uint64_t kvd_mapping_committed_blocks(const kvd_mapping* m) { return m->mapping->committed_blocks(); }

int kvd_mapping_state(const kvd_mapping* m) { return kvd::StateCode(m->mapping->state()); }
int kvd_mapping_pool_state(const kvd_mapping* m) { return kvd::StateCode(m->mapping->pool_state()); }

size_t kvd_mapping_chunks(const kvd_mapping* m, kvd_chunk* chunks, size_t capacity) {
  const std::vector<kvd::ChunkInfo> now = m->mapping->chunks();
  for (size_t i = 0; i < now.size() && i < capacity; ++i) {
    chunks[i] = {.id = now[i].id, .segment = now[i].segment, .offset = now[i].offset, .bytes = now[i].bytes};
  }
  return now.size();
}

const char* kvd_mapping_device_backend(const kvd_mapping* m) { return m->mapping->device().backend.c_str(); }
int kvd_mapping_device_index(const kvd_mapping* m) { return m->mapping->device().index; }
const char* kvd_mapping_device_uuid(const kvd_mapping* m) { return m->mapping->device().uuid.c_str(); }
uint64_t kvd_mapping_events(const kvd_mapping* m) { return m->mapping->counts().events; }
uint64_t kvd_mapping_pauses(const kvd_mapping* m) { return m->mapping->counts().pauses; }
uint64_t kvd_mapping_resumes(const kvd_mapping* m) { return m->mapping->counts().resumes; }

// ---- Group

kvd_group_options* kvd_group_options_create(void) { return new kvd_group_options; }
void kvd_group_options_destroy(kvd_group_options* options) { delete options; }
void kvd_group_options_set_client_name(kvd_group_options* o, const char* name) {
  o->options.connect.client_name = Str(name);
}
void kvd_group_options_set_timeout_us(kvd_group_options* o, int64_t timeout_us) {
  o->options.connect.timeout = absl::Microseconds(timeout_us);
}
void kvd_group_options_set_ttl_us(kvd_group_options* o, int64_t ttl_us) { o->options.ttl = absl::Microseconds(ttl_us); }
void kvd_group_options_set_before_commit(kvd_group_options* o, kvd_before_commit_fn fn, void* user) {
  o->before_commit = fn;
  o->user = user;
}

int kvd_group_open(const char* name, const char* const* sockets, size_t count, const kvd_group_options* options,
                   kvd_group** group, kvd_status** status) {
  auto g = std::make_unique<kvd_group>();
  g->name = Str(name);
  g->replies = std::make_shared<kvd::RankReplies>();
  kvd::GroupOptions o = options == nullptr ? kvd::GroupOptions{} : options->options;
  o.connect.on_reply = [replies = g->replies](const google::protobuf::Message& m) { replies->Observe(m); };
  if (options != nullptr && options->before_commit != nullptr) {
    o.before_commit = [fn = options->before_commit, user = options->user]() -> absl::Status {
      const int code = fn(user);
      if (code == KVD_OK) return absl::OkStatus();
      return absl::Status(kvd::CodeOf(code), absl::StrCat("the before_commit callback returned ", kvd_code_name(code)));
    };
  }
  std::vector<std::string> at;
  for (size_t i = 0; i < count; ++i) at.push_back(Str(sockets[i]));
  g->replies->Begin();
  absl::StatusOr<std::unique_ptr<kvd::Group>> opened = kvd::Group::Open(g->name, at, std::move(o));
  kvd::RankMessages got = kvd::ByRank(g->name, g->replies->End());
  if (!opened.ok()) return Fail(opened.status(), status);
  g->group = *std::move(opened);
  for (const kvd::GroupRank& r : g->group->ranks()) {
    g->sockets.push_back(r.socket);
    g->uuids.push_back(r.device_uuid);
  }
  {
    absl::MutexLock lock(&g->mu);
    g->pools.resize(g->sockets.size());
  }
  if (absl::Status s = kvd::Remember(g.get(), got); !s.ok()) return Fail(s, status);
  *group = g.release();
  return KVD_OK;
}

void kvd_group_close(kvd_group* group) { delete group; }
size_t kvd_group_rank_count(const kvd_group* g) { return g->sockets.size(); }
const char* kvd_group_rank_socket(const kvd_group* g, size_t rank) {
  return rank < g->sockets.size() ? g->sockets[rank].c_str() : nullptr;
}
const char* kvd_group_rank_device_uuid(const kvd_group* g, size_t rank) {
  return rank < g->uuids.size() ? g->uuids[rank].c_str() : nullptr;
}

int kvd_group_rank_pool(const kvd_group* g, size_t rank, kvd_buffer* pool, kvd_status** status) {
  absl::MutexLock lock(&g->mu);
  if (rank >= g->pools.size()) {
    return Fail(absl::OutOfRangeError(absl::StrCat("rank: ", rank, " is past the group's ", g->pools.size(), " ranks")),
                status);
  }
  kvd::Put(g->pools[rank], pool);
  return KVD_OK;
}

int kvd_group_refresh(kvd_group* g, kvd_status** status) {
  absl::MutexLock op(&g->op_mu);
  g->replies->Begin();
  absl::Status s = g->group->Refresh().status();
  kvd::RankMessages got = kvd::ByRank(g->name, g->replies->End());
  if (!s.ok()) return Fail(s, status);
  return Done(kvd::Remember(g, got), status);
}

void kvd_group_change_free(kvd_group_change* change) {
  if (change == nullptr) return;
  for (size_t r = 0; r < change->rank_count; ++r) std::free(change->updates[r].data);
  std::free(const_cast<kvd_buffer*>(change->updates));
  std::free(change);
}

int kvd_group_grow(kvd_group* g, uint64_t target_blocks, kvd_group_change** change, kvd_status** status) {
  return kvd::RunGroup(
      g, [&](kvd::Group& group) { return group.Grow(target_blocks); }, change, status);
}
int kvd_group_shrink(kvd_group* g, uint64_t target_blocks, int wait, int force, kvd_group_change** change,
                     kvd_status** status) {
  return kvd::RunGroup(
      g, [&](kvd::Group& group) { return group.Shrink(target_blocks, wait != 0, force != 0); }, change, status);
}
int kvd_group_sleep(kvd_group* g, int wait, int force, int keep, kvd_group_change** change, kvd_status** status) {
  return kvd::RunGroup(
      g, [&](kvd::Group& group) { return group.Sleep(wait != 0, force != 0, keep != 0); }, change, status);
}
int kvd_group_wake(kvd_group* g, kvd_group_change** change, kvd_status** status) {
  return kvd::RunGroup(
      g, [&](kvd::Group& group) { return group.Wake(); }, change, status);
}

}  // extern "C"
