#include "daemon/codec/codec.h"

#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kvd/status.h"

namespace kvd::daemon {

uint64_t UnixMillis(absl::Time t) {
  const int64_t ms = absl::ToUnixMillis(t);
  return ms > 0 ? static_cast<uint64_t>(ms) : 0;
}

PoolDims FromProto(const v1::PoolDims& proto) {
  return {.layers = proto.layers(),
          .capacity_blocks = proto.capacity_blocks(),
          .heads = proto.heads(),
          .block_tokens = proto.block_tokens(),
          .channels = proto.channels(),
          .element_bytes = proto.element_bytes()};
}

v1::LayoutRule ToProto(LayoutRule rule) {
  switch (rule) {
    case LayoutRule::kRequestOverride:
      return v1::LAYOUT_RULE_REQUEST_OVERRIDE;
    case LayoutRule::kOperatorOverride:
      return v1::LAYOUT_RULE_OPERATOR_OVERRIDE;
    case LayoutRule::kBackendRequirement:
      return v1::LAYOUT_RULE_BACKEND_REQUIREMENT;
    case LayoutRule::kClientEnv:
      return v1::LAYOUT_RULE_CLIENT_ENV;
    case LayoutRule::kDaemonEnv:
      return v1::LAYOUT_RULE_DAEMON_ENV;
    case LayoutRule::kConnectorPreference:
      return v1::LAYOUT_RULE_CONNECTOR_PREFERENCE;
    case LayoutRule::kDefault:
      return v1::LAYOUT_RULE_DEFAULT;
  }
  return v1::LAYOUT_RULE_UNSPECIFIED;
}

v1::LayoutResolution ToProto(const LayoutResolution& resolution) {
  v1::LayoutResolution p;
  ToProto(resolution, &p);
  return p;
}

void ToProto(const LayoutResolution& resolution, v1::LayoutResolution* out) {
  v1::LayoutResolution& p = *out;
  p.set_layout(std::string(resolution.layout.name()));
  p.set_rule(ToProto(resolution.rule));
  p.set_rule_detail(resolution.rule_detail);
  for (Layout l : resolution.allowed.layouts()) p.add_allowed_layouts(std::string(l.name()));
  for (const std::string& w : resolution.warnings) p.add_warnings(w);
}

v1::PoolDims ToProto(const PoolDims& dims) {
  v1::PoolDims p;
  ToProto(dims, &p);
  return p;
}

void ToProto(const PoolDims& dims, v1::PoolDims* out) {
  v1::PoolDims& p = *out;
  p.set_layers(dims.layers);
  p.set_capacity_blocks(dims.capacity_blocks);
  p.set_heads(dims.heads);
  p.set_block_tokens(dims.block_tokens);
  p.set_channels(dims.channels);
  p.set_element_bytes(dims.element_bytes);
}

v1::Backend ToProto(BackendKind backend) {
  switch (backend) {
    case BackendKind::kHost:
      return v1::BACKEND_HOST;
    case BackendKind::kCuda:
      return v1::BACKEND_CUDA;
    case BackendKind::kHip:
      return v1::BACKEND_HIP;
  }
  return v1::BACKEND_UNSPECIFIED;
}

v1::PoolState ToProto(PoolState state) {
  switch (state) {
    case PoolState::kAwake:
      return v1::POOL_STATE_AWAKE;
    case PoolState::kSleeping:
      return v1::POOL_STATE_SLEEPING;
    case PoolState::kRecovering:
      return v1::POOL_STATE_RECOVERING;
  }
  return v1::POOL_STATE_UNSPECIFIED;
}

v1::PoolMetadata ToProto(absl::string_view pool, const PoolMetadata& metadata) {
  v1::PoolMetadata p;
  p.set_pool(std::string(pool));
  p.set_version(metadata.version);
  p.set_data(metadata.data);
  if (metadata.version > 0) p.set_updated_at_unix_ms(UnixMillis(metadata.updated_at));
  return p;
}

v1::ReclaimAction ToProto(ReclaimAction action) {
  switch (action) {
    case ReclaimAction::kNone:
      return v1::RECLAIM_ACTION_NONE;
    case ReclaimAction::kShrink:
      return v1::RECLAIM_ACTION_SHRINK;
    case ReclaimAction::kSleep:
      return v1::RECLAIM_ACTION_SLEEP;
  }
  return v1::RECLAIM_ACTION_NONE;
}

absl::StatusOr<ReclaimAction> FromProto(v1::ReclaimAction action, absl::string_view field) {
  switch (action) {
    case v1::RECLAIM_ACTION_UNSPECIFIED:
    case v1::RECLAIM_ACTION_NONE:
      return ReclaimAction::kNone;
    case v1::RECLAIM_ACTION_SHRINK:
      return ReclaimAction::kShrink;
    case v1::RECLAIM_ACTION_SLEEP:
      return ReclaimAction::kSleep;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", static_cast<int>(action), " is not one of NONE, SHRINK, SLEEP"));
  }
}

v1::PoolPolicy ToProto(const PoolPolicy& policy) {
  v1::PoolPolicy p;
  ToProto(policy, &p);
  return p;
}

void ToProto(const PoolPolicy& policy, v1::PoolPolicy* out) {
  v1::PoolPolicy& p = *out;
  p.set_priority(policy.priority);
  p.set_min_bytes(policy.min_bytes);
  p.set_max_bytes(policy.max_bytes);
  p.set_reclaim_timeout_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(policy.reclaim_timeout)));
  p.set_on_reclaim_timeout(ToProto(policy.on_timeout));
}

