#include "kvd/client.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/handle_client.h"
#include "client/phase_marks.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "kvd/device.h"
#include "kvd/fd_passing.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "kvd/wire.h"

namespace kvd {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// ---------------------------------------------------------------------------------------------
// proto -> plain structs

PoolDims FromProto(const v1::PoolDims& d) {
  return PoolDims{.layers = d.layers(),
                  .capacity_blocks = d.capacity_blocks(),
                  .heads = d.heads(),
                  .block_tokens = d.block_tokens(),
                  .channels = d.channels(),
                  .element_bytes = d.element_bytes()};
}

void ToProto(const PoolDims& d, v1::PoolDims* out) {
  out->set_layers(d.layers);
  out->set_capacity_blocks(d.capacity_blocks);
  out->set_heads(d.heads);
  out->set_block_tokens(d.block_tokens);
  out->set_channels(d.channels);
  out->set_element_bytes(d.element_bytes);
}

void ToProto(const LayoutRequest& r, v1::LayoutRequest* out) {
  out->set_override_layout(r.override_layout);
  for (const LayoutRequest::Requirement& req : r.backend_requirements) {
    v1::BackendRequirement* p = out->add_backend_requirements();
    p->set_backend(req.backend);
    for (const std::string& l : req.layouts) p->add_layouts(l);
  }
  for (const LayoutRequest::Preference& pref : r.connector_preferences) {
    v1::ConnectorPreference* p = out->add_connector_preferences();
    p->set_connector(pref.connector);
    p->set_layout(pref.layout);
  }
  if (r.env_layout_set) {
    out->set_env_layout(r.env_layout);
  } else if (const char* env = std::getenv(wire::kLayoutEnv); env != nullptr) {
    out->set_env_layout(env);
  }
}

Geometry FromProto(const v1::Geometry& g) {
  return Geometry{.layout = g.layout(),
                  .dims = FromProto(g.dims()),
                  .stride_l = g.stride_l(),
                  .stride_b = g.stride_b(),
                  .stride_h = g.stride_h(),
                  .stride_n = g.stride_n(),
                  .stride_c = g.stride_c(),
                  .offset = g.offset(),
                  .layer_stride = g.layer_stride(),
                  .block_stride = g.block_stride(),
                  .segments = g.segments(),
                  .segment_stride = g.segment_stride(),
                  .reserved_bytes = g.reserved_bytes(),
                  .granularity_bytes = g.granularity_bytes()};
}

LayoutResolution FromProto(const v1::LayoutResolution& r) {
  LayoutResolution out{.layout = r.layout(), .rule = "", .rule_detail = r.rule_detail()};
  constexpr absl::string_view kPrefix = "LAYOUT_RULE_";
  std::string rule = v1::LayoutRule_Name(r.rule());
  if (absl::StartsWith(rule, kPrefix)) rule = rule.substr(kPrefix.size());
  out.rule = absl::AsciiStrToLower(rule);
  out.allowed_layouts.assign(r.allowed_layouts().begin(), r.allowed_layouts().end());
  out.warnings.assign(r.warnings().begin(), r.warnings().end());
  return out;
}

ChunkInfo FromProto(const v1::Chunk& c) {
  return ChunkInfo{.id = c.id(),
                   .segment = c.segment(),
                   .offset = c.offset(),
                   .bytes = c.bytes(),
                   .fabric_handle = c.fabric_handle()};
}

PoolState FromProto(v1::PoolState s) {
  switch (s) {
    case v1::POOL_STATE_AWAKE:
      return PoolState::kAwake;
    case v1::POOL_STATE_SLEEPING:
      return PoolState::kSleeping;
    case v1::POOL_STATE_RECOVERING:
      return PoolState::kRecovering;
    default:
      return PoolState::kUnknown;
  }
}

ReclaimAction FromProto(v1::ReclaimAction a) {
  switch (a) {
    case v1::RECLAIM_ACTION_SHRINK:
      return ReclaimAction::kShrink;
    case v1::RECLAIM_ACTION_SLEEP:
      return ReclaimAction::kSleep;
    default:
      return ReclaimAction::kNone;
  }
}

v1::ReclaimAction ToProto(ReclaimAction a) {
  switch (a) {
    case ReclaimAction::kNone:
      return v1::RECLAIM_ACTION_NONE;
    case ReclaimAction::kShrink:
      return v1::RECLAIM_ACTION_SHRINK;
    case ReclaimAction::kSleep:
      return v1::RECLAIM_ACTION_SLEEP;
  }
  return v1::RECLAIM_ACTION_NONE;
}

// Whole milliseconds, rounded up: a positive duration never becomes 0 (the daemon's default).
uint64_t CeilMillis(absl::Duration d) {
  const int64_t us = absl::ToInt64Microseconds(d);
  return us > 0 ? static_cast<uint64_t>((us + 999) / 1000) : 0;
}

PoolPolicy FromProto(const v1::PoolPolicy& p) {
  return PoolPolicy{.priority = p.priority(),
                    .min_bytes = p.min_bytes(),
                    .max_bytes = p.max_bytes(),
                    .reclaim_timeout = absl::Milliseconds(static_cast<int64_t>(p.reclaim_timeout_ms())),
                    .on_reclaim_timeout = FromProto(p.on_reclaim_timeout())};
}

PoolInfo FromProto(const v1::Pool& p) {
  PoolInfo out{.name = p.name(),
               .state = FromProto(p.state()),
               .geometry = FromProto(p.geometry()),
               .layout = FromProto(p.layout()),
               .committed_blocks = p.committed_blocks(),
               .committed_bytes = p.committed_bytes(),
               .reserved_bytes = p.reserved_bytes(),
               .pending_release_bytes = p.pending_release_bytes(),
               .wake_blocks = p.wake_blocks(),
               .kept_bytes = p.kept_bytes(),
               .owner_uid = p.owner_uid(),
               .generation = p.generation(),
               .created_at_unix_ms = p.created_at_unix_ms()};
  out.allowed_uids.assign(p.allowed_uids().begin(), p.allowed_uids().end());
  for (const v1::ClientInfo& c : p.clients()) {
    out.clients.push_back(ClientInfo{.client_id = c.client_id(),
                                     .name = c.name(),
                                     .uid = c.uid(),
                                     .pid = c.pid(),
                                     .mapped_bytes = c.mapped_bytes(),
                                     .attached_at_unix_ms = c.attached_at_unix_ms(),
                                     .device_uuid = c.device_uuid(),
                                     .pausable = c.pausable()});
  }
  for (const v1::Chunk& c : p.chunks()) out.chunks.push_back(FromProto(c));
  out.group = GroupMembership{.name = p.group().name(), .rank = p.group().rank(), .size = p.group().size()};
  out.peer_devices.assign(p.peer_devices().begin(), p.peer_devices().end());
  out.transaction = p.transaction();
  out.epoch = p.epoch();
  out.metadata_version = p.metadata_version();
  out.metadata_bytes = p.metadata_bytes();
  out.missing_chunk_ids.assign(p.missing_chunk_ids().begin(), p.missing_chunk_ids().end());
  out.client_count = p.client_count();
  out.policy = FromProto(p.policy());
  out.policy_operator_bounds = p.policy_operator_bounds();
  if (p.has_usage()) {
    out.usage = PoolUsage{.live_blocks = p.usage().live_blocks(),
                          .evictable_blocks = p.usage().evictable_blocks(),
                          .used_blocks = p.usage().used_blocks(),
                          .reported_at_unix_ms = p.usage().reported_at_unix_ms()};
  }
  out.reclaim = ReclaimState{.reclaim_id = p.reclaim().reclaim_id(),
                             .asked_bytes = p.reclaim().asked_bytes(),
                             .given_bytes = p.reclaim().given_bytes(),
                             .asked_at_unix_ms = p.reclaim().asked_at_unix_ms(),
                             .deadline_unix_ms = p.reclaim().deadline_unix_ms(),
                             .last_outcome = p.reclaim().last_outcome()};
  for (const v1::WaitingRequest& w : p.waiting()) {
    out.waiting.push_back(
        {.asked_bytes = w.asked_bytes(), .waiting_since_unix_ms = w.waiting_since_unix_ms(), .position = w.position()});
  }
  return out;
}

Reshape FromProto(const v1::Reshape& r) {
  Reshape out{.chunks_before = r.chunks_before(),
              .chunks_after = r.chunks_after(),
              .chunks_replaced = r.chunks_replaced(),
              .chunks_added = r.chunks_added(),
              .copied_bytes = r.copied_bytes(),
              .copy_us = r.copy_us(),
              .paused_clients = r.paused_clients(),
              .pause_us = r.pause_us(),
              .resumed_clients = r.resumed_clients(),
              .target_reached = r.target_reached(),
              .steps = r.steps(),
              .max_pause_us = r.max_pause_us()};
  out.detached_client_ids.assign(r.detached_client_ids().begin(), r.detached_client_ids().end());
  for (const v1::BlockCopy& m : r.moved_blocks()) out.moved_blocks.push_back({.src = m.src(), .dst = m.dst()});
  return out;
}

PoolChange FromProto(const v1::PoolUpdate& u) {
  PoolChange out{.pool = FromProto(u.pool()), .release_id = u.release_id(), .elapsed_us = u.elapsed_us()};
  for (const v1::Chunk& c : u.added()) out.added.push_back(FromProto(c));
  out.released_chunk_ids.assign(u.released_chunk_ids().begin(), u.released_chunk_ids().end());
  if (u.has_reshape()) out.reshape = FromProto(u.reshape());
  return out;
}

void ToProto(const PauseOptions& p, v1::PauseOptions* out) {
  // Whole milliseconds, rounded up: a positive timeout never becomes 0 (the daemon's default).
  const int64_t us = absl::ToInt64Microseconds(p.timeout);
  out->set_timeout_ms(us > 0 ? static_cast<uint64_t>((us + 999) / 1000) : 0);
  out->set_detach_unresponsive(p.detach_unresponsive);
}

v1::Operation ToProto(GroupOp op) {
  switch (op) {
    case GroupOp::kGrow:
      return v1::OPERATION_GROW;
    case GroupOp::kShrink:
      return v1::OPERATION_SHRINK;
    case GroupOp::kSleep:
      return v1::OPERATION_SLEEP;
    case GroupOp::kWake:
      return v1::OPERATION_WAKE;
  }
  return v1::OPERATION_UNSPECIFIED;
}

const char* BackendString(v1::Backend b) {
  switch (b) {
    case v1::BACKEND_CUDA:
      return "cuda";
    case v1::BACKEND_HIP:
      return "hip";
    case v1::BACKEND_HOST:
      return "host";
    default:
      return "unknown";
  }
}

}  // namespace

std::string DefaultSocket(int device) { return wire::DefaultSocket(device); }

std::string HandlesPathFor(absl::string_view socket) { return wire::HandlesPathFor(socket); }

absl::StatusOr<std::vector<std::string>> NodeSockets(absl::string_view directory) {
  const std::string dir = directory.empty() ? wire::SocketDirFromEnvironment() : std::string(directory);
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return absl::NotFoundError(absl::StrCat("socket directory ", dir, ": ", std::strerror(errno)));
  std::vector<std::string> sockets;
  while (dirent* e = readdir(d)) {
    if (wire::IsSocketName(e->d_name)) sockets.push_back(absl::StrCat(dir, "/", e->d_name));
  }
  closedir(d);
  std::sort(sockets.begin(), sockets.end());
  if (sockets.empty()) return absl::NotFoundError(absl::StrCat("no kvd socket (*", wire::kSocketSuffix, ") in ", dir));
  return sockets;
}

absl::StatusOr<std::string> FindSocket(absl::string_view device_uuid, absl::string_view directory,
                                       absl::Duration timeout) {
  if (device_uuid.empty()) return absl::InvalidArgumentError("device_uuid: must not be empty");
  const std::string want = absl::AsciiStrToLower(device_uuid);
  KVD_ASSIGN_OR_RETURN(std::vector<std::string> sockets, NodeSockets(directory));
  std::vector<std::string> seen, matches;
  for (const std::string& socket : sockets) {
    absl::StatusOr<std::unique_ptr<Client>> c =
        Client::Connect({.socket = socket, .client_name = "find-socket", .timeout = timeout});
    absl::StatusOr<DeviceStatus> d = c.ok() ? (*c)->DeviceInfo() : c.status();
    if (!d.ok()) {
      seen.push_back(absl::StrCat(socket, " (not answering)"));
      continue;
    }
    seen.push_back(absl::StrCat(socket, " ", d->uuid));
    const std::string uuid = absl::AsciiStrToLower(d->uuid);
    if (uuid == want || uuid == "gpu-" + want) return socket;  // an exact UUID wins
    if (absl::StartsWith(uuid, want) || absl::StartsWith(uuid, "gpu-" + want)) {
      matches.push_back(absl::StrCat(socket, " ", d->uuid));
    }
  }
  if (matches.size() == 1) return matches.front().substr(0, matches.front().find(' '));
  if (matches.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device_uuid, ": matches several daemons: ", absl::StrJoin(matches, ", ")));
  }
  return absl::NotFoundError(
      absl::StrCat("device ", device_uuid, ": no kvd serves it; seen: ", absl::StrJoin(seen, ", ")));
}

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
  return "unknown";
}

