#include "kvd/group.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvd/status.h"

namespace kvd {
namespace {

// Runs fn(i) for every i in [0, n) on its own thread and waits for all: the daemons work in parallel.
template <typename T>
std::vector<T> ForEachRank(size_t n, const std::function<T(size_t)>& fn) {
  std::vector<std::optional<T>> results(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i].emplace(fn(i)); });
  for (std::thread& t : threads) t.join();
  std::vector<T> out;
  out.reserve(n);
  for (std::optional<T>& r : results) out.push_back(*std::move(r));
  return out;
}

std::string RankName(const GroupRank& r) {
  return absl::StrCat("rank ", r.rank, " (", r.pool.name, " on ", r.socket, ")");
}

std::string RankList(const std::vector<uint32_t>& ranks) {
  return ranks.empty() ? std::string("none") : absl::StrJoin(ranks, ", ");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Group>> Group::Open(absl::string_view name, const std::vector<std::string>& sockets,
                                                   GroupOptions options) {
  if (name.empty()) return absl::InvalidArgumentError("group: a group name is required");
  if (sockets.empty()) return absl::InvalidArgumentError("sockets: at least one daemon socket is required");
  auto connect_to = [&](const std::string& socket) -> absl::StatusOr<std::unique_ptr<Client>> {
    ConnectOptions connect = options.connect;
    connect.socket = socket;
    if (connect.client_name.empty()) connect.client_name = "kvd-group";
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(connect);
    if (!client.ok())
      return absl::Status(client.status().code(), absl::StrCat(socket, ": ", client.status().message()));
    return client;
  };
  std::vector<Member> members;
  std::vector<std::string> answered, silent;  // silent: "socket: why" of daemons that could not be read
  for (const std::string& socket : sockets) {
    absl::StatusOr<std::unique_ptr<Client>> scan = connect_to(socket);
    absl::StatusOr<DeviceStatus> device = scan.ok() ? (*scan)->DeviceInfo() : scan.status();
    absl::StatusOr<std::vector<PoolInfo>> pools = device.ok() ? (*scan)->ListPools() : device.status();
    if (!pools.ok()) {
      // A node's socket directory may hold a stopped or foreign kvd: the group may live elsewhere.
      silent.push_back(scan.ok() ? absl::StrCat(socket, ": ", pools.status().message())
                                 : std::string(pools.status().message()));  // connect_to named it
      continue;
    }
    answered.push_back(socket);
    for (PoolInfo& pool : *pools) {
      if (pool.group.name != name) continue;
      // Every rank gets a session of its own; the first one on a daemon reuses the scanning one.
      std::unique_ptr<Client> client = std::move(*scan);
      if (client == nullptr) {
        KVD_ASSIGN_OR_RETURN(client, connect_to(socket));
      }
      const uint32_t rank = pool.group.rank;
      members.push_back(
          Member{.rank = {.rank = rank, .socket = socket, .device_uuid = device->uuid, .pool = std::move(pool)},
                 .client = std::move(client)});
    }
  }
  const std::string searched =
      absl::StrCat(answered.empty() ? std::string("no daemon") : absl::StrJoin(answered, ", "),
                   silent.empty() ? "" : absl::StrCat(" (not answering: ", absl::StrJoin(silent, "; "), ")"));
  if (members.empty()) {
    if (answered.empty()) {
      return absl::UnavailableError(
          absl::StrCat("group ", name, ": no daemon answered: ", absl::StrJoin(silent, "; ")));
    }
    return absl::NotFoundError(absl::StrCat("group ", name, ": no pool of it on ", searched));
  }
  std::sort(members.begin(), members.end(), [](const Member& a, const Member& b) { return a.rank.rank < b.rank.rank; });
  const uint32_t size = members.front().rank.pool.group.size;
  for (const Member& m : members) {
    if (m.rank.pool.group.size != size) {
      return absl::FailedPreconditionError(absl::StrCat("group ", name, ": ", RankName(members.front().rank),
                                                        " says the group has ", size, " ranks but ", RankName(m.rank),
                                                        " says ", m.rank.pool.group.size));
    }
  }
  std::vector<uint32_t> missing;
  for (uint32_t r = 0, i = 0; r < size; ++r) {
    if (i < members.size() && members[i].rank.rank == r) {
      ++i;
      if (i < members.size() && members[i].rank.rank == r) {
        return absl::FailedPreconditionError(absl::StrCat("group ", name, ": rank ", r,
                                                          " appears twice: ", RankName(members[i - 1].rank), " and ",
                                                          RankName(members[i].rank)));
      }
    } else {
      missing.push_back(r);
    }
  }
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("group ", name, ": rank", missing.size() > 1 ? "s " : " ",
                                                      RankList(missing), " of ", size, " not found on ", searched));
  }
  return std::unique_ptr<Group>(new Group(std::string(name), std::move(options), std::move(members)));
}

