#include "daemon/core/reshaper.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvd/status.h"
#include "kvd/units.h"

namespace kvd::daemon {
namespace {

// Adds one step of a reshape in steps to the sum of those before: chunks_before is the first step's,
// chunks_after, the clients and the release the last one's, the rest summed (max_pause the longest).
void AddStep(std::optional<PoolUpdate>& total, PoolUpdate step) {
  if (!total.has_value()) {
    total = std::move(step);
    return;
  }
  ReshapeReport& sum = *total->reshape;
  const ReshapeReport& r = *step.reshape;
  sum.chunks_after = r.chunks_after;
  sum.chunks_replaced += r.chunks_replaced;
  sum.chunks_added += r.chunks_added;
  sum.copied_bytes += r.copied_bytes;
  sum.copy += r.copy;
  sum.paused_clients = r.paused_clients;
  sum.pause += r.pause;
  sum.max_pause = std::max(sum.max_pause, r.max_pause);
  sum.resumed_clients = r.resumed_clients;
  sum.detached_client_ids.insert(sum.detached_client_ids.end(), r.detached_client_ids.begin(),
                                 r.detached_client_ids.end());
  sum.moved_blocks.insert(sum.moved_blocks.end(), r.moved_blocks.begin(), r.moved_blocks.end());
  sum.target_reached = sum.target_reached && r.target_reached;
  sum.steps += r.steps;
  total->pool = std::move(step.pool);
  total->added.insert(total->added.end(), step.added.begin(), step.added.end());
  total->released_chunk_ids.insert(total->released_chunk_ids.end(), step.released_chunk_ids.begin(),
                                   step.released_chunk_ids.end());
  total->release_id = step.release_id;
}

// A step's error once steps before it changed the pool: they stay done, and the error says so.
absl::Status StepsStayDone(const absl::Status& failed, absl::string_view kind, uint32_t steps, size_t chunks_before,
                           size_t chunks_now, absl::string_view go_on) {
  return absl::Status(failed.code(),
                      absl::StrCat(failed.message(), "; what the ", kind, " steps before it did stays done (", steps,
                                   " of them: ", chunks_before, " -> ", chunks_now, " chunks): ", go_on));
}

// `added` names only the new chunks still in the table: a later step may have replaced a chunk an earlier
// one added (a grow between them moved the last chunk's end).
void KeepAddedInTable(PoolUpdate& total) {
  std::set<uint64_t> now;
  for (const ChunkInfo& c : total.pool.chunks) now.insert(c.id);
  std::erase_if(total.added, [&](const ChunkInfo& c) { return !now.contains(c.id); });
}

}  // namespace

// What a step has made before it is applied, and who owns it: the budget taken for the new chunks, the next
// view (its reservation, the staying chunks mapped into it, the new chunks) and the clients' pause. Undo
// gives every part back, the pause first; once the step is applied the pool owns all of it.
class Reshaper::Staging {
 public:
  explicit Staging(Reshaper& reshaper) : r_(reshaper) {}

  uint64_t budget = 0;                // taken from the budget
  uint64_t next = 0;                  // the next view's base (0: none yet)
  uint64_t reserved = 0;              // its bytes
  std::set<uint64_t> in_view;         // staying chunks the next view mapped already (a spare's)
  std::vector<ChunkRecord> added;     // the new chunks, mapped in the next view, their FDs kept
  std::vector<ChunkRecord*> staying;  // the table's chunks that stay
  size_t remapped = 0;                // how many of `staying` this step mapped into the next view
  bool paused = false;                // the clients were asked to pause

  // `pool` is the step's.
  void Undo(Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) {
    if (paused) pool.CancelPause();
    for (size_t i = 0; i < staying.size(); ++i) {
      if (i >= remapped && !in_view.contains(staying[i]->info.id)) continue;
      r_.device_->Unmap(next + staying[i]->info.offset, staying[i]->info.bytes).IgnoreError();
    }
    for (ChunkRecord& c : added) r_.maker_->Discard(next, c);
    if (next != 0) r_.device_->Free(next, reserved).IgnoreError();
    r_.budget_->Give(budget);
  }

