// Sessions and leases: who is talking to the daemon, and the single-use capabilities that turn into
// chunk FDs on the handle channel.
//
// A session is opened on the handle channel, whose SO_PEERCRED gives its uid and pid; its token is
// then sent as metadata on RPCs (docs/api.md, "Identity: sessions and the kvd-session metadata"). A lease names chunks
// of one pool for one session and is redeemed at most once, before it expires.
//
// Threads. Both tables are thread-safe and their locks are leaves: a pool may consult them while
// holding its own lock (see Note [Lock order] in docs/architecture.md).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/limits.h"
#include "daemon/core/pool_types.h"

namespace kvd::daemon {

// 128 random bits as hex after `prefix`: session and lease tokens, client and transaction ids.
std::string RandomToken(absl::string_view prefix);

class SessionTable {
 public:
  // Sessions are bounded by --max-sessions-per-uid and --max-sessions (limits.h).
  explicit SessionTable(Limits limits = {}) : limits_(limits) {}

  // A new session's token. RESOURCE_EXHAUSTED naming the limit and its flag when `uid` has
  // max_sessions_per_uid open, or all uids together their share of max_sessions.
  [[nodiscard]] absl::StatusOr<std::string> Open(uint32_t uid, int32_t pid, std::string name) ABSL_LOCKS_EXCLUDED(mu_);
  // False when `session` is unknown or already closed.
  bool Close(absl::string_view session) ABSL_LOCKS_EXCLUDED(mu_);
  // UNAUTHENTICATED for an unknown or closed session.
  [[nodiscard]] absl::StatusOr<Caller> Authenticate(absl::string_view session) const ABSL_LOCKS_EXCLUDED(mu_);
  bool Contains(absl::string_view session) const ABSL_LOCKS_EXCLUDED(mu_);
  // Open sessions by uid (uids with none are absent), for metrics.
  std::map<uint32_t, uint64_t> CountByUid() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const Limits limits_;
  mutable absl::Mutex mu_;
  std::map<std::string, Caller, std::less<>> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, uint64_t> per_uid_ ABSL_GUARDED_BY(mu_);  // open sessions by uid, none absent
};

struct LeaseRecord {
  std::string pool;
  std::string session;
  std::string client;  // the attached client it was issued to: it ends with the client's attachment
  std::vector<uint64_t> chunk_ids;
  absl::Time expires;
  // A range lease (ExportRanges) yields one FD per range instead of chunk FDs.
  std::vector<RangeHandle> ranges;
  bool ranges_span_chunks = false;  // each range is one device range export; else one chunk's FD
  uint64_t pause_id = 0;            // a PAUSE's lease: its pause (Note [A called-off pause's lease])
};

class LeaseTable {
 public:
  explicit LeaseTable(absl::Duration ttl) : ttl_(ttl) {}

  // A new lease of `chunk_ids` of `pool` for client `client` of `session` (a PAUSE's: of pause `pause_id`);
  // drops expired leases on the way.
  Lease Issue(absl::string_view pool, absl::string_view session, absl::string_view client,
              std::vector<uint64_t> chunk_ids, uint64_t pause_id = 0) ABSL_LOCKS_EXCLUDED(mu_);
  // A new range lease: `ranges` of `pool` for client `client` of `session` (the returned Lease has no
  // chunk_ids).
  Lease IssueRanges(absl::string_view pool, absl::string_view session, absl::string_view client,
                    std::vector<RangeHandle> ranges, bool span_chunks) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the lease out, whatever happens next (single use). NOT_FOUND for an unknown or used lease,
  // PERMISSION_DENIED when it was issued to another session, DEADLINE_EXCEEDED once expired.
  // `keep_expired` (a push, which leaves a lease it cannot use to FetchHandles): an expired lease stays in.
  [[nodiscard]] absl::StatusOr<LeaseRecord> Redeem(absl::string_view session, absl::string_view token,
                                                   bool keep_expired = false) ABSL_LOCKS_EXCLUDED(mu_);
  // Puts back a lease Redeem took out whose FDs could not be handed over after all (Attach's push, which then
  // leaves the lease to FetchHandles).
  void Restore(std::string token, LeaseRecord lease) ABSL_LOCKS_EXCLUDED(mu_);
  void DropSession(absl::string_view session) ABSL_LOCKS_EXCLUDED(mu_);
  // Revokes every unredeemed lease of a client that detached.
  void DropClient(absl::string_view client) ABSL_LOCKS_EXCLUDED(mu_);
  void DropPool(absl::string_view pool) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const absl::Duration ttl_;
  absl::Mutex mu_;
  std::map<std::string, LeaseRecord, std::less<>> leases_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvd::daemon
