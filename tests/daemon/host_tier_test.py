"""Sleep that keeps the contents (docs/api.md, "Sleep that keeps the contents"): on the real kvd (host backend,
a memfd device) with --host-tier-bytes, through the Python package and kvctl. Every byte of every segment is
written with a pattern, the pool sleeps keeping it (all of it, or named live blocks), wakes, and two clients of
two sessions read it back at the same addresses; a sleep the tier cannot hold is refused and changes nothing;
a group's two-phase sleep keeps them at Prepare and an Abort gives the tier back; an engine that exits while the
pool sleeps finds its bytes when it attaches again; pausable engines of other sessions pause before the copy;
under a played service manager (tests/testing/played_manager.py, systemd's FD store) the kept bytes outlive a
SIGTERM and a SIGKILL of kvd, and a tier of another size after the restart drops them and says so.

Run: KVD_BINARY=<build>/daemon/kvd KVCTL_BINARY=<build>/client/kvctl/kvctl \
     PYTHONPATH=<src>/client/python:<src>/tests/testing KVD_PYTHON_GEN_DIR=<build>/python \
     /usr/bin/python3 host_tier_test.py -v
"""

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import numpy as np

import kvd
from kvd_daemon import KvdDaemonCase
from played_manager import PlayedManager

# 2 layers, 8 heads, 16 tokens, 128 channels, fp16: 32 KiB per block and segment.
DIMS = dict(layers=2, capacity_blocks=2048, heads=8, block_tokens=16, channels=128, element_bytes=2)
BLOCKS = 512  # 16 MiB per segment, 32 MiB committed
TIER = "48MiB"
AWAKE, SLEEPING = kvd.v1_pb2.POOL_STATE_AWAKE, kvd.v1_pb2.POOL_STATE_SLEEPING


def pattern(layer, blocks, shape, seed=0):
    b = np.asarray(blocks, dtype=np.uint64)
    word = (b * np.uint64(2654435761) + np.uint64(layer * 40503 + 17 + seed)) & np.uint64(0xFFFFFFFF)
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
    return ((word[:, None] + idx[None, :]) & np.uint64(0xFFFF)).astype(np.uint16).reshape(len(b), *shape)


