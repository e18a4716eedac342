// KvdService: the kvd.v1.Kvd gRPC service (proto/kvd/v1/kvd.proto, docs/api.md). A thin translation:
// each method checks the request's shape, authenticates the caller from the "kvd-session" metadata
// (except GetDeviceInfo and ResolveLayout), makes one PoolManager call, converts the result and
// finishes with the core's status, code and message unchanged. Policy, locking and validation of
// values live in the core. What every method shares is written once, in Serve (Note [One RPC, one row]
// in docs/architecture.md).
//
// Logging: this is the edge. A failed RPC is logged once at warn (method, code, message); a successful
// change (create, delete, attach, detach, grow, shrink, sleep, wake) once at info.
//
// Watch is the client's liveness: its stream is an AsyncStream that writes the client's events as its EventQueue
// receives them and, whenever it ends (the client cancelled, the client detached, the pool was deleted, the daemon
// is stopping), detaches the client (Note [Watch streams are pushed]).
//
// Threads: kvd uses no method of gRPC's callback API, whose threads would take part in every call and grow with the
// machine's CPUs (Note [No callback API] in docs/architecture.md). kvd's completion threads (CompletionThreads,
// daemon/rpc/async_stream.h) run the Watch streams and answer the quick RPCs inline (ResolveLayout,
// GetPool, ListPools, GetPoolMetadata, DescribeTransfer, Acknowledge, ReportUsage, DeclineReclaim: reads and
// bookkeeping that never wait for a pool's op_mu, a pause, a release, a deadline or another RPC), and Attach while
// nothing holds its pool (else on a thread of its own: Note [Attach answers inline when it can]); the synchronous
// gRPC server's threads call every other unary method concurrently, since those may wait (Note [Quick RPCs answer
// inline]). Every reply that carries a pool's chunks is built on an arena (Note [Replies are built on an arena]).
// The service holds no state of its own beyond its constant configuration and the count of waiting attaches.
// `manager` must outlive the service, and the service the server and its completion threads (a Watch stream
// detaches its client when gRPC is done with it, which CompletionThreads::Stop waits for).
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/pool_manager.h"
#include "kvd/v1/kvd.grpc.pb.h"

namespace kvd::daemon {

class ControlSocket;
class HandleChannel;
class Metrics;

// The quick RPCs, Attach and Watch are raw methods of gRPC's asynchronous API, served on kvd's completion threads
// (Note [No callback API] and Note [Quick RPCs answer inline] in docs/architecture.md): kvd parses each request and
// serializes each reply itself, on an arena of the call's (Note [Replies are built on an arena]). Every other RPC is
// a method of gRPC's synchronous server; the resizes are streamed unary methods there, whose handlers write their
// replies on an arena too.
using KvdServiceBase = v1::Kvd::WithRawMethod_Watch<v1::Kvd::WithRawMethod_ResolveLayout<
    v1::Kvd::WithRawMethod_GetPool<v1::Kvd::WithRawMethod_ListPools<v1::Kvd::WithRawMethod_GetPoolMetadata<
        v1::Kvd::WithRawMethod_DescribeTransfer<v1::Kvd::WithRawMethod_Acknowledge<v1::Kvd::WithRawMethod_ReportUsage<
            v1::Kvd::WithRawMethod_DeclineReclaim<v1::Kvd::WithRawMethod_Attach<v1::Kvd::WithStreamedUnaryMethod_Grow<
                v1::Kvd::WithStreamedUnaryMethod_Shrink<v1::Kvd::WithStreamedUnaryMethod_Compact<
                    v1::Kvd::WithStreamedUnaryMethod_Sleep<v1::Kvd::WithStreamedUnaryMethod_Wake<
                        v1::Kvd::WithStreamedUnaryMethod_Commit<v1::Kvd::Service>>>>>>>>>>>>>>>>;

class KvdService final : public KvdServiceBase {
 public:
  struct Options {
    uint64_t granularity = 0;  // the device's, for ResolveLayout's geometry
    // Shrink/Sleep with wait_for_release and no RPC deadline wait at most this long.
    absl::Duration default_release_wait = absl::Seconds(60);
    // Not owned; may be null (no metrics). Counts every RPC's status and times grow, shrink, sleep,
    // wake and attach.
    Metrics* metrics = nullptr;
    // Not owned; may be null (then a session token is not checked against the connection's peer). The
    // control socket that accepted every connection: a session token presented on a connection whose
    // SO_PEERCRED uid is not the session's is PERMISSION_DENIED.
    const ControlSocket* peers = nullptr;
    // Not owned; may be null (then AttachRequest.push_handles is not honoured: handles_pushed stays false). The
    // handle channel on whose session connections Attach pushes leases (docs/api.md, "Pushed handles").
    HandleChannel* handles = nullptr;
  };

