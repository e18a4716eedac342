"""A real kvd on the host backend for Python tests: started in setUp, stopped in tearDown.

    class MyTest(KvdDaemonCase):
        def kvd_args(self):                      # extra flags, optional
            return ["--metrics-address=127.0.0.1:9500"]

$KVD_BINARY names the daemon (ctest sets it). The daemon gets a fresh 0750 directory holding its
sockets (self.socket, self.dir) and its log (self.log()). start_daemon(N) adds the daemon of "GPU" N
of the same node (device N of the host backend, socket gpuN.sock in self.dir); self.daemons[N] is its
process (to kill it mid-test), and restart_daemon(N) starts it again once it stopped. "${dir}" in a
flag stands for self.dir.
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


def kvctl(socket, *args):
    """$KVCTL_BINARY --socket=SOCKET ARGS: its stdout; fails the calling test (AssertionError) unless it exits 0."""
    r = subprocess.run([os.environ["KVCTL_BINARY"], f"--socket={socket}", *args], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        raise AssertionError(f"kvctl {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r.stdout


class KvdDaemonCase(unittest.TestCase):
    def kvd_args(self):
        return []

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-test-")
        os.chmod(self.dir, 0o750)
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.socket = self.start_daemon(0, *self.kvd_args())
        self.log_path = os.path.join(self.dir, "kvd0.log")

    def start_daemon(self, device, *args):
        """Starts kvd for device `device` with `args` (which may replace --budget); returns its socket."""
        socket = os.path.join(self.dir, f"gpu{device}.sock")
        defaults = ["--host-capacity=1GiB", "--budget=512MiB", "--host-granularity=2MiB"]
        given = {a.split("=", 1)[0] for a in args}
        argv = [KVD, "--backend=host", f"--device={device}", "--socket=" + socket,
                *[d for d in defaults if d.split("=", 1)[0] not in given],
                *[a.replace("${dir}", self.dir) for a in args]]
        if not hasattr(self, "argvs"):
            self.argvs = {}
        self.argvs[device] = argv
        self._spawn(device)
        return socket

    def restart_daemon(self, device):
        """Waits for the (stopped) daemon of `device` to exit, then starts it again with the same flags."""
        old = self.daemons[device]
        try:
            old.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.fail(f"kvd {device} did not exit within {WAIT_S} s")
        self._spawn(device)

    def _spawn(self, device):
        argv = self.argvs[device]
        log_path = os.path.join(self.dir, f"kvd{device}.log")
        ready_before = self._read(log_path).count(" ready: ") if os.path.exists(log_path) else 0
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(self._stop, proc)
        deadline = time.monotonic() + WAIT_S
        while self._read(log_path).count(" ready: ") <= ready_before:
            self.assertIsNone(proc.poll(), "kvd exited: " + self._read(log_path))
            self.assertLess(time.monotonic(), deadline, "kvd did not become ready: " + self._read(log_path))
            time.sleep(0.02)
        if device == 0:
            self.kvd = proc
        if not hasattr(self, "daemons"):
            self.daemons = {}
        self.daemons[device] = proc

    @staticmethod
    def _stop(proc):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @staticmethod
    def _read(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def log(self):
        return self._read(self.log_path)
