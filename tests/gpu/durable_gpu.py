"""The durable-pools run on a GPU (tests/gpu/run_gpu.sh, step "durable"): kvd on CUDA under a played
service manager (tests/testing/played_manager.py), a pool of POOL_SIZE written by kvd_probe, then a
SIGTERM restart and a SIGKILL restart; after each, a new process finds every sampled byte. Prints the
time from each start to READY=1 (all pools restored) and the device's used memory.

    python3 durable_gpu.py BIN_DIR OUT_DIR POOL_SIZE [--clients N]
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from played_manager import PlayedManager


def used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else -1


def main():
    bin_dir, out_dir, pool_size = sys.argv[1:4]
    directory = tempfile.mkdtemp(prefix="kvd-durable-gpu-")
    os.chmod(directory, 0o750)
    sock = os.path.join(directory, "gpu0.sock")
    log = os.path.join(out_dir, "kvd-durable.log")
    argv = [os.path.join(bin_dir, "kvd"), "--backend=cuda", "--socket=" + sock]
    probe = os.path.join(bin_dir, "kvd_probe")
    manager = PlayedManager(directory)
    failures = 0

    def start(label):
        t0 = time.monotonic()
        manager.start(argv, log)
        ready = time.monotonic() - t0
        restored = re.findall(r"restored .*", open(log).read())
        print(f"{label}: READY=1 after {ready * 1000:.0f} ms; {restored[-1] if restored else ''}; "
              f"FD store {len(manager.stored())} FDs; GPU used {used_mib()} MiB", flush=True)

    def run(*args):
        nonlocal failures
        t0 = time.monotonic()
        p = subprocess.run([probe, "--socket=" + sock, *args], capture_output=True, text=True)
        print(f"  kvd_probe {' '.join(args)}: rc {p.returncode} in {time.monotonic() - t0:.1f} s: "
              f"{(p.stdout + p.stderr).strip().splitlines()[-1:]}", flush=True)
        failures += p.returncode != 0

    print(f"GPU used before: {used_mib()} MiB", flush=True)
    start("first start")
    run("create", "big", "--bytes=" + pool_size)
    run("attach", "big", "--write=7")
    for sig, pattern in ((signal.SIGTERM, 8), (signal.SIGKILL, 9)):
        rc = manager.kill(sig)
        print(f"{signal.Signals(sig).name}: kvd exited {rc}; FD store keeps {len(manager.stored())} FDs; "
              f"GPU used {used_mib()} MiB", flush=True)
        start(f"restart after {signal.Signals(sig).name}")
        run("attach", "big", f"--expect={pattern - 1}", f"--write={pattern}")
    run("attach", "big", "--expect=9")
    # Give the memory back: drain (delete) then stop for good.
    subprocess.run([os.path.join(bin_dir, "kvctl"), "--socket=" + sock, "delete", "big", "--force"])
    manager.kill(signal.SIGTERM)
    manager.close()
    time.sleep(1)
    print(f"GPU used after delete and stop: {used_mib()} MiB", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
