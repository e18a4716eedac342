"""Issue 12 on the H200 (tests/gpu/run_gpu.sh, step "restart"): a pool of POOL_SIZE mapped by two torch
processes that keep writing it while kvd restarts under a played systemd (tests/testing/played_manager.py)
— once with SIGTERM, once with kill -9. Prints the time from each start to READY=1 (every pool restored),
each engine's restart report, and how many bytes differ at the end (every byte of every committed block is
checked against the pattern its engine wrote).

    python3 restart_torch.py BIN_DIR OUT_DIR POOL_SIZE [KVD_FLAG...]
With --fdstore=no the chunks survive in the engines only, and they hand them back after each restart.
    python3 restart_torch.py --engine SOCKET POOL PARITY     (one engine; driven over stdin/stdout)
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Llama-70B-like: 80 layers, 8 KV heads, 16 tokens a block, 128 channels, bf16 -> 2.5 MiB a block.
DIMS = dict(layers=80, capacity_blocks=49152, heads=8, block_tokens=16, channels=128, element_bytes=2)


def engine(sock, pool, parity):
    import torch

    import kvd

    client = kvd.connect(sock, client_name=f"torch-engine-{parity}", timeout=5.0)
    reports = []
    restarted = threading.Condition()

    def on_restart(r):
        with restarted:
            reports.append(r)
            restarted.notify_all()

    m = client.attach(pool, on_restart=on_restart)
    blocks = m.committed_blocks
    layers = [l for l in range(DIMS["layers"]) if l % 2 == parity]
    # Zero-copy views [blocks, H, N, C*e] of the raw bytes (strided as the layout places them).
    views = {l: torch.as_tensor(m.layer(l), device="cuda")[:blocks].view(torch.uint8) for l in layers}
    _, heads, tokens, row = views[layers[0]].shape

    def axis(n, mul, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return (torch.arange(n, device="cuda", dtype=torch.int16) * mul % 251).reshape(shape)

    parts = axis(blocks, 29, 0) + axis(heads, 17, 1) + axis(tokens, 3, 2) + axis(row, 1, 3)

    def expected(l):  # byte k of token n of head h of block b of layer l
        return ((parts + (13 * l) % 251) % 251 + 1).to(torch.uint8)

    for l in layers:
        views[l].copy_(expected(l))
    torch.cuda.synchronize()
    print(f"ready epoch={m.epoch} blocks={blocks} bytes={sum(v.numel() for v in views.values())}", flush=True)

    writing = threading.Event()
    writing.set()
    passes = [0]

    def writer():  # the engine keeps using its cache while kvd restarts
        while writing.is_set():
            for l in layers:
                views[l].copy_(expected(l))
            torch.cuda.synchronize()
            passes[0] += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    for command in sys.stdin:
        command = command.strip()
        if command.startswith("wait_restart"):
            want = int(command.split()[1])
            with restarted:
                restarted.wait_for(lambda: len(reports) >= want, timeout=120)
            r = reports[-1] if reports else None
            print(f"restart report {len(reports)}: epoch={r.epoch if r else 0} lost={len(r.lost_chunk_ids) if r else -1} "
                  f"returned={len(r.returned_chunk_ids) if r else -1} writer passes so far {passes[0]}", flush=True)
        elif command == "check":
            writing.clear()
            t.join()
            bad = sum(int(torch.count_nonzero(views[l] != expected(l))) for l in layers)
            print(f"checked {sum(v.numel() for v in views.values())} bytes, {bad} differ, "
                  f"{passes[0]} writer passes", flush=True)
        elif command == "quit":
            break
    writing.clear()
    del views
    m.close()
    client.close()


def main():
    from played_manager import PlayedManager

    import kvd

    bin_dir, out_dir, pool_size, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    directory = tempfile.mkdtemp(prefix="kvd-restart-gpu-")
    os.chmod(directory, 0o750)
    sock = os.path.join(directory, "gpu0.sock")
    log = os.path.join(out_dir, "kvd-restart.log")
    manager = PlayedManager(directory)
    argv = [os.path.join(bin_dir, "kvd"), "--backend=cuda", "--socket=" + sock, *flags]

    def start(label):
        t0 = time.monotonic()
        manager.start(argv, log)
        ready = time.monotonic() - t0
        restored = re.findall(r"restored .*", open(log).read())
        print(f"{label}: READY=1 {ready * 1000:.0f} ms after exec; {restored[-1] if restored else ''}", flush=True)

    start("first start")
    c = kvd.connect(sock, client_name="driver")
    block_bytes = DIMS["layers"] * DIMS["heads"] * DIMS["block_tokens"] * DIMS["channels"] * DIMS["element_bytes"]
    units = {"GiB": 1 << 30, "TiB": 1 << 40}
    size = int(float(pool_size[:-3]) * units[pool_size[-3:]])
    c.create_pool("kv", initial_blocks=size // block_bytes, **DIMS)
    pool = c.pool("kv")
    print(f"pool kv: {pool.committed_blocks} blocks, {pool.committed_bytes / (1 << 30):.1f} GiB in "
          f"{len(pool.chunks)} chunks", flush=True)
    c.close()

    env = dict(os.environ)
    engines = [subprocess.Popen([sys.executable, __file__, "--engine", sock, "kv", str(p)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env) for p in (0, 1)]

    def ask(command=None):
        for e in engines:
            if command:
                e.stdin.write(command + "\n")
                e.stdin.flush()
        return [e.stdout.readline().strip() for e in engines]

    for line in ask():
        print("engine:", line, flush=True)
    for n, sig in enumerate((signal.SIGTERM, signal.SIGKILL), start=1):
        time.sleep(2)  # the engines write meanwhile
        t0 = time.monotonic()
        rc = manager.kill(sig)
        print(f"{signal.Signals(sig).name}: kvd exited {rc} after {(time.monotonic() - t0) * 1000:.0f} ms; "
              f"the FD store holds {len(manager.stored())} FDs", flush=True)
        start(f"restart {n} ({signal.Signals(sig).name})")
        for line in ask(f"wait_restart {n}"):
            print("engine:", line, flush=True)
    failures = 0
    for line in ask("check"):
        print("engine:", line, flush=True)
        failures += ", 0 differ" not in line
    for e in engines:
        e.stdin.write("quit\n")
        e.stdin.flush()
        e.wait(60)
    c = kvd.connect(sock, client_name="driver")
    c.delete("kv", force=True)
    c.close()
    manager.kill(signal.SIGTERM)
    manager.close()
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
