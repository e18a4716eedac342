// Reshaper: plans and runs the reshapes of pools — an exact shrink (in steps when the free memory is short)
// and a compaction (in steps of at most so many replaced chunks under one pause) — as Note [Chunks are
// replaced, not cut] in docs/architecture.md says. It owns the steps: the budget and memory a step makes,
// the daemon's next view of the pool, the clients' pause, the copy and the switch, and what a step leaves
// for the next one. The plans come from the pool (Pool::PlanShrink, PlanTails, PlanCompact over the
// reshape planner, reshape_plan.h); what else it needs it is handed: the device, the budget, the chunk
// maker, and from its manager the narrow ReshapeServices below.
//
// Locks: Shrink and Compact take the pool's op_mu for each step (the whole of an exact shrink in steps)
// and wait for the clients' RESUME without it; nothing of its own is locked.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "daemon/core/arbiter.h"
#include "daemon/core/budget.h"
#include "daemon/core/chunk_maker.h"
#include "daemon/core/pool.h"
#include "daemon/core/pool_types.h"
#include "daemon/core/reshape_plan.h"
#include "kvd/device.h"

namespace kvd::daemon {

// Device memory a reshape step leaves free beside its new chunks (or the granularity, if larger): the
// driver's page tables for mapping them and the staying chunks into the next view, the copy's launch,
// and what other processes on the device (the engines) allocate between the look at the free bytes and
// the creation. Page tables take 8 bytes per 2 MiB page, so mapping a 140 GiB device twice needs under
// 1.2 MiB of them; the rest is headroom for the others, and 64 MiB is under 0.05% of an H200.
inline constexpr uint64_t kReshapeDeviceMargin = uint64_t{64} << 20;

// Shrink as the proto's ShrinkRequest says (PoolManager::Shrink).
struct ShrinkOptions {
  bool wait = false;
  absl::Time deadline = absl::InfiniteFuture();
  bool whole_chunks_only = false;
  std::optional<std::vector<uint64_t>> live;
  PauseOptions pause;
  bool force = false;  // a release of whole chunks only (ReleaseOptions)
};

// Compact as the proto's CompactRequest says (PoolManager::Compact).
struct CompactOptions {
  PauseOptions pause;
  uint32_t max_chunks_per_pause = 0;  // 0: ReshaperOptions::compact_chunks_per_pause
  Interrupt interrupt;
};

// What the reshaper needs from the manager that runs it, and nothing more.
class ReshapeServices {
 public:
  virtual ~ReshapeServices() = default;
  // UNAVAILABLE once the daemon is shutting down.
  [[nodiscard]] virtual absl::Status CheckRunning() const = 0;
  // A shrink that moves no bytes: the resize state machine's plain release of whole chunks.
  [[nodiscard]] virtual absl::StatusOr<PoolUpdate> ReleaseWholeChunksLocked(Pool& pool, absl::string_view session,
                                                                            uint64_t target_blocks,
                                                                            const ReleaseOptions& release,
                                                                            absl::Time start)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) = 0;
  // Before a release of `leaving` asked by `session`: Note [Releases pause first] (PoolManager::QuiesceLocked).
  [[nodiscard]] virtual absl::Status QuiesceLocked(Pool& pool, absl::string_view session, absl::string_view what,
                                                   const std::vector<ChunkInfo>& leaving, const ReleaseOptions& options)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) = 0;
  // After a pause's wait: DEADLINE_EXCEEDED naming a late client, or with `detach` each of them detached
  // (into `*detached`).
  [[nodiscard]] virtual absl::Status SettleLatePause(Pool& pool, absl::string_view what,
                                                     const Pool::PauseOutcome& outcome, absl::Duration timeout,
                                                     bool detach, std::vector<std::string>* detached)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) = 0;
  // Maps the pool's chunks into the daemon's view before it touches their bytes (Note [The daemon maps on
  // demand]).
  [[nodiscard]] virtual absl::Status MapView(Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) = 0;
  // Writes the pool's record (Note [Durable pools]).
  virtual void Save(Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) = 0;
  // Each step that moved bytes, for metrics.
  virtual void ObserveStep(const ReshapeReport& step) = 0;
};

struct ReshaperOptions {
  uint64_t max_chunk_bytes = uint64_t{4} << 30;     // the shape a compaction makes
  absl::Duration pause_timeout = absl::Seconds(5);  // unless PauseOptions.timeout says otherwise
  uint32_t compact_chunks_per_pause = 512;          // unless CompactOptions.max_chunks_per_pause says
};

class Reshaper {
 public:
  // Everything must outlive the reshaper.
  // `arbiter` admits each step's new chunks (Note [Arbitration]); `budget` is the one it admits against.
  Reshaper(Device* device, Budget* budget, Arbiter* arbiter, ChunkMaker* maker, ReshapeServices* services,
           ReshaperOptions options)
      : device_(device), budget_(budget), arbiter_(arbiter), maker_(maker), services_(services), options_(options) {}
  Reshaper(const Reshaper&) = delete;
  Reshaper& operator=(const Reshaper&) = delete;

