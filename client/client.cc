#include "kvd/client.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/handle_client.h"
#include "client/phase_marks.h"
#include "grpcpp/grpcpp.h"
#include "kvd/device.h"
#include "kvd/status.h"
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
    default:
      return PoolState::kUnknown;
  }
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
                                     .device_uuid = c.device_uuid()});
  }
  for (const v1::Chunk& c : p.chunks()) out.chunks.push_back(FromProto(c));
  out.group = GroupMembership{.name = p.group().name(), .rank = p.group().rank(), .size = p.group().size()};
  out.peer_devices.assign(p.peer_devices().begin(), p.peer_devices().end());
  out.transaction = p.transaction();
  out.client_count = p.client_count();
  return out;
}

PoolChange FromProto(const v1::PoolUpdate& u) {
  PoolChange out{.pool = FromProto(u.pool()), .release_id = u.release_id(), .elapsed_us = u.elapsed_us()};
  for (const v1::Chunk& c : u.added()) out.added.push_back(FromProto(c));
  out.released_chunk_ids.assign(u.released_chunk_ids().begin(), u.released_chunk_ids().end());
  return out;
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

absl::StatusOr<std::string> FindSocket(absl::string_view device_uuid, absl::string_view directory) {
  if (device_uuid.empty()) return absl::InvalidArgumentError("device_uuid: must not be empty");
  const std::string want = absl::AsciiStrToLower(device_uuid);
  KVD_ASSIGN_OR_RETURN(std::vector<std::string> sockets, NodeSockets(directory));
  std::vector<std::string> seen, matches;
  for (const std::string& socket : sockets) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect({.socket = socket, .client_name = "find-socket"});
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
    default:
      return "unknown";
  }
}

// ---------------------------------------------------------------------------------------------
// Client::Impl

struct Client::Impl {
  Impl(ConnectOptions opts, HandleSession s) : options(std::move(opts)), session(std::move(s)) {}

  ConnectOptions options;
  HandleSession session;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Kvd::Stub> stub;

  absl::Mutex mu;
  // Opened on first use with the daemon's backend, by index; never reset while the Impl lives.
  std::map<int, std::unique_ptr<Device>> devices ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, std::weak_ptr<Mapping::Impl>> mappings ABSL_GUARDED_BY(mu);

  std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata(wire::kSessionMetadataKey, session.token());
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    return ctx;
  }
  std::unique_ptr<grpc::ClientContext> Context() const { return Context(options.timeout); }
  // Hands a successful reply to ConnectOptions::on_reply.
  void Observe(const google::protobuf::Message& reply) const {
    if (options.on_reply) options.on_reply(reply);
  }

  // The device this process maps from (AttachOptions::device; empty: the daemon's), opened once.
  struct LocalDevice {
    Device* device = nullptr;
    std::string peer_uuid;  // set when it is not the daemon's device: the AttachRequest's device_uuid
  };
  // Asks the daemon for its device once per selector: a Client's session (and so the daemon it talks to)
  // does not outlive the daemon, so the answer cannot change under it (an Attach saves a round trip).
  absl::StatusOr<LocalDevice> GetDevice(absl::string_view selector);
  absl::StatusOr<LocalDevice> OpenLocalDevice(absl::string_view selector);
  absl::flat_hash_map<std::string, LocalDevice> local_devices ABSL_GUARDED_BY(mu);
  std::shared_ptr<Mapping::Impl> FindMapping(const std::string& pool);
  // Maps the lease of `update` into this client's Mapping of its pool, if it has one.
  absl::Status Route(const v1::PoolUpdate& update);
};

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
  KVD_RETURN_IF_ERROR(FromGrpc(stub->GetDeviceInfo(Context().get(), v1::GetDeviceInfoRequest(), &info)));
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
  LocalDevice out{.device = device.get()};
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
  };

  std::shared_ptr<Client::Impl> client;
  Device* device = nullptr;
  std::string pool;
  std::string client_id;
  Geometry geometry;
  LayoutResolution layout;
  uint64_t base = 0;
  AttachOptions options;

  mutable absl::Mutex mu;
  std::map<uint64_t, Mapped> chunks ABSL_GUARDED_BY(mu);  // by chunk id
  uint64_t committed_blocks ABSL_GUARDED_BY(mu) = 0;
  Mapping::State state ABSL_GUARDED_BY(mu) = Mapping::State::kAwake;
  bool closing ABSL_GUARDED_BY(mu) = false;

  std::unique_ptr<grpc::ClientContext> watch_ctx;
  std::thread follower;

  // Fetches `lease`, imports each FD (closing it at once) and maps it at base + offset.
  absl::Status MapLease(const std::string& lease, const google::protobuf::RepeatedPtrField<v1::Chunk>& added)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // MapLease, except that a lease refused because its chunks were released meanwhile (a concurrent
  // shrink or sleep, whose release event follows) maps nothing and returns false.
  absl::StatusOr<bool> MapLeaseUnlessReleased(const std::string& lease,
                                              const google::protobuf::RepeatedPtrField<v1::Chunk>& added)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void UnmapOne(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void UnmapAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  absl::Status ApplyUpdate(const v1::PoolUpdate& update);
  void Follow(std::unique_ptr<grpc::ClientReader<v1::PoolEvent>> reader);
  void Lose(const absl::Status& why);
  void Shutdown();
};