const char* PoolStateName(PoolState state) {
  switch (state) {
    case PoolState::kAwake:
      return "awake";
    case PoolState::kSleeping:
      return "sleeping";
    case PoolState::kRecovering:
      return "recovering";
    default:
      return "unknown";
  }
}

// ---------------------------------------------------------------------------------------------
// Client::Impl

namespace {
// The hint a call made while the daemon is away carries (docs/integrating.md, "When kvd restarts").
constexpr absl::string_view kRetryHint = "retry in 1s";
}  // namespace

struct Client::Impl {
  // One session with the daemon: the handle-channel session and a gRPC channel opened with it. A
  // restarted daemon knows none of the old sessions, so both are replaced together (a fresh channel
  // also skips gRPC's reconnect backoff). Immutable once published; shared by the calls using it.
  struct Connection {
    explicit Connection(HandleSession s) : session(std::move(s)) {}
    HandleSession session;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Kvd::Stub> stub;
  };
  using Conn = std::shared_ptr<const Connection>;
  template <typename Req, typename Resp>
  using Method = grpc::Status (v1::Kvd::Stub::*)(grpc::ClientContext*, const Req&, Resp*);

  Impl(ConnectOptions opts, Conn c) : options(std::move(opts)), conn(std::move(c)) {}

  const ConnectOptions options;

  // Opens a session and a channel to options.socket.
  static absl::StatusOr<Conn> Open(const ConnectOptions& options);
  Conn Current() const ABSL_LOCKS_EXCLUDED(conn_mu) {
    absl::MutexLock lock(&conn_mu);
    return conn;
  }
  // The current connection while its session is up; else a new one (the daemon restarted). UNAVAILABLE
  // with the retry hint while no daemon answers.
  absl::StatusOr<Conn> Live() ABSL_LOCKS_EXCLUDED(reopen_mu, conn_mu);
  // UNAVAILABLE from a daemon that went away, with the retry hint; anything else unchanged.
  absl::Status NotAnswering(const absl::Status& s) const {
    if (!absl::IsUnavailable(s)) return s;
    return absl::UnavailableError(
        absl::StrCat("kvd at ", options.socket, " is not answering (restarting?): ", kRetryHint, ": ", s.message()));
  }

  static std::unique_ptr<grpc::ClientContext> Context(const Connection& c, absl::Duration timeout) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata(wire::kSessionMetadataKey, c.session.token());
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    return ctx;  // wait_for_ready stays off: a call to a daemon that is away fails at once
  }
  // One RPC on `c`, within `timeout`.
  template <typename Req, typename Resp>
  absl::Status CallOn(const Connection& c, Method<Req, Resp> method, const Req& req, Resp* resp,
                      absl::Duration timeout) const {
    absl::Status s = FromGrpc(((*c.stub).*method)(Context(c, timeout).get(), req, resp));
    // The daemon's own UNAVAILABLE (a RECOVERING pool) leaves the session up; a daemon that went away
    // closed it.
    if (absl::IsUnavailable(s) && !c.session.Alive()) return NotAnswering(s);
    return s;
  }
  template <typename Req, typename Resp>
  absl::Status CallOn(const Connection& c, Method<Req, Resp> method, const Req& req, Resp* resp) const {
    return CallOn(c, method, req, resp, options.timeout);
  }
  // One RPC on a live connection (re-opening the session after a restart).
  template <typename Req, typename Resp>
  absl::Status Call(Method<Req, Resp> method, const Req& req, Resp* resp, absl::Duration timeout) {
    KVD_ASSIGN_OR_RETURN(Conn c, Live());
    return CallOn(*c, method, req, resp, timeout);
  }
  template <typename Req, typename Resp>
  absl::Status Call(Method<Req, Resp> method, const Req& req, Resp* resp) {
    return Call(method, req, resp, options.timeout);
  }

  // Hands a successful reply to ConnectOptions::on_reply.
  void Observe(const google::protobuf::Message& reply) const {
    if (options.on_reply) options.on_reply(reply);
  }

  absl::Mutex reopen_mu ABSL_ACQUIRED_BEFORE(conn_mu);  // one re-open at a time
  // One Attach with push_handles at a time, from its RPC until its pushed batch is read (docs/api.md, "Pushed
  // handles"): concurrent attaches would read each other's batches.
  absl::Mutex push_mu;
  mutable absl::Mutex conn_mu;
  Conn conn ABSL_GUARDED_BY(conn_mu);

  absl::Mutex mu;
  // Opened on first use with the daemon's backend, by index; never reset while the Impl lives.
  std::map<int, std::unique_ptr<Device>> devices ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, std::weak_ptr<Mapping::Impl>> mappings ABSL_GUARDED_BY(mu);

  // The device this process maps from (AttachOptions::device; empty: the daemon's), opened once.
  struct LocalDevice {
    Device* device = nullptr;
    std::string peer_uuid;  // set when it is not the daemon's device: the AttachRequest's device_uuid
    // What a Mapping reports of the device it maps on (MappedDevice), read once: Device::Info also asks for
    // the free memory (cuMemGetInfo on CUDA), which an Attach does not need.
    BackendKind backend = BackendKind::kHost;
    int index = 0;
    std::string uuid;
  };
  // Asks the daemon for its device once per selector: a restarted daemon serves the same device (its
  // --device), so the answer does not change (an Attach saves a round trip).
  absl::StatusOr<LocalDevice> GetDevice(absl::string_view selector);
  absl::StatusOr<LocalDevice> OpenLocalDevice(absl::string_view selector);
  absl::flat_hash_map<std::string, LocalDevice> local_devices ABSL_GUARDED_BY(mu);
  std::shared_ptr<Mapping::Impl> FindMapping(const std::string& pool);
  // Maps the lease of `update` into this client's Mapping of its pool, if it has one.
  absl::Status Route(const v1::PoolUpdate& update);
  // After this client's Shrink or Compact (`update`): waits, at most `timeout`, until its Mapping of the
  // pool (if any) has no pause pending with one of update.added: it remapped them, or dropped them. The
  // daemon replies after every RESUME's acknowledgement, and the follower acknowledges after remapping,
  // so this normally finds nothing to wait for.
  absl::Status AwaitRemap(const v1::PoolUpdate& update, absl::Duration timeout);
};

absl::StatusOr<Client::Impl::Conn> Client::Impl::Open(const ConnectOptions& options) {
  KVD_ASSIGN_OR_RETURN(HandleSession session, HandleSession::Open(HandlesPathFor(options.socket), options.client_name,
                                                                  HandleClientOptions{.timeout = options.timeout}));
  auto c = std::make_shared<Connection>(std::move(session));
  // A subchannel of its own: gRPC's global pool would hand a new channel the old daemon's broken
  // connection (or its reconnect backoff).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  c->channel = grpc::CreateCustomChannel("unix:" + options.socket, grpc::InsecureChannelCredentials(), args);
  c->stub = v1::Kvd::NewStub(c->channel);
  return Conn(std::move(c));
}

absl::StatusOr<Client::Impl::Conn> Client::Impl::Live() {
  Conn c = Current();
  if (c->session.Alive()) return c;
  absl::MutexLock reopen(&reopen_mu);
  c = Current();
  if (c->session.Alive()) return c;  // another thread re-opened it meanwhile
  absl::StatusOr<Conn> fresh = Open(options);
  if (!fresh.ok()) return NotAnswering(fresh.status());
  absl::MutexLock lock(&conn_mu);
  conn = *fresh;
  return *fresh;
}

absl::StatusOr<Client::Impl::LocalDevice> Client::Impl::GetDevice(absl::string_view selector) {
  {
    absl::MutexLock lock(&mu);
    if (auto it = local_devices.find(selector); it != local_devices.end()) return it->second;
  }
  KVD_ASSIGN_OR_RETURN(LocalDevice local, OpenLocalDevice(selector));
  absl::MutexLock lock(&mu);
  local_devices.emplace(std::string(selector), local);
  return local;
}

