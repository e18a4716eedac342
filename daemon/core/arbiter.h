// Arbiter: who gets the device's memory when several engines' pools contend for it (docs/api.md, "Policy,
// waiting and reclaim"; Note [Arbitration] in docs/architecture.md). It is a room of the PoolManager, like the
// Budget it admits against, and keeps, by pool name:
// - each pool's policy (policy.h) and its engine's last usage report (ReportUsage);
// - admission: every commit of new memory (a grow, a wake, a reshape's new chunks) is admitted here, at once,
//   against the budget *and* what the device can back — its free memory less --device-headroom less what
//   other admitted commits are still making — so that concurrent grows of any pools never ask the driver
//   for memory it does not have; a pool's cap (max_bytes) is checked here too;
// - waiting grows: a grow or wake that asks to wait joins a queue ordered by its pool's priority, then by
//   arrival; while anyone waits, a request is admitted only if no waiter comes before it;
// - reclaims: the first waiter, when it cannot be served, asks pools of lower priority holding more than their
//   min_bytes to give memory back (a RECLAIM event to their clients, with the bytes and a deadline), those
//   with the most reclaimable bytes first, and applies each one's policy (ReclaimAction) when it declines,
//   has nobody attached to answer, or lets the deadline pass.
//
// Threads and locks. Every method is thread-safe. The arbiter's lock comes after the pools' locks and before
// the budget's (Note [Lock order]): pools read it for their views (PoolView::claim) under their state lock,
// and it takes the budget's lock inside its own to admit. It never calls into a pool, the device or its hooks
// while holding its lock. Waiting (AwaitRoom) holds no lock of the caller's: a waiting grow holds no op_mu.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/budget.h"
#include "daemon/core/geometry.h"
#include "daemon/core/limits.h"
#include "daemon/core/policy.h"
#include "daemon/core/pool_types.h"
#include "kvd/device.h"

namespace kvd::daemon {

// One pool as the arbiter's reclaims look at it, snapshotted by the manager (Hooks::loads).
struct PoolLoad {
  std::string name;
  uint32_t owner_uid = 0;
  PoolState state = PoolState::kAwake;
  uint64_t committed_blocks = 0;
  uint64_t committed_bytes = 0;
  uint64_t clients = 0;  // attached clients: someone to answer a reclaim
  Geometry geometry;     // for the bytes of a number of blocks
};

// What the device can back now, for DeviceInfo and metrics.
struct DeviceRoom {
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;      // as the driver reports it
  uint64_t headroom_bytes = 0;  // --device-headroom
  uint64_t making_bytes = 0;    // admitted and not yet made
  // total - free - the daemon's own memory (the budget's committed bytes less what is being made): other
  // processes' contexts, weights, graphs.
  uint64_t foreign_bytes = 0;
  // What a grow could be admitted for now: the lower of the budget's free bytes and free - headroom - making.
  uint64_t available_bytes = 0;
};

// Counters and gauges for metrics (docs/metrics.md), read at scrape time.
struct ArbiterStats {
  uint64_t waiting = 0;         // requests waiting now
  uint64_t waiting_bytes = 0;   // what they asked for
  absl::Duration longest_wait;  // of those waiting now
  absl::Duration pressure;      // since start, the time at least one request was waiting (cf. PSI)
  // Ended reclaims by outcome: "gave", "declined", "timed_out", "no_answer" (nobody attached), "gone" (the
  // pool was deleted), "called_off" (the grow it was for ended first).
  std::map<std::string, uint64_t> reclaims;
  // Deadline actions by what they did: "shrink", "sleep", "shrink_failed", "sleep_failed",
  // "shrink_unreported" (the policy shrinks, but the engine reported no usage).
  std::map<std::string, uint64_t> actions;
  uint64_t reclaims_under_way = 0;
  uint64_t asked_bytes = 0;  // by every reclaim since start
  uint64_t given_bytes = 0;
  uint64_t refused_for_memory = 0;    // creates, grows and wakes that did not wait, refused for want of memory
  uint64_t device_refusals = 0;       // of those, because the device could not back them (not the budget)
  uint64_t driver_out_of_memory = 0;  // creations the driver refused after admission (the manager fills it in)
};

// An ended reclaim or wait, for the duration histograms.
struct ArbiterEvent {
  enum class Kind { kReclaimEnded, kWaitEnded } kind = Kind::kReclaimEnded;
  std::string outcome;  // reclaim: as ArbiterStats::reclaims; wait: "ok", "failed"
  absl::Duration elapsed;
  uint64_t asked_bytes = 0;
  uint64_t given_bytes = 0;
};

class Arbiter {
 public:
  struct Options {
    uint64_t headroom_bytes = 0;                         // --device-headroom (0: none)
    uint64_t reshape_margin_bytes = uint64_t{64} << 20;  // a reshape step's device margin (kReshapeDeviceMargin)
    absl::Duration reclaim_timeout = absl::Seconds(5);   // --reclaim-timeout: a policy's zero
    absl::Duration poll = absl::Milliseconds(50);        // how often a waiter looks again without being told
  };
  // What the arbiter asks of the manager. Each is called without the arbiter's lock, from a waiting
  // request's thread.
  struct Hooks {
    std::function<std::vector<PoolLoad>()> loads;
    // Sends a RECLAIM event to every attached client of `pool`; returns how many were told.
    std::function<size_t(const std::string& pool, uint64_t reclaim_id, uint64_t bytes, absl::Time deadline)> ask;
    // The deadline actions, as the daemon's own release (Note [Releases pause first]): an exact shrink to
    // the larger of `used_blocks` and the blocks that hold `min_bytes` (returns the pool's blocks after it),
    // and a sleep.
    std::function<absl::StatusOr<uint64_t>(const std::string& pool, uint64_t used_blocks, uint64_t min_bytes)> shrink;
    // Returns what became of the contents ("its contents kept in the host tier", "its contents lost: …").
    std::function<absl::StatusOr<std::string>(const std::string& pool)> sleep;
    std::function<void(const ArbiterEvent&)> observe;  // may be empty
  };

