// ReleaseLedger: one pool's releases under way — the chunks that left its table and the clients that still
// map some of them — and the detached clients that hold chunks (holders). A room of Pool (pool.h) with no
// lock of its own: the pool's state lock guards it. See Note [Who holds a released chunk] and Note [A
// detached client still holds its chunks] in docs/architecture.md.
//
// Invariants: every release has chunks and a client it waits for (one that waits for nobody is settled at
// once, its bytes given back to the budget); a holder has a non-empty `handed`.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "daemon/core/budget.h"
#include "daemon/core/pool_types.h"

namespace kvd::daemon {

// Chunk id -> bytes: what a client was handed and not yet acknowledged as released.
using Handed = std::map<uint64_t, uint64_t>;

struct Release {
  std::vector<ChunkInfo> chunks;
  uint64_t bytes = 0;
  std::set<std::string> waiting;  // client ids that still map some of the chunks
};

// A client that detached (Detach, or its Watch stream ended) while its session lives: as far as the daemon
// knows it still maps the chunks it fetched, so releases of those chunks wait for it.
struct Holder {
  std::string session;
  Handed handed;
};

class ReleaseLedger {
 public:
  // `budget` gets the bytes of every settled release; `restart_pending_bytes`: released before a restart.
  explicit ReleaseLedger(Budget* budget, uint64_t restart_pending_bytes = 0)
      : budget_(budget), restart_pending_bytes_(restart_pending_bytes) {}

  // Who waits for a release: a client (attached or a holder) that was handed any of its chunks. The one
  // place this is decided.
  static bool Holds(const Handed& handed, const std::vector<ChunkInfo>& chunks);

  // The id the next release with chunks gets.
  uint64_t NextId() { return next_id_++; }
  // Records release `id` (0: no chunks, nothing recorded) with the attached clients the caller found in
  // `release.waiting`, adding every holder that Holds some of it. Returns the id, or 0 when nobody waits.
  uint64_t Open(uint64_t id, Release release);
  // Whether release `id` still waits for someone.
  bool Pending(uint64_t id) const { return releases_.contains(id); }
  const Release* Find(uint64_t id) const;
  // The bytes still pending release, those from before a restart included.
  uint64_t PendingBytes() const;
  // Client `client_id` acknowledged release `id`: it no longer waits, and the chunks leave its `*handed`.
  // False when the release is not waiting for it.
  bool Acknowledge(uint64_t id, const std::string& client_id, Handed* handed);

  // Holders.
  bool IsHolder(absl::string_view client_id) const { return holders_.contains(client_id); }
  Holder* FindHolder(absl::string_view client_id);
  const std::map<std::string, Holder, std::less<>>& holders() const { return holders_; }
  // The holder's acknowledgement of release `id`; false when that release is not waiting for it.
  bool HolderAcknowledge(uint64_t id, absl::string_view client_id);
  // An attached client detaches still holding `held` (the chunks it fetched): with `keep_holding` the
  // releases of those keep waiting for it and it becomes a holder; without, it owes nothing any more.
  void Detach(const std::string& client_id, const std::string& session, Handed held, bool keep_holding);
  // Holder or not, `client_id` owes nothing any more (its session ended, or it declared everything unmapped).
  void Forget(absl::string_view client_id);
  // The ids of `session`'s holders.
  std::vector<std::string> HoldersOf(absl::string_view session) const;
  // `session`'s holders hand what they hold to its new client `client_id` (into `*handed` and `*fetched`):
  // every release that waited for one of them waits for the client instead, and `tell` is called for each.
  void HandOver(absl::string_view session, const std::string& client_id, Handed* handed, std::set<uint64_t>* fetched,
                const std::function<void(uint64_t id, const Release&)>& tell);

  // The pool is gone: every release and holder is forgotten (clients free the memory when they unmap).
  void Clear();
  // The recovery grace passed: bytes released before the restart stop counting. Returns them.
  uint64_t ForgetRestartPending();

 private:
  // Forgets completed releases; their bytes leave the budget.
  void Settle();

  Budget* const budget_;
  std::map<uint64_t, Release> releases_;
  std::map<std::string, Holder, std::less<>> holders_;  // detached clients, by id
  uint64_t next_id_ = 1;
  uint64_t restart_pending_bytes_ = 0;
};

}  // namespace kvd::daemon