absl::Status Mapping::Impl::MapLease(const std::string& lease,
                                     const google::protobuf::RepeatedPtrField<v1::Chunk>& added) {
  if (added.empty()) return absl::OkStatus();
  std::map<uint64_t, ChunkInfo> wanted;
  for (const v1::Chunk& c : added) wanted[c.id()] = FromProto(c);
  KVD_ASSIGN_OR_RETURN(auto fds, client->session.Fetch(lease));
  internal::MarkPhase("lease.fetched");
  size_t next = 0;
  absl::Cleanup close_rest = [&] {
    for (size_t i = next; i < fds.size(); ++i) close(fds[i].second);
  };
  for (; next < fds.size(); ++next) {
    const auto [id, fd] = fds[next];
    auto it = wanted.find(id);
    if (it == wanted.end()) {
      return absl::InternalError(absl::StrCat("lease yielded chunk ", id, " which is not in the chunk list"));
    }
    const ChunkInfo& info = it->second;
    if (info.offset + info.bytes > geometry.reserved_bytes) {
      return absl::InternalError(absl::StrCat("chunk ", id, " lies outside the pool's reservation"));
    }
    // The daemon's live chunks never overlap: a local chunk that does was released by a change whose
    // release event this follower has not handled yet (it will find the chunk gone and acknowledge).
    std::vector<uint64_t> stale;
    for (const auto& [mapped_id, m] : chunks) {
      if (m.info.offset < info.offset + info.bytes && info.offset < m.info.offset + m.info.bytes) {
        stale.push_back(mapped_id);
      }
    }
    for (uint64_t s : stale) UnmapOne(s);
    absl::StatusOr<Chunk> chunk = device->Import(fd, info.bytes);
    close(fd);  // the imported chunk keeps the memory
    KVD_RETURN_IF_ERROR(chunk.status());
    if (absl::Status s = device->Map(base + info.offset, *chunk, Access::kReadWrite); !s.ok()) {
      device->Release(*chunk).IgnoreError();
      return s;
    }
    chunks[id] = Mapped{info, *chunk};
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Mapping::Impl::MapLeaseUnlessReleased(const std::string& lease,
                                                           const google::protobuf::RepeatedPtrField<v1::Chunk>& added) {
  absl::Status s = MapLease(lease, added);
  if (s.ok()) return true;
  if (s.code() != absl::StatusCode::kFailedPrecondition) return s;
  // Fetch is all-or-nothing: nothing of this lease was mapped. Fine if none of its chunks is live.
  v1::GetPoolRequest req;
  req.set_name(pool);
  v1::Pool now;
  KVD_RETURN_IF_ERROR(FromGrpc(client->stub->GetPool(client->Context().get(), req, &now)));
  for (const v1::Chunk& live : now.chunks()) {
    for (const v1::Chunk& c : added) {
      if (c.id() == live.id()) return s;
    }
  }
  return false;
}

void Mapping::Impl::UnmapOne(uint64_t id) {
  auto it = chunks.find(id);
  if (it == chunks.end()) return;
  device->Unmap(base + it->second.info.offset, it->second.info.bytes).IgnoreError();
  device->Release(it->second.chunk).IgnoreError();
  chunks.erase(it);
}

void Mapping::Impl::UnmapAll() {
  while (!chunks.empty()) UnmapOne(chunks.begin()->first);
}

absl::Status Mapping::Impl::ApplyUpdate(const v1::PoolUpdate& update) {
  absl::MutexLock lock(&mu);
  if (closing || state == Mapping::State::kLost) return absl::OkStatus();
  KVD_ASSIGN_OR_RETURN(bool mapped, MapLeaseUnlessReleased(update.lease().token(), update.added()));
  if (mapped) {
    committed_blocks = update.pool().committed_blocks();
    state = Mapping::State::kAwake;  // chunks are only ever added to an awake pool
  }
  return absl::OkStatus();
}

void Mapping::Impl::Lose(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu);
    if (closing || state == Mapping::State::kLost) return;
    UnmapAll();
    state = Mapping::State::kLost;
    committed_blocks = 0;
  }
  // Ending the watch detaches this client in the daemon: a lost Mapping acknowledges nothing, so it
  // must not hold up a shrink or sleep that waits for every client (the stream then ends CANCELLED,
  // which finds the Mapping lost already).
  watch_ctx->TryCancel();
  if (options.on_lost) options.on_lost(why);
}

