// The layout precedence chain (docs/layouts.md, "The precedence chain"): the daemon is its single
// writer. Resolution is a pure function of the request and the daemon's policy, so the same inputs
// always give the same layout; the result says which rule won and what was ignored, and why.
//
//   1. override    the request's override_layout, else the operator's --layout-override
//   2. backend     the intersection of every backend's allowed set; a single survivor wins
//   3. env         KVD_KV_CACHE_LAYOUT from the engine (forwarded), else the daemon's own;
//                  ignored with a warning when outside the allowed set
//   4. connector   the first connector preference inside the allowed set
//   5. default     LBNHC if allowed, else the first allowed layout in canonical order
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/core/layout.h"

namespace kvd::daemon {

enum class LayoutRule {
  kRequestOverride,
  kOperatorOverride,
  kBackendRequirement,
  kClientEnv,
  kDaemonEnv,
  kConnectorPreference,
  kDefault,
};
// "request override", "operator override", "backend requirement", "client env", "daemon env",
// "connector preference", "default".
const char* LayoutRuleName(LayoutRule rule);

struct BackendRequirement {
  std::string backend;               // named in messages
  std::vector<std::string> layouts;  // layouts and/or classes; the backend accepts their union
};

struct ConnectorPreference {
  std::string connector;
  std::string layout;  // a single layout
};

// What an engine asks for (proto LayoutRequest). Strings are parsed and validated by Resolve.
struct LayoutRequest {
  std::string override_layout;
  std::vector<BackendRequirement> backend_requirements;
  std::string env_layout;  // KVD_KV_CACHE_LAYOUT forwarded from the engine's environment
  std::vector<ConnectorPreference> connector_preferences;
};

// The daemon's side of the chain, fixed at start-up.
struct LayoutPolicy {
  std::optional<Layout> operator_override;  // --layout-override
  std::optional<Layout> daemon_env;         // KVD_KV_CACHE_LAYOUT of the daemon's environment
};

struct LayoutResolution {
  Layout layout = Layout::Default();
  LayoutRule rule = LayoutRule::kDefault;
  std::string rule_detail;  // "backend FLASH_ATTN", "connector nixl", ...
  LayoutSet allowed = LayoutSet::Any();
  std::vector<std::string> warnings;
};

// INVALID_ARGUMENT (naming the field, e.g. "layout_request.backend_requirements[1].layouts[0]") for
// unknown layouts or classes, empty requirement sets, empty names; FAILED_PRECONDITION naming both
// backends when the requirements have no layout in common and no override decides.
[[nodiscard]] absl::StatusOr<LayoutResolution> ResolveLayout(const LayoutRequest& request, const LayoutPolicy& policy);

}  // namespace kvd::daemon
