// kvd_torch_alloc: the allocator behind kvd.torch's MemPool (kvd_torch_alloc.h; docs/engines.md).
//
// One process-wide Allocator holds the configuration, one libkvd Client (one session) and an Allocation per live
// pointer, each with its pool's Mapping. Every entry point takes its lock, so allocations, frees and controls are
// serialised; the Mappings' callbacks never take it. The Allocator is leaked on purpose: torch may free memory from
// its own static destructors after ours would have run, and a process that exits without freeing leaves its pools to
// be adopted by the next one (Note [Re-attaching an allocation]); the kernel closes the session.
#include "client/torch/kvd_torch_alloc.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvd/client.h"
#include "kvd/status.h"

#define KVD_TORCH_EXPORT extern "C" __attribute__((visibility("default")))

namespace kvd {
namespace {

thread_local std::string last_error;

int Fail(const absl::Status& status) {
  last_error = status.ToString();
  return -1;
}

// What a Mapping's callbacks report, shared with them so that a callback never needs the Allocator's lock.
struct Health {
  std::atomic<bool> lost{false};
};

struct Allocation {
  std::string pool;
  uint64_t size = 0;
  uint64_t block_bytes = 0;
  uint64_t blocks = 0;  // capacity
  bool adopted = false;
  std::shared_ptr<Health> health;
  std::unique_ptr<Mapping> mapping;

  uint64_t base() const { return reinterpret_cast<uint64_t>(mapping->base()); }
  uint64_t capacity_bytes() const { return blocks * block_bytes; }
  bool Contains(uint64_t p) const { return p >= base() && p < base() + capacity_bytes(); }
};

// Note [A flat allocation's geometry] (docs/engines.md): L = H = N = 1, C = the granularity, e = 1, B = the size in
// granules. Every layout places such a pool the same way: one segment, block i the i-th granule from the base.
PoolDims FlatDims(uint64_t size, uint64_t granularity) {
  return PoolDims{.layers = 1,
                  .capacity_blocks = (size + granularity - 1) / granularity,
                  .heads = 1,
                  .block_tokens = 1,
                  .channels = granularity,
                  .element_bytes = 1};
}

bool IsFlat(const Geometry& g, const PoolDims& want) {
  return g.dims.layers == 1 && g.dims.heads == 1 && g.dims.block_tokens == 1 && g.dims.element_bytes == 1 &&
         g.dims.channels == want.channels && g.dims.capacity_blocks == want.capacity_blocks && g.segments == 1;
}

absl::Status ValidPrefix(absl::string_view prefix) {
  if (prefix.empty() || prefix.size() > 48) {
    return absl::InvalidArgumentError(absl::StrCat("prefix: \"", prefix, "\" must have 1 to 48 characters"));
  }
  for (char c : prefix) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix: \"", prefix, "\" may hold only letters, digits, '.', '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

class Allocator {
 public:
  static Allocator& Get() {
    static Allocator* const instance = new Allocator();  // leaked: see the file comment
    return *instance;
  }

  absl::Status Configure(absl::string_view socket, absl::string_view prefix, int flags) ABSL_LOCKS_EXCLUDED(mu_) {
    KVD_RETURN_IF_ERROR(ValidPrefix(prefix));
    if ((flags & ~KVD_TORCH_KEEP_ON_FREE) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("flags: unknown bits ", flags & ~KVD_TORCH_KEEP_ON_FREE));
    }
    absl::MutexLock lock(&mu_);
    if (!allocations_.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("kvd_torch_configure: ", allocations_.size(),
                                                        " allocations are live; configure before the first one"));
    }
    socket_ = std::string(socket);
    prefix_ = std::string(prefix);
    keep_on_free_ = (flags & KVD_TORCH_KEEP_ON_FREE) != 0;
    next_ = 0;
    client_.reset();  // the next allocation connects to the socket given now
    return absl::OkStatus();
  }

  absl::Status SetHooks(kvd_torch_pause_hook on_pause, kvd_torch_resume_hook on_resume, void* context)
      ABSL_LOCKS_EXCLUDED(mu_) {
    if ((on_pause == nullptr) != (on_resume == nullptr)) {
      return absl::InvalidArgumentError("on_pause and on_resume: give both or neither");
    }
    absl::MutexLock lock(&mu_);
    if (!allocations_.empty()) {
      return absl::FailedPreconditionError("kvd_torch_set_pause_hooks: set the hooks before the first allocation");
    }
    on_pause_ = on_pause;
    on_resume_ = on_resume;
    hook_context_ = context;
    return absl::OkStatus();
  }