absl::StatusOr<Client::Impl::LocalDevice> Client::Impl::OpenLocalDevice(absl::string_view selector) {
  v1::DeviceInfo info;
  KVD_RETURN_IF_ERROR(Call(&v1::Kvd::Stub::GetDeviceInfo, v1::GetDeviceInfoRequest(), &info));
  DeviceOptions opts{.backend = BackendString(info.backend()), .index = static_cast<int>(info.device_index())};
  if (info.backend() == v1::BACKEND_HOST && info.granularity_bytes() > 0) {
    opts.host_granularity = info.granularity_bytes();
  }
  // Device indices are per process (CUDA_VISIBLE_DEVICES renumbers them): the daemon's device is found
  // here by its UUID.
  const std::string& wanted = selector.empty() ? info.device_uuid() : std::string(selector);
  if (!wanted.empty()) {
    absl::StatusOr<int> index = ResolveDeviceSelector(opts, wanted);
    if (!index.ok()) {
      return absl::Status(index.status().code(),
                          absl::StrCat(selector.empty() ? "the daemon's " : "attach: ", index.status().message()));
    }
    opts.index = *index;
  }
  absl::MutexLock lock(&mu);
  std::unique_ptr<Device>& device = devices[opts.index];
  if (device == nullptr) {
    absl::StatusOr<std::unique_ptr<Device>> opened = OpenDevice(opts);
    if (!opened.ok()) {
      devices.erase(opts.index);
      return opened.status();
    }
    device = *std::move(opened);
  }
  KVD_ASSIGN_OR_RETURN(kvd::DeviceInfo local, device->Info());
  LocalDevice out{.device = device.get(), .backend = local.backend, .index = local.index, .uuid = local.uuid};
  if (local.uuid != info.device_uuid()) {
    // Peer access: this process maps another device's memory with access for its own device.
    KVD_RETURN_IF_ERROR(device->CheckPeerAccess(info.device_uuid()));
    out.peer_uuid = local.uuid;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Mapping::Impl

struct Mapping::Impl {
  struct Mapped {
    ChunkInfo info;
    Chunk chunk;
    // Kept open so that the chunk can be handed back after a daemon restart; empty where the imported
    // chunk is an FD itself (keep_fds false).
    UniqueFd fd;
  };
  using Conn = Client::Impl::Conn;
  using Reader = grpc::ClientReader<v1::PoolEvent>;

  std::shared_ptr<Client::Impl> client;
  Device* device = nullptr;
  Mapping::MappedDevice mapped_device;  // `device`, as Mapping::device() reports it
  // Whether a mapped chunk keeps its FD (Mapped::fd). On host an imported chunk is a dup of the memfd that
  // the device layer holds, so the Mapping keeps no second FD and exports the chunk when it hands it back
  // (Note [FD hygiene] in docs/architecture.md): one FD per chunk either way.
  bool keep_fds = true;
  std::string peer_uuid;  // the AttachRequest's device_uuid
  std::string pool;
  Geometry geometry;
  LayoutResolution layout;
  uint64_t base = 0;
  AttachOptions options;

  mutable absl::Mutex mu;
  Conn conn ABSL_GUARDED_BY(mu);  // the session this Mapping is attached through
  std::string client_id ABSL_GUARDED_BY(mu);
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;
  std::map<uint64_t, Mapped> chunks ABSL_GUARDED_BY(mu);  // by chunk id
  uint64_t committed_blocks ABSL_GUARDED_BY(mu) = 0;
  Mapping::State state ABSL_GUARDED_BY(mu) = Mapping::State::kAwake;
  Mapping::State pool_state_when_lost ABSL_GUARDED_BY(mu) = Mapping::State::kAwake;
  Mapping::Counts counts ABSL_GUARDED_BY(mu);
  bool closing ABSL_GUARDED_BY(mu) = false;
  std::unique_ptr<grpc::ClientContext> watch_ctx ABSL_GUARDED_BY(mu);

  // A pause in progress (docs/api.md, "Pauses and reshaping"): the new chunks of its PAUSE, imported but
  // not mapped until the RESUME, and the PAUSE's ranges.
  struct Imported {
    ChunkInfo info;
    Chunk chunk;
    UniqueFd fd;
  };
  struct Pause {
    std::vector<Imported> chunks;
    std::vector<ByteRange> ranges;
  };
  std::map<uint64_t, Pause> pauses ABSL_GUARDED_BY(mu);  // by pause_id
  // PAUSEs called off before their lease was fetched (the fetch answered ABORTED), whose RESUME (not applied)
  // is still to come: the engine was never paused for them (Note [A called-off pause's lease]).
  std::set<uint64_t> called_off ABSL_GUARDED_BY(mu);
  // The engine was paused (on_pause) for chunks a restarted daemon lacks; on_resume once reattached.
  bool paused_for_restart ABSL_GUARDED_BY(mu) = false;

  std::thread follower;
  // Each RECLAIM event's on_reclaim runs on a thread of its own, so that it may shrink the pool (which the
  // follower must follow meanwhile); joined when the Mapping closes, before the follower stops.
  std::vector<std::thread> reclaimers ABSL_GUARDED_BY(mu);
  bool reclaims_closed ABSL_GUARDED_BY(mu) = false;  // closing: no new reclaimers
  // The reclaims on_reclaim was called for, by (reclaim_id, deadline): kvd asks a client that attaches
  // while a reclaim is under way again, and a follower re-attaching is such a client. Kept until their
  // deadline passes.
  std::set<std::pair<uint64_t, uint64_t>> reclaims_seen ABSL_GUARDED_BY(mu);
  void OnReclaim(const v1::PoolEvent& ev);
  // The follower's own: the last stream ended with DAEMON_RESTARTING, so the daemon that sent it is on
  // its way out and the next one is awaited.
  bool restart_announced = false;

  // Fetches `lease` on `c` and hands each FD with its chunk of `leased` to `each` (the FD is `each`'s),
  // after checking that the chunk is one of `leased` and lies inside the reservation (INTERNAL otherwise).
  // With `all` (a PAUSE's lease) the lease must yield every chunk of `leased`: FAILED_PRECONDITION when one
  // was released since, INTERNAL when the lease lacks one. Without, it yields the chunks still in the pool
  // (FetchHandles.skip_released; Note [A lease yields what is still in the pool] in docs/architecture.md).
  // `pushed`: the lease's FDs, pushed with its Attach (docs/api.md, "Pushed handles"), taken instead of fetched.
  absl::Status FetchLeased(const Client::Impl::Connection& c, const std::string& lease,
                           const google::protobuf::RepeatedPtrField<v1::Chunk>& leased, bool all,
                           absl::FunctionRef<absl::Status(const ChunkInfo&, UniqueFd)> each,
                           std::optional<HandleSession::LeasedFds> pushed = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Fetches `lease` on `c` and maps each chunk of `added` that is still in the pool at base + offset,
  // keeping its FD; a chunk that a release took out since the lease was issued is left out, and that
  // release's event (on this Mapping's stream, before or after) unmaps or replaces it. A chunk mapped
  // already with the same segment, offset and bytes stays as it is. Returns the chunks the lease yielded.
  absl::StatusOr<std::vector<ChunkInfo>> MapLease(const Client::Impl::Connection& c, const std::string& lease,
                                                  const google::protobuf::RepeatedPtrField<v1::Chunk>& added,
                                                  std::optional<HandleSession::LeasedFds> pushed = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The FD a chunk keeps, or none (keep_fds).
  UniqueFd Keep(UniqueFd fd) const { return keep_fds ? std::move(fd) : UniqueFd(); }
  // A new FD of a mapped chunk, for ReturnHandles: a dup of the one it keeps, else the device's export.
  UniqueFd NewFd(const Mapped& m) const;
  void UnmapOne(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Unmaps every chunk and releases the chunks of every pause in progress.
  void UnmapAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Unmaps every mapped chunk that overlaps [offset, offset + bytes): released by a change whose event
  // this follower has not handled yet.
  void UnmapOverlapping(uint64_t offset, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // PAUSE: fetches the event's lease on `c` and imports its chunks into pauses[pause_id], unmapped. ABORTED
  // (the handle channel's answer) when the pause was called off before the fetch.
  absl::Status ImportPause(const Client::Impl::Connection& c, const v1::PoolEvent& ev)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Releases the imported chunks of `pause`.
  void DropPause(Pause& pause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // An applied RESUME: unmaps the event's chunks and maps the pause's new ones at their offsets.
  absl::Status Remap(Pause& pause, const v1::PoolEvent& ev, std::vector<Mapped>* retired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The follower's handling of PAUSE and RESUME; false when the Mapping was lost.
  bool OnPause(const v1::PoolEvent& ev);
  bool OnResume(const v1::PoolEvent& ev);
  // Acknowledge(release_id) or Acknowledge(pause_id) on the Mapping's session.
  absl::Status Acknowledge(uint64_t release_id, uint64_t pause_id);
  absl::Status ApplyUpdate(const v1::PoolUpdate& update);
  // Follows one event stream until it ends. Returns why to reconnect (the daemon restarted), or
  // nothing when the Mapping is lost or closing.
  std::optional<absl::Status> FollowStream(Reader& reader);
  void Follow(std::unique_ptr<Reader> reader);
  // After a daemon restart: retries TryReattach with backoff for options.reconnect_for. The new event
  // stream, or null once the Mapping is lost or closing.
  std::unique_ptr<Reader> Reattach(const absl::Status& why);
  struct Attempt {
    std::unique_ptr<Reader> reader;  // set on success
    absl::Status status;             // why not
    bool fatal = false;              // no point retrying: the Mapping is lost
    // The pauses in progress when the daemon went away, ended by the restart: whether each one's new
    // chunks are in the restarted daemon's pool (on_resume's argument).
    std::vector<bool> resumed;
  };
  Attempt TryReattach(DaemonRestart* restart);
  // The Mapping stops following its pool and says `why` (on_lost). `engine_done`: the engine asked for
  // this (its own session's delete) or is paused, so everything is unmapped now; otherwise a pausable
  // Mapping pauses the engine first, and one that is not pausable keeps every chunk mapped until closed
  // when the loss was `forced` on it (a forced release, chunks a restart lost).
  void Lose(const absl::Status& why, bool engine_done = false, bool forced = false);
  void Shutdown();
};

absl::Status Mapping::Impl::FetchLeased(const Client::Impl::Connection& c, const std::string& lease,
                                        const google::protobuf::RepeatedPtrField<v1::Chunk>& leased, bool all,
                                        absl::FunctionRef<absl::Status(const ChunkInfo&, UniqueFd)> each,
                                        std::optional<HandleSession::LeasedFds> pushed) {
  std::map<uint64_t, ChunkInfo> wanted;
  for (const v1::Chunk& chunk : leased) wanted[chunk.id()] = FromProto(chunk);
  HandleSession::LeasedFds fds;
  if (pushed.has_value()) {
    fds = *std::move(pushed);
  } else {
    KVD_ASSIGN_OR_RETURN(fds, c.session.Fetch(lease, /*skip_released=*/!all));
  }
  internal::MarkPhase("lease.fetched");
  size_t next = 0;
  absl::Cleanup close_rest = [&] {
    for (size_t i = next; i < fds.size(); ++i) close(fds[i].second);
  };
  for (; next < fds.size(); ++next) {
    const uint64_t id = fds[next].first;
    UniqueFd fd(fds[next].second);
    auto it = wanted.find(id);
    if (it == wanted.end()) {
      return absl::InternalError(absl::StrCat("lease yielded chunk ", id, " which is not in the chunk list"));
    }
    const ChunkInfo info = it->second;
    wanted.erase(it);
    if (info.offset + info.bytes > geometry.reserved_bytes) {
      return absl::InternalError(absl::StrCat("chunk ", id, " lies outside the pool's reservation"));
    }
    KVD_RETURN_IF_ERROR(each(info, std::move(fd)));
  }
  if (all && !wanted.empty()) {
    return absl::InternalError(
        absl::StrCat("the lease lacks chunk ", wanted.begin()->first, " (", wanted.size(), " missing)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ChunkInfo>> Mapping::Impl::MapLease(
    const Client::Impl::Connection& c, const std::string& lease,
    const google::protobuf::RepeatedPtrField<v1::Chunk>& added, std::optional<HandleSession::LeasedFds> pushed) {
  std::vector<ChunkInfo> came;
  if (added.empty()) {
    if (pushed.has_value()) CloseLeased(*pushed);
    return came;
  }
  KVD_RETURN_IF_ERROR(FetchLeased(
      c, lease, added, /*all=*/false,
      [&](const ChunkInfo& info, UniqueFd fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) -> absl::Status {
        came.push_back(info);
        if (auto have = chunks.find(info.id); have != chunks.end() && have->second.info.segment == info.segment &&
                                              have->second.info.offset == info.offset &&
                                              have->second.info.bytes == info.bytes) {
          return absl::OkStatus();  // the same chunk, mapped already (a re-attach after a restart): the FD closes
        }
        // The daemon's live chunks never overlap: a local chunk that does was released by a change whose
        // release event this follower has not handled yet (it will find the chunk gone and acknowledge).
        UnmapOverlapping(info.offset, info.bytes);
        KVD_ASSIGN_OR_RETURN(Chunk chunk, device->Import(fd.get(), info.bytes));
        if (absl::Status s = device->Map(base + info.offset, chunk, Access::kReadWrite); !s.ok()) {
          device->Release(chunk).IgnoreError();
          return s;
        }
        chunks[info.id] = Mapped{info, chunk, Keep(std::move(fd))};
        return absl::OkStatus();
      },
      std::move(pushed)));
  return came;
}

UniqueFd Mapping::Impl::NewFd(const Mapped& m) const {
  if (m.fd) return UniqueFd(fcntl(m.fd.get(), F_DUPFD_CLOEXEC, 0));
  absl::StatusOr<int> exported = device->Export(m.chunk);
  return UniqueFd(exported.ok() ? *exported : -1);
}

void Mapping::Impl::UnmapOne(uint64_t id) {
  auto it = chunks.find(id);
  if (it == chunks.end()) return;
  device->Unmap(base + it->second.info.offset, it->second.info.bytes).IgnoreError();
  device->Release(it->second.chunk).IgnoreError();
  chunks.erase(it);  // closes its FD
}

void Mapping::Impl::UnmapAll() {
  while (!chunks.empty()) UnmapOne(chunks.begin()->first);
  for (auto& [id, pause] : pauses) DropPause(pause);
  pauses.clear();
}

void Mapping::Impl::UnmapOverlapping(uint64_t offset, uint64_t bytes) {
  std::vector<uint64_t> stale;
  for (const auto& [mapped_id, m] : chunks) {
    if (m.info.offset < offset + bytes && offset < m.info.offset + m.info.bytes) stale.push_back(mapped_id);
  }
  for (uint64_t s : stale) UnmapOne(s);
}

absl::Status Mapping::Impl::ImportPause(const Client::Impl::Connection& c, const v1::PoolEvent& ev) {
  Pause pause;
  for (const v1::ByteRange& r : ev.ranges()) pause.ranges.push_back({r.segment(), r.offset(), r.bytes()});
  absl::Cleanup drop = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { DropPause(pause); };
  if (!ev.chunks().empty()) {
    KVD_RETURN_IF_ERROR(FetchLeased(c, ev.lease().token(), ev.chunks(), /*all=*/true,
                                    [&](const ChunkInfo& info, UniqueFd fd) -> absl::Status {
                                      KVD_ASSIGN_OR_RETURN(Chunk chunk, device->Import(fd.get(), info.bytes));
                                      pause.chunks.push_back(Imported{info, chunk, Keep(std::move(fd))});
                                      return absl::OkStatus();
                                    }));
  }
  std::move(drop).Cancel();
  pauses[ev.pause_id()] = std::move(pause);
  return absl::OkStatus();
}

void Mapping::Impl::DropPause(Pause& pause) {
  for (Imported& i : pause.chunks) device->Release(i.chunk).IgnoreError();
  pause.chunks.clear();  // closes their FDs
}

absl::Status Mapping::Impl::Remap(Pause& pause, const v1::PoolEvent& ev, std::vector<Mapped>* retired) {
  // Only the unmapping happens while the pool is paused; the handles and FDs are given back after the
  // engine resumed (`retired`).
  for (const v1::Chunk& chunk : ev.chunks()) {
    auto it = chunks.find(chunk.id());
    if (it == chunks.end()) continue;
    device->Unmap(base + it->second.info.offset, it->second.info.bytes).IgnoreError();
    retired->push_back(std::move(it->second));
    chunks.erase(it);
  }
  size_t next = 0;
  absl::Cleanup release_rest = [&] {
    for (size_t i = next; i < pause.chunks.size(); ++i) device->Release(pause.chunks[i].chunk).IgnoreError();
    pause.chunks.clear();
  };
  for (; next < pause.chunks.size(); ++next) {
    Imported& i = pause.chunks[next];
    UnmapOverlapping(i.info.offset, i.info.bytes);
    if (absl::Status s = device->Map(base + i.info.offset, i.chunk, Access::kReadWrite); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("mapping chunk ", i.info.id, ": ", s.message()));
    }
    chunks[i.info.id] = Mapped{i.info, i.chunk, std::move(i.fd)};
  }
  return absl::OkStatus();
}

absl::Status Mapping::Impl::Acknowledge(uint64_t release_id, uint64_t pause_id) {
  Conn c;
  v1::AcknowledgeRequest req;
  {
    absl::MutexLock lock(&mu);
    c = conn;
    req.set_client_id(client_id);
  }
  req.set_release_id(release_id);
  req.set_pause_id(pause_id);
  v1::AcknowledgeResponse resp;
  return client->CallOn(*c, &v1::Kvd::Stub::Acknowledge, req, &resp);
}

absl::Status Mapping::Impl::ApplyUpdate(const v1::PoolUpdate& update) {
  absl::MutexLock lock(&mu);
  if (closing || state == Mapping::State::kLost) return absl::OkStatus();
  KVD_ASSIGN_OR_RETURN(const std::vector<ChunkInfo> came, MapLease(*conn, update.lease().token(), update.added()));
  // See Note [A lease yields what is still in the pool] in docs/architecture.md. A lease that lacks some of
  // the chunks was overtaken by a release, whose event sets the size; one that has them all was not, and the
  // follower may already have handled a later grow.
  if (came.size() == static_cast<size_t>(update.added_size())) {
    committed_blocks = std::max(committed_blocks, update.pool().committed_blocks());
  }
  if (!came.empty()) state = Mapping::State::kAwake;  // chunks are only ever added to an awake pool
  return absl::OkStatus();
}

namespace {

// An event's ranges (connectors).
std::vector<ByteRange> Ranges(const v1::PoolEvent& ev) {
  std::vector<ByteRange> out;
  for (const v1::ByteRange& r : ev.ranges()) out.push_back({r.segment(), r.offset(), r.bytes()});
  return out;
}

// `ranges` sorted, with overlapping and adjacent ranges of one segment joined.
std::vector<ByteRange> Merged(std::vector<ByteRange> ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const ByteRange& a, const ByteRange& b) {
    return a.segment != b.segment ? a.segment < b.segment : a.offset < b.offset;
  });
  std::vector<ByteRange> out;
  for (const ByteRange& r : ranges) {
    if (!out.empty() && out.back().segment == r.segment && r.offset <= out.back().offset + out.back().bytes) {
      out.back().bytes = std::max(out.back().offset + out.back().bytes, r.offset + r.bytes) - out.back().offset;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// The bytes of `a` outside every range of `b` (both Merged).
std::vector<ByteRange> Without(const std::vector<ByteRange>& a, const std::vector<ByteRange>& b) {
  std::vector<ByteRange> out;
  for (const ByteRange& x : a) {
    uint64_t at = x.offset;
    const uint64_t end = x.offset + x.bytes;
    for (const ByteRange& y : b) {
      if (y.segment != x.segment || y.offset + y.bytes <= at || y.offset >= end) continue;
      if (y.offset > at) out.push_back({x.segment, at, y.offset - at});
      at = std::max(at, y.offset + y.bytes);
    }
    if (at < end) out.push_back({x.segment, at, end - at});
  }
  return out;
}

}  // namespace

void Mapping::Impl::Lose(const absl::Status& why, bool engine_done, bool forced) {
  // See Note [Releases pause first] in docs/architecture.md: nothing is unmapped while the engine may touch
  // it. A pausable Mapping that is not paused pauses the engine first; one that is not pausable keeps what
  // it maps until it is closed when the loss was forced on it.
  std::vector<ByteRange> mapped;
  bool pause_first = false;
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return;
    if (!engine_done && pauses.empty() && options.on_pause) {
      pause_first = true;
      for (const auto& [id, m] : chunks) mapped.push_back({m.info.segment, m.info.offset, m.info.bytes});
    }
  }
  if (pause_first) options.on_pause(Merged(std::move(mapped)));
  Conn c;
  v1::DetachRequest req;
  bool released = false;
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return;
    released = engine_done || options.on_pause != nullptr || !forced || chunks.empty();
    if (released) UnmapAll();
    pool_state_when_lost = state;
    state = Mapping::State::kLost;
    committed_blocks = 0;
    // Ending the watch detaches this client in the daemon: a lost Mapping acknowledges nothing, so it
    // must not hold up a shrink or sleep that waits for every client (the stream then ends CANCELLED,
    // which finds the Mapping lost already).
    if (watch_ctx != nullptr) watch_ctx->TryCancel();
    c = conn;
    req.set_pool(pool);
    req.set_client_id(client_id);
    req.set_released(true);
  }
  // Everything is unmapped and closed: say so, so that the daemon stops counting what this Mapping held
  // (a deleted pool's memory stays counted until its clients let go). Best effort: the daemon may be gone.
  // A Mapping that keeps its chunks says so when it is closed.
  if (c != nullptr && released) {
    v1::DetachResponse resp;
    client->CallOn(*c, &v1::Kvd::Stub::Detach, req, &resp, std::min(client->options.timeout, absl::Seconds(5)))
        .IgnoreError();
  }
  if (options.on_lost) options.on_lost(why);
}

bool Mapping::Impl::OnPause(const v1::PoolEvent& ev) {
  std::vector<ByteRange> ranges;
  absl::Status imported;
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return false;
    imported = ImportPause(*conn, ev);
    if (imported.ok()) {
      ranges = pauses[ev.pause_id()].ranges;
      ++counts.pauses;
    }
  }
  if (absl::IsAborted(imported)) {
    // See Note [A called-off pause's lease] in docs/architecture.md: nothing changed, every chunk stays mapped
    // and the engine runs on; the RESUME (not applied) that follows ends it.
    absl::MutexLock lock(&mu);
    called_off.insert(ev.pause_id());
    return true;
  }
  if (!imported.ok()) {
    Lose(absl::Status(imported.code(), absl::StrCat("pausing pool ", pool, " (pause ", ev.pause_id(),
                                                    "): importing its new chunks: ", imported.message())));
    return false;
  }
  if (options.on_ranges_released) options.on_ranges_released(ranges);
  if (options.on_pause) options.on_pause(ranges);
  // A refused acknowledgement (too late: the daemon called the change off) changes nothing here: the
  // RESUME with applied = false follows, or the stream ends if the daemon detached this client.
  Acknowledge(/*release_id=*/0, ev.pause_id()).IgnoreError();
  return true;
}

bool Mapping::Impl::OnResume(const v1::PoolEvent& ev) {
  const uint64_t id = ev.pause_id();
  if (!ev.applied()) {
    std::vector<ByteRange> ranges;
    {
      absl::MutexLock lock(&mu);
      if (closing || state == Mapping::State::kLost) return false;
      if (called_off.erase(id) > 0) return true;  // the engine was not paused for it
      if (auto it = pauses.find(id); it != pauses.end()) {
        ranges = it->second.ranges;
        DropPause(it->second);
        pauses.erase(it);
      }
      ++counts.resumes;
    }
    // Nothing moved: connectors register again what they deregistered at the PAUSE.
    if (options.on_ranges_added && !ranges.empty()) options.on_ranges_added(ranges);
    if (options.on_resume) options.on_resume(false);
    return true;
  }
  // A release's RESUME (a shrink's or sleep's whole chunks) marks the phases a CHUNKS_RELEASED does.
  if (ev.release_id() != 0) internal::MarkPhase("release.event");
  // Bytes unmapped without having moved (whole chunks a shrink released) that the PAUSE's ranges did not
  // name: connectors deregister them before they go.
  std::vector<ByteRange> released_only;
  bool known = false;
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return false;
    if (auto it = pauses.find(id); it != pauses.end()) {
      known = true;
      std::vector<ByteRange> unmapped;
      for (const v1::Chunk& chunk : ev.chunks()) {
        if (auto m = chunks.find(chunk.id()); m != chunks.end()) {
          unmapped.push_back({m->second.info.segment, m->second.info.offset, m->second.info.bytes});
        }
      }
      released_only = Without(Merged(std::move(unmapped)), Merged(it->second.ranges));
    }
  }
  if (!known) {
    Lose(absl::InternalError(
        absl::StrCat("pool ", pool, ": RESUME of pause ", id, ", whose PAUSE this client never had")));
    return false;
  }
  if (options.on_ranges_released && !released_only.empty()) options.on_ranges_released(released_only);
  absl::Status remapped;
  std::vector<ByteRange> added;
  std::vector<Mapped> retired;
  absl::Cleanup release_retired = [&] {
    for (Mapped& m : retired) device->Release(m.chunk).IgnoreError();
    retired.clear();  // closes their FDs
  };
  uint64_t before = 0, committed = 0;
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return false;
    auto it = pauses.find(id);
    if (it == pauses.end()) return false;  // only UnmapAll (closing or lost) takes it away meanwhile
    for (const Imported& i : it->second.chunks) added.push_back({i.info.segment, i.info.offset, i.info.bytes});
    remapped = Remap(it->second, ev, &retired);
    pauses.erase(it);
    if (remapped.ok()) {
      before = committed_blocks;
      committed_blocks = committed = ev.committed_blocks();
      if (ev.state() == v1::POOL_STATE_SLEEPING) state = Mapping::State::kSleeping;  // a sleep's pause
      ++counts.resumes;
    }
  }
  if (!remapped.ok()) {
    Lose(absl::Status(remapped.code(),
                      absl::StrCat("remapping pool ", pool, " after pause ", id, ": ", remapped.message())));
    return false;
  }
  if (ev.release_id() != 0) internal::MarkPhase("release.unmapped");
  if (options.on_ranges_added && !added.empty()) options.on_ranges_added(Merged(std::move(added)));
  if (options.on_resume) options.on_resume(true);
  // The replaced chunks' handles go before the acknowledgement: the device frees their memory only once the
  // last process released them, and an acknowledged release is memory the daemon may commit again at once (a
  // Wake right after a Sleep with wait_for_release needs exactly those bytes).
  std::move(release_retired).Invoke();
  if (ev.release_id() != 0) {
    internal::MarkPhase("release.acknowledging");
    absl::Status s = Acknowledge(ev.release_id(), /*pause_id=*/0);
    if (!s.ok()) {
      Lose(absl::Status(s.code(), absl::StrCat("acknowledging release ", ev.release_id(), ": ", s.message())));
      return false;
    }
  }
  if (committed < before && options.on_release) options.on_release(committed);
  return true;
}

std::optional<absl::Status> Mapping::Impl::FollowStream(Reader& reader) {
  v1::PoolEvent ev;
  bool restarting = false;
  while (!restarting && reader.Read(&ev)) {
    {
      absl::MutexLock lock(&mu);
      ++counts.events;
    }
    switch (ev.type()) {
      case v1::EVENT_TYPE_CHUNKS_ADDED: {
        absl::StatusOr<std::vector<ChunkInfo>> came;
        uint64_t committed = 0;
        bool whole = false;
        {
          absl::MutexLock lock(&mu);
          if (closing || state == Mapping::State::kLost) break;
          came = MapLease(*conn, ev.lease().token(), ev.chunks());
          // A lease that lacks some of the chunks was overtaken by a release, whose event follows and sets
          // the size (Note [A lease yields what is still in the pool] in docs/architecture.md).
          whole = came.ok() && came->size() == static_cast<size_t>(ev.chunks_size());
          if (whole) committed_blocks = committed = ev.committed_blocks();
          if (came.ok() && !came->empty()) state = Mapping::State::kAwake;  // chunks are only added to an awake pool
        }
        if (!came.ok()) {
          const absl::Status& s = came.status();
          // Not the engine's choice: a Mapping that is not pausable keeps what it mapped (its engine may be
          // reading it; a forced delete that overtook the grow fails this fetch, say) until it is closed.
          Lose(absl::Status(s.code(), absl::StrCat("mapping chunks added to pool ", pool, ": ", s.message())),
               /*engine_done=*/false, /*forced=*/true);
          break;
        }
        if (whole && options.on_grow) options.on_grow(committed);
        if (options.on_ranges_added && !came->empty()) {
          if (whole) {
            options.on_ranges_added(Ranges(ev));
          } else {
            std::vector<ByteRange> mapped;
            for (const ChunkInfo& info : *came) mapped.push_back({info.segment, info.offset, info.bytes});
            options.on_ranges_added(Merged(std::move(mapped)));
          }
        }
        break;
      }
      case v1::EVENT_TYPE_CHUNKS_RELEASED: {
        internal::MarkPhase("release.event");
        if (ev.forced()) {
          Lose(absl::FailedPreconditionError(absl::StrCat(
                   "pool ", pool, ": ", ev.chunks_size(),
                   " chunks were released by force while this Mapping, which is not ",
                   "pausable, mapped them: it keeps every chunk mapped (their bytes no longer the pool's) until it is "
                   "closed")),
               /*engine_done=*/false, /*forced=*/true);
          break;
        }
        uint64_t committed = 0;
        if (options.on_ranges_released) options.on_ranges_released(Ranges(ev));
        Conn c;
        v1::AcknowledgeRequest req;
        {
          absl::MutexLock lock(&mu);
          if (closing || state == Mapping::State::kLost) break;
          for (const v1::Chunk& chunk : ev.chunks()) UnmapOne(chunk.id());
          internal::MarkPhase("release.unmapped");
          committed_blocks = committed = ev.committed_blocks();
          if (ev.state() == v1::POOL_STATE_SLEEPING) state = Mapping::State::kSleeping;
          c = conn;
          req.set_client_id(client_id);
        }
        if (ev.release_id() != 0) {
          internal::MarkPhase("release.acknowledging");
          req.set_release_id(ev.release_id());
          v1::AcknowledgeResponse resp;
          absl::Status s = client->CallOn(*c, &v1::Kvd::Stub::Acknowledge, req, &resp);
          if (!s.ok()) {
            Lose(absl::Status(s.code(), absl::StrCat("acknowledging release ", ev.release_id(), ": ", s.message())));
            break;
          }
        }
        if (options.on_release) options.on_release(committed);
        break;
      }
      case v1::EVENT_TYPE_PAUSE:
        OnPause(ev);
        break;
      case v1::EVENT_TYPE_RESUME:
        OnResume(ev);
        break;
      case v1::EVENT_TYPE_POOL_DELETED: {
        bool paused = false;
        {
          absl::MutexLock lock(&mu);
          paused = !pauses.empty();
        }
        // Not forced: this Mapping's own session deleted it, or a pause holds the engine.
        Lose(absl::NotFoundError(absl::StrCat(
                 "pool ", pool, " was deleted",
                 ev.forced() ? " by force: this Mapping, not pausable, keeps its chunks mapped until it is closed"
                             : "")),
             /*engine_done=*/!ev.forced() || paused, /*forced=*/ev.forced());
        break;
      }
      case v1::EVENT_TYPE_DAEMON_STOPPING:
        Lose(absl::UnavailableError("kvd is stopping"));
        break;
      case v1::EVENT_TYPE_DAEMON_RESTARTING:
        restarting = true;
        break;
      case v1::EVENT_TYPE_RECLAIM:
        OnReclaim(ev);
        break;
      default:
        break;
    }
  }
  Conn c;
  {
    absl::MutexLock lock(&mu);
    if (restarting && watch_ctx != nullptr) watch_ctx->TryCancel();  // the daemon closes it anyway
    c = conn;
  }
  absl::Status finished = FromGrpc(reader.Finish());
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return std::nullopt;
  }
  const bool reconnect = client->options.reconnect_for > absl::ZeroDuration();
  restart_announced = restarting;
  if (restarting) {
    if (reconnect) return absl::UnavailableError("kvd is restarting");
    Lose(absl::UnavailableError("kvd is restarting and this client does not reconnect (reconnect_for = 0)"));
    return std::nullopt;
  }
  // A crash: the stream broke and the daemon closed the session with it.
  if (reconnect && !finished.ok() && (absl::IsUnavailable(finished) || !c->session.Alive())) return finished;
  Lose(finished.ok() ? absl::UnavailableError(absl::StrCat("the event stream of pool ", pool, " ended"))
                     : absl::Status(finished.code(),
                                    absl::StrCat("the event stream of pool ", pool, " broke: ", finished.message())));
  return std::nullopt;
}

void Mapping::Impl::Follow(std::unique_ptr<Reader> reader) {
  while (reader != nullptr) {
    std::optional<absl::Status> restarted = FollowStream(*reader);
    reader.reset();
    if (!restarted.has_value()) return;
    reader = Reattach(*restarted);
  }
}

std::unique_ptr<Mapping::Impl::Reader> Mapping::Impl::Reattach(const absl::Status& why) {
  const absl::Duration limit = client->options.reconnect_for;
  const absl::Time give_up = absl::Now() + limit;
  absl::Duration delay = absl::Milliseconds(50);
  absl::Status last = why;
  DaemonRestart restart;
  while (true) {
    {
      absl::MutexLock lock(&mu);
      if (closing || state == Mapping::State::kLost) return nullptr;
    }
    Attempt attempt = TryReattach(&restart);
    if (attempt.reader != nullptr) {
      for (bool applied : attempt.resumed) {
        if (options.on_resume) options.on_resume(applied);
      }
      if (options.on_restart) options.on_restart(restart);
      return std::move(attempt.reader);
    }
    if (attempt.fatal) {
      Lose(attempt.status);
      return nullptr;
    }
    last = attempt.status;
    if (absl::Now() + delay > give_up) {
      Lose(absl::UnavailableError(absl::StrCat("kvd at ", client->options.socket, " did not take pool ", pool,
                                               " back within ", absl::ToDoubleSeconds(limit), "s", ": ",
                                               last.message())));
      return nullptr;
    }
    {
      absl::MutexLock lock(&mu);
      mu.AwaitWithTimeout(absl::Condition(&closing), delay);
    }
    delay = std::min(delay * 2, absl::Seconds(2));
  }
}

namespace {

// Whether a pool found after a restart places every byte where `mapped` does.
bool SameGeometry(const Geometry& found, const Geometry& mapped) {
  const PoolDims &a = found.dims, &b = mapped.dims;
  return found.layout == mapped.layout && a.layers == b.layers && a.capacity_blocks == b.capacity_blocks &&
         a.heads == b.heads && a.block_tokens == b.block_tokens && a.channels == b.channels &&
         a.element_bytes == b.element_bytes && found.offset == mapped.offset &&
         found.segment_stride == mapped.segment_stride && found.segments == mapped.segments &&
         found.reserved_bytes == mapped.reserved_bytes;
}

}  // namespace

Mapping::Impl::Attempt Mapping::Impl::TryReattach(DaemonRestart* restart) {
  Conn old;
  {
    absl::MutexLock lock(&mu);
    old = conn;
  }
  absl::StatusOr<Conn> live = client->Live();
  if (!live.ok()) return {.status = live.status()};
  const Conn c = *live;
  // The daemon says RESTARTING before it exits: attach to the one that comes next, not to this one.
  if (restart_announced && c == old)
    return {.status = absl::UnavailableError(absl::StrCat("kvd at ", client->options.socket, " is still stopping"))};

  v1::GetPoolRequest get;
  get.set_name(pool);
  v1::Pool now;
  if (absl::Status s = client->CallOn(*c, &v1::Kvd::Stub::GetPool, get, &now); !s.ok()) {
    if (!absl::IsNotFound(s)) return {.status = s};
    return {.status = absl::NotFoundError(absl::StrCat("pool ", pool, " did not survive the restart of kvd at ",
                                                       client->options.socket, ": ", s.message())),
            .fatal = true};
  }
  // A pool restored without its memory waits for its clients to hand the chunks back.
  if (now.state() == v1::POOL_STATE_RECOVERING && now.missing_chunk_ids_size() > 0) {
    std::vector<std::pair<uint64_t, int>> mine;
    std::vector<UniqueFd> dups;  // the Mapping's own FDs stay its own: a concurrent unmap closes them
    {
      absl::MutexLock lock(&mu);
      for (uint64_t id : now.missing_chunk_ids()) {
        auto it = chunks.find(id);
        if (it == chunks.end()) continue;
        UniqueFd dup = NewFd(it->second);
        if (!dup) continue;
        mine.emplace_back(id, dup.get());
        dups.push_back(std::move(dup));
      }
    }
    if (!mine.empty()) {
      absl::StatusOr<HandleSession::Returned> returned = c->session.ReturnHandles(pool, mine);
      if (returned.ok()) {
        restart->returned_chunk_ids.insert(restart->returned_chunk_ids.end(), returned->adopted_chunk_ids.begin(),
                                           returned->adopted_chunk_ids.end());
      } else if (absl::IsUnavailable(returned.status()) || absl::IsDeadlineExceeded(returned.status())) {
        return {.status = returned.status()};
      }
      // Otherwise (the daemon found that the pieces do not agree, or the pool no longer waits for
      // them) nothing was adopted: whatever the daemon lacks shows as lost below.
    }
  }

  v1::AttachRequest req;
  req.set_pool(pool);
  req.set_client_name(options.client_name);
  req.set_device_uuid(peer_uuid);
  req.set_pausable(options.on_pause != nullptr);
  v1::AttachResponse resp;
  if (absl::Status s = client->CallOn(*c, &v1::Kvd::Stub::Attach, req, &resp); !s.ok()) {
    // UNAVAILABLE: still RECOVERING, waiting for other clients' chunks or for its grace to pass.
    if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) return {.status = s};
    return {.status = absl::Status(s.code(),
                                   absl::StrCat("attaching pool ", pool, " again after kvd restarted: ", s.message())),
            .fatal = true};
  }
  absl::Cleanup detach = [&] {
    v1::DetachRequest d;
    d.set_pool(pool);
    d.set_client_id(resp.client_id());
    v1::DetachResponse r;
    client->CallOn(*c, &v1::Kvd::Stub::Detach, d, &r).IgnoreError();  // best effort
  };
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata(wire::kSessionMetadataKey, c->session.token());
  v1::WatchRequest watch;
  watch.set_client_id(resp.client_id());
  std::unique_ptr<Reader> reader = c->stub->Watch(ctx.get(), watch);
  absl::Cleanup stop_watch = [&] {
    ctx->TryCancel();
    reader->Finish().ok();  // cancelled: the status says so
  };
  if (!SameGeometry(FromProto(resp.pool().geometry()), geometry)) {
    return {.status = absl::FailedPreconditionError(
                absl::StrCat("pool ", pool, " has another geometry since kvd restarted (it was created again)")),
            .fatal = true};
  }
  // Chunk ids are the daemon's: only a daemon that restored its saved state (epoch 2 and up) has the
  // same chunks under the same ids. A fresh one (epoch 1) may have made a pool of the same name since.
  const bool restored = resp.pool().epoch() > 1;
  std::vector<bool> resumed;
  // Keep what the daemon still has exactly as it was; unmap what it lost; map what it added. A pausable
  // Mapping unmaps what the daemon lost only with the engine paused for it (Note [Releases pause first] in
  // docs/architecture.md), and resumes it once remapped.
  std::vector<uint64_t> gone;
  std::vector<ByteRange> gone_ranges;
  bool paused_before = false;
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return {.status = absl::CancelledError("closing"), .fatal = true};
    std::set<uint64_t> kept;
    for (const v1::Chunk& theirs : resp.pool().chunks()) {
      if (!restored) break;
      auto it = chunks.find(theirs.id());
      if (it != chunks.end() && it->second.info.segment == theirs.segment() &&
          it->second.info.offset == theirs.offset() && it->second.info.bytes == theirs.bytes()) {
        kept.insert(theirs.id());
      }
    }
    for (const auto& [id, m] : chunks) {
      if (kept.contains(id)) continue;
      gone.push_back(id);
      gone_ranges.push_back({m.info.segment, m.info.offset, m.info.bytes});
    }
    paused_before = !pauses.empty() || paused_for_restart;
  }
  // Not pausable: the chunks go as they are (the daemon no longer counts their memory, so keeping them
  // would let it promise that memory twice).
  if (!gone.empty() && !paused_before && options.on_pause) {
    options.on_pause(Merged(std::move(gone_ranges)));
    absl::MutexLock lock(&mu);
    paused_for_restart = true;
  }
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return {.status = absl::CancelledError("closing"), .fatal = true};
    for (uint64_t id : gone) {
      restart->lost_chunk_ids.push_back(id);
      restart->lost_bytes += chunks[id].info.bytes;
      UnmapOne(id);
    }
    // A pause does not outlive the daemon that began it: its imported chunks go, and the new daemon's
    // chunk table says whether the change was made.
    std::vector<std::vector<uint64_t>> paused;
    for (auto& [pause_id, pause] : pauses) {
      paused.emplace_back();
      for (const Imported& i : pause.chunks) paused.back().push_back(i.info.id);
      DropPause(pause);
    }
    pauses.clear();
    called_off.clear();  // their RESUMEs went with the daemon
    if (absl::Status s = MapLease(*c, resp.lease().token(), resp.pool().chunks()).status(); !s.ok()) {
      return {
          .status = absl::Status(s.code(), absl::StrCat("mapping pool ", pool, " after kvd restarted: ", s.message())),
          .fatal = true};
    }
    for (const std::vector<uint64_t>& ids : paused) {
      bool applied = !ids.empty();
      for (uint64_t id : ids) applied &= chunks.contains(id);
      resumed.push_back(applied);
    }
    if (paused_for_restart) resumed.push_back(true);  // on_resume(true) once it follows the restarted daemon
    paused_for_restart = false;
    committed_blocks = resp.pool().committed_blocks();
    state = resp.pool().state() == v1::POOL_STATE_SLEEPING ? Mapping::State::kSleeping : Mapping::State::kAwake;
    conn = c;
    client_id = resp.client_id();
    epoch = resp.pool().epoch();
    watch_ctx = std::move(ctx);
    restart->epoch = epoch;
    restart->committed_blocks = committed_blocks;
  }
  // kvd sends the initial metadata once the watch is registered (events since the Attach are queued).
  reader->WaitForInitialMetadata();
  std::move(stop_watch).Cancel();
  std::move(detach).Cancel();
  return {.reader = std::move(reader), .resumed = std::move(resumed)};
}

void Mapping::Impl::OnReclaim(const v1::PoolEvent& ev) {
  if (!options.on_reclaim) return;  // the pool's policy applies at the deadline
  ReclaimRequest request{.pool = pool,
                         .reclaim_id = ev.reclaim_id(),
                         .bytes = ev.reclaim_bytes(),
                         .deadline = absl::FromUnixMillis(static_cast<int64_t>(ev.reclaim_deadline_unix_ms())),
                         .committed_blocks = ev.committed_blocks()};
  absl::MutexLock lock(&mu);
  if (closing || reclaims_closed || state == Mapping::State::kLost) return;
  const uint64_t now_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  std::erase_if(reclaims_seen, [now_ms](const auto& seen) { return seen.second < now_ms; });
  if (!reclaims_seen.emplace(ev.reclaim_id(), ev.reclaim_deadline_unix_ms()).second) return;
  reclaimers.emplace_back([this, request = std::move(request)] {
    const absl::Status answered = options.on_reclaim(request);
    if (answered.ok()) return;
    Conn c;
    {
      absl::MutexLock relock(&mu);
      c = conn;
    }
    v1::DeclineReclaimRequest req;
    req.set_pool(pool);
    req.set_reclaim_id(request.reclaim_id);
    req.set_reason(std::string(answered.message()));
    v1::DeclineReclaimResponse resp;
    client->CallOn(*c, &v1::Kvd::Stub::DeclineReclaim, req, &resp).IgnoreError();  // too late: the policy applies
  });
}

void Mapping::Impl::Shutdown() {
  Conn c;
  v1::DetachRequest req;
  // A reclaim hook under way may be shrinking the pool, which needs the follower: it ends first.
  std::vector<std::thread> hooks;
  {
    absl::MutexLock lock(&mu);
    reclaims_closed = true;
    hooks.swap(reclaimers);
  }
  for (std::thread& t : hooks) t.join();
  {
    absl::MutexLock lock(&mu);
    closing = true;
    c = conn;
    req.set_pool(pool);
    req.set_client_id(client_id);
  }
  {
    absl::MutexLock lock(&client->mu);
    auto it = client->mappings.find(pool);
    if (it != client->mappings.end() && it->second.lock().get() == this) client->mappings.erase(it);
  }
  // The follower stops first, then every chunk is unmapped and its FD closed, and only then does the
  // client detach, saying so (DetachRequest.released): the daemon gives back what it held at once
  // instead of holding it until the session ends.
  {
    absl::MutexLock lock(&mu);
    if (watch_ctx != nullptr) watch_ctx->TryCancel();
  }
  if (follower.joinable()) follower.join();
  {
    absl::MutexLock lock(&mu);
    UnmapAll();
    device->Free(base, geometry.reserved_bytes).IgnoreError();
  }
  req.set_released(true);
  v1::DetachResponse resp;
  client->CallOn(*c, &v1::Kvd::Stub::Detach, req, &resp, std::min(client->options.timeout, absl::Seconds(5)))
      .IgnoreError();  // the client may already be gone (pool deleted, daemon gone)
}

std::shared_ptr<Mapping::Impl> Client::Impl::FindMapping(const std::string& pool) {
  absl::MutexLock lock(&mu);
  auto it = mappings.find(pool);
  return it == mappings.end() ? nullptr : it->second.lock();
}

absl::Status Client::Impl::Route(const v1::PoolUpdate& update) {
  if (update.lease().token().empty() || update.added().empty()) return absl::OkStatus();
  std::shared_ptr<Mapping::Impl> m = FindMapping(update.pool().name());
  if (m == nullptr) return absl::OkStatus();
  absl::Status s = m->ApplyUpdate(update);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("pool ", update.pool().name(),
                                               " changed but mapping its new chunks failed: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::AwaitRemap(const v1::PoolUpdate& update, absl::Duration timeout) {
  if (update.added().empty()) return absl::OkStatus();
  std::shared_ptr<Mapping::Impl> m = FindMapping(update.pool().name());
  if (m == nullptr) return absl::OkStatus();
  std::set<uint64_t> added;
  for (const v1::Chunk& c : update.added()) added.insert(c.id());
  Mapping::Impl* raw = m.get();
  auto settled = [raw, &added]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (raw->closing || raw->state == Mapping::State::kLost) return true;
    for (const auto& [pause_id, pause] : raw->pauses) {
      for (const Mapping::Impl::Imported& i : pause.chunks) {
        if (added.contains(i.info.id)) return false;
      }
    }
    return true;
  };
  absl::MutexLock lock(&m->mu);
  if (m->mu.AwaitWithTimeout(absl::Condition(&settled), timeout)) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("pool ", update.pool().name(),
                                                  " changed but this client's Mapping of it did not remap within ",
                                                  absl::FormatDuration(timeout)));
}

// ---------------------------------------------------------------------------------------------
// Mapping

Mapping::~Mapping() { impl_->Shutdown(); }

void* Mapping::base() const { return reinterpret_cast<void*>(impl_->base); }
const std::string& Mapping::pool() const { return impl_->pool; }
std::string Mapping::client_id() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->client_id;
}
uint64_t Mapping::epoch() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->epoch;
}
const Geometry& Mapping::geometry() const { return impl_->geometry; }
const LayoutResolution& Mapping::layout() const { return impl_->layout; }