  // An exact shrink (Pool::PlanShrink), pausing the attached clients when bytes move; one that moves none
  // is the plain release (ReshapeServices::ReleaseWholeChunksLocked). All or nothing when the replacements
  // fit the free memory (Room) at once; otherwise whole chunks past the target first, then steps of as many
  // replacements as fit, each all or nothing, the steps before a failed one done.
  [[nodiscard]] absl::StatusOr<PoolUpdate> Shrink(Pool& pool, absl::string_view session, uint64_t target_blocks,
                                                  const ShrinkOptions& options) ABSL_LOCKS_EXCLUDED(pool.op_mu());
  // A compaction in steps (PoolManager::Compact says what it promises).
  [[nodiscard]] absl::StatusOr<PoolUpdate> Compact(Pool& pool, const CompactOptions& options)
      ABSL_LOCKS_EXCLUDED(pool.op_mu());

  // What one step of a reshape may make: `bytes` is the lower of the budget's free bytes and the device's
  // free bytes less `margin` (kReshapeDeviceMargin or the granularity). The device's errors (Info) as they are.
  struct StepRoom {
    uint64_t budget_free = 0;
    uint64_t device_free = 0;
    uint64_t margin = 0;
    uint64_t bytes = 0;
  };
  [[nodiscard]] absl::StatusOr<StepRoom> Room() const;

 private:
  // A view of a pool in the daemon's address space that is not its current one: the previous view after a
  // step (its old base and the chunks that left the table), or a spare that the next step maps again.
  struct View {
    uint64_t base = 0;
    uint64_t bytes = 0;
    std::vector<ChunkInfo> mapped;    // every chunk mapped in it
    std::vector<ChunkRecord> chunks;  // the chunks that left the table
    uint64_t generation = 0;          // a spare view: the pool's when it was last brought up to date
  };
  // One step, from its run under op_mu (Run) to its end without it (Finish): the update it made, the
  // clients it paused and when, and the previous view it left.
  struct Step {
    PoolUpdate update;
    absl::Time paused_at = absl::InfinitePast();
    std::set<std::string> paused;  // the clients that acknowledged the PAUSE
    View old;
  };
  class Staging;

  absl::Duration PauseTimeout(const PauseOptions& pause) const;
  // RESOURCE_EXHAUSTED: `what` needs `needed` bytes for `for_what` and `room` has less; `freed_first`: the
  // bytes a shrink would release before its steps.
  absl::Status NoRoom(const Pool& pool, absl::string_view what, uint64_t needed, absl::string_view for_what,
                      const StepRoom& room, uint64_t freed_first) const;
  // Moves bytes between chunks under a pause: makes `plan.added` in the next view (`*spare`, brought up to
  // date, when it is a view of the table as it is; it is consumed either way; may be null), asks the clients
  // to pause, copies (block moves first), switches the daemon's base to the next view and applies the plan.
  // On any failure nothing changed: the clients are resumed, the new chunks released, the budget as before.
  // `what` names the change in errors.
  [[nodiscard]] absl::StatusOr<Step> RunLocked(Pool& pool, const ReshapePlan& plan, const PauseOptions& pause,
                                               absl::string_view what, View* spare)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // The end of a step, after op_mu (but between the steps of an exact shrink, which holds it throughout):
  // waits for the RESUME acknowledgements of the paused clients (at most until `resume_deadline`; with
  // `release_deadline`, until the whole release completed or it passed) and fills in the report; `start` is
  // when the step (or the call) began.
  void Finish(Pool& pool, Step& step, absl::Time resume_deadline, std::optional<absl::Time> release_deadline,
              absl::Time start);
  // An exact shrink whose replacements (`whole`, planned for the whole change) do not fit in `room` at once:
  // whole chunks released first, then steps of as many replacements as fit, each finished (the clients
  // resumed, the old chunks released) before the next is planned, all under op_mu. Refuses, changing
  // nothing, when even the largest one replacement cannot fit. `*releases` gets each step's release.
  [[nodiscard]] absl::StatusOr<PoolUpdate> ShrinkInStepsLocked(Pool& pool, absl::string_view session,
                                                               uint64_t target_blocks, const ShrinkOptions& options,
                                                               const ReshapePlan& whole, const StepRoom& room,
                                                               absl::Time start, std::vector<uint64_t>* releases)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu());
  // Unmaps and frees a view's reservation and releases its chunks (nothing else refers to them).
  void TakeDown(View& view);
  // After a step whose clients resumed: its old view becomes `spare`, the next step's next view, less the
  // chunks that left `pool`'s table (released now, so that their memory is free for the next step's new
  // chunks); taken down instead when that fails.
  void KeepForNextStep(View& old, const PoolView& pool, View& spare);
  // Readies a view to be the next one: unmaps every chunk but `staying` from it and releases the chunks
  // that left the table. False (the view still to be taken down) when an unmap failed.
  bool Recycle(View& view, const std::set<uint64_t>& staying);

  Device* const device_;
  Budget* const budget_;
  Arbiter* const arbiter_;
  ChunkMaker* const maker_;
  ReshapeServices* const services_;
  const ReshaperOptions options_;
};

}  // namespace kvd::daemon
