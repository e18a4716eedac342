// PoolPolicy: one pool's claim on its device's memory against the other pools' (docs/api.md, "Policy,
// waiting and reclaim"; docs/operations.md, "Several engines on one GPU"): its priority, the bytes it is
// guaranteed, the most it may hold, and what kvd does when its engine does not give memory back in time.
//
// Who may set what (Note [Who may claim what] in docs/architecture.md). Arbitration crosses tenants, so a
// policy is checked twice: ValidatePolicy checks the values (INVALID_ARGUMENT naming `policy.<field>`),
// AuthorizePolicy checks the change against the caller (PERMISSION_DENIED naming the field). Root and the
// daemon's own uid (operator uids, limits.h) may set anything valid. Every other uid may lower its pool's
// claim at any time, and raise it only within what the operator grants the pool's owner: a priority up to
// the owner's ceiling and guaranteed bytes, summed over the owner's pools, up to the owner's guarantee
// (--max-priority-per-uid, --max-guaranteed-per-uid, --uid-claim). A cap, a reclaim timeout or a
// deadline action an operator set on a tenant's pool binds the tenant: it may tighten them, not loosen.
// Plain values and pure functions; the Arbiter (arbiter.h) keeps every pool's policy.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "daemon/core/limits.h"

namespace kvd::daemon {

inline constexpr uint32_t kMaxPriority = 1000;
inline constexpr absl::Duration kMaxReclaimTimeout = absl::Minutes(10);

// What kvd does to a pool whose engine did not give back what a reclaim asked by its deadline (or
// declined, or has no engine attached to answer): nothing (the waiting grow fails naming the pool), an
// exact shrink to the blocks the engine last reported in use (ReportUsage; never below min_bytes), or a
// sleep (keeping the contents in the host tier where there is one with room). Ordered by how much the pool keeps: kNone
// keeps everything.
enum class ReclaimAction { kNone, kShrink, kSleep };
// "none", "shrink", "sleep".
const char* ReclaimActionName(ReclaimAction action);

struct PoolPolicy {
  uint32_t priority = 0;   // 0..kMaxPriority; a waiting grow may reclaim from pools of lower priority
  uint64_t min_bytes = 0;  // guaranteed: never asked for, nor shrunk below, by a reclaim
  uint64_t max_bytes = 0;  // cap on the pool's committed bytes; 0: none
  absl::Duration reclaim_timeout = absl::ZeroDuration();  // zero: the daemon's --reclaim-timeout
  ReclaimAction on_timeout = ReclaimAction::kNone;
  // An operator set this policy on a pool whose owner is not an operator uid: its max_bytes,
  // reclaim_timeout and on_timeout bind the pool's tenants (they may tighten them, not loosen them).
  bool operator_bounds = false;

  bool operator==(const PoolPolicy&) const = default;
};

// A change of a policy: the fields set replace the policy's, the others stay (SetPoolPolicyRequest).
struct PolicyChange {
  std::optional<uint32_t> priority;
  std::optional<uint64_t> min_bytes;
  std::optional<uint64_t> max_bytes;
  std::optional<absl::Duration> reclaim_timeout;
  std::optional<ReclaimAction> on_timeout;
  bool empty() const { return !priority && !min_bytes && !max_bytes && !reclaim_timeout && !on_timeout; }
};

// What an engine last reported of its pool (ReportUsage): the blocks holding data it needs, the blocks
// holding data it could drop when asked (a prefix cache), and the bound below which every one of both lies
// (a shrink to used_blocks loses nothing the engine holds).
struct UsageReport {
  uint64_t live_blocks = 0;
  uint64_t evictable_blocks = 0;
  uint64_t used_blocks = 0;
  absl::Time reported_at;
};

// The reclaim asked of a pool, as its views show it (id 0: none under way), and how the last one ended.
struct ReclaimView {
  uint64_t id = 0;
  uint64_t asked_bytes = 0;
  uint64_t given_bytes = 0;
  absl::Time asked_at;
  absl::Time deadline;
  std::string last_outcome;  // "gave 2.00 GiB of 2.00 GiB in 120ms", "declined (busy): shrunk to 512 blocks", ...
};

// A grow or wake of a pool waiting for memory.
struct WaitingView {
  uint64_t asked_bytes = 0;  // what its last try asked for
  absl::Time since;
  uint32_t position = 0;  // 1: the first of every waiter of the device
};

// A pool's part in the arbitration, in every view of it.
struct PoolClaim {
  PoolPolicy policy;
  std::optional<UsageReport> usage;
  ReclaimView reclaim;
  std::vector<WaitingView> waiting;
};

// `policy` with `change` applied.
PoolPolicy Applied(const PoolPolicy& policy, const PolicyChange& change);

// The values: priority at most kMaxPriority, min_bytes at most the pool's `capacity_bytes` (its committed
// bytes at dims.capacity_blocks) and at most max_bytes when that is set, reclaim_timeout at most
// kMaxReclaimTimeout, and a sleep on timeout only with no guarantee (a sleep gives everything back).
// INVALID_ARGUMENT naming "policy.<field>".
[[nodiscard]] absl::Status ValidatePolicy(const PoolPolicy& policy, uint64_t capacity_bytes);

// Whether `caller_uid` may change pool `pool` (owned by `owner_uid`) from `old` to `next`: always for an
// operator uid; otherwise only lowering its claim or raising it within the owner's grant, where
// `owner_guaranteed_elsewhere` is the min_bytes of the owner's other pools. PERMISSION_DENIED naming the
// field and the flag that grants it.
[[nodiscard]] absl::Status AuthorizePolicy(absl::string_view pool, const PoolPolicy& old, const PoolPolicy& next,
                                           uint32_t caller_uid, uint32_t owner_uid, uint64_t owner_guaranteed_elsewhere,
                                           const Limits& limits);

// "priority 5, min 2.00 GiB, max none, on timeout shrink after 5s" for logs.
std::string DescribePolicy(const PoolPolicy& policy);

}  // namespace kvd::daemon
