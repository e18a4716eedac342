"""The Python package's side of arbitration (docs/api.md, "Policy, waiting and reclaim") on the real kvd (host
backend) with a "full" device: 512 MiB of its 1 GiB used by "other processes" and 64 MiB of headroom, so that
kvd can back 448 MiB. Engine A (priority 0) fills most of it and writes a pattern into every fifth block; its
on_reclaim hook gives back with shrink_for_reclaim and its live blocks, following the moves in its block
table; engine B (priority 10) grows with wait and is served. A declining hook fails B's wait naming A; a policy
and its errors through set_policy; report_usage and a shrink policy for an engine whose hook declines; a sleep
policy with a host tier: the declining pool sleeps keeping its bytes and wakes with them.

Run: KVD_BINARY=<build>/daemon/kvd PYTHONPATH=<src>/client/python:<src>/tests/testing \
     KVD_PYTHON_GEN_DIR=<build>/python /usr/bin/python3 reclaim_test.py -v
No sleeps as assertions: waits are bounded.
"""
import threading
import unittest

import numpy as np

import kvd
from kvd_daemon import KvdDaemonCase

MiB = 1 << 20
# 2 layers, 8 heads, 16 tokens, 128 channels, fp16: 32 KiB a layer and block, 64 KiB a block.
DIMS = dict(layers=2, capacity_blocks=8192, heads=8, block_tokens=16, channels=128, element_bytes=2)
BLOCKS_PER_MIB = 16


class Engine:
    """A Client with a pausable Mapping of its pool; every fifth block below `live_below` holds a pattern, and a
    block table follows where each lives."""

    def __init__(self, socket, name, blocks, answer="give", live_below=None, **policy):
        self.name, self.answer = name, answer
        self.c = kvd.connect(socket, client_name=name)
        self.c.create_pool(name, **DIMS, **policy)
        self.lock = threading.Condition()
        self.paused = False
        self.reclaims = self.answered = 0
        self.m = self.c.attach(name, on_pause=self._pause, on_resume=self._resume, on_reclaim=self._reclaim)
        for at in range(1024, blocks + 1024, 1024):  # chunks end every 1024 blocks
            self.c.grow(name, min(at, blocks))
        self.where = {b: b for b in range(0, live_below or blocks, 5)}
        for b in self.where:
            for layer in range(DIMS["layers"]):
                self.m.layer(layer, "uint16")[b] = self.pattern(b, layer)

    def pattern(self, block, layer):
        shape = (DIMS["heads"], DIMS["block_tokens"], DIMS["channels"])
        return ((np.arange(np.prod(shape), dtype=np.uint32) * 7 + block * 131 + layer * 17 + hash(self.name))
                & 0xFFFF).astype(np.uint16).reshape(shape)

    def _pause(self, ranges):
        with self.lock:
            self.paused = True

    def _resume(self, applied):
        with self.lock:
            self.paused = False
            self.lock.notify_all()

    def _reclaim(self, request):
        with self.lock:
            self.reclaims += 1
            live = sorted(self.where.values())
        try:
            if self.answer == "decline":
                raise RuntimeError("busy serving")
            update = self.c.shrink_for_reclaim(request, live)
            moved = {m.src: m.dst for m in update.reshape.moved_blocks}
            with self.lock:
                self.where = {first: moved.get(now, now) for first, now in self.where.items()}
        finally:
            with self.lock:
                self.answered += 1
                self.lock.notify_all()

    def check(self):
        """Every live block holds its pattern wherever it lives now: '' when so."""
        with self.lock:
            if not self.lock.wait_for(lambda: not self.paused and self.answered == self.reclaims, timeout=30):
                return "the engine stayed paused or answering"
            for first, now in self.where.items():
                for layer in range(DIMS["layers"]):
                    if not np.array_equal(self.m.layer(layer, "uint16")[now], self.pattern(first, layer)):
                        return f"{self.name}: block {first} (now at {now}), layer {layer} differs"
        return ""

    def close(self):
        self.m.close()
        self.c.close()


