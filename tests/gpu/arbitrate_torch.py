"""Issue 23 on the H200 (tests/gpu/run_gpu.sh, step "arbitrate"): kvd arbitrates the GPU's memory between
torch engines through the Python package.

1. Reclaim. Engine A (priority 0, a Client of its own, pausable, on_reclaim: shrink_for_reclaim with its live
   blocks) holds POOL_SIZE (or what the device can back) grown in ten steps; every fifth block is live and
   holds a pattern written with torch on the GPU. A filler pool of the highest priority takes what else the
   device can back. Engine B (priority 10) asks for 40% of A with grow(wait=True). Reported: B's grow and its
   phases (to_ask: B's call -> A's hook called; give_to_reply: A's compaction shrink until B's reply; A's hook
   in all), A's pool before and after, and every live byte of A compared on the GPU with what it wrote,
   wherever the shrink moved it (target: B's grow <= 1 s, 0 bytes differ).
2. Saturation. Eight engines (priorities 0..7, a Client each) grow at once with wait in steps of 1/64 of what
   the device can back until each is refused: the daemon's DeviceInfo.driver_out_of_memory must not rise (every
   refusal is kvd's RESOURCE_EXHAUSTED), and the pools together never hold more than the device could back.

    python3 arbitrate_torch.py BIN_DIR OUT_DIR POOL_SIZE [--backend=cuda|host]
--backend=host runs the same on a small host pool (numpy views, a --host-used-by-others "full" device).
Prints one line per result and "arbitrate: PASS" or "arbitrate: FAIL (...)"; exit 0 or 1.
"""
import os
import subprocess
import sys
import tempfile
import threading
import time

here = os.path.dirname(os.path.abspath(__file__))
for d in (here, os.path.join(here, "..", "testing")):  # the bundle holds both; a checkout has them apart
    if d not in sys.path:
        sys.path.insert(0, d)

from reshape_torch import BLOCK_BYTES, DIMS, parse_size  # noqa: E402

HOST_DIMS = dict(layers=8, capacity_blocks=32768, heads=2, block_tokens=16, channels=64, element_bytes=2)
HOST_BLOCK_BYTES = 8 * 2 * 16 * 64 * 2


def start_kvd(bin_dir, out_dir, backend):
    directory = tempfile.mkdtemp(prefix="kvd-arbitrate-")
    sock = os.path.join(directory, "gpu0.sock")
    args = [os.path.join(bin_dir, "kvd"), f"--backend={backend}", "--socket=" + sock, "--state-dir=none",
            "--pause-timeout=30s"]
    if backend == "host":
        args += ["--host-capacity=2GiB", "--host-used-by-others=1GiB", "--budget=100%", "--device-headroom=64MiB"]
    log = open(os.path.join(out_dir, "kvd-arbitrate.log"), "w")
    daemon = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        if os.path.exists(os.path.join(directory, "gpu0.handles")):
            return daemon, sock
        time.sleep(0.1)
    raise RuntimeError("kvd did not start: see kvd-arbitrate.log")


class EngineA:
    """The pool holding the device: a pattern in every fifth block, a block table that follows the moves."""

    def __init__(self, kvd, sock, dims, blocks, step, xp, device):
        self.c = kvd.connect(sock, client_name="engine-a")
        self.xp, self.device = xp, device
        self.c.create_pool("a", **dims, priority=0)
        self.lock = threading.Condition()
        self.hook = None  # (called, returned) once the reclaim hook ran
        self.m = self.c.attach("a", on_pause=self.on_pause, on_resume=lambda applied: None,
                               on_reclaim=self.on_reclaim)
        for at in range(step, blocks + 1, step):
            self.c.grow("a", at)
        self.where = {b: b for b in range(0, blocks, 5)}
        self.views = [self.view(v) for v in self.m.layers()]
        idx = self.index(sorted(self.where))
        for layer, v in enumerate(self.views):
            v[idx] = self.pattern(idx, layer, v)
        self.sync()

    def view(self, v):
        return self.xp.as_tensor(v, device=self.device) if self.device else v

    def index(self, blocks):
        return self.xp.tensor(blocks, device=self.device) if self.device else self.xp.asarray(blocks)

    def pattern(self, idx, layer, v):
        # One value per block and layer, broadcast over its elements: cheap to write and to compare.
        vals = (idx * 2654435761 + layer * 40503 + 17) % 2039
        shape = (len(idx),) + (1,) * (v.dim() - 1 if self.device else v.ndim - 1)
        return vals.reshape(shape).to(v.dtype) if self.device else vals.reshape(shape).astype(v.dtype)

    def sync(self):
        if self.device:
            self.xp.cuda.synchronize()

    def on_pause(self, ranges):
        self.sync()  # nothing runs on the pool between the checks; a real engine also stops its scheduler

    def on_reclaim(self, request):
        called = time.monotonic()
        with self.lock:
            live = sorted(self.where.values())
        update = self.c.shrink_for_reclaim(request, live)
        moved = {m.src: m.dst for m in update.reshape.moved_blocks}
        with self.lock:
            self.where = {first: moved.get(now, now) for first, now in self.where.items()}
            self.hook = (called, time.monotonic())
            self.lock.notify_all()

    def differing(self):
        """Live bytes that do not hold what was written, wherever they live now: 0 when all do."""
        with self.lock:
            self.lock.wait_for(lambda: self.hook is not None, timeout=120)
            firsts = sorted(self.where)
            nows = [self.where[f] for f in firsts]
        self.views = [self.view(v) for v in self.m.layers()]
        first_idx, now_idx = self.index(firsts), self.index(nows)
        bad = 0
        for layer, v in enumerate(self.views):
            got = v[now_idx]
            want = self.pattern(first_idx, layer, v).expand_as(got) if self.device else \
                self.xp.broadcast_to(self.pattern(first_idx, layer, v), got.shape)
            bad += int((got != want).sum())
        return bad * (self.views[0].element_size() if self.device else self.views[0].itemsize)


