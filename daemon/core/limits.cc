#include "daemon/core/limits.h"

#include "absl/strings/str_cat.h"
#include "kvd/units.h"

namespace kvd::daemon {

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
                        absl::string_view per_uid_flag, uint64_t used_total, uint64_t total_limit,
                        absl::string_view total_flag, const Limits& limits) {
  if (!per_uid_flag.empty() && !IsOperatorUid(uid, limits.daemon_uid) && used >= per_uid_limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " of uid ", uid, ": ", used, " of ", per_uid_limit, " (", per_uid_flag, ")"));
  }
  const uint64_t usable = UsableShare(total_limit, limits, uid);
  if (used_total >= usable) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " of all uids: ", used_total, " of ", usable, " for uid ",
                                                     uid, " ", TotalFlag(total_flag, total_limit, limits, uid, false)));
  }
  return absl::OkStatus();
}

absl::Status CheckBytes(absl::string_view what, uint32_t uid, uint64_t asked, uint64_t used, uint64_t per_uid_limit,
                        absl::string_view per_uid_flag, uint64_t used_total, uint64_t total_limit,
                        absl::string_view total_flag, const Limits& limits) {
  const auto message = [&](absl::string_view scope, uint64_t in_use, uint64_t limit, absl::string_view flag_text) {
    const uint64_t free = limit > in_use ? limit - in_use : 0;
    return absl::ResourceExhaustedError(absl::StrCat(what, " of ", scope, ": ", asked, " bytes (", FormatBytes(asked),
                                                     ") asked but only ", free, " bytes (", FormatBytes(free), ") of ",
                                                     FormatBytes(limit), " are free ", flag_text));
  };
  if (!per_uid_flag.empty() && !IsOperatorUid(uid, limits.daemon_uid) &&
      (used > per_uid_limit || asked > per_uid_limit - used)) {
    return message(absl::StrCat("uid ", uid), used, per_uid_limit, absl::StrCat("(", per_uid_flag, ")"));
  }
  const uint64_t usable = UsableShare(total_limit, limits, uid);
  if (used_total > usable || asked > usable - used_total) {
    return message(absl::StrCat("all uids (for uid ", uid, ")"), used_total, usable,
                   TotalFlag(total_flag, total_limit, limits, uid, true));
  }
  return absl::OkStatus();
}

absl::Status CheckBlockCount(absl::string_view field, size_t count, const Limits& limits) {
  if (count <= limits.max_block_ids) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(field, ": ", count, " in one request, more than ", limits.max_block_ids, " (--max-block-ids)"));
}

}  // namespace kvd::daemon