  // `budget` and `device` outlive the arbiter.
  Arbiter(Budget* budget, Device* device, Options options);
  Arbiter(const Arbiter&) = delete;
  Arbiter& operator=(const Arbiter&) = delete;

  // Installed once by the manager, before any request.
  void SetHooks(Hooks hooks) ABSL_LOCKS_EXCLUDED(mu_);
  const Options& options() const { return options_; }

  // --- Policies ---

  // A pool and its policy (created, restored); replaces an entry of the same name.
  void Add(const std::string& pool, uint32_t owner_uid, const PoolPolicy& policy) ABSL_LOCKS_EXCLUDED(mu_);
  // The pool is gone: its entry, its reclaim and its waiters' claim on the queue.
  void Remove(absl::string_view pool) ABSL_LOCKS_EXCLUDED(mu_);
  // What views show of the pool: policy, usage, reclaim, waiters (defaults for an unknown pool).
  PoolClaim Claim(absl::string_view pool) const ABSL_LOCKS_EXCLUDED(mu_);
  // The policy a new pool of `owner_uid` may have (created by `caller_uid`): ValidatePolicy, AuthorizePolicy
  // against the defaults, and the guarantees of all pools within the budget (RESOURCE_EXHAUSTED naming
  // policy.min_bytes). Changes nothing.
  [[nodiscard]] absl::StatusOr<PoolPolicy> CheckNew(absl::string_view pool, const PoolPolicy& policy,
                                                    uint32_t caller_uid, uint32_t owner_uid, uint64_t capacity_bytes,
                                                    const Limits& limits) const ABSL_LOCKS_EXCLUDED(mu_);
  // Changes the policy of `pool` (checked as CheckNew does, against its current policy). Returns it.
  [[nodiscard]] absl::StatusOr<PoolPolicy> Change(absl::string_view pool, const PolicyChange& change,
                                                  uint32_t caller_uid, uint64_t capacity_bytes, const Limits& limits)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The engine's report of what it uses (ReportUsage). INVALID_ARGUMENT naming the field when
  // used_blocks < live_blocks + evictable_blocks or past `committed_blocks`.
  [[nodiscard]] absl::Status Report(absl::string_view pool, const UsageReport& usage, uint64_t committed_blocks)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The engine declines reclaim `reclaim_id` of `pool` (DeclineReclaim): its policy applies at once.
  // NOT_FOUND naming reclaim_id unless that reclaim is under way for the pool.
  [[nodiscard]] absl::Status Decline(absl::string_view pool, uint64_t reclaim_id, std::string reason)
      ABSL_LOCKS_EXCLUDED(mu_);

