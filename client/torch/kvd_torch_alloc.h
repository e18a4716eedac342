/* kvd_torch_alloc: a torch pluggable allocator whose allocations are kvd pools (docs/engines.md, "A bare torch
 * engine"). torch.cuda.memory.CUDAPluggableAllocator loads this library and calls kvd_torch_malloc and kvd_torch_free;
 * a torch.cuda.MemPool over it gives every tensor allocated under torch.cuda.use_mem_pool(pool) kvd memory:
 * shareable with other processes, kept across restarts of kvd and of the engine, and resizable (sleep, wake, shrink,
 * compact) through the calls below. The Python module kvd.torch drives it; C and C++ engines may call it directly.
 *
 * Each kvd_torch_malloc of `size` bytes is one pool named "<prefix>-<n>", n counting this process's allocations from 0,
 * with the flat geometry of Note [A flat allocation's geometry] (docs/engines.md): one segment of `size` bytes rounded
 * up to the daemon's granularity, block i its i-th granule. The pointer returned is the pool's base in this process.
 * A pool of that name that already exists with the same size is adopted (Note [Re-attaching an allocation]): the
 * pointer maps the same memory with the bytes its previous owner left, and kvd_torch_adopted says so.
 *
 * Threads: every function may be called from any thread. The pause hooks run on a Mapping's follower thread.
 * Errors: a function that fails returns NULL or -1 and leaves a message in kvd_torch_last_error() (this thread's).
 * Nothing here needs torch or the CUDA headers: cudaStream_t is only passed through.
 */
#ifndef KVD_TORCH_ALLOC_H_
#define KVD_TORCH_ALLOC_H_

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* kvd_cuda_stream;

/* kvd_torch_configure flags. */
enum {
  /* kvd_torch_free detaches but keeps the pool, for the next process to adopt; without it, free deletes the pool. */
  KVD_TORCH_KEEP_ON_FREE = 1,
};

/* Where allocations go: `socket` is the kvd's gRPC socket (NULL or "": $KVD_SOCKET, else /run/kvd/gpu<device>.sock
 * with the device of the first allocation), `prefix` names the pools ([A-Za-z0-9._-], at most 48 characters).
 * Call it before the first allocation; again only while nothing is allocated. Returns 0 or -1. */
int kvd_torch_configure(const char* socket, const char* prefix, int flags);

/* Pause hooks (docs/integrating.md, "What the pause hook must do"): with them, every allocation's Mapping is pausable,
 * so kvd pauses the engine before another session's sleep, shrink, compaction or forced delete of it; on_pause must
 * stop every access to the memory (synchronise the streams that use it) before it returns. Without them the Mappings
 * are not pausable and such releases from other sessions are refused. `pool` is the pool's name. Set them before the
 * first allocation. */
typedef void (*kvd_torch_pause_hook)(void* context, const char* pool);
typedef void (*kvd_torch_resume_hook)(void* context, const char* pool, int applied);
int kvd_torch_set_pause_hooks(kvd_torch_pause_hook on_pause, kvd_torch_resume_hook on_resume, void* context);

/* The CUDAPluggableAllocator entry points. kvd_torch_malloc returns NULL when the pool cannot be made (torch raises
 * its out-of-memory error; kvd_torch_last_error says why). `device` is checked against the daemon's device. */
void* kvd_torch_malloc(ssize_t size, int device, kvd_cuda_stream stream);
void kvd_torch_free(void* ptr, ssize_t size, int device, kvd_cuda_stream stream);

/* 1: the allocation holding `ptr` was adopted with the bytes its previous owner left; 0: it is fresh memory; -1: no
 * allocation of this library holds `ptr`. */
int kvd_torch_adopted(const void* ptr);

/* One allocation, as kvd_torch_list reports it. */
typedef struct {
  char pool[64];
  uint64_t base;
  uint64_t size;            /* what torch asked for */
  uint64_t capacity_bytes;  /* the pool's blocks times the block size: size rounded up to the granularity */
  uint64_t committed_bytes; /* backed now: less after a shrink, 0 while asleep */
  int adopted;
  int state; /* 0 awake, 1 sleeping, 2 lost (the pool was deleted or the daemon did not take it back) */
} kvd_torch_allocation;

/* Fills up to `max` entries (in allocation order) and returns how many allocations there are. */
int kvd_torch_list(kvd_torch_allocation* out, int max);

/* Through this library's own session, so its own Mappings follow at once and nobody is paused but other sessions'
 * pausable clients of the same pools. `ptr` is any address inside an allocation, NULL for every allocation. Sleep
 * returns once the memory is released; wake once it is mapped again (fresh, zeroed). Resize commits exactly the
 * first `bytes` (rounded up to the granularity) of an allocation: less releases its tail, more grows it back up to
 * its capacity. Compact rewrites an allocation grown in steps as few chunks. Each returns 0 or -1. */
int kvd_torch_sleep(const void* ptr);
int kvd_torch_wake(const void* ptr);
int kvd_torch_resize(const void* ptr, uint64_t bytes);
int kvd_torch_compact(const void* ptr);

/* This thread's last error message ("" when none). Valid until this thread's next call. */
const char* kvd_torch_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KVD_TORCH_ALLOC_H_ */
