"""kvd.torch's allocator (client/torch/, in libkvd_c.so) against a real kvd on the host backend.

The library is what torch's CUDAPluggableAllocator calls; here engine processes (torch_alloc_peer.py) call its entry
points through kvd.torch without torch, on host memory, which is what the host backend maps. Checked: an allocation
is one kvd pool with the flat geometry of Note [A flat allocation's geometry], shared with another process; an engine
killed and started again adopts its allocations with their bytes (Note [Re-attaching an allocation]) and a different
size is refused naming the pool; sleep, wake and resize through the allocator's own session; another session's sleep
pauses a pausable engine first and is refused for one that is not; the allocations ride through a SIGKILL of kvd;
errors carry their codes. What needs a GPU and torch (the MemPool, torch.zeros under keep_adopted) is
tests/gpu/engines_torch.py.

Run: KVD_BINARY=<build>/daemon/kvd KVD_LIBRARY=<build>/client/libkvd_c.so \
     PYTHONPATH=<src>/client/python:<src>/tests/testing KVD_PYTHON_GEN_DIR=<build>/python python3 kvd_torch_test.py
"""
import os
import signal
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing"))

import kvd  # noqa: E402
from kvd_daemon import KvdDaemonCase  # noqa: E402
from line_peer import LinePeer  # noqa: E402

MiB = 1 << 20


class Engine:
    """A torch_alloc_peer.py process."""

    def __init__(self, case, name="engine"):
        self.peer = LinePeer([sys.executable, os.path.join(HERE, "torch_alloc_peer.py")], name)
        case.addCleanup(self.close)

    def __call__(self, op, **kw):
        return self.peer(op, **kw)

    def ok(self, op, **kw):
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


