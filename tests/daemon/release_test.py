"""Releases that never fault a running engine (docs/api.md, "Releases and running engines"): engine
processes that map a pool through the Python package and read every block of it in a loop, while an
operator sleeps, shrinks (whole chunks and exact) and deletes the pool with kvctl, on the real kvd (host
backend). A fault would kill the engine with SIGSEGV; each case checks that it is alive, that its reader
kept going, and that the bytes below the new size are intact.

Each engine is this file again (`--engine SOCKET POOL MODE BLOCKS`), driven by JSON lines on stdin/stdout.
It writes pattern(layer, b) into blocks [0, BLOCKS), then a reader thread reads and checks them, pass after
pass. MODE "pausable": on_pause waits for the reader to finish its pass and stops it, on_resume lets it go
on (reading what is still committed; nothing while the pool sleeps or once it is lost). MODE "stuck": as
pausable, but on_pause then blocks until the test says "unstick" (an engine that does not pause in time).
MODE "plain": no hooks at all; the reader reads [0, BLOCKS) for ever, knowing nothing of the pool's changes.

Run: KVD_BINARY=<build>/daemon/kvd KVCTL_BINARY=<build>/client/kvctl/kvctl \
     PYTHONPATH=<src>/client/python:<src>/tests/testing KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so \
     /usr/bin/python3 release_test.py -v
No sleeps as assertions: waits are bounded polls.
"""

import json
import os
import subprocess
import sys
import threading
import unittest

import kvd
from kvd_daemon import KvdDaemonCase
from line_peer import LinePeer
from scrape import poll

# 2 layers, 8 heads, 16 tokens, 128 channels, fp16: 32 KiB per block and segment, 64 blocks a 2 MiB granule.
DIMS = dict(layers=2, capacity_blocks=2048, heads=8, block_tokens=16, channels=128, element_bytes=2)
BLOCKS = 1024  # 32 MiB per segment, grown in 4 steps: 4 chunks per segment
AWAKE, SLEEPING = kvd.v1_pb2.POOL_STATE_AWAKE, kvd.v1_pb2.POOL_STATE_SLEEPING


def pattern(layer, blocks, shape):
    import numpy as np
    b = np.asarray(blocks, dtype=np.uint64)
    word = (b * np.uint64(2654435761) + np.uint64(layer * 40503 + 17)) & np.uint64(0xFFFFFFFF)
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
    return ((word[:, None] + idx[None, :]) & np.uint64(0xFFFF)).astype(np.uint16).reshape(len(b), *shape)


# --- the engine process ----------------------------------------------------------------------------

