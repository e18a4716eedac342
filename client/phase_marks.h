// Phase marks: named points inside libkvd's attach and release paths, for kvd_bench's per-phase
// breakdown (docs/benchmarks.md). Internal to the project: not part of kvd/client.h, no ABI promise.
//
// With no hook installed (the normal case) a mark is one relaxed atomic load. The hook is called on
// the thread that passes the mark (the caller's for Attach, the follower's for events), so it must
// be thread-safe; it is process-wide, set once (kvd_bench's second process sets it at start).
#pragma once

#include <atomic>

namespace kvd::internal {

using PhaseHook = void (*)(const char* phase);

inline std::atomic<PhaseHook>& PhaseHookSlot() {
  static std::atomic<PhaseHook> hook{nullptr};
  return hook;
}
inline void SetPhaseHook(PhaseHook hook) { PhaseHookSlot().store(hook, std::memory_order_release); }
inline void MarkPhase(const char* phase) {
  if (PhaseHook hook = PhaseHookSlot().load(std::memory_order_acquire); hook != nullptr) hook(phase);
}

}  // namespace kvd::internal
