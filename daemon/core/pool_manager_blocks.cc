// PoolManager (pool_manager.h): block operations, connectors and the handle channel.
#include <unistd.h>

#include <algorithm>
#include <string>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/core/pool_manager.h"
#include "kvd/status.h"

namespace kvd::daemon {

// ---------------------------------------------------------------------------------------------
// Block operations

absl::StatusOr<TransferPlan> PoolManager::DescribeTransfer(const Caller& caller, absl::string_view name,
                                                           absl::Span<const uint64_t> block_ids) const {
  KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("block_ids", block_ids.size(), caller.uid, options_.limits)));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  const PoolView view = pool->View(ViewClients::kCounted);
  if (view.state == PoolState::kSleeping) {
    return absl::FailedPreconditionError(absl::StrCat("pool ", name, " is sleeping: it has no committed blocks"));
  }
  if (view.state == PoolState::kRecovering) {
    return absl::UnavailableError(absl::StrCat("pool ", name,
                                               " is recovering after a kvd restart: ", view.missing_chunk_ids.size(),
                                               " chunks not yet given back by the clients that map them; retry"));
  }
  TransferPlan plan;
  KVD_ASSIGN_OR_RETURN(plan.descriptors,
                       ::kvd::daemon::DescribeTransfer(view.geometry, view.committed_blocks, block_ids));
  plan.blocks = block_ids.empty() ? view.committed_blocks : block_ids.size();
  for (const TransferDescriptor& d : plan.descriptors) plan.bytes += d.bytes * d.count;
  plan.committed_blocks = view.committed_blocks;
  plan.generation = view.generation;
  return plan;
}

absl::Status PoolManager::CheckInterrupt(absl::string_view call, const Interrupt& interrupt, size_t done,
                                         size_t total) const {
  const std::string progress = absl::StrCat(" after ", done, " of ", total, " entries (those are done, the rest not)");
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError(absl::StrCat("kvd is shutting down: ", call, " stopped", progress));
  }
  // The deadline first: gRPC also cancels a call whose deadline passed.
  if (absl::Now() >= interrupt.deadline) {
    return absl::DeadlineExceededError(absl::StrCat(call, ": the deadline of the call passed", progress));
  }
  if (interrupt.cancelled && interrupt.cancelled()) {
    return absl::CancelledError(absl::StrCat(call, ": the caller cancelled the call", progress));
  }
  return absl::OkStatus();
}

template <typename Entry, typename Op>
absl::Status PoolManager::InSlices(absl::string_view call, const Interrupt& interrupt, const BlockSpan& span,
                                   absl::Span<const Entry> entries, Op op) const {
  const uint64_t per_entry = std::max<uint64_t>(1, span.segments * span.block_bytes);
  const size_t slice = static_cast<size_t>(std::max<uint64_t>(1, options_.block_slice_bytes / per_entry));
  for (size_t done = 0; done < entries.size(); done += slice) {
    KVD_RETURN_IF_ERROR(CheckInterrupt(call, interrupt, done, entries.size()));
    KVD_RETURN_IF_ERROR(op(entries.subspan(done, slice)));
  }
  return absl::OkStatus();
}

absl::Status PoolManager::ZeroBlocks(const Caller& caller, absl::string_view name, absl::Span<const uint64_t> blocks,
                                     const Interrupt& interrupt) {
  KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("block_ids", blocks.size(), caller.uid, options_.limits)));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  // Only this pool's op_mu is held across the slices: other pools, and the device's VA book that their
  // grows need, are free between slices.
  absl::MutexLock op(&pool->op_mu());
  KVD_ASSIGN_OR_RETURN(const BlockSpan span, pool->AwakeSpan());
  // Everything is checked before any work: the ids, and that none repeats (bounding the work by the
  // pool's committed blocks).
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  absl::flat_hash_map<uint64_t, size_t> first;
  first.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (auto [it, inserted] = first.try_emplace(blocks[i], i); !inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat("block_ids[", i, "]: block ", blocks[i], " repeats block_ids[", it->second, "]"));
    }
  }
  KVD_RETURN_IF_ERROR(MapView(*pool));
  return InSlices("ZeroBlocks", interrupt, span, blocks,
                  [&](absl::Span<const uint64_t> slice) { return device_->ZeroBlocks(span, slice); });
}

absl::Status PoolManager::CopyBlocks(const Caller& caller, absl::string_view name, absl::Span<const BlockCopy> copies,
                                     const Interrupt& interrupt) {
  KVD_RETURN_IF_ERROR(Refused(CheckBlockIds("copies", copies.size(), caller.uid, options_.limits)));
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, Find(caller, name));
  absl::MutexLock op(&pool->op_mu());
  KVD_ASSIGN_OR_RETURN(const BlockSpan span, pool->AwakeSpan());
  // The whole request is checked first: no destination twice (which bounds the work by the committed
  // blocks), and none also a source, so the slices may run in any order.
  KVD_RETURN_IF_ERROR(ValidateCopies(span, copies));
  KVD_RETURN_IF_ERROR(MapView(*pool));
  return InSlices("CopyBlocks", interrupt, span, copies,
                  [&](absl::Span<const BlockCopy> slice) { return device_->CopyBlocks(span, slice); });
}

