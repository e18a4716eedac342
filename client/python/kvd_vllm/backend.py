"""The "kvd" sleep-mode backend (vllm-project/vllm#44074): the KV cache's sleep, wake and discard are kvd's; every
other tag (the weights, vLLM's runtime buffers) goes to vLLM's own CuMem backend, which this one wraps."""

from vllm.device_allocator.sleep_mode_backend import CuMemBackend, SleepModeBackend

from . import memory

KV_TAG = "kv_cache"


class KvdSleepModeBackend(SleepModeBackend):
    def __init__(self, **options):
        super().__init__()
        self._cumem = CuMemBackend(**options)

    def suspend(self, level=1, tags=None):
        """vLLM paused and synchronised the device before calling: the KV pools are released (their bytes go), then
        CuMem offloads (level 1) or discards (level 2) the weights."""
        memory.allocator().sleep()
        if tags is None:
            self._cumem.suspend(level)
        else:
            self._cumem.suspend(level, tags=tags)
        self._state = "SUSPENDED"

    def resume(self, tags=None):
        self._state = "RESUMING"
        if tags is None or KV_TAG in tags:
            memory.allocator().wake()  # at the same addresses, zeroed: vLLM's blocks are all free after a sleep
        rest = None if tags is None else [t for t in tags if t != KV_TAG]
        if rest is None or rest:
            self._cumem.resume(rest)
        self._state = "RUNNING"

    def discard(self, tags):
        """The KV-only release (release_kv_cache_memory: vLLM paused with no request left): the KV pools sleep."""
        tags = tuple(tags)
        if KV_TAG in tags:
            memory.allocator().sleep()
        rest = tuple(t for t in tags if t != KV_TAG)
        if rest:
            self._cumem.discard(rest)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls):
        return True  # as CuMem's: NCCL's buffers are in neither pool
