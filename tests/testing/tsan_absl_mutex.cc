// TSan builds only (-DKVD_SANITIZE=thread): makes absl::Mutex visible to ThreadSanitizer.
//
// Debian's Abseil is not built with TSan, so absl::Mutex's lock word and futex waits happen in code TSan
// does not see, and every pair of accesses guarded by one absl::Mutex would be reported as a race. This
// file interposes the Mutex and CondVar entry points of libabsl_synchronization.so (by their mangled
// names, which the program's own definitions take over from the library at dynamic link time), forwards
// each to the library (dlsym(RTLD_NEXT)) and tells TSan the happens-before edges: a release on the mutex's
// address before it is given up, an acquire after it is taken. A wait (Await, CondVar::Wait) is both.
// Abseil evaluates a Condition inside the library, holding the mutex it took there (a waiter between
// its wake-up and its return, or an unlocking thread for its waiters): Condition::Eval is interposed
// too and, while one of the calls below is in progress on this thread, brackets the evaluation with an
// acquire and a release of that mutex. That is the edge a lock gives and nothing more: TSan still reports every access
// that no lock, atomic or thread start/join orders. Lock-order (deadlock) detection is not provided; Note [Lock order]
// and the clang -Wthread-safety build cover lock discipline.
//
// Abseil's own code (its deadlock detector's graph, for one) writes memory through functions TSan
// intercepts, under locks TSan cannot see: __tsan_default_options below has TSan ignore accesses made
// from libraries that are not instrumented (ignore_noninstrumented_modules), for every program of the
// build whatever TSAN_OPTIONS adds.
//
// If the library's names are not the ones below (another Abseil), the first call aborts with the name,
// rather than leaving TSan blind.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

static_assert(ABSL_OPTION_USE_INLINE_NAMESPACE == 1, "the mangled names below assume Debian's inline namespace");

extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);

const char* __tsan_default_options() { return "ignore_noninstrumented_modules=1"; }
}

