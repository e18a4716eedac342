#include "daemon/core/policy.h"

#include "absl/strings/str_cat.h"
#include "kvd/units.h"

namespace kvd::daemon {

const char* ReclaimActionName(ReclaimAction action) {
  switch (action) {
    case ReclaimAction::kNone:
      return "none";
    case ReclaimAction::kShrink:
      return "shrink";
    case ReclaimAction::kSleep:
      return "sleep";
  }
  return "?";
}

PoolPolicy Applied(const PoolPolicy& policy, const PolicyChange& change) {
  PoolPolicy next = policy;
  if (change.priority) next.priority = *change.priority;
  if (change.min_bytes) next.min_bytes = *change.min_bytes;
  if (change.max_bytes) next.max_bytes = *change.max_bytes;
  if (change.reclaim_timeout) next.reclaim_timeout = *change.reclaim_timeout;
  if (change.on_timeout) next.on_timeout = *change.on_timeout;
  return next;
}

absl::Status ValidatePolicy(const PoolPolicy& p, uint64_t capacity_bytes) {
  if (p.priority > kMaxPriority) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.priority: ", p.priority, " is past the highest priority, ", kMaxPriority));
  }
  if (p.min_bytes > capacity_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("policy.min_bytes: ", p.min_bytes, " bytes (",
                                                   FormatBytes(p.min_bytes), ") is more than the pool can hold (",
                                                   capacity_bytes, " bytes at dims.capacity_blocks)"));
  }
  if (p.max_bytes != 0 && p.min_bytes > p.max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.min_bytes: ", p.min_bytes, " bytes are more than policy.max_bytes, ", p.max_bytes));
  }
  if (p.reclaim_timeout < absl::ZeroDuration() || p.reclaim_timeout > kMaxReclaimTimeout) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.reclaim_timeout_ms: ", absl::ToInt64Milliseconds(p.reclaim_timeout),
                     " is past the maximum of ", absl::ToInt64Milliseconds(kMaxReclaimTimeout)));
  }
  if (p.on_timeout == ReclaimAction::kSleep && p.min_bytes > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.on_reclaim_timeout: a sleep gives the whole pool back, below its policy.min_bytes of ",
                     p.min_bytes, " bytes; guarantee nothing or choose SHRINK"));
  }
  return absl::OkStatus();
}

namespace {

// How much of a pool a deadline action leaves it: more is a stronger claim.
int Keeps(ReclaimAction action) {
  switch (action) {
    case ReclaimAction::kNone:
      return 2;
    case ReclaimAction::kShrink:
      return 1;
    case ReclaimAction::kSleep:
      return 0;
  }
  return 0;
}

}  // namespace

absl::Status AuthorizePolicy(absl::string_view pool, const PoolPolicy& old, const PoolPolicy& next, uint32_t caller_uid,
                             uint32_t owner_uid, uint64_t owner_guaranteed_elsewhere, const Limits& limits) {
  if (IsOperatorUid(caller_uid, limits.daemon_uid)) return absl::OkStatus();
  const bool granted_by_flag = !limits.claim_of.contains(owner_uid);
  const ClaimGrant& grant = limits.GrantOf(owner_uid);
  const std::string grant_flag =
      granted_by_flag ? std::string("--max-priority-per-uid") : absl::StrCat("--uid-claim=", owner_uid, ":priority=");
  if (next.priority > old.priority && next.priority > grant.max_priority) {
    return absl::PermissionDeniedError(absl::StrCat("policy.priority: uid ", caller_uid, " may give the pools of uid ",
                                                    owner_uid, " at most priority ", grant.max_priority, " (",
                                                    grant_flag, "), not ", next.priority));
  }
  if (next.min_bytes > old.min_bytes && owner_guaranteed_elsewhere + next.min_bytes > grant.guaranteed_bytes) {
    return absl::PermissionDeniedError(absl::StrCat(
        "policy.min_bytes: the pools of uid ", owner_uid, " may have ", grant.guaranteed_bytes, " bytes (",
        FormatBytes(grant.guaranteed_bytes), ") guaranteed in all (",
        granted_by_flag ? std::string("--max-guaranteed-per-uid")
                        : absl::StrCat("--uid-claim=", owner_uid, ":…,guaranteed="),
        "); its other pools hold ", owner_guaranteed_elsewhere, " bytes of that, so pool ", pool, " may have at most ",
        grant.guaranteed_bytes > owner_guaranteed_elsewhere ? grant.guaranteed_bytes - owner_guaranteed_elsewhere : 0,
        ", not ", next.min_bytes));
  }
  if (!old.operator_bounds) return absl::OkStatus();
  const std::string bound =
      absl::StrCat(" an operator set it on pool ", pool, "; uid ", caller_uid, " may tighten it, not loosen it");
  if (old.max_bytes != 0 && (next.max_bytes == 0 || next.max_bytes > old.max_bytes)) {
    return absl::PermissionDeniedError(absl::StrCat("policy.max_bytes: ", old.max_bytes, " bytes:", bound));
  }
  const absl::Duration old_timeout = old.reclaim_timeout;
  if (old_timeout > absl::ZeroDuration() &&
      (next.reclaim_timeout == absl::ZeroDuration() || next.reclaim_timeout > old_timeout)) {
    return absl::PermissionDeniedError(
        absl::StrCat("policy.reclaim_timeout_ms: ", absl::ToInt64Milliseconds(old_timeout), ":", bound));
  }
  if (Keeps(next.on_timeout) > Keeps(old.on_timeout)) {
    return absl::PermissionDeniedError(
        absl::StrCat("policy.on_reclaim_timeout: ", ReclaimActionName(old.on_timeout), ":", bound));
  }
  return absl::OkStatus();
}

std::string DescribePolicy(const PoolPolicy& p) {
  return absl::StrCat("priority ", p.priority, ", min ", FormatBytes(p.min_bytes), ", max ",
                      p.max_bytes == 0 ? std::string("none") : FormatBytes(p.max_bytes), ", on reclaim timeout ",
                      ReclaimActionName(p.on_timeout),
                      p.reclaim_timeout > absl::ZeroDuration()
                          ? absl::StrCat(" after ", absl::FormatDuration(p.reclaim_timeout))
                          : std::string(""));
}

}  // namespace kvd::daemon
