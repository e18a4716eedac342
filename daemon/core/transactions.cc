#include "daemon/core/transactions.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvd::daemon {

void TransactionTable::Add(std::string id, std::string pool, absl::Time expires) {
  absl::MutexLock lock(&mu_);
  live_[std::move(id)] = Entry{.pool = std::move(pool), .expires = expires};
  changed_ = true;
}

void TransactionTable::Remove(absl::string_view id, absl::string_view why) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(id);
  if (it == live_.end()) return;
  live_.erase(it);
  if (why.empty()) return;
  if (aborted_order_.size() >= kMaxAbortedRecords) {
    aborted_.erase(aborted_order_.front());
    aborted_order_.erase(aborted_order_.begin());
  }
  aborted_[std::string(id)] = std::string(why);
  aborted_order_.emplace_back(id);
}

absl::StatusOr<std::string> TransactionTable::Lookup(absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(id);
  if (it != live_.end()) return it->second.pool;
  auto a = aborted_.find(id);
  if (a != aborted_.end()) {
    return absl::NotFoundError(absl::StrCat("transaction: ", id, " was aborted by the daemon: ", a->second));
  }
  return absl::NotFoundError(absl::StrCat("transaction: ", id, " is unknown or already ended"));
}

std::optional<std::vector<std::pair<std::string, std::string>>> TransactionTable::AwaitExpired() {
  absl::MutexLock lock(&mu_);
  while (!stopped_) {
    const absl::Time now = absl::Now();
    std::vector<std::pair<std::string, std::string>> expired;
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [id, entry] : live_) {
      if (entry.expires <= now) {
        expired.emplace_back(id, entry.pool);
      } else {
        next = std::min(next, entry.expires);
      }
    }
    if (!expired.empty()) return expired;
    changed_ = false;
    auto woken = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopped_ || changed_; };
    mu_.AwaitWithDeadline(absl::Condition(&woken), next);
  }
  return std::nullopt;
}

void TransactionTable::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

}  // namespace kvd::daemon