namespace {

template <typename Fn>
Fn Next(const char* name) {
  void* fn = dlsym(RTLD_NEXT, name);
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found in Abseil: update tests/testing/tsan_absl_mutex.cc\n", name);
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

using Condition = absl::Condition;
using Duration = absl::Duration;
using Time = absl::Time;

// The mutex a call of this thread into Abseil is waiting on or giving up: conditions evaluated meanwhile
// read what it guards.
thread_local void* current_mutex = nullptr;
struct InCall {
  explicit InCall(void* mu) : saved(current_mutex) { current_mutex = mu; }
  ~InCall() { current_mutex = saved; }
  void* saved;
};

}  // namespace

// Each definition: the mangled name of absl::debian3::Mutex::X / CondVar::X (its `this` first).
#define KVD_NEXT(ret, name, ...)          \
  using name##_fn = ret (*)(__VA_ARGS__); \
  static name##_fn next = Next<name##_fn>(#name)

extern "C" {

// Taking the lock: acquire after.
#define KVD_LOCK(name)           \
  void name(void* mu) {          \
    KVD_NEXT(void, name, void*); \
    next(mu);                    \
    __tsan_acquire(mu);          \
  }
KVD_LOCK(_ZN4absl7debian35Mutex4LockEv)
KVD_LOCK(_ZN4absl7debian35Mutex10ReaderLockEv)
#undef KVD_LOCK

#define KVD_TRYLOCK(name)           \
  bool name(void* mu) {             \
    KVD_NEXT(bool, name, void*);    \
    const bool locked = next(mu);   \
    if (locked) __tsan_acquire(mu); \
    return locked;                  \
  }
KVD_TRYLOCK(_ZN4absl7debian35Mutex7TryLockEv)
KVD_TRYLOCK(_ZN4absl7debian35Mutex13ReaderTryLockEv)
#undef KVD_TRYLOCK

// Giving it up: release before.
#define KVD_UNLOCK(name)         \
  void name(void* mu) {          \
    KVD_NEXT(void, name, void*); \
    InCall in_call(mu);          \
    __tsan_release(mu);          \
    next(mu);                    \
  }
KVD_UNLOCK(_ZN4absl7debian35Mutex6UnlockEv)
KVD_UNLOCK(_ZN4absl7debian35Mutex12ReaderUnlockEv)
#undef KVD_UNLOCK

// LockWhen*: returns holding the lock (whatever a timed variant returns).
void _ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(void* mu, const Condition& cond) {
  KVD_NEXT(void, _ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE, void*, const Condition&);
  InCall in_call(mu);
  next(mu, cond);
  __tsan_acquire(mu);
}
void _ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE(void* mu, const Condition& cond) {
  KVD_NEXT(void, _ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE, void*, const Condition&);
  InCall in_call(mu);
  next(mu, cond);
  __tsan_acquire(mu);
}
bool _ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(void* mu, const Condition& cond,
                                                                                 Duration timeout) {
  KVD_NEXT(bool, _ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE, void*, const Condition&,
           Duration);
  InCall in_call(mu);
  const bool met = next(mu, cond, timeout);
  __tsan_acquire(mu);
  return met;
}
bool _ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE(void* mu, const Condition& cond,
                                                                              Time deadline) {
  KVD_NEXT(bool, _ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE, void*, const Condition&,
           Time);
  InCall in_call(mu);
  const bool met = next(mu, cond, deadline);
  __tsan_acquire(mu);
  return met;
}
bool _ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(void* mu, const Condition& cond,
                                                                                       Duration timeout) {
  KVD_NEXT(bool, _ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE, void*,
           const Condition&, Duration);
  InCall in_call(mu);
  const bool met = next(mu, cond, timeout);
  __tsan_acquire(mu);
  return met;
}
bool _ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE(void* mu, const Condition& cond,
                                                                                    Time deadline) {
  KVD_NEXT(bool, _ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE, void*,
           const Condition&, Time);
  InCall in_call(mu);
  const bool met = next(mu, cond, deadline);
  __tsan_acquire(mu);
  return met;
}

// Waits give the lock up and take it back: release before, acquire after.
void _ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(void* mu, const Condition& cond) {
  KVD_NEXT(void, _ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE, void*, const Condition&);
  InCall in_call(mu);
  __tsan_release(mu);
  next(mu, cond);
  __tsan_acquire(mu);
}
bool _ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(void* mu, const Condition& cond,
                                                                              Duration timeout) {
  KVD_NEXT(bool, _ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE, void*, const Condition&,
           Duration);
  InCall in_call(mu);
  __tsan_release(mu);
  const bool met = next(mu, cond, timeout);
  __tsan_acquire(mu);
  return met;
}
bool _ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(void* mu, const Condition& cond,
                                                                           Time deadline) {
  KVD_NEXT(bool, _ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE, void*, const Condition&, Time);
  InCall in_call(mu);
  __tsan_release(mu);
  const bool met = next(mu, cond, deadline);
  __tsan_acquire(mu);
  return met;
}
void _ZN4absl7debian37CondVar4WaitEPNS0_5MutexE(void* cv, void* mu) {
  KVD_NEXT(void, _ZN4absl7debian37CondVar4WaitEPNS0_5MutexE, void*, void*);
  __tsan_release(mu);
  next(cv, mu);
  __tsan_acquire(mu);
}
bool _ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE(void* cv, void* mu, Duration timeout) {
  KVD_NEXT(bool, _ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE, void*, void*, Duration);
  __tsan_release(mu);
  const bool timed_out = next(cv, mu, timeout);
  __tsan_acquire(mu);
  return timed_out;
}
bool _ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE(void* cv, void* mu, Time deadline) {
  KVD_NEXT(bool, _ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE, void*, void*, Time);
  __tsan_release(mu);
  const bool timed_out = next(cv, mu, deadline);
  __tsan_acquire(mu);
  return timed_out;
}

// Conditions: evaluated with the mutex of the call in progress held (see the top of the file).
bool _ZNK4absl7debian39Condition4EvalEv(const void* cond) {
  KVD_NEXT(bool, _ZNK4absl7debian39Condition4EvalEv, const void*);
  void* mu = current_mutex;
  if (mu != nullptr) __tsan_acquire(mu);
  const bool met = next(cond);
  if (mu != nullptr) __tsan_release(mu);
  return met;
}

}  // extern "C"
