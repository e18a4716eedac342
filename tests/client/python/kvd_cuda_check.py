"""GPU check of the Python package kvd (not run by ctest: needs a CUDA kvd and torch).

    kvd --backend=cuda --socket=/tmp/k/gpu0.sock &
    KVD_SOCKET=/tmp/k/gpu0.sock python3 kvd_cuda_check.py

Two processes share a pool through torch tensors built from Mapping.layer() (__cuda_array_interface__):
each writes, the other reads; the peer follows a grow; sleep/wake gives fresh memory at the same
addresses; FDs are closed; close() detaches. Then attach(device=...) by UUID, prefix and index (the
daemon's device: no peer access), refusals of an unknown device and of a process that sees no GPU, a
one-rank kvd.Group grow/sleep/wake, and, where a second GPU is visible, peer access from it (refused
until granted, then it reads rank 0's bytes). Last, pauses: this process and a peer attach pausable
(on_pause synchronises torch) and keep every block's value across a compact of a pool grown in 8 steps
and an exact shrink inside a chunk (the new chunks imported at the PAUSE, mapped at the same addresses
at the RESUME). Exits 0 and prints PASS, or raises.
"""

import os
import subprocess
import sys
import time

import torch

import kvd

DIMS = dict(layers=4, capacity_blocks=4096, heads=8, block_tokens=16, channels=128, element_bytes=2)


def poll(fn, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.01)


def tensors(m):
    return [torch.as_tensor(v, device="cuda") for v in m.layers()]


def block_values(n):
    """What check_pauses writes into block b of layer l (exact in float16): [layers, n]."""
    b = torch.arange(n, device="cuda")
    return torch.stack([((b * 7 + l * 13) % 2000).to(torch.float16) for l in range(DIMS["layers"])])


def wrong_blocks(kv, n):
    """Blocks below n whose every element is not block_values' value."""
    want = block_values(n)
    bad = 0
    for l, t in enumerate(kv):
        v = t[:n].reshape(n, -1)
        bad += int(((v.amax(dim=1) != want[l]) | (v.amin(dim=1) != want[l])).sum())
    return bad


def peer(pool, pausable=True):
    # Pausable unless asked not to be: the check's shrinks and sleeps come from another process, which pauses
    # it first (docs/api.md, "Releases and running engines").
    c = kvd.connect(client_name="peer")
    resumed = []
    if pausable:
        m = c.attach(pool, on_pause=lambda ranges: torch.cuda.synchronize(), on_resume=resumed.append)
    else:
        m = c.attach(pool)
    kv = tensors(m)
    for line in sys.stdin:
        op, *args = line.split()
        if op == "read":
            l, b = int(args[0]), int(args[1])
            print(float(kv[l][b].float().max()), flush=True)
        elif op == "write":
            l, b, v = int(args[0]), int(args[1]), float(args[2])
            kv[l][b] = v
            torch.cuda.synchronize()
            print("ok", flush=True)
        elif op == "wait_blocks":
            n = int(args[0])
            poll(lambda: m.committed_blocks == n and m.state == kvd.v1_pb2.POOL_STATE_AWAKE,
                 f"peer follows (committed {m.committed_blocks}, state {m.state}, chunks {m.mapped_chunks}, "
                 f"events {m.events_seen}, gone {m.gone})")
            print(len(m.mapped_chunks), flush=True)
        elif op == "wait_chunks":  # after a pause: the remap done, then the blocks below n checked
            n, blocks = int(args[0]), int(args[1])
            poll(lambda: len(m.mapped_chunks) == n and m.committed_blocks == blocks and m.resumes == m.pauses,
                 f"peer remaps (chunks {m.mapped_chunks}, committed {m.committed_blocks}, gone {m.gone})")
            print(wrong_blocks(kv, blocks), resumed.count(True), flush=True)
        elif op == "exit":
            del kv
            m.close()
            c.close()
            print("bye", flush=True)
            return


