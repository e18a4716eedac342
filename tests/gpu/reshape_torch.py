"""Issue 14 on the H200 (tests/gpu/run_gpu.sh, step "reshape"): a Llama-70B-like pool grown in steps of 1 GiB
up to POOL_SIZE (one chunk per segment per grow: fragmented), mapped by two torch processes that keep
writing it and pause when kvd asks (on_pause stops the writer and synchronises; on_resume restarts it).
Then Compact, and an exact Shrink to half that ends inside the chunks. Prints each reply's Reshape
(chunks before/after, bytes copied, copy and pause times) and, after each change, how many bytes of the
committed blocks differ from what each engine wrote.

    python3 reshape_torch.py BIN_DIR OUT_DIR POOL_SIZE
    python3 reshape_torch.py --engine SOCKET POOL PARITY     (one engine; driven over stdin/stdout)
"""
import os
import subprocess
import sys
import tempfile
import threading
import time

# Llama-70B-like: 80 layers, 8 KV heads, 16 tokens a block, 128 channels, bf16 -> 2.5 MiB a block.
DIMS = dict(layers=80, capacity_blocks=49152, heads=8, block_tokens=16, channels=128, element_bytes=2)
BLOCK_BYTES = 80 * 8 * 16 * 128 * 2


def engine(sock, pool, parity):
    import torch

    import kvd

    client = kvd.connect(sock, client_name=f"torch-engine-{parity}", timeout=10.0)
    layers = [l for l in range(DIMS["layers"]) if l % 2 == parity]
    state = {"views": None, "blocks": 0}
    writing = threading.Event()
    idle = threading.Event()
    idle.set()
    pauses = []

    def expected(l, blocks, shape):  # byte k of token n of head h of block b of layer l
        _, heads, tokens, row = shape

        def axis(n, mul, dim):
            s = [1, 1, 1, 1]
            s[dim] = n
            return (torch.arange(n, device="cuda", dtype=torch.int16) * mul % 251).reshape(s)

        parts = axis(blocks, 29, 0) + axis(heads, 17, 1) + axis(tokens, 3, 2) + axis(row, 1, 3)
        return ((parts + (13 * l) % 251) % 251 + 1).to(torch.uint8)

    def rebuild(m):
        blocks = m.committed_blocks
        views = {l: torch.as_tensor(m.layer(l), device="cuda")[:blocks].view(torch.uint8) for l in layers}
        state["views"], state["blocks"] = views, blocks

    def write_all():
        for l, v in state["views"].items():
            v.copy_(expected(l, state["blocks"], v.shape))
        torch.cuda.synchronize()

    def on_pause(ranges):  # stop touching the pool: the writer finishes its pass and the stream drains
        t0 = time.monotonic()
        writing.clear()
        idle.wait()
        torch.cuda.synchronize()
        pauses.append(time.monotonic() - t0)

    m = None

    def on_resume(applied):
        if applied:
            rebuild(m)  # the committed blocks may have changed (shrink); the addresses have not
        writing.set()

    m = client.attach(pool, on_pause=on_pause, on_resume=on_resume)
    rebuild(m)
    write_all()
    print(f"ready blocks={state['blocks']} chunks={len(m.mapped_chunks)}", flush=True)
    passes = [0]
    stop = threading.Event()

    def writer():  # the engine keeps using its cache, except while paused
        while not stop.is_set():
            if not writing.wait(0.05):
                continue
            idle.clear()
            if writing.is_set():
                write_all()
                passes[0] += 1
            idle.set()

    writing.set()
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    for command in sys.stdin:
        command = command.strip()
        if command == "check":
            writing.clear()
            idle.wait()
            torch.cuda.synchronize()
            views, blocks = state["views"], state["blocks"]
            bad = sum(int(torch.count_nonzero(v != expected(l, blocks, v.shape))) for l, v in views.items())
            print(f"checked {sum(v.numel() for v in views.values())} bytes of {blocks} blocks in "
                  f"{len(m.mapped_chunks)} chunks, {bad} differ; {passes[0]} writer passes; pauses "
                  f"{len(pauses)} (hook {max(pauses) * 1000 if pauses else 0:.1f} ms at most)", flush=True)
            writing.set()
        elif command == "quit":
            break
    stop.set()
    writing.clear()
    t.join()
    state["views"] = None
    m.close()
    client.close()


def report(label, u):
    r = u.reshape
    print(f"{label}: {r.chunks_before} -> {r.chunks_after} chunks, {r.copied_bytes / (1 << 30):.2f} GiB copied in "
          f"{r.copy_us / 1000:.1f} ms, {r.paused_clients} clients paused for {r.pause_us / 1000:.1f} ms in "
          f"{r.steps} steps (longest {r.max_pause_us / 1000:.1f} ms; {r.resumed_clients} resumed), target reached {r.target_reached}; committed "
          f"{u.pool.committed_blocks} blocks ({u.pool.committed_bytes / (1 << 30):.2f} GiB); "
          f"daemon elapsed {u.elapsed_us / 1000:.1f} ms", flush=True)


def main():
    import kvd

    bin_dir, out_dir, pool_size = sys.argv[1], sys.argv[2], sys.argv[3]
    directory = tempfile.mkdtemp(prefix="kvd-reshape-gpu-")
    sock = os.path.join(directory, "gpu0.sock")
    log = open(os.path.join(out_dir, "kvd-reshape.log"), "w")
    daemon = subprocess.Popen([os.path.join(bin_dir, "kvd"), "--backend=cuda", "--socket=" + sock,
                               "--state-dir=none", "--pause-timeout=30s"], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        if os.path.exists(os.path.join(directory, "gpu0.handles")):
            break
        time.sleep(0.1)
    c = kvd.connect(sock, client_name="driver")
    units = {"GiB": 1 << 30, "TiB": 1 << 40}
    size = int(float(pool_size[:-3]) * units[pool_size[-3:]])
    step = (1 << 30) // BLOCK_BYTES + 1
    c.create_pool("kv", initial_blocks=0, **DIMS)
    t0 = time.monotonic()
    blocks = 0
    while (blocks + step) * BLOCK_BYTES <= size:
        blocks += step
        c.grow("kv", blocks)
    pool = c.pool("kv")
    print(f"pool kv: grown in {blocks // step} steps of 1 GiB in {time.monotonic() - t0:.1f} s: "
          f"{pool.committed_blocks} blocks, {pool.committed_bytes / (1 << 30):.1f} GiB in {len(pool.chunks)} chunks",
          flush=True)

    engines = [subprocess.Popen([sys.executable, __file__, "--engine", sock, "kv", str(p)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for p in (0, 1)]

    def ask(command=None):
        for e in engines:
            if command:
                e.stdin.write(command + "\n")
                e.stdin.flush()
        return [e.stdout.readline().strip() for e in engines]

    failures = 0

    def check(label):
        nonlocal failures
        for line in ask("check"):
            print(f"engine after {label}:", line, flush=True)
            failures += ", 0 differ" not in line

    for line in ask():
        print("engine:", line, flush=True)
    time.sleep(1)
    check("attach")
    u = c.compact("kv")
    report("compact", u)
    check("compact")
    time.sleep(1)
    half = c.pool("kv").committed_blocks // 2
    u = c.shrink("kv", half)
    report(f"shrink to {half} blocks", u)
    check("shrink")
    for e in engines:
        e.stdin.write("quit\n")
        e.stdin.flush()
        e.wait(60)
    c.delete("kv", force=True)
    c.close()
    daemon.terminate()
    daemon.wait(60)
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
