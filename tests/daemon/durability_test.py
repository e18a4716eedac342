"""Durable pools (issue 12; docs/operations.md "Upgrades and restarts"): a restart, a crash or an upgrade
of kvd keeps every pool, its bytes and its metadata.

Run under a played service manager (tests/testing/played_manager.py: the notify socket, FDSTORE=1,
LISTEN_FDS, exactly as systemd) and without one (clients give the chunks' FDs back: ReturnHandles).
The real daemon on the host backend, the real Python package and the handle channel's wire protocol;
chunk bytes are read and written through the FDs the daemon hands out (mmap of the memfds).

Run: KVD_BINARY=<build>/daemon/kvd PYTHONPATH=<src>/client/python:<src>/tests/testing \
     KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so /usr/bin/python3 durability_test.py
"""

import array
import mmap
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import kvd
from kvd import handles_path
from kvd._proto import pb
from kvd_daemon import kvctl
from played_manager import PlayedManager

KVD = os.environ.get("KVD_BINARY", "kvd")
WAIT_S = 30
# 2 layers (LBNHC: 2 segments), 8 heads, 16 tokens, 128 channels, fp16: 32 KiB per block and segment,
# so the 2 MiB granularity is 64 blocks; chunks of at most 8 MiB (--max-chunk).
DIMS = dict(layers=2, capacity_blocks=1024, heads=8, block_tokens=16, channels=128, element_bytes=2)


