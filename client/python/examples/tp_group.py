#!/usr/bin/env python3
"""An engine's tensor-parallel ranks wired into kvd as one group, with real processes.

    KVD_SOCKET_DIR=/run/kvd python3 tp_group.py [--ranks 2] [--group tp-demo] [--demo-failure] ...

Each GPU of the node has its kvd (socket <socket-dir>/gpu<r>.sock). The driver (this process, as an
engine's launcher or RL trainer would be) spawns one worker process per rank (multiprocessing, spawn:
a fresh interpreter, as CUDA needs). Rank r connects to the kvd of GPU r, creates its pool
<group>-r<r> with group=kvd.GroupMembership(group, r, N) and the same dims as every other rank
(--heads is per rank: the model's KV heads / N), attaches it with on_grow/on_release callbacks
(the engine's "usable blocks"), builds per-layer views (numpy on the host backend, torch tensors on
CUDA when torch imports), writes a marker (r + 1) into its first blocks and reports ready on a pipe.

The driver then opens kvd.Group.open(group), which finds every rank's pool on the node's daemons, and
resizes all ranks as one unit: each operation is prepared on every daemon (everything that can fail:
budget, creating and mapping the memory) and only then committed on every daemon. After each step
every rank confirms what its own Mapping saw:
  - grow: the new chunks are mapped by each rank's follower (on_grow), the marker is intact and a
    block past the old size takes a write;
  - sleep(wait=True): returns once every rank has unmapped (on_release); the memory is back;
  - wake: fresh, zeroed memory at the same addresses (on_grow): the views stay valid;
  - with --demo-failure: a group grow one block bigger than what fits on the tightest rank (start one
    rank's kvd with a small --budget, e.g. kvd --device=1 --budget=128MiB). That rank's prepare fails,
    the ranks that had prepared are aborted, and the error says "no rank changed"; every rank confirms
    it still has its blocks and marker, and the pools' generations did not move. The failure is the
    expected outcome of the demo: the example still exits 0.
Last, a `kvctl group status`-like summary from group.refresh(), then shutdown: every rank detaches and
deletes its pool.

A rank must stop using blocks past the new size before a shrink or sleep (the release unmaps them in
every process); here the driver sequences that: the ranks are idle while the group changes.

Exit status 0 on success; 1 with one line on stderr (tp_group: ...) when anything failed.
"""

import argparse
import multiprocessing
import os
import signal
import sys
import threading
import time

try:
    import kvd
except ImportError:  # run from a checkout: the package is next door (then set KVD_PYTHON_GEN_DIR)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import kvd

MARKED_BLOCKS = 16  # blocks 0..15 of every layer carry the rank's marker


def ms(t0):
    return f"{(time.perf_counter() - t0) * 1e3:.1f} ms"


def us_ms(us):
    return f"{us / 1e3:.2f} ms"


def mib(n):
    return f"{n / (1 << 20):.1f} MiB"


def state_name(state):
    return kvd.v1_pb2.PoolState.Name(state)[len("POOL_STATE_"):].lower()


class Failed(Exception):
    """One line that says what went wrong; the driver prints it and exits 1."""