def reclaim(kvd, sock, dims, block_bytes, size, xp, device):
    c = kvd.connect(sock, client_name="driver")
    info = c.device_info()
    a_bytes = min(size, info.available_bytes)
    step = max(a_bytes // block_bytes // 10, 1)
    blocks = 10 * step
    t0 = time.monotonic()
    a = EngineA(kvd, sock, dims, blocks, step, xp, device)
    print(f"A: {blocks} blocks ({blocks * block_bytes / 2**30:.1f} GiB) in {len(c.pool('a').chunks)} chunks, "
          f"{len(a.where)} live with a pattern, in {time.monotonic() - t0:.1f} s", flush=True)
    c.create_pool("filler", **dict(dims, capacity_blocks=max(info.available_bytes // block_bytes, 1)), priority=1000)
    # What is available, less what each segment's rounding up to the granularity adds (at most a granule).
    fill = c.device_info().available_bytes // block_bytes
    while fill > 0:
        try:
            c.grow("filler", fill)
            break
        except kvd.KvdError as e:
            if e.code != "RESOURCE_EXHAUSTED":
                raise
            fill -= max((2 << 20) * dims["layers"] // block_bytes, 1)
    b = kvd.connect(sock, client_name="engine-b")
    b.create_pool("b", **dims, priority=10)
    want = 4 * step
    print(f"filler: {fill * block_bytes / 2**30:.1f} GiB; B asks {want * block_bytes / 2**30:.1f} GiB with wait; "
          f"the device can back {c.device_info().available_bytes / 2**30:.2f} GiB more", flush=True)
    t = time.monotonic()
    u = b.grow("b", want, wait=True, wait_for=60)
    done = time.monotonic()
    bad = a.differing()
    called, returned = a.hook
    pa = c.pool("a")
    grow_ms = (done - t) * 1e3
    print(f"B's grow: {grow_ms:.1f} ms (to_ask {(called - t) * 1e3:.1f} ms, give_to_reply {(done - called) * 1e3:.1f} "
          f"ms; A's hook {(returned - called) * 1e3:.1f} ms), B at {u.pool.committed_blocks} blocks; A now "
          f"{pa.committed_blocks} blocks in {len(pa.chunks)} chunks; {pa.reclaim.last_outcome}", flush=True)
    print(f"A's live bytes: {bad} differ", flush=True)
    a.m.close()
    for p in ("b", "filler", "a"):
        c.delete(p, force=True)
    fails = []
    if bad:
        fails.append(f"{bad} live bytes of A differ")
    if device and grow_ms > 1000:
        fails.append(f"B's grow took {grow_ms:.0f} ms (target 1000)")
    return fails


def saturate(kvd, sock, dims, block_bytes):
    c = kvd.connect(sock, client_name="driver")
    start = c.device_info()
    step = max(start.available_bytes // 64 // block_bytes, 1)
    engines = []
    for i in range(8):
        e = kvd.connect(sock, client_name=f"engine-{i}")
        e.create_pool(f"sat-{i}", **dict(dims, capacity_blocks=128 * step), priority=i)
        engines.append(e)
    ends = [None] * 8

    def grow(i):
        for target in range(step, 128 * step + 1, step):
            try:
                engines[i].grow(f"sat-{i}", target, wait=True, wait_for=2)
            except kvd.KvdError as e:
                ends[i] = e
                return

    t0 = time.monotonic()
    threads = [threading.Thread(target=grow, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    end = c.device_info()
    held = sum(c.pool(f"sat-{i}").committed_bytes for i in range(8))
    oom = end.driver_out_of_memory - start.driver_out_of_memory
    other = [str(e) for e in ends if e is not None and e.code != "RESOURCE_EXHAUSTED"]
    print(f"8 engines to saturation in {time.monotonic() - t0:.1f} s: {held / 2**30:.2f} GiB held of "
          f"{start.available_bytes / 2**30:.2f} GiB the device could back; {oom} driver out-of-memory errors; "
          f"{len(other)} refused with another code", flush=True)
    for i in range(8):
        c.delete(f"sat-{i}", force=True)
    fails = []
    if oom:
        fails.append(f"{oom} driver out-of-memory errors")
    if other:
        fails.append(f"refusals other than RESOURCE_EXHAUSTED: {other[0]}")
    if held > start.available_bytes:
        fails.append("the pools hold more than the device could back")
    return fails


def main():
    import kvd

    bin_dir, out_dir, pool_size = sys.argv[1], sys.argv[2], sys.argv[3]
    backend = "host" if "--backend=host" in sys.argv[4:] else "cuda"
    if backend == "cuda":
        import torch
        xp, device, dims, block_bytes, size = torch, "cuda", DIMS, BLOCK_BYTES, parse_size(pool_size)
    else:
        import numpy
        xp, device, dims, block_bytes, size = numpy, None, HOST_DIMS, HOST_BLOCK_BYTES, 384 << 20
    daemon, sock = start_kvd(bin_dir, out_dir, backend)
    fails = []
    try:
        fails += reclaim(kvd, sock, dims, block_bytes, size, xp, device)
        fails += saturate(kvd, sock, dims, block_bytes)
    except Exception as e:  # noqa: BLE001 -- the verdict line says what failed
        fails.append(f"{type(e).__name__}: {e}")
    finally:
        daemon.terminate()
        daemon.wait(30)
    print("arbitrate: PASS" if not fails else f"arbitrate: FAIL ({'; '.join(fails)})", flush=True)
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
