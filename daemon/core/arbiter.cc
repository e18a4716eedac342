#include "daemon/core/arbiter.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvd/status.h"
#include "kvd/units.h"

namespace kvd::daemon {
namespace {

// The payload that marks a refusal waiting may cure (Arbiter::IsShortOfMemory).
constexpr char kShortOfMemory[] = "type.kvd.dev/arbiter.ShortOfMemory";

absl::Status Short(std::string message) {
  absl::Status status = absl::ResourceExhaustedError(std::move(message));
  status.SetPayload(kShortOfMemory, absl::Cord("1"));
  return status;
}

std::string Bytes(uint64_t bytes) { return absl::StrCat(bytes, " bytes (", FormatBytes(bytes), ")"); }

// The committed bytes of `blocks` blocks of a pool with `geometry`.
uint64_t BytesOf(const Geometry& geometry, uint64_t blocks) {
  return geometry.CommittedBytes(geometry.PrefixBytes(blocks));
}

}  // namespace

// --- Admission and Ticket ---

Arbiter::Admission::Admission(Admission&& other) noexcept
    : arbiter_(std::exchange(other.arbiter_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

Arbiter::Admission& Arbiter::Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    if (arbiter_ != nullptr) arbiter_->Finished(bytes_);
    arbiter_ = std::exchange(other.arbiter_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

Arbiter::Admission::~Admission() {
  if (arbiter_ != nullptr) arbiter_->Finished(bytes_);
}

Arbiter::Ticket::Ticket(Ticket&& other) noexcept
    : arbiter_(std::exchange(other.arbiter_, nullptr)), id_(std::exchange(other.id_, 0)) {}

Arbiter::Ticket& Arbiter::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    if (arbiter_ != nullptr) arbiter_->Leave(id_);
    arbiter_ = std::exchange(other.arbiter_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

Arbiter::Ticket::~Ticket() {
  if (arbiter_ != nullptr) arbiter_->Leave(id_);
}

// --- The arbiter ---

Arbiter::Arbiter(Budget* budget, Device* device, Options options)
    : budget_(budget), device_(device), options_(options) {}

void Arbiter::SetHooks(Hooks hooks) {
  absl::MutexLock lock(&mu_);
  hooks_ = std::move(hooks);
}

void Arbiter::Add(const std::string& pool, uint32_t owner_uid, const PoolPolicy& policy) {
  absl::MutexLock lock(&mu_);
  pools_[pool] = Entry{.owner_uid = owner_uid, .policy = policy};
  ++kicks_;
  changed_.SignalAll();
}

void Arbiter::Remove(absl::string_view pool) {
  std::vector<ArbiterEvent> events;
  {
    absl::MutexLock lock(&mu_);
    auto it = pools_.find(pool);
    if (it == pools_.end()) return;
    if (it->second.reclaim.has_value()) {
      EndReclaimLocked(it->first, it->second, "gone", "the pool was deleted", &events);
    }
    pools_.erase(it);
    ++kicks_;
    changed_.SignalAll();
  }
  Emit(events);
}

PoolClaim Arbiter::Claim(absl::string_view pool) const {
  absl::MutexLock lock(&mu_);
  PoolClaim claim;
  auto it = pools_.find(pool);
  if (it != pools_.end()) {
    const Entry& e = it->second;
    claim.policy = e.policy;
    claim.usage = e.usage;
    claim.reclaim.last_outcome = e.last_outcome;
    if (e.reclaim.has_value()) {
      claim.reclaim.id = e.reclaim->id;
      claim.reclaim.asked_bytes = e.reclaim->asked_bytes;
      claim.reclaim.given_bytes = e.reclaim->given_bytes;
      claim.reclaim.asked_at = e.reclaim->asked_at;
      claim.reclaim.deadline = e.reclaim->deadline;
    }
  }
  for (const auto& [id, w] : waiters_) {
    if (w.served || w.pool != pool) continue;
    uint32_t position = 1;
    for (const auto& [other, o] : waiters_) {
      if (other != id && !o.served && BeforeLocked(other, id)) ++position;
    }
    claim.waiting.push_back({.asked_bytes = w.asked_bytes, .since = w.since, .position = position});
  }
  return claim;
}

uint64_t Arbiter::GuaranteedLocked(uint32_t owner_uid, absl::string_view except, uint64_t* total) const {
  uint64_t of_owner = 0;
  *total = 0;
  for (const auto& [name, e] : pools_) {
    if (name == except) continue;
    *total += e.policy.min_bytes;
    if (e.owner_uid == owner_uid) of_owner += e.policy.min_bytes;
  }
  return of_owner;
}

absl::Status Arbiter::CheckGuaranteesLocked(absl::string_view pool, const PoolPolicy& old, const PoolPolicy& next,
                                            uint32_t caller_uid, uint32_t owner_uid, const Limits& limits) const {
  uint64_t total = 0;
  const uint64_t elsewhere = GuaranteedLocked(owner_uid, pool, &total);
  // A zero reclaim timeout is --reclaim-timeout's: a tenant bound by an operator may not loosen that either.
  const auto effective = [this](PoolPolicy p) {
    if (p.reclaim_timeout == absl::ZeroDuration()) p.reclaim_timeout = options_.reclaim_timeout;
    return p;
  };
  KVD_RETURN_IF_ERROR(AuthorizePolicy(pool, effective(old), effective(next), caller_uid, owner_uid, elsewhere, limits));
  // Guarantees are promises of the budget: together they must fit in it.
  if (next.min_bytes > old.min_bytes && total + next.min_bytes > budget_->limit()) {
    return absl::ResourceExhaustedError(absl::StrCat("policy.min_bytes: the pools of this daemon have ", Bytes(total),
                                                     " guaranteed already; another ", Bytes(next.min_bytes),
                                                     " would pass the daemon's budget of ", Bytes(budget_->limit())));
  }
  return absl::OkStatus();
}

absl::StatusOr<PoolPolicy> Arbiter::CheckNew(absl::string_view pool, const PoolPolicy& policy, uint32_t caller_uid,
                                             uint32_t owner_uid, uint64_t capacity_bytes, const Limits& limits) const {
  PoolPolicy next = policy;
  next.operator_bounds = false;
  KVD_RETURN_IF_ERROR(ValidatePolicy(next, capacity_bytes));
  absl::MutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(CheckGuaranteesLocked(pool, PoolPolicy{}, next, caller_uid, owner_uid, limits));
  return next;
}

absl::StatusOr<PoolPolicy> Arbiter::Change(absl::string_view pool, const PolicyChange& change, uint32_t caller_uid,
                                           uint64_t capacity_bytes, const Limits& limits) {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(pool);
  if (it == pools_.end()) return absl::NotFoundError(absl::StrCat("pool ", pool, " does not exist"));
  Entry& e = it->second;
  PoolPolicy next = Applied(e.policy, change);
  KVD_RETURN_IF_ERROR(ValidatePolicy(next, capacity_bytes));
  KVD_RETURN_IF_ERROR(CheckGuaranteesLocked(pool, e.policy, next, caller_uid, e.owner_uid, limits));
  if (IsOperatorUid(caller_uid, limits.daemon_uid) && !IsOperatorUid(e.owner_uid, limits.daemon_uid) &&
      (change.max_bytes || change.reclaim_timeout || change.on_timeout)) {
    next.operator_bounds = true;
  }
  e.policy = next;
  ++kicks_;  // a priority changes the queue's order
  changed_.SignalAll();
  return next;
}

absl::Status Arbiter::Report(absl::string_view pool, const UsageReport& usage, uint64_t committed_blocks) {
  if (usage.used_blocks < usage.live_blocks || usage.used_blocks - usage.live_blocks < usage.evictable_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("used_blocks: ", usage.used_blocks, " is below live_blocks + evictable_blocks (",
                     usage.live_blocks, " + ", usage.evictable_blocks, "): every block in use lies below used_blocks"));
  }
  if (usage.used_blocks > committed_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("used_blocks: ", usage.used_blocks, " is past the pool's committed blocks, ", committed_blocks));
  }
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(pool);
  if (it == pools_.end()) return absl::NotFoundError(absl::StrCat("pool ", pool, " does not exist"));
  it->second.usage = usage;
  ++kicks_;
  changed_.SignalAll();
  return absl::OkStatus();
}

absl::Status Arbiter::Decline(absl::string_view pool, uint64_t reclaim_id, std::string reason) {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(pool);
  if (it == pools_.end()) return absl::NotFoundError(absl::StrCat("pool ", pool, " does not exist"));
  std::optional<Reclaim>& r = it->second.reclaim;
  if (!r.has_value() || r->id != reclaim_id || r->acting) {
    return absl::NotFoundError(absl::StrCat(
        "reclaim_id: no reclaim ", reclaim_id, " of pool ", pool, " is waiting for an answer",
        it->second.last_outcome.empty() ? "" : absl::StrCat(" (the last one: ", it->second.last_outcome, ")")));
  }
  // Its first 256 bytes, cut where a character starts: the reason travels on in proto3 strings
  // (Pool.reclaim.last_outcome, the waiting grow's error), which must stay valid UTF-8.
  size_t cut = std::min<size_t>(reason.size(), 256);
  while (cut > 0 && cut < reason.size() && (static_cast<unsigned char>(reason[cut]) & 0xC0) == 0x80) --cut;
  reason.resize(cut);
  r->declined = true;
  r->decline_reason = std::move(reason);
  ++kicks_;
  changed_.SignalAll();
  return absl::OkStatus();
}

// --- Admission ---

void Arbiter::Finished(uint64_t bytes) {
  if (bytes == 0) return;
  finished_.fetch_add(bytes, std::memory_order_acq_rel);
  Kick();
}

bool Arbiter::IsShortOfMemory(const absl::Status& status) { return status.GetPayload(kShortOfMemory).has_value(); }

uint32_t Arbiter::PriorityLocked(absl::string_view pool) const {
  auto it = pools_.find(pool);
  return it == pools_.end() ? 0 : it->second.policy.priority;
}

bool Arbiter::BeforeLocked(uint64_t a, uint64_t b) const {
  const uint32_t pa = PriorityLocked(waiters_.at(a).pool);
  const uint32_t pb = PriorityLocked(waiters_.at(b).pool);
  return pa > pb || (pa == pb && a < b);
}

uint64_t Arbiter::HeadLocked() const {
  uint64_t head = 0;
  for (const auto& [id, w] : waiters_) {
    if (!w.served && (head == 0 || BeforeLocked(id, head))) head = id;
  }
  return head;
}

namespace {
// The ticket whose tries this thread's admissions are (Arbiter::Retry).
struct Retrying {
  const Arbiter* arbiter = nullptr;
  uint64_t ticket = 0;
};
thread_local Retrying retrying;
}  // namespace

Arbiter::Retry::Retry(const Ticket& ticket) : previous_arbiter_(retrying.arbiter), previous_ticket_(retrying.ticket) {
  retrying = {.arbiter = ticket.arbiter_, .ticket = ticket.id()};
}

Arbiter::Retry::~Retry() { retrying = {.arbiter = previous_arbiter_, .ticket = previous_ticket_}; }

Arbiter::Waiter* Arbiter::RetryingLocked(absl::string_view pool, uint64_t* id) {
  *id = 0;
  if (retrying.arbiter != this) return nullptr;
  auto it = waiters_.find(retrying.ticket);
  if (it == waiters_.end() || it->second.pool != pool) return nullptr;
  if (it->second.served) {
    // Admitted before, then refused further on (the driver short of memory): waiting again.
    AccountPressureLocked(absl::Now());
    it->second.served = false;
  }
  *id = it->first;
  return &it->second;
}

absl::StatusOr<Arbiter::Admission> Arbiter::Admit(const Ask& ask) {
  if (ask.bytes == 0) return Admission();
  // What is being made is bounded from above by the bytes admitted so far less those finished *before* the
  // device was asked: a creation that finishes between the two looks is counted twice, never not at all.
  const uint64_t finished_before = finished_.load(std::memory_order_acquire);
  // A device that cannot say what it has free admits nothing: its error, as it is.
  KVD_ASSIGN_OR_RETURN(const DeviceInfo info, device_->Info());
  absl::MutexLock lock(&mu_);
  auto entry = pools_.find(ask.pool);
  const PoolPolicy policy = entry == pools_.end() ? PoolPolicy{} : entry->second.policy;
  const std::string head = absl::StrCat("pool ", ask.pool, ": ", ask.what, " needs ", Bytes(ask.bytes));
  if (!ask.reshape && policy.max_bytes != 0 && ask.committed_bytes + ask.bytes > policy.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("pool ", ask.pool, ": ", ask.what, " would hold ",
                                                     Bytes(ask.committed_bytes + ask.bytes),
                                                     ", past its policy.max_bytes of ", Bytes(policy.max_bytes)));
  }
  uint64_t mine = 0;
  Waiter* waiter = nullptr;
  if (!ask.reshape) {
    waiter = RetryingLocked(ask.pool, &mine);
    uint64_t ahead = 0;
    uint64_t first = 0;
    for (const auto& [id, w] : waiters_) {
      if (w.served || id == mine) continue;
      const bool before = mine == 0 ? PriorityLocked(w.pool) >= policy.priority : BeforeLocked(id, mine);
      if (!before) continue;
      ++ahead;
      if (first == 0 || BeforeLocked(id, first)) first = id;
    }
    if (ahead > 0) {
      if (waiter != nullptr) waiter->short_bytes = 0, waiter->asked_bytes = ask.bytes;
      if (mine == 0) ++refused_for_memory_;
      const Waiter& f = waiters_.at(first);
      return Short(absl::StrCat(head, ", but ", ahead, " grow", ahead > 1 ? "s or wakes" : " or wake",
                                " waiting for memory come", ahead > 1 ? "" : "s", " first (the first: priority ",
                                PriorityLocked(f.pool), ", waiting ",
                                absl::FormatDuration(absl::Trunc(absl::Now() - f.since, absl::Milliseconds(1))),
                                f.asked_bytes > 0 ? absl::StrCat(" for ", Bytes(f.asked_bytes)) : std::string(),
                                "; kvctl pools shows them)", mine == 0 ? "; GrowRequest.wait queues behind them" : ""));
    }
  }
  const uint64_t budget_committed = budget_->committed();
  const uint64_t budget_free = budget_committed < budget_->limit() ? budget_->limit() - budget_committed : 0;
  const uint64_t making = admitted_ > finished_before ? admitted_ - finished_before : 0;
  const uint64_t margin =
      ask.reshape ? std::max(options_.reshape_margin_bytes, device_->granularity()) : options_.headroom_bytes;
  const uint64_t device_room = info.free_bytes > margin + making ? info.free_bytes - margin - making : 0;
  const uint64_t resident = budget_committed > making ? budget_committed - making : 0;
  const uint64_t used = info.total_bytes > info.free_bytes ? info.total_bytes - info.free_bytes : 0;
  const uint64_t foreign = used > resident ? used - resident : 0;
  const std::string device_text = absl::StrCat(
      " but the device can back only ", Bytes(device_room), " now: it has ", Bytes(info.free_bytes), " free, less ",
      Bytes(margin), ask.reshape ? " kept for a reshape's own use" : " of headroom (--device-headroom)",
      making > 0 ? absl::StrCat(" and ", Bytes(making), " other commits are making") : std::string(),
      "; other processes use ", Bytes(foreign), " of its ", Bytes(info.total_bytes));
  const uint64_t available = std::min(budget_free, device_room);
  const auto refuse = [&](std::string message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (waiter != nullptr) {
      waiter->short_bytes = ask.bytes - available;
      waiter->asked_bytes = ask.bytes;
    } else if (!ask.reshape) {
      ++refused_for_memory_;
    }
    return Short(std::move(message));
  };
  const auto budget_short = [&](uint64_t free) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return refuse(absl::StrCat(
        head, ask.reshape ? " for new chunks while the chunks they replace still hold theirs," : "", " but only ",
        Bytes(free), " of the daemon's budget of ", FormatBytes(budget_->limit()), " are free"));
  };
  // The budget first (what the operator set), then the device.
  if (ask.bytes > budget_free) return budget_short(budget_free);
  if (ask.bytes > device_room) {
    ++device_refusals_;
    return refuse(absl::StrCat(head, device_text));
  }
  if (uint64_t free = 0; !budget_->TryTake(ask.bytes, &free)) return budget_short(free);
  admitted_ += ask.bytes;
  if (waiter != nullptr) {
    AccountPressureLocked(absl::Now());
    waiter->served = true;
    ++kicks_;  // the next waiter may go
    changed_.SignalAll();
  }
  return Admission(this, ask.bytes);
}

absl::StatusOr<DeviceRoom> Arbiter::Room() const {
  const uint64_t finished_before = finished_.load(std::memory_order_acquire);
  KVD_ASSIGN_OR_RETURN(DeviceInfo info, device_->Info());
  absl::MutexLock lock(&mu_);
  DeviceRoom room{.total_bytes = info.total_bytes,
                  .free_bytes = info.free_bytes,
                  .headroom_bytes = options_.headroom_bytes,
                  .making_bytes = admitted_ > finished_before ? admitted_ - finished_before : 0};
  const uint64_t committed = budget_->committed();
  const uint64_t resident = committed > room.making_bytes ? committed - room.making_bytes : 0;
  const uint64_t used = info.total_bytes > info.free_bytes ? info.total_bytes - info.free_bytes : 0;
  room.foreign_bytes = used > resident ? used - resident : 0;
  const uint64_t budget_free = committed < budget_->limit() ? budget_->limit() - committed : 0;
  const uint64_t reserve = room.headroom_bytes + room.making_bytes;
  room.available_bytes = std::min(budget_free, info.free_bytes > reserve ? info.free_bytes - reserve : 0);
  return room;
}

// --- Waiting ---

void Arbiter::AccountPressureLocked(absl::Time now) {
  bool waiting = false;
  for (const auto& [id, w] : waiters_) waiting = waiting || !w.served;
  if (waiting) pressure_ += now - pressure_since_;
  pressure_since_ = now;
}

Arbiter::Ticket Arbiter::Join(const std::string& pool, uint32_t uid, std::string what) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  AccountPressureLocked(now);
  const uint64_t id = next_ticket_++;
  waiters_[id] = Waiter{.pool = pool, .uid = uid, .what = std::move(what), .since = now};
  return Ticket(this, id);
}

