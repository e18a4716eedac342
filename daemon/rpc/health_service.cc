#include "daemon/rpc/health_service.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/rpc/async_stream.h"

namespace kvd::daemon {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class HealthService::WatchStream final : public AsyncStream<HealthCheckRequest, HealthCheckResponse> {
 public:
  explicit WatchStream(HealthService* service) : service_(service) {}

 private:
  void RequestCall(grpc::ServerContext* context, HealthCheckRequest* request, Writer* writer,
                   grpc::ServerCompletionQueue* cq, void* tag) override {
    service_->RequestWatch(context, request, writer, cq, cq, tag);
  }

  std::shared_ptr<AsyncStream> Successor() override { return std::make_shared<WatchStream>(service_); }

  grpc::Status Open() override {
    service_->Watched(std::static_pointer_cast<WatchStream>(shared_from_this()));
    return grpc::Status::OK;
  }

  bool NextLocked(HealthCheckResponse* message, End* end) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool shut_down = false;
    const ServingStatus status = service_->StatusOf(request().service(), &shut_down);
    if (!written_ || status != last_) {
      written_ = true;
      last_ = status;
      message->set_status(status);
      return true;
    }
    if (shut_down) *end = End{grpc::Status::OK, "the daemon is stopping"};
    return false;
  }

  void Closed(const End&) override {}

  HealthService* const service_;
  bool written_ ABSL_GUARDED_BY(mu_) = false;
  ServingStatus last_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
};

grpc::Status HealthService::Check(grpc::ServerContext*, const HealthCheckRequest* request,
                                  HealthCheckResponse* response) {
  absl::MutexLock lock(&mu_);
  auto it = serving_.find(request->service());
  if (it == serving_.end()) {
    std::vector<std::string> names;
    for (const auto& [name, serving] : serving_) names.push_back(absl::StrCat("\"", name, "\""));
    std::sort(names.begin(), names.end());
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("service: \"", request->service(), "\" is not a name kvd reports (it reports ",
                                     absl::StrJoin(names, ", "), ")"));
  }
  response->set_status(it->second ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING);
  return grpc::Status::OK;
}

void HealthService::SetServingStatus(const std::string& service, bool serving) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    serving_[service] = serving;
  }
  PumpWatches();
}

void HealthService::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    for (auto& [name, serving] : serving_) serving = false;
  }
  PumpWatches();
}

void HealthService::ListenForWatches(grpc::ServerCompletionQueue* cq) {
  std::make_shared<WatchStream>(this)->Listen(cq);
}

HealthService::ServingStatus HealthService::StatusOf(const std::string& service, bool* shut_down) {
  absl::MutexLock lock(&mu_);
  *shut_down = shut_down_;
  auto it = serving_.find(service);
  if (it == serving_.end()) return shut_down_ ? HealthCheckResponse::NOT_SERVING : HealthCheckResponse::SERVICE_UNKNOWN;
  return it->second ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

void HealthService::Watched(std::weak_ptr<WatchStream> stream) {
  absl::MutexLock lock(&mu_);
  std::erase_if(watches_, [](const std::weak_ptr<WatchStream>& w) { return w.expired(); });
  watches_.push_back(std::move(stream));
}

void HealthService::PumpWatches() {
  std::vector<std::weak_ptr<WatchStream>> watches;
  {
    absl::MutexLock lock(&mu_);
    watches = watches_;
  }
  for (const std::weak_ptr<WatchStream>& w : watches) {
    if (std::shared_ptr<WatchStream> stream = w.lock()) stream->Pump();
  }
}

}  // namespace kvd::daemon