  // --- Admission ---

  // In-flight bytes of one admitted commit: released (no longer "being made") when destroyed, once the
  // chunks exist or their creation failed. The budget's bytes are the caller's, as with Budget::TryTake.
  class Admission {
   public:
    Admission() = default;
    Admission(Admission&& other) noexcept;
    Admission& operator=(Admission&& other) noexcept;
    ~Admission();

   private:
    friend class Arbiter;
    Admission(Arbiter* arbiter, uint64_t bytes) : arbiter_(arbiter), bytes_(bytes) {}
    Arbiter* arbiter_ = nullptr;
    uint64_t bytes_ = 0;
  };
  struct Ask {
    std::string pool;
    uint64_t committed_bytes = 0;  // the pool's now
    uint64_t bytes = 0;            // new memory to make
    std::string what;              // "growing to 4096 blocks", for messages
    // A reshape step's new chunks, held only while they replace old ones: not queued behind waiters, and
    // the device keeps only the reshape margin (Note [Chunks are replaced, not cut]).
    bool reshape = false;
  };
  // Takes `ask.bytes` from the budget when the pool's cap, the queue, the budget and the device allow it.
  // RESOURCE_EXHAUSTED otherwise, stating the bytes asked and free; IsShortOfMemory tells the refusals that
  // waiting may cure (all but the cap). The device's own error when it cannot report its memory.
  [[nodiscard]] absl::StatusOr<Admission> Admit(const Ask& ask) ABSL_LOCKS_EXCLUDED(mu_);
  static bool IsShortOfMemory(const absl::Status& status);
  // The device's memory as admission sees it; the device's own errors when it cannot tell.
  [[nodiscard]] absl::StatusOr<DeviceRoom> Room() const ABSL_LOCKS_EXCLUDED(mu_);

  // --- Waiting ---

  // A waiting request's place in the queue, held while it waits and retries; leaving (destruction) ends its
  // reclaims' claim.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept;
    Ticket& operator=(Ticket&& other) noexcept;
    ~Ticket();
    uint64_t id() const { return id_; }

   private:
    friend class Arbiter;
    Ticket(Arbiter* arbiter, uint64_t id) : arbiter_(arbiter), id_(id) {}
    Arbiter* arbiter_ = nullptr;
    uint64_t id_ = 0;
  };
  // While one lives, its thread's admissions (Admit, not a reshape's) are `ticket`'s tries: served, they end
  // its wait. Any other admission, of the same pool too, queues behind the waiters of its priority and above.
  class Retry {
   public:
    explicit Retry(const Ticket& ticket);
    ~Retry();
    Retry(const Retry&) = delete;
    Retry& operator=(const Retry&) = delete;