void Arbiter::Leave(uint64_t ticket) {
  std::vector<ArbiterEvent> events;
  // The committed bytes of the pools its reclaims are under way for, read without the lock: a waiter is
  // often served the moment its reclaim's memory comes free, before its Drive saw the pool give it back.
  std::map<std::string, uint64_t, std::less<>> committed;
  bool reclaiming = false;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, e] : pools_) reclaiming |= e.reclaim.has_value() && e.reclaim->for_ticket == ticket;
  }
  if (reclaiming && hooks_.loads) {
    for (const PoolLoad& l : hooks_.loads()) committed[l.name] = l.committed_bytes;
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(ticket);
    if (it == waiters_.end()) return;
    const absl::Time now = absl::Now();
    AccountPressureLocked(now);
    events.push_back({.kind = ArbiterEvent::Kind::kWaitEnded,
                      .outcome = it->second.served ? "ok" : "failed",
                      .elapsed = now - it->second.since});
    waiters_.erase(it);
    // Its reclaims under way serve the next waiter, where that one may reclaim from them; else they end:
    // given back when their pool's committed bytes fell by what was asked (the waiter was served by it),
    // else called off (no deadline action: nobody needs the memory).
    const uint64_t next = HeadLocked();
    for (auto& [name, e] : pools_) {
      if (!e.reclaim.has_value() || e.reclaim->for_ticket != ticket || e.reclaim->acting) continue;
      if (next != 0 && e.policy.priority < PriorityLocked(waiters_.at(next).pool)) {
        e.reclaim->for_ticket = next;
        waiters_.at(next).tried.insert(name);
        continue;
      }
      Reclaim& r = *e.reclaim;
      if (auto c = committed.find(name); c != committed.end()) {
        r.given_bytes = r.committed_at_ask > c->second ? r.committed_at_ask - c->second : 0;
      }
      if (r.given_bytes >= r.asked_bytes) {
        EndReclaimLocked(name, e, "gave",
                         absl::StrCat("gave ", FormatBytes(r.given_bytes), " in ",
                                      absl::FormatDuration(absl::Trunc(now - r.asked_at, absl::Milliseconds(1)))),
                         &events);
      } else {
        EndReclaimLocked(name, e, "called_off", "called off: the grow it was asked for ended", &events);
      }
    }
    ++kicks_;
    changed_.SignalAll();
  }
  Emit(events);
}