 private:
  Reshaper& r_;
};

absl::Duration Reshaper::PauseTimeout(const PauseOptions& pause) const {
  return pause.timeout > absl::ZeroDuration() ? pause.timeout : options_.pause_timeout;
}

absl::StatusOr<Reshaper::StepRoom> Reshaper::Room() const {
  // The device's free bytes less what other admitted commits are still making (Note [Arbitration]).
  KVD_ASSIGN_OR_RETURN(DeviceRoom device, arbiter_->Room());
  const uint64_t committed = budget_->committed();
  StepRoom room{.budget_free = committed < budget_->limit() ? budget_->limit() - committed : 0,
                .device_free = device.free_bytes > device.making_bytes ? device.free_bytes - device.making_bytes : 0,
                .margin = std::max<uint64_t>(kReshapeDeviceMargin, device_->granularity())};
  room.bytes = std::min(room.budget_free, room.device_free > room.margin ? room.device_free - room.margin : 0);
  return room;
}

absl::Status Reshaper::NoRoom(const Pool& pool, absl::string_view what, uint64_t needed, absl::string_view for_what,
                              const StepRoom& room, uint64_t freed_first) const {
  return absl::ResourceExhaustedError(
      absl::StrCat("pool ", pool.name(), ": ", what, " needs ", needed, " bytes (", FormatBytes(needed), ") free for ",
                   for_what, " while the chunks it replaces still hold theirs, but only ", room.budget_free, " bytes (",
                   FormatBytes(room.budget_free), ") of the daemon's budget of ", FormatBytes(budget_->limit()),
                   " are free and the device has ", room.device_free, " bytes (", FormatBytes(room.device_free),
                   ") free, less ", room.margin, " bytes (", FormatBytes(room.margin), ") kept for its own use",
                   freed_first > 0 ? absl::StrCat(", even with the ", freed_first, " bytes (", FormatBytes(freed_first),
                                                  ") of the whole chunks past the target released first")
                                   : ""));
}

absl::StatusOr<PoolUpdate> Reshaper::Shrink(Pool& pool, absl::string_view session, uint64_t target_blocks,
                                            const ShrinkOptions& options) {
  const absl::Time start = absl::Now();
  const std::string what = absl::StrCat("shrinking to ", target_blocks, " blocks");
  Step step;
  std::optional<std::vector<uint64_t>> stepped;  // an exact shrink in steps: the releases of its steps
  {
    absl::MutexLock lock(&pool.op_mu());
    KVD_ASSIGN_OR_RETURN(ReshapePlan plan, pool.PlanShrink(target_blocks, options.whole_chunks_only, options.live));
    if (!plan.moves_bytes()) {
      // Whole chunks go and nothing moves: the plain resize, which needs no pause of its own.
      KVD_ASSIGN_OR_RETURN(step.update, services_->ReleaseWholeChunksLocked(
                                            pool, session, target_blocks,
                                            ReleaseOptions{.force = options.force, .pause = options.pause}, start));
    } else {
      KVD_ASSIGN_OR_RETURN(StepRoom room, Room());
      if (plan.added_bytes() > room.bytes) {
        // Not in one step: see Note [Chunks are replaced, not cut] in docs/architecture.md.
        stepped.emplace();
        KVD_ASSIGN_OR_RETURN(step.update,
                             ShrinkInStepsLocked(pool, session, target_blocks, options, plan, room, start, &*stepped));
      } else {
        KVD_ASSIGN_OR_RETURN(step, RunLocked(pool, plan, options.pause, what, nullptr));
      }
    }
  }
  if (stepped.has_value()) {
    // Each step was finished under op_mu; with wait, every step's release is awaited.
    if (options.wait) {
      for (uint64_t id : *stepped) pool.AwaitRelease(id, options.deadline);
      if (!stepped->empty()) step.update.pool = pool.View(ViewClients::kCounted);
    }
    step.update.elapsed = absl::Now() - start;
    return std::move(step.update);
  }
  // Replied once the paused clients resumed (so that the caller's own Mapping has remapped), at most a
  // pause timeout later; with wait, once every release is acknowledged or the caller's deadline passed.
  Finish(pool, step, absl::Now() + PauseTimeout(options.pause),
         options.wait ? std::optional<absl::Time>(options.deadline) : std::nullopt, start);
  TakeDown(step.old);
  if (step.update.reshape.has_value() && step.update.reshape->steps > 0) services_->ObserveStep(*step.update.reshape);
  return std::move(step.update);
}

absl::StatusOr<PoolUpdate> Reshaper::ShrinkInStepsLocked(Pool& pool, absl::string_view session, uint64_t target_blocks,
                                                         const ShrinkOptions& options, const ReshapePlan& whole,
                                                         const StepRoom& room, absl::Time start,
                                                         std::vector<uint64_t>* releases) {
  const std::string what = absl::StrCat("shrinking to ", target_blocks, " blocks");
  const absl::Duration timeout = PauseTimeout(options.pause);
  KVD_RETURN_IF_ERROR(services_->CheckRunning());
  KVD_RETURN_IF_ERROR(pool.CheckPausable(what));
  // Nothing changed yet: refuse unless the largest replacement (one segment's) fits once the whole chunks
  // past the target are released. Free memory only grows from step to step (each gives back at least
  // what it takes), so every later step fits one too unless someone else takes the memory meanwhile.
  uint64_t largest = 0;
  for (const PlannedChunk& p : whole.added) largest = std::max(largest, p.bytes);
  if (largest > room.bytes + whole.release_first_bytes) {
    return NoRoom(
        pool, what, largest,
        absl::StrCat("the new chunk of one segment (", whole.added_bytes(), " bytes for all ", whole.added.size(), ")"),
        room, whole.release_first_bytes);
  }

  // First the whole chunks at or past a boundary every segment shares: a plain release (the clients of other
  // sessions paused for it first: Note [Releases pause first]), whose memory is free for the steps once the
  // clients that map it acknowledged.
  std::vector<uint64_t> released_first;
  if (whole.release_first_bytes > 0) {
    KVD_RETURN_IF_ERROR(services_->QuiesceLocked(pool, session, what, pool.Leaving(whole.release_first_from),
                                                 ReleaseOptions{.pause = options.pause}));
    std::vector<ChunkRecord> released;
    PoolUpdate freed = pool.ReleaseFrom(whole.release_first_from, &released, session);
    services_->Save(pool);
    for (ChunkRecord& r : released) maker_->Discard(pool.base(), r);
    if (freed.release_id != 0) {
      releases->push_back(freed.release_id);
      pool.AwaitRelease(freed.release_id, absl::Now() + timeout);
    }
    released_first = std::move(freed.released_chunk_ids);
  }

  // Then the straddling chunks, as many segments' a step as the free memory holds. The first step also
  // releases every chunk past the target and moves the live blocks; from it on the prefix is the target's
  // and the segments not yet replaced keep tails past it (the invariants in pool.h) until a later step.
  std::optional<PoolUpdate> total;
  View spare;  // the view the step before left, to be the next one (RunLocked)
  absl::Cleanup take_down_spare = [&] { TakeDown(spare); };
  for (bool first = true;; first = false) {
    const absl::Time step_start = absl::Now();
    absl::StatusOr<Step> made;
    // What is left first (after the first step: no tail left, done), then what of it fits now.
    absl::StatusOr<ReshapePlan> rest =
        first ? pool.PlanShrink(target_blocks, false, options.live) : pool.PlanTails(std::nullopt);
    absl::Status failed = rest.status();
    if (failed.ok() && !first && !rest->moves_bytes()) break;
    absl::StatusOr<StepRoom> now = failed.ok() ? Room() : absl::StatusOr<StepRoom>(failed);
    failed = now.status();
    if (failed.ok()) {
      absl::StatusOr<ReshapePlan> plan =
          first ? pool.PlanShrink(target_blocks, false, options.live, now->bytes) : pool.PlanTails(now->bytes);
      failed = plan.status();
      if (failed.ok() && plan->added.empty()) {
        // Memory not given back yet (a client slow to acknowledge), or taken by others meanwhile.
        failed = NoRoom(pool, what, rest->added.empty() ? 0 : rest->added.front().bytes, "the new chunk of one segment",
                        *now, 0);
      }
      if (failed.ok()) {
        made = RunLocked(pool, *plan, options.pause, what, &spare);
        failed = made.status();
      }
    }
    if (!failed.ok()) {
      if (!total.has_value() && released_first.empty()) return failed;
      const size_t chunks_now = pool.Summary().chunks;
      return StepsStayDone(
          failed, "shrink", total.has_value() ? total->reshape->steps : 0, whole.chunks_before, chunks_now,
          total.has_value()
              ? "the pool has the target's blocks committed, but the chunks of the segments not yet replaced still "
                "run past them: Compact the pool (or shrink it exactly again) to replace them"
              : "whole chunks past the target were released first; shrink again to go on");
    }
    Step& step = *made;
    Finish(pool, step, absl::Now() + timeout, std::nullopt, step_start);
    if (step.update.release_id != 0) releases->push_back(step.update.release_id);
    KeepForNextStep(step.old, step.update.pool, spare);
    services_->ObserveStep(*step.update.reshape);
    AddStep(total, std::move(step.update));
  }
  total->reshape->chunks_before = whole.chunks_before;
  total->released_chunk_ids.insert(total->released_chunk_ids.begin(), released_first.begin(), released_first.end());
  KeepAddedInTable(*total);
  total->elapsed = absl::Now() - start;
  return *std::move(total);
}

absl::StatusOr<PoolUpdate> Reshaper::Compact(Pool& pool, const CompactOptions& options) {
  const absl::Time start = absl::Now();
  const absl::Duration timeout = PauseTimeout(options.pause);
  const size_t per_pause =
      options.max_chunks_per_pause > 0 ? options.max_chunks_per_pause : options_.compact_chunks_per_pause;
  // Each step: plan the next new chunks (at most per_pause old ones replaced with clients to pause, and
  // no more bytes than are free), reshape under op_mu, let the clients resume without it. Planned afresh
  // each time, from the memory the step before gave back, so that a grow between steps is compacted too.
  std::optional<PoolUpdate> total;
  View spare;  // the view the step before left, to be the next one (RunLocked)
  absl::Cleanup take_down_spare = [&] { TakeDown(spare); };
  for (;;) {
    Step step;
    const absl::Time step_start = absl::Now();
    {
      absl::MutexLock lock(&pool.op_mu());
      // With nobody attached the daemon is the only mapper: a new chunk that does not fit may be made of
      // runs of the old ones that do (fewer chunks, if not one a segment).
      const bool alone = pool.Summary().clients == 0;
      // What is left to do first (nothing: in shape), then what of it fits now: no look at the device
      // once the work is done.
      absl::StatusOr<ReshapePlan> rest = pool.PlanCompact(options_.max_chunk_bytes, std::nullopt);
      absl::Status failed = rest.status();
      if (failed.ok() && !rest->moves_bytes()) {
        if (!total.has_value()) {  // already in shape
          total.emplace();
          total->pool = pool.View(ViewClients::kCounted);
          total->reshape = ReshapeReport{.chunks_before = rest->chunks_before,
                                         .chunks_after = static_cast<uint32_t>(total->pool.chunks.size()),
                                         .target_reached = true};
        }
        break;
      }
      absl::StatusOr<StepRoom> room = failed.ok() ? Room() : absl::StatusOr<StepRoom>(failed);
      failed = room.status();
      absl::StatusOr<ReshapePlan> plan = ReshapePlan{};
      if (failed.ok()) {
        plan = pool.PlanCompact(options_.max_chunk_bytes, alone ? std::nullopt : std::optional<size_t>(per_pause),
                                room->bytes, /*smaller=*/alone);
        failed = plan.status();
      }
      if (failed.ok() && !plan->moves_bytes()) {
        // The next new chunk does not fit; after smaller ones, that is as far as the free memory goes.
        if (total.has_value() && !total->reshape->target_reached) break;
        failed = NoRoom(pool, "compacting", rest->added.front().bytes,
                        alone ? "a new chunk of at least two old ones" : "its next new chunk", *room, 0);
      }
      if (failed.ok() && total.has_value()) {
        if (absl::Now() >= options.interrupt.deadline) {
          failed = absl::DeadlineExceededError(absl::StrCat("pool ", pool.name(), ": the deadline of the call passed"));
        } else if (options.interrupt.cancelled && options.interrupt.cancelled()) {
          failed = absl::CancelledError(absl::StrCat("pool ", pool.name(), ": the caller cancelled the call"));
        }
      }
      if (failed.ok()) {
        absl::StatusOr<Step> made = RunLocked(pool, *plan, options.pause, "compacting", &spare);
        failed = made.status();
        if (made.ok()) step = *std::move(made);
      }
      if (!failed.ok()) {
        if (!total.has_value()) return failed;
        // The steps before stay done: the pool is whole, only less fragmented than asked.
        return StepsStayDone(failed, "compaction", total->reshape->steps, total->reshape->chunks_before,
                             pool.Summary().chunks, "Compact again to go on");
      }
    }
    Finish(pool, step, absl::Now() + timeout, std::nullopt, step_start);
    KeepForNextStep(step.old, step.update.pool, spare);
    services_->ObserveStep(*step.update.reshape);
    AddStep(total, std::move(step.update));
  }
  KeepAddedInTable(*total);
  total->elapsed = absl::Now() - start;
  return *std::move(total);
}

absl::StatusOr<Reshaper::Step> Reshaper::RunLocked(Pool& pool, const ReshapePlan& plan, const PauseOptions& pause,
                                                   absl::string_view what, View* spare) {
  KVD_RETURN_IF_ERROR(services_->CheckRunning());
  KVD_RETURN_IF_ERROR(pool.CheckPausable(what));
  // The copy reads the pool through the daemon's view, and the next view replaces all of it (Note [The daemon
  // maps on demand]).
  KVD_RETURN_IF_ERROR(services_->MapView(pool));
  const absl::Duration timeout = PauseTimeout(pause);
  ReshapeReport report{.chunks_before = plan.chunks_before,
                       .chunks_replaced = static_cast<uint32_t>(plan.replaced.size()),
                       .chunks_added = static_cast<uint32_t>(plan.added.size()),
                       .moved_blocks = plan.moves,
                       .target_reached = plan.target_reached,
                       .steps = 1};

  // The new chunks hold their bytes before the old ones give theirs back.
  const uint64_t bytes = plan.added_bytes();
  // Admitted against the budget and the device, keeping only the reshape margin of it (Note [Arbitration]);
  // the admission ends once the new chunks exist (or failed to).
  absl::StatusOr<Arbiter::Admission> admission =
      arbiter_->Admit({.pool = pool.name(), .bytes = bytes, .what = std::string(what), .reshape = true});
  if (!admission.ok()) return absl::Status(admission.status().code(), admission.status().message());
  Staging staging(*this);
  staging.budget = bytes;
  // Until applied, everything made is the step's alone: a failure gives it all back.
  absl::Cleanup undo = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool.op_mu()) { staging.Undo(pool); };

