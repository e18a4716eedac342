// The core's value types <-> their kvd.v1 messages: the pieces that both the API (daemon/rpc/convert.h)
// and the saved state (daemon/state/, kvd/state.proto) are made of. Pure functions, no I/O; FromProto
// validates nothing beyond shape. Depends on the core and the generated messages only, so `rpc -> codec`
// and `state -> codec` with no edge between rpc and state (docs/architecture.md, "Layers").
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/limits.h"
#include "daemon/core/pool_spec.h"
#include "daemon/core/pool_types.h"
#include "google/protobuf/any.pb.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "kvd/device.h"
#include "kvd/v1/kvd.pb.h"

namespace kvd::daemon {

// Unix milliseconds; 0 for a time before the epoch.
uint64_t UnixMillis(absl::Time t);

PoolDims FromProto(const v1::PoolDims& proto);
v1::PoolDims ToProto(const PoolDims& dims);
void ToProto(const PoolDims& dims, v1::PoolDims* out);
v1::LayoutRule ToProto(LayoutRule rule);
v1::LayoutResolution ToProto(const LayoutResolution& resolution);
// The same into `out`, on its arena if it has one (a reply built on an arena copies a message assigned to it).
void ToProto(const LayoutResolution& resolution, v1::LayoutResolution* out);
// INVALID_ARGUMENT for a layout or rule this build does not know.
absl::StatusOr<LayoutResolution> FromProto(const v1::LayoutResolution& proto);
v1::Backend ToProto(BackendKind backend);
v1::PoolState ToProto(PoolState state);
v1::PoolMetadata ToProto(absl::string_view pool, const PoolMetadata& metadata);
PoolMetadata FromProto(const v1::PoolMetadata& proto);
v1::Chunk ToProto(const ChunkInfo& chunk);
// The same into `out`, on its arena if it has one.
void ToProto(const ChunkInfo& chunk, v1::Chunk* out);
ChunkInfo FromProto(const v1::Chunk& proto);
v1::ReclaimAction ToProto(ReclaimAction action);
// INVALID_ARGUMENT naming `field` for a value this build does not know (UNSPECIFIED is NONE).
absl::StatusOr<ReclaimAction> FromProto(v1::ReclaimAction action, absl::string_view field);
// operator_bounds travels beside it (Pool.policy_operator_bounds).
v1::PoolPolicy ToProto(const PoolPolicy& policy);
void ToProto(const PoolPolicy& policy, v1::PoolPolicy* out);
// INVALID_ARGUMENT naming "<field>.<member>" for an unknown on_reclaim_timeout or a timeout past 64 bits of
// milliseconds; the values are the Arbiter's to check (ValidatePolicy).
absl::StatusOr<PoolPolicy> FromProto(const v1::PoolPolicy& proto, absl::string_view field);

v1::LimitExceeded ToProto(const LimitRefusal& refusal);

// What `status` says in numbers, appended to `details` (an RpcStatus's or a HandleChannelError's): a
// kvd.v1.LimitExceeded for a limit's refusal (LimitRefusalOf); nothing for any other status.
void AppendDetails(const absl::Status& status, google::protobuf::RepeatedPtrField<google::protobuf::Any>* details);

}  // namespace kvd::daemon
