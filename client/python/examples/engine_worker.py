#!/usr/bin/env python3
"""An inference engine's use of kvd, as a vLLM/SGLang worker would wire it in.

    KVD_SOCKET=/run/kvd/gpu0.sock python3 engine_worker.py [--pool kv-demo] [--layers 32] ...

Connect; create the KV pool with the attention backend's layout requirement (FlashInfer wants a
block-outermost layout) and the KV connector's preference (nixl); attach (every chunk mapped at a
fixed address); build per-layer views (numpy on the host backend, torch tensors on CUDA when torch
imports); warm up (write some blocks); grow to what fits (device free memory and the daemon's budget);
sleep (memory back to the device, e.g. for RL weight updates); wake (fresh, zeroed memory at the same
addresses: the views stay valid); clean up.

The Mapping is pausable (docs/integrating.md, "What the pause hook must do"): when another session
releases or moves the pool's memory (an operator's kvctl sleep/shrink/compact/delete, kvd compacting on
its own), on_pause stops the engine launching work on the pool and synchronises the device before it
returns; on_resume lets it go on with the new committed size, except after a sleep (0 blocks: it waits for
the wake's on_grow); on_lost (the pool was deleted, kvd stopped) stops it for good. Changes this process
makes itself (its own grow, sleep, wake) do not pause it.

It also answers reclaims (docs/integrating.md, "Sharing a GPU"): when a waiting grow of another engine of
higher priority (--priority) needs memory, kvd sends this one a RECLAIM; on_reclaim (on a thread of its own)
gives back with shrink_for_reclaim and the blocks it still uses, and moves its block table where the
compaction moved them. It reports what it uses (report_usage), so that kvd asks the engines with the most to
give first.
"""

import argparse
import os
import sys
import threading
import time

try:
    import kvd
except ImportError:  # run from a checkout: the package is next door (then set KVD_PYTHON_GEN_DIR)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import kvd


def ms(t0):
    return f"{(time.perf_counter() - t0) * 1e3:.1f} ms"


def mib(n):
    return f"{n / (1 << 20):.1f} MiB"


class KvGate:
    """What the engine's scheduler asks before it launches work on the KV cache: may it, and over how many
    blocks. The Mapping's hooks drive it, on the follower thread."""

    def __init__(self, torch):
        self.torch = torch
        self.usable = threading.Event()  # set: the engine may launch kernels that touch the pool
        self.blocks = 0                  # the committed blocks it may touch
        self.lost = None

    def on_pause(self, ranges):  # the pool's memory is about to change under these bytes
        self.usable.clear()      # the scheduler launches nothing more on the pool (a real engine also waits
                                 # for the step in flight to finish launching)
        if self.torch is not None:
            self.torch.cuda.synchronize()  # every stream that reads or writes it has finished

    def on_resume(self, applied, mapping):
        self.blocks = mapping.committed_blocks
        if self.blocks:          # 0 after a sleep: nothing to touch until on_grow (the views stay valid)
            self.usable.set()

    def on_grow(self, committed_blocks):  # a grow, or the wake after a sleep (fresh, zeroed memory)
        self.blocks = committed_blocks
        if self.lost is None:
            self.usable.set()

    def on_lost(self, why):  # deleted, or kvd stopped: the cache is gone; stop using it and close the Mapping
        self.lost = why
        self.usable.clear()


