#include "daemon/rpc/service.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "daemon/metrics/metrics.h"
#include "daemon/rpc/async_stream.h"
#include "daemon/rpc/control_socket.h"
#include "daemon/rpc/convert.h"
#include "daemon/rpc/handle_channel.h"
#include "daemon/rpc/status.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/descriptor.h"
#include "kvd/status.h"
#include "kvd/units.h"
#include "kvd/wire.h"
#include "spdlog/spdlog.h"

namespace kvd::daemon {
namespace {

// fmt does not know absl::string_view (a distinct type in Debian's Abseil).
std::string_view Sv(absl::string_view s) { return {s.data(), s.size()}; }

absl::Status RequireNonEmpty(const std::string& value, absl::string_view field) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  return absl::OkStatus();
}

absl::Status RequireNonEmpty(std::initializer_list<KvdService::Required> required) {
  for (const KvdService::Required& field : required) KVD_RETURN_IF_ERROR(RequireNonEmpty(field.value, field.name));
  return absl::OkStatus();
}

// Times one core call for kvd_operations_total / kvd_operation_duration_seconds (no-op without metrics).
template <typename Call>
auto Timed(Metrics* metrics, Operation op, Call call) -> decltype(call()) {
  const absl::Time start = absl::Now();
  auto result = call();
  if (metrics != nullptr) metrics->ObserveOperation(op, absl::Now() - start, result.ok());
  return result;
}

std::string Elapsed(absl::Duration d) { return absl::FormatDuration(d); }

// The handler boundary: no exception leaves a handler (gRPC would answer UNKNOWN with no message).
// Allocation failure is RESOURCE_EXHAUSTED (memory, or memory mappings at vm.max_map_count); anything
// else INTERNAL, both naming the method and what was thrown.
absl::Status Guarded(const char* method, absl::FunctionRef<absl::Status()> body) {
  try {
    return body();
  } catch (const std::bad_alloc& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat(method, ": kvd could not allocate memory (", e.what(),
                     "): the host is out of memory or the daemon reached vm.max_map_count mappings"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(method, ": unexpected exception: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(method, ": unexpected exception of unknown type"));
  }
}

constexpr uint64_t kDefaultTransactionTtlMs = 30'000;
// ListPools pages (kvd.proto, docs/api.md): pools per page by default and at most, and the encoded
// size a page stops before.
constexpr size_t kDefaultListPageSize = 100;
constexpr size_t kMaxListPageSize = 1000;
constexpr size_t kMaxListPageBytes = size_t{1} << 20;
constexpr uint64_t kMaxTransactionTtlMs = 600'000;

absl::StatusOr<GroupOp> FromProto(v1::Operation op) {
  switch (op) {
    case v1::OPERATION_GROW:
      return GroupOp::kGrow;
    case v1::OPERATION_SHRINK:
      return GroupOp::kShrink;
    case v1::OPERATION_SLEEP:
      return GroupOp::kSleep;
    case v1::OPERATION_WAKE:
      return GroupOp::kWake;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("operation: ", static_cast<int>(op), " is not one of GROW, SHRINK, SLEEP, WAKE"));
  }
}

Operation ToMetricsOperation(GroupOp op) {
  switch (op) {
    case GroupOp::kGrow:
      return Operation::kGrow;
    case GroupOp::kShrink:
      return Operation::kShrink;
    case GroupOp::kSleep:
      return Operation::kSleep;
    case GroupOp::kWake:
      return Operation::kWake;
  }
  return Operation::kGrow;
}

void LogUpdate(const std::string& verb, const PoolUpdate& u) {
  spdlog::info("{} pool {}: {} blocks committed ({}), +{} / -{} chunks, {} pending release, {} elapsed", verb,
               u.pool.name, u.pool.committed_blocks, FormatBytes(u.pool.committed_bytes), u.added.size(),
               u.released_chunk_ids.size(), FormatBytes(u.pool.pending_release_bytes), Elapsed(u.elapsed));
  if (!spdlog::should_log(spdlog::level::debug)) return;
  const ResizePhases& p = u.phases;
  spdlog::debug("{} pool {}: admit {}, create {}, export {}, map {}, store {}, apply {}, save {}, release {}", verb,
                u.pool.name, Elapsed(p.admit), Elapsed(p.create), Elapsed(p.exported), Elapsed(p.map), Elapsed(p.store),
                Elapsed(p.apply), Elapsed(p.save), Elapsed(p.release));
}

// A shrink or compact that moved bytes: its pause and copy, in the log (metrics see each step: main.cc).
void LogReshape(const PoolUpdate& u) {
  if (!u.reshape.has_value() || (u.reshape->chunks_added == 0 && u.reshape->moved_blocks.empty())) return;
  const ReshapeReport& r = *u.reshape;
  spdlog::info(
      "pool {}: {} -> {} chunks, {} copied in {}, {} clients paused for {} in {} steps (at most {} at a "
      "time; {} resumed{})",
      u.pool.name, r.chunks_before, r.chunks_after, FormatBytes(r.copied_bytes), Elapsed(r.copy), r.paused_clients,
      Elapsed(r.pause), r.steps, Elapsed(r.max_pause), r.resumed_clients,
      r.detached_client_ids.empty() ? "" : absl::StrCat(", ", r.detached_client_ids.size(), " detached"));
}

// The answer to a request gRPC could not parse: INVALID_ARGUMENT naming the method and the request's type.
grpc::Status UnparseableRequest(absl::string_view method, absl::string_view type) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("request: the ", method, " request is not a valid ", type,
                                   " (a malformed message, or a string field that is not valid UTF-8)"));
}

class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  // `method` is gRPC's, valid for the call, which the interceptor does not outlive: no copy per call.
  explicit ParseErrorInterceptor(absl::string_view method) : method_(method) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      // Every status kvd's handlers finish with has a message (Finish, Guarded): an INTERNAL without one is
      // gRPC's answer to a request it could not deserialize on the synchronous server (the raw methods parse
      // their own: QuickCall, WatchStream).
      const grpc::Status status = methods->GetSendStatus();
      if (status.error_message().empty() && status.error_code() == grpc::StatusCode::INTERNAL) {
        methods->ModifySendStatus(UnparseableRequest(method_, RequestType()));
      }
    }
    methods->Proceed();
  }

 private:
  // "/kvd.v1.Kvd/GetPool": its descriptor; null for a method not in a linked proto.
  const google::protobuf::MethodDescriptor* Method() const {
    const size_t slash = method_.rfind('/');
    if (slash == absl::string_view::npos || slash == 0) return nullptr;
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
            std::string(method_.substr(1, slash - 1)));
    return service == nullptr ? nullptr : service->FindMethodByName(std::string(method_.substr(slash + 1)));
  }

  // "kvd.v1.GetPoolRequest" for "/kvd.v1.Kvd/GetPool"; "protobuf message" for a method not in the proto.
  std::string RequestType() const {
    const google::protobuf::MethodDescriptor* method = Method();
    return method == nullptr ? "protobuf message" : method->input_type()->full_name();
  }

  const absl::string_view method_;
};

