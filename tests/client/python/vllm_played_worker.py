"""A vLLM worker process played for kvd_vllm_test.py: it makes the calls vLLM makes into the plugin, in vLLM's order,
with the played vLLM of tests/testing/played_vllm on sys.path (vLLM cannot be installed here). One op a line
(tests/testing/line_peer.py); each answers {"value": ...} or {"code", "message"}.

What a real worker does between these calls and what is replaced here: inside the KV allocation context vLLM's model
runner allocates each KVCacheTensor with torch.zeros(size, dtype=torch.int8); torch's caching allocator turns that
into kvd_torch_malloc(size rounded up to 2 MiB) of the context's MemPool. Without torch, the played runner makes that
call itself (ctx.allocator.malloc): the MemPool's routing is checked on the GPU (tests/gpu/engines_torch.py)."""
import ctypes
import json
import os
import sys
import tomllib
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing", "played_vllm"))

import kvd  # noqa: E402

state = {}


def entry_point():
    """vllm.plugins.load_general_plugins: the plugin's vllm.general_plugins entry point, from its pyproject.toml."""
    with open(os.path.join(HERE, "..", "..", "..", "client", "python", "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]["kvd"]
    module, _, fn = target.partition(":")
    return getattr(__import__(module, fromlist=[fn]), fn)


class Tensor:
    """What register_kv_caches needs of a KV tensor: its address."""

    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


def run(op, a):
    if op == "start":  # engine start-up up to the end of Worker.initialize_from_config
        entry_point()()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        connector = KVConnectorFactory.get_connector_class("KvdConnector")(None, KVConnectorRole.WORKER)
        ctx = connector.get_mem_pool_context()  # Worker.initialize_from_config, before initialize_kv_cache
        granule = 2 << 20
        ptrs = [ctx.allocator.malloc(-(-size // granule) * granule) for size in a["sizes"]]  # the zeros, see above
        connector.register_kv_caches({f"layer{i}": Tensor(p) for i, p in enumerate(ptrs)})
        state.update(ptrs=ptrs, sizes=a["sizes"], alloc=ctx.allocator,
                     backend=SleepModeBackendFactory.create_backend(types.SimpleNamespace(sleep_mode_backend="kvd")))
        return [type(connector).__name__, type(state["backend"]).__name__, type(ctx).__name__]
    if op == "write":  # the engine's kernels
        for p, n in zip(state["ptrs"], state["sizes"]):
            ctypes.memset(p, a["value"], n)
        return None
    if op == "read":
        return [sorted(set(ctypes.string_at(p, n))) for p, n in zip(state["ptrs"], state["sizes"])]
    if op == "adopted":
        return [state["alloc"].adopted(p) for p in state["ptrs"]]
    if op == "sleep":  # /sleep?level=N: Worker.sleep -> backend.suspend(level) (level 0 only pauses the scheduler)
        if a["level"] > 0:
            state["backend"].suspend(a["level"])
        return state["backend"].state()
    if op == "release_kv_cache_memory":  # EngineCore: paused, no requests -> executor.discard(("kv_cache",))
        state["backend"].discard(("kv_cache",))
        return state["backend"].state()
    if op == "wake_up":  # /wake_up?tags=...: Worker.wake_up -> backend.resume(tags)
        state["backend"].resume(a.get("tags"))
        return state["backend"].state()
    if op == "cumem":
        from vllm.device_allocator.sleep_mode_backend import CUMEM_CALLS
        return CUMEM_CALLS
    if op == "committed":
        return [x.committed_bytes for x in state["alloc"].allocations()]
    raise ValueError(op)


for line in sys.stdin:
    req = json.loads(line)
    op = req.pop("op")
    if op == "exit":
        print(json.dumps({"ok": True}), flush=True)
        break
    try:
        out = {"value": run(op, req)}
    except (kvd.KvdError, RuntimeError) as e:
        out = {"code": getattr(e, "code", type(e).__name__), "message": getattr(e, "message", str(e))}
    print(json.dumps({"ok": True, "result": out}), flush=True)