std::vector<GroupRank> Group::ranks() const {
  absl::MutexLock lock(&mu_);
  std::vector<GroupRank> out;
  for (const Member& m : members_) out.push_back(m.rank);
  return out;
}

absl::StatusOr<std::vector<GroupRank>> Group::Refresh() {
  absl::MutexLock lock(&mu_);
  std::vector<absl::StatusOr<PoolInfo>> pools = ForEachRank<absl::StatusOr<PoolInfo>>(
      members_.size(), [&](size_t i) { return members_[i].client->GetPool(members_[i].rank.pool.name); });
  std::vector<GroupRank> out;
  for (size_t i = 0; i < members_.size(); ++i) {
    if (!pools[i].ok()) {
      return absl::Status(pools[i].status().code(),
                          absl::StrCat(RankName(members_[i].rank), ": ", pools[i].status().message()));
    }
    members_[i].rank.pool = *std::move(pools[i]);
    out.push_back(members_[i].rank);
  }
  return out;
}

absl::StatusOr<GroupChange> Group::Grow(uint64_t target_blocks) { return Run(GroupOp::kGrow, target_blocks, false); }
absl::StatusOr<GroupChange> Group::Shrink(uint64_t target_blocks, bool wait, bool force) {
  return Run(GroupOp::kShrink, target_blocks, wait, force);
}
absl::StatusOr<GroupChange> Group::Sleep(bool wait, bool force, bool keep) {
  return Run(GroupOp::kSleep, 0, wait, force, keep);
}
absl::StatusOr<GroupChange> Group::Wake() { return Run(GroupOp::kWake, 0, false); }