// The methods served on the completion threads (KvdService::ListenForCalls, HealthService::ListenForWatches): they
// parse their own requests (or, a typed asynchronous method, gRPC answers a bad one before any interceptor), so an
// interceptor there would only cost each call its allocation and hooks (docs/benchmarks.md measured it).
constexpr absl::string_view kSelfParsingMethods[] = {
    "/kvd.v1.Kvd/Watch",       "/kvd.v1.Kvd/ResolveLayout",   "/kvd.v1.Kvd/GetPool",
    "/kvd.v1.Kvd/ListPools",   "/kvd.v1.Kvd/GetPoolMetadata", "/kvd.v1.Kvd/DescribeTransfer",
    "/kvd.v1.Kvd/Acknowledge", "/kvd.v1.Kvd/ReportUsage",     "/kvd.v1.Kvd/DeclineReclaim",
    "/kvd.v1.Kvd/Attach",      "/grpc.health.v1.Health/Watch"};

class ParseErrorInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    const absl::string_view method = info->method() == nullptr ? absl::string_view() : info->method();
    for (absl::string_view self_parsing : kSelfParsingMethods) {
      if (method == self_parsing) return nullptr;  // gRPC takes no interceptor for a null
    }
    return new ParseErrorInterceptor(method);
  }
};

// Note [Replies are built on an arena] in docs/architecture.md. A serialized reply this large (about 200 chunks) has
// left more than glibc's trim threshold (32 KiB) free on the heap's top, which glibc gives back only after a single
// free of 64 KiB.
constexpr int kTrimAfterReplyBytes = 4 << 10;

// The reply's arena: blocks double from 1 KiB, and from 32 KiB on glibc mmaps them (ShapeTheHeap in daemon/main.cc),
// so a large reply's memory goes back to the kernel whole and leaves no holes in the heap.
google::protobuf::ArenaOptions ReplyArenaOptions() {
  google::protobuf::ArenaOptions options;
  options.start_block_size = 1 << 10;
  options.max_block_size = 1 << 20;
  return options;
}

}  // namespace

// One Watch stream (Note [Watch streams are pushed] in docs/architecture.md): the client's events are written as
// they are pushed, one write in flight at a time, until they end (OK), the client goes or a write fails
// (CANCELLED). When it is closed, the client is detached (the stream is its liveness) and the RPC counted. A refused
// Watch (no session, an unknown client, a second watcher) never opened a stream: nobody to detach.
//
// Threads: Ready runs on whichever thread pushed (maybe inside a pool's lock), the steps on the stream thread; the
// stream's mu_ is taken before the queue's (a leaf), and nothing under it calls into the manager (Detach runs in
// Closed, outside it). The queue holds the stream weakly, so a Ready that races its close keeps it alive for its own
// call and finds it ended.
//
// The method is raw (its request and events are bytes, parsed and serialized here), so that a request that does not
// parse gets the same INVALID_ARGUMENT as on every other method: on the asynchronous API, gRPC would answer a typed
// method's unparseable request itself, past the interceptors.
class KvdService::WatchStream final : public AsyncStream<grpc::ByteBuffer, grpc::ByteBuffer>,
                                      public EventQueue::Listener {
 public:
  explicit WatchStream(KvdService* service) : service_(service) {}

  void Ready() override { Pump(); }

 private:
  void RequestCall(grpc::ServerContext* context, grpc::ByteBuffer* request, Writer* writer,
                   grpc::ServerCompletionQueue* cq, void* tag) override {
    service_->RequestWatch(context, request, writer, cq, cq, tag);
  }

  std::shared_ptr<AsyncStream> Successor() override { return std::make_shared<WatchStream>(service_); }

  // watch_, caller_ and queue_ are written here, before the stream opens (under mu_), and only read after.
  grpc::Status Open() override {
    grpc::ByteBuffer bytes(request());
    if (!grpc::SerializationTraits<v1::WatchRequest>::Deserialize(&bytes, &watch_).ok()) {
      return UnparseableRequest("/kvd.v1.Kvd/Watch", v1::WatchRequest::descriptor()->full_name());
    }
    const absl::Status status =
        service_->Run("Watch", context(), {{watch_.client_id(), "client_id"}}, [&](const Caller& caller) {
          caller_ = caller;
          KVD_ASSIGN_OR_RETURN(queue_, service_->manager_->Watch(caller, watch_.client_id()));
          return absl::OkStatus();
        });
    if (!status.ok()) return service_->Finish("Watch", status);
    queue_->Listen(std::static_pointer_cast<WatchStream>(shared_from_this()));
    return grpc::Status::OK;
  }

  bool NextLocked(grpc::ByteBuffer* message, End* end) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool drained = false;
    std::optional<PoolEvent> next = queue_->TryPop(&drained);
    if (!next.has_value()) {
      if (drained) *end = End{grpc::Status::OK, "its events ended (detached, pool deleted or daemon stopping)"};
      return false;
    }
    const absl::Status converted = Guarded("Watch", [&] {
      bool own_buffer = false;
      const grpc::Status serialized =
          grpc::SerializationTraits<v1::PoolEvent>::Serialize(ToProto(*next), message, &own_buffer);
      if (!serialized.ok()) return absl::InternalError(absl::StrCat("event: ", serialized.error_message()));
      return absl::OkStatus();
    });
    if (!converted.ok()) {
      spdlog::warn("rpc Watch failed: {}: {}", Sv(absl::StatusCodeToString(converted.code())), Sv(converted.message()));
      *end = End{ToGrpcStatus(converted), "the stream failed"};
      return false;
    }
    return true;
  }

  void Closed(const End& end) override {
    // The stream is the client's liveness. After a detach, a delete or a shutdown the client is already gone and
    // this is a harmless NOT_FOUND/UNAVAILABLE.
    const absl::Status detached = service_->manager_->Detach(caller_, watch_.client_id());
    spdlog::info("watch of client {} ended: {}{}", watch_.client_id(), end.reason,
                 detached.ok() ? "; client detached" : "");
    if (service_->options_.metrics != nullptr) {
      service_->options_.metrics->CountRpc("Watch", static_cast<absl::StatusCode>(end.status.error_code()));
    }
  }

  KvdService* const service_;
  v1::WatchRequest watch_;
  Caller caller_;
  std::shared_ptr<EventQueue> queue_;
};

