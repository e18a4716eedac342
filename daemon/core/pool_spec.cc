#include "daemon/core/pool_spec.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kvd/status.h"

namespace kvd::daemon {

absl::Status ValidateName(absl::string_view name, absl::string_view field) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  if (name.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", name.size(), " characters, at most ", kMaxNameLength, " allowed"));
  }
  if (name.front() == '.' || name.front() == '-') {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must not start with '", name.substr(0, 1), "'"));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(field, ": character 0x", absl::Hex(static_cast<unsigned char>(c)),
                                                     " is not allowed (allowed: letters, digits, '.', '_', '-')"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateGroup(const GroupMembership& group, absl::string_view field) {
  if (group.name.empty()) {
    if (group.rank != 0 || group.size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".name: required when rank or size is set"));
    }
    return absl::OkStatus();
  }
  KVD_RETURN_IF_ERROR(ValidateName(group.name, absl::StrCat(field, ".name")));
  if (group.size == 0 || group.size > kMaxGroupSize) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".size: ", group.size, " is not in [1, ", kMaxGroupSize, "]"));
  }
  if (group.rank >= group.size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".rank: ", group.rank, " is not less than ", field, ".size (", group.size, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateDeviceUuid(absl::string_view uuid, absl::string_view field, bool allow_any) {
  if (allow_any && uuid == "*") return absl::OkStatus();
  if (uuid.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  if (uuid.size() > kMaxDeviceUuidLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", uuid.size(), " characters, at most ", kMaxDeviceUuidLength, " allowed"));
  }
  for (char c : uuid) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(field, ": character 0x", absl::Hex(static_cast<unsigned char>(c)),
                                                     " is not allowed in a device UUID (letters, digits, '-'",
                                                     allow_any ? "; or \"*\" for every device)" : ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PoolPlan> PlanPool(const PoolSpec& spec, const LayoutPolicy& policy, const DeviceLimits& limits) {
  KVD_RETURN_IF_ERROR(ValidateName(spec.name, "name"));
  KVD_RETURN_IF_ERROR(ValidateGroup(spec.group, "group"));
  for (size_t i = 0; i < spec.peer_devices.size(); ++i) {
    KVD_RETURN_IF_ERROR(ValidateDeviceUuid(spec.peer_devices[i], absl::StrCat("peer_devices[", i, "]"), true));
  }
  KVD_ASSIGN_OR_RETURN(LayoutResolution layout, ResolveLayout(spec.layout_request, policy));
  KVD_ASSIGN_OR_RETURN(Geometry geometry, Geometry::Compute(layout.layout, spec.dims, limits.granularity));
  if (geometry.reserved_bytes() > limits.max_reserved_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dims.capacity_blocks: a pool of ", spec.dims.capacity_blocks, " blocks needs ", geometry.reserved_bytes(),
        " bytes of address space, more than the ", limits.max_reserved_bytes, " one pool may reserve"));
  }
  if (spec.initial_blocks > spec.dims.capacity_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("initial_blocks: ", spec.initial_blocks,
                                                   " exceeds dims.capacity_blocks (", spec.dims.capacity_blocks, ")"));
  }
  return PoolPlan{std::move(layout), std::move(geometry)};
}

}  // namespace kvd::daemon