  absl::StatusOr<void*> Malloc(int64_t size, int device) ABSL_LOCKS_EXCLUDED(mu_) {
    if (size <= 0) return absl::InvalidArgumentError(absl::StrCat("size: ", size, " bytes; must be > 0"));
    absl::MutexLock lock(&mu_);
    if (prefix_.empty()) {
      return absl::FailedPreconditionError("kvd_torch_malloc: call kvd_torch_configure (kvd.torch does) first");
    }
    KVD_ASSIGN_OR_RETURN(Client * client, Connected(device));
    const std::string name = absl::StrCat(prefix_, "-", next_);
    const PoolDims dims = FlatDims(static_cast<uint64_t>(size), granularity_);
    auto a = std::make_unique<Allocation>();
    a->pool = name;
    a->size = static_cast<uint64_t>(size);
    a->block_bytes = granularity_;
    a->blocks = dims.capacity_blocks;
    a->health = std::make_shared<Health>();

    // Note [Re-attaching an allocation]: a pool of this name with this geometry is adopted.
    bool created = false;
    absl::StatusOr<PoolInfo> found = client->GetPool(name);
    if (!found.ok() && found.status().code() != absl::StatusCode::kNotFound) return found.status();
    if (found.ok()) {
      if (!IsFlat(found->geometry, dims)) {
        return absl::AlreadyExistsError(
            absl::StrCat("pool ", name, " exists with another geometry (", found->geometry.dims.capacity_blocks,
                         " blocks of ", found->geometry.block_stride, " bytes) than this allocation of ", size,
                         " bytes needs (", dims.capacity_blocks, " blocks of ", dims.channels,
                         " bytes): delete it (kvctl delete ", name, ") or configure another prefix"));
      }
      // Only an awake pool with every block committed still holds the previous owner's bytes.
      a->adopted = found->state == PoolState::kAwake && found->committed_blocks >= dims.capacity_blocks;
    } else {
      PoolOptions options{.name = name, .dims = dims, .initial_blocks = dims.capacity_blocks};
      KVD_RETURN_IF_ERROR(client->CreatePool(options).status());
      created = true;
    }
    absl::Status attached = Attach(client, *a);
    if (attached.ok() && !a->adopted && a->mapping->committed_blocks() < a->blocks) {
      // An adopted pool that slept or shrank: back all of it again (its bytes are not the previous owner's).
      if (found.ok() && found->state == PoolState::kSleeping) attached = client->Wake(name).status();
      if (attached.ok() && a->mapping->committed_blocks() < a->blocks) {
        attached = client->Grow(name, a->blocks).status();
      }
    }
    if (!attached.ok()) {
      a->mapping.reset();
      if (created) client->DeletePool(name, /*force=*/false).IgnoreError();
      return attached;
    }
    ++next_;
    void* base = a->mapping->base();
    allocations_.emplace(a->base(), std::move(a));
    return base;
  }

  absl::Status Free(void* ptr) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = allocations_.find(reinterpret_cast<uint64_t>(ptr));
    if (it == allocations_.end()) {
      return absl::NotFoundError(absl::StrCat("kvd_torch_free: 0x", absl::Hex(reinterpret_cast<uint64_t>(ptr)),
                                              " is not an allocation of this library"));
    }
    std::unique_ptr<Allocation> a = std::move(it->second);
    allocations_.erase(it);
    a->mapping.reset();  // detaches, unmaps, frees the VA
    if (keep_on_free_ || client_ == nullptr) return absl::OkStatus();
    absl::StatusOr<uint64_t> deleted = client_->DeletePool(a->pool, /*force=*/false);
    if (!deleted.ok() && deleted.status().code() != absl::StatusCode::kNotFound) return deleted.status();
    return absl::OkStatus();
  }