// One call of a quick RPC or of Attach on kvd's completion threads (Note [Quick RPCs answer inline] in
// docs/architecture.md): it waits for its method's next call, listens for the one after, parses the request, runs
// the handler inline and finishes with the reply it serialized. The method is raw, so that a request that does not
// parse gets the same INVALID_ARGUMENT as everywhere else (on the asynchronous API gRPC would answer a typed
// method's itself, past the interceptors). Request and reply live on the call's arena, dropped with the call (Note
// [Replies are built on an arena]). The call owns itself from Listen until gRPC is done with it; Finish may come
// from another thread (a waiting Attach's).
template <typename Request, typename Reply>
class KvdService::QuickCall final : public CompletionThreads::Step {
 public:
  using RequestFn = void (KvdService::*)(grpc::ServerContext*, grpc::ByteBuffer*,
                                         grpc::ServerAsyncResponseWriter<grpc::ByteBuffer>*, grpc::CompletionQueue*,
                                         grpc::ServerCompletionQueue*, void*);
  // Null for Attach, which KvdService::Attach serves.
  using Handler = grpc::Status (KvdService::*)(grpc::ServerContext*, const Request*, Reply*);

  static void Listen(KvdService* service, grpc::ServerCompletionQueue* cq, const char* method, RequestFn request,
                     Handler handler) {
    auto* call = new QuickCall(service, cq, method, request, handler);
    HandOff(call);
    (service->*request)(&call->context_, &call->bytes_, &call->responder_, cq, cq, call);
  }

  const grpc::ServerContext& context() const { return context_; }
  const Request& request() const { return *request_; }
  Reply* reply() { return reply_; }

  // Sends the reply (OK) or the status alone.
  void Finish(const grpc::Status& status) {
    finishing_ = true;
    if (status.ok()) {
      bytes_.Clear();
      bool own_buffer = false;
      const grpc::Status serialized = grpc::SerializationTraits<Reply>::Serialize(*reply_, &bytes_, &own_buffer);
      HandOff(this);
      if (serialized.ok()) {
        responder_.Finish(bytes_, status, this);
      } else {
        responder_.FinishWithError(
            grpc::Status(grpc::StatusCode::INTERNAL,
                         absl::StrCat(method_, ": the reply could not be serialized: ", serialized.error_message())),
            this);
      }
      return;
    }
    HandOff(this);
    responder_.FinishWithError(status, this);
  }

  void Run(bool ok) override {
    if (finishing_) {
      // Note [Replies are built on an arena]: what a large reply left on the heap's top goes back now.
      const bool trim = reply_->GetCachedSize() >= kTrimAfterReplyBytes;
      delete this;
      if (trim) malloc_trim(0);
      return;
    }
    // Not ok: the server is shutting down, and no call came.
    if (!ok) {
      delete this;
      return;
    }
    Listen(service_, cq_, method_, request_fn_, handler_);
    if (!grpc::SerializationTraits<Request>::Deserialize(&bytes_, request_).ok()) {
      Finish(UnparseableRequest(absl::StrCat("/", v1::Kvd::service_full_name(), "/", method_),
                                Request::descriptor()->full_name()));
      return;
    }
    if constexpr (std::is_same_v<Request, v1::AttachRequest>) {
      service_->AnswerAttach(this);
    } else {
      Finish((service_->*handler_)(&context_, request_, reply_));
    }
  }

 private:
  QuickCall(KvdService* service, grpc::ServerCompletionQueue* cq, const char* method, RequestFn request_fn,
            Handler handler)
      : service_(service),
        cq_(cq),
        method_(method),
        request_fn_(request_fn),
        handler_(handler),
        arena_(ReplyArenaOptions()),
        request_(google::protobuf::Arena::CreateMessage<Request>(&arena_)),
        reply_(google::protobuf::Arena::CreateMessage<Reply>(&arena_)) {}

  KvdService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  const char* const method_;
  const RequestFn request_fn_;
  const Handler handler_;
  google::protobuf::Arena arena_;
  Request* const request_;
  Reply* const reply_;
  grpc::ServerContext context_;
  grpc::ByteBuffer bytes_;  // the request, then the reply
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder_{&context_};
  bool finishing_ = false;  // set before Finish, read after its completion
};

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeParseErrorInterceptorFactory() {
  return std::make_unique<ParseErrorInterceptorFactory>();
}

KvdService::KvdService(PoolManager* manager, Options options) : manager_(manager), options_(options) {}

grpc::Status KvdService::Finish(const char* method, const absl::Status& status) const {
  if (!status.ok()) {
    // The message may echo what the caller sent (a pool name that does not exist, say): escaped, so
    // that no request can put a newline or raw bytes in the log.
    spdlog::warn("rpc {} failed: {}: {}", method, Sv(absl::StatusCodeToString(status.code())),
                 absl::CEscape(status.message()));
  }
  if (options_.metrics != nullptr) options_.metrics->CountRpc(method, status.code());
  return ToGrpcStatus(status);
}

template <typename Body>
absl::Status KvdService::Run(const char* method, const grpc::ServerContextBase& context,
                             std::initializer_list<Required> required, Body&& body) const {
  return Guarded(method, [&]() -> absl::Status {
    if constexpr (std::is_invocable_v<Body&, const Caller&>) {
      KVD_ASSIGN_OR_RETURN(const Caller caller, Authenticate(context));
      KVD_RETURN_IF_ERROR(RequireNonEmpty(required));
      return body(caller);
    } else {
      KVD_RETURN_IF_ERROR(RequireNonEmpty(required));
      return body();
    }
  });
}