  KvdService(PoolManager* manager, Options options);

  // Serves the methods on gRPC's asynchronous API on `cq` (CompletionThreads', daemon/rpc/async_stream.h), after
  // the server started.
  void ListenForCalls(grpc::ServerCompletionQueue* cq);
  // After grpc::Server::Shutdown, before the completion threads stop: waits for the Attach calls that wait for their
  // pool on a thread of their own (Note [Attach answers inline when it can]) to finish.
  void WaitForAttaches() ABSL_LOCKS_EXCLUDED(attach_mu_);

  // Synchronous: the driver's free-memory query may wait for the driver (Note [Quick RPCs answer inline]).
  grpc::Status GetDeviceInfo(grpc::ServerContext* context, const v1::GetDeviceInfoRequest* request,
                             v1::DeviceInfo* response) override;
  grpc::Status CreatePool(grpc::ServerContext* context, const v1::CreatePoolRequest* request,
                          v1::Pool* response) override;
  grpc::Status DeletePool(grpc::ServerContext* context, const v1::DeletePoolRequest* request,
                          v1::DeletePoolResponse* response) override;

  grpc::Status Detach(grpc::ServerContext* context, const v1::DetachRequest* request,
                      v1::DetachResponse* response) override;
  grpc::Status StreamedGrow(grpc::ServerContext* context,
                            grpc::ServerUnaryStreamer<v1::GrowRequest, v1::PoolUpdate>* stream) override;
  grpc::Status StreamedShrink(grpc::ServerContext* context,
                              grpc::ServerUnaryStreamer<v1::ShrinkRequest, v1::PoolUpdate>* stream) override;
  grpc::Status StreamedCompact(grpc::ServerContext* context,
                               grpc::ServerUnaryStreamer<v1::CompactRequest, v1::PoolUpdate>* stream) override;
  grpc::Status StreamedSleep(grpc::ServerContext* context,
                             grpc::ServerUnaryStreamer<v1::SleepRequest, v1::PoolUpdates>* stream) override;
  grpc::Status StreamedWake(grpc::ServerContext* context,
                            grpc::ServerUnaryStreamer<v1::WakeRequest, v1::PoolUpdates>* stream) override;
  grpc::Status ZeroBlocks(grpc::ServerContext* context, const v1::ZeroBlocksRequest* request,
                          v1::ZeroBlocksResponse* response) override;
  grpc::Status Prepare(grpc::ServerContext* context, const v1::PrepareRequest* request,
                       v1::PrepareResponse* response) override;
  grpc::Status StreamedCommit(grpc::ServerContext* context,
                              grpc::ServerUnaryStreamer<v1::CommitRequest, v1::PoolUpdate>* stream) override;
  grpc::Status Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override;
  grpc::Status GrantPeerAccess(grpc::ServerContext* context, const v1::GrantPeerAccessRequest* request,
                               v1::Pool* response) override;
  grpc::Status CopyBlocks(grpc::ServerContext* context, const v1::CopyBlocksRequest* request,
                          v1::CopyBlocksResponse* response) override;
  grpc::Status ExportRanges(grpc::ServerContext* context, const v1::ExportRangesRequest* request,
                            v1::ExportRangesResponse* response) override;
  grpc::Status SetPoolMetadata(grpc::ServerContext* context, const v1::SetPoolMetadataRequest* request,
                               v1::PoolMetadata* response) override;
  grpc::Status SetPoolPolicy(grpc::ServerContext* context, const v1::SetPoolPolicyRequest* request,
                             v1::Pool* response) override;

  // A string field of the request that must not be empty: "<name>: must not be empty" otherwise.
  struct Required {
    const std::string& value;
    const char* name;
  };

 private:
  class WatchStream;
  template <typename Request, typename Reply>
  class QuickCall;
  using AttachCall = QuickCall<v1::AttachRequest, v1::AttachResponse>;

