"""Pods without hostIPC (docs/operations.md, "Pods without hostIPC"): a kvd with $NVIDIA_DRA_LOCAL_IPC_DIR set puts its
sockets in that directory, named by its device's UUID with --socket-name=uuid, and clients with the same variable
(libkvd through kvctl, the Python package) find it there by the UUID; by index otherwise. The real host backend, real
sockets; the DRA driver's directory is played by a temporary one."""
import os
import shutil
import subprocess
import tempfile
import time
import unittest

import kvd

KVD = os.environ.get("KVD_BINARY", "kvd")
KVCTL = os.environ.get("KVCTL_BINARY", "kvctl")
DRA = "NVIDIA_DRA_LOCAL_IPC_DIR"


class DraSocketTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-dra-")
        os.chmod(self.dir, 0o750)
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.env = {k: v for k, v in os.environ.items() if k not in ("KVD_SOCKET", "KVD_SOCKET_DIR")}
        self.env[DRA] = self.dir

    def start(self, *flags, where=None):
        p = subprocess.Popen([KVD, "--backend=host", "--budget=64MiB", "--host-capacity=128MiB", *flags],
                             env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(lambda: (p.terminate(), p.wait(30)))
        deadline = time.monotonic() + 30
        while not any(n.endswith(".handles") for n in os.listdir(where or self.dir)):
            self.assertIsNone(p.poll(), p.stdout.read() if p.poll() is not None else "")
            self.assertLess(time.monotonic(), deadline, "kvd did not start")
            time.sleep(0.02)
        return p

    def test_sockets_named_by_uuid_in_the_claims_directory(self):
        self.start("--socket-name=uuid")
        [sock] = [n for n in os.listdir(self.dir) if n.endswith(".sock")]
        uuid = sock[: -len(".sock")]
        self.assertTrue(uuid.startswith("host-"), sock)
        self.assertIn(uuid.replace(".sock", "") + ".handles", os.listdir(self.dir))
        os.environ[DRA] = self.dir
        self.addCleanup(os.environ.pop, DRA)
        saved = {k: os.environ.pop(k) for k in ("KVD_SOCKET", "KVD_SOCKET_DIR") if k in os.environ}
        self.addCleanup(os.environ.update, saved)
        self.assertEqual(kvd.find_socket(uuid), os.path.join(self.dir, sock))
        with kvd.connect(device=uuid) as c:
            self.assertEqual(c.device_info().device_uuid, uuid)
        with self.assertRaises(kvd.KvdError) as by_index:  # gpu0.sock is not there: find the daemon by its UUID
            kvd.connect(timeout=2).close()
        self.assertEqual(by_index.exception.code, "UNAVAILABLE")
        out = subprocess.run([KVCTL, f"--device={uuid}", "status"], env=self.env, capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(os.path.join(self.dir, sock), out.stdout)

    def test_sockets_named_by_index_in_the_claims_directory(self):
        self.start()
        self.assertIn("gpu0.sock", os.listdir(self.dir))
        out = subprocess.run([KVCTL, "status"], env=self.env, capture_output=True, text=True)  # the default socket
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(os.path.join(self.dir, "gpu0.sock"), out.stdout)

    def test_socket_dir_and_the_flags_that_cannot_go_together(self):
        other = os.path.join(self.dir, "other")
        os.mkdir(other, 0o750)
        self.start(f"--socket-dir={other}", where=other)
        self.assertIn("gpu0.sock", os.listdir(other))
        bad = subprocess.run([KVD, "--backend=host", f"--socket={self.dir}/x.sock", "--socket-name=uuid"],
                             env=self.env, capture_output=True, text=True, timeout=30)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("--socket names the socket's path: --socket-dir and --socket-name apply without it",
                      bad.stdout + bad.stderr)
        bad = subprocess.run([KVD, "--backend=host", "--socket-name=serial"], env=self.env, capture_output=True,
                             text=True, timeout=30)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("--socket-name", bad.stdout + bad.stderr)


if __name__ == "__main__":
    unittest.main()