template <typename Request, typename Reply, typename Body>
grpc::Status KvdService::OnArena(grpc::ServerUnaryStreamer<Request, Reply>* stream, Body&& body) const {
  google::protobuf::Arena arena(ReplyArenaOptions());
  Request* request = google::protobuf::Arena::CreateMessage<Request>(&arena);
  // A request gRPC cannot parse: the same answer as from a unary handler, which the parse-error interceptor
  // turns into INVALID_ARGUMENT.
  if (!stream->Read(request)) return grpc::Status(grpc::StatusCode::INTERNAL, "");
  Reply* reply = google::protobuf::Arena::CreateMessage<Reply>(&arena);
  grpc::Status status = body(static_cast<const Request*>(request), reply);
  // Written before the arena goes: gRPC has serialized it when Write returns. A client gone by then reads nothing.
  if (status.ok()) stream->Write(*reply);
  // Note [Replies are built on an arena]: what a large reply left on the heap's top goes back now.
  if (status.ok() && reply->GetCachedSize() >= kTrimAfterReplyBytes) {
    arena.Reset();
    malloc_trim(0);
  }
  return status;
}

template <typename Body>
grpc::Status KvdService::Serve(const char* method, const grpc::ServerContextBase& context,
                               std::initializer_list<Required> required, Body&& body) const {
  return Finish(method, Run(method, context, required, std::forward<Body>(body)));
}

absl::StatusOr<Caller> KvdService::Authenticate(const grpc::ServerContextBase& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(wire::kSessionMetadataKey);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        absl::StrCat(wire::kSessionMetadataKey, " metadata missing: open a session on the handle channel first"));
  }
  KVD_ASSIGN_OR_RETURN(Caller caller, manager_->Authenticate(absl::string_view(it->second.data(), it->second.size())));
  if (options_.peers == nullptr) return caller;
  // The token is not a bearer secret: it is valid only from the uid that opened the session.
  const std::optional<PeerCred> peer = options_.peers->PeerOf(context.peer());
  if (!peer.has_value()) {
    return absl::UnauthenticatedError(
        absl::StrCat(wire::kSessionMetadataKey, ": the connection's peer is unknown (", context.peer(), ")"));
  }
  if (peer->uid != caller.uid) {
    return absl::PermissionDeniedError(absl::StrCat(wire::kSessionMetadataKey, ": the session belongs to uid ",
                                                    caller.uid, "; this connection is uid ", peer->uid, " (pid ",
                                                    peer->pid, "): a session token is valid only from its own uid"));
  }
  return caller;
}

Interrupt KvdService::InterruptOf(const grpc::ServerContextBase& context) const {
  Interrupt interrupt;
  // No deadline reads as the far future (time_point::max()).
  if (context.deadline() < std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    interrupt.deadline = absl::FromChrono(context.deadline());
  }
  interrupt.cancelled = [&context] { return context.IsCancelled(); };
  return interrupt;
}

absl::Time KvdService::ReleaseDeadline(const grpc::ServerContextBase& context) const {
  const auto deadline = context.deadline();
  const absl::Time now = absl::Now();
  // No deadline reads as the far future (time_point::max()).
  if (deadline >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return now + options_.default_release_wait;
  }
  // Stop waiting a little before the client gives up, so that it gets the reply (with the bytes still
  // pending) rather than DEADLINE_EXCEEDED.
  const absl::Time rpc_deadline = absl::FromChrono(deadline);
  const absl::Duration margin = std::min(absl::Seconds(1), (rpc_deadline - now) / 10);
  return rpc_deadline - std::max(margin, absl::ZeroDuration());
}

grpc::Status KvdService::GetDeviceInfo(grpc::ServerContext* context, const v1::GetDeviceInfoRequest*,
                                       v1::DeviceInfo* response) {
  return Serve("GetDeviceInfo", *context, {}, [&]() -> absl::Status {
    KVD_ASSIGN_OR_RETURN(DeviceStatus device, manager_->GetDeviceStatus());
    *response = ToProto(device);
    return absl::OkStatus();
  });
}

grpc::Status KvdService::AnswerResolveLayout(grpc::ServerContext* context, const v1::ResolveLayoutRequest* request,
                                             v1::ResolveLayoutResponse* response) {
  return Serve("ResolveLayout", *context, {}, [&]() -> absl::Status {
    KVD_ASSIGN_OR_RETURN(LayoutResolution resolution, manager_->ResolveLayout(FromProto(request->layout_request())));
    *response->mutable_resolution() = ToProto(resolution);
    if (request->has_dims()) {
      // A pure computation on the resolved layout: the geometry a pool with these dims would get.
      KVD_ASSIGN_OR_RETURN(Geometry geometry,
                           Geometry::Compute(resolution.layout, FromProto(request->dims()), options_.granularity));
      *response->mutable_geometry() = ToProto(geometry);
    }
    return absl::OkStatus();
  });
}

grpc::Status KvdService::CreatePool(grpc::ServerContext* context, const v1::CreatePoolRequest* request,
                                    v1::Pool* response) {
  return Serve("CreatePool", *context, {{request->name(), "name"}}, [&](const Caller& caller) -> absl::Status {
    if (!request->has_dims()) return absl::InvalidArgumentError("dims: required");
    PoolSpec spec = FromProto(*request);
    KVD_ASSIGN_OR_RETURN(spec.policy, FromProto(request->policy(), "policy"));
    KVD_ASSIGN_OR_RETURN(PoolView pool, manager_->CreatePool(caller, spec));
    *response = ToProto(pool);
    spdlog::info(
        "created pool {} for uid {}: layout {} ({}), {} segments, capacity {} blocks ({} reserved), {} "
        "blocks committed ({})",
        pool.name, caller.uid, Sv(pool.geometry.layout().name()), LayoutRuleName(pool.layout.rule),
        pool.geometry.segments(), pool.geometry.dims().capacity_blocks, FormatBytes(pool.reserved_bytes),
        pool.committed_blocks, FormatBytes(pool.committed_bytes));
    return absl::OkStatus();
  });
}

grpc::Status KvdService::AnswerGetPool(grpc::ServerContext* context, const v1::GetPoolRequest* request,
                                       v1::Pool* response) {
  return Serve("GetPool", *context, {{request->name(), "name"}}, [&](const Caller& caller) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(PoolView pool, manager_->GetPool(caller, request->name()));
    ToProto(pool, response);
    return absl::OkStatus();
  });
}