namespace {

// An event's ranges (connectors).
std::vector<ByteRange> Ranges(const v1::PoolEvent& ev) {
  std::vector<ByteRange> out;
  for (const v1::ByteRange& r : ev.ranges()) out.push_back({r.segment(), r.offset(), r.bytes()});
  return out;
}

}  // namespace

void Mapping::Impl::Follow(std::unique_ptr<grpc::ClientReader<v1::PoolEvent>> reader) {
  v1::PoolEvent ev;
  while (reader->Read(&ev)) {
    switch (ev.type()) {
      case v1::EVENT_TYPE_CHUNKS_ADDED: {
        absl::StatusOr<bool> mapped;
        uint64_t committed = 0;
        {
          absl::MutexLock lock(&mu);
          if (closing || state == Mapping::State::kLost) break;
          mapped = MapLeaseUnlessReleased(ev.lease().token(), ev.chunks());
          if (mapped.ok() && *mapped) {
            committed_blocks = committed = ev.committed_blocks();
            state = Mapping::State::kAwake;  // chunks are only ever added to an awake pool
          }
        }
        if (!mapped.ok()) {
          const absl::Status& s = mapped.status();
          Lose(absl::Status(s.code(), absl::StrCat("mapping chunks added to pool ", pool, ": ", s.message())));
        } else if (*mapped) {
          if (options.on_grow) options.on_grow(committed);
          if (options.on_ranges_added) options.on_ranges_added(Ranges(ev));
        }
        break;
      }
      case v1::EVENT_TYPE_CHUNKS_RELEASED: {
        internal::MarkPhase("release.event");
        uint64_t committed = 0;
        if (options.on_ranges_released) options.on_ranges_released(Ranges(ev));
        {
          absl::MutexLock lock(&mu);
          if (closing || state == Mapping::State::kLost) break;
          for (const v1::Chunk& c : ev.chunks()) UnmapOne(c.id());
          internal::MarkPhase("release.unmapped");
          committed_blocks = committed = ev.committed_blocks();
          if (ev.state() == v1::POOL_STATE_SLEEPING) state = Mapping::State::kSleeping;
        }
        if (ev.release_id() != 0) {
          internal::MarkPhase("release.acknowledging");
          v1::AcknowledgeRequest req;
          req.set_client_id(client_id);
          req.set_release_id(ev.release_id());
          v1::AcknowledgeResponse resp;
          absl::Status s = FromGrpc(client->stub->Acknowledge(client->Context().get(), req, &resp));
          if (!s.ok()) {
            Lose(absl::Status(s.code(), absl::StrCat("acknowledging release ", ev.release_id(), ": ", s.message())));
            break;
          }
        }
        if (options.on_release) options.on_release(committed);
        break;
      }
      case v1::EVENT_TYPE_POOL_DELETED:
        Lose(absl::NotFoundError(absl::StrCat("pool ", pool, " was deleted")));
        break;
      case v1::EVENT_TYPE_DAEMON_STOPPING:
        Lose(absl::UnavailableError("kvd is stopping"));
        break;
      default:
        break;
    }
  }
  absl::Status finished = FromGrpc(reader->Finish());
  Lose(finished.ok() ? absl::UnavailableError(absl::StrCat("the event stream of pool ", pool, " ended"))
                     : absl::Status(finished.code(),
                                    absl::StrCat("the event stream of pool ", pool, " broke: ", finished.message())));
}

