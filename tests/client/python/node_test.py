"""A node of two GPUs on the host backend: one kvd per "GPU" (devices 0 and 1, sockets gpu0.sock and gpu1.sock in
one directory), as the two-GPU run has them on two H200s (docs/gpu.md), for what needs two daemons and not two
real devices:

- Both daemons restarted (SIGTERM, SIGKILL) under played service managers (tests/testing/played_manager.py: each
  keeps its chunks in its own FD store) while a two-rank group is mid-prepare (a grow prepared on both ranks,
  not committed) and while its engines write: every byte reads as written on both ranks, the prepared grows are
  gone on both (nothing held, no prepared bytes counted, the old transactions are NOT_FOUND), and the group is
  consistent and grows as one afterwards.
- Arbitration is per daemon: a waiting grow on GPU 0 reclaims from GPU 0's idle pool and never asks GPU 1's.
- A group grow that one rank cannot back fails as a group at once (Prepare neither waits nor reclaims): the
  other rank is as it was, and the full rank's idle pool is not asked to give anything back.

Run: KVD_BINARY=<build>/daemon/kvd RESTART_PEER_BINARY=<build>/tests/restart_peer \
     PYTHONPATH=<src>/client/python KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so python3 node_test.py
No wall-clock assertions: every wait is bounded.
"""
import os
import shutil
import signal
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing"))

import kvd  # noqa: E402
from kvd_daemon import KVD, KvdDaemonCase  # noqa: E402
from played_manager import PlayedManager  # noqa: E402
from reclaim_test import BLOCKS_PER_MIB, Engine  # noqa: E402
from restart_test import DIMS, PEER, Peer  # noqa: E402

MiB = 1 << 20
BLOCKS = 512  # of restart_test's 16 KiB blocks: 8 MiB a rank
GROUP = "llama"


