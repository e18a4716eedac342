"""The wire conventions of C++ (proto/kvd/wire.h) and of the Python package (kvd/_wire.py) agree.

The C++ values come from kvd_wire_dump (tests/client/kvd_wire_dump.cc), which prints wire.h's constants
and its functions applied to a table of inputs; every Python module that uses a convention is checked
to take it from kvd._wire. The last test runs a real kvd on a socket without ".sock" and connects to it
from Python and kvctl, which find its handle channel by the rule.

Run: KVD_WIRE_DUMP=<build>/tests/kvd_wire_dump KVD_BINARY=... KVCTL_BINARY=... \
     PYTHONPATH=<src>/client/python KVD_PYTHON_GEN_DIR=<build>/python /usr/bin/python3 wire_test.py
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
from kvd import _client, _group, _handles, _wire  # noqa: E402
from kvd_daemon import KvdDaemonCase  # noqa: E402

DUMP = os.environ.get("KVD_WIRE_DUMP", "kvd_wire_dump")
KVCTL = os.environ.get("KVCTL_BINARY", "kvctl")
KVD = os.environ.get("KVD_BINARY", "kvd")

DEVICES = [0, 1, 7, 10, 123]
SOCKETS = ["/run/kvd/gpu0.sock", "gpu0.sock", "/tmp/x/ctl", "/tmp/x/ctl.socket", "/tmp/a.sock/b",
           "/tmp/x/.sock", ".sock", "a.sock.sock", "", "/run/kvd/gpu12.sock"]
NAMES = ["gpu0.sock", "gpu0.handles", ".sock", "gpu0.sock.bak", "sock", "x.SOCK"]

# wire.h constant -> the Python name in kvd._wire.
CONSTANTS = {
    "kDefaultSocketDir": "DEFAULT_SOCKET_DIR",
    "kSocketPrefix": "SOCKET_PREFIX",
    "kSocketSuffix": "SOCKET_SUFFIX",
    "kHandlesSuffix": "HANDLES_SUFFIX",
    "kSessionMetadataKey": "SESSION_METADATA_KEY",
    "kSocketEnv": "SOCKET_ENV",
    "kSocketDirEnv": "SOCKET_DIR_ENV",
    "kLayoutEnv": "LAYOUT_ENV",
    "kDraIpcDirEnv": "DRA_IPC_DIR_ENV",
}


def dump(env_overrides=None):
    """kvd_wire_dump over the input table, in an environment without (or with only) the kvd variables."""
    env = {k: v for k, v in os.environ.items() if k not in (_wire.SOCKET_ENV, _wire.SOCKET_DIR_ENV, _wire.DRA_IPC_DIR_ENV)}
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


class WireConventionsTest(unittest.TestCase):
    def test_every_constant_of_wire_h_has_the_same_python_value(self):
        cpp = dump()["constants"]
        self.assertEqual(sorted(cpp), sorted(CONSTANTS), "wire.h and this test's table differ: add the new constant")
        for cpp_name, py_name in CONSTANTS.items():
            with self.subTest(constant=cpp_name):
                self.assertEqual(getattr(_wire, py_name), cpp[cpp_name])

    def test_default_socket_and_handles_path_agree_for_every_input(self):
        cpp = dump()
        for device, path in cpp["default_socket"]:
            with self.subTest(device=device):
                self.assertEqual(_wire.default_socket(int(device)), path)
        self.assertEqual([int(d) for d, _ in cpp["default_socket"]], DEVICES)
        for socket, path in cpp["handles_path_for"]:
            with self.subTest(socket=socket):
                self.assertEqual(_wire.handles_path_for(socket), path)
                self.assertEqual(_handles.handles_path(socket), path)
        self.assertEqual([s for s, _ in cpp["handles_path_for"]], SOCKETS)
        for name, is_socket in cpp["is_socket_name"]:
            with self.subTest(name=name):
                self.assertEqual(_wire.is_socket_name(name), is_socket)

    def test_the_environment_is_read_the_same_way(self):
        cases = [{}, {_wire.SOCKET_ENV: ""}, {_wire.SOCKET_DIR_ENV: ""},
                 {_wire.SOCKET_ENV: "/srv/kvd/ctl.sock", _wire.SOCKET_DIR_ENV: "/srv/kvd"},
                 {_wire.DRA_IPC_DIR_ENV: "/var/run/dra/claim-1"}, {_wire.DRA_IPC_DIR_ENV: ""},
                 {_wire.DRA_IPC_DIR_ENV: "/var/run/dra/claim-1", _wire.SOCKET_DIR_ENV: "/srv/kvd"}]
        for overrides in cases:
            with self.subTest(env=overrides):
                cpp = dump(overrides)
                ours = (_wire.SOCKET_ENV, _wire.SOCKET_DIR_ENV, _wire.DRA_IPC_DIR_ENV)
                clean = {k: v for k, v in os.environ.items() if k not in ours}
                with mock.patch.dict(os.environ, {**clean, **overrides}, clear=True):
                    for device, path in cpp["socket_from_environment"]:
                        self.assertEqual(_wire.socket_from_environment(int(device)), path)
                        self.assertEqual(kvd.default_socket(int(device)), path)
                    self.assertEqual(_wire.socket_dir_from_environment(), cpp["socket_dir_from_environment"])

    def test_the_package_takes_its_conventions_from_wire(self):
        self.assertEqual(_group.DEFAULT_SOCKET_DIR, _wire.DEFAULT_SOCKET_DIR)
        self.assertIs(_client._wire, _wire)
        # No module but _wire spells a convention out (the docstrings may name them).
        here = os.path.dirname(_wire.__file__)
        literals = ['"/run/kvd', '".sock"', '".handles"', '"kvd-session"', '"KVD_SOCKET', '"KVD_KV_CACHE_LAYOUT"']
        for name in sorted(os.listdir(here)):
            if not name.endswith(".py") or name == "_wire.py":
                continue
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
        self.assertEqual(_wire.handles_path_for(control), control + ".handles")
        with kvd.connect(socket=control, client_name="wire-test") as c:
            self.assertEqual(c.device_info().device_index, 0)
        out = subprocess.run([KVCTL, "--socket=" + control, "status"], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(control, out.stdout)


if __name__ == "__main__":
    unittest.main()
