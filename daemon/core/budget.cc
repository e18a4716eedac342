#include "daemon/core/budget.h"

#include <cassert>

namespace kvd::daemon {

uint64_t Budget::committed() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

bool Budget::TryTake(uint64_t bytes, uint64_t* free) {
  absl::MutexLock lock(&mu_);
  const uint64_t available = limit_ > committed_ ? limit_ - committed_ : 0;
  if (bytes > available) {
    *free = available;
    return false;
  }
  committed_ += bytes;
  return true;
}

void Budget::Take(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  committed_ += bytes;
}

void Budget::Give(uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    assert(bytes <= committed_);
    committed_ -= bytes;
  }
  if (on_give_ && bytes > 0) on_give_();
}

}  // namespace kvd::daemon
