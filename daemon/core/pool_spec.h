// Validation of what a request asks a pool to be (DESIGN.md section 7: every field validated, every
// product overflow-checked, every message naming its field), and the plan a valid spec resolves to:
// the layout chain's result and the geometry on this device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/core/geometry.h"
#include "daemon/core/layout_chain.h"

namespace kvd {

inline constexpr size_t kMaxNameLength = 64;

// [A-Za-z0-9._-]{1,64}, not starting with '.' or '-'. INVALID_ARGUMENT naming `field`.
[[nodiscard]] absl::Status ValidateName(absl::string_view name, absl::string_view field);

struct PoolSpec {
  std::string name;
  PoolDims dims;
  uint64_t initial_blocks = 0;
  LayoutRequest layout_request;
  std::vector<uint32_t> allowed_uids;
};

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

}  // namespace kvd