def pattern(chunk_id, nbytes):
    """The bytes a test writes into chunk `chunk_id`: its id and position, so that a chunk read back in
    the wrong place or another chunk's memory both show."""
    word = (chunk_id * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    block = array.array("Q", [(word + i) & 0xFFFFFFFFFFFFFFFF for i in range(512)]).tobytes()  # 4 KiB
    return block * (nbytes // len(block))


def connect(sock):
    return kvd.connect(sock, client_name="durability-test")


def chunk_fds(client, pool):
    """Attaches `pool` and fetches every chunk's FD: {chunk_id: (fd, bytes)}, through a session of its own
    that then closes and takes the attachment with it. (A client that detached would hold the chunks it
    fetched until its session ends, docs/api.md, and `client`'s later shrinks would wait for it.)"""
    own = connect(client.socket)
    try:
        resp = own._call("Attach", pb.AttachRequest(pool=pool, client_name="fds"))
        fds = dict(own.session.fetch(resp.lease.token))
    finally:
        own.close()
    deadline = time.monotonic() + WAIT_S
    while any(cl.client_id == resp.client_id for cl in client.pool(pool).clients):
        assert time.monotonic() < deadline, "the daemon did not close the session"
        time.sleep(0.01)
    return {c.id: (fds[c.id], c.bytes) for c in resp.pool.chunks}


def write_patterns(client, pool):
    """Writes pattern(id) into every chunk of `pool`; returns the chunk ids written."""
    written = []
    for cid, (fd, nbytes) in chunk_fds(client, pool).items():
        with mmap.mmap(fd, nbytes) as m:
            m[:] = pattern(cid, nbytes)
        os.close(fd)
        written.append(cid)
    return written


def differing_bytes(client, pool, ids):
    """Bytes of the chunks `ids` of `pool` that differ from their pattern (a missing chunk counts whole)."""
    fds = chunk_fds(client, pool)
    bad = 0
    for cid in ids:
        if cid not in fds:
            bad += 1 << 30
            continue
    for cid, (fd, nbytes) in fds.items():
        if cid in ids:
            with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as m:
                want = pattern(cid, nbytes)
                if m[:] != want:
                    bad += sum(1 for a, b in zip(m[:], want) if a != b)
        os.close(fd)
    return bad


def comparable(pool):
    """Everything of a Pool a restart must keep (not clients, epoch or transient fields)."""
    p = pb.Pool()
    p.CopyFrom(pool)
    p.ClearField("clients")
    p.ClearField("epoch")
    return p


class DurabilityCase(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-durable-")
        os.chmod(self.dir, 0o750)
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.socket = os.path.join(self.dir, "gpu0.sock")
        self.state_dir = os.path.join(self.dir, "gpu0.state")
        self.log_path = os.path.join(self.dir, "kvd.log")
        self.binary = KVD
        self.clients = []
        self.addCleanup(self._close_clients)

    def _close_clients(self):
        for c in self.clients:
            try:
                c.close()
            except Exception:
                pass

    def argv(self, *extra):
        return [self.binary, "--backend=host", "--socket=" + self.socket, "--host-capacity=1GiB", "--budget=512MiB",
                "--host-granularity=2MiB", "--max-chunk=8MiB", *extra]

    def client(self):
        """A new client; those of a daemon that is gone are closed (their channels would be reused)."""
        self._close_clients()
        self.clients = []
        c = connect(self.socket)
        self.clients.append(c)
        return c

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def make_pools(self, c):
        """Pools in every shape a restart must keep: grown in steps, sleeping, empty, grouped, granted,
        shared with another uid, with metadata."""
        c.create_pool("steps", initial_blocks=64, **DIMS)
        c.grow("steps", 200)
        c.grow("steps", 300)
        c.shrink("steps", 260)
        c.create_pool("asleep", initial_blocks=128, **DIMS)
        c.sleep("asleep")
        c.create_pool("empty", **DIMS)
        c.create_pool("rank1", initial_blocks=32, **DIMS, group=kvd.GroupMembership("g", 1, 2))
        c.grant_peer_access("rank1", "*")
        c.create_pool("shared", initial_blocks=64, allowed_uids=[4242], **DIMS)
        c.set_metadata("shared", b"block table v1", expected_version=0)
        c.set_metadata("shared", b"block table v2", expected_version=1)
        written = {}
        for name in ("steps", "rank1", "shared"):
            written[name] = write_patterns(c, name)
        return written

    def snapshot(self, c):
        return {p.name: comparable(p) for p in c.pools()}

    def assert_same_pools(self, before, c, epoch):
        after = {p.name: p for p in c.pools()}
        self.assertEqual(sorted(before), sorted(after))
        for name, pool in after.items():
            self.assertEqual(pool.epoch, epoch, name)
            self.assertEqual(comparable(pool), before[name], name)
        self.assertEqual(c.device_info().epoch, epoch)

    def assert_store_matches(self, manager, c):
        """The FD store holds exactly the FDs of the chunks in the daemon's tables, and the daemon counts
        exactly their bytes: nothing lost, nothing leaked."""
        chunks = {f"c{ch.id}": ch.bytes for p in c.pools() for ch in p.chunks}
        self.assertEqual(manager.stored(), sorted(chunks))
        self.assertEqual(c.device_info().committed_bytes, sum(chunks.values()))


class FdStoreTest(DurabilityCase):
    """Under the played service manager: chunk FDs live in the FD store across restarts."""

    def setUp(self):
        super().setUp()
        self.manager = PlayedManager(self.dir)
        self.addCleanup(self.manager.close)

    def start(self, *extra):
        return self.manager.start(self.argv(*extra), self.log_path)

    def test_sigterm_restart_keeps_every_pool_byte_and_metadata(self):
        self.start()
        c = self.client()
        self.assertEqual(c.device_info().epoch, 1)
        self.assertEqual(c.device_info().durability, pb.DURABILITY_FD_STORE)
        written = self.make_pools(c)
        before = self.snapshot(c)
        self.assert_store_matches(self.manager, c)

        self.assertEqual(self.manager.kill(signal.SIGTERM), 0)
        self.assertIn("pools kept for the next start", self.log())
        self.start()
        c = self.client()
        self.assert_same_pools(before, c, epoch=2)
        for name, ids in written.items():
            self.assertEqual(differing_bytes(c, name, ids), 0, name)
        md = c.metadata("shared")
        self.assertEqual((md.version, md.data), (2, b"block table v2"))
        self.assert_store_matches(self.manager, c)
        # The restored pools work as before: grow, shrink, sleep, wake; chunk ids are never reused.
        old_ids = {ch.id for p in c.pools() for ch in p.chunks}
        grown = c.grow("steps", 400)
        self.assertTrue(all(ch.id not in old_ids for ch in grown.added))
        self.assertEqual(c.shrink("steps", 64).pool.committed_blocks, 64)
        c.wake("asleep")
        self.assertEqual(c.pool("asleep").committed_blocks, 128)
        self.assert_store_matches(self.manager, c)

    def test_sigkill_at_random_points_loses_nothing(self):
        """kill -9 while grows, shrinks, sleeps, wakes and group prepares run; every restart restores
        every committed chunk with its bytes and the store and the budget agree with the tables."""
        rng = random.Random(12)
        self.start()
        c = self.client()
        c.create_pool("busy", initial_blocks=64, **DIMS)
        c.create_pool("quiet", initial_blocks=256, **DIMS)
        written = {"quiet": write_patterns(c, "quiet")}
        epoch = 1
        for round_ in range(8):
            stop = threading.Event()

            def churn(client=c):
                ops = 0
                while not stop.is_set():
                    try:
                        pool = client.pool("busy")
                        if pool.state == pb.POOL_STATE_SLEEPING:
                            client.wake("busy")
                        elif ops % 5 == 4:
                            client.sleep("busy")
                        elif ops % 5 == 3:
                            t = client.prepare("busy", "grow", pool.committed_blocks + 32).transaction
                            client.abort(t)
                        elif pool.committed_blocks < 600:
                            client.grow("busy", pool.committed_blocks + rng.choice((16, 64, 130)))
                        else:
                            client.shrink("busy", rng.choice((16, 100, 300)))
                    except kvd.KvdError:
                        return  # the daemon died under it
                    ops += 1

            worker = threading.Thread(target=churn)
            worker.start()
            time.sleep(rng.uniform(0.0, 0.15))
            self.manager.kill(signal.SIGKILL)
            stop.set()
            worker.join(WAIT_S)
            self.start()
            epoch += 1
            c = self.client()
            self.assertEqual(c.device_info().epoch, epoch, f"round {round_}")
            states = {p.name: p.state for p in c.pools()}
            self.assertNotIn(pb.POOL_STATE_RECOVERING, states.values(), f"round {round_}: {self.log()}")
            self.assertEqual(differing_bytes(c, "quiet", written["quiet"]), 0, f"round {round_}")
            self.assert_store_matches(self.manager, c)
            written["busy"] = write_patterns(c, "busy") if states["busy"] == pb.POOL_STATE_AWAKE else []
        self.assertEqual(differing_bytes(c, "busy", written["busy"]), 0)

    def test_kill9_mid_shrink_with_acknowledgements_outstanding(self):
        """A shrink whose released chunks a client still maps (it never acknowledged) when kvd is killed:
        the restarted daemon has the shrunk table, the store only its chunks, and keeps the released bytes
        counted for the recovery grace (the client may still map them), then gives them back."""
        self.start("--recovery-grace=2s")
        c = self.client()
        # Grown in two steps: the shrink to 64 releases a whole chunk per segment. The holder did not opt in
        # to pauses, so the shrink is forced past it (docs/api.md, "Releases and running engines").
        c.create_pool("p", initial_blocks=64, **DIMS)
        c.grow("p", 512)
        holder = connect(self.socket)  # attached, handed every chunk, never watches nor acknowledges
        self.addCleanup(holder.close)
        holder._call("Attach", pb.AttachRequest(pool="p", client_name="holder"))
        shrunk = c.shrink("p", 64, force=True)
        pending = shrunk.pool.pending_release_bytes
        self.assertGreater(pending, 0)
        table = shrunk.pool.committed_bytes
        self.manager.kill(signal.SIGKILL)
        self.start("--recovery-grace=2s")
        c = self.client()
        pool = c.pool("p")
        self.assertEqual(pool.committed_bytes, table)
        self.assertEqual(sorted(f"c{ch.id}" for ch in pool.chunks), self.manager.stored())
        info = c.device_info()
        if info.committed_bytes != table:  # the grace may have passed already on a slow machine
            self.assertEqual(info.committed_bytes, table + pending)
        deadline = time.monotonic() + WAIT_S
        while c.device_info().committed_bytes != table:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.05)
        self.assertEqual(c.pool("p").pending_release_bytes, 0)

    def test_new_binary_restores_the_pools(self):
        self.start()
        c = self.client()
        written = self.make_pools(c)
        before = self.snapshot(c)
        self.manager.kill(signal.SIGTERM)
        # An upgrade: another binary at another path (the same build here).
        self.binary = os.path.join(self.dir, "kvd-new")
        shutil.copy(KVD, self.binary)
        self.start()
        c = self.client()
        self.assert_same_pools(before, c, epoch=2)
        for name, ids in written.items():
            self.assertEqual(differing_bytes(c, name, ids), 0, name)

    def test_drain_on_stop_releases_everything(self):
        self.start("--drain-on-stop")
        c = self.client()
        self.make_pools(c)
        self.assertGreater(len(self.manager.stored()), 0)
        self.manager.kill(signal.SIGTERM)
        self.assertIn("all memory released", self.log())
        self.assertEqual(self.manager.stored(), [])
        self.assertEqual(os.listdir(os.path.join(self.state_dir, "pools")), [])
        self.start()
        c = self.client()
        self.assertEqual(c.pools(), [])
        self.assertEqual(c.device_info().epoch, 2)

    def test_releases_that_settled_before_a_kill_are_not_counted_after_it(self):
        """A shrink or sleep with wait_for_release replies once every client gave the chunks back: a SIGKILL
        after that reply must not bring those bytes back as pending release (they would be counted against the
        budget for the whole recovery grace)."""
        self.start()
        c = self.client()
        for name in ("shrunk", "slept", "grouped"):
            c.create_pool(name, initial_blocks=0, **DIMS)
            c.grow(name, 256)
            c.grow(name, 512)
        engine = kvd.connect(self.socket, client_name="engine")  # another session: its Mappings pause and give back
        self.addCleanup(engine.close)
        mappings = [engine.attach(name, on_pause=lambda ranges: None) for name in ("shrunk", "slept", "grouped")]
        self.addCleanup(lambda: [m.close() for m in mappings])
        self.assertEqual(c.shrink("shrunk", 448, wait=True).pool.pending_release_bytes, 0)  # exact: replaced
        c.sleep("slept", wait=True)
        t = c.prepare("grouped", "shrink", target_blocks=256).transaction
        c.commit(t, wait=True)
        self.assertEqual([p.pending_release_bytes for p in c.pools()], [0, 0, 0])
        self.manager.kill(signal.SIGKILL)
        self.start()
        c = self.client()
        self.assertEqual([p.pending_release_bytes for p in c.pools()], [0, 0, 0])
        self.assert_store_matches(self.manager, c)  # the budget counts exactly the chunks

    def test_a_grow_past_fdstore_max_is_refused_and_changes_nothing(self):
        """--fdstore-max counts every FD kvd keeps in the store, the host tier's included; a grow that would pass
        it is RESOURCE_EXHAUSTED naming the flag and the unit's setting, and leaves the pool, the store and the
        budget as they were."""
        self.start("--fdstore-max=4", "--host-tier-bytes=16MiB")
        c = self.client()
        c.create_pool("kv", initial_blocks=64, **DIMS)  # 2 MiB in each of 2 segments: 2 chunks
        before = c.pool("kv")
        self.assertEqual(len(before.chunks), 2)
        self.assertIn("host-tier", self.manager.stored())
        with self.assertRaises(kvd.KvdError) as refused:
            c.grow("kv", 128)  # 2 more chunks: 5 FDs
        self.assertEqual(refused.exception.code, "RESOURCE_EXHAUSTED")
        self.assertIn("holds 4 of 4 FDs (3 chunks and the host tier; --fdstore-max, FileDescriptorStoreMax= of the "
                      "unit)", refused.exception.message)
        after = c.pool("kv")
        self.assertEqual((after.committed_blocks, [ch.id for ch in after.chunks]),
                         (64, [ch.id for ch in before.chunks]))
        self.assertEqual(self.manager.stored(), sorted([f"c{ch.id}" for ch in before.chunks] + ["host-tier"]))
        self.assertEqual(c.device_info().committed_bytes, before.committed_bytes)
        c.delete("kv")  # and the store gives the FDs back
        self.assertEqual(self.manager.stored(), ["host-tier"])

    def test_stray_fds_in_the_store_are_reported_and_released(self):
        """An FD the records do not account for (a grow that never committed) is released, not kept."""
        self.start()
        c = self.client()
        c.create_pool("p", initial_blocks=64, **DIMS)
        self.manager.kill(signal.SIGTERM)
        stray = os.memfd_create("stray")
        os.ftruncate(stray, 2 << 20)
        self.manager.fds["c999999"] = stray
        self.start()
        self.assertIn("chunk 999999: its FD was in the store but no saved pool has it", self.log())
        c = self.client()
        self.assert_store_matches(self.manager, c)

    def test_wrong_size_fd_in_the_store_is_reported_and_not_adopted(self):
        self.start()
        c = self.client()
        c.create_pool("p", initial_blocks=64, **DIMS)
        victim = c.pool("p").chunks[0].id
        self.manager.kill(signal.SIGTERM)
        os.close(self.manager.fds.pop(f"c{victim}"))
        bigger = os.memfd_create("bigger")
        os.ftruncate(bigger, 4 << 20)
        self.manager.fds[f"c{victim}"] = bigger
        self.start()
        self.assertIn(f"chunk {victim} ", self.log())
        self.assertIn("has 4194304 bytes, the chunk 2097152", self.log())
        c = self.client()
        self.assertEqual(list(c.pool("p").missing_chunk_ids), [victim])
        self.assertNotIn(f"c{victim}", self.manager.stored())  # taken out of the store, not kept

    def test_lost_fd_is_reported_and_its_pool_recovers_or_sleeps(self):
        """A chunk whose FD is missing from the store: reported chunk by chunk, its pool RECOVERING (Attach
        UNAVAILABLE) until the grace passes, then asleep with its size remembered; its bytes counted until then."""
        self.start("--recovery-grace=3s")
        c = self.client()
        c.create_pool("p", initial_blocks=64, **DIMS)
        victim = c.pool("p").chunks[0].id
        self.manager.kill(signal.SIGTERM)
        os.close(self.manager.fds.pop(f"c{victim}"))
        self.start("--recovery-grace=3s")
        self.assertIn(f"chunk {victim} ", self.log())
        c = self.client()
        pool = c.pool("p")
        if pool.state == pb.POOL_STATE_RECOVERING:  # the grace may already have passed on a slow machine
            self.assertEqual(list(pool.missing_chunk_ids), [victim])
            self.assertEqual(c.device_info().committed_bytes, pool.committed_bytes)
            with self.assertRaises(kvd.KvdError) as e:
                c._call("Attach", pb.AttachRequest(pool="p"))
            self.assertEqual(e.exception.code, "UNAVAILABLE")
        deadline = time.monotonic() + WAIT_S
        while c.pool("p").state != pb.POOL_STATE_SLEEPING:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.05)
        pool = c.pool("p")
        self.assertEqual((pool.wake_blocks, pool.committed_bytes, len(pool.chunks)), (64, 0, 0))
        self.assertEqual(c.device_info().committed_bytes, 0)
        self.assert_store_matches(self.manager, c)
        c.wake("p")  # usable again: fresh memory
        self.assertEqual(c.pool("p").committed_blocks, 64)


    def test_a_record_that_cannot_be_written_shows_as_degraded_until_it_is_saved_again(self):
        """docs/api.md DeviceInfo.state_*: a failed save is sticky and visible through the RPC and kvctl status."""
        self.start()
        c = self.client()
        c.create_pool("p", initial_blocks=32, **DIMS)
        pools = os.path.join(self.state_dir, "pools")
        os.rename(pools, pools + ".away")
        open(pools, "w").close()  # records cannot be written under a file (as root, where modes do not stop it)
        c.grow("p", 128)  # the grow itself succeeds: the memory is there, only its record is stale
        info = c.device_info()
        self.assertTrue(info.state_degraded)
        self.assertIn("pool p", info.state_error)
        self.assertEqual(info.state_save_failures, 1)
        status = self.kvctl("status")
        self.assertIn("saved state  DEGRADED: ", status)
        self.assertIn("1 saves failed since start", status)
        os.remove(pools)
        os.rename(pools + ".away", pools)
        c.grow("p", 192)
        info = c.device_info()
        self.assertEqual((info.state_degraded, info.state_error, info.state_save_failures), (False, "", 1))
        self.assertIn("saved state  current (1 saves failed since start", self.kvctl("status"))

    def kvctl(self, *args):
        return kvctl(self.socket, *args)

class ClientsReturnHandlesTest(DurabilityCase):
    """Without a service manager (a container): the pool table is saved, and clients that still map a
    pool give its chunks' FDs back after a restart."""

    def start(self, *extra):
        seen = len(self.log()) if os.path.exists(self.log_path) else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(*extra), stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(self.stop, self.proc)
        deadline = time.monotonic() + WAIT_S
        while " ready: " not in self.log()[seen:]:
            self.assertIsNone(self.proc.poll(), self.log())
            self.assertLess(time.monotonic(), deadline, self.log())
            time.sleep(0.02)

    @staticmethod
    def stop(proc, sig=signal.SIGTERM):
        if proc.poll() is None:
            proc.send_signal(sig)
        proc.wait(WAIT_S)

    def return_handles(self, c, pool, fds, packet_size=250):
        """ReturnHandles on the handle channel: `fds` [(chunk_id, fd)] in packets -> the reply."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(WAIT_S)
        s.connect(handles_path(self.socket))
        try:
            for start in range(0, max(len(fds), 1), packet_size):
                part = fds[start:start + packet_size]
                req = pb.HandleChannelRequest()
                req.return_handles.session_token = c.session.token
                req.return_handles.pool = pool
                req.return_handles.chunk_ids.extend(cid for cid, _ in part)
                req.return_handles.last = start + packet_size >= len(fds)
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd for _, fd in part]))] if part else []
                s.sendmsg([req.SerializeToString()], anc)
            reply = pb.HandleChannelReply()
            reply.ParseFromString(s.recv(65536))
            return reply
        finally:
            s.close()

    def test_kill9_then_clients_give_the_chunks_back(self):
        self.start()
        c = self.client()
        self.assertEqual(c.device_info().durability, pb.DURABILITY_CLIENTS)
        c.create_pool("p", initial_blocks=300, **DIMS)  # 2 segments, several chunks each (8 MiB max)
        c.set_metadata("p", b"index", expected_version=0)
        written = write_patterns(c, "p")
        before = self.snapshot(c)
        held = chunk_fds(c, "p")  # the engine's FDs: they keep the memory after the daemon dies
        self.addCleanup(lambda: [os.close(fd) for fd, _ in held.values()])
        self.stop(self.proc, signal.SIGKILL)

        self.start()
        c = self.client()
        pool = c.pool("p")
        self.assertEqual(pool.state, pb.POOL_STATE_RECOVERING)
        self.assertEqual(sorted(pool.missing_chunk_ids), sorted(held))
        # Memory the clients still hold is counted: the daemon does not hand it out again.
        info = c.device_info()
        self.assertEqual(info.committed_bytes, pool.committed_bytes)
        with self.assertRaises(kvd.KvdError) as e:
            c._call("Attach", pb.AttachRequest(pool="p"))
        self.assertEqual(e.exception.code, "UNAVAILABLE")
        self.assertIn("recovering", e.exception.message)

        # Refused whole, nothing adopted: a chunk not in the table, the same chunk twice, a wrong size.
        ids = sorted(held)
        wrong = os.memfd_create("wrong")
        os.ftruncate(wrong, 4096)
        self.addCleanup(os.close, wrong)
        for bad, needle in (([(123456789, wrong)], "not in pool p's chunk table"),
                            ([(ids[0], held[ids[0]][0]), (ids[0], held[ids[0]][0])], "given twice"),
                            ([(ids[0], wrong)], "has 4096 bytes")):
            reply = self.return_handles(c, "p", bad)
            self.assertTrue(reply.HasField("error"), reply)
            self.assertEqual(reply.error.code, 3)  # INVALID_ARGUMENT
            self.assertIn(needle, reply.error.message)
        self.assertEqual(len(c.pool("p").missing_chunk_ids), len(ids))

        # In two calls, the first in packets of 1 FD.
        half = [(cid, held[cid][0]) for cid in ids[:2]]
        reply = self.return_handles(c, "p", half, packet_size=1)
        self.assertEqual(sorted(reply.handles_returned.adopted_chunk_ids), ids[:2], reply)
        self.assertEqual(reply.handles_returned.state, pb.POOL_STATE_RECOVERING)
        reply = self.return_handles(c, "p", [(cid, held[cid][0]) for cid in ids])
        self.assertEqual(sorted(reply.handles_returned.adopted_chunk_ids), ids[2:], reply)
        self.assertEqual(list(reply.handles_returned.missing_chunk_ids), [])
        self.assertEqual(reply.handles_returned.state, pb.POOL_STATE_AWAKE)

        self.assert_same_pools(before, c, epoch=2)
        self.assertEqual(differing_bytes(c, "p", written), 0)
        md = c.metadata("p")
        self.assertEqual((md.version, md.data), (1, b"index"))
        c.grow("p", 400)  # usable

    def test_pools_nobody_maps_sleep_after_the_grace(self):
        self.start("--recovery-grace=500ms")
        c = self.client()
        c.create_pool("p", initial_blocks=64, **DIMS)
        c.create_pool("asleep", initial_blocks=64, **DIMS)
        c.sleep("asleep")
        self.stop(self.proc, signal.SIGKILL)
        self.start("--recovery-grace=500ms")
        c = self.client()
        self.assertEqual(c.pool("asleep").state, pb.POOL_STATE_SLEEPING)  # nothing to recover
        deadline = time.monotonic() + WAIT_S
        while c.pool("p").state != pb.POOL_STATE_SLEEPING:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.05)
        self.assertEqual((c.pool("p").wake_blocks, c.device_info().committed_bytes), (64, 0))
        self.assertIn("was not given back within the recovery grace: lost", self.log())

    def test_state_of_another_device_is_refused(self):
        self.start()
        self.stop(self.proc)
        with open(self.log_path, "ab") as log:
            rc = subprocess.call(self.argv("--device=1"), stdout=log, stderr=subprocess.STDOUT, timeout=WAIT_S)
        self.assertEqual(rc, 1)
        self.assertIn("give each device its own --state-dir", self.log())


class MetadataTest(DurabilityCase):
    start = ClientsReturnHandlesTest.start
    stop = staticmethod(ClientsReturnHandlesTest.stop)

    def test_compare_and_set_and_limits(self):
        self.start("--max-metadata-bytes=1KiB")
        c = self.client()
        c.create_pool("p", **DIMS)
        md = c.metadata("p")
        self.assertEqual((md.pool, md.version, md.data, md.updated_at_unix_ms), ("p", 0, b"", 0))
        md = c.set_metadata("p", b"a", expected_version=0)
        self.assertEqual((md.version, md.data), (1, b"a"))
        self.assertGreater(md.updated_at_unix_ms, 0)
        with self.assertRaises(kvd.KvdError) as e:
            c.set_metadata("p", b"b", expected_version=0)
        self.assertEqual(e.exception.code, "ABORTED")
        self.assertIn("version 1", e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            c.set_metadata("p", b"x" * 1025, expected_version=1)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("data: 1025 bytes, at most 1024", e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            c.metadata("nope")
        self.assertEqual(e.exception.code, "NOT_FOUND")
        pool = c.pool("p")
        self.assertEqual((pool.metadata_version, pool.metadata_bytes), (1, 1))

    def test_engine_killed_and_restarted_finds_bytes_and_metadata(self):
        """An engine process writes its KV bytes and its index, is SIGKILLed; a new one finds both."""
        self.start()
        c = self.client()
        c.create_pool("engine", initial_blocks=128, **DIMS)
        engine = subprocess.Popen([sys.executable, __file__, "--engine", self.socket, "engine"],
                                  stdout=subprocess.PIPE, text=True)
        self.addCleanup(engine.stdout.close)
        ids = [int(x) for x in engine.stdout.readline().split()]
        self.assertTrue(ids)
        engine.kill()
        engine.wait(WAIT_S)
        c2 = self.client()
        md = c2.metadata("engine")
        self.assertEqual([int(x) for x in md.data.decode().split()], ids)
        self.assertEqual(differing_bytes(c2, "engine", ids), 0)


def engine_main(sock, pool):
    """--engine: writes patterns and its index into `pool`, says so, then waits to be killed."""
    c = connect(sock)
    ids = write_patterns(c, pool)
    c.set_metadata(pool, " ".join(map(str, ids)).encode(), expected_version=c.metadata(pool).version)
    print(" ".join(map(str, ids)), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--engine":
        engine_main(sys.argv[2], sys.argv[3])
    else:
        unittest.main()