  int Adopted(const void* ptr) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const Allocation* a = FindLocked(ptr);
    return a == nullptr ? -1 : a->adopted ? 1 : 0;
  }

  int List(kvd_torch_allocation* out, int max) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    std::vector<const Allocation*> order;
    for (const auto& [base, a] : allocations_) order.push_back(a.get());
    // Allocation order is the order of the names' numbers.
    std::sort(order.begin(), order.end(), [](const Allocation* x, const Allocation* y) {
      return x->pool.size() != y->pool.size() ? x->pool.size() < y->pool.size() : x->pool < y->pool;
    });
    for (int i = 0; i < max && i < static_cast<int>(order.size()); ++i) {
      const Allocation& a = *order[i];
      kvd_torch_allocation& o = out[i];
      std::memset(&o, 0, sizeof(o));
      std::strncpy(o.pool, a.pool.c_str(), sizeof(o.pool) - 1);
      o.base = a.base();
      o.size = a.size;
      o.capacity_bytes = a.capacity_bytes();
      o.committed_bytes = a.mapping->committed_blocks() * a.block_bytes;
      o.adopted = a.adopted ? 1 : 0;
      o.state = a.health->lost.load() || a.mapping->state() == Mapping::State::kLost ? 2
                : a.mapping->state() == Mapping::State::kSleeping                    ? 1
                                                                                     : 0;
    }
    return static_cast<int>(order.size());
  }

  enum class Control { kSleep, kWake, kResize, kCompact };

  absl::Status Apply(Control control, const void* ptr, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    std::vector<Allocation*> targets;
    if (ptr == nullptr) {
      for (auto& [base, a] : allocations_) targets.push_back(a.get());
    } else {
      Allocation* a = FindLocked(ptr);
      if (a == nullptr)
        return absl::NotFoundError(
            absl::StrCat("0x", absl::Hex(reinterpret_cast<uint64_t>(ptr)), " is in no allocation of this library"));
      targets.push_back(a);
    }
    if (control == Control::kResize && ptr == nullptr) {
      return absl::InvalidArgumentError("kvd_torch_resize: name one allocation (ptr), not all of them");
    }
    for (Allocation* a : targets) {
      KVD_RETURN_IF_ERROR(ApplyOne(control, *a, bytes));
    }
    return absl::OkStatus();
  }

 private:
  Allocator() = default;

  absl::StatusOr<Client*> Connected(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (client_ == nullptr) {
      KVD_ASSIGN_OR_RETURN(client_, Client::Connect({.socket = socket_, .device = device, .client_name = prefix_}));
      absl::StatusOr<DeviceStatus> info = client_->DeviceInfo();
      if (!info.ok()) {
        client_.reset();
        return info.status();
      }
      granularity_ = info->granularity_bytes;
      device_ = device;
    }
    if (device != device_) {
      return absl::InvalidArgumentError(absl::StrCat("device: ", device, "; this allocator serves device ", device_,
                                                     " (one kvd, one device: configure one allocator per device)"));
    }
    return client_.get();
  }

  absl::Status Attach(Client* client, Allocation& a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    AttachOptions options;
    options.device = absl::StrCat(device_);
    std::shared_ptr<Health> health = a.health;
    options.on_lost = [health](const absl::Status&) { health->lost = true; };
    if (on_pause_ != nullptr) {
      kvd_torch_pause_hook on_pause = on_pause_;
      kvd_torch_resume_hook on_resume = on_resume_;
      void* context = hook_context_;
      std::string pool = a.pool;
      options.on_pause = [on_pause, context, pool](const std::vector<ByteRange>&) { on_pause(context, pool.c_str()); };
      options.on_resume = [on_resume, context, pool](bool applied) { on_resume(context, pool.c_str(), applied); };
    }
    KVD_ASSIGN_OR_RETURN(a.mapping, client->Attach(a.pool, std::move(options)));
    return absl::OkStatus();
  }

  absl::Status ApplyOne(Control control, Allocation& a, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    switch (control) {
      case Control::kSleep:
        if (a.mapping->state() == Mapping::State::kSleeping) return absl::OkStatus();
        return client_->Sleep(a.pool, SleepOptions{.wait = true}).status();
      case Control::kWake:
        if (a.mapping->state() != Mapping::State::kSleeping) return absl::OkStatus();
        return client_->Wake(a.pool).status();
      case Control::kCompact:
        return client_->Compact(a.pool).status();
      case Control::kResize: {
        const uint64_t blocks = (bytes + a.block_bytes - 1) / a.block_bytes;
        if (blocks > a.blocks) {
          return absl::InvalidArgumentError(absl::StrCat("bytes: ", bytes, " is more than allocation ", a.pool,
                                                         " holds (", a.capacity_bytes(), " bytes)"));
        }
        const uint64_t now = a.mapping->committed_blocks();
        if (blocks > now) return client_->Grow(a.pool, blocks).status();
        if (blocks < now) return client_->Shrink(a.pool, blocks, ShrinkOptions{.wait = true}).status();
        return absl::OkStatus();
      }
    }
    return absl::InternalError("unknown control");
  }

  Allocation* FindLocked(const void* ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint64_t p = reinterpret_cast<uint64_t>(ptr);
    auto it = allocations_.upper_bound(p);
    if (it == allocations_.begin()) return nullptr;
    --it;
    return it->second->Contains(p) ? it->second.get() : nullptr;
  }

  absl::Mutex mu_;
  std::string socket_ ABSL_GUARDED_BY(mu_);
  std::string prefix_ ABSL_GUARDED_BY(mu_);
  bool keep_on_free_ ABSL_GUARDED_BY(mu_) = false;
  kvd_torch_pause_hook on_pause_ ABSL_GUARDED_BY(mu_) = nullptr;
  kvd_torch_resume_hook on_resume_ ABSL_GUARDED_BY(mu_) = nullptr;
  void* hook_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<Client> client_ ABSL_GUARDED_BY(mu_);
  uint64_t granularity_ ABSL_GUARDED_BY(mu_) = 0;
  int device_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::unique_ptr<Allocation>> allocations_ ABSL_GUARDED_BY(mu_);  // by base address
};

