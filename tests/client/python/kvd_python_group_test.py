"""Engine groups (kvd.Group, Client.prepare/commit/abort) and peer access (grant_peer_access,
attach(device=...)) of the Python package against two real kvd daemons on the host backend: devices 0
and 1 of one "node" (sockets gpu0.sock and gpu1.sock in one directory). Mirrors tests/client/group_test.cc.

Run: KVD_BINARY=<build>/daemon/kvd PYTHONPATH=<src>/client/python KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so \
     /usr/bin/python3 kvd_python_group_test.py
Engines are Mappings in this process or engine processes (kvd_python_test.py --peer); the Group is a
separate coordinator (Clients of its own), as kvctl would be. Every wait is a bounded poll for a condition; no test asserts
on wall-clock time.
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing"))
from kvd_daemon import KvdDaemonCase  # noqa: E402
from kvd_python_test import Peer, poll  # noqa: E402

import kvd  # noqa: E402

MiB = 1 << 20

# L=2, H=2, N=16, C=1024, fp16: 64 KiB blocks in each of 2 segments (LBNHC), 32 blocks per 2 MiB chunk.
DIMS = dict(layers=2, capacity_blocks=512, heads=2, block_tokens=16, channels=1024, element_bytes=2)
BLOCK = 64 << 10


class GroupCase(KvdDaemonCase):
    def start_node(self, budget1="512MiB"):
        """The daemon of device 1 beside the case's daemon of device 0; `budget1` limits its commits."""
        self.socket1 = self.start_daemon(1, "--budget=" + budget1)
        self.sockets = [self.socket, self.socket1]

    def connect(self, socket, name):
        c = kvd.connect(socket, client_name=name)
        self.addCleanup(c.close)
        return c

    def make_rank(self, group, rank, size=2, initial=32):
        """Rank `rank` of `group`: an engine Client on daemon `rank` with its pool created and mapped."""
        c = self.connect(self.sockets[rank], f"engine-rank{rank}")
        p = c.create_pool(f"{group}-r{rank}", initial_blocks=initial, override="LBNHC",
                          group=kvd.GroupMembership(group, rank, size), **DIMS)
        self.assertEqual((p.group.name, p.group.rank, p.group.size), (group, rank, size))
        # Pausable: the Group's shrinks and sleeps come from another session (docs/api.md, "Releases and
        # running engines"); the engine touches nothing here, so its hook has nothing to stop.
        m = c.attach(p.name, on_pause=lambda ranges: None)
        self.addCleanup(m.close)
        return c, m

    def engine(self, socket, pool, device=None):
        """An engine process with `pool` attached (from `device`), driven over stdin/stdout."""
        p = Peer(socket, pool, device)
        self.addCleanup(p.close)
        return p

    def open_group(self, name="llama", **kw):
        g = kvd.Group.open(name, **kw)
        self.addCleanup(g.close)
        return g


