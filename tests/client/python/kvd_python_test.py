"""The Python package kvd against a real kvd child on the host backend.

Run: KVD_BINARY=<build>/daemon/kvd PYTHONPATH=<src>/client/python KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so \
     /usr/bin/python3 kvd_python_test.py
The second process is this file again (`--peer SOCKET POOL [DEVICE]`), driven line by line over
stdin/stdout; kvd_python_group_test.py drives it too (DEVICE: attach(device=...), peer access).
No sleeps as assertions: waits are bounded polls.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest

import kvd
from line_peer import LinePeer
from scrape import memfd_fds, poll

POLL_S = 20.0

# 4 layers, 8 heads, 16 tokens, 128 channels, fp16: 128 KiB a block, 16 blocks per 2 MiB chunk.
DIMS = dict(layers=4, capacity_blocks=256, heads=8, block_tokens=16, channels=128, element_bytes=2)




def fd_count():
    return len(os.listdir("/proc/self/fd"))


def memfd_maps():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:" in line)


# --- the peer process ----------------------------------------------------------------------------

def peer_main(socket_path, pool, device=None):
    c = kvd.connect(socket_path, client_name="peer")
    # Pausable: the test's shrinks and sleeps come from another session (docs/api.md, "Releases and running
    # engines"); between commands the peer touches nothing, so its hook has nothing to stop.
    m = c.attach(pool, device=device, on_pause=lambda ranges: None)
    out = sys.stdout
    print(json.dumps({"ok": True, "result": "attached"}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "write":
                m.layer(cmd["layer"])[cmd["block"]] = cmd["value"]
                r = True
            elif op == "read":
                r = float(m.layer(cmd["layer"])[cmd["block"]].max())
            elif op == "state":
                r = {"committed": m.committed_blocks, "chunks": m.mapped_chunks, "gone": str(m.gone) if m.gone is not None else None,
                     "state": kvd.v1_pb2.PoolState.Name(m.state), "device_uuid": m.device_uuid}
            elif op == "exit":
                m.close()
                c.close()
                print(json.dumps({"ok": True}), file=out, flush=True)
                return 0
            else:
                r = None
            print(json.dumps({"ok": True, "result": r}), file=out, flush=True)
        except Exception as e:  # reported to the test, which fails on it
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), file=out, flush=True)
    return 0


class Peer(LinePeer):
    def __init__(self, socket_path, pool, device=None):
        extra = [str(device)] if device is not None else []
        super().__init__([sys.executable, os.path.abspath(__file__), "--peer", socket_path, pool, *extra], "peer",
                         env=dict(os.environ))
        self._reply()  # "attached": the peer has mapped the pool and follows it

    def close(self):
        super().close(timeout=POLL_S)


class Daemon:
    def __init__(self, *flags):
        binary = os.environ.get("KVD_BINARY")
        if not binary:
            raise unittest.SkipTest("KVD_BINARY is not set")
        self.dir = tempfile.mkdtemp(prefix="kvdpy-")
        os.chmod(self.dir, 0o750)
        self.socket = os.path.join(self.dir, "gpu0.sock")
        self.log_path = os.path.join(self.dir, "kvd.log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen([binary, "--backend=host", f"--socket={self.socket}", "--host-capacity=1GiB",
                                   "--budget=512MiB", "--host-granularity=2MiB", *flags], stdout=self.log,
                                  stderr=subprocess.STDOUT)
        poll(lambda: " ready: " in self.read_log() or self.p.poll() is not None, "kvd ready")
        if self.p.poll() is not None:
            raise AssertionError("kvd exited: " + self.read_log())

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class KvdPythonTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.c = kvd.connect(self.daemon.socket, client_name="test")
        self.addCleanup(self.c.close)

    def create(self, name, initial=16):
        p = self.c.create_pool(name, initial_blocks=initial, backend_requirements={"FLASHINFER": ["block-outermost"]},
                               connector_preferences=[("nixl", "BLNHC")], **DIMS)
        self.addCleanup(self._delete, name)
        return p

    def _delete(self, name):
        try:
            self.c.delete(name, force=True)
        except kvd.KvdError:
            pass

    def peer(self, pool):
        p = Peer(self.daemon.socket, pool)
        self.addCleanup(p.close)
        return p

    def test_device_info_and_layout(self):
        info = self.c.device_info()
        self.assertEqual(info.backend, kvd.v1_pb2.BACKEND_HOST)
        self.assertEqual(info.budget_bytes, 512 << 20)
        p = self.create("layout")
        self.assertEqual(p.geometry.layout, "BLNHC")  # the connector's wish, inside FLASHINFER's class
        self.assertEqual(p.layout.rule, kvd.v1_pb2.LAYOUT_RULE_CONNECTOR_PREFERENCE)
        r = self.c.resolve_layout(backend_requirements={"FLASHINFER": ["block-outermost"]},
                                  connector_preferences=[("nixl", "BLNHC")], dims=DIMS)
        self.assertEqual(r.resolution.layout, "BLNHC")
        self.assertEqual(r.geometry.reserved_bytes, p.geometry.reserved_bytes)
        self.assertIn("layout", [x.name for x in self.c.pools()])

    def test_pools_follows_every_page(self):
        # ListPools answers 100 pools a page by default; pools() returns them all, by name.
        names = [f"page{i:03d}" for i in range(105)]
        for n in names:
            self.c.create_pool(n, initial_blocks=0, **DIMS)
            self.addCleanup(self._delete, n)
        first = self.c._call("ListPools", kvd.v1_pb2.ListPoolsRequest())
        self.assertEqual(len(first.pools), 100)
        self.assertTrue(first.next_page_token)
        listed = [p.name for p in self.c.pools() if p.name.startswith("page")]
        self.assertEqual(listed, names)

    def test_describe_transfer(self):
        p = self.create("xfer")
        t = self.c.describe_transfer("xfer")
        self.assertEqual(t.blocks, p.committed_blocks)
        self.assertEqual(len(t.descriptors), 1)  # BLNHC: one segment, one run
        t = self.c.describe_transfer("xfer", [0, 2, 4, 6])
        self.assertEqual(len(t.descriptors), 1)
        d = t.descriptors[0]
        self.assertEqual((d.offset, d.bytes, d.stride, d.count),
                         (0, p.geometry.block_stride, 2 * p.geometry.block_stride, 4))
        with self.assertRaises(kvd.KvdError) as e:
            self.c.describe_transfer("xfer", [1, 1])
        self.assertIn("block_ids[1]", str(e.exception))

    def test_export_ranges(self):
        import ctypes
        import mmap
        self.create("ranges", initial=200)
        with self.c.attach("ranges") as m:
            resp, fds = self.c.export_ranges(m.client_id)
            try:
                self.assertEqual(resp.handle_type, kvd.v1_pb2.HANDLE_TYPE_DMA_BUF)
                self.assertEqual(len(fds), len(resp.handles))
                h = resp.handles[0]
                pattern = bytes(range(256)) * 16
                ctypes.memmove(m.base + h.offset + 8192, pattern, len(pattern))
                with mmap.mmap(fds[0], h.bytes, prot=mmap.PROT_READ, offset=h.fd_offset) as view:
                    self.assertEqual(view[8192:8192 + len(pattern)], pattern)
            finally:
                for fd in fds:
                    os.close(fd)
            with self.assertRaises(kvd.KvdError) as e:
                self.c.export_ranges(m.client_id, [(4096, 4096)])
            self.assertIn("ranges[0]", str(e.exception))

    def test_two_processes_share_grow_sleep_wake(self):
        self.create("shared")
        with self.c.attach("shared") as m:
            self.assertEqual(m.committed_blocks, 16)
            self.assertEqual(len(m.mapped_chunks), 1)
            peer = self.peer("shared")
            self.assertEqual(peer("state")["committed"], 16)
            # Each writes, the other reads.
            m.layer(1)[3] = 7
            self.assertEqual(peer("read", layer=1, block=3), 7.0)
            peer("write", layer=2, block=5, value=9)
            self.assertEqual(float(m.layer(2)[5].max()), 9.0)
            self.assertEqual(float(m.layer(2)[5].min()), 9.0)

            # Grow through this process: mapped before grow() returns; the peer's follower maps it.
            u = self.c.grow("shared", 48)
            self.assertEqual(m.events_seen, 0)  # our own grow was mapped from the reply, not an event
            self.assertEqual(m.committed_blocks, 48)
            self.assertEqual(len(m.mapped_chunks), 2)
            self.assertEqual(len(u.added), 1)
            poll(lambda: len(peer("state")["chunks"]) == 2 and peer("state")["committed"] == 48, "peer maps the grow")
            peer("write", layer=3, block=40, value=11)
            self.assertEqual(float(m.layer(3)[40].max()), 11.0)
            m.layer(0)[47] = 4
            self.assertEqual(peer("read", layer=0, block=47), 4.0)

            # Shrink with wait: both followers unmap and acknowledge before the reply.
            u = self.c.shrink("shared", 16, wait=True)
            self.assertEqual(u.pool.pending_release_bytes, 0)
            self.assertNotEqual(u.release_id, 0)
            self.assertEqual(len(m.mapped_chunks), 1)
            self.assertEqual(len(peer("state")["chunks"]), 1)
            self.assertEqual(peer("read", layer=1, block=3), 7.0)  # the kept prefix keeps its bytes

            # Sleep (wait: every client acknowledged) and wake on fresh, zeroed memory.
            [s] = self.c.sleep("shared", wait=True)
            self.assertEqual(s.pool.pending_release_bytes, 0)
            self.assertEqual(m.mapped_chunks, [])
            self.assertEqual(peer("state")["chunks"], [])
            [w] = self.c.wake()
            self.assertEqual(w.pool.committed_blocks, 16)
            self.assertEqual(len(m.mapped_chunks), 1)
            self.assertEqual(float(m.layer(1)[3].max()), 0.0)
            poll(lambda: len(peer("state")["chunks"]) == 1, "peer maps the wake")
            peer("write", layer=1, block=3, value=5)
            self.assertEqual(float(m.layer(1)[3].max()), 5.0)
            m.layer(2)[6] = 2
            self.assertEqual(peer("read", layer=2, block=6), 2.0)

            # Growth made by the OTHER process reaches this one through Watch.
            peer.close()
            poll(lambda: len(self.c.pool("shared").clients) == 1, "the peer detached")

    def test_grow_by_another_session(self):
        self.create("other")
        seen = []
        def on_release(committed_blocks):
            seen.append(("release", committed_blocks))
            raise RuntimeError("a failing callback must not stop the follower")

        with self.c.attach("other", on_grow=lambda committed_blocks: seen.append(("grow", committed_blocks)),
                           on_release=on_release, on_pause=lambda ranges: None) as m:
            with kvd.connect(self.daemon.socket, client_name="operator") as op:
                op.grow("other", 64)
                # on_grow runs after the follower published the new state, so wait for the callback too.
                poll(lambda: m.committed_blocks == 64 and len(m.mapped_chunks) == 2 and seen,
                     "the follower maps the grow and calls on_grow")
                self.assertEqual(seen, [("grow", 64)])
                m.layer(3)[63] = 1
                self.assertEqual(float(m.layer(3)[63].sum()), 8 * 16 * 128)
                u = op.shrink("other", 16, wait=True)  # returns once our follower acknowledged
                self.assertEqual(u.pool.pending_release_bytes, 0)
                self.assertEqual(len(m.mapped_chunks), 1)
                poll(lambda: len(seen) == 2, "on_release (it runs after the acknowledgement)")
                self.assertEqual(seen[1], ("release", 16))
                op.grow("other", 32)  # still following after the callback raised
                poll(lambda: m.committed_blocks == 32 and len(m.mapped_chunks) == 2, "the follower maps again")
                self.assertIsNone(m.gone)

    def test_errors_carry_code_and_message(self):
        self.create("err")
        with self.assertRaises(kvd.KvdError) as e:
            self.create("err")
        self.assertEqual(e.exception.code, "ALREADY_EXISTS")
        self.assertIn("err", e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.pool("nope")
        self.assertEqual(e.exception.code, "NOT_FOUND")
        self.assertIn("pool nope does not exist", e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.create_pool("bad", **dict(DIMS, heads=0))
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("dims.heads", e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.grow("err", DIMS["capacity_blocks"] + 1)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        with self.assertRaises(kvd.KvdError) as e:
            self.c.grow("err", 200 * 1024)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        with self.c.attach("err"):
            with self.assertRaises(kvd.KvdError) as e:
                self.c.delete("err")
            self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
            with self.assertRaises(kvd.KvdError) as e:
                self.c.attach("err")
            self.assertEqual(e.exception.code, "ALREADY_EXISTS")
        with self.assertRaises(kvd.KvdError) as e:
            kvd.connect(os.path.join(self.daemon.dir, "missing.sock"))
        self.assertEqual(e.exception.code, "UNAVAILABLE")
        # Handle-channel errors too: a lease is single-use.
        r = self.c._call("Attach", kvd.v1_pb2.AttachRequest(pool="err"))
        for _, fd in self.c.session.fetch(r.lease.token):
            os.close(fd)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.session.fetch(r.lease.token)
        self.assertEqual(e.exception.code, "NOT_FOUND")
        self.c._call("Detach", kvd.v1_pb2.DetachRequest(pool="err", client_id=r.client_id))

    def test_one_fd_per_mapped_chunk_and_none_after_close(self):
        self.create("fds")
        self.c.pools()  # the channel is connected: its socket is in the baseline
        before, maps_before = fd_count(), memfd_maps()
        self.assertEqual(memfd_fds(), 0)
        m = self.c.attach("fds")
        # Each mapped chunk's FD stays open (to hand it back after a daemon restart), and only those.
        self.assertEqual(memfd_fds(), len(m.mapped_chunks))
        self.assertGreater(memfd_maps(), maps_before)
        self.c.grow("fds", 64)
        self.assertEqual(memfd_fds(), len(m.mapped_chunks))
        self.c.shrink("fds", 16, wait=True)  # the grown chunk, whole: no pause (the mapping is not pausable)
        self.assertEqual(memfd_fds(), len(m.mapped_chunks))
        self.c.sleep("fds", wait=True)
        self.assertEqual(memfd_fds(), 0)  # unmapped chunks close their FDs
        self.c.wake("fds")
        self.assertEqual(memfd_fds(), len(m.mapped_chunks))
        # Nothing else of ours stays open (gRPC may keep a few of its own: at most 4 more than at the start).
        self.assertLessEqual(fd_count(), before + 4 + len(m.mapped_chunks))
        m.close()
        self.assertEqual(memfd_fds(), 0)
        self.assertLessEqual(fd_count(), before + 4)
        self.assertEqual(memfd_maps(), maps_before)

    def test_close_detaches(self):
        self.create("detach")
        m = self.c.attach("detach")
        self.assertEqual(len(self.c.pool("detach").clients), 1)
        m.close()
        self.assertTrue(m.closed)
        self.assertEqual(len(self.c.pool("detach").clients), 0)
        m.close()  # idempotent
        # A peer process that exits without closing is detached by the daemon (its session died).
        peer = self.peer("detach")
        self.assertEqual(len(self.c.pool("detach").clients), 1)
        peer.p.kill()
        peer.p.wait()
        poll(lambda: len(self.c.pool("detach").clients) == 0, "the killed peer detached")
        self.c.delete("detach")

    def test_pool_deleted_unmaps(self):
        self.create("gone")
        lost = []
        m = self.c.attach("gone", on_lost=lost.append)
        with kvd.connect(self.daemon.socket, client_name="operator") as op:
            op.delete("gone", force=True)
        poll(lambda: len(lost) == 1, "on_lost")
        # Not pausable and of another session: a forced delete leaves it what it maps until it closes
        # (docs/api.md, "Releases and running engines"), still counted by the daemon.
        self.assertEqual(lost[0].code, "NOT_FOUND")
        self.assertIn("pool gone was deleted by force", lost[0].message)
        self.assertIs(m.gone, lost[0])
        self.assertEqual(m.committed_blocks, 0)
        self.assertEqual(len(m.mapped_chunks), 1)
        self.assertEqual(float(m.layer(0)[0].max()), 0.0)  # still readable
        self.assertEqual(self.c.device_info().committed_bytes, 16 * 8 * 16 * 128 * 2 * 4)
        m.close()
        self.assertEqual(m.mapped_chunks, [])
        poll(lambda: self.c.device_info().committed_bytes == 0, "the memory given back once it closed")

    def test_pool_deleted_pauses_a_pausable_mapping_and_unmaps(self):
        self.create("gone")
        lost, paused = [], []
        m = self.c.attach("gone", on_lost=lost.append, on_pause=paused.append)
        with kvd.connect(self.daemon.socket, client_name="operator") as op:
            op.delete("gone", force=True)
        poll(lambda: len(lost) == 1, "on_lost")
        self.assertEqual((lost[0].code, lost[0].message), ("NOT_FOUND", "pool gone was deleted"))
        self.assertEqual(len(paused), 1)
        self.assertEqual(m.mapped_chunks, [])
        m.close()


class LeaseRaceTest(unittest.TestCase):
    """A lease overtaken by a release (docs/api.md, "Leases and concurrent releases"), through the package: the
    follower maps what is still in the pool, and the release's event does the rest."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon("--max-chunk=2MiB")  # a grow of 4 MiB is two chunks

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def test_chunks_added_that_a_release_overtook_map_what_is_still_in_the_pool(self):
        engine = kvd.connect(self.daemon.socket, client_name="engine")
        self.addCleanup(engine.close)
        op = kvd.connect(self.daemon.socket, client_name="operator")
        self.addCleanup(op.close)
        engine.create_pool("race", initial_blocks=16, backend_requirements={"FLASHINFER": ["block-outermost"]},
                           **DIMS)  # one segment, 16 blocks a chunk
        held, let_go = threading.Event(), threading.Event()
        grows, releases, lost = [], [], []

        def on_grow(blocks):
            grows.append(blocks)
            if len(grows) == 1:  # the follower waits here: the next events queue behind it
                held.set()
                let_go.wait(POLL_S)

        m = engine.attach("race", on_grow=on_grow, on_release=releases.append, on_lost=lost.append,
                          on_pause=lambda ranges: None)
        self.addCleanup(m.close)
        self.addCleanup(let_go.set)
        op.grow("race", 32)
        self.assertTrue(held.wait(POLL_S))
        op.grow("race", 64)  # CHUNKS_ADDED: blocks 32-47 and 48-63, one lease
        # The engine's own session releases the last chunk before its follower redeemed that lease (no pause:
        # CHUNKS_RELEASED, queued behind it).
        shrunk = engine.shrink("race", 48, whole_chunks_only=True)
        self.assertEqual(len(shrunk.released_chunk_ids), 1)
        let_go.set()
        poll(lambda: (m.committed_blocks == 48 and releases) or lost,
             "the follower maps the chunk left and follows the release")
        self.assertEqual([(e.code, e.message) for e in lost], [])
        self.assertIsNone(m.gone)
        self.assertEqual(m.state, kvd.v1_pb2.POOL_STATE_AWAKE)
        self.assertEqual(m.mapped_chunks, sorted(c.id for c in op.pool("race").chunks))
        self.assertEqual(grows, [32])  # the overtaken grow's size was never the engine's to use
        self.assertEqual(releases, [48])
        m.layer(3)[47] = 7
        with op.attach("race") as other:
            self.assertEqual(float(other.layer(3)[47].min()), 7.0)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--peer":
        sys.exit(peer_main(*sys.argv[2:5]))
    unittest.main(verbosity=2)