void Arbiter::Kick() {
  absl::MutexLock lock(&mu_);
  ++kicks_;
  changed_.SignalAll();
}

void Arbiter::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  changed_.SignalAll();
}

absl::Status Arbiter::AwaitRoom(const Ticket& ticket, absl::Time deadline, const std::function<bool()>& cancelled) {
  bool head = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("kvd is shutting down");
    head = HeadLocked() == ticket.id();
  }
  if (absl::Now() >= deadline) return absl::DeadlineExceededError("the wait's deadline passed");
  if (cancelled && cancelled()) return absl::CancelledError("the caller cancelled the wait");
  if (head) Drive(ticket.id());
  absl::MutexLock lock(&mu_);
  const uint64_t seen = kicks_;
  const absl::Time until = std::min(deadline, absl::Now() + options_.poll);
  while (kicks_ == seen && !stopping_) {
    if (changed_.WaitWithDeadline(&mu_, until)) break;
  }
  if (stopping_) return absl::UnavailableError("kvd is shutting down");
  return absl::OkStatus();
}

void Arbiter::EndReclaimLocked(const std::string& pool, Entry& entry, const std::string& outcome,
                               const std::string& line, std::vector<ArbiterEvent>* events) {
  const Reclaim& r = *entry.reclaim;
  const absl::Time now = absl::Now();
  given_bytes_ += r.given_bytes;
  ++reclaims_[outcome];
  events->push_back({.kind = ArbiterEvent::Kind::kReclaimEnded,
                     .outcome = outcome,
                     .elapsed = now - r.asked_at,
                     .asked_bytes = r.asked_bytes,
                     .given_bytes = r.given_bytes});
  entry.last_outcome = absl::StrCat("reclaim ", r.id, " of ", FormatBytes(r.asked_bytes), ": ", line);
  if (auto w = waiters_.find(r.for_ticket); w != waiters_.end()) {
    w->second.outcomes.push_back(absl::StrCat(pool, "\x1f", entry.owner_uid, "\x1f", entry.policy.priority, "\x1f",
                                              FormatBytes(r.asked_bytes), "\x1f", line));
  }
  entry.reclaim.reset();
  ++kicks_;
  changed_.SignalAll();
}