LayerView Mapping::layer(uint64_t l) const {
  const Geometry& g = impl_->geometry;
  if (l >= g.dims.layers) return LayerView{};
  return LayerView{.data = reinterpret_cast<void*>(impl_->base + g.offset + l * g.layer_stride),
                   .stride_b = g.stride_b,
                   .stride_h = g.stride_h,
                   .stride_n = g.stride_n,
                   .stride_c = g.stride_c,
                   .dims = g.dims};
}

uint64_t Mapping::committed_blocks() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->committed_blocks;
}

Mapping::State Mapping::state() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->state;
}

Mapping::State Mapping::pool_state() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->state == State::kLost ? impl_->pool_state_when_lost : impl_->state;
}

const Mapping::MappedDevice& Mapping::device() const { return impl_->mapped_device; }

Mapping::Counts Mapping::counts() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->counts;
}

std::vector<ChunkInfo> Mapping::chunks() const {
  absl::MutexLock lock(&impl_->mu);
  std::vector<ChunkInfo> out;
  for (const auto& [id, m] : impl_->chunks) out.push_back(m.info);
  std::sort(out.begin(), out.end(), [](const ChunkInfo& a, const ChunkInfo& b) { return a.offset < b.offset; });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Client

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ConnectOptions options) {
  if (options.socket.empty()) options.socket = wire::SocketFromEnvironment(options.device);
  if (options.client_name.empty()) options.client_name = "libkvd";
  // A Mapping keeps one FD per mapped chunk (to hand it back after a daemon restart).
  static const bool raised = (RaiseOpenFileLimit(), true);
  (void)raised;
  KVD_ASSIGN_OR_RETURN(Impl::Conn conn, Impl::Open(options));
  return std::unique_ptr<Client>(new Client(std::make_shared<Impl>(std::move(options), std::move(conn))));
}