class BlockTable:
    """The engine's blocks in use: request slot -> block id. A reclaim's compaction shrink moves the live
    blocks past its target below it; the table follows (update.reshape.moved_blocks)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.slots = {}

    def live(self):
        with self.lock:
            return sorted(self.slots.values())

    def moved(self, moves):
        with self.lock:
            where = {m.src: m.dst for m in moves}
            self.slots = {slot: where.get(b, b) for slot, b in self.slots.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=None, help="kvd's socket (default: $KVD_SOCKET or /run/kvd/gpu<device>.sock)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--pool", default=f"kv-demo-{os.getpid()}")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--element-bytes", type=int, default=2)
    ap.add_argument("--capacity-blocks", type=int, default=4096)
    ap.add_argument("--initial-blocks", type=int, default=256)
    ap.add_argument("--fraction", type=float, default=0.5, help="share of the free budget to grow into")
    ap.add_argument("--keep", action="store_true", help="leave the pool behind")
    ap.add_argument("--priority", type=int, default=0, help="the pool's priority (a tenant needs the operator's grant)")
    a = ap.parse_args()

    t0 = time.perf_counter()
    c = kvd.connect(a.socket, device=a.device, client_name=f"engine-{os.getpid()}")
    info = c.device_info()
    backend = kvd.v1_pb2.Backend.Name(info.backend)
    print(f"connected to {c.socket} ({info.device_name}, {backend}) in {ms(t0)}: free {mib(info.free_bytes)}, "
          f"budget {mib(info.budget_bytes)}, committed {mib(info.committed_bytes)}")

    t0 = time.perf_counter()
    pool = c.create_pool(a.pool, layers=a.layers, capacity_blocks=a.capacity_blocks, heads=a.heads,
                         block_tokens=a.block_tokens, channels=a.channels, element_bytes=a.element_bytes,
                         initial_blocks=a.initial_blocks,
                         backend_requirements={"FLASHINFER": ["block-outermost"]},
                         connector_preferences=[("nixl", "BLNHC")], priority=a.priority)
    print(f"created {pool.name}: layout {pool.geometry.layout} ({kvd.layout_rule_name(pool.layout.rule)}: "
          f"{pool.layout.rule_detail}), {pool.committed_blocks} blocks, {mib(pool.committed_bytes)} committed, "
          f"{mib(pool.reserved_bytes)} VA, in {ms(t0)}")

    try:
        torch = None
        if info.backend == kvd.v1_pb2.BACKEND_CUDA:
            try:
                import torch
            except ImportError:
                print("torch is not importable: the views stay raw __cuda_array_interface__ objects")

        gate = KvGate(torch)
        table = BlockTable()

        def on_reclaim(request):  # on a thread of its own: it may shrink right here
            # A real engine first drops what it can recompute (prefix cache), then gives back with the rest.
            update = c.shrink_for_reclaim(request, table.live())
            table.moved(update.reshape.moved_blocks)
            print(f"reclaim {request.reclaim_id}: gave back {mib(request.bytes)} or more: now "
                  f"{update.pool.committed_blocks} blocks, {len(update.reshape.moved_blocks)} live block(s) moved")
            # Raising instead declines (kvd then applies the pool's on_reclaim_timeout policy).

        m = None
        t0 = time.perf_counter()
        m = c.attach(a.pool, on_grow=gate.on_grow, on_lost=gate.on_lost, on_pause=gate.on_pause,
                     on_resume=lambda applied: gate.on_resume(applied, m), on_reclaim=on_reclaim)
        gate.blocks = m.committed_blocks
        gate.usable.set()
        print(f"attached (pausable) and mapped {len(m.mapped_chunks)} chunk(s) at {m.base:#x} in {ms(t0)}")

        def views():
            raw = m.layers()
            if torch is not None:
                return [torch.as_tensor(v, device=f"cuda:{m.cuda_device}") for v in raw]
            return raw

        t0 = time.perf_counter()
        kv = views()
        print(f"{len(kv)} layer views of [B={m.geometry.dims['capacity_blocks']}, H, N, C] "
              f"(only the first {m.committed_blocks} blocks are backed), {type(kv[0]).__module__}."
              f"{type(kv[0]).__name__}, in {ms(t0)}")

        def fill(blocks, value):
            if not gate.usable.wait(30):  # paused by another session's change, asleep, or lost
                raise RuntimeError(f"the KV cache is not usable: {gate.lost or 'paused for 30 s'}")
            for v in kv:
                v[blocks] = value
            if torch is not None:
                torch.cuda.synchronize()

        def probe(block):
            x = kv[-1][block]
            return float(x.float().max()) if torch is not None else float(x.max())

        t0 = time.perf_counter()
        fill(slice(0, min(16, m.committed_blocks)), 1.0)
        with table.lock:
            table.slots = {slot: slot for slot in range(min(16, m.committed_blocks))}
        c.report_usage(a.pool, live_blocks=len(table.slots))
        print(f"warm-up: wrote blocks 0..{min(16, m.committed_blocks) - 1} of every layer in {ms(t0)}; "
              f"block 0 reads {probe(0)}")

        info = c.device_info()
        block_bytes = pool.committed_bytes // max(pool.committed_blocks, 1) if pool.committed_blocks else \
            m.geometry.block_stride * max(m.geometry.segments, 1)
        room = min(info.free_bytes, info.budget_bytes - info.committed_bytes)
        target = min(a.capacity_blocks, m.committed_blocks + int(room * a.fraction) // max(block_bytes, 1))
        if target > m.committed_blocks:
            t0 = time.perf_counter()
            u = c.grow(a.pool, target)
            print(f"grew to {m.committed_blocks} blocks ({mib(u.pool.committed_bytes)}) in {ms(t0)} "
                  f"(daemon {u.elapsed_us / 1e3:.1f} ms), {len(u.added)} new chunk(s) mapped before grow() returned")
            fill(target - 1, 2.0)
            with table.lock:
                table.slots["last"] = target - 1
            c.report_usage(a.pool, live_blocks=len(table.live()), used_blocks=target)
            print(f"wrote the last block {target - 1}: reads {probe(target - 1)}")
        else:
            print("no room to grow")

        t0 = time.perf_counter()
        gate.usable.clear()  # this process's own sleep does not pause it: it stops using the pool itself
        [s] = c.sleep(a.pool, wait=True)
        print(f"slept: {mib(s.pool.committed_bytes)} committed, {len(s.released_chunk_ids)} chunk(s) released, "
              f"pending {s.pool.pending_release_bytes} B, in {ms(t0)}")
        t0 = time.perf_counter()
        [w] = c.wake(a.pool)
        gate.on_grow(m.committed_blocks)  # its own wake calls no on_grow: the chunks are mapped on return
        print(f"woke {w.pool.committed_blocks} blocks in {ms(t0)} (daemon {w.elapsed_us / 1e3:.1f} ms); "
              f"same addresses, block 0 now reads {probe(0)} (fresh memory)")
        fill(0, 3.0)
        print(f"views work after wake: block 0 reads {probe(0)}")
        kv = None  # drop the views before the memory goes
        t0 = time.perf_counter()
        m.close()
        print(f"detached and unmapped in {ms(t0)}")
    finally:
        if not a.keep:
            print(f"deleted {a.pool}: {mib(c.delete(a.pool, force=True))} released")
        c.close()


if __name__ == "__main__":
    main()