  std::set<uint64_t> leaving(plan.replaced.begin(), plan.replaced.end());
  leaving.insert(plan.released.begin(), plan.released.end());
  std::vector<uint64_t> staying_ids;
  const PoolView now = pool.View(ViewClients::kCounted);
  for (const ChunkInfo& c : now.chunks) {
    if (!leaving.contains(c.id)) staying_ids.push_back(c.id);
  }

  // The daemon's next view of the pool: a reservation of the pool's size where the new chunks are made and
  // the chunks that stay are mapped again. After the copy the daemon switches its base to it, instead of
  // unmapping and mapping chunk by chunk while the clients wait (its base is its own; clients map at
  // theirs). The old view is taken down after the clients resumed (Finish's caller), or handed back as the
  // spare for the next step of a compaction, which brings it up to date (Recycle) rather than mapping every
  // chunk of the pool again.
  staging.reserved = pool.geometry().reserved_bytes();
  if (spare != nullptr && spare->base != 0) {
    // Only a view of the table as this pool has it now: no other change came between the steps.
    if (spare->generation == now.generation && spare->bytes == staging.reserved &&
        Recycle(*spare, std::set<uint64_t>(staying_ids.begin(), staying_ids.end()))) {
      staging.next = spare->base;
      for (const ChunkInfo& c : spare->mapped) staging.in_view.insert(c.id);
      *spare = View{};
    } else {
      TakeDown(*spare);
    }
  }
  if (staging.next == 0) {
    KVD_ASSIGN_OR_RETURN(staging.next, device_->Reserve(staging.reserved));
  }
  absl::StatusOr<std::vector<ChunkRecord>> made =
      maker_->Make(staging.next, plan.added,
                   absl::StrCat("pool ", pool.name(), ": ", what, " needs ", bytes, " bytes (", FormatBytes(bytes),
                                ") of new chunks"),
                   ChunkMaker::Map::kNow);
  *admission = Arbiter::Admission();  // made, or given up: no longer being made
  KVD_ASSIGN_OR_RETURN(staging.added, std::move(made));
  staging.staying = pool.ChunksById(staying_ids);
  for (; staging.remapped < staging.staying.size(); ++staging.remapped) {
    const ChunkRecord& r = *staging.staying[staging.remapped];
    if (staging.in_view.contains(r.info.id)) continue;
    KVD_RETURN_IF_ERROR(device_->Map(staging.next + r.info.offset, r.chunk, Access::kReadWrite));
  }