# -- a rank: one worker process per GPU ------------------------------------------------------------
class Rank:
    """What an engine's worker does on its GPU: the pool, the views, and the usable block count that
    the callbacks keep (an engine's scheduler would read it)."""

    def __init__(self, rank, a):
        self.rank, self.a = rank, a
        self.pool = f"{a.group}-r{rank}"
        self.marker = float(rank + 1)
        self.cond = threading.Condition()
        self.usable = 0  # blocks this engine may use: set by the callbacks
        self.grows = self.releases = 0
        self.confirmed_grows = 0  # on_grow calls as of the last confirmation to the driver
        self.client = self.m = self.kv = self.torch = None

    # Callbacks run on the Mapping's follower thread, for changes made by other sessions (the Group's).
    # Each gets the pool's committed blocks after the change (0 once it sleeps).
    def on_grow(self, committed_blocks):
        with self.cond:
            self.grows += 1
            self.usable = committed_blocks
            self.cond.notify_all()

    def on_release(self, committed_blocks):
        with self.cond:
            self.releases += 1
            self.usable = committed_blocks
            self.cond.notify_all()

    def on_pause(self, ranges):
        # The coordinator's shrinks and sleeps pause this rank before its memory goes (docs/api.md,
        # "Releases and running engines"). This rank touches the pool only inside its commands, which are
        # done by then; an engine with kernels in flight would also wait for them here.
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def wait_usable(self, blocks, what):
        with self.cond:
            if not self.cond.wait_for(lambda: self.usable == blocks, timeout=self.a.timeout):
                raise Failed(f"{what}: the engine sees {self.usable} usable blocks, not {blocks}, after "
                             f"{self.a.timeout:g} s (mapping: {self.m.committed_blocks} blocks, "
                             f"{state_name(self.m.state)}, gone: {self.m.gone})")

    def fill(self, blocks, value):
        for v in self.kv:
            v[blocks] = value
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def probe(self, block):
        """(min, max) of `block` over every layer."""
        if self.torch is not None:
            return (min(float(v[block].float().min()) for v in self.kv),
                    max(float(v[block].float().max()) for v in self.kv))
        return min(float(v[block].min()) for v in self.kv), max(float(v[block].max()) for v in self.kv)

    def check_marker(self, what):
        for b in (0, MARKED_BLOCKS - 1):
            got = self.probe(b)
            if got != (self.marker, self.marker):
                raise Failed(f"{what}: block {b} reads {got}, not the marker {self.marker}")

    def start(self):
        a = self.a
        lines = []
        socket = os.path.join(a.socket_dir, f"gpu{self.rank}.sock")
        t0 = time.perf_counter()
        self.client = kvd.connect(socket, client_name=f"{a.group}-rank{self.rank}")
        info = self.client.device_info()
        backend = kvd.v1_pb2.Backend.Name(info.backend)
        lines.append(f"connected to {socket} ({info.device_name}, {backend}, {info.device_uuid}) in {ms(t0)}")

        t0 = time.perf_counter()
        p = self.client.create_pool(self.pool, layers=a.layers, capacity_blocks=a.capacity_blocks, heads=a.heads,
                                    block_tokens=a.block_tokens, channels=a.channels, element_bytes=a.element_bytes,
                                    initial_blocks=a.initial_blocks,
                                    backend_requirements={"FLASHINFER": ["block-outermost"]},
                                    connector_preferences=[("nixl", "BLNHC")],
                                    group=kvd.GroupMembership(a.group, self.rank, a.ranks))
        lines.append(f"created {p.name} (group {p.group.name}, rank {p.group.rank} of {p.group.size}): layout "
                     f"{p.geometry.layout}, {p.committed_blocks} blocks, {mib(p.committed_bytes)}, in {ms(t0)}")

        t0 = time.perf_counter()
        self.m = self.client.attach(self.pool, on_grow=self.on_grow, on_release=self.on_release,
                                    on_pause=self.on_pause)
        with self.cond:
            self.usable = self.m.committed_blocks
        if info.backend == kvd.v1_pb2.BACKEND_CUDA:
            try:
                import torch
                self.torch = torch
            except ImportError:
                pass
        raw = self.m.layers()
        if self.torch is not None:
            self.kv = [self.torch.as_tensor(v, device=f"cuda:{self.m.cuda_device}") for v in raw]
        else:
            self.kv = raw
        if info.backend == kvd.v1_pb2.BACKEND_CUDA and self.torch is None:
            raise Failed("the pool is on CUDA but torch is not importable: this example writes through torch views")
        kind = f"{type(self.kv[0]).__module__}.{type(self.kv[0]).__name__}"
        lines.append(f"attached ({len(self.m.mapped_chunks)} chunk(s) mapped) and built {len(self.kv)} layer views "
                     f"({kind}) in {ms(t0)}")

        t0 = time.perf_counter()
        n = min(MARKED_BLOCKS, self.m.committed_blocks)
        if n < MARKED_BLOCKS:
            raise Failed(f"--initial-blocks {a.initial_blocks}: at least {MARKED_BLOCKS} are needed for the marker")
        self.fill(slice(0, n), self.marker)
        self.check_marker("warm-up")
        lines.append(f"wrote marker {self.marker} into blocks 0..{n - 1} of every layer in {ms(t0)}: ready")
        return lines

    def after_grow(self, blocks):
        t0 = time.perf_counter()
        self.wait_usable(blocks, "grow")
        self.check_marker("grow")
        self.fill(blocks - 1, 10 * self.marker)
        got = self.probe(blocks - 1)
        if got != (10 * self.marker, 10 * self.marker):
            raise Failed(f"grow: new block {blocks - 1} reads {got} after writing {10 * self.marker}")
        self.confirmed_grows = self.grows
        return [f"followed the grow (on_grow x{self.grows}): {blocks} blocks, {len(self.m.mapped_chunks)} chunk(s) "
                f"mapped, marker intact, new block {blocks - 1} reads {got[1]}; confirmed in {ms(t0)}"]

    def after_sleep(self):
        t0 = time.perf_counter()
        self.wait_usable(0, "sleep")
        if self.m.mapped_chunks:
            raise Failed(f"sleep: {len(self.m.mapped_chunks)} chunk(s) still mapped")
        return [f"unmapped everything (on_release x{self.releases}): {state_name(self.m.state)}, "
                f"0 usable blocks; confirmed in {ms(t0)}"]

    def after_wake(self, blocks):
        t0 = time.perf_counter()
        self.wait_usable(blocks, "wake")
        fresh = self.probe(0)
        if fresh != (0.0, 0.0):
            raise Failed(f"wake: block 0 reads {fresh}, not fresh (zeroed) memory")
        self.fill(slice(0, MARKED_BLOCKS), self.marker)
        self.check_marker("wake")
        self.confirmed_grows = self.grows
        return [f"woke with the same views (on_grow x{self.grows}): {blocks} blocks, block 0 read {fresh[1]} "
                f"(fresh memory), marker rewritten; confirmed in {ms(t0)}"]

    def unchanged(self, blocks):
        if self.m.committed_blocks != blocks or self.usable != blocks or self.grows != self.confirmed_grows:
            raise Failed(f"failed grow: the rank changed: {self.m.committed_blocks} blocks (usable {self.usable}), "
                         f"on_grow x{self.grows}; expected {blocks} blocks and on_grow x{self.confirmed_grows}")
        self.check_marker("failed grow")
        return [f"unchanged: {blocks} blocks, on_grow not called, marker intact"]

    def stop(self):
        lines = []
        if self.m is not None:
            self.kv = None  # drop the views before the memory goes
            t0 = time.perf_counter()
            self.m.close()
            self.m = None
            lines.append(f"detached and unmapped in {ms(t0)}")
        if self.client is not None:
            try:
                released = self.client.delete(self.pool)
                lines.append(f"deleted {self.pool}: {mib(released)} released")
            except kvd.KvdError as e:
                if e.code != "NOT_FOUND":  # never created (failed start): nothing to delete
                    raise
            self.client.close()
            self.client = None
        return lines


