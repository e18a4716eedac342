"""Issue 14 on the H200 (tests/gpu/run_gpu.sh, step "reshape"): a Llama-70B-like pool grown in steps of 1 GiB
up to POOL_SIZE (one chunk per segment per grow: fragmented), mapped by two torch processes that keep
writing it and pause when kvd asks (on_pause stops the writer and synchronises; on_resume restarts it).
The engines then allocate memory of their own (as weights and activations would) until the pool and they
fill FILL (97.5%) of the GPU, as engines run. Then Compact (to one chunk per segment) and an exact Shrink to
half that ends inside every segment's chunk: at 97% neither fits in one step, so the daemon goes in steps of
what is free (docs/api.md, "Steps bounded by free memory"), and Compact also at most
--compact-chunks-per-pause chunks a pause. Prints each reply's Reshape
(chunks before/after, bytes copied, copy and pause times, pauses and the longest) and, after each change,
how many bytes of the committed blocks differ from what each engine wrote.

    python3 reshape_torch.py BIN_DIR OUT_DIR POOL_SIZE
    python3 reshape_torch.py --engine SOCKET POOL PARITY     (one engine; driven over stdin/stdout)

tests/gpu/release_torch.py uses its pattern, sizing and reporting helpers.
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
FILL = 0.975  # the share of the GPU the pool and the engines' own allocations take: what engines run at
SLICE_BLOCKS = 2048  # blocks of one layer a pattern is made for at once (bounds the engines' scratch)


def expected(xp, l, first, n, shape, **kw):
    """The pattern of blocks [first, first + n) of layer l, as int32 in 1..251: byte k of token t of head h
    of block b is a sum of b, h, t and k, each times its own factor, mod 251, plus 1 (never 0: fresh memory
    never matches). xp is torch (kw: device=...) or numpy; shape is the layer view's (B, H, N, C bytes)."""
    _, heads, tokens, row = shape

    def axis(start, count, mul, dim):
        s = [1, 1, 1, 1]
        s[dim] = count
        return (xp.arange(start, start + count, dtype=xp.int32, **kw) * mul % 251).reshape(s)

    parts = axis(first, n, 29, 0) + axis(0, heads, 17, 1) + axis(0, tokens, 3, 2) + axis(0, row, 1, 3)
    return (parts + (13 * l) % 251) % 251 + 1


def slices(first, end, step=SLICE_BLOCKS):
    """[(start, count)] covering blocks [first, end) in runs of at most `step`."""
    return [(b, min(step, end - b)) for b in range(first, end, step)]


def parse_size(text):
    """'100GiB', '512MiB', '1.5TiB' -> bytes."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    return int(float(text[:-3]) * units[text[-3:]]) if text[-3:] in units else int(text)


def gpu_mib():
    """(used, total) MiB of GPU 0 by nvidia-smi; (0, 0) where it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
        used, total = (int(x) for x in out.split(","))
        return used, total
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0, 0


def ballast_each(engines, fill=FILL):
    """Bytes each of `engines` engines allocates so that the GPU is `fill` used (0 when it is already)."""
    used, total = gpu_mib()
    return max(0, int((fill * total - used) * (1 << 20)) // engines)


def grow_in_steps(c, pool, size, step_bytes, block_bytes):
    """Grows `pool` (created empty) in steps of about `step_bytes` until the next would pass `size`: one new
    chunk per segment per grow (a fragmented pool). -> (blocks, blocks a step, grows)."""
    step = step_bytes // block_bytes + 1
    blocks = grows = 0
    while (blocks + step) * block_bytes <= size:
        blocks += step
        grows += 1
        c.grow(pool, blocks)
    return blocks, step, grows


def chunks_per_pause(c, pool):
    """A compaction step's chunks, so that its new chunks fit beside the old ones in what the device and
    the budget have free (512, the daemon's default, at most)."""
    info, p = c.device_info(), c.pool(pool)
    room = min(info.free_bytes, info.budget_bytes - info.committed_bytes)
    average = p.committed_bytes // max(len(p.chunks), 1)
    return max(1, min(512, int(room * 0.8) // max(average, 1)))


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
    ballast = []

    def rebuild(m):
        blocks = m.committed_blocks
        views = {l: torch.as_tensor(m.layer(l), device="cuda")[:blocks].view(torch.uint8) for l in layers}
        state["views"], state["blocks"] = views, blocks

    def write_all():
        for l, v in state["views"].items():
            for b, n in slices(0, state["blocks"]):
                v[b:b + n].copy_(expected(torch, l, b, n, v.shape, device="cuda").to(torch.uint8))
        torch.cuda.synchronize()

    def differ():
        bad = 0
        for l, v in state["views"].items():
            for b, n in slices(0, state["blocks"]):
                bad += int(torch.count_nonzero(v[b:b + n] != expected(torch, l, b, n, v.shape, device="cuda")))
        return bad

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
            bad = differ()
            print(f"checked {sum(v.numel() for v in views.values())} bytes of {blocks} blocks in "
                  f"{len(m.mapped_chunks)} chunks, {bad} differ; {passes[0]} writer passes; pauses "
                  f"{len(pauses)} (hook {max(pauses) * 1000 if pauses else 0:.1f} ms at most)", flush=True)
            writing.set()
        elif command.startswith("ballast "):  # the engine's own memory (weights, activations), kept to the end
            n = int(command.split()[1])
            ballast.append(torch.empty(n, dtype=torch.uint8, device="cuda") if n else None)
            torch.cuda.synchronize()
            print(f"allocated {n / (1 << 30):.2f} GiB; torch reserves {torch.cuda.memory_reserved() / (1 << 30):.2f} GiB",
                  flush=True)
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
    size = parse_size(pool_size)
    c.create_pool("kv", initial_blocks=0, **DIMS)
    t0 = time.monotonic()
    _, step, grows = grow_in_steps(c, "kv", size, 1 << 30, BLOCK_BYTES)
    pool = c.pool("kv")
    print(f"pool kv: grown in {grows} steps of 1 GiB in {time.monotonic() - t0:.1f} s: "
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
    share = ballast_each(len(engines))
    for line in ask(f"ballast {share}"):
        print("engine:", line, flush=True)
    used, total = gpu_mib()
    print(f"GPU {used} of {total} MiB used ({100 * used / max(total, 1):.1f}%): the pool "
          f"{pool.committed_bytes / (1 << 30):.1f} GiB, the engines' own {2 * share / (1 << 30):.1f} GiB and their "
          f"scratch, the CUDA contexts", flush=True)
    if used < 0.97 * total:
        print(f"!!! the GPU is {100 * used / max(total, 1):.1f}% used, not 97%", flush=True)
        failures += 1
    time.sleep(1)
    check("attach")
    u = c.compact("kv")  # the daemon's --compact-chunks-per-pause, and what is free
    report("compact", u)
    check("compact")
    time.sleep(1)
    committed = c.pool("kv").committed_blocks
    half = committed // 2 + step // 2  # inside every segment's one chunk
    u = c.shrink("kv", half)
    report(f"exact shrink to {half} blocks", u)
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