grpc::Status KvdService::AnswerListPools(grpc::ServerContext* context, const v1::ListPoolsRequest* request,
                                         v1::ListPoolsResponse* response) {
  return Serve("ListPools", *context, {}, [&](const Caller& caller) -> absl::Status {
    // The token is the last name of the previous page, base64url-encoded: pools listed by name, and a
    // page starts after it, so creates and deletes between pages neither repeat nor skip other pools.
    std::string after;
    if (!request->page_token().empty() &&
        (!absl::WebSafeBase64Unescape(request->page_token(), &after) || !ValidateName(after, "page_token").ok())) {
      return absl::InvalidArgumentError(
          "page_token: not a next_page_token of a ListPools reply (leave it empty for the first page)");
    }
    const size_t page_size =
        request->page_size() == 0 ? kDefaultListPageSize : std::min<size_t>(request->page_size(), kMaxListPageSize);
    PoolPage page = manager_->ListPools(caller, after, page_size);
    // The reply's encoding: each pool with its field tag and length (at most 6 bytes), and room for the
    // token (a base64 name of at most 64 bytes, with its tag and length).
    size_t bytes = 96;
    for (size_t i = 0; i < page.pools.size(); ++i) {
      v1::Pool* pool = response->add_pools();
      ToProto(page.pools[i], pool);
      bytes += pool->ByteSizeLong() + 6;
      // Never past the page's byte bound, but never an empty page while pools remain.
      if (i > 0 && bytes > kMaxListPageBytes) {
        response->mutable_pools()->RemoveLast();
        page.more = true;
        break;
      }
    }
    if (page.more && response->pools_size() > 0) {
      response->set_next_page_token(absl::WebSafeBase64Escape(response->pools(response->pools_size() - 1).name()));
    }
    return absl::OkStatus();
  });
}

grpc::Status KvdService::DeletePool(grpc::ServerContext* context, const v1::DeletePoolRequest* request,
                                    v1::DeletePoolResponse* response) {
  return Serve("DeletePool", *context, {{request->name(), "name"}}, [&](const Caller& caller) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(PauseOptions pause, FromProto(request->pause(), "pause"));
    KVD_ASSIGN_OR_RETURN(uint64_t released, manager_->DeletePool(caller, request->name(), request->force(), pause));
    response->set_released_bytes(released);
    spdlog::info("deleted pool {}{}: {} released", request->name(), request->force() ? " (forced)" : "",
                 FormatBytes(released));
    return absl::OkStatus();
  });
}

// Note [Attach answers inline when it can] in docs/architecture.md: inline while no other operation holds the pool,
// else on a thread of its own that waits for it.
void KvdService::AnswerAttach(AttachCall* call) {
  bool busy = false;
  const absl::Status inline_status = AttachNow(call->context(), call->request(), call->reply(), /*wait=*/false, &busy);
  if (!busy) {
    call->Finish(Finish("Attach", inline_status));
    return;
  }
  spdlog::debug("Attach to pool {} waits on a thread of its own: another operation holds the pool",
                call->request().pool());
  {
    absl::MutexLock lock(&attach_mu_);
    ++waiting_attaches_;
  }
  try {
    // The thread touches nothing of the call's after its Finish (a completion thread then drops the call).
    std::thread([this, call] {
      bool unused = false;
      call->Finish(
          Finish("Attach", AttachNow(call->context(), call->request(), call->reply(), /*wait=*/true, &unused)));
      absl::MutexLock lock(&attach_mu_);
      --waiting_attaches_;
    }).detach();
  } catch (const std::system_error& e) {
    {
      absl::MutexLock lock(&attach_mu_);
      --waiting_attaches_;
    }
    call->Finish(Finish("Attach", absl::ResourceExhaustedError(absl::StrCat(
                                      "Attach: pool ", call->request().pool(),
                                      " is busy and no thread could be started to wait for it: ", e.what()))));
  }
}

void KvdService::WaitForAttaches() {
  absl::MutexLock lock(&attach_mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(attach_mu_) { return waiting_attaches_ == 0; };
  attach_mu_.Await(absl::Condition(&none));
}

// Run, not Serve: a try that found the pool busy did nothing and is neither logged nor counted.
absl::Status KvdService::AttachNow(const grpc::ServerContext& context, const v1::AttachRequest& request,
                                   v1::AttachResponse* response, bool wait, bool* busy) {
  return Run("Attach", context, {{request.pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    const absl::Time start = absl::Now();
    std::optional<absl::StatusOr<AttachResult>> tried =
        wait
            ? manager_->Attach(caller, request.pool(), request.client_name(), request.device_uuid(), request.pausable())
            : manager_->TryAttach(caller, request.pool(), request.client_name(), request.device_uuid(),
                                  request.pausable());
    if (!tried.has_value()) {
      *busy = true;
      return absl::OkStatus();
    }
    if (options_.metrics != nullptr) {
      options_.metrics->ObserveOperation(Operation::kAttach, absl::Now() - start, tried->ok());
    }
    KVD_ASSIGN_OR_RETURN(AttachResult attached, *std::move(tried));
    response->set_client_id(attached.client_id);
    ToProto(attached.pool, response->mutable_pool());
    ToProto(attached.lease, response->mutable_lease());
    if (request.push_handles() && options_.handles != nullptr) {
      // docs/api.md, "Pushed handles": sent before the reply; a push that cannot go leaves the lease to fetch.
      const absl::Status pushed = manager_->PushLease(
          caller.session, attached.lease.token, caller.uid, [&](absl::Span<const PoolManager::LeasedFd> leased) {
            std::vector<uint64_t> ids;
            std::vector<int> fds;
            for (const PoolManager::LeasedFd& l : leased) {
              ids.push_back(l.chunk_id);
              fds.push_back(l.fd);
            }
            return options_.handles->Push(caller.session, attached.lease.token, ids, fds);
          });
      response->set_handles_pushed(pushed.ok());
      if (!pushed.ok()) spdlog::debug("client {}: lease not pushed: {}", attached.client_id, Sv(pushed.message()));
    }
    spdlog::info("client {} (\"{}\", uid {}, pid {}) attached to pool {}{}: {} chunks leased", attached.client_id,
                 request.client_name(), caller.uid, caller.pid, request.pool(),
                 request.device_uuid().empty() ? "" : absl::StrCat(" from device ", request.device_uuid()),
                 attached.lease.chunk_ids.size());
    return absl::OkStatus();
  });
}

grpc::Status KvdService::Detach(grpc::ServerContext* context, const v1::DetachRequest* request, v1::DetachResponse*) {
  return Serve("Detach", *context, {{request->client_id(), "client_id"}}, [&](const Caller& caller) -> absl::Status {
    KVD_RETURN_IF_ERROR(manager_->Detach(caller, request->client_id(), request->released()));
    spdlog::info("client {} detached", request->client_id());
    return absl::OkStatus();
  });
}

grpc::Status KvdService::StreamedGrow(grpc::ServerContext* context,
                                      grpc::ServerUnaryStreamer<v1::GrowRequest, v1::PoolUpdate>* stream) {
  return OnArena(stream, [&](const v1::GrowRequest* request, v1::PoolUpdate* response) {
    return Serve("Grow", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
      const WaitOptions wait{.wait = request->wait(), .deadline = ReleaseDeadline(*context), .cancelled = [context] {
                               return context->IsCancelled();
                             }};
      KVD_ASSIGN_OR_RETURN(PoolUpdate update, Timed(options_.metrics, Operation::kGrow, [&] {
                             return manager_->Grow(caller, request->pool(), request->target_blocks(), wait);
                           }));
      ToProto(update, response);
      LogUpdate("grew", update);
      return absl::OkStatus();
    });
  });
}

grpc::Status KvdService::StreamedShrink(grpc::ServerContext* context,
                                        grpc::ServerUnaryStreamer<v1::ShrinkRequest, v1::PoolUpdate>* stream) {
  return OnArena(stream, [&](const v1::ShrinkRequest* request, v1::PoolUpdate* response) {
    return Serve("Shrink", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
      KVD_ASSIGN_OR_RETURN(PauseOptions pause, FromProto(request->pause(), "pause"));
      PoolManager::ShrinkOptions options{.wait = request->wait_for_release(),
                                         .deadline = ReleaseDeadline(*context),
                                         .whole_chunks_only = request->whole_chunks_only(),
                                         .pause = pause,
                                         .force = request->force()};
      if (request->has_live()) {
        options.live.emplace(request->live().blocks().begin(), request->live().blocks().end());
      }
      KVD_ASSIGN_OR_RETURN(PoolUpdate update, Timed(options_.metrics, Operation::kShrink, [&] {
                             return manager_->Shrink(caller, request->pool(), request->target_blocks(), options);
                           }));
      ToProto(update, response);
      LogUpdate("shrank", update);
      LogReshape(update);
      return absl::OkStatus();
    });
  });
}

