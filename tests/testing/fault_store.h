// FaultStore: a StateStore (daemon/core/durable.h) that forwards to another one and fails calls on
// request, as FaultDevice does for the device. It proves that a failed save is sticky and visible and that
// a refused FD leaves nothing behind.
#pragma once

#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/core/durable.h"

namespace kvd::testing {

class FaultStore final : public daemon::StateStore {
 public:
  enum class Op { kSave, kForget, kKeep };

  // `inner` must outlive this store.
  explicit FaultStore(daemon::StateStore* inner) : inner_(inner) {}

  // The `nth` call (1-based, counted from now) of `op` fails with `status`; with `times` > 1, that many
  // calls in a row from the nth on.
  void FailNth(Op op, int nth, absl::Status status, int times = 1) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    faults_[op] = {.countdown = nth, .times = times, .status = std::move(status)};
  }
  // Calls of `op` made since the store was made, failed ones included.
  int calls(Op op) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = calls_.find(op);
    return it == calls_.end() ? 0 : it->second;
  }

  daemon::Durability durability() const override { return inner_->durability(); }
  absl::Status SavePool(const daemon::SavedPool& pool) override {
    if (absl::Status s = Fault(Op::kSave); !s.ok()) return s;
    return inner_->SavePool(pool);
  }
  absl::Status ForgetPool(absl::string_view name) override {
    if (absl::Status s = Fault(Op::kForget); !s.ok()) return s;
    return inner_->ForgetPool(name);
  }
  absl::Status KeepChunkFd(uint64_t id, int fd) override {
    if (absl::Status s = Fault(Op::kKeep); !s.ok()) return s;
    return inner_->KeepChunkFd(id, fd);
  }
  void DropChunkFd(uint64_t id) override { inner_->DropChunkFd(id); }
  absl::Status KeepHostTierFd(int fd) override { return inner_->KeepHostTierFd(fd); }
  void DropHostTierFd() override { inner_->DropHostTierFd(); }

 private:
  struct Planned {
    int countdown = 0;
    int times = 1;
    absl::Status status;
  };
  absl::Status Fault(Op op) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    ++calls_[op];
    auto it = faults_.find(op);
    if (it == faults_.end()) return absl::OkStatus();
    if (it->second.countdown > 1) {
      --it->second.countdown;
      return absl::OkStatus();
    }
    absl::Status s = it->second.status;
    if (--it->second.times <= 0) faults_.erase(it);
    return s;
  }

  daemon::StateStore* const inner_;
  mutable absl::Mutex mu_;
  std::map<Op, Planned> faults_ ABSL_GUARDED_BY(mu_);
  std::map<Op, int> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvd::testing
