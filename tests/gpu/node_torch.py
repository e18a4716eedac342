"""The two-GPU run (tests/gpu/run_gpu.sh, step "node"; docs/gpu.md "Two GPUs"): one kvd per GPU, each under a
played service manager (FD store, saved state, a host tier), and torch engines on both GPUs checking every byte.

1. A tensor-parallel group, one pool per GPU (layer-outermost, created at half of SIZE and grown in eight steps,
   so each segment has several chunks), written by one engine per rank: grown to SIZE as one group, shrunk back
   to half as one (a group shrink releases whole chunks: docs/api.md), grown again, then each rank compacted and
   exact-shrunk to 3/4 (reshapes are per rank: a two-phase commit cannot promise a copy, docs/architecture.md),
   then slept keeping the contents (the host tier) and woken as one group; every byte checked after each step.
2. Where the node has two GPUs, a peer engine on GPU 1 maps rank 0's pool (GrantPeerAccess) through a compaction
   of it and a SIGKILL and restart of GPU 0's kvd, checking every byte.
3. Both daemons SIGKILLed while a group grow is prepared on both ranks and the engines are attached: after the
   restart every byte is as written, the prepared grow is gone on both ranks (no hold, nothing counted, nothing
   left in either FD store), and the group grows as one.
4. Arbitration across the node: on GPU 0, an idle pool of priority 0 (its engine answers a reclaim with
   ShrinkForReclaim) and a pool of priority 10 whose waiting grow is short of GPU 0's budget; the same idle pool
   on GPU 1. The waiting grow is served by GPU 0's reclaim; GPU 1's engine is never asked.

Printed: the group's grow, compaction, shrink, keeping sleep and wake times; each daemon's restart to ready; the
reclaim's time. One node with one GPU runs both daemons on GPU 0 and skips part 2, saying so.

    python3 node_torch.py BIN_DIR OUT_DIR [SIZE] [--backend=cuda|host]
SIZE is per rank (default 32 GiB; 256 MiB on host). --backend=host runs the same with numpy views on host devices
0 and 1 (the suite's kvd_node_script_test). Prints "node: PASS" or "node: FAIL (...)".
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
for d in (here, os.path.join(here, "..", "testing")):  # the bundle holds both; a checkout has them apart
    if d not in sys.path:
        sys.path.insert(0, d)

from played_manager import PlayedManager  # noqa: E402
from reshape_torch import parse_size  # noqa: E402

LAYERS = 16  # 8 KV heads x 16 tokens x 128 channels x bf16: 32 KiB a block and layer
DIMS = dict(layers=LAYERS, heads=8, block_tokens=16, channels=128, element_bytes=2)
LAYER_BLOCK_BYTES = 8 * 16 * 128 * 2
GROUP = "tp"
WAIT_S = 120


def pattern(xp, n, start, layer, salt, torch_device):
    """Words [start, start + n) of a layer: every word different, cheap to make on the device."""
    if torch_device:
        i = xp.arange(start, start + n, dtype=xp.int64, device=torch_device)
        return ((i * 2654435761 + layer * 40503 + salt) & 0x7FFFFFFF).to(xp.int32)
    i = xp.arange(start, start + n, dtype=xp.int64)
    return ((i * 2654435761 + layer * 40503 + salt) & 0x7FFFFFFF).astype(xp.int32)


def engine(sock, pool, device, salt, backend):
    """A child: attaches `pool` from `device` (pausable), then on "write B0 B1" fills blocks [B0, B1) of every layer
    with its pattern and on "check B" compares blocks [0, B) of every layer."""
    import kvd
    if backend == "host":
        import numpy as xp
        torch_device = None
    else:
        import torch as xp
        xp.cuda.set_device(device)
        torch_device = f"cuda:{device}"
    sync = (lambda: xp.cuda.synchronize()) if torch_device else (lambda: None)
    c = kvd.connect(sock, client_name=f"engine-{pool}-gpu{device}", timeout=5.0)
    m = c.attach(pool, device=device, on_pause=lambda ranges: sync())
    words = LAYER_BLOCK_BYTES // 4

    def layer(l, b0, b1):
        v = m.layer(l, "int16")
        t = xp.as_tensor(v, device=torch_device) if torch_device else v
        return t[b0:b1].reshape(-1).view(xp.int32) if torch_device else t[b0:b1].reshape(-1).view("int32")

    def pieces(b0, b1):  # at most 64 MiB of a layer at a time: the pattern's temporaries stay small on the GPU
        step = max(1, (64 << 20) // LAYER_BLOCK_BYTES)
        for l in range(LAYERS):
            for b in range(b0, b1, step):
                yield l, b, min(b + step, b1)

    print("attached", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "write":
            for l, b, e in pieces(int(cmd[1]), int(cmd[2])):
                layer(l, b, e)[:] = pattern(xp, (e - b) * words, b * words, l, salt, torch_device)
            sync()
            print("written", flush=True)
        elif cmd[0] == "check":
            bad = 0
            for l, b, e in pieces(0, int(cmd[1])):
                bad += int((layer(l, b, e) != pattern(xp, (e - b) * words, b * words, l, salt, torch_device)).sum())
            print(f"checked {bad * 4}", flush=True)
        else:
            break
    m.close()
    c.close()


class Engine:
    def __init__(self, sock, pool, device, salt, backend):
        self.name = f"{pool}@gpu{device}"
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine", sock, pool, str(device),
                                   str(salt), backend], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.expect("attached")

    def ask(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def expect(self, want):
        got = self.p.stdout.readline().strip()
        assert got == want, f"engine {self.name}: {got!r}"

    def write(self, b0, b1):
        assert self.ask(f"write {b0} {b1}") == "written", self.name

    def bad(self, blocks):
        line = self.ask(f"check {blocks}")
        assert line.startswith("checked "), f"engine {self.name}: {line!r}"
        return int(line.split()[1])

    def close(self):
        if self.p.poll() is None:
            try:
                self.ask("quit")
            except BrokenPipeError:
                pass
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()


class Node:
    """Two kvds, GPU g's at gpu<g>.sock in one directory, each under its own played service manager."""

    def __init__(self, bin_dir, out_dir, backend, devices, rank_bytes):
        self.kvd = os.path.join(bin_dir, "kvd")
        self.out, self.backend, self.devices = out_dir, backend, devices
        self.dir = tempfile.mkdtemp(prefix="kvd-node-")
        os.chmod(self.dir, 0o750)
        self.sockets = [os.path.join(self.dir, f"gpu{g}.sock") for g in range(2)]
        self.budget = rank_bytes * 7 // 4  # a rank and half of one more fit; a third half does not (part 4)
        self.tier = rank_bytes
        self.managers = []
        for g in range(2):
            os.mkdir(os.path.join(self.dir, f"unit{g}"))
            self.managers.append(PlayedManager(os.path.join(self.dir, f"unit{g}")))
            self.start(g)

    def argv(self, g):
        a = [self.kvd, f"--backend={self.backend}", f"--device={self.devices[g]}", "--socket=" + self.sockets[g],
             f"--state-dir={self.dir}/unit{g}/state", f"--budget={self.budget}", f"--host-tier-bytes={self.tier}",
             "--pause-timeout=30s", "--reclaim-timeout=10s"]
        if self.backend == "host":
            a += ["--host-capacity=1GiB", "--host-granularity=2MiB"]
        return a

    def start(self, g):
        """Starts GPU g's kvd; returns the seconds to READY=1."""
        t = time.monotonic()
        self.managers[g].start(self.argv(g), os.path.join(self.out, f"kvd-node{g}.log"))
        return time.monotonic() - t

    def close(self):
        for m in self.managers:
            m.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    backend = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--backend=")), "cuda")
    bin_dir, out_dir = args[0], args[1]
    size = parse_size(args[2]) if len(args) > 2 else (32 << 30 if backend != "host" else 256 << 20)
    import kvd
    if backend == "host":
        devices = [0, 1]
    else:
        listed = json.loads(subprocess.run([os.path.join(bin_dir, "kvd"), "--backend=cuda", "--list-devices",
                                            "--json"], capture_output=True, text=True, check=True).stdout)
        devices = [0, 1] if len(listed["devices"]) > 1 else [0, 0]
    two_gpus = devices[0] != devices[1]
    per_layer = size // LAYERS // (2 << 20) * (2 << 20)
    blocks = per_layer // LAYER_BLOCK_BYTES  # SIZE per rank, whole granules per layer
    granule_blocks = (2 << 20) // LAYER_BLOCK_BYTES
    node = Node(bin_dir, out_dir, backend, devices, per_layer * LAYERS)
    engines, clients, failed = [], [], []

    def connect(g, name):
        c = kvd.connect(node.sockets[g], client_name=name)
        clients.append(c)
        return c

    def check(what, ranks_blocks, extra=()):
        bad = sum(e.bad(b) for e, b in zip(engines, ranks_blocks)) + sum(e.bad(b) for e, b in extra)
        print(f"  {what}: {bad} bytes differ", flush=True)
        if bad:
            failed.append(f"{what}: {bad} bytes differ")

    try:
        print(f"node: {'two GPUs' if two_gpus else 'one GPU (both kvds on GPU 0)'}, {backend}; "
              f"{per_layer * LAYERS / 2**30:.2f} GiB a rank as {LAYERS} layers, budget "
              f"{node.budget / 2**30:.2f} GiB a kvd", flush=True)
        # 1. The group, grown, compacted, shrunk, slept keeping its contents and woken as one.
        half = blocks // 2 // granule_blocks * granule_blocks
        for g in range(2):
            c = connect(g, f"creator{g}")
            c.create_pool(f"{GROUP}-r{g}", capacity_blocks=blocks, override="LBHNC",
                          group=kvd.GroupMembership(GROUP, g, 2), **DIMS)
            steps = sorted({max(granule_blocks, half * k // 8 // granule_blocks * granule_blocks) for k in range(1, 9)})
            for b in steps:  # up to eight grows: several chunks a segment, for the compaction
                c.grow(f"{GROUP}-r{g}", b)
        for g in range(2):
            engines.append(Engine(node.sockets[g], f"{GROUP}-r{g}", devices[g], 17 + g, backend))
            engines[-1].write(0, half)
        group = kvd.Group.open(GROUP, socket_dir=node.dir)
        t = time.monotonic()
        group.grow(blocks)
        grow_ms = (time.monotonic() - t) * 1000
        check("group grow", [half, half])
        t = time.monotonic()
        change = group.shrink(half, wait=True)  # whole chunks: half is where the grow's chunks begin
        group_shrink_ms = (time.monotonic() - t) * 1000
        if [u.pool.committed_blocks for u in change.ranks] != [half, half]:
            failed.append(f"group shrink to {half}: {[u.pool.committed_blocks for u in change.ranks]}")
        check("group shrink of whole chunks", [half, half])
        group.grow(blocks)
        for e in engines:
            e.write(half, blocks)
        compact = []
        for g in range(2):
            t = time.monotonic()
            r = clients[g].compact(f"{GROUP}-r{g}")
            compact.append(f"rank {g} {r.reshape.chunks_before} -> {r.reshape.chunks_after} chunks in "
                           f"{(time.monotonic() - t) * 1000:.0f} ms, longest pause {r.reshape.max_pause_us} us")
        check("compaction of each rank", [blocks, blocks])
        # 3/4 and a granule more: inside each segment's one chunk, so an exact shrink replaces it
        target = (blocks * 3 // 4) // granule_blocks * granule_blocks + granule_blocks
        shrink_ms = []
        for g in range(2):
            t = time.monotonic()
            r = clients[g].shrink(f"{GROUP}-r{g}", target, wait=True)
            shrink_ms.append((time.monotonic() - t) * 1000)
            if r.pool.committed_blocks != target or not r.reshape.target_reached:
                failed.append(f"rank {g}: the exact shrink to {target} left {r.pool.committed_blocks} blocks")
        check("exact shrink of each rank to 3/4", [target, target])
        t = time.monotonic()
        group.sleep(wait=True, keep=True)
        sleep_ms = (time.monotonic() - t) * 1000
        t = time.monotonic()
        group.wake()
        wake_ms = (time.monotonic() - t) * 1000
        check("group sleep keeping the contents, then wake", [target, target])
        print(f"  group of 2 across two kvds: grow {half} -> {blocks} blocks {grow_ms:.0f} ms, shrink back "
              f"{group_shrink_ms:.0f} ms; {'; '.join(compact)}; exact shrinks {shrink_ms[0]:.0f} and "
              f"{shrink_ms[1]:.0f} ms; sleep keeping "
              f"{2 * target * LAYERS * LAYER_BLOCK_BYTES / 2**30:.2f} GiB {sleep_ms:.0f} ms; wake {wake_ms:.0f} ms",
              flush=True)
        group.close()

        # 2. A peer mapping from GPU 1 of rank 0's pool, through a compaction and a restart of GPU 0's kvd.
        if two_gpus:
            uuid1 = connect(1, "peer-uuid").device_info().device_uuid
            clients[0].grant_peer_access(f"{GROUP}-r0", uuid1)
            peer = Engine(node.sockets[0], f"{GROUP}-r0", devices[1], 17, backend)  # reads rank 0's pattern
            engines.append(peer)
            clients[0].grow(f"{GROUP}-r0", blocks)
            engines[0].write(target, blocks)
            clients[0].compact(f"{GROUP}-r0")
            check("peer mapping through a compaction", [], [(peer, blocks)])
            node.managers[0].kill(signal.SIGKILL)
            ready = node.start(0)
            check(f"peer mapping through a SIGKILL of GPU 0's kvd (ready again in {ready:.2f} s)", [], [(peer, blocks)])
            clients[0] = connect(0, "after-restart")
            clients[0].shrink(f"{GROUP}-r0", target, wait=True)
            peer.close()
            engines.remove(peer)
        else:
            print("  peer mapping: SKIPPED (one GPU)", flush=True)

        # 3. Both kvds SIGKILLed while a group grow is prepared on both ranks.
        coordinators = [connect(g, "coordinator") for g in range(2)]
        prepared = [c.prepare(f"{GROUP}-r{g}", "grow", target_blocks=blocks, ttl=120)
                    for g, c in enumerate(coordinators)]
        for m in node.managers:
            m.kill(signal.SIGKILL)
        ready = [node.start(g) for g in range(2)]
        after = [connect(g, "after-prepare") for g in range(2)]
        for g, c in enumerate(after):
            pool = c.pool(f"{GROUP}-r{g}")
            stored = [n for n in node.managers[g].stored() if n.startswith("c")]
            # The budget holds the table and what is still pending release (a compaction's old chunks stay
            # counted across a restart that came before the record said they were given back), nothing prepared.
            counted = pool.committed_bytes + pool.pending_release_bytes
            state = (pool.committed_blocks, pool.transaction, c.device_info().committed_bytes, len(stored))
            if state != (target, "", counted, len(pool.chunks)):
                failed.append(f"rank {g} after the mid-prepare restart: (committed blocks, transaction, committed "
                              f"bytes, FDs stored) {state}, want {(target, '', counted, len(pool.chunks))}")
            try:
                c.commit(prepared[g].transaction)
                failed.append(f"rank {g}: the prepared grow committed after the restart")
            except kvd.KvdError as e:
                if e.code != "NOT_FOUND":
                    failed.append(f"rank {g}: commit after the restart: {e}")
        check(f"both kvds SIGKILLed mid-prepare (ready again in {ready[0]:.2f} s and {ready[1]:.2f} s)",
              [target, target])
        group = kvd.Group.open(GROUP, socket_dir=node.dir)
        group.grow(blocks)
        group.close()
        check("group grow after the restarts", [target, target])

        # 4. Arbitration: GPU 0 reclaims from its own idle pool, never from GPU 1's.
        for e in engines:
            e.close()
        engines.clear()
        for g in range(2):
            after[g].delete(f"{GROUP}-r{g}", force=True)
        asked = [0, 0]
        idle = []
        for g in range(2):
            c = connect(g, f"idle-engine{g}")
            c.create_pool("idle", capacity_blocks=blocks, override="LBHNC", priority=0, **DIMS)
            c.grow("idle", blocks)

            def on_reclaim(request, g=g, c=c):
                asked[g] += 1
                c.shrink_for_reclaim(request, [])  # nothing live: give back what was asked

            idle.append(c.attach("idle", on_pause=lambda ranges: None, on_reclaim=on_reclaim))
        hungry = connect(0, "hungry")
        hungry.create_pool("hungry", capacity_blocks=blocks, override="LBHNC", priority=10, **DIMS)
        t = time.monotonic()
        hungry.grow("hungry", blocks, wait=True, wait_for=60)  # idle holds a rank of the 1.75: a quarter must go back
        reclaim_ms = (time.monotonic() - t) * 1000
        left = [clients_pool.pool("idle").committed_blocks for clients_pool in (after[0], after[1])]
        print(f"  reclaim on GPU 0: the waiting grow of {per_layer * LAYERS / 2**30:.2f} GiB served in "
              f"{reclaim_ms:.0f} ms; GPU 0's idle pool asked {asked[0]} time(s), now {left[0]} blocks; GPU 1's "
              f"asked {asked[1]} time(s), {left[1]} blocks", flush=True)
        if asked[0] < 1 or left[0] >= blocks:
            failed.append("GPU 0's idle pool gave nothing back")
        if asked[1] != 0 or left[1] != blocks:
            failed.append(f"GPU 1's idle pool was touched: asked {asked[1]}, {left[1]} blocks")
        for m in idle:
            m.close()
    except (AssertionError, kvd.KvdError) as e:
        failed.append(f"{type(e).__name__}: {e}")
    finally:
        for e in engines:
            e.close()
        for c in clients:
            c.close()
        node.close()
    print("node: PASS" if not failed else f"node: FAIL ({'; '.join(failed)})", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        sys.exit(main())
