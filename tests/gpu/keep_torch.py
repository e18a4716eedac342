"""Issue 24 on the H200 (tests/gpu/run_gpu.sh, step "keep"): a sleep that keeps a pool's contents in kvd's host
tier and the wake that copies them back, every byte checked by two torch engines.

One pool of POOL_SIZE (default 64 GiB; layer-outermost, one chunk per layer) on a kvd with a host tier of that
size. Two engine processes attach it (pausable Mappings of their own sessions); each owns half of the layers
and fills every byte of them with its pattern on the GPU. The driver (a third session) sleeps the pool keeping
its contents: both engines are paused first, then every byte goes to the tier and the device memory is released;
then it wakes the pool: one chunk per segment again, the bytes copied back before the reply. Each engine then
compares every byte of its layers, at the same addresses, on the GPU. Reported: the sleep's and the wake's times
(issue 24: <= 1.4 s each for 64 GiB), the copy rates, the tier's metrics, and the bytes that differ (target 0).

    python3 keep_torch.py BIN_DIR OUT_DIR [POOL_SIZE] [--backend=cuda|host]
--backend=host runs the same on a small host pool with numpy views. Prints "keep: PASS" or "keep: FAIL (...)".
"""
import os
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
for d in (here, os.path.join(here, "..", "testing")):  # the bundle holds both; a checkout has them apart
    if d not in sys.path:
        sys.path.insert(0, d)

from reshape_torch import parse_size  # noqa: E402

LAYERS = 80  # 8 KV heads x 16 tokens x 128 channels x bf16: 32 KiB a block and layer
DIMS = dict(layers=LAYERS, heads=8, block_tokens=16, channels=128, element_bytes=2)
LAYER_BLOCK_BYTES = 8 * 16 * 128 * 2


def pattern(xp, n, layer, torch_device):
    """n int32 words of layer `layer`: every word different, cheap to make on the device."""
    if torch_device:
        i = xp.arange(n, dtype=xp.int64, device=torch_device)
    else:
        i = xp.arange(n, dtype=xp.int64)
    return ((i * 2654435761 + layer * 40503 + 17) & 0x7FFFFFFF).to(xp.int32) if torch_device else \
        ((i * 2654435761 + layer * 40503 + 17) & 0x7FFFFFFF).astype(xp.int32)


