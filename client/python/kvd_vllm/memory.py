"""The KV cache's memory in a vLLM worker: one kvd.torch allocator per worker process and the KV allocation context.

Pools are named "<prefix>-<n>": the prefix is $KVD_VLLM_PREFIX (default "vllm") plus "-r<rank>" (torch.distributed's
rank, 0 without it), n counting the worker's KV cache tensors in vLLM's allocation order (kv_cache_config's
kv_cache_tensors). A worker started again with the same configuration allocates the same sizes in the same order and
so adopts the same memory (Note [Re-attaching an allocation], docs/engines.md); the allocation context's torch.zeros
keeps it as it is (kvd.torch.KvdAllocator.keep_adopted). vLLM's scheduler starts with every block free either way.

The allocations are not pausable: vLLM cannot be stopped from another thread, so a sleep, shrink or compaction of
these pools by another session (kvctl) is refused, naming the worker; vLLM's own /sleep, /wake_up and
/release_kv_cache_memory go through the sleep-mode backend, after vLLM has paused itself.
"""

import os
import threading

PREFIX_ENV = "KVD_VLLM_PREFIX"
_lock = threading.Lock()
_allocator = None


def prefix():
    rank = 0
    try:
        import torch.distributed as dist  # noqa: PLC0415
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
    except ImportError:
        pass
    return f"{os.environ.get(PREFIX_ENV) or 'vllm'}-r{rank}"


def allocator():
    """This worker's kvd.torch.KvdAllocator, made on first use (the kvd of the worker's CUDA device, by its UUID;
    $KVD_SOCKET when set)."""
    global _allocator
    with _lock:
        if _allocator is None:
            import kvd.torch  # noqa: PLC0415
            _allocator = kvd.torch.KvdAllocator(prefix(), socket=os.environ.get("KVD_SOCKET") or None)
        return _allocator


class KvAllocationContext:
    """What vLLM enters around its raw KV allocation: torch.cuda.use_mem_pool over the kvd MemPool, with torch.zeros
    keeping adopted memory. `allocator` is the worker's KvdAllocator."""

    def __init__(self):
        self.allocator = allocator()
        self._inner = None

    def __enter__(self):
        self._inner = self.allocator.allocating(keep_adopted=True)
        return self._inner.__enter__()

    def __exit__(self, *exc):
        inner, self._inner = self._inner, None
        return inner.__exit__(*exc)


def kv_cache_allocation_context():
    return KvAllocationContext()
