"""The GPU run's engines step, part 1: kvd.torch's MemPool under a torch program on CUDA. An engine allocates its KV
tensor under torch.cuda.use_mem_pool (kvd.torch's allocating()), another process reads its bytes through the pool,
the engine sleeps (the GPU memory goes back) and wakes (zeroed), writes, and is killed; a new engine process allocating
the same size under the same prefix adopts the memory, and its torch.zeros (under keep_adopted) leaves the bytes as
they were. Prints the figures (allocation, sleep, wake, adoption).

    KVD_SOCKET=... python3 engines_torch.py                 (run_gpu.sh's engines step starts the kvd)
"""
import os
import signal
import subprocess
import sys
import time

PREFIX = "engines-torch"
NBYTES = 256 << 20


def engine(phase):
    import torch
    import kvd.torch
    socket = os.environ["KVD_SOCKET"]
    alloc = kvd.torch.KvdAllocator(PREFIX, socket=socket)
    t0 = time.monotonic()
    with alloc.allocating():
        kv = torch.zeros(NBYTES, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    [a] = alloc.allocations()
    print(f"{phase}: torch.zeros({NBYTES >> 20} MiB) under the kvd MemPool in {took * 1e3:.1f} ms: pool {a.pool}, "
          f"adopted {a.adopted}, {a.committed_bytes >> 20} MiB committed", flush=True)
    if phase == "first":
        assert not alloc.adopted(kv) and int(kv.abs().sum()) == 0
        kv.fill_(7)
        torch.cuda.synchronize()
        print("filled 7", flush=True)
        sys.stdin.readline()  # the parent has read the bytes from another process
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.monotonic()
        alloc.sleep()
        t_sleep = time.monotonic() - t0
        freed = torch.cuda.mem_get_info()[0] - free0
        t0 = time.monotonic()
        alloc.wake()
        t_wake = time.monotonic() - t0
        zeros = int(kv.abs().sum()) == 0
        print(f"sleep {t_sleep * 1e3:.1f} ms (freed {freed >> 20} MiB), wake {t_wake * 1e3:.1f} ms; woken memory "
              f"zeroed: {zeros}", flush=True)
        assert freed >= NBYTES and zeros
        kv.fill_(9)
        torch.cuda.synchronize()
        print("filled 9", flush=True)
        time.sleep(600)  # killed here, never freeing
    else:
        assert alloc.adopted(kv), "the second engine did not adopt the first one's allocation"
        values = torch.unique(kv).tolist()
        print(f"adopted: the bytes after torch.zeros under keep_adopted are {values}", flush=True)
        assert values == [9], values


def main():
    import kvd
    here = os.path.abspath(__file__)
    socket = os.environ["KVD_SOCKET"]
    first = subprocess.Popen([sys.executable, here, "--engine", "first"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        print(first.stdout.readline().strip())
        assert first.stdout.readline().strip() == "filled 7"
        import torch
        with kvd.connect(socket) as c, c.attach(PREFIX + "-0") as m:  # another process, the same bytes
            flat = torch.as_tensor(m.layer(0), device=f"cuda:{m.cuda_device}").reshape(-1)[:NBYTES]
            assert torch.unique(flat).tolist() == [7], "another process does not see the engine's bytes"
            print("another process reads the engine's 7s through the pool")
        first.stdin.write("go\n")
        first.stdin.flush()
        print(first.stdout.readline().strip())
        assert first.stdout.readline().strip() == "filled 9"
        first.send_signal(signal.SIGKILL)
        first.wait()
        with kvd.connect(socket) as c:
            deadline = time.monotonic() + 10
            while c.pool(PREFIX + "-0").client_count:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        second = subprocess.run([sys.executable, here, "--engine", "second"], capture_output=True, text=True,
                                timeout=120)
        print(second.stdout.strip(), second.stderr.strip()[-2000:])
        assert second.returncode == 0
        print("PASS engines_torch")
    finally:
        if first.poll() is None:
            first.kill()
        with kvd.connect(socket) as c:
            for p in c.pools():
                if p.name.startswith(PREFIX):
                    c.delete(p.name, force=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--engine":
        engine(sys.argv[2])
    else:
        main()