  // The pause: every attached client imports the new chunks and stops touching the pool.
  Step step;
  const size_t asked = pool.BeginPause(staging.added);
  staging.paused = true;
  if (asked > 0) {
    Pool::PauseOutcome outcome = pool.AwaitPause(absl::Now() + timeout);
    KVD_RETURN_IF_ERROR(services_->SettleLatePause(pool, what, outcome, timeout, pause.detach_unresponsive,
                                                   &report.detached_client_ids));
    report.paused_clients = static_cast<uint32_t>(outcome.paused.size());
    step.paused = std::move(outcome.paused);
  }
  step.paused_at = absl::Now();

  // The copies: live blocks first (they may land in a chunk that is replaced next), then every new chunk
  // from the bytes now at its place in the current view.
  const absl::Time copy_start = absl::Now();
  if (!plan.moves.empty()) {
    KVD_ASSIGN_OR_RETURN(BlockSpan span, pool.AwakeSpan());
    KVD_RETURN_IF_ERROR(device_->CopyBlocks(span, plan.moves));
  }
  const uint64_t base = pool.base();
  for (const PlannedChunk& p : plan.added) {
    KVD_RETURN_IF_ERROR(device_->CopyRange(staging.next + p.offset, base + p.offset, p.bytes));
    report.copied_bytes += p.bytes;
  }
  report.copy = absl::Now() - copy_start;