void Mapping::Impl::Shutdown() {
  {
    absl::MutexLock lock(&mu);
    closing = true;
  }
  {
    absl::MutexLock lock(&client->mu);
    auto it = client->mappings.find(pool);
    if (it != client->mappings.end() && it->second.lock().get() == this) client->mappings.erase(it);
  }
  v1::DetachRequest req;
  req.set_pool(pool);
  req.set_client_id(client_id);
  v1::DetachResponse resp;
  client->stub->Detach(client->Context(std::min(client->options.timeout, absl::Seconds(5))).get(), req, &resp)
      .ok();  // the client may already be detached (pool deleted, daemon gone)
  if (watch_ctx != nullptr) watch_ctx->TryCancel();
  if (follower.joinable()) follower.join();
  absl::MutexLock lock(&mu);
  UnmapAll();
  device->Free(base, geometry.reserved_bytes).IgnoreError();
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

// ---------------------------------------------------------------------------------------------
// Mapping

Mapping::~Mapping() { impl_->Shutdown(); }

void* Mapping::base() const { return reinterpret_cast<void*>(impl_->base); }
const std::string& Mapping::pool() const { return impl_->pool; }
const std::string& Mapping::client_id() const { return impl_->client_id; }
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
  KVD_ASSIGN_OR_RETURN(HandleSession session, HandleSession::Open(HandlesPathFor(options.socket), options.client_name,
                                                                  HandleClientOptions{.timeout = options.timeout}));
  auto impl = std::make_shared<Impl>(options, std::move(session));
  impl->channel = grpc::CreateChannel("unix:" + options.socket, grpc::InsecureChannelCredentials());
  impl->stub = v1::Kvd::NewStub(impl->channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::~Client() = default;

const std::string& Client::socket() const { return impl_->options.socket; }

absl::StatusOr<DeviceStatus> Client::DeviceInfo() {
  v1::DeviceInfo i;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->GetDeviceInfo(impl_->Context().get(), v1::GetDeviceInfoRequest(), &i)));
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
                   .pool_count = i.pool_count()};
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
    KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->ListPools(impl_->Context().get(), req, &resp)));
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
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->GetPool(impl_->Context().get(), req, &pool)));
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
  v1::Pool pool;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->CreatePool(impl_->Context().get(), req, &pool)));
  impl_->Observe(pool);
  return FromProto(pool);
}

absl::StatusOr<ResolvedLayout> Client::ResolveLayout(const LayoutRequest& request, const PoolDims* dims) {
  v1::ResolveLayoutRequest req;
  ToProto(request, req.mutable_layout_request());
  if (dims != nullptr) ToProto(*dims, req.mutable_dims());
  v1::ResolveLayoutResponse resp;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->ResolveLayout(impl_->Context().get(), req, &resp)));
  impl_->Observe(resp);
  return ResolvedLayout{.resolution = FromProto(resp.resolution()),
                        .has_geometry = resp.has_geometry(),
                        .geometry = FromProto(resp.geometry())};
}

absl::StatusOr<PoolChange> Client::Grow(absl::string_view pool, uint64_t target_blocks) {
  v1::GrowRequest req;
  req.set_pool(std::string(pool));
  req.set_target_blocks(target_blocks);
  v1::PoolUpdate update;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->Grow(impl_->Context().get(), req, &update)));
  impl_->Observe(update);
  KVD_RETURN_IF_ERROR(impl_->Route(update));
  return FromProto(update);
}

namespace {
absl::Duration WaitTimeout(absl::Duration timeout, bool wait) {
  return wait ? std::max(timeout, absl::Seconds(65)) : timeout;
}
}  // namespace

absl::StatusOr<PoolChange> Client::Shrink(absl::string_view pool, uint64_t target_blocks, bool wait) {
  v1::ShrinkRequest req;
  req.set_pool(std::string(pool));
  req.set_target_blocks(target_blocks);
  req.set_wait_for_release(wait);
  v1::PoolUpdate update;
  KVD_RETURN_IF_ERROR(
      FromGrpc(impl_->stub->Shrink(impl_->Context(WaitTimeout(impl_->options.timeout, wait)).get(), req, &update)));
  impl_->Observe(update);
  return FromProto(update);
}

absl::StatusOr<std::vector<PoolChange>> Client::Sleep(absl::string_view pool, bool wait) {
  v1::SleepRequest req;
  if (pool.empty()) {
    req.set_all(true);
  } else {
    req.set_pool(std::string(pool));
  }
  req.set_wait_for_release(wait);
  v1::PoolUpdates updates;
  KVD_RETURN_IF_ERROR(
      FromGrpc(impl_->stub->Sleep(impl_->Context(WaitTimeout(impl_->options.timeout, wait)).get(), req, &updates)));
  impl_->Observe(updates);
  std::vector<PoolChange> out;
  for (const v1::PoolUpdate& u : updates.updates()) out.push_back(FromProto(u));
  return out;
}

absl::StatusOr<std::vector<PoolChange>> Client::Wake(absl::string_view pool) {
  v1::WakeRequest req;
  if (pool.empty()) {
    req.set_all(true);
  } else {
    req.set_pool(std::string(pool));
  }
  v1::PoolUpdates updates;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->Wake(impl_->Context().get(), req, &updates)));
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