absl::StatusOr<PoolPolicy> FromProto(const v1::PoolPolicy& proto, absl::string_view field) {
  PoolPolicy policy{.priority = proto.priority(), .min_bytes = proto.min_bytes(), .max_bytes = proto.max_bytes()};
  // Far past the maximum either way; checked against it by ValidatePolicy.
  policy.reclaim_timeout = absl::Milliseconds(std::min<uint64_t>(proto.reclaim_timeout_ms(), uint64_t{1} << 40));
  KVD_ASSIGN_OR_RETURN(policy.on_timeout,
                       FromProto(proto.on_reclaim_timeout(), absl::StrCat(field, ".on_reclaim_timeout")));
  return policy;
}

PoolMetadata FromProto(const v1::PoolMetadata& proto) {
  return {.version = proto.version(),
          .data = proto.data(),
          .updated_at = absl::FromUnixMillis(static_cast<int64_t>(proto.updated_at_unix_ms()))};
}

absl::StatusOr<LayoutResolution> FromProto(const v1::LayoutResolution& proto) {
  LayoutResolution r;
  KVD_ASSIGN_OR_RETURN(r.layout, Layout::Parse(proto.layout(), "layout.layout"));
  bool known = false;
  for (LayoutRule rule :
       {LayoutRule::kRequestOverride, LayoutRule::kOperatorOverride, LayoutRule::kBackendRequirement,
        LayoutRule::kClientEnv, LayoutRule::kDaemonEnv, LayoutRule::kConnectorPreference, LayoutRule::kDefault}) {
    if (ToProto(rule) == proto.rule()) {
      r.rule = rule;
      known = true;
    }
  }
  if (!known) return absl::InvalidArgumentError(absl::StrCat("layout.rule: ", proto.rule(), " is not a known rule"));
  r.rule_detail = proto.rule_detail();
  r.allowed = LayoutSet::None();
  for (int i = 0; i < proto.allowed_layouts_size(); ++i) {
    KVD_ASSIGN_OR_RETURN(LayoutSet one,
                         LayoutSet::Parse(proto.allowed_layouts(i), absl::StrCat("layout.allowed_layouts[", i, "]")));
    r.allowed = r.allowed.Union(one);
  }
  r.warnings = {proto.warnings().begin(), proto.warnings().end()};
  return r;
}

ChunkInfo FromProto(const v1::Chunk& proto) {
  return {.id = proto.id(),
          .segment = proto.segment(),
          .offset = proto.offset(),
          .bytes = proto.bytes(),
          .fabric_handle =
              proto.fabric_handle().empty() ? nullptr : std::make_shared<const std::string>(proto.fabric_handle())};
}

void ToProto(const ChunkInfo& chunk, v1::Chunk* out) {
  out->set_id(chunk.id);
  out->set_segment(chunk.segment);
  out->set_offset(chunk.offset);
  out->set_bytes(chunk.bytes);
  if (chunk.fabric_handle != nullptr) out->set_fabric_handle(*chunk.fabric_handle);
}

v1::Chunk ToProto(const ChunkInfo& chunk) {
  v1::Chunk p;
  ToProto(chunk, &p);
  return p;
}

v1::LimitExceeded ToProto(const LimitRefusal& refusal) {
  v1::LimitExceeded p;
  p.set_limit(std::string(LimitFlag(refusal.limit)).substr(2));  // the flag without "--"
  p.set_uid(refusal.uid);
  p.set_allowed(refusal.allowed);
  p.set_used(refusal.used);
  p.set_asked(refusal.asked);
  return p;
}

void AppendDetails(const absl::Status& status, google::protobuf::RepeatedPtrField<google::protobuf::Any>* details) {
  if (const std::optional<LimitRefusal> refusal = LimitRefusalOf(status); refusal.has_value()) {
    details->Add()->PackFrom(ToProto(*refusal));
  }
}

}  // namespace kvd::daemon
