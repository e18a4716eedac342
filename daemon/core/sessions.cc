#include "daemon/core/sessions.h"

#include <sys/random.h>

#include <iterator>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvd::daemon {

std::string RandomToken(absl::string_view prefix) {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::StrCat(prefix,
                      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes))));
}

absl::StatusOr<std::string> SessionTable::Open(uint32_t uid, int32_t pid, std::string name) {
  std::string token = RandomToken("s-");
  absl::MutexLock lock(&mu_);
  auto used = per_uid_.find(uid);
  if (absl::Status fits =
          CheckCount("sessions", uid, used == per_uid_.end() ? 0 : used->second, limits_.max_sessions_per_uid,
                     Limit::kMaxSessionsPerUid, sessions_.size(), limits_.max_sessions, Limit::kMaxSessions, limits_);
      !fits.ok()) {
    return fits;
  }
  sessions_[token] = Caller{.uid = uid, .pid = pid, .session = token, .name = std::move(name)};
  ++per_uid_[uid];
  return token;
}

bool SessionTable::Close(absl::string_view session) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return false;
  auto used = per_uid_.find(it->second.uid);
  if (used != per_uid_.end() && --used->second == 0) per_uid_.erase(used);
  sessions_.erase(it);
  return true;
}

std::map<uint32_t, uint64_t> SessionTable::CountByUid() const {
  absl::MutexLock lock(&mu_);
  return per_uid_;
}

absl::StatusOr<Caller> SessionTable::Authenticate(absl::string_view session) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::UnauthenticatedError("kvd-session: unknown or closed session; open one on the handle channel");
  }
  return it->second;
}

bool SessionTable::Contains(absl::string_view session) const {
  absl::MutexLock lock(&mu_);
  return sessions_.contains(session);
}

Lease LeaseTable::IssueRanges(absl::string_view pool, absl::string_view session, absl::string_view client,
                              std::vector<RangeHandle> ranges, bool span_chunks) {
  Lease lease = Issue(pool, session, client, {});
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease.token);
  if (it != leases_.end()) {
    it->second.ranges = std::move(ranges);
    it->second.ranges_span_chunks = span_chunks;
  }
  return lease;
}

Lease LeaseTable::Issue(absl::string_view pool, absl::string_view session, absl::string_view client,
                        std::vector<uint64_t> chunk_ids, uint64_t pause_id) {
  const absl::Time now = absl::Now();
  Lease lease{.token = RandomToken("l-"), .chunk_ids = std::move(chunk_ids), .expires = now + ttl_};
  absl::MutexLock lock(&mu_);
  for (auto it = leases_.begin(); it != leases_.end();) {
    it = it->second.expires < now ? leases_.erase(it) : std::next(it);
  }
  leases_[lease.token] = {.pool = std::string(pool),
                          .session = std::string(session),
                          .client = std::string(client),
                          .chunk_ids = lease.chunk_ids,
                          .expires = lease.expires,
                          .pause_id = pause_id};
  return lease;
}

absl::StatusOr<LeaseRecord> LeaseTable::Redeem(absl::string_view session, absl::string_view token, bool keep_expired) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(token);
  if (it == leases_.end()) return absl::NotFoundError("lease_token: unknown or already used lease");
  if (it->second.session != session) return absl::PermissionDeniedError("lease_token: issued to another session");
  const absl::Time now = absl::Now();
  if (it->second.expires < now) {
    const absl::Duration ago = now - it->second.expires;
    if (!keep_expired) leases_.erase(it);
    return absl::DeadlineExceededError(
        absl::StrCat("lease_token: expired ", absl::FormatDuration(ago), " ago; attach again for a new lease"));
  }
  LeaseRecord lease = std::move(it->second);
  leases_.erase(it);
  return lease;
}

void LeaseTable::Restore(std::string token, LeaseRecord lease) {
  absl::MutexLock lock(&mu_);
  leases_.emplace(std::move(token), std::move(lease));
}

void LeaseTable::DropSession(absl::string_view session) {
  absl::MutexLock lock(&mu_);
  for (auto it = leases_.begin(); it != leases_.end();) {
    it = it->second.session == session ? leases_.erase(it) : std::next(it);
  }
}

void LeaseTable::DropClient(absl::string_view client) {
  absl::MutexLock lock(&mu_);
  for (auto it = leases_.begin(); it != leases_.end();) {
    it = it->second.client == client ? leases_.erase(it) : std::next(it);
  }
}

void LeaseTable::DropPool(absl::string_view pool) {
  absl::MutexLock lock(&mu_);
  for (auto it = leases_.begin(); it != leases_.end();) {
    it = it->second.pool == pool ? leases_.erase(it) : std::next(it);
  }
}

}  // namespace kvd::daemon
