// EventQueue: one attached client's events, in order (the Watch stream's source). Thread-safe; its
// lock is a leaf (nothing else is taken while it is held), so a pool may push while holding its own.
#pragma once

#include <deque>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/pool_types.h"

namespace kvd::daemon {

// Closed when the client detaches, its pool is deleted or the daemon stops; Pop then drains what is
// left and returns nullopt. Events pushed after Close are dropped.
class EventQueue {
 public:
  void Push(PoolEvent event) ABSL_LOCKS_EXCLUDED(mu_);
  void Close() ABSL_LOCKS_EXCLUDED(mu_);
  // The next event, or nullopt after `timeout` or once closed and drained.
  std::optional<PoolEvent> Pop(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  bool closed() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::deque<PoolEvent> events_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvd::daemon
