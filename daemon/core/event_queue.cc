#include "daemon/core/event_queue.h"

#include <utility>

namespace kvd::daemon {

void EventQueue::Push(PoolEvent event) {
  std::shared_ptr<Listener> listener;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    events_.push_back(std::move(event));
    listener = listener_.lock();
  }
  if (listener != nullptr) listener->Ready();
}

void EventQueue::Close() {
  std::shared_ptr<Listener> listener;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    listener = listener_.lock();
  }
  if (listener != nullptr) listener->Ready();
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

std::optional<PoolEvent> EventQueue::TryPop(bool* ended) {
  absl::MutexLock lock(&mu_);
  *ended = events_.empty() && closed_;
  if (events_.empty()) return std::nullopt;
  PoolEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

bool EventQueue::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

void EventQueue::Listen(std::weak_ptr<Listener> listener) {
  absl::MutexLock lock(&mu_);
  listener_ = std::move(listener);
}

}  // namespace kvd::daemon
