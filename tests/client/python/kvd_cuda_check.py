"""GPU check of the Python package kvd (not run by ctest: needs a CUDA kvd and torch).

    kvd --backend=cuda --socket=/tmp/k/gpu0.sock &
    KVD_SOCKET=/tmp/k/gpu0.sock python3 kvd_cuda_check.py

Two processes share a pool through torch tensors built from Mapping.layer() (__cuda_array_interface__):
each writes, the other reads; the peer follows a grow; sleep/wake gives fresh memory at the same
addresses; FDs are closed; close() detaches. Exits 0 and prints PASS, or raises.
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


def peer(pool):
    c = kvd.connect(client_name="peer")
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
        elif op == "exit":
            del kv
            m.close()
            c.close()
            print("bye", flush=True)
            return


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--peer":
        return peer(sys.argv[2])
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
        assert len(os.listdir("/proc/self/fd")) == fds0, "chunk FDs left open"
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
    finally:
        c.delete(pool, force=True)
        c.close()
    print("PASS")


if __name__ == "__main__":
    main()
