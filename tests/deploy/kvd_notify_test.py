#!/usr/bin/env python3
"""kvd's systemd notifications (deploy/systemd/kvd@.service is Type=notify).

Runs the real kvd (host backend) with NOTIFY_SOCKET pointing at a datagram socket this test owns, as
systemd would, and checks that READY=1 (with STATUS= and MAINPID=) arrives only once both sockets
exist, that STOPPING=1 arrives on SIGTERM, and that kvd runs normally without NOTIFY_SOCKET.
$KVD_BINARY names the binary (ctest sets it).
"""
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import unittest

KVD = os.environ.get("KVD_BINARY", "kvd")
WAIT_S = 30


def kvd_args(sock):
    return [KVD, "--backend=host", "--socket=" + sock, "--host-capacity=256MiB", "--budget=128MiB",
            "--host-granularity=2MiB"]


def is_socket(path):
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


class NotifyTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-notify-test-")
        self.sock = os.path.join(self.dir, "gpu0.sock")
        self.handles = os.path.join(self.dir, "gpu0.handles")
        self.log_path = os.path.join(self.dir, "kvd.log")
        self.notify_path = os.path.join(self.dir, "notify")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.proc = None

    def tearDown(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def start(self, env):
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(kvd_args(self.sock), stdout=log, stderr=subprocess.STDOUT, env=env)

    def receive(self, wanted):
        """Datagrams until one has the line `wanted`; returns (that message's fields, when it arrived)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            left = deadline - time.monotonic()
            self.assertGreater(left, 0, "no %s from kvd: %s" % (wanted, self.log()))
            self.notify.settimeout(min(left, 0.5))
            try:
                data = self.notify.recv(4096).decode()
            except socket.timeout:
                self.assertIsNone(self.proc.poll(), "kvd exited: " + self.log())
                continue
            fields = dict(line.split("=", 1) for line in data.split("\n") if "=" in line)
            if wanted in data.split("\n"):
                return fields

    def test_ready_then_stopping(self):
        env = dict(os.environ, NOTIFY_SOCKET=self.notify_path)
        self.start(env)
        ready = self.receive("READY=1")
        # READY means serving: both sockets exist when the message arrives.
        self.assertTrue(is_socket(self.sock), "gRPC socket missing at READY=1")
        self.assertTrue(is_socket(self.handles), "handle channel missing at READY=1")
        self.assertIn(" ready: ", self.log())
        self.assertIn("STATUS", ready)
        self.assertIn(self.sock, ready["STATUS"])
        self.assertEqual(ready.get("MAINPID"), str(self.proc.pid))
        print("READY=1 received, STATUS=%s" % ready["STATUS"])

        self.proc.send_signal(signal.SIGTERM)
        stopping = self.receive("STOPPING=1")
        print("STOPPING=1 received, STATUS=%s" % stopping.get("STATUS"))
        self.assertEqual(self.proc.wait(WAIT_S), 0, self.log())
        self.assertFalse(is_socket(self.sock), "gRPC socket left behind")

    def test_without_notify_socket(self):
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        self.start(env)
        deadline = time.monotonic() + WAIT_S
        while " ready: " not in self.log():
            self.assertIsNone(self.proc.poll(), "kvd exited: " + self.log())
            self.assertLess(time.monotonic(), deadline, "kvd did not become ready: " + self.log())
            time.sleep(0.02)
        self.notify.settimeout(0.3)
        with self.assertRaises(socket.timeout):
            self.notify.recv(4096)
        self.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.proc.wait(WAIT_S), 0, self.log())


if __name__ == "__main__":
    unittest.main(verbosity=2)