def engine(sock, pool, first, last, backend):
    """A child: attaches, fills layers [first, last) with their patterns, then on "check" compares them."""
    import kvd
    if backend == "host":
        import numpy as xp
        device = None
    else:
        import torch as xp
        device = "cuda"
    c = kvd.connect(sock, client_name=f"engine-{first}")
    sync = (lambda: xp.cuda.synchronize()) if device else (lambda: None)
    m = c.attach(pool, client_name=f"engine-{first}", on_pause=lambda ranges: sync())

    def views():
        out = []
        for layer in range(first, last):
            v = m.layer(layer, "int16")
            out.append(xp.as_tensor(v, device=device).view(xp.int32) if device else v.view("int32"))
        return out

    for layer, v in zip(range(first, last), views()):
        flat = v.reshape(-1) if device else v.reshape(-1)
        flat[:] = pattern(xp, flat.shape[0], layer, device)
    sync()
    print("written", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "check":
            break
        # The wake's CHUNKS_ADDED reaches this Mapping after Wake returned to the driver: map them first.
        chunks = int(words[1])
        if not m.wait_for(lambda m: m.state == kvd.v1_pb2.POOL_STATE_AWAKE and len(m.mapped_chunks) == chunks,
                          timeout=60):
            print(f"unmapped: {len(m.mapped_chunks)} of {chunks} chunks mapped 60 s after the wake", flush=True)
            continue
        bad = 0
        for layer, v in zip(range(first, last), views()):
            flat = v.reshape(-1)
            bad += int((flat != pattern(xp, flat.shape[0], layer, device)).sum())
        print(f"checked {bad * 4}", flush=True)
    m.close()
    c.close()


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    backend = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--backend=")), "cuda")
    bin_dir, out_dir = args[0], args[1]
    size = parse_size(args[2]) if len(args) > 2 else (64 << 30 if backend != "host" else 160 << 20)
    directory = tempfile.mkdtemp(prefix="kvd-keep-")
    sock = os.path.join(directory, "gpu0.sock")
    per_layer = size // LAYERS // (2 << 20) * (2 << 20)
    blocks = per_layer // LAYER_BLOCK_BYTES
    tier = per_layer * LAYERS
    argv = [os.path.join(bin_dir, "kvd"), f"--backend={backend}", "--socket=" + sock, "--state-dir=none",
            f"--host-tier-bytes={tier}", "--pause-timeout=30s"]
    if backend == "host":
        argv += ["--host-capacity=1GiB"]
    log = open(os.path.join(out_dir, "kvd-keep.log"), "w")
    daemon = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    engines = []
    try:
        for _ in range(300):
            if os.path.exists(os.path.join(directory, "gpu0.handles")):
                break
            time.sleep(0.1)
        import kvd
        c = kvd.connect(sock, client_name="driver")
        c.create_pool("kv", capacity_blocks=blocks, override="LBHNC", **DIMS)  # each layer one dense run
        c.grow("kv", blocks)
        pool = c.pool("kv")
        print(f"pool: {pool.committed_bytes / 2**30:.2f} GiB in {len(pool.chunks)} chunks; host tier "
              f"{tier / 2**30:.2f} GiB", flush=True)
        env = dict(os.environ)
        for first, last in ((0, LAYERS // 2), (LAYERS // 2, LAYERS)):
            engines.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine", sock, "kv",
                                             str(first), str(last), backend], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, env=env))
        for e in engines:
            line = e.stdout.readline().strip()
            assert line == "written", f"engine: {line!r}"
        deadline = time.monotonic() + 60
        while len(c.pool("kv").clients) < 2:  # both engines attached (their "written" came after the attach)
            assert time.monotonic() < deadline, "the engines did not attach"
            time.sleep(0.01)
        t = time.monotonic()
        while not c.device_info().host_tier_ready:  # allocated and registered in the background after the start
            assert time.monotonic() - t < 120, "the host tier was not ready 120 s after the engines wrote"
            time.sleep(0.05)
        print(f"host tier ready {time.monotonic() - t:.1f} s after the engines wrote", flush=True)
        t = time.monotonic()
        c.sleep("kv", wait=True, keep=True)
        slept = time.monotonic() - t
        pool = c.pool("kv")
        assert pool.state == kvd.v1_pb2.POOL_STATE_SLEEPING and pool.kept_bytes == tier, (pool.state, pool.kept_bytes)
        t = time.monotonic()
        c.wake("kv")
        woke = time.monotonic() - t
        gb = tier / 1e9
        print(f"sleep keeping {tier / 2**30:.2f} GiB: {slept * 1000:.0f} ms ({gb / slept:.1f} GB/s); wake copying them "
              f"back: {woke * 1000:.0f} ms ({gb / woke:.1f} GB/s)", flush=True)
        bad = 0
        chunks = len(c.pool("kv").chunks)
        for e in engines:
            e.stdin.write(f"check {chunks}\n")
            e.stdin.flush()
            line = e.stdout.readline().strip()
            assert line.startswith("checked "), f"engine: {line!r}"
            bad += int(line.split()[1])
        print(f"engines: {bad} bytes differ of {tier} checked", flush=True)
        limit = 1.4 if backend != "host" and size >= 64 << 30 else None  # issue 24's figure is for 64 GiB
        failed = [what for what, ok in (("bytes differ", bad == 0),
                                        ("sleep over 1.4 s", limit is None or slept <= limit),
                                        ("wake over 1.4 s", limit is None or woke <= limit)) if not ok]
        print("keep: PASS" if not failed else f"keep: FAIL ({', '.join(failed)})", flush=True)
        return 0 if not failed else 1
    finally:
        for e in engines:
            if e.poll() is None:
                e.stdin.close()
                e.wait(60)
        daemon.terminate()
        daemon.wait(60)
        log.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        sys.exit(main())