grpc::Status KvdService::StreamedCompact(grpc::ServerContext* context,
                                         grpc::ServerUnaryStreamer<v1::CompactRequest, v1::PoolUpdate>* stream) {
  return OnArena(stream, [&](const v1::CompactRequest* request, v1::PoolUpdate* response) {
    return Serve("Compact", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
      KVD_ASSIGN_OR_RETURN(PauseOptions pause, FromProto(request->pause(), "pause"));
      KVD_ASSIGN_OR_RETURN(PoolUpdate update, Timed(options_.metrics, Operation::kCompact, [&] {
                             return manager_->Compact(caller, request->pool(),
                                                      {.pause = pause,
                                                       .max_chunks_per_pause = request->max_chunks_per_pause(),
                                                       .interrupt = InterruptOf(*context)});
                           }));
      ToProto(update, response);
      LogUpdate("compacted", update);
      LogReshape(update);
      return absl::OkStatus();
    });
  });
}

namespace {

// SleepRequest's and WakeRequest's target: the pool named, or "" for `all` (`every` says which pools that is).
template <typename Request>
absl::StatusOr<std::string> Target(const Request& request, absl::string_view every) {
  switch (request.target_case()) {
    case Request::kPool:
      KVD_RETURN_IF_ERROR(RequireNonEmpty(request.pool(), "pool"));
      return request.pool();
    case Request::kAll:
      if (!request.all()) return absl::InvalidArgumentError("all: must be true when set (or set pool instead)");
      return std::string();
    case Request::TARGET_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("target: set pool (one pool) or all (", every, ")"));
}

// SleepRequest's and PrepareRequest's keep and live_blocks; the tier is waited for until `ready_by`.
absl::StatusOr<KeepOptions> KeepFromProto(bool keep, const google::protobuf::RepeatedField<uint64_t>& live,
                                          absl::Time ready_by) {
  if (!keep && !live.empty())
    return absl::InvalidArgumentError("live_blocks: set keep too (they name what a sleep keeps)");
  return KeepOptions{.keep = keep, .live_blocks = {live.begin(), live.end()}, .tier_ready_by = ready_by};
}

}  // namespace

grpc::Status KvdService::StreamedSleep(grpc::ServerContext* context,
                                       grpc::ServerUnaryStreamer<v1::SleepRequest, v1::PoolUpdates>* stream) {
  return OnArena(stream, [&](const v1::SleepRequest* request, v1::PoolUpdates* response) {
    return Serve("Sleep", *context, {}, [&](const Caller& caller) -> absl::Status {
      KVD_ASSIGN_OR_RETURN(const std::string pool, Target(*request, "every awake pool"));
      KVD_ASSIGN_OR_RETURN(PauseOptions pause, FromProto(request->pause(), "pause"));
      KVD_ASSIGN_OR_RETURN(const KeepOptions keep,
                           KeepFromProto(request->keep(), request->live_blocks(), ReleaseDeadline(*context)));
      KVD_ASSIGN_OR_RETURN(std::vector<PoolUpdate> updates, Timed(options_.metrics, Operation::kSleep, [&] {
                             return manager_->Sleep(caller, pool, request->wait_for_release(),
                                                    ReleaseDeadline(*context),
                                                    {.force = request->force(), .pause = pause}, keep);
                           }));
      for (const PoolUpdate& u : updates) {
        ToProto(u, response->add_updates());
        LogUpdate("put to sleep", u);
      }
      return absl::OkStatus();
    });
  });
}

grpc::Status KvdService::StreamedWake(grpc::ServerContext* context,
                                      grpc::ServerUnaryStreamer<v1::WakeRequest, v1::PoolUpdates>* stream) {
  return OnArena(stream, [&](const v1::WakeRequest* request, v1::PoolUpdates* response) {
    return Serve("Wake", *context, {}, [&](const Caller& caller) -> absl::Status {
      KVD_ASSIGN_OR_RETURN(const std::string pool, Target(*request, "every sleeping pool"));
      const WaitOptions wait{.wait = request->wait(), .deadline = ReleaseDeadline(*context), .cancelled = [context] {
                               return context->IsCancelled();
                             }};
      KVD_ASSIGN_OR_RETURN(std::vector<PoolUpdate> updates, Timed(options_.metrics, Operation::kWake,
                                                                  [&] { return manager_->Wake(caller, pool, wait); }));
      for (const PoolUpdate& u : updates) {
        ToProto(u, response->add_updates());
        LogUpdate("woke", u);
      }
      return absl::OkStatus();
    });
  });
}

