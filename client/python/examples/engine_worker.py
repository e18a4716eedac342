#!/usr/bin/env python3
"""An inference engine's use of kvd, as a vLLM/SGLang worker would wire it in.

    KVD_SOCKET=/run/kvd/gpu0.sock python3 engine_worker.py [--pool kv-demo] [--layers 32] ...

Connect; create the KV pool with the attention backend's layout requirement (FlashInfer wants a
block-outermost layout) and the KV connector's preference (nixl); attach (every chunk mapped at a
fixed address); build per-layer views (numpy on the host backend, torch tensors on CUDA when torch
imports); warm up (write some blocks); grow to what fits (device free memory and the daemon's budget);
sleep (memory back to the device, e.g. for RL weight updates); wake (fresh, zeroed memory at the same
addresses: the views stay valid); clean up.
"""

import argparse
import os
import sys
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
                         connector_preferences=[("nixl", "BLNHC")])
    print(f"created {pool.name}: layout {pool.geometry.layout} ({kvd.layout_rule_name(pool.layout.rule)}: "
          f"{pool.layout.rule_detail}), {pool.committed_blocks} blocks, {mib(pool.committed_bytes)} committed, "
          f"{mib(pool.reserved_bytes)} VA, in {ms(t0)}")

    try:
        grown = []
        t0 = time.perf_counter()
        m = c.attach(a.pool, on_grow=grown.append)  # on_grow(committed_blocks)
        print(f"attached and mapped {len(m.mapped_chunks)} chunk(s) at {m.base:#x} in {ms(t0)}")

        torch = None
        if info.backend == kvd.v1_pb2.BACKEND_CUDA:
            try:
                import torch
            except ImportError:
                print("torch is not importable: the views stay raw __cuda_array_interface__ objects")

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
            for v in kv:
                v[blocks] = value
            if torch is not None:
                torch.cuda.synchronize()

        def probe(block):
            x = kv[-1][block]
            return float(x.float().max()) if torch is not None else float(x.max())

        t0 = time.perf_counter()
        fill(slice(0, min(16, m.committed_blocks)), 1.0)
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
            print(f"wrote the last block {target - 1}: reads {probe(target - 1)}")
        else:
            print("no room to grow")

        t0 = time.perf_counter()
        [s] = c.sleep(a.pool, wait=True)
        print(f"slept: {mib(s.pool.committed_bytes)} committed, {len(s.released_chunk_ids)} chunk(s) released, "
              f"pending {s.pool.pending_release_bytes} B, in {ms(t0)}")
        t0 = time.perf_counter()
        [w] = c.wake(a.pool)
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