Client::~Client() = default;

const std::string& Client::socket() const { return impl_->options.socket; }

absl::StatusOr<DeviceStatus> Client::DeviceInfo() {
  v1::DeviceInfo i;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::GetDeviceInfo, v1::GetDeviceInfoRequest(), &i));
  impl_->Observe(i);
  DeviceStatus out{.backend = BackendString(i.backend()),
                   .device_index = i.device_index(),
                   .name = i.device_name(),
                   .uuid = i.device_uuid(),
                   .driver_version = i.driver_version(),
                   .daemon_version = i.daemon_version(),
                   .total_bytes = i.total_bytes(),
                   .free_bytes = i.free_bytes(),
                   .committed_bytes = i.committed_bytes(),
                   .budget_bytes = i.budget_bytes(),
                   .reserved_bytes = i.reserved_bytes(),
                   .granularity_bytes = i.granularity_bytes(),
                   .max_chunk_bytes = i.max_chunk_bytes(),
                   .pool_count = i.pool_count(),
                   .epoch = i.epoch(),
                   .started_at_unix_ms = i.started_at_unix_ms()};
  out.durability = absl::AsciiStrToLower(absl::StripPrefix(v1::Durability_Name(i.durability()), "DURABILITY_"));
  out.state_degraded = i.state_degraded();
  out.state_error = i.state_error();
  out.state_save_failures = i.state_save_failures();
  for (int t : i.handle_types()) {
    std::string name = v1::HandleType_Name(static_cast<v1::HandleType>(t));
    out.handle_types.push_back(absl::AsciiStrToLower(absl::StripPrefix(name, "HANDLE_TYPE_")));
  }
  const v1::Capabilities& c = i.capabilities();
  auto item = [](const v1::Capability& in) { return CapabilityReport::Item{in.supported(), in.detail()}; };
  out.capabilities.posix_fd = item(c.posix_fd());
  out.capabilities.fabric = item(c.fabric());
  out.capabilities.dma_buf = item(c.dma_buf());
  out.capabilities.gpu_direct_rdma_vmm = item(c.gpu_direct_rdma_vmm());
  out.capabilities.range_spans_chunks = c.range_spans_chunks();
  out.headroom_bytes = i.headroom_bytes();
  out.foreign_bytes = i.foreign_bytes();
  out.available_bytes = i.available_bytes();
  out.waiting_requests = i.waiting_requests();
  out.waiting_bytes = i.waiting_bytes();
  out.driver_out_of_memory = i.driver_out_of_memory();
  out.host_tier_bytes = i.host_tier_bytes();
  out.host_tier_used_bytes = i.host_tier_used_bytes();
  out.host_tier_ready = i.host_tier_ready();
  for (const v1::PeerAccess& p : c.peers()) {
    out.capabilities.peers.push_back({p.device_index(), p.device_uuid(), p.access(), p.detail()});
  }
  out.capabilities.granularity_bytes = c.granularity_bytes();
  out.capabilities.max_chunk_bytes = c.max_chunk_bytes();
  return out;
}