void Arbiter::Drive(uint64_t ticket) {
  const std::vector<PoolLoad> loads = hooks_.loads ? hooks_.loads() : std::vector<PoolLoad>{};
  std::map<std::string, const PoolLoad*, std::less<>> by_name;
  for (const PoolLoad& l : loads) by_name[l.name] = &l;
  struct ToAsk {
    std::string pool;
    uint64_t id;
    uint64_t bytes;
    absl::Time deadline;
  };
  std::vector<ToAsk> asks;
  std::vector<Due> due;
  std::vector<ArbiterEvent> events;
  {
    absl::MutexLock lock(&mu_);
    auto wit = waiters_.find(ticket);
    if (wit == waiters_.end() || wit->second.served) return;
    Waiter& w = wit->second;
    const absl::Time now = absl::Now();
    // 1. The reclaims under way: given back, or due for their pool's policy.
    uint64_t outstanding = 0;
    for (auto& [name, e] : pools_) {
      if (!e.reclaim.has_value() || e.reclaim->acting) continue;
      Reclaim& r = *e.reclaim;
      auto l = by_name.find(name);
      if (l == by_name.end()) continue;  // created after the snapshot, or going: Remove ends it
      r.given_bytes =
          r.committed_at_ask > l->second->committed_bytes ? r.committed_at_ask - l->second->committed_bytes : 0;
      if (r.given_bytes >= r.asked_bytes) {
        EndReclaimLocked(name, e, "gave",
                         absl::StrCat("gave ", FormatBytes(r.given_bytes), " in ",
                                      absl::FormatDuration(absl::Trunc(now - r.asked_at, absl::Milliseconds(1)))),
                         &events);
        continue;
      }
      std::string why;
      if (r.declined) {
        why = r.decline_reason.empty() ? std::string("declined") : absl::StrCat("declined (", r.decline_reason, ")");
      } else if (now >= r.deadline) {
        why = absl::StrCat("gave ", FormatBytes(r.given_bytes), " by its deadline");
      } else if (l->second->clients == 0) {
        why = "no client attached to answer";
      }
      if (!why.empty()) {
        r.acting = true;
        due.push_back({.pool = name,
                       .reclaim_id = r.id,
                       .action = e.policy.on_timeout,
                       .usage = e.usage,
                       .min_bytes = e.policy.min_bytes,
                       .why = why});
        continue;
      }
      if (r.for_ticket == ticket) outstanding += r.asked_bytes - r.given_bytes;
    }
    // 2. More asks, when what is under way does not cover the shortfall: pools of lower priority (of any
    // priority while the waiter stays within its own guarantee) above their guarantee and the live blocks
    // they reported, lowest priority first, then the most reclaimable.
    const uint64_t need = w.short_bytes > outstanding ? w.short_bytes - outstanding : 0;
    if (need > 0) {
      const uint32_t priority = PriorityLocked(w.pool);
      bool within_min = false;
      if (auto own = by_name.find(w.pool); own != by_name.end()) {
        auto e = pools_.find(w.pool);
        within_min = e != pools_.end() && own->second->committed_bytes + w.asked_bytes <= e->second.policy.min_bytes;
      }
      std::vector<std::tuple<uint32_t, uint64_t, std::string>> candidates;
      for (const PoolLoad& l : loads) {
        auto e = pools_.find(l.name);
        if (l.name == w.pool || e == pools_.end() || e->second.reclaim.has_value() || w.tried.contains(l.name) ||
            l.state != PoolState::kAwake) {
          continue;
        }
        const PoolPolicy& p = e->second.policy;
        if (!(p.priority < priority || within_min)) continue;
        uint64_t floor = p.min_bytes;
        if (e->second.usage.has_value()) {
          floor = std::max(floor, BytesOf(l.geometry, std::min(e->second.usage->live_blocks, l.committed_blocks)));
        }
        if (l.committed_bytes <= floor || l.committed_bytes <= p.min_bytes) continue;
        candidates.emplace_back(p.priority, l.committed_bytes - floor, l.name);
      }
      std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
        if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) < std::get<0>(b);
        if (std::get<1>(a) != std::get<1>(b)) return std::get<1>(a) > std::get<1>(b);
        return std::get<2>(a) < std::get<2>(b);
      });
      uint64_t left = need;
      for (const auto& [p, reclaimable, name] : candidates) {
        if (left == 0) break;
        Entry& e = pools_.at(name);
        const uint64_t bytes = std::min(reclaimable, left);
        const absl::Duration timeout =
            e.policy.reclaim_timeout > absl::ZeroDuration() ? e.policy.reclaim_timeout : options_.reclaim_timeout;
        e.reclaim = Reclaim{.id = next_reclaim_++,
                            .asked_bytes = bytes,
                            .committed_at_ask = by_name.at(name)->committed_bytes,
                            .asked_at = now,
                            .deadline = now + timeout,
                            .for_ticket = ticket};
        w.tried.insert(name);
        asked_bytes_ += bytes;
        asks.push_back({.pool = name, .id = e.reclaim->id, .bytes = bytes, .deadline = e.reclaim->deadline});
        left -= bytes;
      }
    }
  }
  for (const ToAsk& a : asks) {
    if (hooks_.ask) hooks_.ask(a.pool, a.id, a.bytes, a.deadline);
  }
  if (!asks.empty()) Kick();  // a pool with nobody attached is due at once
  for (const Due& d : due) {
    std::string line = d.why;
    const std::string outcome = d.why.rfind("declined", 0) == 0           ? "declined"
                                : d.why == "no client attached to answer" ? "no_answer"
                                                                          : "timed_out";
    std::string action;  // for the actions' counter: "shrink", "sleep", "shrink_failed", ...
    switch (d.action) {
      case ReclaimAction::kNone:
        absl::StrAppend(&line, "; its policy does nothing more (policy.on_reclaim_timeout NONE)");
        break;
      case ReclaimAction::kShrink:
        if (!d.usage.has_value()) {
          absl::StrAppend(&line, "; its policy shrinks to the blocks its engine reported in use, but it reported none");
          action = "shrink_unreported";
        } else if (hooks_.shrink) {
          const absl::StatusOr<uint64_t> shrunk = hooks_.shrink(d.pool, d.usage->used_blocks, d.min_bytes);
          if (!shrunk.ok()) {
            absl::StrAppend(&line, "; shrinking it failed: ", shrunk.status().message());
          } else if (*shrunk == d.usage->used_blocks) {
            absl::StrAppend(&line, "; shrunk to the ", *shrunk, " blocks its engine reported in use");
          } else if (*shrunk > d.usage->used_blocks) {
            absl::StrAppend(&line, "; shrunk to ", *shrunk, " blocks, what its policy.min_bytes holds (its engine ",
                            "reported ", d.usage->used_blocks, " in use)");
          } else {
            absl::StrAppend(&line, "; nothing to shrink: it holds ", *shrunk, " blocks, fewer than the ",
                            d.usage->used_blocks, " its engine reported in use");
          }
          action = shrunk.ok() ? "shrink" : "shrink_failed";
        }
        break;
      case ReclaimAction::kSleep:
        if (hooks_.sleep) {
          absl::StatusOr<std::string> slept = hooks_.sleep(d.pool);
          absl::StrAppend(&line, slept.ok() ? absl::StrCat("; put to sleep, ", *slept)
                                            : absl::StrCat("; putting it to sleep failed: ", slept.status().message()));
          action = slept.ok() ? "sleep" : "sleep_failed";
        }
        break;
    }
    const std::vector<PoolLoad> after =
        action == "shrink" || action == "sleep" ? hooks_.loads() : std::vector<PoolLoad>{};
    absl::MutexLock lock(&mu_);
    if (!action.empty()) ++actions_[action];
    auto e = pools_.find(d.pool);
    if (e == pools_.end() || !e->second.reclaim.has_value() || e->second.reclaim->id != d.reclaim_id) continue;
    Reclaim& r = *e->second.reclaim;
    for (const PoolLoad& l : after) {
      if (l.name == d.pool && r.committed_at_ask > l.committed_bytes)
        r.given_bytes = r.committed_at_ask - l.committed_bytes;
    }
    EndReclaimLocked(d.pool, e->second, outcome, line, &events);
  }
  Emit(events);
}

