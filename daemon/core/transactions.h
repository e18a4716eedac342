// TransactionTable: the engine-group transactions a daemon holds (id -> pool, expiry), why it aborted
// recent ones, and the reaper's wait for the next expiry. The transaction itself (its staged memory,
// its session) is held by its pool (pool.h); this table only finds it. Thread-safe; its lock is a leaf.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvd::daemon {

class TransactionTable {
 public:
  void Add(std::string id, std::string pool, absl::Time expires) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets `id`; a non-empty `why` (the daemon aborted it) is kept for Lookup's message.
  void Remove(absl::string_view id, absl::string_view why) ABSL_LOCKS_EXCLUDED(mu_);
  // The pool `id` holds; NOT_FOUND naming the daemon's reason when it aborted the transaction.
  [[nodiscard]] absl::StatusOr<std::string> Lookup(absl::string_view id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until some transaction's expiry passed, then returns those (id, pool) pairs; nullopt once
  // Stop was called.
  std::optional<std::vector<std::pair<std::string, std::string>>> AwaitExpired() ABSL_LOCKS_EXCLUDED(mu_);
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::string pool;
    absl::Time expires;
  };
  static constexpr size_t kMaxAbortedRecords = 1024;

  mutable absl::Mutex mu_;
  std::map<std::string, Entry, std::less<>> live_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string, std::less<>> aborted_ ABSL_GUARDED_BY(mu_);  // id -> why
  std::vector<std::string> aborted_order_ ABSL_GUARDED_BY(mu_);
  bool changed_ ABSL_GUARDED_BY(mu_) = false;  // an Add since the reaper last looked
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvd::daemon