void KvdService::ListenForCalls(grpc::ServerCompletionQueue* cq) {
  std::make_shared<WatchStream>(this)->Listen(cq);
  QuickCall<v1::ResolveLayoutRequest, v1::ResolveLayoutResponse>::Listen(
      this, cq, "ResolveLayout", &KvdService::RequestResolveLayout, &KvdService::AnswerResolveLayout);
  QuickCall<v1::GetPoolRequest, v1::Pool>::Listen(this, cq, "GetPool", &KvdService::RequestGetPool,
                                                  &KvdService::AnswerGetPool);
  QuickCall<v1::ListPoolsRequest, v1::ListPoolsResponse>::Listen(this, cq, "ListPools", &KvdService::RequestListPools,
                                                                 &KvdService::AnswerListPools);
  QuickCall<v1::GetPoolMetadataRequest, v1::PoolMetadata>::Listen(
      this, cq, "GetPoolMetadata", &KvdService::RequestGetPoolMetadata, &KvdService::AnswerGetPoolMetadata);
  QuickCall<v1::DescribeTransferRequest, v1::DescribeTransferResponse>::Listen(
      this, cq, "DescribeTransfer", &KvdService::RequestDescribeTransfer, &KvdService::AnswerDescribeTransfer);
  QuickCall<v1::AcknowledgeRequest, v1::AcknowledgeResponse>::Listen(
      this, cq, "Acknowledge", &KvdService::RequestAcknowledge, &KvdService::AnswerAcknowledge);
  QuickCall<v1::ReportUsageRequest, v1::ReportUsageResponse>::Listen(
      this, cq, "ReportUsage", &KvdService::RequestReportUsage, &KvdService::AnswerReportUsage);
  QuickCall<v1::DeclineReclaimRequest, v1::DeclineReclaimResponse>::Listen(
      this, cq, "DeclineReclaim", &KvdService::RequestDeclineReclaim, &KvdService::AnswerDeclineReclaim);
  AttachCall::Listen(this, cq, "Attach", &KvdService::RequestAttach, nullptr);
}

grpc::Status KvdService::AnswerAcknowledge(grpc::ServerContext* context, const v1::AcknowledgeRequest* request,
                                           v1::AcknowledgeResponse* response) {
  return Serve(
      "Acknowledge", *context, {{request->client_id(), "client_id"}}, [&](const Caller& caller) -> absl::Status {
        if ((request->release_id() == 0) == (request->pause_id() == 0)) {
          return absl::InvalidArgumentError(
              "release_id, pause_id: set exactly one (the release_id of a CHUNKS_RELEASED or RESUME event, or the "
              "pause_id of a PAUSE event)");
        }
        if (request->pause_id() != 0) {
          KVD_RETURN_IF_ERROR(manager_->AcknowledgePause(caller, request->client_id(), request->pause_id()));
          response->set_pending_release_bytes(0);
          return absl::OkStatus();
        }
        KVD_ASSIGN_OR_RETURN(uint64_t pending,
                             manager_->Acknowledge(caller, request->client_id(), request->release_id()));
        response->set_pending_release_bytes(pending);
        return absl::OkStatus();
      });
}

grpc::Status KvdService::ZeroBlocks(grpc::ServerContext* context, const v1::ZeroBlocksRequest* request,
                                    v1::ZeroBlocksResponse*) {
  return Serve("ZeroBlocks", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    const std::vector<uint64_t> blocks(request->block_ids().begin(), request->block_ids().end());
    return manager_->ZeroBlocks(caller, request->pool(), blocks, InterruptOf(*context));
  });
}

grpc::Status KvdService::CopyBlocks(grpc::ServerContext* context, const v1::CopyBlocksRequest* request,
                                    v1::CopyBlocksResponse*) {
  return Serve("CopyBlocks", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    return manager_->CopyBlocks(caller, request->pool(), FromProto(request->copies()), InterruptOf(*context));
  });
}

grpc::Status KvdService::AnswerDescribeTransfer(grpc::ServerContext* context,
                                                const v1::DescribeTransferRequest* request,
                                                v1::DescribeTransferResponse* response) {
  return Serve("DescribeTransfer", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    const std::vector<uint64_t> blocks(request->block_ids().begin(), request->block_ids().end());
    KVD_ASSIGN_OR_RETURN(TransferPlan plan, manager_->DescribeTransfer(caller, request->pool(), blocks));
    *response = ToProto(plan);
    return absl::OkStatus();
  });
}

grpc::Status KvdService::ExportRanges(grpc::ServerContext* context, const v1::ExportRangesRequest* request,
                                      v1::ExportRangesResponse* response) {
  return Serve(
      "ExportRanges", *context, {{request->client_id(), "client_id"}}, [&](const Caller& caller) -> absl::Status {
        KVD_ASSIGN_OR_RETURN(RangeExport exported,
                             manager_->ExportRanges(caller, request->client_id(), FromProto(request->ranges())));
        *response = ToProto(exported, manager_->range_spans_chunks());
        spdlog::info("pool {}: {} range handles exported for client {} (pid {})", exported.pool,
                     exported.handles.size(), request->client_id(), caller.pid);
        return absl::OkStatus();
      });
}

grpc::Status KvdService::Prepare(grpc::ServerContext* context, const v1::PrepareRequest* request,
                                 v1::PrepareResponse* response) {
  return Serve("Prepare", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(GroupOp op, FromProto(request->operation()));
    if (request->ttl_ms() > kMaxTransactionTtlMs) {
      return absl::InvalidArgumentError(
          absl::StrCat("ttl_ms: ", request->ttl_ms(), " exceeds the maximum of ", kMaxTransactionTtlMs));
    }
    const absl::Duration ttl =
        absl::Milliseconds(request->ttl_ms() == 0 ? kDefaultTransactionTtlMs : request->ttl_ms());
    if (request->keep() && op != GroupOp::kSleep) {
      return absl::InvalidArgumentError("keep: applies to OPERATION_SLEEP only");
    }
    KVD_ASSIGN_OR_RETURN(const KeepOptions keep,
                         KeepFromProto(request->keep(), request->live_blocks(), ReleaseDeadline(*context)));
    KVD_ASSIGN_OR_RETURN(PreparedOp prepared, manager_->Prepare(caller, request->pool(), op, request->target_blocks(),
                                                                ttl, request->force(), keep));
    response->set_transaction(prepared.transaction);
    *response->mutable_pool() = ToProto(prepared.pool);
    response->set_prepared_bytes(prepared.prepared_bytes);
    response->set_expires_at_unix_ms(static_cast<uint64_t>(absl::ToUnixMillis(prepared.expires)));
    response->set_elapsed_us(absl::ToInt64Microseconds(prepared.elapsed));
    spdlog::info("prepared {} of pool {} as transaction {} for pid {}: {} made ready, {} elapsed, ttl {}",
                 GroupOpName(op), request->pool(), prepared.transaction, caller.pid,
                 FormatBytes(prepared.prepared_bytes), Elapsed(prepared.elapsed), Elapsed(ttl));
    return absl::OkStatus();
  });
}

