"""Engines ride through a restart of kvd: two engine processes, one on libkvd (restart_peer) and one on
the Python package (restart_peer.py), map one pool and keep writing their layers while kvd is stopped
(SIGTERM) or killed (SIGKILL) and started again with its saved state: without a service manager
(--state-dir: DURABILITY_CLIENTS, the clients hand the chunks' FDs back), and under a played one
(tests/testing/played_manager.py: DURABILITY_FD_STORE, the pool comes back whole and nothing is handed
back). Afterwards every byte of every layer reads as written, in both processes; each saw exactly one
restart, with the new epoch and nothing lost; their calls while kvd was away failed with UNAVAILABLE
(within their 5 s deadline, never hanging).

Run: KVD_BINARY=<build>/daemon/kvd RESTART_PEER_BINARY=<build>/tests/restart_peer \
     PYTHONPATH=<src>/client/python KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so python3 restart_test.py
"""
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing"))

import kvd  # noqa: E402
from kvd_daemon import KVD, KvdDaemonCase  # noqa: E402
from played_manager import PlayedManager  # noqa: E402

PEER = os.environ.get("RESTART_PEER_BINARY", "restart_peer")
WAIT_S = 60
# 4 layers x 2 heads x 16 tokens x 64 channels x 2 bytes: 16 KiB a block.
DIMS = dict(layers=4, capacity_blocks=2048, heads=2, block_tokens=16, channels=64, element_bytes=2)
BLOCKS = 512


class Peer:
    """A child engine process speaking restart_peer's line protocol."""

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.name = os.path.basename(argv[-4] if argv[0] == sys.executable else argv[0])

    def line(self):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                text = self.proc.stdout.readline()
                if not text:
                    raise AssertionError(f"{self.name} exited: {self.proc.wait()}")
                if text.startswith("lost "):
                    raise AssertionError(f"{self.name}: {text.strip()}")
                return text.strip()
        raise AssertionError(f"{self.name}: no answer within {WAIT_S} s")

    def ask(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.line()

    def quit(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(WAIT_S)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except BrokenPipeError:
                pass


class RideThrough:
    """The test, whoever plays the service manager: stop(sig) and start() are the subclass's."""

    returned = None  # how many chunks each peer hands back; None: together, every chunk of the pool once

    def start_peers(self):
        with kvd.connect(self.socket) as c:
            self.epoch = c.device_info().epoch
            c.create_pool("kv", **DIMS, initial_blocks=BLOCKS)
        env = dict(os.environ)
        self.peers = [Peer([PEER, self.socket, "kv", "0"]),
                      Peer([sys.executable, os.path.join(HERE, "restart_peer.py"), self.socket, "kv", "1"], env)]
        for p in self.peers:
            self.addCleanup(p.quit)
        for p in self.peers:
            self.assertEqual(p.line(), f"ready {self.epoch}")

    def ride_through(self, sig):
        self.stop(sig)
        for p in self.peers:  # kvd is away: a call fails at once instead of hanging
            self.assertEqual(p.ask("probe"), "probe UNAVAILABLE", p.name)
        self.start()
        returned = 0
        for p in self.peers:
            restarted = p.ask("wait_restart")
            returned += int(restarted.split(" returned=")[1].split()[0])
            self.assertEqual(restarted.split(" returned=")[0],
                             f"restarted epoch={self.epoch + 1} lost=0 lost_bytes=0", p.name)
            if self.returned is not None:
                self.assertIn(f" returned={self.returned} ", restarted, p.name)
        every_byte = DIMS["layers"] * BLOCKS * 2 * 16 * 64 * 2
        for p in self.peers:
            self.assertEqual(p.ask("check"), f"checked {every_byte} bytes, 0 differ", p.name)
            self.assertEqual(p.ask("probe"), "probe OK", p.name)
        for p in self.peers:  # exactly one restart each
            self.assertIn(" restarts=1", p.ask("wait_restart"), p.name)
        with kvd.connect(self.socket) as c:
            self.assertEqual(c.device_info().epoch, self.epoch + 1)
            pool = c.pool("kv")
            if self.returned is None:  # the engines gave every chunk back, each exactly once
                self.assertEqual(returned, len(pool.chunks))
            self.assertEqual(pool.state, kvd.v1_pb2.POOL_STATE_AWAKE)
            self.assertEqual(pool.committed_blocks, BLOCKS)
            self.assertEqual(list(pool.missing_chunk_ids), [])
            self.assertEqual(sorted(cl.name for cl in pool.clients), ["restart-peer", "restart-peer-py"])

    def test_sigterm_and_restart_keep_every_byte(self):
        self.ride_through(signal.SIGTERM)

    def test_sigkill_and_restart_keep_every_byte(self):
        self.ride_through(signal.SIGKILL)


class WithoutServiceManagerTest(RideThrough, KvdDaemonCase):
    """DURABILITY_CLIENTS: the restarted daemon gets the chunks back from the engines."""

    def kvd_args(self):
        return ["--state-dir=${dir}/state"]

    def setUp(self):
        super().setUp()
        self.start_peers()

    def stop(self, sig):
        self.kvd.send_signal(sig)
        self.kvd.wait(WAIT_S)

    def start(self):
        self.restart_daemon(0)


class UnderPlayedSystemdTest(RideThrough, unittest.TestCase):
    """DURABILITY_FD_STORE: the chunks wait in the (played) service manager's FD store, so the pool comes
    back whole and no engine hands anything back."""

    returned = 0

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-test-")
        os.chmod(self.dir, 0o750)
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.socket = os.path.join(self.dir, "gpu0.sock")
        self.log_path = os.path.join(self.dir, "kvd0.log")
        self.manager = PlayedManager(self.dir)
        self.addCleanup(self.manager.close)
        self.start()
        with kvd.connect(self.socket) as c:
            self.assertEqual(c.device_info().durability, kvd.v1_pb2.DURABILITY_FD_STORE)
        self.start_peers()

    def stop(self, sig):
        self.manager.kill(sig)

    def start(self):
        self.manager.start([KVD, "--backend=host", "--device=0", "--socket=" + self.socket, "--host-capacity=1GiB",
                            "--budget=512MiB", "--host-granularity=2MiB", f"--state-dir={self.dir}/state"],
                           self.log_path)


if __name__ == "__main__":
    unittest.main()
