#include "daemon/rpc/status.h"

#include <string>

#include "daemon/codec/codec.h"
#include "kvd/v1/kvd.pb.h"

namespace kvd::daemon {
namespace {

// Both enums number the canonical codes 0 (OK) .. 16 (UNAUTHENTICATED) identically.
constexpr int kMaxCanonicalCode = 16;

bool IsCanonical(int code) { return code >= 0 && code <= kMaxCanonicalCode; }

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  const grpc::StatusCode mapped = IsCanonical(code) ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN;
  std::string message(status.message());
  v1::RpcStatus rich;
  AppendDetails(status, rich.mutable_details());
  if (rich.details().empty()) return grpc::Status(mapped, std::move(message));
  rich.set_code(static_cast<int32_t>(mapped));
  rich.set_message(message);
  return grpc::Status(mapped, std::move(message), rich.SerializeAsString());
}

}  // namespace kvd::daemon