grpc::Status KvdService::StreamedCommit(grpc::ServerContext* context,
                                        grpc::ServerUnaryStreamer<v1::CommitRequest, v1::PoolUpdate>* stream) {
  return OnArena(stream, [&](const v1::CommitRequest* request, v1::PoolUpdate* response) {
    return Serve(
        "Commit", *context, {{request->transaction(), "transaction"}}, [&](const Caller& caller) -> absl::Status {
          KVD_ASSIGN_OR_RETURN(
              CommittedOp committed,
              manager_->Commit(caller, request->transaction(), request->wait_for_release(), ReleaseDeadline(*context)));
          if (options_.metrics != nullptr) {
            options_.metrics->ObserveOperation(ToMetricsOperation(committed.op), committed.update.elapsed, true);
          }
          ToProto(committed.update, response);
          LogUpdate(
              absl::StrCat("committed ", GroupOpName(committed.op), " (transaction ", request->transaction(), ") of"),
              committed.update);
          return absl::OkStatus();
        });
  });
}

grpc::Status KvdService::Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                               v1::AbortResponse* response) {
  return Serve("Abort", *context, {{request->transaction(), "transaction"}}, [&](const Caller& caller) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(uint64_t released, manager_->Abort(caller, request->transaction()));
    response->set_released_bytes(released);
    spdlog::info("aborted transaction {}: {} given back", request->transaction(), FormatBytes(released));
    return absl::OkStatus();
  });
}

grpc::Status KvdService::GrantPeerAccess(grpc::ServerContext* context, const v1::GrantPeerAccessRequest* request,
                                         v1::Pool* response) {
  return Serve("GrantPeerAccess", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(PoolView pool,
                         manager_->GrantPeerAccess(caller, request->pool(), request->device_uuid(), request->revoke()));
    *response = ToProto(pool);
    spdlog::info("pool {}: peer access {} device {} (uid {})", request->pool(),
                 request->revoke() ? "revoked from" : "granted to", request->device_uuid(), caller.uid);
    return absl::OkStatus();
  });
}

grpc::Status KvdService::AnswerGetPoolMetadata(grpc::ServerContext* context, const v1::GetPoolMetadataRequest* request,
                                               v1::PoolMetadata* response) {
  return Serve("GetPoolMetadata", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(PoolMetadata metadata, manager_->GetPoolMetadata(caller, request->pool()));
    *response = ToProto(request->pool(), metadata);
    return absl::OkStatus();
  });
}

grpc::Status KvdService::SetPoolMetadata(grpc::ServerContext* context, const v1::SetPoolMetadataRequest* request,
                                         v1::PoolMetadata* response) {
  return Serve("SetPoolMetadata", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(
        PoolMetadata metadata,
        manager_->SetPoolMetadata(caller, request->pool(), request->expected_version(), request->data()));
    *response = ToProto(request->pool(), metadata);
    return absl::OkStatus();
  });
}

grpc::Status KvdService::SetPoolPolicy(grpc::ServerContext* context, const v1::SetPoolPolicyRequest* request,
                                       v1::Pool* response) {
  return Serve("SetPoolPolicy", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    PolicyChange change;
    if (request->has_priority()) change.priority = request->priority();
    if (request->has_min_bytes()) change.min_bytes = request->min_bytes();
    if (request->has_max_bytes()) change.max_bytes = request->max_bytes();
    if (request->has_reclaim_timeout_ms()) {
      change.reclaim_timeout = absl::Milliseconds(std::min<uint64_t>(request->reclaim_timeout_ms(), uint64_t{1} << 40));
    }
    if (request->has_on_reclaim_timeout()) {
      KVD_ASSIGN_OR_RETURN(change.on_timeout, FromProto(request->on_reclaim_timeout(), "policy.on_reclaim_timeout"));
    }
    if (change.empty()) {
      return absl::InvalidArgumentError(
          "policy: set at least one of priority, min_bytes, max_bytes, reclaim_timeout_ms, on_reclaim_timeout");
    }
    KVD_ASSIGN_OR_RETURN(PoolView pool, manager_->SetPoolPolicy(caller, request->pool(), change));
    *response = ToProto(pool);
    spdlog::info("pool {}: policy set by uid {}: {}", request->pool(), caller.uid, DescribePolicy(pool.claim.policy));
    return absl::OkStatus();
  });
}

grpc::Status KvdService::AnswerReportUsage(grpc::ServerContext* context, const v1::ReportUsageRequest* request,
                                           v1::ReportUsageResponse*) {
  return Serve("ReportUsage", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    return manager_->ReportUsage(caller, request->pool(),
                                 {.live_blocks = request->live_blocks(),
                                  .evictable_blocks = request->evictable_blocks(),
                                  .used_blocks = request->used_blocks()});
  });
}

grpc::Status KvdService::AnswerDeclineReclaim(grpc::ServerContext* context, const v1::DeclineReclaimRequest* request,
                                              v1::DeclineReclaimResponse*) {
  return Serve("DeclineReclaim", *context, {{request->pool(), "pool"}}, [&](const Caller& caller) -> absl::Status {
    if (request->reclaim_id() == 0) return absl::InvalidArgumentError("reclaim_id: must be > 0");
    KVD_RETURN_IF_ERROR(manager_->DeclineReclaim(caller, request->pool(), request->reclaim_id(), request->reason()));
    spdlog::info("pool {}: reclaim {} declined by pid {}: {}", request->pool(), request->reclaim_id(), caller.pid,
                 absl::CEscape(request->reason().substr(0, 256)));
    return absl::OkStatus();
  });
}

}  // namespace kvd::daemon
