// absl::Status -> grpc::Status. Abseil's and gRPC's status codes are the same canonical codes
// (google.rpc.Code), so the mapping keeps the code and the message unchanged; a code outside the canonical
// range becomes UNKNOWN. What the status says in numbers (a limit's refusal) goes along as gRPC's error
// details, a serialized kvd.v1.RpcStatus (docs/api.md, "Errors"). Pure functions, thread-safe.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvd::daemon {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace kvd::daemon