absl::StatusOr<GroupChange> Group::Run(GroupOp op, uint64_t target_blocks, bool wait, bool force, bool keep) {
  absl::MutexLock lock(&mu_);
  const size_t n = members_.size();
  const absl::Time start = absl::Now();
  const std::string what = op == GroupOp::kGrow || op == GroupOp::kShrink
                               ? absl::StrCat("group ", name_, ": ", GroupOpName(op), " to ", target_blocks, " blocks")
                               : absl::StrCat("group ", name_, ": ", GroupOpName(op));

  // Phase 1: every daemon does what can fail and holds its pool.
  std::vector<absl::StatusOr<PreparedChange>> prepared = ForEachRank<absl::StatusOr<PreparedChange>>(n, [&](size_t i) {
    return members_[i].client->Prepare(members_[i].rank.pool.name, op, target_blocks, options_.ttl, force, keep);
  });
  const absl::Time prepared_at = absl::Now();
  std::optional<size_t> failed;
  for (size_t i = 0; i < n && !failed.has_value(); ++i) {
    if (!prepared[i].ok()) failed = i;
  }
  // Aborts every prepared rank; `where` and `cause` say why, and the error says what came of the aborts.
  auto abort_all = [&](absl::string_view where, const absl::Status& cause) {
    std::vector<uint32_t> rolled_back;
    std::vector<std::string> stuck;
    std::vector<absl::Status> aborted = ForEachRank<absl::Status>(n, [&](size_t i) -> absl::Status {
      if (!prepared[i].ok()) return absl::OkStatus();
      return members_[i].client->Abort(prepared[i]->transaction).status();
    });
    for (size_t i = 0; i < n; ++i) {
      if (!prepared[i].ok()) continue;
      if (aborted[i].ok()) {
        rolled_back.push_back(members_[i].rank.rank);
      } else {
        // The daemon aborts it anyway when this session closes or the ttl passes.
        stuck.push_back(absl::StrCat("rank ", members_[i].rank.rank, ": ", aborted[i].message()));
      }
    }
    return absl::Status(cause.code(),
                        absl::StrCat(what, where, cause.message(),
                                     "; no rank changed (prepared ranks rolled back: ", RankList(rolled_back), ")",
                                     stuck.empty() ? ""
                                                   : absl::StrCat("; abort failed on ", absl::StrJoin(stuck, "; "),
                                                                  " (the daemon aborts it at its ttl)")));
  };
  if (failed.has_value()) {
    return abort_all(absl::StrCat(" failed on ", RankName(members_[*failed].rank), ": "), prepared[*failed].status());
  }

  // Phase 2: every daemon makes its change visible.
  if (options_.before_commit) {
    if (absl::Status s = options_.before_commit(); !s.ok()) return abort_all(": before the commit: ", s);
  }
  std::vector<absl::StatusOr<PoolChange>> committed = ForEachRank<absl::StatusOr<PoolChange>>(
      n, [&](size_t i) { return members_[i].client->Commit(prepared[i]->transaction, wait); });
  const absl::Time committed_at = absl::Now();
  std::optional<size_t> commit_failed;
  for (size_t i = 0; i < n && !commit_failed.has_value(); ++i) {
    if (!committed[i].ok()) commit_failed = i;
  }
  if (commit_failed.has_value()) {
    // Put the committed ranks back where they were before this operation.
    std::vector<absl::Status> undone = ForEachRank<absl::Status>(n, [&](size_t i) -> absl::Status {
      if (!committed[i].ok()) return absl::OkStatus();
      Client& c = *members_[i].client;
      const PoolInfo& before = prepared[i]->pool;
      switch (op) {
        case GroupOp::kGrow:
          return c.Shrink(before.name, before.committed_blocks, false).status();
        case GroupOp::kShrink:
          return c.Grow(before.name, before.committed_blocks).status();
        case GroupOp::kSleep:
          return c.Wake(before.name).status();
        case GroupOp::kWake:
          return c.Sleep(before.name, false).status();
      }
      return absl::OkStatus();
    });
    std::vector<uint32_t> restored;
    std::vector<std::string> inconsistent;
    for (size_t i = 0; i < n; ++i) {
      if (!committed[i].ok()) continue;
      if (undone[i].ok()) {
        restored.push_back(members_[i].rank.rank);
      } else {
        inconsistent.push_back(
            absl::StrCat("rank ", members_[i].rank.rank, " stays changed (", undone[i].message(), ")"));
      }
    }
    const absl::Status& cause = committed[*commit_failed].status();
    if (!inconsistent.empty()) {
      return absl::InternalError(
          absl::StrCat(what, ": commit failed on ", RankName(members_[*commit_failed].rank), ": ", cause.message(),
                       "; THE GROUP IS INCONSISTENT: ", absl::StrJoin(inconsistent, "; "),
                       "; restored ranks: ", RankList(restored), ". Check with kvctl group status ", name_));
    }
    return absl::AbortedError(absl::StrCat(what, ": commit failed on ", RankName(members_[*commit_failed].rank), ": ",
                                           cause.message(),
                                           "; ranks that had committed were put back: ", RankList(restored)));
  }

  GroupChange change{.op = op,
                     .prepare_us = static_cast<uint64_t>(absl::ToInt64Microseconds(prepared_at - start)),
                     .commit_us = static_cast<uint64_t>(absl::ToInt64Microseconds(committed_at - prepared_at))};
  for (size_t i = 0; i < n; ++i) {
    change.prepared_bytes += prepared[i]->prepared_bytes;
    members_[i].rank.pool = committed[i]->pool;
    change.ranks.push_back(*std::move(committed[i]));
  }
  change.total_us = static_cast<uint64_t>(absl::ToInt64Microseconds(absl::Now() - start));
  return change;
}

}  // namespace kvd