def engine_main(socket_path, pool, mode, blocks):
    import numpy as np
    blocks = int(blocks)
    c = kvd.connect(socket_path, client_name=f"engine-{mode}")
    idle = threading.Condition()
    st = {"passes": 0, "bad": 0, "paused": False, "reading": False, "pauses": 0, "resumes": 0, "lost": None,
          "error": None, "slept": False, "woke_zeroed": None}

    unstuck = threading.Event()

    def on_pause(ranges):
        with idle:  # the engine's side of a pause: finish the pass, then touch nothing
            st["paused"] = True
            st["pauses"] += 1
            idle.wait_for(lambda: not st["reading"], timeout=30)
        if mode == "stuck":
            unstuck.wait()

    def on_resume(applied):
        with idle:
            st["paused"] = False
            st["resumes"] += 1
            st["slept"] = m.state == SLEEPING  # touch nothing until on_grow brings the memory back
            idle.notify_all()

    def on_grow(committed_blocks):
        # After a wake: the memory is fresh (zeroed); the engine writes its blocks again before it reads on.
        with idle:
            if st["slept"]:
                st["woke_zeroed"] = all(not v[:blocks].any() for v in views)
                for layer, v in enumerate(views):
                    v[:blocks] = expected[layer]
                st["slept"] = False

    def on_lost(why):
        st["lost"] = str(why)

    hooks = dict(on_pause=on_pause, on_resume=on_resume, on_grow=on_grow, on_lost=on_lost) if mode != "plain" else {}
    m = c.attach(pool, client_name=f"engine-{mode}", **hooks)
    d = m.geometry.dims
    shape = (d["heads"], d["block_tokens"], d["channels"])
    views = [m.layer(layer, "uint16") for layer in range(d["layers"])]  # taken once, as an engine does
    for layer, v in enumerate(views):
        v[:blocks] = pattern(layer, range(blocks), shape)
    expected = [pattern(layer, range(blocks), shape) for layer in range(d["layers"])]

    def readable():
        if mode == "plain":
            return blocks  # knows nothing: reads what it wrote, for ever
        if st["paused"] or st["slept"] or m.gone is not None or m.state != AWAKE:
            return 0
        return min(blocks, m.committed_blocks)

    stop = threading.Event()

    def reader():
        while not stop.is_set():
            with idle:
                n = readable()
                st["reading"] = n > 0
            try:
                for layer, v in enumerate(views):
                    if n:
                        st["bad"] += int(np.count_nonzero(v[:n] != expected[layer][:n]))
            except Exception as e:  # not a fault: a Python error in the reader would show here
                st["error"] = f"{type(e).__name__}: {e}"
            with idle:
                st["reading"] = False
                idle.notify_all()
            if n:
                st["passes"] += 1
            else:
                stop.wait(0.002)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    print(json.dumps({"ok": True, "result": m.client_id}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "state":
            r = dict(st, committed=m.committed_blocks, state=int(m.state), gone=str(m.gone) if m.gone else None)
        elif op == "unstick":
            unstuck.set()
            r = True
        elif op == "close":  # the engine lets go of the pool (Mapping.close): a forced release completes
            stop.set()
            t.join()
            m.close()
            r = True
        elif op == "exit":
            unstuck.set()
            stop.set()
            t.join()
            m.close()
            c.close()
            print(json.dumps({"ok": True}), flush=True)
            return 0
        else:
            print(json.dumps({"ok": False, "error": f"unknown op {op}"}), flush=True)
            continue
        print(json.dumps({"ok": True, "result": r}), flush=True)
    return 0


class Engine(LinePeer):
    def __init__(self, socket_path, pool, mode):
        super().__init__([sys.executable, os.path.abspath(__file__), "--engine", socket_path, pool, mode, str(BLOCKS)],
                         f"{mode} engine")
        self.client_id = self._reply()

    def passes_go_on(self):
        """The reader completes more passes from now on (it is running, not stuck or dead)."""
        before = self("state")["passes"]
        poll(lambda: self("state")["passes"] >= before + 3, lambda: f"{self.name} to read on: {self('state')}")

    def assert_alive(self, test):
        test.assertIsNone(self.p.poll(), f"{self.name} died (exit {self.p.poll()}: -11 is SIGSEGV)")
        s = self("state")
        test.assertEqual(s["bad"], 0, f"{self.name} read bytes that differ")
        test.assertIsNone(s["error"], self.name)
        return s


class ReleaseTest(KvdDaemonCase):
    def setUp(self):
        super().setUp()
        self.c = kvd.connect(self.socket, client_name="operator")
        self.addCleanup(self.c.close)
        self.c.create_pool("kv", **DIMS)
        for step in range(1, 5):
            self.c.grow("kv", BLOCKS * step // 4)

    def engine(self, mode):
        e = Engine(self.socket, "kv", mode)
        self.addCleanup(e.close)
        e.passes_go_on()
        return e

    def kvctl(self, *args):
        return subprocess.run([os.environ["KVCTL_BINARY"], f"--socket={self.socket}", *args], capture_output=True,
                              text=True, timeout=120)

    def pending(self):
        return self.c.pool("kv").pending_release_bytes

    # --- pausable engines: paused first, never faulted ---------------------------------------------

    def test_sleep_pauses_a_reading_engine_first_and_wake_gives_it_the_pool_back(self):
        e = self.engine("pausable")
        r = self.kvctl("sleep", "kv", "--wait")
        self.assertEqual(r.returncode, 0, r.stderr)
        s = e.assert_alive(self)
        self.assertEqual((s["pauses"], s["resumes"], s["state"], s["committed"]), (1, 1, SLEEPING, 0))
        self.assertEqual(self.pending(), 0)
        self.assertEqual(self.kvctl("wake", "kv").returncode, 0)
        s = poll(lambda: (lambda s: s if s["state"] == AWAKE and not s["slept"] else None)(e("state")),
                 lambda: f"the engine to wake and write its blocks again: {e('state')}")
        self.assertTrue(s["woke_zeroed"], "a woken pool's memory reads back as zero")
        e.passes_go_on()
        e.assert_alive(self)

    def test_forced_delete_pauses_a_reading_engine_first(self):
        e = self.engine("pausable")
        r = self.kvctl("delete", "kv", "--force")
        self.assertEqual(r.returncode, 0, r.stderr)
        s = poll(lambda: (lambda s: s if s["lost"] else None)(e("state")), lambda: f"on_lost: {e('state')}")
        s = e.assert_alive(self)
        self.assertEqual((s["pauses"], s["resumes"]), (1, 0))
        self.assertIn("was deleted", s["lost"])
        poll(lambda: self.c.device_info().committed_bytes == 0, lambda: "the deleted pool's bytes to go")

    def test_whole_chunk_and_exact_shrinks_pause_a_reading_engine_and_keep_the_bytes_below(self):
        e = self.engine("pausable")
        r = self.kvctl("shrink", "kv", f"--blocks={BLOCKS // 2}", "--whole-chunks", "--wait")
        self.assertEqual(r.returncode, 0, r.stderr)
        s = e.assert_alive(self)
        self.assertEqual((s["pauses"], s["committed"]), (1, BLOCKS // 2))
        e.passes_go_on()
        r = self.kvctl("shrink", "kv", f"--blocks={BLOCKS // 2 - 100}", "--wait")
        self.assertEqual(r.returncode, 0, r.stderr)
        s = e.assert_alive(self)
        self.assertEqual(s["pauses"], 2)
        e.passes_go_on()
        self.assertEqual(e.assert_alive(self)["bad"], 0)

    def test_an_engine_that_does_not_pause_in_time_makes_the_sleep_fail_and_nothing_changes(self):
        stuck = self.engine("stuck")
        other = self.engine("pausable")
        before = self.c.pool("kv")
        with self.assertRaises(kvd.KvdError) as caught:
            self.c.sleep("kv", wait=True, pause_timeout=0.5)
        self.assertEqual(caught.exception.code, "DEADLINE_EXCEEDED", caught.exception.message)
        self.assertIn(stuck.client_id, caught.exception.message)
        self.assertIn("nothing changed", caught.exception.message)
        after = self.c.pool("kv")
        self.assertEqual((after.state, after.committed_blocks, after.pending_release_bytes),
                         (AWAKE, BLOCKS, 0))
        self.assertEqual(sorted(c.id for c in after.chunks), sorted(c.id for c in before.chunks))
        # The other engine got its RESUME (nothing applied) and reads on; so does the stuck one once free.
        poll(lambda: (lambda s: s["pauses"] == s["resumes"] == 1)(other("state")), lambda: f"{other('state')}")
        other.passes_go_on()
        other.assert_alive(self)
        stuck("unstick")
        poll(lambda: (lambda s: s["pauses"] == s["resumes"] == 1)(stuck("state")), lambda: f"{stuck('state')}")
        stuck.passes_go_on()
        stuck.assert_alive(self)
        # With detach_unresponsive the sleep goes on past an engine that is stuck again.
        stuck2 = self.engine("stuck")
        [slept] = self.c.sleep("kv", pause_timeout=0.5, detach_unresponsive=True)
        self.assertEqual(slept.pool.state, SLEEPING)
        self.assertGreater(slept.pool.pending_release_bytes, 0, "the detached engine still maps it: counted")
        stuck2("unstick")
        stuck2.assert_alive(self)

    # --- engines without hooks: refused unless forced, never faulted ---------------------------------

    def test_a_sleep_or_shrink_past_an_engine_without_hooks_is_refused_naming_it(self):
        e = self.engine("plain")
        for args in (["sleep", "kv", "--wait"], ["shrink", "kv", f"--blocks={BLOCKS // 2}", "--whole-chunks"],
                     ["shrink", "kv", f"--blocks={BLOCKS // 2 - 100}"]):
            r = self.kvctl(*args)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn("FAILED_PRECONDITION", r.stderr, args)
            self.assertIn(e.client_id, r.stderr, args)
        pool = self.c.pool("kv")
        self.assertEqual((pool.state, pool.committed_blocks), (AWAKE, BLOCKS))
        e.passes_go_on()
        e.assert_alive(self)

    def test_a_forced_sleep_leaves_an_engine_without_hooks_its_memory_until_it_closes(self):
        e = self.engine("plain")
        r = self.kvctl("sleep", "kv", "--force")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.c.pool("kv").state, SLEEPING)
        s = poll(lambda: (lambda s: s if s["gone"] else None)(e("state")), lambda: f"the Mapping lost: {e('state')}")
        self.assertIn("by force", s["gone"])
        e.passes_go_on()  # still reading the memory it maps
        e.assert_alive(self)
        self.assertGreater(self.pending(), 0, "the engine's memory stays counted while it maps it")
        e("close")
        poll(lambda: self.pending() == 0, lambda: f"the release to complete: {self.pending()} bytes pending")

    def test_a_forced_delete_leaves_an_engine_without_hooks_its_memory_until_it_closes(self):
        e = self.engine("plain")
        held = self.c.device_info().committed_bytes
        r = self.kvctl("delete", "kv", "--force")
        self.assertEqual(r.returncode, 0, r.stderr)
        poll(lambda: e("state")["gone"], lambda: f"the Mapping lost: {e('state')}")
        e.passes_go_on()
        e.assert_alive(self)
        self.assertEqual(self.c.device_info().committed_bytes, held, "still counted while the engine maps it")
        e("close")
        poll(lambda: self.c.device_info().committed_bytes == 0, lambda: "the engine's memory to be given back")

    def test_an_engine_releasing_its_own_pool_is_not_paused(self):
        # The caller's own session: the engine asked for it, so no pause and no refusal.
        m = self.c.attach("kv")
        self.addCleanup(m.close)
        self.c.shrink("kv", BLOCKS // 2, whole_chunks_only=True, wait=True)
        self.assertEqual(m.committed_blocks, BLOCKS // 2)
        self.c.sleep("kv", wait=True)
        self.assertEqual(m.state, SLEEPING)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        sys.exit(engine_main(*sys.argv[2:6]))
    unittest.main()
