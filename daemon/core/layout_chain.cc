#include "daemon/core/layout_chain.h"

#include "absl/strings/str_cat.h"

namespace kvd::daemon {
namespace {

constexpr absl::string_view kField = "layout_request";

struct ParsedBackend {
  const BackendRequirement* requirement;
  LayoutSet allowed;
};

absl::StatusOr<std::vector<ParsedBackend>> ParseBackends(const LayoutRequest& request) {
  std::vector<ParsedBackend> out;
  for (size_t i = 0; i < request.backend_requirements.size(); ++i) {
    const BackendRequirement& r = request.backend_requirements[i];
    const std::string field = absl::StrCat(kField, ".backend_requirements[", i, "]");
    if (r.backend.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ".backend: must not be empty"));
    if (r.layouts.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".layouts: backend ", r.backend, " must allow at least one layout or class"));
    }
    LayoutSet allowed = LayoutSet::None();
    for (size_t j = 0; j < r.layouts.size(); ++j) {
      absl::StatusOr<LayoutSet> set = LayoutSet::Parse(r.layouts[j], absl::StrCat(field, ".layouts[", j, "]"));
      if (!set.ok()) return set.status();
      allowed = allowed.Union(*set);
    }
    out.push_back({&r, allowed});
  }
  return out;
}

// Names the backends whose requirements cannot all hold: a pair if one pair conflicts on its own.
absl::Status Conflict(const std::vector<ParsedBackend>& backends) {
  LayoutSet so_far = LayoutSet::Any();
  for (size_t i = 0; i < backends.size(); ++i) {
    const ParsedBackend& b = backends[i];
    for (size_t j = 0; j < i; ++j) {
      if (backends[j].allowed.Intersect(b.allowed).empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat(kField, ".backend_requirements: backend ", backends[j].requirement->backend, " requires ",
                         backends[j].allowed.ToString(), " but backend ", b.requirement->backend, " requires ",
                         b.allowed.ToString(), "; no layout satisfies both"));
      }
    }
    if (so_far.Intersect(b.allowed).empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(kField, ".backend_requirements: backend ", b.requirement->backend, " requires ",
                       b.allowed.ToString(), " but the backends before it together allow only ", so_far.ToString()));
    }
    so_far = so_far.Intersect(b.allowed);
  }
  return absl::OkStatus();
}

}  // namespace

// Both overrides are rule 1; see Note [Request override beats operator override] in docs/architecture.md.
const char* LayoutRuleName(LayoutRule rule) {
  switch (rule) {
    case LayoutRule::kRequestOverride:
      return "request override";
    case LayoutRule::kOperatorOverride:
      return "operator override";
    case LayoutRule::kBackendRequirement:
      return "backend requirement";
    case LayoutRule::kClientEnv:
      return "client env";
    case LayoutRule::kDaemonEnv:
      return "daemon env";
    case LayoutRule::kConnectorPreference:
      return "connector preference";
    case LayoutRule::kDefault:
      return "default";
  }
  return "unknown";
}