  // Applied: nothing below can fail. The next view becomes the daemon's, and the pool owns what was staged.
  std::move(undo).Cancel();
  pool.set_base(staging.next);
  step.update = pool.ApplyReshape(plan, std::move(staging.added), &step.old.chunks);
  services_->Save(pool);
  // The record no longer names them (Note [Durable pools]); their memory goes with the old view.
  for (const ChunkRecord& r : step.old.chunks) maker_->ForgetFd(r.info.id);
  step.old.base = base;
  step.old.bytes = staging.reserved;
  step.old.mapped = now.chunks;
  report.chunks_after = static_cast<uint32_t>(step.update.pool.chunks.size());
  step.update.reshape = std::move(report);
  return step;
}

void Reshaper::Finish(Pool& pool, Step& step, absl::Time resume_deadline, std::optional<absl::Time> release_deadline,
                      absl::Time start) {
  PoolUpdate& update = step.update;
  if (!step.paused.empty()) {
    // Only the paused clients' RESUME acknowledgements: a detached holder of the old chunks keeps them
    // counted, but nobody waits for it here.
    const size_t still = pool.AwaitClients(update.release_id, step.paused, resume_deadline);
    update.reshape->resumed_clients = static_cast<uint32_t>(step.paused.size() - std::min(still, step.paused.size()));
    update.reshape->pause = absl::Now() - step.paused_at;
    update.reshape->max_pause = update.reshape->pause;
  }
  if (release_deadline.has_value()) pool.AwaitRelease(update.release_id, *release_deadline);
  if (update.release_id != 0) update.pool = pool.View(ViewClients::kCounted);
  update.elapsed = absl::Now() - start;
}