absl::StatusOr<std::vector<PoolInfo>> Client::ListPools() {
  // Every page, in order (ListPools is paginated: kvd.proto, docs/api.md).
  std::vector<PoolInfo> out;
  v1::ListPoolsRequest req;
  do {
    v1::ListPoolsResponse resp;
    KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::ListPools, req, &resp));
    impl_->Observe(resp);
    for (const v1::Pool& p : resp.pools()) out.push_back(FromProto(p));
    req.set_page_token(resp.next_page_token());
  } while (!req.page_token().empty());
  return out;
}

absl::StatusOr<PoolInfo> Client::GetPool(absl::string_view name) {
  v1::GetPoolRequest req;
  req.set_name(std::string(name));
  v1::Pool pool;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::GetPool, req, &pool));
  impl_->Observe(pool);
  return FromProto(pool);
}

absl::StatusOr<PoolInfo> Client::CreatePool(const PoolOptions& options) {
  v1::CreatePoolRequest req;
  req.set_name(options.name);
  ToProto(options.dims, req.mutable_dims());
  req.set_initial_blocks(options.initial_blocks);
  ToProto(options.layout, req.mutable_layout_request());
  for (uint32_t uid : options.allowed_uids) req.add_allowed_uids(uid);
  if (!options.group.name.empty() || options.group.size != 0 || options.group.rank != 0) {
    req.mutable_group()->set_name(options.group.name);
    req.mutable_group()->set_rank(options.group.rank);
    req.mutable_group()->set_size(options.group.size);
  }
  for (const std::string& d : options.peer_devices) req.add_peer_devices(d);
  v1::PoolPolicy* policy = req.mutable_policy();
  policy->set_priority(options.policy.priority);
  policy->set_min_bytes(options.policy.min_bytes);
  policy->set_max_bytes(options.policy.max_bytes);
  policy->set_reclaim_timeout_ms(CeilMillis(options.policy.reclaim_timeout));
  policy->set_on_reclaim_timeout(ToProto(options.policy.on_reclaim_timeout));
  v1::Pool pool;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::CreatePool, req, &pool));
  impl_->Observe(pool);
  return FromProto(pool);
}

absl::StatusOr<ResolvedLayout> Client::ResolveLayout(const LayoutRequest& request, const PoolDims* dims) {
  v1::ResolveLayoutRequest req;
  ToProto(request, req.mutable_layout_request());
  if (dims != nullptr) ToProto(*dims, req.mutable_dims());
  v1::ResolveLayoutResponse resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::ResolveLayout, req, &resp));
  impl_->Observe(resp);
  return ResolvedLayout{.resolution = FromProto(resp.resolution()),
                        .has_geometry = resp.has_geometry(),
                        .geometry = FromProto(resp.geometry())};
}

absl::StatusOr<PoolChange> Client::Grow(absl::string_view pool, uint64_t target_blocks) {
  return Grow(pool, target_blocks, WaitOptions{});
}

absl::StatusOr<PoolChange> Client::Grow(absl::string_view pool, uint64_t target_blocks, const WaitOptions& wait) {
  v1::GrowRequest req;
  req.set_pool(std::string(pool));
  req.set_target_blocks(target_blocks);
  req.set_wait(wait.wait);
  v1::PoolUpdate update;
  // A waiting grow's deadline is how long it waits: the daemon answers a little before it.
  const absl::Duration timeout =
      wait.wait && wait.wait_for > absl::ZeroDuration() ? wait.wait_for : impl_->options.timeout;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::Grow, req, &update, timeout));
  impl_->Observe(update);
  KVD_RETURN_IF_ERROR(impl_->Route(update));
  return FromProto(update);
}