class KvdTorchTest(KvdDaemonCase):
    def setUp(self):
        super().setUp()
        self.c = kvd.connect(self.socket)
        self.addCleanup(self.c.close)

    def engine(self, prefix="eng", **kw):
        e = Engine(self)
        e.ok("configure", socket=self.socket, prefix=prefix, **kw)
        return e

    def wait_detached(self, pool):
        deadline = time.monotonic() + 10
        while self.c.pool(pool).client_count:
            self.assertLess(time.monotonic(), deadline, f"{pool} still has clients")
            time.sleep(0.02)

    def test_an_allocation_is_a_flat_shared_pool(self):
        e = self.engine()
        ptr = e.ok("malloc", size=5 * MiB)
        pool = self.c.pool("eng-0")
        d = pool.geometry.dims
        self.assertEqual((d.layers, d.heads, d.block_tokens, d.element_bytes, d.channels, d.capacity_blocks),
                         (1, 1, 1, 1, 2 * MiB, 3))
        self.assertEqual(pool.geometry.segments, 1)
        self.assertEqual(pool.committed_blocks, 3)
        self.assertEqual(pool.state, kvd.v1_pb2.POOL_STATE_AWAKE)
        e.ok("fill", ptr=ptr, value=0x5A, n=5 * MiB)
        with self.c.attach("eng-0") as m:  # another process's view of the same bytes
            import numpy
            flat = numpy.asarray(m.layer(0)).reshape(-1)
            self.assertEqual(set(numpy.unique(flat[:5 * MiB]).tolist()), {0x5A})
        [a] = e.ok("list")
        self.assertEqual((a["pool"], a["base"], a["size"], a["capacity_bytes"], a["committed_bytes"], a["adopted"],
                          a["state"]), ("eng-0", ptr, 5 * MiB, 6 * MiB, 6 * MiB, False, "awake"))
        self.assertFalse(e.ok("adopted", ptr=ptr + 4 * MiB))
        self.assertEqual(e("adopted", ptr=ptr + 6 * MiB)["code"], "NOT_FOUND")
        second = e.ok("malloc", size=1)
        self.assertEqual([x["pool"] for x in e.ok("list")], ["eng-0", "eng-1"])
        self.assertEqual(self.c.pool("eng-1").committed_blocks, 1)
        e.ok("free", ptr=ptr)
        with self.assertRaises(kvd.KvdError) as gone:
            self.c.pool("eng-0")
        self.assertEqual(gone.exception.code, "NOT_FOUND")
        self.assertEqual([x["pool"] for x in e.ok("list")], ["eng-1"])
        e.ok("free", ptr=second)
        self.assertEqual(self.c.pools(), [])

    def test_a_restarted_engine_adopts_its_memory(self):
        first = self.engine()
        a, b = first.ok("malloc", size=4 * MiB), first.ok("malloc", size=6 * MiB)
        first.ok("fill", ptr=a, value=0x11, n=4 * MiB)
        first.ok("fill", ptr=b, value=0x22, n=6 * MiB)
        first.kill()  # no free: the pools stay, as after a crash
        self.wait_detached("eng-0")
        self.wait_detached("eng-1")

        again = self.engine()
        a2, b2 = again.ok("malloc", size=4 * MiB), again.ok("malloc", size=6 * MiB)
        self.assertTrue(again.ok("adopted", ptr=a2))
        self.assertTrue(again.ok("adopted", ptr=b2))
        self.assertEqual(again.ok("read", ptr=a2, n=4 * MiB), [0x11])
        self.assertEqual(again.ok("read", ptr=b2, n=6 * MiB), [0x22])
        fresh = again.ok("malloc", size=4 * MiB)
        self.assertFalse(again.ok("adopted", ptr=fresh))
        self.assertEqual([x["adopted"] for x in again.ok("list")], [True, True, False])

        # A third engine of the same prefix whose first allocation has another size is refused, naming the pool.
        other = self.engine()
        r = other("malloc", size=8 * MiB)
        self.assertEqual(r["code"], "ALREADY_EXISTS")
        self.assertIn("pool eng-0 exists with another geometry", r["message"])
        self.assertIn("kvctl delete eng-0", r["message"])
        self.assertEqual(self.c.pool("eng-0").committed_blocks, 2)  # nothing changed

    def test_a_slept_pool_is_adopted_as_fresh_memory(self):
        first = self.engine(keep=True)
        p = first.ok("malloc", size=4 * MiB)
        first.ok("fill", ptr=p, value=0x44, n=4 * MiB)
        first.ok("sleep", ptr=p)
        first.ok("free", ptr=p)  # keep: the pool stays, asleep
        self.assertEqual(self.c.pool("eng-0").state, kvd.v1_pb2.POOL_STATE_SLEEPING)
        again = self.engine()
        q = again.ok("malloc", size=4 * MiB)
        self.assertFalse(again.ok("adopted", ptr=q))  # its bytes went with the sleep
        self.assertEqual(again.ok("read", ptr=q, n=4 * MiB), [0])
        self.assertEqual(self.c.pool("eng-0").state, kvd.v1_pb2.POOL_STATE_AWAKE)

    def test_sleep_wake_and_resize_through_the_allocator(self):
        e = self.engine(pausable=True)
        p = e.ok("malloc", size=8 * MiB)
        e.ok("fill", ptr=p, value=0x33, n=8 * MiB)
        e.ok("sleep", ptr=p)
        [a] = e.ok("list")
        self.assertEqual((a["state"], a["committed_bytes"]), ("sleeping", 0))
        self.assertEqual(self.c.pool("eng-0").state, kvd.v1_pb2.POOL_STATE_SLEEPING)
        self.assertEqual(self.c.pool("eng-0").pending_release_bytes, 0)  # released when sleep returned
        e.ok("wake")
        self.assertEqual(e.ok("list")[0]["committed_bytes"], 8 * MiB)
        self.assertEqual(e.ok("read", ptr=p, n=8 * MiB), [0])  # woken memory is fresh
        e.ok("fill", ptr=p, value=0x66, n=8 * MiB)
        e.ok("resize", ptr=p + 100, bytes=3 * MiB)  # exact: 2 granules stay, copied into a smaller chunk
        self.assertEqual(self.c.pool("eng-0").committed_blocks, 2)
        self.assertEqual(e.ok("read", ptr=p, n=4 * MiB), [0x66])
        self.assertIn(["pause", "eng-0"], e.ok("pauses"))  # its own Mapping paused for the copy
        e.ok("resize", ptr=p, bytes=8 * MiB)
        self.assertEqual(self.c.pool("eng-0").committed_blocks, 4)
        self.assertEqual(e.ok("read", ptr=p, n=4 * MiB), [0x66])
        r = e("resize", ptr=p, bytes=9 * MiB)
        self.assertEqual(r["code"], "INVALID_ARGUMENT")
        self.assertIn("more than allocation eng-0 holds", r["message"])
        self.assertEqual(e("resize", bytes=1)["code"], "INVALID_ARGUMENT")  # which allocation?
        self.assertEqual(self.c.pool("eng-0").committed_blocks, 4)

    def test_an_exact_resize_needs_pause_hooks(self):
        e = self.engine()
        p = e.ok("malloc", size=8 * MiB)
        r = e("resize", ptr=p, bytes=2 * MiB)
        self.assertEqual(r["code"], "FAILED_PRECONDITION")
        self.assertEqual(self.c.pool("eng-0").committed_blocks, 4)

    def test_another_sessions_sleep_pauses_the_engine_or_is_refused(self):
        plain = self.engine(prefix="plain")
        plain.ok("malloc", size=2 * MiB)
        with self.assertRaises(kvd.KvdError) as refused:
            self.c.sleep("plain-0")
        self.assertEqual(refused.exception.code, "FAILED_PRECONDITION")
        self.assertEqual(self.c.pool("plain-0").state, kvd.v1_pb2.POOL_STATE_AWAKE)

        e = self.engine(pausable=True)
        e.ok("malloc", size=2 * MiB)
        self.c.sleep("eng-0", wait=True)
        self.assertEqual(e.ok("pauses"), [["pause", "eng-0"], ["resume", "eng-0", True]])
        self.assertEqual(e.ok("list")[0]["state"], "sleeping")
        self.c.wake("eng-0")
        deadline = time.monotonic() + 10
        while e.ok("list")[0]["committed_bytes"] != 2 * MiB:
            self.assertLess(time.monotonic(), deadline, "the engine's Mapping did not follow the wake")
            time.sleep(0.02)

    def test_allocations_ride_through_a_kvd_crash(self):
        e = self.engine()
        p = e.ok("malloc", size=4 * MiB)
        e.ok("fill", ptr=p, value=0x77, n=4 * MiB)
        self.kvd.send_signal(signal.SIGKILL)
        self.restart_daemon(0)
        self.c.close()
        self.c = kvd.connect(self.socket)
        deadline = time.monotonic() + 20
        while True:  # the Mapping hands its chunk back and attaches again
            pool = self.c.pool("eng-0")
            if pool.state == kvd.v1_pb2.POOL_STATE_AWAKE and pool.client_count == 1:
                break
            self.assertLess(time.monotonic(), deadline, f"eng-0 not taken back: {pool}")
            time.sleep(0.05)
        self.assertEqual(e.ok("read", ptr=p, n=4 * MiB), [0x77])
        self.assertEqual(e.ok("list")[0]["state"], "awake")
        q = e.ok("malloc", size=2 * MiB)  # the allocator's session is opened again
        self.assertEqual(self.c.pool("eng-1").committed_blocks, 1)
        e.ok("free", ptr=q)

    def test_errors(self):
        e = Engine(self)
        r = e("configure", socket=self.socket, prefix="bad/prefix")
        self.assertEqual(r["code"], "INVALID_ARGUMENT")
        self.assertIn("prefix", r["message"])
        e.ok("configure", socket=os.path.join(self.dir, "nobody.sock"), prefix="eng")
        self.assertEqual(e("malloc", size=MiB)["code"], "UNAVAILABLE")
        e.ok("configure", socket=self.socket, prefix="eng")
        self.assertEqual(e("malloc", size=0)["code"], "INVALID_ARGUMENT")
        p = e.ok("malloc", size=MiB)
        r = e("malloc", size=MiB, device=1)
        self.assertEqual(r["code"], "INVALID_ARGUMENT")
        self.assertIn("serves device 0", r["message"])
        r = e("configure", socket=self.socket, prefix="other")
        self.assertEqual(r["code"], "FAILED_PRECONDITION")
        self.assertIn("1 allocations are live", r["message"])
        self.assertEqual(e("free", ptr=p + 4096)["code"], "NOT_FOUND")  # not an allocation's base
        self.assertEqual(e("sleep", ptr=12345)["code"], "NOT_FOUND")
        e.ok("free", ptr=p)
        self.assertEqual(self.c.pools(), [])


if __name__ == "__main__":
    unittest.main()