int Done(const absl::Status& status) {
  if (!status.ok()) return Fail(status);
  last_error.clear();
  return 0;
}

}  // namespace
}  // namespace kvd

KVD_TORCH_EXPORT int kvd_torch_configure(const char* socket, const char* prefix, int flags) {
  return kvd::Done(
      kvd::Allocator::Get().Configure(socket == nullptr ? "" : socket, prefix == nullptr ? "" : prefix, flags));
}

KVD_TORCH_EXPORT int kvd_torch_set_pause_hooks(kvd_torch_pause_hook on_pause, kvd_torch_resume_hook on_resume,
                                               void* context) {
  return kvd::Done(kvd::Allocator::Get().SetHooks(on_pause, on_resume, context));
}

KVD_TORCH_EXPORT void* kvd_torch_malloc(ssize_t size, int device, kvd_cuda_stream) {
  absl::StatusOr<void*> p = kvd::Allocator::Get().Malloc(size, device);
  if (!p.ok()) {
    kvd::Fail(p.status());
    return nullptr;
  }
  kvd::last_error.clear();
  return *p;
}

KVD_TORCH_EXPORT void kvd_torch_free(void* ptr, ssize_t, int, kvd_cuda_stream) {
  kvd::Done(kvd::Allocator::Get().Free(ptr));
}

KVD_TORCH_EXPORT int kvd_torch_adopted(const void* ptr) { return kvd::Allocator::Get().Adopted(ptr); }

KVD_TORCH_EXPORT int kvd_torch_list(kvd_torch_allocation* out, int max) {
  return kvd::Allocator::Get().List(out, out == nullptr ? 0 : max);
}

KVD_TORCH_EXPORT int kvd_torch_sleep(const void* ptr) {
  return kvd::Done(kvd::Allocator::Get().Apply(kvd::Allocator::Control::kSleep, ptr, 0));
}

KVD_TORCH_EXPORT int kvd_torch_wake(const void* ptr) {
  return kvd::Done(kvd::Allocator::Get().Apply(kvd::Allocator::Control::kWake, ptr, 0));
}

KVD_TORCH_EXPORT int kvd_torch_resize(const void* ptr, uint64_t bytes) {
  return kvd::Done(kvd::Allocator::Get().Apply(kvd::Allocator::Control::kResize, ptr, bytes));
}

KVD_TORCH_EXPORT int kvd_torch_compact(const void* ptr) {
  return kvd::Done(kvd::Allocator::Get().Apply(kvd::Allocator::Control::kCompact, ptr, 0));
}

KVD_TORCH_EXPORT const char* kvd_torch_last_error(void) { return kvd::last_error.c_str(); }