absl::StatusOr<LayoutResolution> ResolveLayout(const LayoutRequest& request, const LayoutPolicy& policy) {
  // Validate every input first: a malformed field is an error whichever rule ends up deciding.
  std::optional<Layout> request_override;
  if (!request.override_layout.empty()) {
    absl::StatusOr<Layout> l = Layout::Parse(request.override_layout, absl::StrCat(kField, ".override_layout"));
    if (!l.ok()) return l.status();
    request_override = *l;
  }
  std::optional<Layout> client_env;
  if (!request.env_layout.empty()) {
    absl::StatusOr<Layout> l = Layout::Parse(request.env_layout, absl::StrCat(kField, ".env_layout"));
    if (!l.ok()) return l.status();
    client_env = *l;
  }
  std::vector<Layout> connector_layouts;
  for (size_t i = 0; i < request.connector_preferences.size(); ++i) {
    const ConnectorPreference& c = request.connector_preferences[i];
    const std::string field = absl::StrCat(kField, ".connector_preferences[", i, "]");
    if (c.connector.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ".connector: must not be empty"));
    absl::StatusOr<Layout> l = Layout::Parse(c.layout, absl::StrCat(field, ".layout"));
    if (!l.ok()) return l.status();
    connector_layouts.push_back(*l);
  }
  absl::StatusOr<std::vector<ParsedBackend>> backends = ParseBackends(request);
  if (!backends.ok()) return backends.status();

  LayoutResolution r;
  for (const ParsedBackend& b : *backends) r.allowed = r.allowed.Intersect(b.allowed);

  // Decides `layout` by `rule` unless an earlier rule already did.
  bool decided = false;
  auto decide = [&](Layout layout, LayoutRule rule, std::string detail) {
    r.layout = layout;
    r.rule = rule;
    r.rule_detail = std::move(detail);
    decided = true;
  };

  // 1. Overrides win over everything; a violated backend requirement is worth a warning.
  if (request_override) {
    decide(*request_override, LayoutRule::kRequestOverride, "override_layout in the request");
  } else if (policy.operator_override) {
    decide(*policy.operator_override, LayoutRule::kOperatorOverride, "the daemon's --layout-override");
  }
  if (decided) {
    if (r.allowed.empty()) {
      r.warnings.push_back(absl::StrCat("the backend requirements conflict (no layout satisfies all of them); ",
                                        r.layout.name(), " is used because of the ", LayoutRuleName(r.rule)));
    } else if (!r.allowed.contains(r.layout)) {
      r.warnings.push_back(absl::StrCat(LayoutRuleName(r.rule), " ", r.layout.name(),
                                        " is outside the layouts the backends allow ", r.allowed.ToString()));
    }
  } else {
    // 2. Backend requirements.
    if (r.allowed.empty()) return Conflict(*backends);
    if (r.allowed.size() == 1) {
      std::string detail = "required by";
      for (const ParsedBackend& b : *backends) {
        if (b.allowed.size() < Layout::kCount) absl::StrAppend(&detail, " ", b.requirement->backend);
      }
      decide(r.allowed.layouts().front(), LayoutRule::kBackendRequirement, detail);
    }
  }

  // 3. The env var: the engine's forwarded value, else the daemon's own.
  const std::optional<Layout> env = client_env ? client_env : policy.daemon_env;
  const LayoutRule env_rule = client_env ? LayoutRule::kClientEnv : LayoutRule::kDaemonEnv;
  if (env && !decided) {
    if (r.allowed.contains(*env)) {
      decide(*env, env_rule, "KVD_KV_CACHE_LAYOUT");
    } else {
      r.warnings.push_back(absl::StrCat("KVD_KV_CACHE_LAYOUT=", env->name(), " (", LayoutRuleName(env_rule),
                                        ") ignored: outside the layouts the backends allow ", r.allowed.ToString()));
    }
  }

  // 4. Connector preferences, in order.
  for (size_t i = 0; i < connector_layouts.size(); ++i) {
    const Layout want = connector_layouts[i];
    const std::string& name = request.connector_preferences[i].connector;
    if (decided) {
      if (want != r.layout) {
        r.warnings.push_back(absl::StrCat("connector ", name, " prefers ", want.name(), "; ", r.layout.name(),
                                          " was chosen by the ", LayoutRuleName(r.rule)));
      }
    } else if (r.allowed.contains(want)) {
      decide(want, LayoutRule::kConnectorPreference, absl::StrCat("connector ", name));
    } else {
      r.warnings.push_back(absl::StrCat("connector ", name, " prefers ", want.name(),
                                        ", outside the layouts the backends allow ", r.allowed.ToString()));
    }
  }

  // 5. The default.
  if (!decided) {
    const Layout layout = r.allowed.contains(Layout::Default()) ? Layout::Default() : r.allowed.layouts().front();
    decide(layout, LayoutRule::kDefault,
           layout == Layout::Default() ? "LBNHC" : absl::StrCat("first allowed of ", r.allowed.ToString()));
  }
  return r;
}

}  // namespace kvd::daemon
