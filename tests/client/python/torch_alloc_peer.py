"""An engine process on kvd.torch's allocator without torch (the host backend's memory is plain host memory), driven
by kvd_torch_test.py over tests/testing/line_peer.py's protocol. Each op answers {"value": ...} or, when the allocator
raised, {"code": ..., "message": ...}: the test checks both."""
import ctypes
import json
import sys

import kvd
import kvd.torch

alloc = None
paused = []


def on_pause(pool):
    paused.append(("pause", pool))


def on_resume(pool, applied):
    paused.append(("resume", pool, applied))


def run(op, a):
    global alloc
    if op == "configure":
        hooks = dict(on_pause=on_pause, on_resume=on_resume) if a.get("pausable") else {}
        alloc = kvd.torch.KvdAllocator(a["prefix"], socket=a["socket"], keep_on_free=a.get("keep", False), **hooks)
        return None
    if op == "malloc":
        return alloc.malloc(a["size"], a.get("device", 0))
    if op == "free":
        return alloc.free(a["ptr"])
    if op == "fill":  # every byte of [ptr, ptr + n) := value
        ctypes.memset(a["ptr"], a["value"], a["n"])
        return None
    if op == "read":  # the distinct byte values of [ptr, ptr + n)
        return sorted(set(ctypes.string_at(a["ptr"], a["n"])))
    if op == "adopted":
        return alloc.adopted(a["ptr"])
    if op == "list":
        return [x._asdict() for x in alloc.allocations()]
    if op in ("sleep", "wake", "compact"):
        return getattr(alloc, op)(a.get("ptr"))
    if op == "resize":
        return alloc.resize(a.get("ptr"), a["bytes"])
    if op == "pauses":
        return paused
    raise ValueError(f"unknown op {op}")


for line in sys.stdin:
    req = json.loads(line)
    op = req.pop("op")
    if op == "exit":
        print(json.dumps({"ok": True}), flush=True)
        break
    try:
        out = {"value": run(op, req)}
    except kvd.KvdError as e:
        out = {"code": e.code, "message": e.message}
    print(json.dumps({"ok": True, "result": out}), flush=True)
