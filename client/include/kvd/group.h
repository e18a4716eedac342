// kvd::Group: one engine's tensor-parallel ranks as one unit (docs/integrating.md, "Engine groups").
// Each rank owns one pool on the kvd of its GPU; the pools carry the same GroupMembership name and
// size and distinct ranks. A Group resizes all of them or none: it prepares the operation on every
// daemon (each does everything that can fail and holds its pool), then commits on every daemon; when a
// prepare fails it aborts the prepared ranks, so every pool stays as it was.
//
// A commit cannot fail for want of memory, but a daemon can die or a ttl pass between the phases. Then
// the ranks that did commit are put back with the opposite operation (grow <-> shrink to their blocks
// before, sleep <-> wake) and the error says so; if even that fails the error lists each rank's state.
//
// Ownership and threads. A Group owns one Client (session) per daemon. Its methods may be called from
// any thread; operations on one Group are serialised. The daemons abort a coordinator's prepared ranks
// when its sessions close, so a coordinator that dies between the phases leaves nothing held.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvd/client.h"

namespace kvd {

struct GroupOptions {
  // Client options for every daemon (socket and device are ignored: the sockets are Open's).
  ConnectOptions connect;
  // How long each daemon holds a prepared pool before it aborts on its own.
  absl::Duration ttl = absl::Seconds(30);
  // Runs after every rank prepared and before the first commit (tests use it to fail a daemon between
  // the phases). A failure aborts every rank (no rank changes) and is the operation's error.
  std::function<absl::Status()> before_commit;
};

// One rank as found on its daemon.
struct GroupRank {
  uint32_t rank = 0;
  std::string socket;
  std::string device_uuid;
  PoolInfo pool;
};

// The result of one group operation: every rank's change, by rank, and the coordinator's timings.
struct GroupChange {
  GroupOp op = GroupOp::kGrow;
  std::vector<PoolChange> ranks;
  uint64_t prepare_us = 0;  // first prepare sent to last prepare answered
  uint64_t commit_us = 0;
  uint64_t total_us = 0;
  uint64_t prepared_bytes = 0;  // memory made ready on all daemons (grow, wake)
};

// See Note [Engine groups are two-phase, with presumed abort] in docs/architecture.md.
class Group {
 public:
  // Finds the pools of group `name` on the daemons at `sockets` (every pool whose membership names
  // it) and checks that they form the whole group: one size, every rank 0..size-1 exactly once. A
  // daemon that does not answer (or refuses this uid) is passed over: the group may live on the
  // others. NOT_FOUND when no daemon that answered has a pool of it; UNAVAILABLE when none answered;
  // FAILED_PRECONDITION naming the missing or duplicated rank, or the disagreeing size. The messages
  // name the daemons searched and why any did not answer.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Group>> Open(absl::string_view name,
                                                                   const std::vector<std::string>& sockets,
                                                                   GroupOptions options = {});
  const std::string& name() const { return name_; }
  // Every rank as last seen (Open, or the last operation), by rank.
  std::vector<GroupRank> ranks() const;
  // Re-reads every rank's pool.
  [[nodiscard]] absl::StatusOr<std::vector<GroupRank>> Refresh();

  // All ranks or none. `wait` is Shrink's/Sleep's: reply once every attached client acknowledged.
  // Shrink and Sleep pause the ranks' pausable clients of other sessions from the prepare to the commit;
  // one that is not pausable refuses them unless `force` (docs/api.md, "Releases and running engines").
  [[nodiscard]] absl::StatusOr<GroupChange> Grow(uint64_t target_blocks);
  [[nodiscard]] absl::StatusOr<GroupChange> Shrink(uint64_t target_blocks, bool wait, bool force = false);
  // `keep`: every rank keeps its contents in its daemon's host tier (SleepOptions::keep), or none sleeps.
  [[nodiscard]] absl::StatusOr<GroupChange> Sleep(bool wait, bool force = false, bool keep = false);
  [[nodiscard]] absl::StatusOr<GroupChange> Wake();

 private:
  struct Member {
    GroupRank rank;
    std::unique_ptr<Client> client;
  };
  Group(std::string name, GroupOptions options, std::vector<Member> members)
      : name_(std::move(name)), options_(std::move(options)), members_(std::move(members)) {}
  absl::StatusOr<GroupChange> Run(GroupOp op, uint64_t target_blocks, bool wait, bool force = false, bool keep = false);

  const std::string name_;
  const GroupOptions options_;
  mutable absl::Mutex mu_;  // one operation at a time; guards members_[*].rank
  std::vector<Member> members_;
};

}  // namespace kvd
