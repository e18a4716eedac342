// PoolManager (pool_manager.h): engine groups' two-phase resizes (Prepare, Commit, Abort).
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/core/pool_manager.h"
#include "kvd/status.h"

namespace kvd::daemon {

// ---------------------------------------------------------------------------------------------
// Engine groups: the same state machine, split at the RPC boundary

absl::StatusOr<PreparedOp> PoolManager::Prepare(const Caller& caller, absl::string_view name, GroupOp op,
                                                uint64_t target_blocks, absl::Duration ttl, bool force,
                                                const KeepOptions& keep) {
  const absl::Time start = absl::Now();
  if ((op == GroupOp::kSleep || op == GroupOp::kWake) && target_blocks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_blocks: must be unset for ", GroupOpName(op), " (it applies to grow and shrink)"));
  }
  KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("live_blocks", keep.live_blocks.size(), caller.uid, options_.limits)));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op_lock(&pool->op_mu());
  // A shrink or sleep pauses the pausable clients of other sessions until the commit or abort.
  KVD_ASSIGN_OR_RETURN(Change change,
                       PrepareLocked(*pool, op, target_blocks, caller.session, ReleaseOptions{.force = force}, keep));
  const uint64_t prepared_bytes = change.staged.bytes;
  Transaction txn{.id = RandomToken("t-"),
                  .session = caller.session,
                  .pid = caller.pid,
                  .expires = absl::Now() + ttl,
                  .change = std::move(change)};
  const std::string id = txn.id;
  const absl::Time expires = txn.expires;
  if (std::optional<Transaction> refused = pool->Hold(std::move(txn), sessions_); refused.has_value()) {
    // The session closed (or the pool was deleted) while the memory was made: nobody could commit this.
    Unprepare(*pool, refused->change);
    if (pool->deleted()) return PoolGone(name);
    return absl::UnauthenticatedError("kvd-session: the session has closed");
  }
  transactions_.Add(id, pool->name(), expires);
  PreparedOp prepared{.transaction = id,
                      .pool = pool->View(ViewClients::kCounted),
                      .prepared_bytes = prepared_bytes,
                      .expires = expires};
  prepared.elapsed = absl::Now() - start;
  return prepared;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolManager::FindTransaction(absl::string_view transaction) const {
  KVD_ASSIGN_OR_RETURN(const std::string name, transactions_.Lookup(transaction));
  absl::MutexLock lock(&mu_);
  auto p = pools_.find(name);
  if (p == pools_.end()) {
    return absl::NotFoundError(absl::StrCat("transaction: ", transaction, " ended with its pool ", name));
  }
  return p->second;
}

uint64_t PoolManager::AbortLocked(Pool& pool, absl::string_view id, std::optional<absl::string_view> session,
                                  absl::string_view why) {
  absl::StatusOr<Transaction> txn = pool.Unhold(id, session);
  if (!txn.ok()) return 0;
  transactions_.Remove(id, why);
  const uint64_t bytes = txn->change.staged.bytes;
  Unprepare(pool, txn->change);
  return bytes;
}

absl::StatusOr<CommittedOp> PoolManager::Commit(const Caller& caller, absl::string_view transaction, bool wait,
                                                absl::Time deadline) {
  const absl::Time start = absl::Now();
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindTransaction(transaction));
  CommittedOp result;
  {
    absl::MutexLock op(&pool->op_mu());
    // Ended (reaper, a closed session, a forced delete) between the lookup and op_mu: Lookup says why.
    absl::StatusOr<Transaction> txn = pool->Unhold(transaction, caller.session);
    if (!txn.ok()) {
      if (absl::IsPermissionDenied(txn.status())) return txn.status();
      KVD_RETURN_IF_ERROR(transactions_.Lookup(transaction).status());
      return txn.status();
    }
    if (const absl::Duration late = absl::Now() - txn->expires; late > absl::ZeroDuration()) {
      transactions_.Remove(transaction, "not committed within its ttl");
      Unprepare(*pool, txn->change);
      return absl::AbortedError(absl::StrCat("transaction: ", transaction, " expired ",
                                             absl::FormatDuration(absl::Trunc(late, absl::Milliseconds(1))),
                                             " ago and was aborted; prepare again"));
    }
    transactions_.Remove(transaction, "");
    result.op = txn->change.op;
    result.update = CommitLocked(*pool, std::move(txn->change), caller.session, start);
  }
  if (wait && result.update.release_id != 0) {
    pool->AwaitRelease(result.update.release_id, deadline);
    SaveIfSettled(*pool);
    result.update.pool = pool->View(ViewClients::kCounted);
  }
  if (result.op == GroupOp::kGrow) CompactLaterIfFragmented(result.update.pool);
  result.update.elapsed = absl::Now() - start;
  return result;
}

absl::StatusOr<uint64_t> PoolManager::Abort(const Caller& caller, absl::string_view transaction) {
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindTransaction(transaction));
  absl::MutexLock op(&pool->op_mu());
  absl::StatusOr<Transaction> txn = pool->Unhold(transaction, caller.session);
  if (!txn.ok()) {
    if (absl::IsPermissionDenied(txn.status())) return txn.status();
    KVD_RETURN_IF_ERROR(transactions_.Lookup(transaction).status());
    return txn.status();
  }
  transactions_.Remove(transaction, "");
  const uint64_t bytes = txn->change.staged.bytes;
  Unprepare(*pool, txn->change);
  return bytes;
}

}  // namespace kvd::daemon
