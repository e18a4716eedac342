// Budget: the bytes the daemon may commit on its device, shared by every pool. Bytes are taken before
// a grow or wake creates memory (so concurrent grows of different pools see each other) and given back
// when the memory is really free: released by the daemon and acknowledged by every client that mapped
// it. Thread-safe; its lock is a leaf.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvd::daemon {

class Budget {
 public:
  // `on_give` (may be empty) is called after every Give, without the budget's lock: waiting grows look
  // again (arbiter.h).
  explicit Budget(uint64_t limit, std::function<void()> on_give = {}) : limit_(limit), on_give_(std::move(on_give)) {}

  uint64_t limit() const { return limit_; }
  uint64_t committed() const ABSL_LOCKS_EXCLUDED(mu_);
  // Takes `bytes` when they fit under the limit. Otherwise takes nothing and returns false with the
  // bytes that were free in `*free`.
  [[nodiscard]] bool TryTake(uint64_t bytes, uint64_t* free) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes `bytes` even past the limit: memory that exists already (restored after a restart).
  void Take(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void Give(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const uint64_t limit_;
  const std::function<void()> on_give_;
  mutable absl::Mutex mu_;
  uint64_t committed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvd::daemon
