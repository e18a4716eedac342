// Limits: how much of the daemon one tenant (a uid) and all tenants together may hold, so that no user
// of the sockets can starve or out-budget the others (docs/operations.md "Limits").
//
// Every limit is a daemon flag. A total limit keeps a share for the operator: root and the daemon's own
// uid ("operator uids") may use all of it, every other uid only the ordinary share, the total less
// OperatorShare(). Operator uids are not bound by the per-uid limits (the totals bound them), so
// `kvctl status`, probes and an operator's repair always get in when one uid holds every ordinary slot.
//
// An exhausted limit is RESOURCE_EXHAUSTED naming the limit and its flag, built by the functions below:
//   "pools of uid 1000: 256 of 256 (--max-pools-per-uid)",
// and carrying the same as a LimitRefusal (Note [Typed refusals] in docs/architecture.md), which the
// refusal counters and the RPC edge read (the reply's kvd.v1.LimitExceeded; docs/api.md, "Errors").
// Plain values and pure functions; the rooms that count usage enforce them (PoolManager, SessionTable,
// Pool, the handle channel).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvd::daemon {

// What the operator grants one uid's pools in the arbitration of the device's memory (policy.h): the
// highest priority it may give them and the bytes it may have guaranteed, summed over its pools.
struct ClaimGrant {
  uint32_t max_priority = 0;
  uint64_t guaranteed_bytes = 0;
  bool operator==(const ClaimGrant&) const = default;
};

struct Limits {
  uint64_t max_pools = 1024;                                 // --max-pools
  uint64_t max_pools_per_uid = 256;                          // --max-pools-per-uid
  uint64_t max_sessions = 768;                               // --max-sessions
  uint64_t max_sessions_per_uid = 128;                       // --max-sessions-per-uid
  uint64_t max_reserved_bytes = uint64_t{96} << 40;          // --max-reserved (96 TiB)
  uint64_t max_reserved_bytes_per_uid = uint64_t{64} << 40;  // --max-reserved-per-uid (64 TiB)
  uint64_t max_clients_per_pool = 256;                       // --max-clients-per-pool
  uint64_t max_block_ids = 65536;                            // --max-block-ids
  uint32_t operator_reserve_percent = 5;                     // --operator-reserve
  uint32_t daemon_uid = 0;                                   // the daemon's own uid (an operator uid)
  ClaimGrant claim_per_uid;                                  // --max-priority-per-uid, --max-guaranteed-per-uid
  std::map<uint32_t, ClaimGrant> claim_of;  // --uid-claim=UID:priority=P,guaranteed=SIZE, replacing the above
  // What `uid` is granted (operator uids are not bound by it: policy.h).
  const ClaimGrant& GrantOf(uint32_t uid) const {
    auto it = claim_of.find(uid);
    return it == claim_of.end() ? claim_per_uid : it->second;
  }
};

// The limits the core enforces, in the order of kLimitFlags.
enum class Limit : uint8_t {
  kMaxPools,
  kMaxPoolsPerUid,
  kMaxSessions,
  kMaxSessionsPerUid,
  kMaxReserved,
  kMaxReservedPerUid,
  kMaxClientsPerPool,
  kMaxBlockIds,
};

// Their flags, as their RESOURCE_EXHAUSTED messages name them.
inline constexpr std::array<const char*, 8> kLimitFlags = {
    "--max-pools",    "--max-pools-per-uid",    "--max-sessions",         "--max-sessions-per-uid",
    "--max-reserved", "--max-reserved-per-uid", "--max-clients-per-pool", "--max-block-ids"};

inline const char* LimitFlag(Limit limit) { return kLimitFlags[static_cast<size_t>(limit)]; }

// Why a request was refused by a limit, in numbers: used + asked > allowed.
struct LimitRefusal {
  Limit limit = Limit::kMaxPools;
  uint32_t uid = 0;      // the caller's
  uint64_t allowed = 0;  // what `uid` may have: a per-uid limit, or UsableShare of a total
  uint64_t used = 0;     // in use: of `uid` for a per-uid limit, of every uid for a total; 0 for max-block-ids
  uint64_t asked = 0;    // 1 more pool, session or client; bytes to reserve; the block ids of one request
};

// RESOURCE_EXHAUSTED with `message`, carrying `refusal` (an absl::Status payload, read by LimitRefusalOf).
[[nodiscard]] absl::Status LimitExceeded(absl::string_view message, const LimitRefusal& refusal);

// The refusal a status carries; nullopt for every other status.
std::optional<LimitRefusal> LimitRefusalOf(const absl::Status& status);

// Root and the daemon's own uid.
inline bool IsOperatorUid(uint32_t uid, uint32_t daemon_uid) { return uid == 0 || uid == daemon_uid; }

// The part of `total` kept for operator uids: ceil(total * percent / 100), at most `total`.
uint64_t OperatorShare(uint64_t total, uint32_t percent);

// What `uid` may use of a total limit: all of it for an operator uid, else the total less the share.
uint64_t UsableShare(uint64_t total, const Limits& limits, uint32_t uid);

// Checks that one more of a counted resource fits: `used` of `uid` against the per-uid limit (skipped
// for operator uids) and `used_total` against the total. RESOURCE_EXHAUSTED otherwise (LimitExceeded), e.g.
//   "pools of uid 1000: 256 of 256 (--max-pools-per-uid)"
//   "pools of all uids: 972 of 972 for uid 1000 (--max-pools=1024, less 52 kept for root and uid 990 by
//    --operator-reserve=5%)"
// `per_uid` is nullopt for a resource with no per-uid limit.
[[nodiscard]] absl::Status CheckCount(absl::string_view what, uint32_t uid, uint64_t used, uint64_t per_uid_limit,
                                      std::optional<Limit> per_uid, uint64_t used_total, uint64_t total_limit,
                                      Limit total, const Limits& limits);

// The same for bytes: `asked` more bytes on top of `used` (of `uid`) and `used_total`; the message states
// the bytes asked and free.
[[nodiscard]] absl::Status CheckBytes(absl::string_view what, uint32_t uid, uint64_t asked, uint64_t used,
                                      uint64_t per_uid_limit, std::optional<Limit> per_uid, uint64_t used_total,
                                      uint64_t total_limit, Limit total, const Limits& limits);

// RESOURCE_EXHAUSTED when one request of `uid` names more than --max-block-ids blocks (or copies) in
// `field`: "block_ids: 70000 in one request, more than 65536 (--max-block-ids)".
[[nodiscard]] absl::Status CheckBlockIds(absl::string_view field, size_t count, uint32_t uid, const Limits& limits);

}  // namespace kvd::daemon
