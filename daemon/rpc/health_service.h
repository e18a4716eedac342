// HealthService: grpc.health.v1.Health (proto/grpc/health/v1/health.proto, docs/api.md "Health and reflection"),
// served by kvd itself rather than by gRPC's default service, which runs on gRPC's callback API (Note [No callback
// API] in docs/architecture.md). Check is a synchronous method; Watch is an AsyncStream on kvd's completion threads
// that writes the name's status at once and then each change.
//
// A name is known once a status was set for it; Check answers NOT_FOUND for any other, Watch SERVICE_UNKNOWN
// until it is set. Shutdown sets every name NOT_SERVING for good (later sets are ignored) and ends each Watch
// with OK once it has written that. Thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvd::daemon {

using HealthServiceBase = grpc::health::v1::Health::WithAsyncMethod_Watch<grpc::health::v1::Health::Service>;

class HealthService final : public HealthServiceBase {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  grpc::Status Check(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;

  void SetServingStatus(const std::string& service, bool serving) ABSL_LOCKS_EXCLUDED(mu_);
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);
  // Serves Watch on `cq` (CompletionThreads', daemon/rpc/async_stream.h), after the server started.
  void ListenForWatches(grpc::ServerCompletionQueue* cq);

 private:
  class WatchStream;

  // The name's status, and whether the service is shut down.
  ServingStatus StatusOf(const std::string& service, bool* shut_down) ABSL_LOCKS_EXCLUDED(mu_);
  void Watched(std::weak_ptr<WatchStream> stream) ABSL_LOCKS_EXCLUDED(mu_);
  // Each open Watch may have a status to write.
  void PumpWatches() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, bool> serving_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::weak_ptr<WatchStream>> watches_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvd::daemon