// ---------------------------------------------------------------------------------------------
// Handle channel

absl::StatusOr<std::vector<PoolManager::LeasedFd>> PoolManager::RedeemLease(absl::string_view session,
                                                                            absl::string_view lease_token,
                                                                            uint32_t peer_uid, bool skip_released) {
  absl::StatusOr<Caller> owner = sessions_.Authenticate(session);
  if (!owner.ok()) return absl::UnauthenticatedError("session_token: unknown or closed session");
  if (owner->uid != peer_uid) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", peer_uid, " may not use the session of uid ", owner->uid));
  }
  KVD_ASSIGN_OR_RETURN(const LeaseRecord lease, leases_.Redeem(session, lease_token));
  std::shared_ptr<Pool> pool;
  {
    absl::MutexLock lock(&mu_);
    auto p = pools_.find(lease.pool);
    if (p != pools_.end()) pool = p->second;
  }
  if (pool == nullptr) return absl::FailedPreconditionError(absl::StrCat("pool ", lease.pool, " was deleted"));
  if (lease.ranges.empty()) return pool->DupFds(lease.client, lease.chunk_ids, skip_released, lease.pause_id);
  return RedeemRanges(*pool, lease);
}

absl::Status PoolManager::PushLease(absl::string_view session, absl::string_view lease_token, uint32_t peer_uid,
                                    absl::FunctionRef<absl::Status(absl::Span<const LeasedFd>)> push) {
  absl::StatusOr<Caller> owner = sessions_.Authenticate(session);
  if (!owner.ok()) return absl::UnauthenticatedError("session_token: unknown or closed session");
  if (owner->uid != peer_uid) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", peer_uid, " may not use the session of uid ", owner->uid));
  }
  KVD_ASSIGN_OR_RETURN(LeaseRecord lease, leases_.Redeem(session, lease_token, /*keep_expired=*/true));
  if (!lease.ranges.empty()) {
    leases_.Restore(std::string(lease_token), std::move(lease));
    return absl::InvalidArgumentError("lease_token: a range lease is fetched, not pushed");
  }
  std::shared_ptr<Pool> pool;
  {
    absl::MutexLock lock(&mu_);
    auto p = pools_.find(lease.pool);
    if (p != pools_.end()) pool = p->second;
  }
  if (pool == nullptr) return absl::FailedPreconditionError(absl::StrCat("pool ", lease.pool, " was deleted"));
  absl::StatusOr<std::vector<LeasedFd>> fds = pool->DupFds(lease.client, lease.chunk_ids, false, lease.pause_id);
  absl::Status pushed = fds.ok() ? push(*fds) : fds.status();
  if (fds.ok()) {
    for (const LeasedFd& f : *fds) close(f.fd);
  }
  if (!pushed.ok()) leases_.Restore(std::string(lease_token), std::move(lease));
  return pushed;
}

absl::StatusOr<RangeExport> PoolManager::ExportRanges(const Caller& caller, absl::string_view client_id,
                                                      const std::vector<ByteRange>& ranges) {
  if (!capabilities_.dma_buf.supported) {
    return absl::UnimplementedError(absl::StrCat("ExportRanges: the ", BackendName(device_->kind()),
                                                 " backend has no range export: ", capabilities_.dma_buf.detail));
  }
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindClient(client_id));
  if (!pool->Allows(caller.uid)) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", caller.uid, " may not use pool ", pool->name()));
  }
  return pool->PlanRangeExport(caller, client_id, ranges, capabilities_.range_spans_chunks);
}

absl::StatusOr<std::vector<PoolManager::LeasedFd>> PoolManager::RedeemRanges(Pool& pool, const LeaseRecord& lease) {
  std::vector<LeasedFd> out;
  absl::Cleanup close_all = [&] {
    for (const LeasedFd& f : out) close(f.fd);
  };
  if (!lease.ranges_span_chunks) {
    // One chunk per range: its exported FD, which the handle's fd_offset points into.
    for (size_t i = 0; i < lease.ranges.size(); ++i) {
      KVD_ASSIGN_OR_RETURN(std::vector<LeasedFd> one, pool.DupFds(lease.client, lease.ranges[i].chunk_ids));
      for (LeasedFd& f : one) out.push_back({.chunk_id = i, .fd = f.fd});
    }
  } else {
    // The device exports a range of the daemon's view: op_mu keeps every covered chunk mapped there meanwhile.
    absl::MutexLock op(&pool.op_mu());
    for (size_t i = 0; i < lease.ranges.size(); ++i) {
      const RangeHandle& r = lease.ranges[i];
      KVD_RETURN_IF_ERROR(pool.CheckChunksLive(lease.client, r.chunk_ids));
      KVD_RETURN_IF_ERROR(MapView(pool));
      KVD_ASSIGN_OR_RETURN(const int fd, device_->ExportRange(pool.base() + r.offset, r.bytes));
      out.push_back({.chunk_id = i, .fd = fd});
    }
  }
  std::move(close_all).Cancel();
  return out;
}

}  // namespace kvd::daemon