def cuda_devices():
    """The CUDA devices this process sees, [(ordinal, "GPU-..." UUID)], straight from libcuda.so.1: what the
    package's Mappings must agree with."""
    import collections
    import ctypes
    Device = collections.namedtuple("Device", "index uuid")
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0, "cuInit"
    n = ctypes.c_int()
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == 0, "cuDeviceGetCount"
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    out = []
    for i in range(n.value):
        dev, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        assert cu.cuDeviceGet(ctypes.byref(dev), i) == 0 and get_uuid(raw, dev) == 0, f"device {i}"
        h = bytes(raw).hex()
        out.append(Device(i, f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"))
    return out


def expect_error(fn, *codes):
    try:
        fn()
    except kvd.KvdError as e:
        assert e.code in codes, f"expected {codes}, got {e}"
        return e
    raise AssertionError(f"expected a KvdError {codes}")


def check_devices_and_group(c, info):
    """attach(device=...), peer access where a second GPU is visible, and a one-rank kvd.Group on CUDA."""
    visible = cuda_devices()
    own = next(d for d in visible if d.uuid == info.device_uuid)
    pool = f"cuda-group-{os.getpid()}"
    c.create_pool(pool, initial_blocks=64, group=kvd.GroupMembership(pool, 0, 1), override="LBNHC", **DIMS)
    try:
        # Pausable: the Group's sleep below comes from its own sessions (docs/api.md, "Releases and running
        # engines").
        m = c.attach(pool, on_pause=lambda ranges: torch.cuda.synchronize())
        assert (m.cuda_device, m.device_uuid) == (own.index, own.uuid), (m.cuda_device, m.device_uuid)
        kv = tensors(m)
        kv[1][3] = 3.0
        torch.cuda.synchronize()
        for selector in (info.device_uuid, info.device_uuid[4:].upper(), info.device_uuid[:13], own.index):
            with kvd.connect(client_name="by-device") as c2, c2.attach(pool, device=selector) as m2:
                assert m2.cuda_device == own.index and m2.device_uuid == own.uuid, selector
                assert float(tensors(m2)[1][3].float().max()) == 3.0
                assert all(x.device_uuid == "" for x in c.pool(pool).clients), "the daemon's own device is no peer"
        print(f"attach(device=...) by UUID, prefix and index {own.index} maps the daemon's device; no peer access")
        e = expect_error(lambda: kvd.connect(client_name="bad").attach(pool, device="GPU-00000000-dead"), "NOT_FOUND")
        print("unknown device:", e)
        r = subprocess.run([sys.executable, "-c", "import kvd; kvd.connect().attach(%r)" % pool],
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True)
        assert r.returncode != 0 and ("UNAVAILABLE" in r.stderr or "NOT_FOUND" in r.stderr), r.stderr
        print("a process that sees no GPU:", r.stderr.strip().splitlines()[-1])

        with kvd.Group.open(pool, [c.socket]) as g:
            t = time.perf_counter()
            change = g.grow(1024)
            print(f"group grow to 1024 blocks in {(time.perf_counter() - t) * 1e3:.1f} ms "
                  f"(prepare {change.prepare_us} us, commit {change.commit_us} us, {change.prepared_bytes} bytes)")
            poll(lambda: m.committed_blocks == 1024, "the mapping follows the group grow")
            kv[0][1000] = 6.0
            torch.cuda.synchronize()
            assert float(kv[0][1000].float().min()) == 6.0
            g.sleep(wait=True)
            assert m.mapped_chunks == []
            g.wake()
            poll(lambda: m.committed_blocks == 1024 and len(m.mapped_chunks) > 0, "the mapping follows the wake")
            assert float(kv[0][1000].float().max()) == 0.0
        print("kvd.Group grow / sleep / wake on CUDA; the engine's mapping followed")

        others = [d for d in visible if d.uuid != own.uuid]
        if not others:
            print("peer access: skipped (one visible CUDA device)")
            return
        peer_dev = others[0]
        reader = kvd.connect(client_name="peer-reader")
        try:
            e = expect_error(lambda: reader.attach(pool, device=peer_dev.index), "PERMISSION_DENIED",
                             "FAILED_PRECONDITION")
            if e.code == "FAILED_PRECONDITION":
                print(f"peer access: skipped ({e.message})")
                return
            assert peer_dev.uuid in e.message and own.uuid in e.message, e
            c.grant_peer_access(pool, peer_dev.uuid)
            kv[1][5] = 8.0
            torch.cuda.synchronize()
            pm = reader.attach(pool, device=peer_dev.index)
            assert pm.cuda_device == peer_dev.index and pm.device_uuid == peer_dev.uuid
            with torch.cuda.device(peer_dev.index):
                pv = torch.as_tensor(pm.layer(1), device=f"cuda:{peer_dev.index}")
                assert float(pv[5].float().max()) == 8.0
            assert peer_dev.uuid in [x.device_uuid for x in c.pool(pool).clients]
            del pv
            pm.close()
            print(f"peer access: device {peer_dev.index} read rank 0's bytes once granted")
        finally:
            reader.close()
    finally:
        c.delete(pool, force=True)


def check_pauses(c):
    """Compact and an exact shrink on CUDA, with this process and a peer attached pausable."""
    pool = f"cuda-pause-{os.getpid()}"
    c.create_pool(pool, initial_blocks=0, override="LBNHC", **DIMS)
    proc = None
    try:
        resumed = []
        m = c.attach(pool, on_pause=lambda ranges: torch.cuda.synchronize(), on_resume=resumed.append)
        for step in range(1, 9):
            c.grow(pool, step * 256)
        kv = tensors(m)
        n = m.committed_blocks
        want = block_values(n)
        for l, t in enumerate(kv):
            t[:n] = want[l].view(n, 1, 1, 1)
        torch.cuda.synchronize()
        assert wrong_blocks(kv, n) == 0
        chunks = len(c.pool(pool).chunks)
        proc = subprocess.Popen([sys.executable, __file__, "--pause-peer", pool], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

        def ask(line):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            r = proc.stdout.readline().strip()
            assert r, "peer died"
            return r

        assert ask(f"wait_chunks {chunks} {n}") == "0 0", "the peer reads the blocks before any pause"
        t = time.perf_counter()
        u = c.compact(pool)
        r = u.reshape
        print(f"compact {r.chunks_before} -> {r.chunks_after} chunks in {(time.perf_counter() - t) * 1e3:.1f} ms "
              f"(copy {r.copy_us} us of {r.copied_bytes} bytes, pause {r.pause_us} us, {r.paused_clients} clients)")
        assert r.chunks_after == m.geometry.segments and r.paused_clients == 2, r
        assert m.mapped_chunks == sorted(ch.id for ch in u.pool.chunks), "own Mapping remapped on return"
        assert wrong_blocks(kv, n) == 0, "bytes moved under this process's views"
        assert ask(f"wait_chunks {r.chunks_after} {n}") == "0 1", "the peer's bytes after compact"
        target = n // 2 + 40  # inside a chunk
        u = c.shrink(pool, target)
        r = u.reshape
        print(f"exact shrink to {target} blocks: committed {u.pool.committed_blocks}, target_reached "
              f"{r.target_reached}, copy {r.copy_us} us of {r.copied_bytes} bytes, pause {r.pause_us} us")
        assert r.target_reached and r.paused_clients == 2, r
        kept = u.pool.committed_blocks
        assert wrong_blocks(kv, kept) == 0
        assert ask(f"wait_chunks {len(u.pool.chunks)} {kept}") == "0 2", "the peer's bytes after shrink"
        assert resumed == [True, True], resumed
        print("pauses on CUDA: compact and exact shrink kept every block in both processes")
        assert ask("exit") == "bye"
        proc.wait()
        del kv
        m.close()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        c.delete(pool, force=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--peer":
        return peer(sys.argv[2])
    if len(sys.argv) > 2 and sys.argv[1] == "--pause-peer":
        return peer(sys.argv[2], pausable=True)
    c = kvd.connect(client_name="cuda-check")
    info = c.device_info()
    assert info.backend == kvd.v1_pb2.BACKEND_CUDA, info
    print("device", info.device_name, info.device_uuid)
    pool = f"cuda-check-{os.getpid()}"
    p = c.create_pool(pool, initial_blocks=64, backend_requirements={"FLASHINFER": ["block-outermost"]}, **DIMS)
    print("created", p.geometry.layout, p.committed_blocks, "blocks", p.committed_bytes, "bytes")
    try:
        torch.zeros(1, device="cuda")
        c.attach(pool).close()  # CUDA's own files (driver, context) are opened once, by the first attach
        fds0 = len(os.listdir("/proc/self/fd"))
        m = c.attach(pool)
        # One FD per mapped chunk stays open (to hand the chunk back after a daemon restart), no more.
        assert len(os.listdir("/proc/self/fd")) == fds0 + len(m.mapped_chunks), "an FD other than the chunks' open"
        kv = tensors(m)
        print("views", kv[0].shape, kv[0].stride(), kv[0].dtype, hex(kv[0].data_ptr()), "base", hex(m.base))
        assert kv[0].data_ptr() == m.base + m.geometry.offset
        proc = subprocess.Popen([sys.executable, __file__, "--peer", pool], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

        def ask(line):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            r = proc.stdout.readline().strip()
            assert r, "peer died"
            return r

        kv[1][3] = 7.0
        torch.cuda.synchronize()
        assert float(ask("read 1 3")) == 7.0
        ask("write 2 5 9")
        assert float(kv[2][5].float().min()) == 9.0
        print("two processes share the pool through torch")
        t = time.perf_counter()
        c.grow(pool, 2048)
        print(f"grew to 2048 blocks in {(time.perf_counter() - t) * 1e3:.1f} ms; mapped chunks {m.mapped_chunks}")
        assert int(ask("wait_blocks 2048")) == len(m.mapped_chunks)
        ask("write 3 2000 11")
        assert float(kv[3][2000].float().max()) == 11.0
        print("the peer followed the grow; its write to a new block is visible")
        c.sleep(pool, wait=True)
        assert m.mapped_chunks == []
        c.wake(pool)
        assert float(kv[1][3].float().max()) == 0.0
        kv[1][3] = 5.0
        torch.cuda.synchronize()
        ask("wait_blocks 2048")
        assert float(ask("read 1 3")) == 5.0
        print("sleep/wake: fresh memory at the same addresses, both processes see it")
        assert ask("exit") == "bye"
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        del kv
        m.close()
        assert len(c.pool(pool).clients) == 0
        fds1 = len(os.listdir("/proc/self/fd"))
        assert fds1 <= fds0, f"{fds1} FDs open after close, {fds0} before attach"
        print(f"no FD left open ({fds1} now, {fds0} before attach); the pool shows 0 clients after close()")
        check_devices_and_group(c, info)
        check_pauses(c)
    finally:
        c.delete(pool, force=True)
        c.close()
    print("PASS")


if __name__ == "__main__":
    main()
