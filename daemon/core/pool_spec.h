// Validation of what a request asks a pool to be (docs/reliability.md "Bad input", docs/layouts.md on
// overflow: every field validated, every product overflow-checked, every message naming its field), and the plan a
// valid spec resolves to: the layout chain's result and the geometry on this device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/core/geometry.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/policy.h"

namespace kvd::daemon {

inline constexpr size_t kMaxNameLength = 64;

// [A-Za-z0-9._-]{1,64}, not starting with '.' or '-'. INVALID_ARGUMENT naming `field`.
[[nodiscard]] absl::Status ValidateName(absl::string_view name, absl::string_view field);

inline constexpr uint32_t kMaxGroupSize = 1024;
inline constexpr size_t kMaxDeviceUuidLength = 128;

// One rank of an engine group (the pools of one engine's tensor-parallel ranks, one per daemon).
// An empty name means the pool belongs to no group.
struct GroupMembership {
  std::string name;
  uint32_t rank = 0;
  uint32_t size = 0;
  bool operator==(const GroupMembership&) const = default;
};

struct PoolSpec {
  std::string name;
  PoolDims dims;
  uint64_t initial_blocks = 0;
  LayoutRequest layout_request;
  std::vector<uint32_t> allowed_uids;
  GroupMembership group;
  std::vector<std::string> peer_devices;  // device UUIDs granted peer access; "*": every device
  PoolPolicy policy;                      // checked by the Arbiter (policy.h), not by PlanPool
};

// A group name, 1 <= size <= kMaxGroupSize and rank < size; or nothing set at all.
[[nodiscard]] absl::Status ValidateGroup(const GroupMembership& group, absl::string_view field);
// A device UUID as a backend reports it ("GPU-…", "host-…"): letters, digits and '-', at most
// kMaxDeviceUuidLength; or "*" where `allow_any`.
[[nodiscard]] absl::Status ValidateDeviceUuid(absl::string_view uuid, absl::string_view field, bool allow_any);

// What the device allows a pool to be.
struct DeviceLimits {
  uint64_t granularity = 0;
  uint64_t max_reserved_bytes = 0;  // the most VA one pool may reserve
};

struct PoolPlan {
  LayoutResolution layout;
  Geometry geometry;
};

// Validates `spec`, resolves its layout and computes its geometry: INVALID_ARGUMENT naming the field
// for malformed input, FAILED_PRECONDITION for conflicting backend requirements.
[[nodiscard]] absl::StatusOr<PoolPlan> PlanPool(const PoolSpec& spec, const LayoutPolicy& policy,
                                                const DeviceLimits& limits);

}  // namespace kvd::daemon