   private:
    const Arbiter* previous_arbiter_;
    uint64_t previous_ticket_;
  };
  // Joins the queue for `pool` (the caller `uid` may see only the pools it may use named in errors).
  Ticket Join(const std::string& pool, uint32_t uid, std::string what) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until memory may have come free for `ticket` (or its place moved up), then returns OK for the
  // caller to try again; as the first waiter, drives the reclaims. DEADLINE_EXCEEDED once `deadline` passed,
  // CANCELLED when `cancelled` says so, UNAVAILABLE once stopping. Holds no lock of the caller's.
  [[nodiscard]] absl::Status AwaitRoom(const Ticket& ticket, absl::Time deadline,
                                       const std::function<bool()>& cancelled) ABSL_LOCKS_EXCLUDED(mu_);
  // `failed` (the last refusal) with what the wait did: how long, and each reclaim asked for it and how it
  // ended, naming a pool only where `ticket`'s uid may use it (`may_see`).
  absl::Status WaitFailed(const Ticket& ticket, const absl::Status& failed,
                          const std::function<bool(const std::string& pool)>& may_see) const ABSL_LOCKS_EXCLUDED(mu_);
  // Something freed memory or changed the queue: waiters look again.
  void Kick() ABSL_LOCKS_EXCLUDED(mu_);
  // Every waiter returns UNAVAILABLE from now on.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  ArbiterStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Reclaim {
    uint64_t id = 0;
    uint64_t asked_bytes = 0;
    uint64_t given_bytes = 0;
    uint64_t committed_at_ask = 0;
    absl::Time asked_at;
    absl::Time deadline;
    uint64_t for_ticket = 0;
    bool declined = false;
    std::string decline_reason;
    bool acting = false;  // its deadline action runs
  };
  struct Entry {
    uint32_t owner_uid = 0;
    PoolPolicy policy;
    std::optional<UsageReport> usage;
    std::optional<Reclaim> reclaim;
    std::string last_outcome;
  };
  struct Waiter {
    std::string pool;
    uint32_t uid = 0;
    std::string what;
    absl::Time since;
    uint64_t short_bytes = 0;           // the last refusal: bytes more than there was room for
    uint64_t asked_bytes = 0;           // the last refusal: bytes asked
    bool served = false;                // admitted: no longer holds anyone back
    std::set<std::string> tried;        // pools asked during this wait
    std::vector<std::string> outcomes;  // how each of those reclaims ended, for WaitFailed
  };
  // A deadline action to run without the lock.
  struct Due {
    std::string pool;
    uint64_t reclaim_id = 0;
    ReclaimAction action = ReclaimAction::kNone;
    std::optional<UsageReport> usage;
    uint64_t min_bytes = 0;
    std::string why;  // "declined: …", "its deadline passed", "no client attached to answer"
  };

  void Finished(uint64_t bytes);
  void Leave(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t PriorityLocked(absl::string_view pool) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The waiter this thread's admission of `pool` tries for (a Retry of this arbiter's), or null.
  Waiter* RetryingLocked(absl::string_view pool, uint64_t* id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether waiter `a` (priority, id) comes before `b`.
  bool BeforeLocked(uint64_t a, uint64_t b) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The first unserved waiter, 0 when none.
  uint64_t HeadLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  uint64_t GuaranteedLocked(uint32_t owner_uid, absl::string_view except, uint64_t* total) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  [[nodiscard]] absl::Status CheckGuaranteesLocked(absl::string_view pool, const PoolPolicy& old,
                                                   const PoolPolicy& next, uint32_t caller_uid, uint32_t owner_uid,
                                                   const Limits& limits) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Ends the reclaim of `entry` (pool `pool`) with `outcome` ("gave", ...) and a line for its waiter.
  void EndReclaimLocked(const std::string& pool, Entry& entry, const std::string& outcome, const std::string& line,
                        std::vector<ArbiterEvent>* events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One round of the first waiter's reclaims (AwaitRoom).
  void Drive(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);
  void AccountPressureLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Emit(const std::vector<ArbiterEvent>& events) const;

  Budget* const budget_;
  Device* const device_;
  const Options options_;
  Hooks hooks_;  // set once, before any request

  // Bytes whose creation finished (made, or failed), read before the device's free bytes: together with
  // admitted_ it bounds what is being made from above (Note [Arbitration]).
  std::atomic<uint64_t> finished_{0};

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  uint64_t kicks_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t admitted_ ABSL_GUARDED_BY(mu_) = 0;  // every byte ever admitted for creation
  std::map<std::string, Entry, std::less<>> pools_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);  // by ticket id: arrival order
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_reclaim_ ABSL_GUARDED_BY(mu_) = 1;
  // Stats.
  absl::Duration pressure_ ABSL_GUARDED_BY(mu_);
  absl::Time pressure_since_ ABSL_GUARDED_BY(mu_);  // while anyone waits: when last accounted
  std::map<std::string, uint64_t> reclaims_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> actions_ ABSL_GUARDED_BY(mu_);
  uint64_t asked_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t given_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refused_for_memory_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t device_refusals_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvd::daemon