class ReclaimTest(KvdDaemonCase):
    def kvd_args(self):
        return ["--host-capacity=1GiB", "--host-used-by-others=512MiB", "--budget=900MiB", "--device-headroom=64MiB",
                "--reclaim-timeout=5s"]

    def engine(self, *args, **kwargs):
        e = Engine(self.socket, *args, **kwargs)
        self.addCleanup(e.close)
        return e

    def test_a_waiting_grow_is_served_by_a_reclaim_the_python_hook_answers(self):
        a = self.engine("a", 384 * BLOCKS_PER_MIB, priority=0)
        b = self.engine("b", 0, priority=10)
        with self.assertRaises(kvd.KvdError) as refused:
            b.c.grow("b", 128 * BLOCKS_PER_MIB)
        self.assertEqual(refused.exception.code, "RESOURCE_EXHAUSTED")
        self.assertIn("the device can back only", refused.exception.message)
        update = b.c.grow("b", 128 * BLOCKS_PER_MIB, wait=True, wait_for=20)
        self.assertEqual(update.pool.committed_blocks, 128 * BLOCKS_PER_MIB)
        self.assertEqual(a.reclaims, 1)
        self.assertEqual(a.check(), "")
        pa = a.c.pool("a")
        self.assertLessEqual(pa.committed_blocks, 320 * BLOCKS_PER_MIB)
        self.assertIn("gave", pa.reclaim.last_outcome)
        self.assertLessEqual(pa.committed_bytes + b.c.pool("b").committed_bytes, 448 * MiB)

    def test_a_hook_that_raises_declines_and_the_policy_applies(self):
        a = self.engine("a", 384 * BLOCKS_PER_MIB, answer="decline", live_below=3072, priority=0)
        b = self.engine("b", 0, priority=10)
        with self.assertRaises(kvd.KvdError) as failed:
            b.c.grow("b", 128 * BLOCKS_PER_MIB, wait=True, wait_for=3)
        self.assertEqual(failed.exception.code, "RESOURCE_EXHAUSTED")
        self.assertIn("pool a (priority 0) was asked for 64.0 MiB: declined (busy serving)", failed.exception.message)
        a.c.set_policy("a", on_reclaim_timeout="shrink")
        a.c.report_usage("a", live_blocks=len(a.where), used_blocks=3072)
        b.c.grow("b", 128 * BLOCKS_PER_MIB, wait=True, wait_for=20)
        self.assertEqual(a.c.pool("a").committed_blocks, 3072)
        self.assertEqual(a.check(), "")

    def test_the_policy_is_set_checked_and_shown(self):
        c = kvd.connect(self.socket, client_name="operator")
        self.addCleanup(c.close)
        p = c.create_pool("kv", **DIMS, priority=3, min_bytes=8 * MiB, reclaim_timeout=1.5,
                          on_reclaim_timeout="shrink")
        self.assertEqual((p.policy.priority, p.policy.min_bytes, p.policy.reclaim_timeout_ms), (3, 8 * MiB, 1500))
        self.assertEqual(p.policy.on_reclaim_timeout, kvd.v1_pb2.RECLAIM_ACTION_SHRINK)
        p = c.set_policy("kv", priority=7, max_bytes=64 * MiB)
        self.assertEqual((p.policy.priority, p.policy.min_bytes, p.policy.max_bytes), (7, 8 * MiB, 64 * MiB))
        for kwargs, field in [(dict(priority=1001), "policy.priority"),
                              (dict(on_reclaim_timeout="sleep"), "policy.on_reclaim_timeout"),
                              (dict(min_bytes=1 << 40), "policy.min_bytes")]:
            with self.assertRaises(kvd.KvdError) as bad:
                c.set_policy("kv", **kwargs)
            self.assertEqual(bad.exception.code, "INVALID_ARGUMENT")
            self.assertIn(field, bad.exception.message)
        with self.assertRaises(kvd.KvdError) as bad:
            c.set_policy("kv", on_reclaim_timeout="later")
        self.assertIn("on_reclaim_timeout", bad.exception.message)
        c.report_usage("kv", live_blocks=0)
        self.assertTrue(c.pool("kv").HasField("usage"))
        self.assertEqual(c.pool("kv").policy.priority, 7)



class ReclaimToHostTest(KvdDaemonCase):
    """on_reclaim_timeout SLEEP with a host tier (docs/api.md): the pool that declines sleeps keeping its contents,
    the waiting grow is served, and the pool wakes later with every live byte where it was."""

    def kvd_args(self):
        return ["--host-capacity=1GiB", "--host-used-by-others=512MiB", "--budget=900MiB", "--device-headroom=64MiB",
                "--reclaim-timeout=5s", "--host-tier-bytes=400MiB"]

    def test_a_declining_pool_sleeps_to_the_host_tier_and_wakes_with_its_bytes(self):
        a = Engine(self.socket, "a", 384 * BLOCKS_PER_MIB, answer="decline", priority=0, on_reclaim_timeout="sleep")
        self.addCleanup(a.close)
        b = Engine(self.socket, "b", 0, priority=10)
        self.addCleanup(b.close)
        b.c.grow("b", 128 * BLOCKS_PER_MIB, wait=True, wait_for=20)
        pa = a.c.pool("a")
        self.assertEqual(pa.state, kvd.v1_pb2.POOL_STATE_SLEEPING)
        self.assertEqual(pa.kept_bytes, 384 * MiB)
        self.assertIn("kept in the host tier", pa.reclaim.last_outcome)
        b.c.delete("b", force=True)
        a.c.wake("a")
        self.assertEqual(a.c.pool("a").committed_blocks, 384 * BLOCKS_PER_MIB)
        self.assertEqual(a.check(), "")

if __name__ == "__main__":
    unittest.main(verbosity=2)
