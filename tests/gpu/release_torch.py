"""Issue 22 on the H200 (tests/gpu/run_gpu.sh, step "release"): every kind of release of a pool that two
running engines use. Each engine is a process of its own (the Python package; torch.as_tensor over the
Mapping's __cuda_array_interface__ views on CUDA, numpy views on the host backend) that loops launching a
read-modify-write kernel over every committed block of its half of the layers (+1 to every byte, one
layer at a time, synchronising after each pass), so that it can always tell what each byte must hold.

Pausable engines (attach(on_pause=...)): on_pause stops the loop, waits until it is idle and synchronises
(torch.cuda.synchronize()); on_resume rebuilds the views to the new committed size and restarts it, except
after a sleep (committed 0: it waits for on_grow); on_grow after a wake checks the fresh memory reads 0,
writes the pattern again and restarts; on_lost (after a delete) records why and leaves the loop stopped.
Against them the operator (kvctl, a process of its own) runs, each a case:
  shrink --whole-chunks --wait, exact shrink --wait (inside a chunk), compact, sleep --wait, wake,
  delete --force
and checks: kvctl's exit code; the pool's committed blocks, state and pending_release_bytes; every engine
alive with no CUDA (or any) error, paused where a release took memory, and every byte of its blocks below
the new size as it wrote them (verified on the GPU).

Engines that are not pausable: the unforced sleep, shrink (exact and --whole-chunks), compact and delete
must be refused (kvctl exits non-zero; sleep and shrink with FAILED_PRECONDITION naming the engine's
client) with the engines running on and their bytes intact; sleep --force, shrink --force and delete
--force must leave each engine alive: its library keeps the memory mapped (reads stay valid) and calls
on_lost; the memory stays pending release until the engine closes its Mapping, then it is free. After a
forced sleep or shrink the engines attach again and go on.

Sizes: the pool is POOL_SIZE of Llama-70B-like blocks (reshape_torch.DIMS), grown in 1 GiB steps (one chunk
per segment per grow, so that an exact shrink replaces only the small chunks straddling its target), and
on CUDA the engines allocate memory of their own until the GPU is reshape_torch.FILL (97.5%) used. The
shrinks come first: they free the room that the compaction copies into. On the host backend (--backend=host:
a kvd --backend=host of its own, numpy instead of torch) the same cases run on a small pool.

    python3 release_torch.py BIN_DIR OUT_DIR POOL_SIZE [--backend=cuda|host] [--only=pausable|fixed]
    python3 release_torch.py --engine SOCKET POOL NAME PARITY BACKEND ERR_FILE   (one engine, over stdin/stdout)
Prints one line per case (PASS/FAIL and why) and "release: PASS" or "release: FAIL (...)"; exit 0 or 1.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

here = os.path.dirname(os.path.abspath(__file__))
for d in (here, os.path.join(here, "..", "testing")):  # the bundle holds both; a checkout has them apart
    if d not in sys.path:
        sys.path.insert(0, d)

from line_peer import LinePeer  # noqa: E402
from reshape_torch import (BLOCK_BYTES, DIMS, ballast_each, chunks_per_pause, expected, gpu_mib,  # noqa: E402
                           grow_in_steps, parse_size, slices)

# The host backend's pool: 8 layers of 2 heads x 16 tokens x 64 channels x 2 bytes (4 KiB a layer and block),
# grown in steps of 64 MiB (8 MiB, four 2 MiB granules, a segment: an exact shrink has a chunk to cut).
HOST_DIMS = dict(layers=8, capacity_blocks=32768, heads=2, block_tokens=16, channels=64, element_bytes=2)
HOST_BLOCK_BYTES = 8 * 2 * 16 * 64 * 2
CALL_S = 120  # the longest an engine command or a kvctl call may take


# -- an engine -----------------------------------------------------------------------------------------
class Arrays:
    """What an engine does to its views, with torch on CUDA or numpy on the host backend."""

    def __init__(self, backend):
        self.cuda = backend == "cuda"
        if self.cuda:
            import torch
            self.xp, self.kw = torch, {"device": "cuda"}
        else:
            import numpy
            self.xp, self.kw = numpy, {}

    def views(self, m, layers, blocks):
        if self.cuda:
            t = self.xp
            return {l: t.as_tensor(m.layer(l), device=f"cuda:{m.cuda_device}")[:blocks].view(t.uint8) for l in layers}
        return {l: m.layer(l)[:blocks].view(self.xp.uint8) for l in layers}

    def pattern(self, l, b, n, shape, plus):
        x = (expected(self.xp, l, b, n, shape, **self.kw) + plus) % 256
        return x.to(self.xp.uint8) if self.cuda else x.astype(self.xp.uint8)

    def count(self, x):
        return int(self.xp.count_nonzero(x))

    def bump(self, v):  # the read-modify-write kernel: +1 to every byte (uint8 wraps)
        if self.cuda:
            v.add_(1)
        else:
            v += 1

    def sync(self):
        if self.cuda:
            self.xp.cuda.synchronize()


class Engine:
    """One engine process: a Mapping of POOL, its views of the layers l % 2 == parity, and the loop."""

    def __init__(self, sock, pool, name, parity, backend):
        import kvd
        self.kvd, self.pool, self.name, self.parity = kvd, pool, name, parity
        self.a = Arrays(backend)
        self.client = kvd.connect(sock, client_name=name, timeout=30.0)
        self.layers = [l for l in range(self.client.pool(pool).geometry.dims.layers) if l % 2 == parity]
        self.m = None
        self.views, self.blocks = {}, 0   # the blocks the pattern covers
        self.count = {}                   # layer -> passes of the kernel over it since it was written
        self.active = threading.Event()   # the loop may launch
        self.idle = threading.Event()     # the loop launches nothing now
        self.idle.set()
        self.lock = threading.Lock()      # one change of views/blocks at a time (hooks, commands)
        self.errors, self.events = [], []
        self.lost = None
        self.passes = self.pauses = self.resumes = self.grows = 0
        self.hook_ms = []
        self.fresh_nonzero = None  # bytes of the memory a wake gave back that were not 0
        self.ballast = []
        self.stop = False
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    # the loop: what an engine's forward passes do to its cache
    def loop(self):
        while not self.stop:
            if not self.active.wait(0.05):
                continue
            self.idle.clear()
            try:
                for l in self.layers:
                    if not self.active.is_set():
                        break
                    v = self.views.get(l)
                    if v is not None:
                        self.a.bump(v)
                        self.count[l] += 1
                else:
                    self.passes += 1
                self.a.sync()
            except Exception as e:  # a CUDA error (illegal address: memory unmapped under the kernel) lands here
                self.errors.append(f"loop: {type(e).__name__}: {e}")
                self.active.clear()
            finally:
                self.idle.set()

    def quiesce(self, why):
        """Stops the loop and waits until it is idle and the device has finished (bounded: 20 s)."""
        t0 = time.monotonic()
        self.active.clear()
        if not self.idle.wait(20):
            self.errors.append(f"{why}: the loop did not stop within 20 s")
        self.a.sync()
        return (time.monotonic() - t0) * 1000

    def write(self, first, end):
        """Writes the pattern into blocks [first, end) of every layer (its count stays)."""
        for l, v in self.views.items():
            for b, n in slices(first, end):
                v[b:b + n] = self.a.pattern(l, b, n, v.shape, self.count[l])
        self.a.sync()

    def differ(self, end=None):
        """Bytes of blocks [0, end) (default: all the pattern covers) that are not what the engine wrote."""
        end = self.blocks if end is None else min(end, self.blocks)
        bad = 0
        for l, v in self.views.items():
            for b, n in slices(0, end):
                bad += self.a.count(v[b:b + n] != self.a.pattern(l, b, n, v.shape, self.count[l]))
        return bad

    def rebuild(self, blocks):
        self.views = self.a.views(self.m, self.layers, blocks) if blocks else {}
        self.blocks = blocks

    # the hooks, on the Mapping's follower thread
    def on_pause(self, ranges):
        self.events.append("pause")
        self.pauses += 1
        self.hook_ms.append(self.quiesce("on_pause"))

    def on_resume(self, applied):
        self.events.append(f"resume {applied}")
        self.resumes += 1
        with self.lock:
            blocks = self.m.committed_blocks
            if blocks == 0:  # slept: nothing to touch until a wake's on_grow
                self.rebuild(0)
                return
            if applied:
                self.rebuild(min(blocks, self.blocks))  # the bytes below the new size are the engine's
            self.active.set()

    def on_grow(self, blocks):
        self.events.append(f"grow {blocks}")
        self.grows += 1
        with self.lock:
            was_running = self.active.is_set()
            self.quiesce("on_grow")
            first = self.blocks
            self.views = self.a.views(self.m, self.layers, blocks)
            if first == 0:  # a wake: fresh memory, which reads 0
                self.fresh_nonzero = sum(self.a.count(v) for v in self.views.values())
                self.count = {l: 0 for l in self.layers}
            self.blocks = blocks
            self.write(first, blocks)
            if was_running or first == 0:
                self.active.set()

    def on_lost(self, why):
        self.events.append(f"lost {why.code}")
        self.lost = f"{why.code}: {why.message}"
        self.quiesce("on_lost")  # a real engine stops using the cache; the Mapping is closed on "close"

    # commands
    def attach(self, pausable):
        hooks = dict(on_pause=self.on_pause, on_resume=self.on_resume) if pausable else {}
        self.lost = None
        self.m = self.client.attach(self.pool, on_grow=self.on_grow, on_lost=self.on_lost, client_name=self.name,
                                    **hooks)
        with self.lock:
            self.count = {l: 0 for l in self.layers}
            self.rebuild(self.m.committed_blocks)
            self.write(0, self.blocks)
            if self.blocks:
                self.active.set()
        return self.status()

    def status(self):
        m = self.m
        return dict(name=self.name, blocks=self.blocks, passes=self.passes, active=self.active.is_set(),
                    pauses=self.pauses, resumes=self.resumes, grows=self.grows, lost=self.lost,
                    errors=self.errors[-5:], events=self.events[-12:], fresh_nonzero=self.fresh_nonzero,
                    mapping=None if m is None else dict(committed_blocks=m.committed_blocks, chunks=len(m.mapped_chunks),
                                                        state=self.kvd.v1_pb2.PoolState.Name(m.state), closed=m.closed),
                    hook_ms_max=round(max(self.hook_ms), 1) if self.hook_ms else 0.0)

    def check(self, below=None, stale_ok=False):
        """Every byte of blocks [0, below) as written (paused meanwhile). stale_ok: a Mapping that a forced
        release left mapped: the read must work, its bytes need not be right."""
        with self.lock:
            running = self.active.is_set()
            self.quiesce("check")
            try:
                bad = self.differ(below)
            except Exception as e:
                self.errors.append(f"check: {type(e).__name__}: {e}")
                raise
            finally:
                if running:
                    self.active.set()
        return dict(differ=bad, stale_ok=stale_ok, blocks=self.blocks,
                    bytes=sum(v[:below].numel() if self.a.cuda else v[:below].size for v in self.views.values()))

    def close(self):
        with self.lock:
            self.quiesce("close")
            self.views, self.blocks = {}, 0
            if self.m is not None:
                self.m.close()
        return self.status()

    def ballast_alloc(self, n):  # the engine's own memory (weights, activations), kept to the end
        if n and self.a.cuda:
            self.ballast.append(self.a.xp.empty(n, dtype=self.a.xp.uint8, device="cuda"))
            self.a.sync()
        return dict(allocated=n, reserved=self.a.xp.cuda.memory_reserved() if self.a.cuda else 0)

    def exit(self):
        self.stop = True
        self.active.clear()
        self.thread.join(20)
        if self.m is not None and not self.m.closed:
            self.close()
        self.client.close()


def engine_main(sock, pool, name, parity, backend, err_path):
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)  # the engine's stderr (tracebacks, CUDA errors, the package's log) to its own file
    sys.stderr = os.fdopen(2, "w", buffering=1)
    import faulthandler
    faulthandler.enable()  # a SIGSEGV (memory unmapped under a host view) says where
    e = Engine(sock, pool, name, int(parity), backend)
    ops = {"attach": lambda r: e.attach(r["pausable"]), "status": lambda r: e.status(),
           "check": lambda r: e.check(r.get("below"), r.get("stale_ok", False)), "close": lambda r: e.close(),
           "ballast": lambda r: e.ballast_alloc(r["bytes"])}
    for line in sys.stdin:
        r = json.loads(line)
        if r["op"] == "exit":
            e.exit()
            print(json.dumps({"ok": True}), flush=True)
            return
        try:
            out = {"ok": True, "result": ops[r["op"]](r)}
        except Exception as ex:
            traceback.print_exc()
            out = {"ok": False, "error": f"{type(ex).__name__}: {ex}"}
        print(json.dumps(out), flush=True)
    e.exit()


# -- the driver ----------------------------------------------------------------------------------------
class Run:
    def __init__(self, bin_dir, out_dir, pool_size, backend):
        import kvd
        self.kvd, self.bin_dir, self.out_dir, self.backend = kvd, bin_dir, out_dir, backend
        self.cuda = backend == "cuda"
        self.dims = DIMS if self.cuda else HOST_DIMS
        self.block_bytes = BLOCK_BYTES if self.cuda else HOST_BLOCK_BYTES
        self.size = parse_size(pool_size)
        self.step_bytes = (1 << 30) if self.cuda else (64 << 20)
        self.dir = tempfile.mkdtemp(prefix="kvd-release-")
        os.chmod(self.dir, 0o750)
        self.sock = os.path.join(self.dir, "gpu0.sock")
        self.results, self.engines, self.daemon = [], [], None

    def start_daemon(self):
        flags = ["--backend=cuda"] if self.cuda else \
            ["--backend=host", "--host-capacity=4GiB", "--budget=3GiB", "--host-granularity=2MiB"]
        log = open(os.path.join(self.out_dir, f"kvd-release-{self.backend}.log"), "w")
        self.daemon = subprocess.Popen([os.path.join(self.bin_dir, "kvd"), *flags, "--socket=" + self.sock,
                                        "--state-dir=none", "--pause-timeout=30s"], stdout=log, stderr=subprocess.STDOUT)
        for _ in range(300):
            if os.path.exists(os.path.join(self.dir, "gpu0.handles")) or self.daemon.poll() is not None:
                break
            time.sleep(0.1)
        self.c = self.kvd.connect(self.sock, client_name="release-driver")

    def stop(self):
        for e in self.engines:
            self.end_engine(e)
        self.engines = []
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()

    # engines
    def spawn(self, pool, tag):
        out = []
        for p in (0, 1):
            name = f"release-{tag}-{p}"
            err = os.path.join(self.out_dir, f"{name}.err")
            e = LinePeer([sys.executable, os.path.abspath(__file__), "--engine", self.sock, pool, name, str(p),
                          self.backend, err], name)
            e.err, e.tag = err, name
            out.append(e)
        self.engines += out
        return out

    @staticmethod
    def ask(e, op, **kw):
        """e(op, **kw) bounded by CALL_S: -> (result, None) or (None, why); a hung engine is killed."""
        box = {}

        def call():
            try:
                box["r"] = e(op, **kw)
            except Exception as ex:  # AssertionError: the engine died or answered an error
                box["why"] = str(ex)

        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(CALL_S)
        if t.is_alive():
            e.p.kill()
            t.join(10)
            return None, f"{e.tag}: no answer to {op} within {CALL_S} s (killed)"
        return box.get("r"), box.get("why")

    def end_engine(self, e):
        if e.p.poll() is None:
            self.ask(e, "exit")
        try:
            e.p.wait(20)
        except subprocess.TimeoutExpired:
            e.p.kill()
            e.p.wait()
        e.close()

    def engine_trouble(self, e):
        """Why an engine is not well: dead (exit code), or errors it recorded, or its stderr's errors."""
        if e.p.poll() is not None:
            return f"{e.tag} died (exit {e.p.returncode}{', SIGSEGV' if e.p.returncode == -11 else ''})" + \
                self.err_tail(e)
        st, why = self.ask(e, "status")
        if why:
            return why + self.err_tail(e)
        if st["errors"]:
            return f"{e.tag}: {st['errors']}"
        return None

    @staticmethod
    def err_tail(e):
        try:
            lines = [l.strip() for l in open(e.err) if l.strip()]
        except OSError:
            return ""
        return f"; its stderr ends: {' | '.join(lines[-3:])}" if lines else ""

    # the operator
    def kvctl(self, *args):
        argv = [os.path.join(self.bin_dir, "kvctl"), "--socket=" + self.sock, *args]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=CALL_S)
            return p.returncode, (p.stdout + p.stderr).strip()
        except subprocess.TimeoutExpired:
            return 124, f"kvctl {' '.join(args)}: no answer within {CALL_S} s"

    def pool(self, name):
        try:
            return self.c.pool(name)
        except self.kvd.KvdError as e:
            return e

    def poll_pool(self, name, ok, timeout=15.0):
        deadline = time.monotonic() + timeout
        while True:
            p = self.pool(name)
            if ok(p) or time.monotonic() > deadline:
                return p
            time.sleep(0.05)

    def case(self, label, problems, detail=""):
        verdict = "PASS" if not problems else "FAIL"
        line = f"case {label}: {verdict}" + (f": {'; '.join(problems)}" if problems else "") + \
            (f" ({detail})" if detail else "")
        print(line, flush=True)
        self.results.append((label, not problems))

    # the parts
    def make_pool(self, name):
        self.c.create_pool(name, initial_blocks=0, **self.dims)
        t0 = time.monotonic()
        _, _, grows = grow_in_steps(self.c, name, self.size, self.step_bytes, self.block_bytes)
        p = self.c.pool(name)
        print(f"pool {name}: grown in {grows} steps in {time.monotonic() - t0:.1f} s to {p.committed_blocks} blocks, "
              f"{p.committed_bytes / (1 << 30):.2f} GiB in {len(p.chunks)} chunks", flush=True)

    def boundaries(self, pool):
        """The block at which each chunk of segment 0 ends (the pool's chunk table), ascending."""
        p = self.c.pool(pool)
        seg = sorted((c for c in p.chunks if c.segment == 0), key=lambda c: c.offset)
        start, stride = seg[0].offset, p.geometry.stride_b
        return [(c.offset + c.bytes - start) // stride for c in seg]

    def targets(self, pool):
        """(a chunk boundary at about 3/4 of the pool, a block inside a chunk at about half)."""
        ends = self.boundaries(pool)
        whole = ends[max(0, (3 * len(ends)) // 4 - 1)]
        i = max(1, len(ends) // 2)
        inside = (ends[i - 1] + ends[i]) // 2 if len(ends) > 1 else ends[0] // 2
        return whole, inside

    def setup(self, pool, tag, pausable):
        """A fresh pool and two fresh engines (on CUDA filling the GPU) -> problems."""
        for e in list(self.engines):
            self.end_engine(e)
        self.engines = []
        try:
            self.c.delete(pool, force=True)
        except self.kvd.KvdError:
            pass
        self.make_pool(pool)
        engines, problems = self.start_engines(pool, tag, pausable)
        self.cur = dict(pool=pool, tag=tag, pausable=pausable, engines=engines)
        return engines, problems + self.fill(engines)

    def ensure(self, want_state="POOL_STATE_AWAKE"):
        """Before a case: the engines alive and well and the pool there and in `want_state`; else (a case before
        broke them) a fresh pool and engines, so that no failure cascades -> the engines, or None."""
        cur = self.cur
        p = self.pool(cur["pool"])
        why = [t for t in (self.engine_trouble(e) for e in cur["engines"]) if t]
        if isinstance(p, Exception):
            why.append(str(p))
        elif self.kvd.v1_pb2.PoolState.Name(p.state) != want_state:
            why.append(f"the pool is {self.kvd.v1_pb2.PoolState.Name(p.state)}")
        if not why:
            return cur["engines"]
        print(f"  a fresh pool and engines for the next case ({'; '.join(why)[:300]})", flush=True)
        engines, problems = self.setup(cur["pool"], cur["tag"], cur["pausable"])
        if problems:
            self.case("setting up again", problems)
            return None
        return engines

    def start_engines(self, pool, tag, pausable):
        engines = self.spawn(pool, tag)
        problems = []
        for e in engines:
            st, why = self.ask(e, "attach", pausable=pausable)
            if why:
                problems.append(why + self.err_tail(e))
            else:
                print(f"  {e.tag}: attached {'pausable' if pausable else 'not pausable'}, {st['blocks']} blocks, "
                      f"{st['mapping']['chunks']} chunks", flush=True)
        return engines, problems

    def fill(self, engines):
        """On CUDA: each engine allocates its share of what keeps the GPU under FILL; -> problems."""
        if not self.cuda:
            print("  host backend: the engines allocate nothing of their own", flush=True)
            return []
        for e in engines:  # every engine's scratch is in torch's cache before the GPU is measured
            self.ask(e, "check")
        share = ballast_each(len(engines))
        for e in engines:
            self.ask(e, "ballast", bytes=share)
        used, total = gpu_mib()
        print(f"  GPU {used} of {total} MiB used ({100 * used / max(total, 1):.1f}%): the pool, "
              f"{len(engines) * share / (1 << 30):.1f} GiB of the engines' own, their scratch, the CUDA contexts",
              flush=True)
        return [] if used >= 0.97 * total else [f"the GPU is {100 * used / max(total, 1):.1f}% used, not 97%"]

    def health(self, engines, below=None, intact=True, stale_ok=False, moving=True):
        """Problems of the engines: dead, errors, or (intact) bytes below `below` not as written; moving: the
        loop must still be passing."""
        problems = []
        for e in engines:
            t = self.engine_trouble(e)
            if t:
                problems.append(t)
                continue
            before, _ = self.ask(e, "status")
            r, why = self.ask(e, "check", below=below, stale_ok=stale_ok)
            if why:
                problems.append(why + self.err_tail(e))
                continue
            if intact and r["differ"]:
                problems.append(f"{e.tag}: {r['differ']} of {r['bytes']} bytes differ")
            if moving:
                time.sleep(0.3)
                after, _ = self.ask(e, "status")
                if after and before and after["passes"] <= before["passes"]:
                    problems.append(f"{e.tag}: its loop stopped ({after['passes']} passes; events {after['events']})")
        return problems

    def statuses(self, engines):
        return [self.ask(e, "status")[0] or {} for e in engines]

    def pausable_cases(self):
        pool = "rel-pausable"
        engines, problems = self.setup(pool, "p", pausable=True)
        self.case("pausable: attach and fill", problems + self.health(engines))
        if problems:
            return

        def paused_once(engines, before):
            now = self.statuses(engines)
            return [f"{s.get('name')}: not paused ({s.get('pauses')} pauses; events {s.get('events')})"
                    for s, b in zip(now, before) if s and s.get("pauses", 0) <= b.get("pauses", 0)]  # {}: dead

        def released(label, args, check):  # one release with the engines running
            engines = self.ensure()
            if engines is None:
                return False
            p0 = self.c.pool(pool)
            before = self.statuses(engines)
            rc, text = self.kvctl(*args)
            p = self.pool(pool)
            problems = [] if rc == 0 else [f"kvctl exited {rc}: {text}"]
            if rc == 0:
                problems += check(p0, p) + paused_once(engines, before)
            return problems, engines, p0, p, text

        whole, inside = self.targets(pool)

        def whole_ok(p0, p):
            return ([f"committed {p.committed_blocks}, not {whole}"] if p.committed_blocks != whole else []) + \
                ([f"pending_release_bytes {p.pending_release_bytes} after --wait"] if p.pending_release_bytes else [])

        problems, engines, p0, p, text = released(
            "shrink --whole-chunks", ["shrink", pool, f"--blocks={whole}", "--whole-chunks", "--wait"], whole_ok)
        self.case("pausable: shrink --whole-chunks --wait", problems + self.health(engines, below=whole),
                  f"{p0.committed_blocks} -> {whole} blocks")

        _, inside = self.targets(pool)

        def exact_ok(p0, p):
            return ([f"committed {p.committed_blocks} < {inside}"] if p.committed_blocks < inside else []) + \
                ([f"pending_release_bytes {p.pending_release_bytes} after --wait"] if p.pending_release_bytes else [])

        problems, engines, p0, p, text = released("exact shrink", ["shrink", pool, f"--blocks={inside}", "--wait"],
                                                  exact_ok)
        self.case("pausable: exact shrink --wait", problems + self.health(engines, below=inside),
                  f"{p0.committed_blocks} -> {inside} blocks: {text.splitlines()[-1] if text else ''}")

        per_pause = chunks_per_pause(self.c, pool)

        def compact_ok(p0, p):
            return [f"{len(p.chunks)} chunks after, {len(p0.chunks)} before"] if len(p.chunks) >= len(p0.chunks) else []

        problems, engines, p0, p, text = released("compact", ["compact", pool, f"--chunks-per-pause={per_pause}"],
                                                  compact_ok)
        longest = max((s.get("hook_ms_max", 0) for s in self.statuses(engines)), default=0)
        self.case("pausable: compact", problems + self.health(engines),
                  f"{len(p0.chunks)} -> {len(p.chunks) if not isinstance(p, Exception) else '?'} chunks, at most "
                  f"{per_pause} a pause; longest on_pause {longest} ms; {text.splitlines()[-1] if text else ''}")

        # sleep --wait: every engine paused, then the memory is gone and they wait for a wake
        def sleep_ok(p0, p):
            state = self.kvd.v1_pb2.PoolState.Name(p.state)
            return ([f"pool {state}, committed {p.committed_blocks}"]
                    if state != "POOL_STATE_SLEEPING" or p.committed_blocks else []) + \
                ([f"pending_release_bytes {p.pending_release_bytes} after --wait"] if p.pending_release_bytes else [])

        problems, engines, p0, p, text = released("sleep", ["sleep", pool, "--wait"], sleep_ok)
        for e in engines:
            t = self.engine_trouble(e)
            if t:
                problems.append(t)
        for s in self.statuses(engines):
            if s and (s["active"] or (s["mapping"] or {}).get("committed_blocks")):
                problems.append(f"{s['name']}: active {s['active']}, its Mapping has "
                                f"{(s['mapping'] or {}).get('committed_blocks')} blocks after the sleep")
        slept = not problems
        self.case("pausable: sleep --wait", problems, f"{p0.committed_blocks} blocks")

        # wake: on_grow, fresh memory (0), the pattern again, the loop going
        if not slept:
            self.case("pausable: wake", ["not run: the sleep before it failed"])
        else:
            committed = p0.committed_blocks
            rc, text = self.kvctl("wake", pool)
            problems = [] if rc == 0 else [f"kvctl exited {rc}: {text}"]
            if rc == 0:
                for e in engines:
                    deadline = time.monotonic() + 30
                    while True:
                        t = self.engine_trouble(e)
                        s, _ = self.ask(e, "status")
                        if t or not s or s["blocks"] == committed or time.monotonic() > deadline:
                            break
                        time.sleep(0.1)
                    if t:
                        problems.append(t)
                    elif not s or s["blocks"] != committed:
                        problems.append(f"{e.tag}: {s and s['blocks']} blocks after the wake, not {committed}")
                    elif s["fresh_nonzero"]:
                        problems.append(f"{e.tag}: {s['fresh_nonzero']} bytes of the woken memory were not 0")
            self.case("pausable: wake", problems + self.health(engines), f"{committed} blocks")

        # delete --force: paused, then on_lost; alive; closing frees everything
        def delete_ok(p0, p):
            return [] if isinstance(p, Exception) else ["the pool is still there"]

        problems, engines, p0, p, text = released("delete", ["delete", pool, "--force"], delete_ok)
        if not problems:
            problems += self.lost_and_freed(engines, pool, deleted=True, still_mapped=False)
        self.case("pausable: delete --force", problems)
        for e in engines:
            self.end_engine(e)
            if e.p.returncode:
                self.case(f"pausable: {e.tag} exits", [f"exit {e.p.returncode}{self.err_tail(e)}"])
        self.engines = [e for e in self.engines if e not in engines]

    def lost_and_freed(self, engines, pool, deleted=False, still_mapped=True):
        """After a forced release: each engine alive, on_lost called, its memory still readable when
        `still_mapped` (an engine that is not pausable keeps what it maps; a pausable one was paused and its
        library unmapped everything, so it must not touch it); the bytes stay pending release until the
        engines close their Mappings, then none are."""
        problems = []
        deadline = time.monotonic() + 15
        for e in engines:
            while True:
                t = self.engine_trouble(e)
                s, _ = self.ask(e, "status")
                if t or not s or s["lost"] or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if t:
                problems.append(t)
            elif not s or not s["lost"]:
                problems.append(f"{e.tag}: no on_lost (events {s and s['events']})")
        if problems:
            return problems
        if not deleted:
            p = self.pool(pool)
            if not isinstance(p, Exception) and not p.pending_release_bytes:
                problems.append("nothing pending release while the engines still map the memory")
        held = self.c.device_info().committed_bytes
        for e in engines:
            if still_mapped:
                r, why = self.ask(e, "check", stale_ok=True)  # reads of what the forced release left mapped
                if why:
                    problems.append(f"{e.tag}: reading its memory after on_lost: {why}{self.err_tail(e)}")
            _, why = self.ask(e, "close")
            if why:
                problems.append(f"{e.tag}: close: {why}")
        info = self.c.device_info()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            p = self.pool(pool)
            pending = 0 if isinstance(p, Exception) else p.pending_release_bytes
            info = self.c.device_info()
            if not pending and (not deleted or info.committed_bytes == 0):
                break
            time.sleep(0.1)
        else:
            problems.append(f"after the engines closed: {pending} bytes pending release, {info.committed_bytes} "
                            "committed on the device")
        print(f"  committed on the device while the engines held it: {held / (1 << 30):.2f} GiB; after they "
              f"closed: {info.committed_bytes / (1 << 30):.2f} GiB", flush=True)
        return problems

    def refused(self, label, args, names=True):
        engines = self.ensure()
        if engines is None:
            return
        pool = self.cur["pool"]
        committed = self.c.pool(pool).committed_blocks
        rc, text = self.kvctl(*args)
        problems = []
        if rc == 0:
            problems.append(f"kvctl {' '.join(args)} succeeded: {text.splitlines()[-1] if text else ''}")
        elif names:
            if "FAILED_PRECONDITION" not in text:
                problems.append(f"not FAILED_PRECONDITION: {text}")
            if not any(e.tag in text for e in engines):
                problems.append(f"names no engine's client ({', '.join(e.tag for e in engines)}): {text}")
        p = self.pool(pool)
        if isinstance(p, Exception) or p.committed_blocks != committed:
            problems.append(f"the pool changed: {p if isinstance(p, Exception) else p.committed_blocks} blocks")
        self.case(f"not pausable: {label} refused", problems + self.health(engines), f"rc {rc}: {text[:200]}")

    def fixed_cases(self):
        pool = "rel-fixed"
        engines, problems = self.setup(pool, "np", pausable=False)
        self.case("not pausable: attach and fill", problems + self.health(engines))
        if problems:
            return
        whole, inside = self.targets(pool)
        self.refused("sleep --wait", ["sleep", pool, "--wait"])
        self.refused("exact shrink --wait", ["shrink", pool, f"--blocks={inside}", "--wait"])
        self.refused("shrink --whole-chunks --wait", ["shrink", pool, f"--blocks={whole}", "--whole-chunks", "--wait"])
        self.refused("compact", ["compact", pool])
        self.refused("delete", ["delete", pool], names=False)

        def forced(label, args, after):
            engines = self.ensure()
            if engines is None:
                return
            rc, text = self.kvctl(*args)
            problems = [] if rc == 0 else [f"kvctl exited {rc}: {text}"]
            if rc == 0:
                problems += self.lost_and_freed(engines, pool, deleted=args[0] == "delete")
                if not problems and after:
                    problems += after(engines)
            self.case(f"not pausable: {label}", problems, f"rc {rc}: {text[:200]}")

        def reattach(engines, below=None):
            problems = []
            for e in engines:
                _, why = self.ask(e, "attach", pausable=False)
                if why:
                    problems.append(f"{e.tag}: attaching again: {why}{self.err_tail(e)}")
            return problems + self.health(engines, below=below)

        def woken(engines):
            rc, text = self.kvctl("wake", pool)
            return ([] if rc == 0 else [f"kvctl wake exited {rc}: {text}"]) + reattach(engines)

        # A shrink that moves bytes needs every client pausable even forced: force releases whole chunks only.
        # It runs first, while the pool still has its many chunks (a wake makes one per segment).
        forced("shrink --whole-chunks --force, then attach again",
               ["shrink", pool, f"--blocks={whole}", "--whole-chunks", "--force"],
               lambda engines: reattach(engines, whole))
        forced("sleep --force, then wake and attach again", ["sleep", pool, "--force"], woken)
        forced("delete --force", ["delete", pool, "--force"], None)
        for e in self.cur["engines"]:
            self.end_engine(e)
            if e.p.returncode:
                self.case(f"not pausable: {e.tag} exits", [f"exit {e.p.returncode}{self.err_tail(e)}"])
        self.engines = []


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    bin_dir, out_dir, pool_size = args[:3]
    backend = opts.get("backend", "cuda")
    only = opts.get("only", "")
    r = Run(bin_dir, out_dir, pool_size, backend)
    t0 = time.monotonic()
    try:
        r.start_daemon()
        info = r.c.device_info()
        print(f"kvd on {r.kvd.v1_pb2.Backend.Name(info.backend)} ({info.device_name}): budget "
              f"{info.budget_bytes / (1 << 30):.1f} GiB; pool {pool_size}", flush=True)
        for part, run in (("pausable", r.pausable_cases), ("fixed", r.fixed_cases)):
            if only and only != part:
                continue
            try:
                run()
            except Exception as e:  # a part that broke off: say where, and go on with the next
                traceback.print_exc()
                r.case(f"{part}: the part broke off", [f"{type(e).__name__}: {e}"])
            for e in list(r.engines):  # what a broken part left
                r.end_engine(e)
            r.engines = []
            try:
                for p in r.c.pools():
                    r.c.delete(p.name, force=True)
            except r.kvd.KvdError as e:
                r.case(f"{part}: clean up", [f"deleting what is left: {e}"])
    finally:
        r.stop()
    failed = [label for label, ok in r.results if not ok]
    print(f"release: {'PASS' if not failed else 'FAIL'} ({len(r.results) - len(failed)} of {len(r.results)} cases "
          f"passed in {time.monotonic() - t0:.0f} s){': ' + '; '.join(failed) if failed else ''}", flush=True)
    return 1 if failed or not r.results else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine_main(*sys.argv[2:8])
    else:
        sys.exit(main())
