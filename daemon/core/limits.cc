#include "daemon/core/limits.h"

#include <cstring>
#include <type_traits>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "kvd/units.h"

namespace kvd::daemon {
namespace {

// The payload's key. The payload is the struct's bytes: it never leaves the process (the RPC edge sends
// a kvd.v1.LimitExceeded), so it needs no encoding beyond a copy.
constexpr char kRefusalPayload[] = "type.kvd.daemon/kvd.daemon.LimitRefusal";
static_assert(std::is_trivially_copyable_v<LimitRefusal>);

}  // namespace

absl::Status LimitExceeded(absl::string_view message, const LimitRefusal& refusal) {
  absl::Status status = absl::ResourceExhaustedError(message);
  status.SetPayload(kRefusalPayload,
                    absl::Cord(absl::string_view(reinterpret_cast<const char*>(&refusal), sizeof(refusal))));
  return status;
}

std::optional<LimitRefusal> LimitRefusalOf(const absl::Status& status) {
  if (!absl::IsResourceExhausted(status)) return std::nullopt;
  const absl::optional<absl::Cord> payload = status.GetPayload(kRefusalPayload);
  if (!payload.has_value() || payload->size() != sizeof(LimitRefusal)) return std::nullopt;
  LimitRefusal refusal;
  std::memcpy(&refusal, std::string(*payload).data(), sizeof(refusal));
  if (static_cast<size_t>(refusal.limit) >= kLimitFlags.size()) return std::nullopt;
  return refusal;
}

uint64_t OperatorShare(uint64_t total, uint32_t percent) {
  if (percent == 0 || total == 0) return 0;
  if (percent >= 100) return total;
  // ceil(total * percent / 100) without overflow: total < 2^64 and percent < 100.
  const uint64_t share = total / 100 * percent + ((total % 100) * percent + 99) / 100;
  return share < total ? share : total;
}

uint64_t UsableShare(uint64_t total, const Limits& limits, uint32_t uid) {
  if (IsOperatorUid(uid, limits.daemon_uid)) return total;
  return total - OperatorShare(total, limits.operator_reserve_percent);
}

namespace {

// "(--max-pools)" for an operator uid; with the reserve spelled out for everyone else.
std::string TotalFlag(absl::string_view flag, uint64_t total, const Limits& limits, uint32_t uid, bool bytes) {
  const uint64_t share = OperatorShare(total, limits.operator_reserve_percent);
  if (IsOperatorUid(uid, limits.daemon_uid) || share == 0) return absl::StrCat("(", flag, ")");
  return absl::StrCat("(", flag, "=", bytes ? FormatBytes(total) : absl::StrCat(total), ", less ",
                      bytes ? FormatBytes(share) : absl::StrCat(share), " kept for root and uid ", limits.daemon_uid,
                      " by --operator-reserve=", limits.operator_reserve_percent, "%)");
}

}  // namespace

absl::Status CheckCount(absl::string_view what, uint32_t uid, uint64_t used, uint64_t per_uid_limit,
                        std::optional<Limit> per_uid, uint64_t used_total, uint64_t total_limit, Limit total,
                        const Limits& limits) {
  if (per_uid.has_value() && !IsOperatorUid(uid, limits.daemon_uid) && used >= per_uid_limit) {
    return LimitExceeded(
        absl::StrCat(what, " of uid ", uid, ": ", used, " of ", per_uid_limit, " (", LimitFlag(*per_uid), ")"),
        {.limit = *per_uid, .uid = uid, .allowed = per_uid_limit, .used = used, .asked = 1});
  }
  const uint64_t usable = UsableShare(total_limit, limits, uid);
  if (used_total >= usable) {
    return LimitExceeded(absl::StrCat(what, " of all uids: ", used_total, " of ", usable, " for uid ", uid, " ",
                                      TotalFlag(LimitFlag(total), total_limit, limits, uid, false)),
                         {.limit = total, .uid = uid, .allowed = usable, .used = used_total, .asked = 1});
  }
  return absl::OkStatus();
}

absl::Status CheckBytes(absl::string_view what, uint32_t uid, uint64_t asked, uint64_t used, uint64_t per_uid_limit,
                        std::optional<Limit> per_uid, uint64_t used_total, uint64_t total_limit, Limit total,
                        const Limits& limits) {
  const auto refuse = [&](absl::string_view scope, uint64_t in_use, uint64_t limit, absl::string_view flag_text,
                          Limit which) {
    const uint64_t free = limit > in_use ? limit - in_use : 0;
    return LimitExceeded(
        absl::StrCat(what, " of ", scope, ": ", asked, " bytes (", FormatBytes(asked), ") asked but only ", free,
                     " bytes (", FormatBytes(free), ") of ", FormatBytes(limit), " are free ", flag_text),
        {.limit = which, .uid = uid, .allowed = limit, .used = in_use, .asked = asked});
  };
  if (per_uid.has_value() && !IsOperatorUid(uid, limits.daemon_uid) &&
      (used > per_uid_limit || asked > per_uid_limit - used)) {
    return refuse(absl::StrCat("uid ", uid), used, per_uid_limit, absl::StrCat("(", LimitFlag(*per_uid), ")"),
                  *per_uid);
  }
  const uint64_t usable = UsableShare(total_limit, limits, uid);
  if (used_total > usable || asked > usable - used_total) {
    return refuse(absl::StrCat("all uids (for uid ", uid, ")"), used_total, usable,
                  TotalFlag(LimitFlag(total), total_limit, limits, uid, true), total);
  }
  return absl::OkStatus();
}

absl::Status CheckBlockIds(absl::string_view field, size_t count, uint32_t uid, const Limits& limits) {
  if (count <= limits.max_block_ids) return absl::OkStatus();
  return LimitExceeded(
      absl::StrCat(field, ": ", count, " in one request, more than ", limits.max_block_ids, " (--max-block-ids)"),
      {.limit = Limit::kMaxBlockIds, .uid = uid, .allowed = limits.max_block_ids, .used = 0, .asked = count});
}

}  // namespace kvd::daemon
