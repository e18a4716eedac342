"""A real kvd on the host backend for Python tests: started in setUp, stopped in tearDown.

    class MyTest(KvdDaemonCase):
        def kvd_args(self):                      # extra flags, optional
            return ["--metrics-address=127.0.0.1:9500"]

$KVD_BINARY names the daemon (ctest sets it). The daemon gets a fresh 0750 directory holding its
sockets (self.socket, self.dir) and its log (self.log()).
"""
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

KVD = os.environ.get("KVD_BINARY", "kvd")
WAIT_S = 30


class KvdDaemonCase(unittest.TestCase):
    def kvd_args(self):
        return []

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-test-")
        os.chmod(self.dir, 0o750)
        self.socket = os.path.join(self.dir, "gpu0.sock")
        self.log_path = os.path.join(self.dir, "kvd.log")
        with open(self.log_path, "wb") as log:
            self.kvd = subprocess.Popen([KVD, "--backend=host", "--socket=" + self.socket, "--host-capacity=1GiB",
                                         "--budget=512MiB", "--host-granularity=2MiB", *self.kvd_args()],
                                        stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(self._stop)
        deadline = time.monotonic() + WAIT_S
        while " ready: " not in self.log():
            self.assertIsNone(self.kvd.poll(), "kvd exited: " + self.log())
            self.assertLess(time.monotonic(), deadline, "kvd did not become ready: " + self.log())
            time.sleep(0.02)

    def _stop(self):
        self.kvd.send_signal(signal.SIGTERM)
        try:
            self.kvd.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.kvd.kill()
            self.kvd.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()