namespace {
absl::Duration WaitTimeout(absl::Duration timeout, bool wait) {
  return wait ? std::max(timeout, absl::Seconds(65)) : timeout;
}

// The deadline of a change that may pause the attached clients: the daemon waits up to the pause timeout
// for the PAUSE acknowledgements and again for the RESUME ones, then copies.
absl::Duration PauseTimeout(absl::Duration timeout, const PauseOptions& pause) {
  return std::max(WaitTimeout(timeout, true), 2 * pause.timeout + absl::Seconds(65));
}

// A Compact or an exact Shrink goes in as many steps as the chunks per pause and the free memory make, a
// pause each: 10 minutes at least.
absl::Duration StepsTimeout(absl::Duration timeout, const PauseOptions& pause) {
  return std::max(PauseTimeout(timeout, pause), absl::Minutes(10));
}
}  // namespace

absl::StatusOr<PoolChange> Client::Shrink(absl::string_view pool, uint64_t target_blocks, bool wait) {
  return Shrink(pool, target_blocks, ShrinkOptions{.wait = wait});
}

absl::StatusOr<PoolChange> Client::Shrink(absl::string_view pool, uint64_t target_blocks,
                                          const ShrinkOptions& options) {
  v1::ShrinkRequest req;
  req.set_pool(std::string(pool));
  req.set_target_blocks(target_blocks);
  req.set_wait_for_release(options.wait);
  req.set_whole_chunks_only(options.whole_chunks_only);
  if (options.live_blocks.has_value()) {
    req.mutable_live()->mutable_blocks()->Add(options.live_blocks->begin(), options.live_blocks->end());
  }
  ToProto(options.pause, req.mutable_pause());
  req.set_force(options.force);
  // Every shrink may pause the clients of other sessions (docs/api.md, "Releases and running engines"); one
  // that moves bytes may go in steps.
  const absl::Duration timeout = options.whole_chunks_only ? PauseTimeout(impl_->options.timeout, options.pause)
                                                           : StepsTimeout(impl_->options.timeout, options.pause);
  v1::PoolUpdate update;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::Shrink, req, &update, timeout));
  impl_->Observe(update);
  KVD_RETURN_IF_ERROR(impl_->AwaitRemap(update, timeout));
  return FromProto(update);
}

absl::StatusOr<PoolChange> Client::Compact(absl::string_view pool, const CompactOptions& options) {
  v1::CompactRequest req;
  req.set_pool(std::string(pool));
  ToProto(options.pause, req.mutable_pause());
  req.set_max_chunks_per_pause(options.max_chunks_per_pause);
  const absl::Duration timeout = StepsTimeout(impl_->options.timeout, options.pause);
  v1::PoolUpdate update;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::Compact, req, &update, timeout));
  impl_->Observe(update);
  KVD_RETURN_IF_ERROR(impl_->AwaitRemap(update, timeout));
  return FromProto(update);
}

absl::StatusOr<std::vector<PoolChange>> Client::Sleep(absl::string_view pool, bool wait) {
  return Sleep(pool, SleepOptions{.wait = wait});
}

absl::StatusOr<std::vector<PoolChange>> Client::Sleep(absl::string_view pool, const SleepOptions& options) {
  v1::SleepRequest req;
  if (pool.empty()) {
    req.set_all(true);
  } else {
    req.set_pool(std::string(pool));
  }
  req.set_wait_for_release(options.wait);
  req.set_force(options.force);
  ToProto(options.pause, req.mutable_pause());
  req.set_keep(options.keep);
  for (uint64_t b : options.live_blocks) req.add_live_blocks(b);
  v1::PoolUpdates updates;
  KVD_RETURN_IF_ERROR(
      impl_->Call(&v1::Kvd::Stub::Sleep, req, &updates, PauseTimeout(impl_->options.timeout, options.pause)));
  impl_->Observe(updates);
  std::vector<PoolChange> out;
  for (const v1::PoolUpdate& u : updates.updates()) out.push_back(FromProto(u));
  return out;
}

absl::StatusOr<std::vector<PoolChange>> Client::Wake(absl::string_view pool) { return Wake(pool, WaitOptions{}); }

absl::StatusOr<std::vector<PoolChange>> Client::Wake(absl::string_view pool, const WaitOptions& wait) {
  v1::WakeRequest req;
  if (pool.empty()) {
    req.set_all(true);
  } else {
    req.set_pool(std::string(pool));
  }
  req.set_wait(wait.wait);
  v1::PoolUpdates updates;
  const absl::Duration timeout =
      wait.wait && wait.wait_for > absl::ZeroDuration() ? wait.wait_for : impl_->options.timeout;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::Wake, req, &updates, timeout));
  impl_->Observe(updates);
  std::vector<PoolChange> out;
  absl::Status first_error;
  for (const v1::PoolUpdate& u : updates.updates()) {
    absl::Status s = impl_->Route(u);
    if (first_error.ok()) first_error = s;
    out.push_back(FromProto(u));
  }
  KVD_RETURN_IF_ERROR(first_error);
  return out;
}

absl::StatusOr<uint64_t> Client::DeletePool(absl::string_view name, bool force, const PauseOptions& pause) {
  v1::DeletePoolRequest req;
  req.set_name(std::string(name));
  req.set_force(force);
  ToProto(pause, req.mutable_pause());
  v1::DeletePoolResponse resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::DeletePool, req, &resp,
                                  force ? PauseTimeout(impl_->options.timeout, pause) : impl_->options.timeout));
  impl_->Observe(resp);
  return resp.released_bytes();
}

namespace {
absl::Status AlreadyAttached(const std::string& pool) {
  return absl::AlreadyExistsError(
      absl::StrCat("pool ", pool, " is already attached by this client; use its Mapping or connect another client"));
}
}  // namespace

absl::StatusOr<std::unique_ptr<Mapping>> Client::Attach(absl::string_view pool, AttachOptions options) {
  const std::string name(pool);
  if (impl_->FindMapping(name) != nullptr) {
    return AlreadyAttached(name);
  }
  internal::MarkPhase("attach.begin");
  KVD_ASSIGN_OR_RETURN(Impl::LocalDevice local, impl_->GetDevice(options.device));
  Device* device = local.device;
  internal::MarkPhase("attach.device");

  KVD_ASSIGN_OR_RETURN(const Impl::Conn conn, impl_->Live());
  v1::AttachRequest req;
  req.set_pool(name);
  req.set_client_name(options.client_name);
  req.set_device_uuid(local.peer_uuid);
  req.set_pausable(options.on_pause != nullptr);
  // The daemon pushes the lease's FDs on the session's connection before it replies (docs/api.md, "Pushed
  // handles"): one attach of this Client at a time reads them there.
  req.set_push_handles(true);
  v1::AttachResponse resp;
  std::optional<HandleSession::LeasedFds> pushed;
  absl::Status taken;  // a push that cannot be read: answered once the client is detached again (below)
  {
    absl::MutexLock one_push(&impl_->push_mu);
    KVD_RETURN_IF_ERROR(impl_->CallOn(*conn, &v1::Kvd::Stub::Attach, req, &resp));
    if (resp.handles_pushed()) {
      absl::StatusOr<HandleSession::LeasedFds> take = conn->session.TakePushed(resp.lease().token());
      if (take.ok()) {
        pushed = *std::move(take);
      } else {
        taken = take.status();
      }
    }
  }
  absl::Cleanup close_pushed = [&pushed] {
    if (pushed.has_value()) CloseLeased(*pushed);
  };
  impl_->Observe(resp);
  internal::MarkPhase("attach.rpc");

  auto m = std::make_shared<Mapping::Impl>();
  m->client = impl_;
  m->device = device;
  m->mapped_device = {.backend = BackendName(local.backend), .index = local.index, .uuid = local.uuid};
  m->keep_fds = local.backend != BackendKind::kHost;
  m->peer_uuid = local.peer_uuid;
  m->pool = name;
  m->geometry = FromProto(resp.pool().geometry());
  m->layout = FromProto(resp.pool().layout());
  m->options = std::move(options);
  absl::Cleanup detach = [&] {
    v1::DetachRequest d;
    d.set_pool(name);
    d.set_client_id(resp.client_id());
    v1::DetachResponse r;
    impl_->CallOn(*conn, &v1::Kvd::Stub::Detach, d, &r).IgnoreError();  // best effort: the session's end detaches too
  };
  KVD_RETURN_IF_ERROR(taken);
  // The event stream starts now and is confirmed after the import (WaitForInitialMetadata below), so its
  // round trip overlaps the import instead of following it. Events since the Attach are queued in the
  // daemon either way, and the follower reads them only once the lease is mapped.
  auto watch_ctx = std::make_unique<grpc::ClientContext>();
  watch_ctx->AddMetadata(wire::kSessionMetadataKey, conn->session.token());
  v1::WatchRequest watch;
  watch.set_client_id(resp.client_id());
  std::unique_ptr<grpc::ClientReader<v1::PoolEvent>> reader = conn->stub->Watch(watch_ctx.get(), watch);
  grpc::ClientContext* const ctx = watch_ctx.get();
  absl::Cleanup stop_watch = [&] {
    ctx->TryCancel();
    reader->Finish().ok();  // cancelled: the status says so
  };
  {
    absl::MutexLock lock(&m->mu);
    m->conn = conn;
    m->client_id = resp.client_id();
    m->epoch = resp.pool().epoch();
    m->watch_ctx = std::move(watch_ctx);
  }
  KVD_ASSIGN_OR_RETURN(m->base, device->Reserve(m->geometry.reserved_bytes));
  absl::Cleanup free_va = [&] {
    absl::MutexLock lock(&m->mu);
    m->UnmapAll();
    device->Free(m->base, m->geometry.reserved_bytes).IgnoreError();
  };
  {
    absl::MutexLock lock(&m->mu);
    std::move(close_pushed).Cancel();
    KVD_RETURN_IF_ERROR(m->MapLease(*conn, resp.lease().token(), resp.pool().chunks(), std::move(pushed)).status());
    m->committed_blocks = resp.pool().committed_blocks();
    m->state = resp.pool().state() == v1::POOL_STATE_SLEEPING ? Mapping::State::kSleeping : Mapping::State::kAwake;
  }
  internal::MarkPhase("attach.mapped");
  // kvd sends the initial metadata once the watch is registered: from here on every event reaches the
  // follower. A stream that failed instead returns here too, and the follower reports it (on_lost).
  reader->WaitForInitialMetadata();
  internal::MarkPhase("attach.watching");
  {
    absl::MutexLock lock(&impl_->mu);
    auto& slot = impl_->mappings[name];
    if (slot.lock() != nullptr) return AlreadyAttached(name);  // stop_watch ends the stream
    slot = m;
  }
  std::move(stop_watch).Cancel();
  Mapping::Impl* raw = m.get();
  m->follower = std::thread([raw, r = std::move(reader)]() mutable { raw->Follow(std::move(r)); });
  std::move(detach).Cancel();
  std::move(free_va).Cancel();
  return std::unique_ptr<Mapping>(new Mapping(std::move(m)));
}

absl::StatusOr<PoolInfo> Client::GrantPeerAccess(absl::string_view pool, absl::string_view device_uuid, bool revoke) {
  v1::GrantPeerAccessRequest req;
  req.set_pool(std::string(pool));
  req.set_device_uuid(std::string(device_uuid));
  req.set_revoke(revoke);
  v1::Pool resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::GrantPeerAccess, req, &resp));
  impl_->Observe(resp);
  return FromProto(resp);
}

namespace {

PoolMetadata FromProto(const v1::PoolMetadata& p) {
  return {.pool = p.pool(),
          .version = p.version(),
          .data = p.data(),
          .updated_at = absl::FromUnixMillis(static_cast<int64_t>(p.updated_at_unix_ms()))};
}

}  // namespace

absl::StatusOr<PoolMetadata> Client::GetPoolMetadata(absl::string_view pool) {
  v1::GetPoolMetadataRequest req;
  req.set_pool(std::string(pool));
  v1::PoolMetadata resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::GetPoolMetadata, req, &resp));
  impl_->Observe(resp);
  return FromProto(resp);
}

absl::StatusOr<PoolMetadata> Client::SetPoolMetadata(absl::string_view pool, uint64_t expected_version,
                                                     std::string data) {
  v1::SetPoolMetadataRequest req;
  req.set_pool(std::string(pool));
  req.set_expected_version(expected_version);
  req.set_data(std::move(data));
  v1::PoolMetadata resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::SetPoolMetadata, req, &resp));
  impl_->Observe(resp);
  return FromProto(resp);
}

const char* ReclaimActionName(ReclaimAction action) {
  switch (action) {
    case ReclaimAction::kNone:
      return "none";
    case ReclaimAction::kShrink:
      return "shrink";
    case ReclaimAction::kSleep:
      return "sleep";
  }
  return "none";
}