bool Reshaper::Recycle(View& view, const std::set<uint64_t>& staying) {
  std::vector<ChunkInfo> kept;
  for (size_t i = 0; i < view.mapped.size(); ++i) {
    const ChunkInfo& c = view.mapped[i];
    if (staying.contains(c.id)) {
      kept.push_back(c);
      continue;
    }
    if (!device_->Unmap(view.base + c.offset, c.bytes).ok()) {
      // TakeDown unmaps what is still mapped: the ones kept, this one (it may be), and the rest.
      kept.insert(kept.end(), view.mapped.begin() + static_cast<ptrdiff_t>(i), view.mapped.end());
      view.mapped = std::move(kept);
      return false;
    }
  }
  view.mapped = std::move(kept);
  for (ChunkRecord& r : view.chunks) {
    device_->Release(r.chunk).IgnoreError();
    r.exported.reset();
  }
  view.chunks.clear();
  return true;
}

void Reshaper::KeepForNextStep(View& old, const PoolView& pool, View& spare) {
  std::set<uint64_t> table;
  for (const ChunkInfo& c : pool.chunks) table.insert(c.id);
  if (Recycle(old, table)) {
    old.generation = pool.generation;
    spare = std::move(old);
  } else {
    TakeDown(old);
  }
}

void Reshaper::TakeDown(View& view) {
  if (view.base != 0) {
    for (const ChunkInfo& c : view.mapped) device_->Unmap(view.base + c.offset, c.bytes).IgnoreError();
    device_->Free(view.base, view.bytes).IgnoreError();
  }
  for (ChunkRecord& r : view.chunks) {
    device_->Release(r.chunk).IgnoreError();
    r.exported.reset();
  }
  view = View{};
}

}  // namespace kvd::daemon
