"""The wire conventions (proto/kvd/wire.h) as the Python package applies them: libkvd's, through its C API,
the one copy (no module of the package spells a convention out).

The C++ values come from kvd_wire_dump (tests/client/kvd_wire_dump.cc), which prints wire.h's constants
and its functions applied to a table of inputs; the package must give the same answers for the same inputs
and environments. The last test runs a real kvd on a socket without ".sock" and connects to it from Python
and kvctl, which find its handle channel by the rule.

Run: KVD_WIRE_DUMP=<build>/tests/kvd_wire_dump KVD_BINARY=... KVCTL_BINARY=... \
     KVD_LIBRARY=<build>/client/libkvd_c.so PYTHONPATH=<src>/client/python KVD_PYTHON_GEN_DIR=<build>/python \
     /usr/bin/python3 wire_test.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "testing"))

import kvd  # noqa: E402
from kvd_daemon import KvdDaemonCase  # noqa: E402

DUMP = os.environ.get("KVD_WIRE_DUMP", "kvd_wire_dump")
KVCTL = os.environ.get("KVCTL_BINARY", "kvctl")
KVD = os.environ.get("KVD_BINARY", "kvd")

DEVICES = [0, 1, 7, 10, 123]
SOCKETS = ["/run/kvd/gpu0.sock", "gpu0.sock", "/tmp/x/ctl", "/tmp/x/ctl.socket", "/tmp/a.sock/b",
           "/tmp/x/.sock", ".sock", "a.sock.sock", "", "/run/kvd/gpu12.sock"]
NAMES = ["gpu0.sock", "gpu0.handles", ".sock", "gpu0.sock.bak", "sock", "x.SOCK"]
SOCKET_ENV, SOCKET_DIR_ENV, DRA_IPC_DIR_ENV = "KVD_SOCKET", "KVD_SOCKET_DIR", "NVIDIA_DRA_LOCAL_IPC_DIR"
OURS = (SOCKET_ENV, SOCKET_DIR_ENV, DRA_IPC_DIR_ENV)


def dump(env_overrides=None):
    """kvd_wire_dump over the input table, in an environment without (or with only) the kvd variables."""
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    env.update(env_overrides or {})
    argv = [DUMP]
    for d in DEVICES:
        argv += ["--device", str(d)]
    for s in SOCKETS:
        argv += ["--socket", s]
    for n in NAMES:
        argv += ["--name", n]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"kvd_wire_dump failed: {out.stderr}")
    return json.loads(out.stdout)


def environment(overrides):
    """os.environ (which the library reads too) without the kvd variables, plus `overrides`."""
    clean = {k: v for k, v in os.environ.items() if k not in OURS}
    return mock.patch.dict(os.environ, {**clean, **overrides}, clear=True)


class WireConventionsTest(unittest.TestCase):
    def test_handles_path_agrees_for_every_input(self):
        cpp = dump()
        for socket, path in cpp["handles_path_for"]:
            with self.subTest(socket=socket):
                self.assertEqual(kvd.handles_path(socket), path)
        self.assertEqual([s for s, _ in cpp["handles_path_for"]], SOCKETS)

    def test_node_sockets_take_the_names_wire_h_takes(self):
        cpp = dict(dump()["is_socket_name"])
        directory = tempfile.mkdtemp(prefix="kvd-wire-names-")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        for name in NAMES:
            open(os.path.join(directory, name), "w").close()
        want = sorted(os.path.join(directory, n) for n in NAMES if cpp[n])
        self.assertTrue(want, "the table has socket names")
        self.assertEqual(kvd.node_sockets(directory), want)

    def test_the_environment_is_read_the_same_way(self):
        cases = [{}, {SOCKET_ENV: ""}, {SOCKET_DIR_ENV: ""},
                 {SOCKET_ENV: "/srv/kvd/ctl.sock", SOCKET_DIR_ENV: "/srv/kvd-wire-test-none"},
                 {DRA_IPC_DIR_ENV: "/var/run/dra/claim-wire-test"}, {DRA_IPC_DIR_ENV: ""},
                 {DRA_IPC_DIR_ENV: "/var/run/dra/claim-wire-test", SOCKET_DIR_ENV: "/srv/kvd-wire-test-none"}]
        for overrides in cases:
            with self.subTest(env=overrides):
                cpp = dump(overrides)
                with environment(overrides):
                    for device, path in cpp["socket_from_environment"]:
                        self.assertEqual(kvd.default_socket(int(device)), path)
                    try:
                        found = kvd.node_sockets()
                    except kvd.KvdError as e:  # the directory is not there, or holds no socket
                        self.assertIn(cpp["socket_dir_from_environment"] + ":", e.message + ":")
                    else:
                        self.assertTrue(all(s.startswith(cpp["socket_dir_from_environment"] + "/") for s in found))

    def test_the_package_spells_out_no_convention(self):
        # Every convention is libkvd's (the docstrings may name them).
        here = os.path.dirname(kvd.__file__)
        literals = ['"/run/kvd', '".sock"', '".handles"', '"kvd-session"', '"KVD_SOCKET', '"KVD_KV_CACHE_LAYOUT"']
        modules = sorted(name for name in os.listdir(here) if name.endswith(".py"))
        self.assertIn("_client.py", modules)
        for name in modules:
            with open(os.path.join(here, name), encoding="utf-8") as f:
                text = f.read()
            for literal in literals:
                with self.subTest(module=name, literal=literal):
                    self.assertNotIn(literal, text)


class WireOnARealDaemonTest(unittest.TestCase):
    """kvd, Python and kvctl find the handle channel of a socket not named *.sock by the same rule."""

    def test_a_socket_without_sock_suffix(self):
        directory = tempfile.mkdtemp(prefix="kvd-wire-test-")
        os.chmod(directory, 0o750)
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        control = os.path.join(directory, "control")
        log_path = os.path.join(directory, "kvd.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([KVD, "--backend=host", "--socket=" + control, "--host-capacity=256MiB",
                                     "--budget=128MiB"], stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(KvdDaemonCase._stop, proc)
        deadline = time.monotonic() + 30
        while " ready: " not in KvdDaemonCase._read(log_path):
            self.assertIsNone(proc.poll(), "kvd exited: " + KvdDaemonCase._read(log_path))
            self.assertLess(time.monotonic(), deadline, "kvd did not become ready: " + KvdDaemonCase._read(log_path))
            time.sleep(0.02)

        # The saved state (--state-dir=auto) goes beside the socket too: <socket without .sock>.state.
        self.assertEqual(sorted(os.listdir(directory)), ["control", "control.handles", "control.state", "kvd.log"])
        self.assertEqual(kvd.handles_path(control), control + ".handles")
        with kvd.connect(socket=control, client_name="wire-test") as c:
            self.assertEqual(c.device_info().device_index, 0)
        out = subprocess.run([KVCTL, "--socket=" + control, "status"], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(control, out.stdout)


if __name__ == "__main__":
    unittest.main()