absl::Status Arbiter::WaitFailed(const Ticket& ticket, const absl::Status& failed,
                                 const std::function<bool(const std::string& pool)>& may_see) const {
  std::vector<std::string> outcomes;
  std::vector<std::string> under_way;
  absl::Duration waited;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(ticket.id());
    if (it == waiters_.end()) return failed;
    waited = absl::Now() - it->second.since;
    outcomes = it->second.outcomes;
    for (const auto& [name, e] : pools_) {
      if (!e.reclaim.has_value() || e.reclaim->for_ticket != ticket.id()) continue;
      under_way.push_back(absl::StrCat(
          name, "\x1f", e.owner_uid, "\x1f", e.policy.priority, "\x1f", FormatBytes(e.reclaim->asked_bytes), "\x1f",
          absl::StrCat("gave ", FormatBytes(e.reclaim->given_bytes), " so far, has until ",
                       absl::FormatTime("%H:%M:%E3S", e.reclaim->deadline, absl::LocalTimeZone()))));
    }
  }
  // "pool a (priority 0) was asked for 2.00 GiB: declined", or "a pool of uid 1001 …" where the waiter's uid
  // may not use it (pool names are not revealed across tenants: docs/api.md, "Identity").
  const auto describe = [&](const std::string& packed) {
    std::vector<std::string> f = absl::StrSplit(packed, '\x1f');
    if (f.size() != 5) return packed;
    const std::string who = may_see(f[0]) ? absl::StrCat("pool ", f[0]) : absl::StrCat("a pool of uid ", f[1]);
    return absl::StrCat(who, " (priority ", f[2], ") was asked for ", f[3], ": ", f[4]);
  };
  std::vector<std::string> lines;
  for (const std::string& o : outcomes) lines.push_back(describe(o));
  for (const std::string& u : under_way) lines.push_back(describe(u));
  std::string text =
      absl::StrCat(failed.message(), "; waited ", absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))));
  if (lines.empty()) {
    absl::StrAppend(&text, " and no pool of lower priority held more than its policy.min_bytes to reclaim from");
  } else {
    absl::StrAppend(&text, ": ", absl::StrJoin(lines, "; "));
  }
  return absl::ResourceExhaustedError(text);
}

ArbiterStats Arbiter::Stats() const {
  absl::MutexLock lock(&mu_);
  ArbiterStats s{.reclaims = reclaims_,
                 .actions = actions_,
                 .asked_bytes = asked_bytes_,
                 .given_bytes = given_bytes_,
                 .refused_for_memory = refused_for_memory_,
                 .device_refusals = device_refusals_};
  const absl::Time now = absl::Now();
  s.pressure = pressure_;
  for (const auto& [id, w] : waiters_) {
    if (w.served) continue;
    ++s.waiting;
    s.waiting_bytes += w.asked_bytes;
    s.longest_wait = std::max(s.longest_wait, now - w.since);
  }
  if (s.waiting > 0) s.pressure += now - pressure_since_;
  for (const auto& [name, e] : pools_) s.reclaims_under_way += e.reclaim.has_value() ? 1 : 0;
  return s;
}

void Arbiter::Emit(const std::vector<ArbiterEvent>& events) const {
  if (!hooks_.observe) return;
  for (const ArbiterEvent& e : events) hooks_.observe(e);
}

}  // namespace kvd::daemon