absl::StatusOr<uint64_t> Client::DeletePool(absl::string_view name, bool force) {
  v1::DeletePoolRequest req;
  req.set_name(std::string(name));
  req.set_force(force);
  v1::DeletePoolResponse resp;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->DeletePool(impl_->Context().get(), req, &resp)));
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

  v1::AttachRequest req;
  req.set_pool(name);
  req.set_client_name(options.client_name);
  req.set_device_uuid(local.peer_uuid);
  v1::AttachResponse resp;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->Attach(impl_->Context().get(), req, &resp)));
  impl_->Observe(resp);
  internal::MarkPhase("attach.rpc");

  auto m = std::make_shared<Mapping::Impl>();
  m->client = impl_;
  m->device = device;
  m->pool = name;
  m->client_id = resp.client_id();
  m->geometry = FromProto(resp.pool().geometry());
  m->layout = FromProto(resp.pool().layout());
  m->options = std::move(options);
  absl::Cleanup detach = [&] {
    v1::DetachRequest d;
    d.set_pool(name);
    d.set_client_id(m->client_id);
    v1::DetachResponse r;
    impl_->stub->Detach(impl_->Context().get(), d, &r).ok();  // best effort: the session's end detaches too
  };
  // The event stream starts now and is confirmed after the import (WaitForInitialMetadata below), so its
  // round trip overlaps the import instead of following it. Events since the Attach are queued in the
  // daemon either way, and the follower reads them only once the lease is mapped.
  m->watch_ctx = std::make_unique<grpc::ClientContext>();
  m->watch_ctx->AddMetadata(wire::kSessionMetadataKey, impl_->session.token());
  v1::WatchRequest watch;
  watch.set_client_id(m->client_id);
  std::unique_ptr<grpc::ClientReader<v1::PoolEvent>> reader = impl_->stub->Watch(m->watch_ctx.get(), watch);
  absl::Cleanup stop_watch = [&] {
    m->watch_ctx->TryCancel();
    reader->Finish().ok();  // cancelled: the status says so
  };
  KVD_ASSIGN_OR_RETURN(m->base, device->Reserve(m->geometry.reserved_bytes));
  absl::Cleanup free_va = [&] {
    absl::MutexLock lock(&m->mu);
    m->UnmapAll();
    device->Free(m->base, m->geometry.reserved_bytes).IgnoreError();
  };
  {
    absl::MutexLock lock(&m->mu);
    KVD_RETURN_IF_ERROR(m->MapLease(resp.lease().token(), resp.pool().chunks()));
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
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->GrantPeerAccess(impl_->Context().get(), req, &resp)));
  impl_->Observe(resp);
  return FromProto(resp);
}

absl::StatusOr<RangeExport> Client::ExportRanges(const Mapping& mapping, const std::vector<ByteRange>& ranges) {
  v1::ExportRangesRequest req;
  req.set_client_id(mapping.client_id());
  for (const ByteRange& r : ranges) {
    v1::ByteRange* p = req.add_ranges();
    p->set_segment(r.segment);
    p->set_offset(r.offset);
    p->set_bytes(r.bytes);
  }
  v1::ExportRangesResponse resp;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->ExportRanges(impl_->Context().get(), req, &resp)));
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
  KVD_ASSIGN_OR_RETURN(auto fds, impl_->session.Fetch(resp.lease().token()));
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
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->DescribeTransfer(impl_->Context().get(), req, &resp)));
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
                                               absl::Duration ttl) {
  v1::PrepareRequest req;
  req.set_pool(std::string(pool));
  req.set_operation(ToProto(op));
  req.set_target_blocks(target_blocks);
  req.set_ttl_ms(static_cast<uint64_t>(std::max<int64_t>(absl::ToInt64Milliseconds(ttl), 1)));
  v1::PrepareResponse resp;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->Prepare(impl_->Context().get(), req, &resp)));
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
  KVD_RETURN_IF_ERROR(
      FromGrpc(impl_->stub->Commit(impl_->Context(WaitTimeout(impl_->options.timeout, wait)).get(), req, &update)));
  impl_->Observe(update);
  KVD_RETURN_IF_ERROR(impl_->Route(update));
  return FromProto(update);
}

absl::StatusOr<uint64_t> Client::Abort(absl::string_view transaction) {
  v1::AbortRequest req;
  req.set_transaction(std::string(transaction));
  v1::AbortResponse resp;
  KVD_RETURN_IF_ERROR(FromGrpc(impl_->stub->Abort(impl_->Context().get(), req, &resp)));
  impl_->Observe(resp);
  return resp.released_bytes();
}

}  // namespace kvd