class MidPrepareRestartTest(unittest.TestCase):
    """Two daemons under played service managers; rank r of group llama is pool llama-r<r> on GPU r, written by
    two engine processes (libkvd's restart_peer for the even layers, the Python package's for the odd ones)."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-node-")
        os.chmod(self.dir, 0o750)
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.sockets, self.managers = [], []
        for gpu in range(2):
            home = os.path.join(self.dir, f"unit{gpu}")  # each unit's notify socket and saved state
            os.mkdir(home)
            manager = PlayedManager(home)
            self.addCleanup(manager.close)
            self.managers.append(manager)
            self.sockets.append(os.path.join(self.dir, f"gpu{gpu}.sock"))
            self.start(gpu)
        self.epochs = []
        for gpu, socket in enumerate(self.sockets):
            with kvd.connect(socket) as c:
                self.assertEqual(c.device_info().durability, kvd.v1_pb2.DURABILITY_FD_STORE)
                self.epochs.append(c.device_info().epoch)
                c.create_pool(f"{GROUP}-r{gpu}", **DIMS, initial_blocks=BLOCKS,
                              group=kvd.GroupMembership(GROUP, gpu, 2))
        env = dict(os.environ)
        self.peers = []
        for gpu, socket in enumerate(self.sockets):
            pool = f"{GROUP}-r{gpu}"
            self.peers += [Peer([PEER, socket, pool, "0"]),
                           Peer([sys.executable, os.path.join(HERE, "restart_peer.py"), socket, pool, "1"], env)]
        for p in self.peers:
            self.addCleanup(p.quit)
        for i, p in enumerate(self.peers):
            self.assertEqual(p.line(), f"ready {self.epochs[i // 2]}")

    def start(self, gpu):
        home = os.path.join(self.dir, f"unit{gpu}")
        self.managers[gpu].start([KVD, "--backend=host", f"--device={gpu}", "--socket=" + self.sockets[gpu],
                                  "--host-capacity=1GiB", "--budget=512MiB", "--host-granularity=2MiB",
                                  f"--state-dir={home}/state"], os.path.join(self.dir, f"kvd{gpu}.log"))

    def connect(self, gpu, name):
        c = kvd.connect(self.sockets[gpu], client_name=name)
        self.addCleanup(c.close)
        return c

    def restart_mid_prepare(self, sig):
        coordinators = [self.connect(gpu, "coordinator") for gpu in range(2)]
        prepared = [c.prepare(f"{GROUP}-r{gpu}", "grow", target_blocks=2 * BLOCKS, ttl=120)
                    for gpu, c in enumerate(coordinators)]
        for gpu, p in enumerate(prepared):
            self.assertEqual(p.pool.transaction, p.transaction)
            self.assertGreater(p.prepared_bytes, 0)
        for manager in self.managers:  # both daemons go, the grow prepared on both and committed on neither
            manager.kill(sig)
        for p in self.peers:
            self.assertEqual(p.ask("probe"), "probe UNAVAILABLE", p.name)
        for gpu in range(2):
            self.start(gpu)
        for i, p in enumerate(self.peers):
            self.assertEqual(p.ask("wait_restart"), f"restarted epoch={self.epochs[i // 2] + 1} lost=0 lost_bytes=0 "
                             "returned=0 restarts=1", p.name)
        for gpu in range(2):  # the prepared grow is gone on both ranks: as before the prepare
            c = self.connect(gpu, "after")
            pool = c.pool(f"{GROUP}-r{gpu}")
            self.assertEqual(pool.state, kvd.v1_pb2.POOL_STATE_AWAKE)
            self.assertEqual(pool.committed_blocks, BLOCKS)
            self.assertEqual(pool.transaction, "")
            self.assertEqual(c.device_info().committed_bytes, pool.committed_bytes)  # no prepared bytes counted
            # and none kept: the unit's FD store holds the pool's chunks and nothing of the prepared grow
            self.assertEqual([n for n in self.managers[gpu].stored() if n.startswith("c")],
                             sorted(f"c{ch.id}" for ch in pool.chunks))
            with self.assertRaises(kvd.KvdError) as gone:
                c.commit(prepared[gpu].transaction)
            self.assertEqual(gone.exception.code, "NOT_FOUND", gone.exception.message)

        g = kvd.Group.open(GROUP, socket_dir=self.dir)
        self.addCleanup(g.close)
        self.assertEqual([r.pool.committed_blocks for r in g.ranks], [BLOCKS, BLOCKS])
        change = g.grow(2 * BLOCKS)  # the group still moves as one
        self.assertEqual([u.pool.committed_blocks for u in change.ranks], [2 * BLOCKS, 2 * BLOCKS])
        every_byte = DIMS["layers"] * BLOCKS * 2 * 16 * 64 * 2  # what each engine wrote: the blocks before the grow
        for p in self.peers:  # each checks every layer, its own and its neighbour's, once it stopped writing
            self.assertEqual(p.ask("check"), f"checked {every_byte} bytes, 0 differ", p.name)

    def test_sigterm_of_both_daemons_mid_prepare_keeps_every_byte_and_no_prepared_grow(self):
        self.restart_mid_prepare(signal.SIGTERM)

    def test_sigkill_of_both_daemons_mid_prepare_keeps_every_byte_and_no_prepared_grow(self):
        self.restart_mid_prepare(signal.SIGKILL)


class NodeArbitrationTest(KvdDaemonCase):
    """Each "GPU" full as in reclaim_test: 512 MiB of its 1 GiB used by other processes, 64 MiB headroom, so
    each kvd can back 448 MiB."""

    ARGS = ["--host-capacity=1GiB", "--host-used-by-others=512MiB", "--budget=900MiB", "--device-headroom=64MiB",
            "--reclaim-timeout=5s"]

    def kvd_args(self):
        return self.ARGS

    def setUp(self):
        super().setUp()
        self.socket1 = self.start_daemon(1, *self.ARGS)

    def engine(self, socket, *args, **kwargs):
        e = Engine(socket, *args, **kwargs)
        self.addCleanup(e.close)
        return e

    def test_a_reclaim_on_one_gpu_never_asks_the_other_gpus_pools(self):
        a0 = self.engine(self.socket, "a", 384 * BLOCKS_PER_MIB, priority=0)
        a1 = self.engine(self.socket1, "a", 384 * BLOCKS_PER_MIB, priority=0)  # same name, the other GPU
        b = self.engine(self.socket, "b", 0, priority=10)
        b.c.grow("b", 128 * BLOCKS_PER_MIB, wait=True, wait_for=20)
        self.assertEqual(a0.reclaims, 1)
        self.assertEqual(a0.check(), "")
        self.assertEqual(a1.reclaims, 0)
        pool1 = a1.c.pool("a")
        self.assertEqual(pool1.committed_blocks, 384 * BLOCKS_PER_MIB)
        self.assertEqual(pool1.reclaim.last_outcome, "")
        self.assertEqual(a1.check(), "")
        self.assertEqual(a1.c.device_info().waiting_requests, 0)

    def test_a_group_grow_one_rank_cannot_back_fails_as_a_group_without_waiting_or_reclaiming(self):
        ranks = []
        for gpu, socket in enumerate([self.socket, self.socket1]):
            c = kvd.connect(socket, client_name=f"engine-rank{gpu}")
            self.addCleanup(c.close)
            c.create_pool(f"{GROUP}-r{gpu}", **DIMS_GROUP, initial_blocks=64 * BLOCKS_PER_MIB, priority=10,
                          group=kvd.GroupMembership(GROUP, gpu, 2))
            ranks.append(c)
        idle = self.engine(self.socket1, "idle", 320 * BLOCKS_PER_MIB, priority=0)  # GPU 1 now has 64 MiB left
        g = kvd.Group.open(GROUP, socket_dir=self.dir)
        self.addCleanup(g.close)
        with self.assertRaises(kvd.KvdError) as refused:
            g.grow(256 * BLOCKS_PER_MIB)  # fits on GPU 0, not on GPU 1 unless "idle" gave back
        self.assertEqual(refused.exception.code, "RESOURCE_EXHAUSTED", refused.exception.message)
        self.assertIn("rank 1", refused.exception.message)
        for gpu, c in enumerate(ranks):
            pool = c.pool(f"{GROUP}-r{gpu}")
            self.assertEqual((pool.committed_blocks, pool.transaction), (64 * BLOCKS_PER_MIB, ""), gpu)
        self.assertEqual(ranks[0].device_info().committed_bytes, 64 * MiB)  # GPU 0's prepared bytes went back
        self.assertEqual(idle.reclaims, 0)
        self.assertEqual(idle.c.pool("idle").committed_blocks, 320 * BLOCKS_PER_MIB)
        self.assertEqual(idle.check(), "")


DIMS_GROUP = dict(layers=2, capacity_blocks=8192, heads=8, block_tokens=16, channels=128, element_bytes=2)

if __name__ == "__main__":
    unittest.main()