def rank_main(rank, a, conn):
    """A rank's process: start, report, then answer the driver's commands until "stop". Whatever
    happens (a failed check, a daemon error, Ctrl-C), the rank detaches and deletes its pool."""
    def send(msg):
        try:
            conn.send(msg)
        except OSError:
            pass  # the driver is gone; still clean up below

    r = Rank(rank, a)
    cmd = "start"
    try:
        send(("ok", r.start()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            send(("ok", getattr(r, cmd)(*args)))
    except (Failed, kvd.KvdError) as e:
        send(("error", f"{cmd}: {e}"))
    except EOFError:
        pass  # the driver exited without saying stop
    except BaseException as e:  # noqa: B036  (a bug or Ctrl-C: one line for the driver, then clean up)
        send(("error", f"{cmd}: {type(e).__name__}: {e}"))
    try:
        lines = r.stop()
        if cmd == "stop":
            send(("ok", lines))
    except BaseException as e:  # noqa: B036
        send(("error", f"stop: {type(e).__name__}: {e}"))
    conn.close()


# -- the driver ------------------------------------------------------------------------------------
class Ranks:
    """The driver's side of the rank processes: a pipe each, every call bounded by --timeout."""

    def __init__(self, a):
        self.a = a
        self.ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []

    def spawn(self):
        for r in range(self.a.ranks):
            mine, theirs = self.ctx.Pipe()
            p = self.ctx.Process(target=rank_main, args=(r, self.a, theirs), name=f"rank{r}")
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)

    def _reply(self, r):
        conn = self.conns[r]
        if not conn.poll(self.a.timeout):
            raise Failed(f"rank {r}: no answer in {self.a.timeout:g} s")
        try:
            status, payload = conn.recv()
        except EOFError:
            raise Failed(f"rank {r}: its process exited (code {self.procs[r].exitcode})") from None
        if status != "ok":
            raise Failed(f"rank {r}: {payload}")
        return payload

    def gather(self, title=None):
        """Every rank's answer, printed in rank order."""
        t0 = time.perf_counter()
        answers = [self._reply(r) for r in range(len(self.conns))]
        for r, lines in enumerate(answers):
            for line in lines:
                print(f"  rank {r}: {line}")
        if title:
            print(f"  every rank {title} in {ms(t0)}")
        return answers

    def ask(self, *cmd, title=None):
        for conn in self.conns:
            conn.send(cmd)
        return self.gather(title)

    def stop(self):
        """Asks every live rank to detach and delete its pool; a rank that does not stop is terminated."""
        errors = []
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass  # exited already (after reporting its error)
        for r, conn in enumerate(self.conns):
            try:
                if conn.poll(self.a.timeout):
                    status, payload = conn.recv()
                    if status == "ok":
                        for line in payload:
                            print(f"  rank {r}: {line}")
                    else:
                        errors.append(f"rank {r}: {payload}")
            except (EOFError, OSError):
                pass
        for p in self.procs:
            p.join(self.a.timeout)
            if p.is_alive():
                p.terminate()
                p.join()
                errors.append(f"rank {p.name[4:]}: did not stop within {self.a.timeout:g} s; terminated")
        return errors


def block_bytes(pool):
    d = pool.geometry.dims
    return d.layers * d.heads * d.block_tokens * d.channels * d.element_bytes


def fits(group):
    """For each rank, the most blocks its daemon can hold now: its blocks + what its budget and the
    device's free memory leave."""
    out = []
    for r in group.ranks:
        with kvd.connect(r.socket, client_name="tp-group-driver") as c:
            info = c.device_info()
        room = min(info.free_bytes, max(info.budget_bytes - info.committed_bytes, 0))
        out.append(r.pool.committed_blocks + room // block_bytes(r.pool))
    return out


def print_status(group):
    """What `kvctl group status` prints, from group.refresh()."""
    ranks = group.refresh()
    first = ranks[0].pool
    consistent = all(r.pool.state == first.state and r.pool.committed_blocks == first.committed_blocks
                     for r in ranks)
    print(f"group {group.name}: {len(ranks)} ranks, " +
          (f"{state_name(first.state)}, {first.committed_blocks} blocks on every rank" if consistent
           else "INCONSISTENT: the ranks differ in state or committed blocks"))
    for r in ranks:
        p = r.pool
        print(f"  rank {r.rank:<3} {p.name:<20} {state_name(p.state):<9} {p.committed_blocks:8} blocks "
              f"{mib(p.committed_bytes):>10}  {len(p.clients)} clients  {r.socket} ({r.device_uuid})"
              f"{' held by ' + p.transaction if p.transaction else ''}")
    return ranks, consistent


def drive(a, ranks):
    ranks.spawn()
    print(f"driver: spawned {a.ranks} rank processes (pids {', '.join(str(p.pid) for p in ranks.procs)})")
    ranks.gather("is ready")

    t0 = time.perf_counter()
    with kvd.Group.open(a.group, socket_dir=a.socket_dir, client_name="tp-group-driver") as g:
        print(f"opened group {g.name} in {ms(t0)}: group.ranks =")
        for r in g.ranks:
            print(f"  GroupRank(rank={r.rank}, socket={r.socket}, device_uuid={r.device_uuid}, "
                  f"pool={r.pool.name}: {state_name(r.pool.state)}, {r.pool.committed_blocks} blocks)")
        if len(g.ranks) != a.ranks:
            raise Failed(f"group {g.name} has {len(g.ranks)} ranks, not {a.ranks}")

        # Grow: to a --fraction of what fits on the tightest rank, or to --grow-blocks.
        now = g.ranks[0].pool.committed_blocks
        capacity = a.capacity_blocks
        fit = fits(g)
        target = a.grow_blocks or min(capacity, now + int((min(fit) - now) * a.fraction))
        if target <= now:
            raise Failed(f"no room to grow the group past {now} blocks (the ranks fit {fit} blocks)")
        c = g.grow(target)
        print(f"group grow to {target} blocks: prepare {us_ms(c.prepare_us)}, commit {us_ms(c.commit_us)}, "
              f"total {us_ms(c.total_us)}; {mib(c.prepared_bytes)} prepared on {len(c.ranks)} daemons")
        ranks.ask("after_grow", target, title="confirmed the grow")

        c = g.sleep(wait=True)
        print(f"group sleep (wait=True): prepare {us_ms(c.prepare_us)}, commit {us_ms(c.commit_us)}, "
              f"total {us_ms(c.total_us)}; every rank had unmapped when it returned; committed now "
              f"{', '.join(mib(u.pool.committed_bytes) for u in c.ranks)}")
        ranks.ask("after_sleep", title="confirmed the sleep")

        c = g.wake()
        print(f"group wake: prepare {us_ms(c.prepare_us)}, commit {us_ms(c.commit_us)}, total {us_ms(c.total_us)}; "
              f"{mib(c.prepared_bytes)} of fresh memory on {len(c.ranks)} daemons")
        ranks.ask("after_wake", target, title="confirmed the wake")

        if a.demo_failure:
            fit = fits(g)
            tight = min(range(len(fit)), key=lambda i: fit[i])
            too_big = fit[tight] + 1
            if too_big > capacity:
                raise Failed(f"--demo-failure: every rank fits the whole capacity ({capacity} blocks; they fit "
                             f"{fit}): start one rank's kvd with a smaller --budget")
            before = {r.rank: r.pool.generation for r in g.refresh()}
            print(f"group grow to {too_big} blocks (rank {tight} fits {fit[tight]}), as --demo-failure asks:")
            try:
                g.grow(too_big)
            except kvd.KvdError as e:
                print(f"  failed as expected: {e}")
                if "no rank changed" not in e.message:
                    raise Failed(f"the failed group grow does not say that no rank changed: {e}")
            else:
                raise Failed(f"--demo-failure: the group grow to {too_big} blocks succeeded; it was meant to fail")
            after = {r.rank: r.pool.generation for r in g.refresh()}
            if after != before:
                raise Failed(f"the failed group grow changed the pools' generations: {before} -> {after}")
            print(f"  no rank changed: every pool's generation is as before ({before})")
            ranks.ask("unchanged", target, title="confirmed it is unchanged")

        print("status (as kvctl group status, from group.refresh()):")
        _, consistent = print_status(g)
        if not consistent:
            raise Failed(f"group {g.name} is inconsistent")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket-dir", default=os.environ.get("KVD_SOCKET_DIR") or "/run/kvd",
                    help="the node's kvd sockets, gpu<r>.sock (default: $KVD_SOCKET_DIR or /run/kvd)")
    ap.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks: one process and one GPU each")
    ap.add_argument("--group", default=f"tp-demo-{os.getpid()}", help="group name; rank r's pool is <group>-r<r>")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="KV heads per rank")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--element-bytes", type=int, default=2)
    ap.add_argument("--capacity-blocks", type=int, default=4096)
    ap.add_argument("--initial-blocks", type=int, default=64)
    ap.add_argument("--grow-blocks", type=int, default=0,
                    help="group grow target (default: a --fraction of what fits on the tightest rank)")
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--demo-failure", action="store_true",
                    help="also try a group grow that does not fit on the tightest rank (expects it to fail)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any rank's answer")
    a = ap.parse_args()
    if a.ranks < 1:
        ap.error("--ranks must be at least 1")

    ranks = Ranks(a)
    error = None
    try:
        drive(a, ranks)
    except (Failed, kvd.KvdError) as e:
        error = str(e)
    except KeyboardInterrupt:
        error = "interrupted"
    print("shutdown:")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the ranks got Ctrl-C too and are cleaning up: wait (bounded)
    errors = ranks.stop()
    error = error or (errors[0] if errors else None)
    if error:
        print(f"tp_group: {error}", file=sys.stderr)
        return 1
    print(f"done: {a.ranks} rank{'s' if a.ranks != 1 else ''} grew, slept and woke as one group"
          f"{' and a grow that did not fit changed no rank' if a.demo_failure else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