class HostTierTest(KvdDaemonCase):
    def kvd_args(self):
        from scrape import free_port
        self.metrics_port = free_port()
        return [f"--host-tier-bytes={TIER}", f"--metrics-address=127.0.0.1:{self.metrics_port}"]

    def metrics(self):
        from scrape import http_get, parse_samples
        samples = parse_samples(http_get(f"http://127.0.0.1:{self.metrics_port}/metrics"))
        return {name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels) if k != "device"): value
                for (name, labels), value in samples.items() if name.startswith("kvd_host_tier")}

    def setUp(self):
        super().setUp()
        self.c = kvd.connect(self.socket, client_name="engine")
        self.addCleanup(self.c.close)
        self.c.create_pool("kv", **DIMS)
        for step in range(1, 5):  # several chunks per segment: wake recommits one per segment
            self.c.grow("kv", BLOCKS * step // 4)
        self.m = self.c.attach("kv", client_name="engine")
        d = self.m.geometry.dims
        self.shape = (d["heads"], d["block_tokens"], d["channels"])
        self.layers = d["layers"]
        self.write(self.m)

    def write(self, m, seed=0):
        for layer in range(self.layers):
            m.layer(layer, "uint16")[:BLOCKS] = pattern(layer, range(BLOCKS), self.shape, seed)

    def assert_blocks(self, m, blocks, seed=0, what=""):
        for layer in range(self.layers):
            got = m.layer(layer, "uint16")[list(blocks)]
            want = pattern(layer, blocks, self.shape, seed)
            self.assertEqual(int(np.count_nonzero(got != want)), 0, f"layer {layer}: bytes differ {what}")

    def assert_zero(self, m, blocks):
        for layer in range(self.layers):
            self.assertFalse(m.layer(layer, "uint16")[list(blocks)].any(), f"layer {layer}: not fresh memory")

    def kvctl(self, *args):
        return subprocess.run([os.environ["KVCTL_BINARY"], f"--socket={self.socket}", *args], capture_output=True,
                              text=True, timeout=120)

    def test_every_byte_comes_back_at_the_same_addresses_for_two_clients(self):
        other = kvd.connect(self.socket, client_name="reader")
        self.addCleanup(other.close)
        paused = []
        m2 = other.attach("kv", client_name="reader", on_pause=lambda ranges: paused.append(True))
        base = self.m.base if hasattr(self.m, "base") else None
        pool = self.c.sleep("kv", wait=True, keep=True)[0].pool
        self.assertEqual(pool.state, SLEEPING)
        committed = self.c.pool("kv").wake_blocks
        self.assertEqual(committed, BLOCKS)
        self.assertEqual(self.c.pool("kv").kept_bytes, 2 * 16 << 20)
        self.assertTrue(paused, "the reader of another session was not paused before the copy")
        woke = self.c.wake("kv")[0].pool
        self.assertEqual(woke.kept_bytes, 0)
        self.assertEqual(woke.committed_blocks, BLOCKS)
        self.assertEqual(len(woke.chunks), self.layers)  # one chunk per segment, as a plain wake
        if base is not None:
            self.assertEqual(self.m.base, base)
        self.assert_blocks(self.m, range(BLOCKS), what="for the sleeping client")
        # The other session's Mapping maps the woken chunks from its events.
        from scrape import poll
        poll(lambda: m2.state == AWAKE and m2.committed_blocks == BLOCKS, lambda: f"reader state {m2.state}")
        self.assert_blocks(m2, range(BLOCKS), what="for the reader of another session")
        # The tier is empty again: a second keeping sleep of the whole pool fits.
        self.c.sleep("kv", keep=True)
        self.c.wake("kv")
        self.assert_blocks(self.m, range(BLOCKS), what="after a second round")

    def test_only_the_live_blocks_are_kept(self):
        live = [0, 1, 2, 3, 7, 100, 101, 511]
        self.c.sleep("kv", keep=True, live_blocks=live)
        self.assertEqual(self.c.pool("kv").kept_bytes, len(live) * self.layers * (32 << 10))
        self.c.wake("kv")
        self.assert_blocks(self.m, live, what="in a live block")
        self.assert_zero(self.m, [b for b in range(BLOCKS) if b not in live])

    def test_bad_live_blocks_are_refused_naming_the_field_and_nothing_changes(self):
        for live, field in (([0, BLOCKS], "live_blocks[1]"), ([3, 3], "live_blocks")):
            with self.assertRaises(kvd.KvdError) as e:
                self.c.sleep("kv", keep=True, live_blocks=live)
            self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
            self.assertIn(field, e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.sleep("kv", keep=True, live_blocks=list(range(65537)))
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        self.assertIn("live_blocks: 65537 in one request, more than 65536 (--max-block-ids)", e.exception.message)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.sleep("kv", live_blocks=[1])  # without keep
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertEqual(self.c.pool("kv").state, AWAKE)
        self.assert_blocks(self.m, range(BLOCKS))

    def test_a_sleep_the_tier_cannot_hold_is_refused_and_changes_nothing(self):
        self.c.create_pool("big", **DIMS)
        self.c.grow("big", BLOCKS)  # 32 MiB more: the tier (48 MiB) holds one of the two pools, not both
        reader = kvd.connect(self.socket, client_name="reader")  # a pausable engine of another session
        self.addCleanup(reader.close)
        m2 = reader.attach("big", client_name="reader", on_pause=lambda ranges: None)
        self.c.sleep("kv", keep=True)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.sleep("big", keep=True)
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        self.assertIn(f"needs {2 * 16 << 20} bytes", e.exception.message)  # the bytes asked
        self.assertIn(f"its largest free extent is {16 << 20} bytes", e.exception.message)
        self.assertIn("--host-tier-bytes", e.exception.message)
        big = self.c.pool("big")
        self.assertEqual((big.state, big.committed_blocks, big.kept_bytes), (AWAKE, BLOCKS, 0))
        self.assertEqual((m2.state, m2.pauses), (AWAKE, m2.resumes), "a client stayed paused")
        m2.close()
        self.c.sleep("big")  # a sleep without keep still works then
        self.assertEqual(self.c.pool("big").state, SLEEPING)
        self.c.wake("big")
        self.c.wake("kv")
        self.assert_blocks(self.m, range(BLOCKS), what="of the pool that kept its contents")
        self.c.sleep("big", keep=True)  # the tier is free again
        self.assertEqual(self.c.pool("big").kept_bytes, 2 * 16 << 20)

    def test_a_wake_refused_for_memory_keeps_the_contents_for_the_next_wake(self):
        self.c.sleep("kv", keep=True, wait=True)  # the engine's release acknowledged: out of the budget
        self.c.create_pool("filler", **{**DIMS, "capacity_blocks": 8192})
        self.c.grow("filler", 8000)  # 500 of the 512 MiB budget: kv's 32 MiB do not fit
        with self.assertRaises(kvd.KvdError) as e:
            self.c.wake("kv")
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        pool = self.c.pool("kv")
        self.assertEqual((pool.state, pool.kept_bytes), (SLEEPING, 2 * 16 << 20))
        self.assertEqual(self.metrics()["kvd_host_tier_used_bytes"], 2 * 16 << 20)
        self.c.delete("filler")
        self.c.wake("kv")
        self.assert_blocks(self.m, range(BLOCKS), what="after a refused wake and a second one")

    def test_sleep_all_keeping_stops_at_the_pool_the_tier_cannot_hold(self):
        self.c.create_pool("other", **DIMS)
        self.c.grow("other", BLOCKS)  # the tier (48 MiB) holds one of the two pools' 32 MiB, not both
        with self.assertRaises(kvd.KvdError) as e:
            self.c.sleep(keep=True, live_blocks=[1])
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("live_blocks", e.exception.message)
        self.assertEqual({p.name: p.state for p in self.c.pools()}, {"kv": AWAKE, "other": AWAKE})
        with self.assertRaises(kvd.KvdError) as e:
            self.c.sleep(keep=True)
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        # The pool put to sleep before the one that failed stays asleep with its contents; that one is awake.
        pools = {p.name: (p.state, p.kept_bytes) for p in self.c.pools()}
        self.assertEqual(sorted(pools.values()), [(AWAKE, 0), (SLEEPING, 2 * 16 << 20)], pools)
        self.c.wake()
        self.assert_blocks(self.m, range(BLOCKS), what="after a sleep of all that stopped")

    def test_a_restart_without_an_fd_store_loses_the_kept_bytes_and_says_so(self):
        self.m.close()
        self.c.sleep("kv", keep=True)
        self.c.close()
        self.kvd.terminate()
        self.restart_daemon(0)  # DURABILITY_CLIENTS: no FD store holds the tier's memfd
        c = kvd.connect(self.socket, client_name="engine-2")
        self.addCleanup(c.close)
        self.assertEqual(c.device_info().durability, kvd.v1_pb2.DURABILITY_CLIENTS)
        pool = c.pool("kv")
        self.assertEqual((pool.state, pool.kept_bytes, pool.wake_blocks), (SLEEPING, 0, BLOCKS))
        self.assertIn(f"pool kv: the {2 * 16 << 20} bytes it kept in the host tier are lost", self.log())
        self.assertEqual(self.metrics()["kvd_host_tier_used_bytes"], 0)
        c.wake("kv")
        self.assert_zero(c.attach("kv", client_name="engine-2"), range(BLOCKS))

    def test_the_engine_exits_while_the_pool_sleeps_and_finds_its_bytes_after_wake(self):
        self.c.sleep("kv", keep=True)
        self.m.close()
        self.c.close()
        c = kvd.connect(self.socket, client_name="engine-2")
        self.addCleanup(c.close)
        self.assertEqual(c.pool("kv").kept_bytes, 2 * 16 << 20)
        c.wake("kv")
        self.assert_blocks(c.attach("kv", client_name="engine-2"), range(BLOCKS), what="after the engine restart")

    def test_device_info_and_kvctl_status_report_the_tier(self):
        from scrape import poll
        poll(lambda: self.c.device_info().host_tier_ready, "DeviceInfo.host_tier_ready")
        d = self.c.device_info()
        self.assertEqual((d.host_tier_bytes, d.host_tier_used_bytes), (48 << 20, 0))
        self.assertIn("host tier    48.0 MiB, 0 B kept by sleeping pools\n", self.kvctl("status").stdout)
        self.m.close()
        self.c.sleep("kv", keep=True)
        self.assertEqual(self.c.device_info().host_tier_used_bytes, 2 * 16 << 20)
        self.assertIn("32.0 MiB kept by sleeping pools", self.kvctl("status").stdout)
        self.assertEqual(self.c.device_info().host_tier_bytes, 48 << 20)

    def test_the_metrics_count_the_tier_its_use_and_every_byte_copied(self):
        from scrape import poll
        poll(lambda: self.metrics().get("kvd_host_tier_registered") == 1, "the tier to be registered")
        m = self.metrics()
        self.assertEqual(m["kvd_host_tier_bytes"], 48 << 20)
        self.assertEqual(m["kvd_host_tier_used_bytes"], 0)
        self.assertEqual(m["kvd_host_tier_numa_node"], -1)  # the host backend names no node
        self.assertEqual(m["kvd_host_tier_copied_bytes_total{direction=to_host}"], 0)
        kept = 2 * 16 << 20
        self.c.sleep("kv", keep=True)
        m = self.metrics()
        self.assertEqual(m["kvd_host_tier_used_bytes"], kept)
        self.assertEqual(m["kvd_host_tier_copied_bytes_total{direction=to_host}"], kept)
        self.assertEqual(m["kvd_host_tier_copied_bytes_total{direction=to_device}"], 0)
        self.assertGreater(m["kvd_host_tier_copy_seconds_total{direction=to_host}"], 0)
        self.c.wake("kv")
        m = self.metrics()
        self.assertEqual(m["kvd_host_tier_used_bytes"], 0)
        self.assertEqual(m["kvd_host_tier_copied_bytes_total{direction=to_device}"], kept)
        self.assertGreater(m["kvd_host_tier_copy_seconds_total{direction=to_device}"], 0)

    def test_deleting_a_pool_that_keeps_its_contents_gives_the_tier_back(self):
        self.m.close()
        self.c.sleep("kv", keep=True)
        self.assertEqual(self.metrics()["kvd_host_tier_used_bytes"], 2 * 16 << 20)
        self.c.delete("kv")
        self.assertEqual(self.metrics()["kvd_host_tier_used_bytes"], 0)
        # A pool deleted while a group's keeping sleep is prepared: the prepared copy's extent comes back too.
        self.c.create_pool("kv", **DIMS)
        self.c.grow("kv", BLOCKS)
        self.c.prepare("kv", "sleep", keep=True)
        self.assertEqual(self.metrics()["kvd_host_tier_used_bytes"], 2 * 16 << 20)
        self.c.delete("kv", force=True)
        from scrape import poll
        poll(lambda: self.metrics()["kvd_host_tier_used_bytes"] == 0, "the prepared extent to come back")

    def test_group_sleep_keeps_at_prepare_and_abort_gives_the_tier_back(self):
        prepared = self.c.prepare("kv", "sleep", keep=True)
        self.assertEqual(self.c.pool("kv").state, AWAKE)
        self.c.abort(prepared.transaction)
        self.assertEqual(self.c.pool("kv").kept_bytes, 0)
        self.assert_blocks(self.m, range(BLOCKS), what="after an aborted keeping sleep")
        prepared = self.c.prepare("kv", "sleep", keep=True)
        self.c.commit(prepared.transaction)
        self.assertEqual(self.c.pool("kv").kept_bytes, 2 * 16 << 20)
        self.c.commit(self.c.prepare("kv", "wake").transaction)
        self.assert_blocks(self.m, range(BLOCKS), what="after a two-phase sleep and wake")
        with self.assertRaises(kvd.KvdError) as e:
            self.c.prepare("kv", "shrink", target_blocks=10, keep=True)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")

    def test_a_writing_engine_of_another_session_pauses_before_the_copy(self):
        writer = kvd.connect(self.socket, client_name="writer")
        self.addCleanup(writer.close)
        state = {"paused": False, "seed": 0}
        lock = threading.Condition()
        stop = threading.Event()

        pausing = threading.Event()

        def on_pause(ranges):
            pausing.set()  # the writer starts no new pass (Python's locks are not fair: it could keep this one)
            with lock:
                state["paused"] = True  # the writer finishes its pass first (it holds the lock through it)

        m2 = writer.attach("kv", client_name="writer", on_pause=on_pause)

        def write_loop():
            while not stop.is_set():
                if pausing.is_set() and not state["paused"]:
                    time.sleep(0.001)  # let on_pause take the lock
                    continue
                with lock:
                    if state["paused"] or m2.state != AWAKE:
                        lock.wait(0.01)
                        continue
                    state["seed"] += 1
                    self.write(m2, state["seed"])

        t = threading.Thread(target=write_loop, daemon=True)
        t.start()
        self.addCleanup(stop.set)
        from scrape import poll
        poll(lambda: state["seed"] >= 3, lambda: "the writer to write")
        self.c.sleep("kv", keep=True)
        with lock:
            last = state["seed"]
        stop.set()
        t.join()
        self.c.wake("kv")
        self.assert_blocks(self.m, range(BLOCKS), seed=last, what="as the writer last wrote them")

    def test_kvctl_sleep_keep_and_describe(self):
        self.m.close()  # kvctl is another session: a Mapping that is not pausable would refuse the sleep
        r = self.kvctl("sleep", "kv", "--keep")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("MiB kept in the host tier", r.stdout)
        r = self.kvctl("describe", "kv")
        self.assertIn("kept", r.stdout)
        r = self.kvctl("wake", "kv")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_blocks(self.c.attach("kv"), range(BLOCKS), what="after kvctl sleep --keep")
        r = self.kvctl("sleep", "kv", "--live-blocks", "1,2")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--keep", r.stderr)


class NoHostTierTest(KvdDaemonCase):
    def kvd_args(self):
        from scrape import free_port
        self.metrics_port = free_port()
        return [f"--metrics-address=127.0.0.1:{self.metrics_port}"]

    def test_keep_without_a_tier_is_refused_and_nothing_changes(self):
        c = kvd.connect(self.socket)
        self.addCleanup(c.close)
        c.create_pool("kv", **DIMS)
        c.grow("kv", 64)
        with self.assertRaises(kvd.KvdError) as e:
            c.sleep("kv", keep=True)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("--host-tier-bytes", e.exception.message)
        self.assertEqual(c.pool("kv").state, AWAKE)
        with self.assertRaises(kvd.KvdError) as e:  # a group's keeping sleep likewise, at its Prepare
            c.prepare("kv", "sleep", keep=True)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("--host-tier-bytes", e.exception.message)
        self.assertEqual((c.pool("kv").state, c.pool("kv").transaction), (AWAKE, ""))
        from scrape import http_get
        text = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        self.assertIn("kvd_waiting_requests", text)
        self.assertNotIn("kvd_host_tier", text, "the tier's metrics are served only with --host-tier-bytes")

    def test_a_tier_that_is_not_a_multiple_of_the_granularity_is_refused_at_start(self):
        r = subprocess.run([os.environ["KVD_BINARY"], "--backend=host", f"--socket={self.dir}/gpu1.sock",
                            "--device=1", "--host-capacity=1GiB", "--host-granularity=2MiB", "--host-tier-bytes=3MiB"],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--host-tier-bytes", r.stdout + r.stderr)


class HostTierRestartTest(unittest.TestCase):
    """kvd restarted under a played service manager: the tier's memfd waits in the FD store as "host-tier"."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-tier-")
        os.chmod(self.dir, 0o750)
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.socket = os.path.join(self.dir, "gpu0.sock")
        self.log_path = os.path.join(self.dir, "kvd.log")
        self.manager = PlayedManager(self.dir)
        self.addCleanup(self.manager.close)
        self.clients = []
        self.addCleanup(self.close_clients)

    def close_clients(self):
        for c in self.clients:
            c.close()
        self.clients = []

    def start(self, tier=TIER):
        self.close_clients()
        self.manager.start([os.environ["KVD_BINARY"], "--backend=host", f"--socket={self.socket}",
                            "--host-capacity=512MiB", f"--host-tier-bytes={tier}"], self.log_path)
        c = kvd.connect(self.socket, client_name="engine")
        self.clients.append(c)
        return c

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def sleep_with_contents(self):
        c = self.start()
        c.create_pool("kv", **DIMS)
        c.grow("kv", BLOCKS // 2)
        c.grow("kv", BLOCKS)
        m = c.attach("kv", client_name="engine")
        d = m.geometry.dims
        shape = (d["heads"], d["block_tokens"], d["channels"])
        for layer in range(d["layers"]):
            m.layer(layer, "uint16")[:BLOCKS] = pattern(layer, range(BLOCKS), shape, seed=5)
        m.close()
        c.sleep("kv", keep=True)
        self.assertEqual(c.pool("kv").kept_bytes, 2 * 16 << 20)
        self.assertIn("host-tier", self.manager.stored())
        return shape, d["layers"]

    def wake_and_read(self, c, shape, layers):
        c.wake("kv")
        m = c.attach("kv", client_name="engine")
        self.addCleanup(m.close)
        return [m.layer(layer, "uint16")[:BLOCKS].copy() for layer in range(layers)]

    def test_the_kept_bytes_outlive_a_sigterm_and_a_sigkill_of_kvd(self):
        shape, layers = self.sleep_with_contents()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self.manager.kill(sig)
            c = self.start()
            pool = c.pool("kv")
            self.assertEqual((pool.state, pool.kept_bytes), (SLEEPING, 2 * 16 << 20), sig)
            got = self.wake_and_read(c, shape, layers)
            for layer in range(layers):
                want = pattern(layer, range(BLOCKS), shape, seed=5)
                self.assertEqual(int(np.count_nonzero(got[layer] != want)), 0, f"layer {layer} after {sig!r}")
            c.sleep("kv", keep=True)  # and again for the next round
        self.assertEqual(self.manager.stored().count("host-tier"), 1)

    def test_a_tier_of_another_size_drops_the_kept_bytes_and_says_so(self):
        shape, layers = self.sleep_with_contents()
        self.manager.kill(signal.SIGTERM)
        c = self.start(tier="64MiB")
        pool = c.pool("kv")
        self.assertEqual((pool.state, pool.kept_bytes), (SLEEPING, 0))
        self.assertIn("bytes it kept in the host tier are lost", self.log())
        got = self.wake_and_read(c, shape, layers)
        self.assertFalse(any(g.any() for g in got), "the pool woke with fresh memory")
        self.assertEqual(self.manager.stored().count("host-tier"), 1, "the old tier was taken out of the store")


if __name__ == "__main__":
    unittest.main()
