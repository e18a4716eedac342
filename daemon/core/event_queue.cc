#include "daemon/core/event_queue.h"

#include <utility>

namespace kvd::daemon {

void EventQueue::Push(PoolEvent event) {
  absl::MutexLock lock(&mu_);
  if (!closed_) events_.push_back(std::move(event));
}

void EventQueue::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

std::optional<PoolEvent> EventQueue::Pop(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !events_.empty() || closed_; };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (events_.empty()) return std::nullopt;
  PoolEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

bool EventQueue::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

}  // namespace kvd::daemon
