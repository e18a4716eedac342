"""client/python/examples/tp_group.py, run as a user would, against two real kvd daemons on the host
backend: devices 0 and 1 of one "node" (sockets gpu0.sock and gpu1.sock in one directory).

Run: KVD_BINARY=<build>/daemon/kvd PYTHONPATH=<src>/client/python KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so \
     /usr/bin/python3 tp_group_example_test.py
The example spawns its rank processes itself; each run is bounded (RUN_S) and no test asserts on
wall-clock time.
"""

import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing"))
from kvd_daemon import KvdDaemonCase  # noqa: E402

import kvd  # noqa: E402

EXAMPLE = os.path.join(HERE, "..", "..", "..", "client", "python", "examples", "tp_group.py")
RUN_S = 180
GROUP = "tp-test"


class TpGroupExampleCase(KvdDaemonCase):
    budget1 = "512MiB"

    def setUp(self):
        super().setUp()
        self.socket1 = self.start_daemon(1, "--budget=" + self.budget1)

    def run_example(self, *args):
        """Runs the example to its end -> (exit status, stdout, stderr)."""
        p = subprocess.run([sys.executable, EXAMPLE, "--socket-dir", self.dir, "--group", GROUP, "--timeout", "30",
                            *args], capture_output=True, text=True, timeout=RUN_S)
        return p.returncode, p.stdout, p.stderr

    def assert_no_pool_left(self):
        for socket in (self.socket, self.socket1):
            with kvd.connect(socket, client_name="check") as c:
                self.assertEqual([p.name for p in c.pools()], [], socket)
                self.assertEqual(c.device_info().committed_bytes, 0, socket)

    def assert_lines(self, out, *parts):
        for part in parts:
            self.assertIn(part, out, f"{part!r} is not in the example's output:\n{out}")


class TpGroupExampleTest(TpGroupExampleCase):
    def test_two_ranks_grow_sleep_and_wake_as_one_group_and_clean_up(self):
        rc, out, err = self.run_example("--ranks", "2")
        self.assertEqual(rc, 0, f"stdout:\n{out}\nstderr:\n{err}")
        self.assertEqual(err.strip(), "")
        target = int(re.search(r"^group grow to (\d+) blocks: prepare ", out, re.M).group(1))
        self.assert_lines(
            out,
            "driver: spawned 2 rank processes",
            f"rank 0: created {GROUP}-r0 (group {GROUP}, rank 0 of 2)",
            f"rank 1: created {GROUP}-r1 (group {GROUP}, rank 1 of 2)",
            "every rank is ready",
            f"opened group {GROUP} in ",
            f"GroupRank(rank=0, socket={self.socket}, ",
            f"GroupRank(rank=1, socket={self.socket1}, ",
            f"rank 0: followed the grow (on_grow x1): {target} blocks",
            f"rank 1: followed the grow (on_grow x1): {target} blocks",
            f"new block {target - 1} reads 10.0",
            f"new block {target - 1} reads 20.0",
            "group sleep (wait=True): ",
            "rank 0: unmapped everything (on_release x1): sleeping, 0 usable blocks",
            "rank 1: unmapped everything (on_release x1): sleeping, 0 usable blocks",
            "group wake: ",
            f"rank 0: woke with the same views (on_grow x2): {target} blocks, block 0 read 0.0 (fresh memory)",
            f"rank 1: woke with the same views (on_grow x2): {target} blocks, block 0 read 0.0 (fresh memory)",
            f"group {GROUP}: 2 ranks, awake, {target} blocks on every rank",
            f"rank 0: deleted {GROUP}-r0",
            f"rank 1: deleted {GROUP}-r1",
            "done: 2 ranks grew, slept and woke as one group\n")
        self.assertNotIn("--demo-failure", out)
        self.assert_no_pool_left()

    def test_a_rank_without_a_daemon_fails_with_one_line_and_the_others_clean_up(self):
        rc, out, err = self.run_example("--ranks", "3")  # no gpu2.sock
        self.assertEqual(rc, 1, f"stdout:\n{out}\nstderr:\n{err}")
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assert_lines(err, "tp_group: rank 2: start: UNAVAILABLE: ", "gpu2")
        self.assert_lines(out, f"rank 0: deleted {GROUP}-r0", f"rank 1: deleted {GROUP}-r1")
        self.assertNotIn("done:", out)
        self.assert_no_pool_left()

    def test_demo_failure_needs_a_rank_that_cannot_fit_the_capacity(self):
        rc, out, err = self.run_example("--ranks", "2", "--demo-failure", "--capacity-blocks", "256")
        self.assertEqual(rc, 1, f"stdout:\n{out}\nstderr:\n{err}")
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assert_lines(err, "tp_group: --demo-failure: every rank fits the whole capacity (256 blocks",
                          "smaller --budget")
        self.assert_no_pool_left()


class TpGroupExampleTightBudgetTest(TpGroupExampleCase):
    budget1 = "128MiB"  # rank 1 holds 128 one-MiB blocks at most: the demo's failing grow asks for 129

    def test_demo_failure_reports_that_no_rank_changed_and_exits_0(self):
        rc, out, err = self.run_example("--ranks", "2", "--demo-failure")
        self.assertEqual(rc, 0, f"stdout:\n{out}\nstderr:\n{err}")
        self.assertEqual(err.strip(), "")
        target = int(re.search(r"^group grow to (\d+) blocks: prepare ", out, re.M).group(1))
        too_big = int(re.search(r"^group grow to (\d+) blocks \(rank 1 fits \d+\), as --demo-failure asks:$", out,
                                re.M).group(1))
        self.assertGreater(too_big, target)
        self.assert_lines(
            out,
            f"failed as expected: RESOURCE_EXHAUSTED: group {GROUP}: grow to {too_big} blocks failed on rank 1 "
            f"({GROUP}-r1 on {self.socket1}): ",
            "budget",
            "; no rank changed (prepared ranks rolled back: 0)",
            "no rank changed: every pool's generation is as before",
            f"rank 0: unchanged: {target} blocks, on_grow not called, marker intact",
            f"rank 1: unchanged: {target} blocks, on_grow not called, marker intact",
            f"group {GROUP}: 2 ranks, awake, {target} blocks on every rank",
            "done: 2 ranks grew, slept and woke as one group and a grow that did not fit changed no rank\n")
        self.assert_no_pool_left()


if __name__ == "__main__":
    unittest.main(verbosity=2)