  // The quick RPCs' handlers, run inline by their QuickCall (Note [Quick RPCs answer inline]).
  grpc::Status AnswerResolveLayout(grpc::ServerContext* context, const v1::ResolveLayoutRequest* request,
                                   v1::ResolveLayoutResponse* response);
  grpc::Status AnswerGetPool(grpc::ServerContext* context, const v1::GetPoolRequest* request, v1::Pool* response);
  grpc::Status AnswerListPools(grpc::ServerContext* context, const v1::ListPoolsRequest* request,
                               v1::ListPoolsResponse* response);
  grpc::Status AnswerAcknowledge(grpc::ServerContext* context, const v1::AcknowledgeRequest* request,
                                 v1::AcknowledgeResponse* response);
  grpc::Status AnswerDescribeTransfer(grpc::ServerContext* context, const v1::DescribeTransferRequest* request,
                                      v1::DescribeTransferResponse* response);
  grpc::Status AnswerGetPoolMetadata(grpc::ServerContext* context, const v1::GetPoolMetadataRequest* request,
                                     v1::PoolMetadata* response);
  grpc::Status AnswerReportUsage(grpc::ServerContext* context, const v1::ReportUsageRequest* request,
                                 v1::ReportUsageResponse* response);
  grpc::Status AnswerDeclineReclaim(grpc::ServerContext* context, const v1::DeclineReclaimRequest* request,
                                    v1::DeclineReclaimResponse* response);

  // Note [Attach answers inline when it can]: inline while nothing holds the pool, else on a thread of its own that
  // waits for it and finishes `call` from there.
  void AnswerAttach(AttachCall* call);
  // Attach's work: without `wait`, sets `*busy` and does nothing while another operation holds the pool.
  absl::Status AttachNow(const grpc::ServerContext& context, const v1::AttachRequest& request,
                         v1::AttachResponse* response, bool wait, bool* busy);

  // The ceremony every RPC shares (Note [One RPC, one row] in docs/architecture.md), around `body`, the part
  // that is the RPC's own. A `body` that takes the Caller is an RPC with a session: the caller is authenticated
  // first (UNAUTHENTICATED, PERMISSION_DENIED), then every `required` field checked, then `body` runs; no
  // exception leaves it (RESOURCE_EXHAUSTED for allocation failures, INTERNAL otherwise, naming `method`).
  // Serve finishes the RPC with that status (Finish); Run returns it, for Watch, whose stream outlives its
  // handler. `method` is the RPC's name in the proto, the label of its log lines and metrics.
  template <typename Body>
  [[nodiscard]] absl::Status Run(const char* method, const grpc::ServerContextBase& context,
                                 std::initializer_list<Required> required, Body&& body) const;
  template <typename Body>
  grpc::Status Serve(const char* method, const grpc::ServerContextBase& context,
                     std::initializer_list<Required> required, Body&& body) const;
  // A synchronous RPC whose reply is built on an arena (Note [Replies are built on an arena]): reads the request
  // from `stream`, runs `body(request, reply)` (which calls Serve) and writes the reply if it succeeded.
  template <typename Request, typename Reply, typename Body>
  grpc::Status OnArena(grpc::ServerUnaryStreamer<Request, Reply>* stream, Body&& body) const;
  // The caller named by the "kvd-session" metadata: UNAUTHENTICATED when it is missing or unknown, or
  // when the connection's peer is unknown; PERMISSION_DENIED when the connection's uid (SO_PEERCRED)
  // is not the uid that opened the session.
  [[nodiscard]] absl::StatusOr<Caller> Authenticate(const grpc::ServerContextBase& context) const;
  // The call's deadline and cancellation, for work done in slices.
  Interrupt InterruptOf(const grpc::ServerContextBase& context) const;
  // The RPC's deadline, or now + default_release_wait when it has none.
  absl::Time ReleaseDeadline(const grpc::ServerContextBase& context) const;
  // The edge: every RPC's status passes here once; a failure is logged once and every status counted.
  grpc::Status Finish(const char* method, const absl::Status& status) const;

  PoolManager* const manager_;
  const Options options_;
  absl::Mutex attach_mu_;
  int waiting_attaches_ ABSL_GUARDED_BY(attach_mu_) = 0;
};

// A server interceptor that answers a request gRPC could not parse (a malformed message, or a string
// field that is not UTF-8: protobuf refuses those before any handler runs, and gRPC would answer
// INTERNAL with no message) with INVALID_ARGUMENT "request: ... is not a valid kvd.v1.<Type> ...".
// Register it with ServerBuilder::experimental().SetInterceptorCreators.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeParseErrorInterceptorFactory();

}  // namespace kvd::daemon
