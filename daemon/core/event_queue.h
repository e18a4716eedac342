// EventQueue: one attached client's events, in order (the Watch stream's source). Thread-safe; its
// lock is a leaf (nothing else is taken while it is held), so a pool may push while holding its own.
#pragma once

#include <deque>
#include <memory>
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
  // Told that the queue changed, so that a reader need not wait in Pop (Note [Watch streams are pushed] in
  // docs/architecture.md): Ready runs after every Push and at Close, on the thread that pushed or closed,
  // outside the queue's lock but maybe inside a pool's. It must not block or call into the PoolManager.
  class Listener {
   public:
    virtual ~Listener() = default;
    virtual void Ready() = 0;
  };

  void Push(PoolEvent event) ABSL_LOCKS_EXCLUDED(mu_);
  void Close() ABSL_LOCKS_EXCLUDED(mu_);
  // The next event, or nullopt after `timeout` or once closed and drained.
  std::optional<PoolEvent> Pop(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // The next event without waiting. nullopt when none is queued; `*ended` says then whether none ever will
  // (closed and drained), decided under the same lock as the pop.
  std::optional<PoolEvent> TryPop(bool* ended) ABSL_LOCKS_EXCLUDED(mu_);
  bool closed() const ABSL_LOCKS_EXCLUDED(mu_);
  // Tells `listener` from now on, while it lives (the queue holds it weakly); replaces an earlier one.
  void Listen(std::weak_ptr<Listener> listener) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::deque<PoolEvent> events_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::weak_ptr<Listener> listener_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvd::daemon
