// absl::Status <-> grpc::Status. Abseil's and gRPC's status codes are the same canonical codes
// (google.rpc.Code), so the mapping keeps the code and the message unchanged in both directions; a
// code outside the canonical range becomes UNKNOWN. Pure functions, thread-safe.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvd::daemon {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvd::daemon