class GroupTest(GroupCase):
    def setUp(self):
        super().setUp()
        self.start_node()

    def test_grow_sleep_and_wake_move_every_rank_and_every_rank_follows(self):
        c0, m0 = self.make_rank("llama", 0)
        c1 = self.connect(self.socket1, "engine-rank1")
        c1.create_pool("llama-r1", initial_blocks=32, override="LBNHC", group=("llama", 1, 2), **DIMS)
        e1 = self.engine(self.socket1, "llama-r1")  # rank 1's engine is another process

        g = self.open_group(socket_dir=self.dir)
        self.assertEqual([r.rank for r in g.ranks], [0, 1])
        self.assertEqual([r.socket for r in g.ranks], self.sockets)
        self.assertEqual([r.pool.name for r in g.ranks], ["llama-r0", "llama-r1"])
        self.assertEqual([r.device_uuid for r in g.ranks],
                         [c0.device_info().device_uuid, c1.device_info().device_uuid])

        change = g.grow(128)
        self.assertEqual(change.op, "grow")
        self.assertEqual([u.pool.committed_blocks for u in change.ranks], [128, 128])
        self.assertEqual(change.prepared_bytes, 2 * 2 * (128 - 32) * BLOCK)  # 2 ranks x 2 segments
        self.assertEqual([r.pool.committed_blocks for r in g.ranks], [128, 128])
        # Both engines follow the coordinator's grow: the new blocks are backed in their views.
        poll(lambda: m0.committed_blocks == 128 and len(m0.mapped_chunks) == 4, "rank 0 maps the grow")
        poll(lambda: e1("state")["committed"] == 128 and len(e1("state")["chunks"]) == 4, "rank 1 maps the grow")
        m0.layer(1)[100] = 3
        self.assertEqual(float(m0.layer(1)[100].min()), 3.0)
        e1("write", layer=1, block=120, value=5)
        self.assertEqual(e1("read", layer=1, block=120), 5.0)
        self.assertEqual(c1.pool("llama-r1").committed_blocks, 128)

        # Shrink with wait: every engine has unmapped the chunks above 32 blocks and acknowledged.
        change = g.shrink(32, wait=True)
        self.assertEqual([u.pool.committed_blocks for u in change.ranks], [32, 32])
        self.assertEqual([u.pool.pending_release_bytes for u in change.ranks], [0, 0])
        self.assertEqual(len(m0.mapped_chunks), 2)
        self.assertEqual(e1("state")["committed"], 32)
        self.assertEqual(len(e1("state")["chunks"]), 2)

        # Sleep with wait: every engine has unmapped and acknowledged when it returns.
        m0.layer(1)[10] = 3
        e1("write", layer=1, block=20, value=5)
        change = g.sleep(wait=True)
        self.assertEqual([u.pool.state for u in change.ranks], [kvd.v1_pb2.POOL_STATE_SLEEPING] * 2)
        self.assertEqual(m0.mapped_chunks, [])
        self.assertEqual(e1("state")["chunks"], [])
        self.assertEqual([c0.device_info().committed_bytes, c1.device_info().committed_bytes], [0, 0])

        change = g.wake()
        self.assertEqual([u.pool.committed_blocks for u in change.ranks], [32, 32])
        self.assertEqual(change.prepared_bytes, 2 * 2 * 32 * BLOCK)
        poll(lambda: len(m0.mapped_chunks) == 2 and m0.state == kvd.v1_pb2.POOL_STATE_AWAKE, "rank 0 maps the wake")
        poll(lambda: len(e1("state")["chunks"]) == 2, "rank 1 maps the wake")
        self.assertEqual(float(m0.layer(1)[10].max()), 0.0)  # fresh memory at the same addresses
        self.assertEqual(e1("read", layer=1, block=20), 0.0)
        self.assertEqual([r.pool.committed_blocks for r in g.refresh()], [32, 32])
        self.assertEqual([r.pool.state for r in g.ranks], [kvd.v1_pb2.POOL_STATE_AWAKE] * 2)
        self.assertEqual([r.pool.transaction for r in g.ranks], ["", ""])

    def test_a_commit_that_fails_puts_the_committed_ranks_back(self):
        c0, m0 = self.make_rank("llama", 0)
        self.make_rank("llama", 1)
        before = c0.device_info().committed_bytes
        # GPU 1's daemon dies between the phases: rank 0 commits, rank 1 cannot.
        g = self.open_group(sockets=self.sockets, timeout=5.0, before_commit=self.daemons[1].kill)
        with self.assertRaises(kvd.KvdError) as e:
            g.grow(256)
        self.assertEqual(e.exception.code, "ABORTED", e.exception.message)
        self.assertIn("group llama: grow to 256 blocks: commit failed on rank 1 (llama-r1 on " + self.socket1,
                      e.exception.message)
        self.assertIn("put back: 0", e.exception.message)
        after = c0.pool("llama-r0")
        self.assertEqual(after.committed_blocks, 32)
        self.assertEqual(after.transaction, "")
        # The engine's follower mapped the committed chunks and released them again.
        poll(lambda: m0.committed_blocks == 32 and len(m0.mapped_chunks) == 2, "rank 0 back at 32 blocks")
        poll(lambda: c0.device_info().committed_bytes == before, "rank 0's memory given back")

    def test_a_coordinator_that_fails_before_the_commit_aborts_every_rank(self):
        c0, m0 = self.make_rank("llama", 0)
        c1, _ = self.make_rank("llama", 1)

        def fail():
            raise RuntimeError("the coordinator gives up")

        g = self.open_group(sockets=self.sockets, before_commit=fail)
        with self.assertRaisesRegex(RuntimeError, "gives up"):
            g.grow(128)
        for c, name in ((c0, "llama-r0"), (c1, "llama-r1")):
            p = c.pool(name)
            self.assertEqual((p.committed_blocks, p.transaction), (32, ""))
            self.assertEqual(c.device_info().committed_bytes, 2 * 32 * BLOCK)
        self.assertEqual(m0.committed_blocks, 32)

    def test_find_socket_and_connect_by_device_uuid(self):
        c1 = self.connect(self.socket1, "probe")
        uuid1 = c1.device_info().device_uuid
        self.assertEqual(kvd.find_socket(uuid1, socket_dir=self.dir), self.socket1)
        self.assertEqual(kvd.find_socket(uuid1.upper(), socket_dir=self.dir), self.socket1)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.find_socket(uuid1[:-2], socket_dir=self.dir)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("matches several daemons", e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.find_socket("GPU-0000", socket_dir=self.dir)
        self.assertEqual(e.exception.code, "NOT_FOUND")
        self.assertIn(uuid1, e.exception.message)
        os.environ["KVD_SOCKET_DIR"] = self.dir
        self.addCleanup(os.environ.pop, "KVD_SOCKET_DIR")
        with kvd.connect(device=uuid1, client_name="by-uuid") as c:
            self.assertEqual(c.device_info().device_uuid, uuid1)

    def test_open_refuses_a_group_that_is_not_whole(self):
        self.make_rank("llama", 0)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.Group.open("llama", self.sockets)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("group llama: rank 1 of 2 not found on " + self.socket, e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.Group.open("mistral", socket_dir=self.dir)
        self.assertEqual(e.exception.code, "NOT_FOUND")
        self.assertIn("group mistral: no pool of it", e.exception.message)

        c1 = self.connect(self.socket1, "engine-rank1")
        c1.create_pool("llama-twin", group=("llama", 0, 2), **DIMS)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.Group.open("llama", self.sockets)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("rank 0 appears twice: rank 0 (llama-r0 on ", e.exception.message)
        c1.delete("llama-twin")
        c1.create_pool("llama-r1", group=kvd.GroupMembership("llama", 1, 3), **DIMS)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.Group.open("llama", self.sockets)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("says the group has 2 ranks but rank 1 (llama-r1 on " + self.socket1 + ") says 3",
                      e.exception.message)

        with self.assertRaises(kvd.KvdError) as e:
            kvd.Group.open("llama", [os.path.join(self.dir, "gpu7.sock")])
        self.assertEqual(e.exception.code, "UNAVAILABLE")
        self.assertIn("gpu7.sock", e.exception.message)
        # A daemon that does not answer is passed over, and named when the group is then incomplete.
        with self.assertRaises(kvd.KvdError) as e:
            kvd.Group.open("llama", [self.socket, os.path.join(self.dir, "gpu7.sock")])
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("rank 1 of 2 not found on " + self.socket + " (not answering: ", e.exception.message)
        self.assertIn("gpu7.sock", e.exception.message)
        empty = os.path.join(self.dir, "empty")
        os.mkdir(empty)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.Group.open("llama", socket_dir=empty)
        self.assertIn("no kvd socket (*.sock) in " + empty, e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.node_sockets(empty + "-not")
        self.assertEqual(e.exception.code, "NOT_FOUND")
        self.assertIn("socket directory", e.exception.message)
        os.environ["KVD_SOCKET_DIR"] = self.dir
        self.addCleanup(os.environ.pop, "KVD_SOCKET_DIR")
        self.assertEqual(kvd.node_sockets(), self.sockets)

    def test_a_coordinator_that_closes_between_the_phases_leaves_nothing_held(self):
        c0, m0 = self.make_rank("llama", 0)
        before = c0.device_info().committed_bytes
        coordinator = kvd.connect(self.socket, client_name="coordinator")
        try:
            p = coordinator.prepare("llama-r0", "grow", 256, ttl=600)
            self.assertGreater(p.prepared_bytes, 0)
            self.assertEqual(p.pool.committed_blocks, 32)  # nothing visible yet
            self.assertEqual(c0.pool("llama-r0").transaction, p.transaction)
            with self.assertRaises(kvd.KvdError) as e:
                c0.grow("llama-r0", 64)
            self.assertEqual(e.exception.code, "ABORTED")
            self.assertIn(p.transaction, e.exception.message)
            with self.assertRaises(kvd.KvdError) as e:  # another session may neither commit nor abort it
                c0.commit(p.transaction)
            self.assertEqual(e.exception.code, "PERMISSION_DENIED")
        finally:
            coordinator.close()  # its session ends: kvd aborts what it held
        poll(lambda: c0.pool("llama-r0").transaction == "" and c0.device_info().committed_bytes == before,
             "the prepared grow aborted")
        self.assertEqual(m0.committed_blocks, 32)
        c0.grow("llama-r0", 64)
        self.assertEqual(m0.committed_blocks, 64)

    def test_prepare_commit_and_abort_on_one_daemon(self):
        c0, m0 = self.make_rank("llama", 0)
        # Abort gives the prepared memory back; the pool never changed.
        p = c0.prepare("llama-r0", "grow", 96)
        self.assertEqual(c0.abort(p.transaction), p.prepared_bytes)
        self.assertEqual(c0.pool("llama-r0").committed_blocks, 32)
        # The caller's own commit maps its new chunks before it returns, as grow() does.
        seen = m0.events_seen
        p = c0.prepare("llama-r0", kvd.v1_pb2.OPERATION_GROW, 96, ttl=10)
        u = c0.commit(p.transaction)
        self.assertEqual(u.pool.committed_blocks, 96)
        self.assertEqual(m0.committed_blocks, 96)
        self.assertEqual(len(m0.mapped_chunks), 4)
        self.assertEqual(m0.events_seen, seen)
        m0.layer(0)[95] = 1
        u = c0.commit(c0.prepare("llama-r0", "sleep").transaction, wait=True)
        self.assertEqual(u.pool.state, kvd.v1_pb2.POOL_STATE_SLEEPING)
        self.assertEqual(m0.mapped_chunks, [])
        c0.commit(c0.prepare("llama-r0", "wake").transaction)
        self.assertEqual(m0.committed_blocks, 96)
        self.assertEqual(len(m0.mapped_chunks), 2)

    def test_malformed_group_requests_name_their_field(self):
        c = self.connect(self.socket, "bad")
        for kw, field, code in [(dict(group=("llama", 2, 2)), "group.rank", "INVALID_ARGUMENT"),
                                (dict(group=("no/slash", 0, 2)), "group.name", "INVALID_ARGUMENT"),
                                (dict(peer_devices=["GPU-ok", "bad uuid"]), "peer_devices[1]", "INVALID_ARGUMENT")]:
            with self.assertRaises(kvd.KvdError) as e:
                c.create_pool("llama-r0", **kw, **DIMS)
            self.assertEqual(e.exception.code, code)
            self.assertIn(field, e.exception.message)
        p = c.create_pool("llama-r0", group=("llama", 0, 2), peer_devices=["*"], **DIMS)
        self.assertEqual(list(p.peer_devices), ["*"])
        self.assertEqual(c.pool("llama-r0").group.name, "llama")
        for call, field, code in [(lambda: c.prepare("llama-r0", "sleep", 5), "target_blocks", "INVALID_ARGUMENT"),
                                  (lambda: c.prepare("llama-r0", "grow", 64, ttl=3600), "ttl_ms", "INVALID_ARGUMENT"),
                                  (lambda: c.prepare("llama-r0", "explode"), "operation", "INVALID_ARGUMENT"),
                                  (lambda: c.commit(""), "transaction", "INVALID_ARGUMENT"),
                                  (lambda: c.abort("t-unknown"), "transaction", "NOT_FOUND"),
                                  (lambda: c.grant_peer_access("llama-r0", ""), "device_uuid", "INVALID_ARGUMENT")]:
            with self.assertRaises(kvd.KvdError) as e:
                call()
            self.assertEqual(e.exception.code, code, e.exception.message)
            self.assertIn(field, e.exception.message)
        self.assertEqual(c.pool("llama-r0").transaction, "")  # nothing is held

    def test_a_process_on_another_device_maps_a_pool_only_once_granted(self):
        c0, m0 = self.make_rank("tp", 0)
        own = c0.device_info().device_uuid
        peer_uuid = self.connect(self.socket1, "probe").device_info().device_uuid
        self.assertNotEqual(peer_uuid, own)
        reader = self.connect(self.socket, "rank1-reader")
        with self.assertRaises(kvd.KvdError) as e:
            reader.attach("tp-r0", device=1)  # this process maps from device 1 of the same backend
        self.assertEqual(e.exception.code, "PERMISSION_DENIED")
        for part in (peer_uuid, own, "kvctl grant"):
            self.assertIn(part, e.exception.message)
        # Bad selectors are refused before the daemon is asked.
        with self.assertRaises(kvd.KvdError) as e:
            reader.attach("tp-r0", device="GPU-1234")
        self.assertEqual(e.exception.code, "NOT_FOUND")
        self.assertIn("attach: device GPU-1234: no host device has this UUID", e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            reader.attach("tp-r0", device="host-")
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("ambiguous", e.exception.message)

        granted = c0.grant_peer_access("tp-r0", peer_uuid)
        self.assertEqual(list(granted.peer_devices), [peer_uuid])
        # The neighbour process, mapping from device 1 (by UUID), reads what rank 0 wrote, and back.
        e1 = self.engine(self.socket, "tp-r0", device=peer_uuid)
        self.assertEqual(e1("state")["device_uuid"], peer_uuid)
        m0.layer(1)[7] = 0.5
        self.assertEqual(e1("read", layer=1, block=7), 0.5)
        e1("write", layer=1, block=8, value=2)
        self.assertEqual(float(m0.layer(1)[8].min()), 2.0)
        clients = c0.pool("tp-r0").clients
        self.assertIn(peer_uuid, [c.device_uuid for c in clients])
        self.assertIn("", [c.device_uuid for c in clients])  # rank 0 itself maps from the daemon's device

        # An attach from the daemon's own device, named by index or UUID, is no peer access.
        with self.connect(self.socket, "own").attach("tp-r0", device=own) as same:
            self.assertEqual(same.device_uuid, own)
            self.assertEqual(float(same.layer(1)[8].min()), 2.0)

        # A grow reaches the peer mapping too.
        c0.grow("tp-r0", 128)
        poll(lambda: e1("state")["committed"] == 128, "the peer maps the grow")
        m0.layer(0)[127] = 4
        self.assertEqual(e1("read", layer=0, block=127), 4.0)
        revoked = c0.grant_peer_access("tp-r0", peer_uuid, revoke=True)
        self.assertEqual(list(revoked.peer_devices), [])
        self.assertEqual(e1("read", layer=0, block=127), 4.0)  # a mapping that exists stays
        with self.assertRaises(kvd.KvdError) as e:
            self.connect(self.socket, "late").attach("tp-r0", device="1")
        self.assertEqual(e.exception.code, "PERMISSION_DENIED")


class GroupTightBudgetTest(GroupCase):
    def setUp(self):
        super().setUp()
        self.start_node(budget1="16MiB")  # 256 blocks need 32 MiB a rank: GPU 0 prepares them, GPU 1 cannot

    def test_a_rank_that_cannot_grow_leaves_every_rank_as_it_was(self):
        c0, m0 = self.make_rank("llama", 0)
        self.make_rank("llama", 1)
        before = c0.pool("llama-r0")
        device_before = c0.device_info().committed_bytes
        g = self.open_group(sockets=self.sockets)
        with self.assertRaises(kvd.KvdError) as e:
            g.grow(256)
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        for part in ("group llama: grow to 256 blocks failed on rank 1 (llama-r1 on " + self.socket1 + ")",
                     "budget", "no rank changed", "rolled back: 0"):
            self.assertIn(part, e.exception.message)
        after = c0.pool("llama-r0")
        self.assertEqual(after.committed_blocks, before.committed_blocks)
        self.assertEqual(after.generation, before.generation)  # rank 0's clients never saw the memory
        self.assertEqual(after.transaction, "")
        self.assertEqual(c0.device_info().committed_bytes, device_before)
        self.assertEqual(m0.committed_blocks, 32)
        self.assertEqual(len(m0.mapped_chunks), 2)

        # What fits everywhere still works, and both ranks move.
        change = g.grow(96)
        self.assertEqual([u.pool.committed_blocks for u in change.ranks], [96, 96])
        poll(lambda: m0.committed_blocks == 96, "rank 0 maps the grow")


if __name__ == "__main__":
    unittest.main(verbosity=2)
