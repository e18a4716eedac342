"""kvd_vllm (the vLLM plugin) driven by a played vLLM worker (vllm_played_worker.py) against a real kvd on the host
backend, in the order vLLM makes the calls: the vllm.general_plugins entry point, the KvdConnector's
get_mem_pool_context() before the KV allocation, the KV cache tensors allocated inside it, then /sleep (levels 1 and
2), /wake_up (all tags, and selective), the KV-only release (release_kv_cache_memory -> discard(("kv_cache",))), an
operator's sleep while vLLM runs (refused: vLLM cannot be paused from outside), and a worker killed and started again
(it adopts its KV memory). Also the version gate and the seam checks of register(). What this cannot check is listed
in docs/engines.md ("vLLM: what is not verified").
"""
import os
import signal
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing"))

import kvd  # noqa: E402
from kvd_daemon import KvdDaemonCase  # noqa: E402
from line_peer import LinePeer  # noqa: E402

MiB = 1 << 20
PLAYED = os.path.join(HERE, "..", "..", "testing", "played_vllm")


class Worker:
    def __init__(self, case, socket):
        env = dict(os.environ, KVD_SOCKET=socket, KVD_VLLM_PREFIX="vllm")
        self.peer = LinePeer([sys.executable, os.path.join(HERE, "vllm_played_worker.py")], "vllm worker", env=env)
        case.addCleanup(self.close)

    def __call__(self, op, **kw):
        r = self.peer(op, **kw)
        if "code" in r:
            raise AssertionError(f"{op}: {r['code']}: {r['message']}")
        return r["value"]

    def kill(self):
        self.peer.p.send_signal(signal.SIGKILL)
        self.peer.p.wait()
        self.peer.close()

    def close(self):
        if self.peer.p.poll() is None:
            self.peer.close()


class KvdVllmTest(KvdDaemonCase):
    def setUp(self):
        super().setUp()
        self.c = kvd.connect(self.socket)
        self.addCleanup(self.c.close)

    def states(self):
        return [self.c.pool(f"vllm-r0-{i}").state for i in (0, 1)]

    def test_the_engines_calls_in_order(self):
        w = Worker(self, self.socket)
        self.assertEqual(w("start", sizes=[6 * MiB, 5 * MiB]),
                         ["KvdConnector", "KvdSleepModeBackend", "KvAllocationContext"])
        AWAKE, SLEEPING = kvd.v1_pb2.POOL_STATE_AWAKE, kvd.v1_pb2.POOL_STATE_SLEEPING
        self.assertEqual(self.states(), [AWAKE, AWAKE])
        self.assertEqual([self.c.pool(f"vllm-r0-{i}").committed_blocks for i in (0, 1)], [3, 3])
        w("write", value=0x21)

        self.assertEqual(w("sleep", level=1), "SUSPENDED")  # the KV pools sleep, CuMem offloads the weights
        self.assertEqual(self.states(), [SLEEPING, SLEEPING])
        self.assertEqual(w("committed"), [0, 0])
        self.assertEqual(w("cumem"), [["suspend", 1]])
        self.assertEqual(w("wake_up"), "RUNNING")
        self.assertEqual(self.states(), [AWAKE, AWAKE])
        self.assertEqual(w("read"), [[0], [0]])  # the KV memory comes back zeroed
        self.assertEqual(w("cumem"), [["suspend", 1], ["resume", None]])

        w("write", value=0x31)
        self.assertEqual(w("sleep", level=0), "RUNNING")  # level 0 pauses the scheduler only
        self.assertEqual(w("release_kv_cache_memory"), "SUSPENDED")
        self.assertEqual(self.states(), [SLEEPING, SLEEPING])
        self.assertEqual(len(w("cumem")), 2)  # the weights were not touched
        w("wake_up", tags=["kv_cache"])
        self.assertEqual(self.states(), [AWAKE, AWAKE])
        self.assertEqual(len(w("cumem")), 2)

        w("sleep", level=2)
        w("wake_up", tags=["weights"])  # a selective wake: the KV cache stays asleep
        self.assertEqual(self.states(), [SLEEPING, SLEEPING])
        self.assertEqual(w("cumem")[-1], ["resume", ["weights"]])
        w("wake_up", tags=["kv_cache"])
        self.assertEqual(self.states(), [AWAKE, AWAKE])

        # vLLM cannot be stopped from another thread: an operator's sleep of its KV memory is refused.
        with self.assertRaises(kvd.KvdError) as refused:
            self.c.sleep("vllm-r0-0")
        self.assertEqual(refused.exception.code, "FAILED_PRECONDITION")
        self.assertEqual(self.states(), [AWAKE, AWAKE])

    def test_a_restarted_worker_adopts_its_kv_memory(self):
        w = Worker(self, self.socket)
        w("start", sizes=[4 * MiB, 4 * MiB])
        w("write", value=0x41)
        w.kill()
        deadline = time.monotonic() + 10
        while any(self.c.pool(f"vllm-r0-{i}").client_count for i in (0, 1)):
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.02)
        again = Worker(self, self.socket)
        again("start", sizes=[4 * MiB, 4 * MiB])
        self.assertEqual(again("adopted"), [True, True])
        self.assertEqual(again("read"), [[0x41], [0x41]])

    def register(self, **env):
        code = "import kvd_vllm; kvd_vllm.register(); print('registered')"
        e = dict(os.environ, PYTHONPATH=PLAYED + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60)

    def test_the_version_gate_and_the_seams(self):
        for version in ("0.26.0", "0.28.3rc1.dev2+gabc"):
            r = self.register(PLAYED_VLLM_VERSION=version)
            self.assertEqual((r.returncode, r.stdout.strip()), (0, "registered"), r.stderr)
        for version in ("0.25.2", "0.29.0", "1.0.0"):
            r = self.register(PLAYED_VLLM_VERSION=version)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(f"kvd_vllm supports vLLM 0.26 up to (not including) 0.29; this is vLLM {version}", r.stderr)
            self.assertIn("KVD_VLLM_ALLOW_UNTESTED=1", r.stderr)
        r = self.register(PLAYED_VLLM_VERSION="0.29.0", KVD_VLLM_ALLOW_UNTESTED="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.register(PLAYED_VLLM_NO_MEM_POOL_CONTEXT="1")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("KVConnectorBase_V1.get_mem_pool_context", r.stderr)


if __name__ == "__main__":
    unittest.main()