absl::StatusOr<PoolInfo> Client::SetPoolPolicy(absl::string_view pool, const PolicyChange& change) {
  v1::SetPoolPolicyRequest req;
  req.set_pool(std::string(pool));
  if (change.priority) req.set_priority(*change.priority);
  if (change.min_bytes) req.set_min_bytes(*change.min_bytes);
  if (change.max_bytes) req.set_max_bytes(*change.max_bytes);
  if (change.reclaim_timeout) req.set_reclaim_timeout_ms(CeilMillis(*change.reclaim_timeout));
  if (change.on_reclaim_timeout) req.set_on_reclaim_timeout(ToProto(*change.on_reclaim_timeout));
  v1::Pool resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::SetPoolPolicy, req, &resp));
  impl_->Observe(resp);
  return FromProto(resp);
}

absl::Status Client::ReportUsage(absl::string_view pool, uint64_t live_blocks, uint64_t evictable_blocks,
                                 uint64_t used_blocks) {
  v1::ReportUsageRequest req;
  req.set_pool(std::string(pool));
  req.set_live_blocks(live_blocks);
  req.set_evictable_blocks(evictable_blocks);
  req.set_used_blocks(used_blocks);
  v1::ReportUsageResponse resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::ReportUsage, req, &resp));
  impl_->Observe(resp);
  return absl::OkStatus();
}

absl::Status Client::DeclineReclaim(const ReclaimRequest& request, absl::string_view reason) {
  v1::DeclineReclaimRequest req;
  req.set_pool(request.pool);
  req.set_reclaim_id(request.reclaim_id);
  req.set_reason(std::string(reason));
  v1::DeclineReclaimResponse resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::DeclineReclaim, req, &resp));
  impl_->Observe(resp);
  return absl::OkStatus();
}

absl::StatusOr<PoolChange> Client::ShrinkForReclaim(const ReclaimRequest& request,
                                                    const std::vector<uint64_t>& live_blocks,
                                                    const PauseOptions& pause) {
  KVD_ASSIGN_OR_RETURN(const PoolInfo pool, GetPool(request.pool));
  const Geometry& g = pool.geometry;
  // The committed bytes of `blocks` blocks: every segment's prefix, rounded up to the granularity.
  const auto bytes_of = [&g](uint64_t blocks) {
    const uint64_t gran = std::max<uint64_t>(g.granularity_bytes, 1);
    return g.segments * ((blocks * g.block_stride + gran - 1) / gran * gran);
  };
  const uint64_t now = bytes_of(pool.committed_blocks);
  const uint64_t goal = now > request.bytes ? now - request.bytes : 0;
  // The most blocks whose bytes are within the goal (the fewest that give back at least request.bytes).
  uint64_t lo = 0;
  uint64_t hi = pool.committed_blocks;
  while (lo < hi) {
    const uint64_t mid = hi - (hi - lo) / 2;
    if (bytes_of(mid) <= goal) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  uint64_t target = std::max<uint64_t>(lo, live_blocks.size());
  // A target at a boundary every segment's chunks share releases whole chunks: no new chunk to make (it
  // would need free memory beside the old one, which a full device has not), only the live blocks moved.
  // The highest such boundary between the live blocks and the target, if there is one.
  std::map<uint64_t, uint64_t> ends;  // end of a chunk inside its segment -> segments with it
  for (const ChunkInfo& c : pool.chunks) ++ends[c.offset + c.bytes - g.offset - c.segment * g.segment_stride];
  for (auto it = ends.rbegin(); it != ends.rend(); ++it) {
    if (it->second != g.segments || g.block_stride == 0) continue;
    const uint64_t blocks = it->first / g.block_stride;
    if (blocks > target || blocks < live_blocks.size()) continue;
    if (bytes_of(blocks) == g.segments * it->first && blocks >= live_blocks.size()) {
      target = blocks;
      break;
    }
  }
  if (target >= pool.committed_blocks) {
    return absl::FailedPreconditionError(absl::StrCat("pool ", request.pool, ": its ", live_blocks.size(),
                                                      " live blocks fill its ", pool.committed_blocks,
                                                      " committed blocks: nothing to give back"));
  }
  return Shrink(request.pool, target, ShrinkOptions{.wait = true, .live_blocks = live_blocks, .pause = pause});
}

absl::StatusOr<RangeExport> Client::ExportRanges(const Mapping& mapping, const std::vector<ByteRange>& ranges) {
  return ExportRanges(mapping.client_id(), ranges);
}

absl::StatusOr<RangeExport> Client::ExportRanges(absl::string_view client_id, const std::vector<ByteRange>& ranges) {
  v1::ExportRangesRequest req;
  req.set_client_id(std::string(client_id));
  for (const ByteRange& r : ranges) {
    v1::ByteRange* p = req.add_ranges();
    p->set_segment(r.segment);
    p->set_offset(r.offset);
    p->set_bytes(r.bytes);
  }
  v1::ExportRangesResponse resp;
  KVD_ASSIGN_OR_RETURN(const Impl::Conn conn, impl_->Live());  // the lease is the session's
  KVD_RETURN_IF_ERROR(impl_->CallOn(*conn, &v1::Kvd::Stub::ExportRanges, req, &resp));
  impl_->Observe(resp);
  RangeExport out{
      .pool = resp.pool(), .ranges_span_chunks = resp.ranges_span_chunks(), .generation = resp.generation()};
  for (const v1::RangeHandle& h : resp.handles()) {
    out.handles.push_back({.segment = h.segment(),
                           .offset = h.offset(),
                           .bytes = h.bytes(),
                           .fd_offset = h.fd_offset(),
                           .chunk_ids = {h.chunk_ids().begin(), h.chunk_ids().end()}});
  }
  if (out.handles.empty()) return out;
  KVD_ASSIGN_OR_RETURN(auto fds, conn->session.Fetch(resp.lease().token()));
  bool in_order = fds.size() == out.handles.size();
  for (size_t i = 0; in_order && i < fds.size(); ++i) in_order = fds[i].first == i;
  if (!in_order) {
    for (const auto& f : fds) close(f.second);
    return absl::DataLossError(absl::StrCat("ExportRanges: the handle channel sent ", fds.size(), " FDs for ",
                                            out.handles.size(), " range handles, or out of order"));
  }
  for (size_t i = 0; i < fds.size(); ++i) out.handles[i].fd = fds[i].second;
  return out;
}

absl::StatusOr<TransferPlan> Client::DescribeTransfer(absl::string_view pool, const std::vector<uint64_t>& block_ids) {
  v1::DescribeTransferRequest req;
  req.set_pool(std::string(pool));
  for (uint64_t id : block_ids) req.add_block_ids(id);
  v1::DescribeTransferResponse resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::DescribeTransfer, req, &resp));
  impl_->Observe(resp);
  TransferPlan plan{.blocks = resp.blocks(),
                    .bytes = resp.bytes(),
                    .committed_blocks = resp.committed_blocks(),
                    .generation = resp.generation()};
  for (const v1::TransferDescriptor& d : resp.descriptors()) {
    plan.descriptors.push_back(
        {.segment = d.segment(), .offset = d.offset(), .bytes = d.bytes(), .stride = d.stride(), .count = d.count()});
  }
  return plan;
}

absl::StatusOr<PreparedChange> Client::Prepare(absl::string_view pool, GroupOp op, uint64_t target_blocks,
                                               absl::Duration ttl, bool force, bool keep) {
  v1::PrepareRequest req;
  req.set_force(force);
  req.set_keep(keep);
  req.set_pool(std::string(pool));
  req.set_operation(ToProto(op));
  req.set_target_blocks(target_blocks);
  req.set_ttl_ms(static_cast<uint64_t>(std::max<int64_t>(absl::ToInt64Milliseconds(ttl), 1)));
  v1::PrepareResponse resp;
  // A shrink or sleep waits for the pause acknowledgements of other sessions' clients.
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::Prepare, req, &resp,
                                  op == GroupOp::kShrink || op == GroupOp::kSleep
                                      ? PauseTimeout(impl_->options.timeout, PauseOptions{})
                                      : impl_->options.timeout));
  impl_->Observe(resp);
  return PreparedChange{.transaction = resp.transaction(),
                        .pool = FromProto(resp.pool()),
                        .prepared_bytes = resp.prepared_bytes(),
                        .expires_at_unix_ms = resp.expires_at_unix_ms(),
                        .elapsed_us = resp.elapsed_us()};
}

absl::StatusOr<PoolChange> Client::Commit(absl::string_view transaction, bool wait) {
  v1::CommitRequest req;
  req.set_transaction(std::string(transaction));
  req.set_wait_for_release(wait);
  v1::PoolUpdate update;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::Commit, req, &update, WaitTimeout(impl_->options.timeout, wait)));
  impl_->Observe(update);
  KVD_RETURN_IF_ERROR(impl_->Route(update));
  return FromProto(update);
}

absl::StatusOr<uint64_t> Client::Abort(absl::string_view transaction) {
  v1::AbortRequest req;
  req.set_transaction(std::string(transaction));
  v1::AbortResponse resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::Abort, req, &resp));
  impl_->Observe(resp);
  return resp.released_bytes();
}

absl::Status Client::ZeroBlocks(absl::string_view pool, const std::vector<uint64_t>& block_ids) {
  v1::ZeroBlocksRequest req;
  req.set_pool(std::string(pool));
  req.mutable_block_ids()->Add(block_ids.begin(), block_ids.end());
  v1::ZeroBlocksResponse resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::ZeroBlocks, req, &resp));
  impl_->Observe(resp);
  return absl::OkStatus();
}

absl::Status Client::CopyBlocks(absl::string_view pool, const std::vector<BlockMove>& copies) {
  v1::CopyBlocksRequest req;
  req.set_pool(std::string(pool));
  for (const BlockMove& c : copies) {
    v1::BlockCopy* p = req.add_copies();
    p->set_src(c.src);
    p->set_dst(c.dst);
  }
  v1::CopyBlocksResponse resp;
  KVD_RETURN_IF_ERROR(impl_->Call(&v1::Kvd::Stub::CopyBlocks, req, &resp));
  impl_->Observe(resp);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Client::CallMethod(absl::string_view method, absl::string_view request,
                                               absl::Duration timeout) {
  const google::protobuf::ServiceDescriptor* kvd = v1::DeviceInfo::descriptor()->file()->FindServiceByName("Kvd");
  const google::protobuf::MethodDescriptor* m = kvd->FindMethodByName(std::string(method));
  if (m == nullptr || m->client_streaming() || m->server_streaming()) {
    return absl::InvalidArgumentError(absl::StrCat("method: ", method, " is not a unary RPC of kvd.v1.Kvd"));
  }
  google::protobuf::MessageFactory* factory = google::protobuf::MessageFactory::generated_factory();
  std::unique_ptr<google::protobuf::Message> req(factory->GetPrototype(m->input_type())->New());
  if (!req->ParseFromArray(request.data(), static_cast<int>(request.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("request: not a serialized ", m->input_type()->full_name(), " (", request.size(), " bytes)"));
  }
  KVD_ASSIGN_OR_RETURN(const Impl::Conn c, impl_->Live());
  std::unique_ptr<grpc::ClientContext> ctx =
      Impl::Context(*c, timeout > absl::ZeroDuration() ? timeout : impl_->options.timeout);
  grpc::Slice slice(request.data(), request.size());
  grpc::ByteBuffer in(&slice, 1), out;
  grpc::GenericStub stub(c->channel);
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(ctx.get(), absl::StrCat("/", m->service()->full_name(), "/", m->name()), grpc::StubOptions(), &in,
                 &out, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  absl::Status s = FromGrpc(status);
  if (absl::IsUnavailable(s) && !c->session.Alive()) s = impl_->NotAnswering(s);
  KVD_RETURN_IF_ERROR(s);
  std::vector<grpc::Slice> slices;
  if (!out.Dump(&slices).ok()) return absl::InternalError(absl::StrCat(method, ": the reply could not be read"));
  std::string reply;
  for (const grpc::Slice& part : slices) reply.append(reinterpret_cast<const char*>(part.begin()), part.size());
  std::unique_ptr<google::protobuf::Message> parsed(factory->GetPrototype(m->output_type())->New());
  if (!parsed->ParseFromString(reply)) {
    return absl::InternalError(absl::StrCat(method, ": the reply is not a ", m->output_type()->full_name()));
  }
  impl_->Observe(*parsed);
  return reply;
}

absl::StatusOr<std::vector<std::pair<uint64_t, int>>> Client::FetchLease(absl::string_view lease_token) {
  KVD_ASSIGN_OR_RETURN(const Impl::Conn c, impl_->Live());
  return c->session.Fetch(lease_token);
}

absl::StatusOr<Client::Session> Client::CurrentSession() {
  KVD_ASSIGN_OR_RETURN(const Impl::Conn c, impl_->Live());
  return Session{.token = c->session.token(), .uid = c->session.uid(), .pid = c->session.pid()};
}

}  // namespace kvd
