"""Elastic shape (issue 14; docs/api.md "Pauses and reshaping"): exact shrink, compact and compaction
shrink on the real kvd (host backend), with two engine processes that map the pool through the Python
package, pause and resume, and check their bytes after every change.

Each engine is this file again (`--engine SOCKET POOL INDEX MODE`), driven by JSON lines on stdin/stdout.
Engine i owns the blocks b with b % 2 == i: it writes pattern(i, layer, b) into them through its numpy
views, and checks every block (both engines' patterns) after each change. MODE: "pausable" (on_pause
returns at once), "stuck" (on_pause blocks until told otherwise: a client that never acknowledges) or
"plain" (no on_pause: not pausable).

Run: KVD_BINARY=<build>/daemon/kvd PYTHONPATH=<src>/client/python:<src>/tests/testing \
     KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so /usr/bin/python3 reshape_test.py -v
No sleeps as assertions: waits are bounded polls.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import unittest

import kvd
from kvd_daemon import KvdDaemonCase
from line_peer import LinePeer
from scrape import free_port, http_get, memfd_fds, parse_samples, poll

POLL_S = 30.0
MiB = 1 << 20
# 2 layers (2 segments), 32 heads, 16 tokens, 128 channels, fp16: 128 KiB per block and segment, so the
# 2 MiB granularity is 16 blocks; a pool of 256 blocks is 32 MiB per segment.
DIMS = dict(layers=2, capacity_blocks=1024, heads=32, block_tokens=16, channels=128, element_bytes=2)
GRANULE_BLOCKS = 16


def pattern(owners, layer, seeds, shape):
    """What block seeds[i] of `layer` holds when engine owners[i] wrote it: uint16 [len(seeds), H, N, C]."""
    import numpy as np
    seeds = np.asarray(seeds, dtype=np.uint64)
    owners = np.asarray(owners, dtype=np.uint64)
    word = (seeds * np.uint64(2654435761) + np.uint64(layer * 40503) + owners * np.uint64(7919)) & np.uint64(0xFFFFFFFF)
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
    return ((word[:, None] + idx[None, :]) & np.uint64(0xFFFF)).astype(np.uint16).reshape(len(seeds), *shape)


# --- the engine process ----------------------------------------------------------------------------

def engine_main(socket_path, pool, index, mode):
    import numpy as np
    index = int(index)
    c = kvd.connect(socket_path, client_name=f"engine-{index}")
    seen = {"in_pause": False, "pause_ranges": [], "resumed": []}
    unstuck = threading.Event()
    # The engine's own discipline: no access to the pool between on_pause and on_resume (a pause the
    # daemon starts on its own may come at any time).
    gate = threading.Lock()

    def on_pause(ranges):
        gate.acquire()
        seen["in_pause"] = True
        seen["pause_ranges"].append([list(r) for r in ranges])
        if mode == "stuck":
            unstuck.wait()

    def on_resume(applied):
        seen["in_pause"] = False
        seen["resumed"].append(applied)
        if gate.locked():
            gate.release()

    m = c.attach(pool, client_name=f"engine-{index}", on_pause=on_pause if mode != "plain" else None,
                 on_resume=on_resume)
    d = m.geometry.dims
    shape = (d["heads"], d["block_tokens"], d["channels"])
    print(json.dumps({"ok": True, "result": m.client_id}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "write":  # this engine's blocks in [lo, hi), every layer
                lo, hi = cmd["lo"], cmd["hi"]
                blocks = np.arange(lo + (index - lo) % 2, hi, 2)
                with gate:
                    for layer in range(d["layers"]):
                        m.layer(layer, "uint16")[blocks] = pattern(np.full(len(blocks), index), layer, blocks, shape)
                r = len(blocks)
            elif op == "check":  # [[seed, at], ...]: block `at` holds what its owner wrote into block `seed`
                pairs = np.asarray(cmd["pairs"], dtype=np.int64).reshape(-1, 2)
                r = 0
                with gate:
                    for layer in range(d["layers"]):
                        got = m.layer(layer, "uint16")[pairs[:, 1]]
                        r += int(np.count_nonzero(got != pattern(pairs[:, 0] % 2, layer, pairs[:, 0], shape)))
            elif op == "state":
                r = {"committed": m.committed_blocks, "chunks": m.mapped_chunks, "pauses": m.pauses,
                     "resumes": m.resumes, "in_pause": seen["in_pause"], "pause_ranges": seen["pause_ranges"],
                     "resumed": seen["resumed"], "gone": str(m.gone) if m.gone is not None else None,
                     "memfds": memfd_fds()}
            elif op == "unstick":
                unstuck.set()
                r = True
            elif op == "exit":
                unstuck.set()
                m.close()
                c.close()
                print(json.dumps({"ok": True}), flush=True)
                return 0
            else:
                raise ValueError(f"unknown op {op}")
            print(json.dumps({"ok": True, "result": r}), flush=True)
        except Exception as e:  # reported to the test, which fails on it
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
    return 0


class Engine(LinePeer):
    def __init__(self, socket_path, pool, index, mode="pausable"):
        self.index = index
        super().__init__([sys.executable, os.path.abspath(__file__), "--engine", socket_path, pool, str(index), mode],
                         f"engine-{index}")
        self.client_id = self._reply()  # attached, mapped and following

    def close(self):
        super().close(timeout=POLL_S)




def table(pool):
    """A pool's chunk table, comparable."""
    return [(c.id, c.segment, c.offset, c.bytes) for c in pool.chunks]


def kept(blocks, moves=()):
    """check pairs: every block below `blocks` holds its own pattern, except a move's destination, which
    holds its source's."""
    dst = {d: s for s, d in moves}
    return [[dst.get(b, b), b] for b in range(blocks)]


class ReshapeTest(KvdDaemonCase):
    def kvd_args(self):
        args = ["--max-chunk=256MiB"]
        if self._testMethodName == "test_budget_full_refuses_the_replacement_chunk":
            # 64 MiB for the pool of 256 blocks and 6 MiB more: no replacement chunk of shrink fits.
            args.append("--budget=70MiB")
        if self._testMethodName == "test_the_daemon_compacts_a_fragmented_pool_on_its_own_when_every_client_pauses":
            args.append("--compact-above-chunks=6")
        if self._testMethodName == "test_a_full_budget_compacts_and_shrinks_in_steps_that_fit_what_is_free":
            # 896 MiB of the 1 GiB budget: 128 MiB free. The host device has more, so the budget binds.
            args += ["--budget=1GiB", "--host-capacity=2GiB"]
        if self._testMethodName == "test_an_attach_during_a_reshape_waits_for_it_and_maps_what_it_left":
            args.append("--log-level=debug")
        if self._testMethodName == "test_metrics_count_pauses_copies_and_compactions":
            self.metrics_port = free_port()
            args += [f"--metrics-address=127.0.0.1:{self.metrics_port}", "--compact-above-chunks=6"]
        return args

    def setUp(self):
        super().setUp()
        self.c = kvd.connect(self.socket, client_name="reshape-test")
        self.addCleanup(self.c.close)

    def create(self, initial, name="kv"):
        pool = self.c.create_pool(name, initial_blocks=initial, **DIMS)
        self.g = pool.geometry
        return pool

    def engine(self, index, mode="pausable", pool="kv"):
        e = Engine(self.socket, pool, index, mode)
        self.addCleanup(e.close)
        return e

    def engines(self, pool="kv", modes=("pausable", "pausable")):
        return [self.engine(i, mode, pool) for i, mode in enumerate(modes)]

    def prefix_bytes(self, blocks):
        """What every segment's committed prefix at `blocks` (rounded up to the granularity) holds, summed."""
        g = self.g
        per_segment = -(-blocks * g.block_stride // g.granularity_bytes) * g.granularity_bytes
        return per_segment * g.segments

    def write_all(self, engines, blocks):
        for e in engines:
            e("write", lo=0, hi=blocks)

    def assert_intact(self, engines, pairs):
        for e in engines:
            self.assertEqual(e("check", pairs=pairs), 0, f"{e.name}: bytes differ")

    def assert_follows(self, engines, pool):
        """Every engine maps exactly the pool's chunks, one FD each, at the pool's size."""
        ids = sorted(c.id for c in pool.chunks)
        for e in engines:
            # The replaced chunks' handles and FDs go right after the engine resumed (not during its pause):
            # wait for that too.
            st = poll(lambda: (lambda s: s if s["chunks"] == ids and s["committed"] == pool.committed_blocks
                               and s["memfds"] == len(ids) else None)(e("state")),
                      lambda: f"{e.name} to map chunks {ids} at {pool.committed_blocks} blocks with one FD each: "
                              f"{e('state')}")
            self.assertIsNone(st["gone"], e.name)
            self.assertFalse(st["in_pause"], e.name)

    def assert_exact(self, update, target, holders=True):
        """The pool's prefix is at `target` rounded up to the granularity; `holders`: no detached client
        holds chunks (the daemon then counts exactly the pool's bytes)."""
        pool = update.pool
        self.assertTrue(update.reshape.target_reached, update)
        self.assertEqual(pool.committed_bytes, self.prefix_bytes(target), update)
        self.assertEqual(pool.committed_blocks, -(-target // GRANULE_BLOCKS) * GRANULE_BLOCKS, update)
        if holders:  # once every client acknowledged the release
            poll(lambda: self.c.device_info().committed_bytes == pool.committed_bytes,
                 f"the daemon to count only the pool's {pool.committed_bytes} bytes")
        for ch in pool.chunks:  # nothing past the prefix of its segment
            seg_start = ch.segment * self.g.segment_stride
            self.assertLessEqual(ch.offset + ch.bytes - seg_start, self.prefix_bytes(target) // self.g.segments)

    # -- exact shrink -----------------------------------------------------------------------------
    def test_exact_shrink_inside_a_chunk_keeps_the_bytes_below_the_target_in_both_processes(self):
        pool = self.create(256)  # one chunk per segment
        self.assertEqual(len(pool.chunks), 2)
        self.assertEqual(pool.committed_bytes, self.prefix_bytes(256))
        engines = self.engines()
        self.write_all(engines, 256)
        self.assert_intact(engines, kept(256))

        u = self.c.shrink("kv", 100)
        r = u.reshape
        self.assert_exact(u, 100)
        self.assertEqual((r.chunks_before, r.chunks_after, r.chunks_replaced, r.chunks_added), (2, 2, 2, 2), r)
        self.assertEqual(r.copied_bytes, self.prefix_bytes(100), r)
        self.assertEqual((r.paused_clients, r.resumed_clients), (2, 2), r)
        self.assertGreater(r.pause_us, 0, r)
        self.assertEqual(sorted(c.id for c in u.added), sorted(c.id for c in u.pool.chunks))
        self.assertEqual(list(r.detached_client_ids), [])
        self.assert_follows(engines, u.pool)
        for e in engines:
            st = e("state")
            self.assertEqual((st["pauses"], st["resumes"], st["resumed"]), (1, 1, [True]), e.name)
            self.assertTrue(st["pause_ranges"][0], e.name)  # the bytes that move
        self.assert_intact(engines, kept(u.pool.committed_blocks))
        # The new memory is the engines' to write.
        self.write_all(engines, u.pool.committed_blocks)
        self.assert_intact(engines, kept(u.pool.committed_blocks))

    def test_the_shrinking_clients_own_mapping_has_remapped_when_shrink_returns(self):
        self.create(256)
        resumed = []
        m = self.c.attach("kv", on_pause=lambda ranges: None, on_resume=resumed.append)
        self.addCleanup(m.close)
        self.assertTrue(any(cl.pausable for cl in self.c.pool("kv").clients))
        import numpy as np
        m.layer(1, "uint16")[:256] = 7
        u = self.c.shrink("kv", 40)
        self.assertTrue(u.reshape.target_reached)
        # No poll: shrink() returns once its own Mapping maps the new chunks.
        self.assertEqual(m.mapped_chunks, sorted(c.id for c in u.pool.chunks))
        self.assertEqual(m.committed_blocks, u.pool.committed_blocks)
        self.assertEqual(resumed, [True])
        self.assertTrue(np.all(m.layer(1, "uint16")[:u.pool.committed_blocks] == 7))

    def test_shrink_reaches_the_target_after_grows_sleep_and_wake(self):
        self.create(32)
        engines = self.engines()
        self.c.grow("kv", 96)
        self.c.sleep("kv", wait=True)
        self.c.wake("kv")  # one chunk per segment of 96 blocks (zeroed)
        self.c.grow("kv", 200)
        pool = self.c.pool("kv")
        self.assert_follows(engines, pool)
        self.write_all(engines, 200)

        u = self.c.shrink("kv", 150)  # inside the grown chunk
        self.assert_exact(u, 150)
        self.assert_follows(engines, u.pool)
        self.assert_intact(engines, kept(u.pool.committed_blocks))

        u = self.c.shrink("kv", 40)  # inside the woken chunk; the grown one goes whole
        self.assert_exact(u, 40)
        self.assertEqual(u.reshape.chunks_after, 2)
        self.assert_follows(engines, u.pool)
        self.assert_intact(engines, kept(u.pool.committed_blocks))
        for e in engines:
            # The sleep paused them too (docs/api.md, "Releases and running engines"), then the two shrinks.
            self.assertEqual(e("state")["resumed"], [True, True, True], e.name)

    def test_shrink_with_no_client_attached_copies_without_a_pause(self):
        self.create(256)
        writer = self.engine(0)
        writer("write", lo=0, hi=256)
        writer.close()
        poll(lambda: self.c.pool("kv").client_count == 0, "the writer to detach")
        u = self.c.shrink("kv", 100)
        self.assert_exact(u, 100)
        self.assertEqual((u.reshape.paused_clients, u.reshape.pause_us), (0, 0), u.reshape)
        reader = self.engine(0)
        self.assertEqual(reader("check", pairs=[[b, b] for b in range(0, u.pool.committed_blocks, 2)]), 0)

    # -- compact ----------------------------------------------------------------------------------
    def test_compact_of_a_pool_grown_in_32_steps_ends_with_one_chunk_per_segment(self):
        self.create(0)
        engines = self.engines()
        for step in range(1, 33):
            self.c.grow("kv", step * GRANULE_BLOCKS)
        pool = self.c.pool("kv")
        self.assertEqual(len(pool.chunks), 64)
        self.assert_follows(engines, pool)
        self.write_all(engines, 512)

        u = self.c.compact("kv")
        r = u.reshape
        self.assertEqual((r.chunks_before, r.chunks_after, r.chunks_replaced, r.chunks_added), (64, 2, 64, 2), r)
        self.assertEqual(r.copied_bytes, self.prefix_bytes(512), r)
        self.assertEqual((r.paused_clients, r.resumed_clients), (2, 2), r)
        self.assertEqual(len(u.pool.chunks), 2)
        self.assertEqual(u.pool.committed_blocks, 512)
        self.assertEqual(u.pool.committed_bytes, self.prefix_bytes(512))
        self.assert_follows(engines, u.pool)
        self.assert_intact(engines, kept(512))

    def test_compact_in_steps_pauses_once_a_step_and_keeps_every_byte(self):
        """max_chunks_per_pause=32 on 32 chunks a segment: one segment's new chunk a step, two pauses."""
        self.create(0)
        engines = self.engines()
        for step in range(1, 33):
            self.c.grow("kv", step * GRANULE_BLOCKS)
        self.assert_follows(engines, self.c.pool("kv"))
        self.write_all(engines, 512)

        u = self.c.compact("kv", max_chunks_per_pause=32)
        r = u.reshape
        self.assertEqual((r.chunks_before, r.chunks_after, r.chunks_replaced, r.chunks_added), (64, 2, 64, 2), r)
        self.assertEqual(r.steps, 2, r)
        self.assertGreater(r.max_pause_us, 0, r)
        self.assertLessEqual(r.max_pause_us, r.pause_us, r)
        self.assertEqual(r.copied_bytes, self.prefix_bytes(512), r)
        self.assertEqual((r.paused_clients, r.resumed_clients), (2, 2), r)
        self.assertEqual(len(u.added), 2)
        self.assertEqual(len(u.released_chunk_ids), 64)
        self.assert_follows(engines, u.pool)
        for e in engines:
            st = e("state")
            self.assertEqual((st["pauses"], st["resumed"]), (2, [True, True]), e.name)
        self.assert_intact(engines, kept(512))

    def test_the_daemon_compacts_a_fragmented_pool_on_its_own_when_every_client_pauses(self):
        self.create(GRANULE_BLOCKS)
        engines = self.engines()
        for step in (2, 3):
            self.c.grow("kv", step * GRANULE_BLOCKS)  # 6 chunks: not past --compact-above-chunks=6
        self.assert_follows(engines, self.c.pool("kv"))
        self.write_all(engines, 48)
        self.c.grow("kv", 64)  # 8 chunks: compacted in the background, while both engines pause
        pool = poll(lambda: (lambda p: p if len(p.chunks) == 2 else None)(self.c.pool("kv")),
                    "the daemon to compact the pool on its own")
        self.assertEqual((pool.committed_blocks, pool.committed_bytes), (64, self.prefix_bytes(64)))
        self.assert_follows(engines, pool)
        for e in engines:
            self.assertEqual(e("state")["resumed"], [True], e.name)
        self.assert_intact(engines, kept(48))
        self.assertIn("pool kv: compacted on its own past 6 chunks (--compact-above-chunks): 8 -> 2 chunks", self.log())

        # With a client that does not pause, the pool stays as it is and the log says why.
        plain = self.engine(2, "plain")
        for step in (5, 6, 7, 8):
            self.c.grow("kv", step * GRANULE_BLOCKS)
        poll(lambda: "pool kv: not compacted on its own: FAILED_PRECONDITION" in self.log(),
             "the daemon to say why it did not compact")
        self.assertIn(plain.client_id, self.log())
        self.assertEqual(len(self.c.pool("kv").chunks), 10)
        for e in engines:
            self.assertEqual(e("state")["pauses"], 1, e.name)
        self.assert_intact(engines + [plain], kept(48))

    # -- compaction shrink ------------------------------------------------------------------------
    def test_compaction_shrink_moves_live_blocks_above_the_target_below_it(self):
        self.create(256)
        engines = self.engines()
        self.write_all(engines, 256)
        live = [3, 10, 50, 120, 200, 201, 255]
        u = self.c.shrink("kv", 64, live_blocks=live)
        self.assert_exact(u, 64)
        # Into the free blocks below the target, in increasing order of both.
        moves = [(m.src, m.dst) for m in u.reshape.moved_blocks]
        self.assertEqual(moves, [(120, 0), (200, 1), (201, 2), (255, 4)])
        self.assert_follows(engines, u.pool)
        # The moved blocks' bytes are at their new numbers; the live blocks below stay.
        self.assert_intact(engines, [[s, d] for s, d in moves] + [[b, b] for b in (3, 10, 50)])

    def test_compaction_shrink_with_an_invalid_or_duplicate_live_list_changes_nothing(self):
        self.create(256)
        engines = self.engines()
        self.write_all(engines, 256)
        before = self.c.pool("kv")
        for live, extra, needle in (([5, 9, 5], {}, "live.blocks[2]: block 5 is listed twice"),
                                    ([1, 256], {}, "live.blocks[1]: block 256 is not committed"),
                                    (list(range(65)), {}, "live: 65 live blocks do not fit in target_blocks 64"),
                                    ([1, 2], {"whole_chunks_only": True}, "whole_chunks_only")):
            with self.assertRaises(kvd.KvdError, msg=str(live)) as e:
                self.c.shrink("kv", 64, live_blocks=live, **extra)
            self.assertEqual(e.exception.code, "INVALID_ARGUMENT", e.exception)
            self.assertIn(needle, e.exception.message)
            after = self.c.pool("kv")
            self.assertEqual(table(after), table(before))
            self.assertEqual((after.committed_blocks, after.generation), (before.committed_blocks, before.generation))
        for e in engines:
            self.assertEqual(e("state")["pauses"], 0, e.name)
        self.assert_intact(engines, kept(256))

    # -- clients that do not pause ----------------------------------------------------------------
    def test_a_client_that_never_acknowledges_fails_the_shrink_or_is_detached(self):
        pool = self.create(256)
        good, stuck = self.engines(modes=("pausable", "stuck"))
        self.write_all([good, stuck], 256)
        before = self.c.pool("kv")

        # 3 s: ample for the engine that does pause, even on a loaded machine (it must not be named).
        with self.assertRaises(kvd.KvdError) as e:
            self.c.shrink("kv", 100, pause_timeout=3)
        self.assertEqual(e.exception.code, "DEADLINE_EXCEEDED", e.exception)
        self.assertIn(stuck.client_id, e.exception.message)
        self.assertNotIn(good.client_id, e.exception.message)
        after = self.c.pool("kv")
        self.assertEqual(table(after), table(before))
        self.assertEqual((after.committed_blocks, after.committed_bytes), (pool.committed_blocks, pool.committed_bytes))
        poll(lambda: good("state")["resumed"] == [False], "engine-0 to resume (not applied)")
        self.assert_follows([good], after)
        self.assert_intact([good], kept(256))

        u = self.c.shrink("kv", 100, pause_timeout=3, detach_unresponsive=True)
        self.assert_exact(u, 100, holders=False)
        self.assertEqual(list(u.reshape.detached_client_ids), [stuck.client_id])
        self.assertEqual(u.reshape.paused_clients, 1)
        self.assertEqual([cl.client_id for cl in self.c.pool("kv").clients], [good.client_id])
        self.assert_follows([good], u.pool)
        self.assert_intact([good], kept(u.pool.committed_blocks))
        self.assertEqual(good("state")["resumed"], [False, True])
        # Let go, the stuck engine finds its Mapping detached: lost, everything unmapped.
        stuck("unstick")
        st = poll(lambda: (lambda s: s if s["gone"] else None)(stuck("state")), "engine-1 to lose its Mapping")
        self.assertEqual((st["chunks"], st["memfds"]), ([], 0), st)
        # Having unmapped everything, the lost Mapping said so (Detach with released): what it held is
        # no longer counted, without waiting for its session to end.
        poll(lambda: self.c.device_info().committed_bytes == u.pool.committed_bytes,
             lambda: f"the detached client's chunks to go when it let go: {self.c.device_info()} "
             f"{self.c.pool('kv')}")
        stuck.close()
        self.assertEqual(stuck.p.returncode, 0)

    def test_an_attach_during_a_reshape_waits_for_it_and_maps_what_it_left(self):
        """Note [Attach answers inline when it can] (docs/architecture.md): an Attach while a shrink holds the
        pool waits for it on a thread of its own, the quick RPCs answering meanwhile, and then maps the pool
        as the shrink left it."""
        self.create(256)
        good, stuck = self.engines(modes=("pausable", "stuck"))
        self.write_all([good, stuck], 256)
        done, late = {}, []
        shrink = threading.Thread(target=lambda: done.update(update=self.c.shrink("kv", 100, pause_timeout=120)))
        attach = threading.Thread(target=lambda: late.append(self.engine(2)))

        def let_go():  # on any failure too: the shrink, then the Attach, end once engine-1 acknowledges
            stuck("unstick")
            for t in (shrink, attach):
                if t.ident is not None:
                    t.join()
        self.addCleanup(let_go)
        shrink.start()
        poll(lambda: stuck("state")["in_pause"], "engine-1 to be paused by the shrink")
        attach.start()
        poll(lambda: "Attach to pool kv waits on a thread of its own" in self.log(), lambda: "the Attach to wait for the shrink: " + self.log()[-3000:])
        # The shrink holds the pool until engine-1 acknowledges its pause, so the Attach is still waiting.
        self.assertEqual(self.c.pool("kv").committed_blocks, 256)
        self.assertEqual(len(self.c.pools()), 1)
        self.assertTrue(attach.is_alive())
        stuck("unstick")
        shrink.join()
        attach.join()
        u = done["update"]
        self.assert_exact(u, 100, holders=False)
        self.assertEqual(len(late), 1)
        self.assertEqual(sorted(cl.client_id for cl in self.c.pool("kv").clients),
                         sorted([good.client_id, stuck.client_id, late[0].client_id]))
        self.assert_follows([good, stuck, late[0]], u.pool)
        self.assert_intact([good, stuck, late[0]], kept(100))
        self.assertEqual(self.log().count("Attach to pool kv waits"), 1)

    def test_a_compaction_called_off_maps_the_old_chunks_back(self):
        """A compaction called off (the other engine never acknowledges): the engine that paused keeps
        the old chunks, bytes and all, and lets the new ones it imported go."""
        self.create(0)
        good, stuck = self.engines(modes=("pausable", "stuck"))
        for step in range(1, 9):
            self.c.grow("kv", step * GRANULE_BLOCKS)
        before = self.c.pool("kv")
        self.assertEqual(len(before.chunks), 16)
        self.assert_follows([good, stuck], before)
        self.write_all([good, stuck], 128)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.compact("kv", pause_timeout=3)
        self.assertEqual(e.exception.code, "DEADLINE_EXCEEDED", e.exception)
        self.assertIn(stuck.client_id, e.exception.message)
        self.assertEqual(table(self.c.pool("kv")), table(before))
        poll(lambda: good("state")["resumed"] == [False], "engine-0 to resume (not applied)")
        self.assert_follows([good], before)  # the old chunks, one FD each, nothing else held
        self.assert_intact([good], kept(128))
        stuck("unstick")
        poll(lambda: stuck("state")["resumed"] == [False], "engine-1 to resume (not applied)")
        self.assert_intact([stuck], kept(128))
        self.assertEqual(self.c.device_info().committed_bytes, before.committed_bytes)

    def test_a_client_killed_while_paused_lets_the_change_go_on(self):
        self.create(256)
        good, stuck = self.engines(modes=("pausable", "stuck"))
        self.write_all([good, stuck], 256)
        result = {}

        def shrink():
            try:
                result["update"] = self.c.shrink("kv", 100, pause_timeout=60)
            except kvd.KvdError as e:
                result["error"] = e

        t = threading.Thread(target=shrink)
        t.start()
        poll(lambda: stuck("state")["in_pause"], "engine-1 to be in its pause")
        stuck.p.send_signal(signal.SIGKILL)
        stuck.p.wait(POLL_S)
        t.join(POLL_S)
        self.assertFalse(t.is_alive(), "the shrink did not return")
        self.assertNotIn("error", result, result.get("error"))
        u = result["update"]
        self.assert_exact(u, 100)
        self.assertEqual(list(u.reshape.detached_client_ids), [])  # it died: nobody to detach
        self.assert_follows([good], u.pool)
        self.assert_intact([good], kept(u.pool.committed_blocks))

    def test_a_client_that_is_not_pausable_refuses_exact_shrink_and_compact(self):
        self.create(64)
        for blocks in (128, 192, 256):
            self.c.grow("kv", blocks)  # chunks of 64 blocks: boundaries at 64, 128, 192
        plain, pausable = self.engines(modes=("plain", "pausable"))
        self.write_all([plain, pausable], 256)
        before = self.c.pool("kv")
        self.assertEqual({cl.client_id: cl.pausable for cl in before.clients},
                         {plain.client_id: False, pausable.client_id: True})
        for call in (lambda: self.c.shrink("kv", 100), lambda: self.c.compact("kv")):
            with self.assertRaises(kvd.KvdError) as e:
                call()
            self.assertEqual(e.exception.code, "FAILED_PRECONDITION", e.exception)
            self.assertIn(plain.client_id, e.exception.message)
            self.assertEqual(table(self.c.pool("kv")), table(before))

        # Whole chunks from another session: the plain engine refuses that too, unless forced (docs/api.md,
        # "Releases and running engines"); nothing changed.
        with self.assertRaises(kvd.KvdError) as e:
            self.c.shrink("kv", 100, whole_chunks_only=True)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION", e.exception)
        self.assertIn(plain.client_id, e.exception.message)
        self.assertEqual(table(self.c.pool("kv")), table(before))
        self.assertEqual(pausable("state")["pauses"], 0)
        plain.close()  # the plain engine lets go; the pausable one is paused for what follows

        u = self.c.shrink("kv", 100, whole_chunks_only=True)  # releases what lies past 128 only
        self.assertFalse(u.reshape.target_reached)
        self.assertEqual(u.pool.committed_blocks, 128)
        self.assertEqual(u.pool.committed_bytes, self.prefix_bytes(128))
        self.assert_follows([pausable], u.pool)
        self.assert_intact([pausable], kept(128))

        u = self.c.shrink("kv", 64)  # on a chunk boundary: nothing to replace; the whole chunks go paused
        self.assert_exact(u, 64)
        self.assert_follows([pausable], u.pool)
        self.assert_intact([pausable], kept(64))
        self.assertEqual(pausable("state")["pauses"], 2)

    def test_pause_timeout_is_checked(self):
        self.create(256)
        with self.assertRaises(kvd.KvdError) as e:
            self.c.shrink("kv", 100, pause_timeout=-1)  # refused before any call
        self.assertEqual((e.exception.code, e.exception.message), ("INVALID_ARGUMENT", "pause_timeout: -1 s is negative"))
        with self.assertRaises(kvd.KvdError) as e:
            self.c.compact("kv", pause_timeout=600.001)  # 600001 ms: the daemon's limit is 10 minutes
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("pause.timeout_ms: 600001 is more than 600000", e.exception.message)
        self.assertEqual(self.c.shrink("kv", 100, pause_timeout=0.0001).pool.committed_blocks, 112)  # 1 ms, no client

    # -- budget -----------------------------------------------------------------------------------
    def test_budget_full_refuses_the_replacement_chunk(self):
        self.create(256)  # 64 MiB of the 70 MiB budget
        engines = self.engines()
        self.write_all(engines, 256)
        before = self.c.pool("kv")
        with self.assertRaises(kvd.KvdError) as e:
            self.c.shrink("kv", 200)  # replacements of 25 MiB per segment
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED", e.exception)
        # One segment's replacement (the least a step makes) and both.
        self.assertIn(f"needs {self.prefix_bytes(200) // 2} bytes", e.exception.message)
        self.assertIn(f"({self.prefix_bytes(200)} bytes for all 2)", e.exception.message)
        self.assertIn(f"only {6 * MiB} bytes", e.exception.message)  # free
        self.assertEqual(table(self.c.pool("kv")), table(before))
        self.assertEqual(self.c.device_info().committed_bytes, before.committed_bytes)
        for e in engines:
            self.assertEqual(e("state")["pauses"], 0, e.name)
        self.assert_intact(engines, kept(256))
        # A shrink that only releases whole chunks needs no room.
        u = self.c.shrink("kv", 200, whole_chunks_only=True)
        self.assertFalse(u.reshape.target_reached)
        self.assertEqual(table(u.pool), table(before))

    def test_a_full_budget_compacts_and_shrinks_in_steps_that_fit_what_is_free(self):
        """Issue 22: an 896 MiB pool under --budget=1GiB, grown in 56 steps of 2 MiB a segment (8 segments,
        448 chunks). Compact needs 896 MiB of new chunks at once, an exact shrink to half 448 MiB: neither
        fits the 128 MiB free, so both go in steps of what is free, the engines pausing for each."""
        dims = dict(DIMS, layers=8)  # 8 segments of 128 KiB blocks: 112 MiB a segment at 896 blocks
        self.c.create_pool("kv", initial_blocks=0, **dims)
        for step in range(1, 57):
            self.c.grow("kv", step * GRANULE_BLOCKS)
        pool = self.c.pool("kv")
        self.g = pool.geometry
        self.assertEqual((len(pool.chunks), pool.committed_blocks, pool.committed_bytes), (448, 896, 896 * MiB))
        engines = self.engines()
        self.assert_follows(engines, pool)
        self.write_all(engines, 896)
        free = (1 << 30) - 896 * MiB

        u = self.c.compact("kv")
        r = u.reshape
        self.assertGreater(r.steps, 1, r)
        self.assertEqual(r.steps, 8, r)  # one segment's 112 MiB chunk at a time
        self.assertEqual((r.chunks_before, r.chunks_after, r.chunks_replaced, r.chunks_added), (448, 8, 448, 8), r)
        self.assertLessEqual(r.copied_bytes // r.steps, free, r)
        self.assertEqual(r.copied_bytes, 896 * MiB, r)
        self.assertTrue(r.target_reached, r)
        self.assertEqual((r.paused_clients, r.resumed_clients), (2, 2), r)
        self.assertGreater(r.max_pause_us, 0, r)
        self.assertLessEqual(r.max_pause_us, r.pause_us, r)
        self.assertEqual(len(u.pool.chunks), 8)
        self.assert_follows(engines, u.pool)
        for e in engines:
            self.assertEqual(e("state")["resumed"], [True] * 8, e.name)
        self.assert_intact(engines, kept(896))
        poll(lambda: self.c.device_info().committed_bytes == 896 * MiB, "the daemon to count only the pool's bytes")

        u = self.c.shrink("kv", 448)  # 56 MiB a segment: 2 segments' replacements in the 128 MiB free first
        r = u.reshape
        self.assertGreater(r.steps, 1, r)
        self.assertEqual((r.chunks_before, r.chunks_after, r.chunks_replaced, r.chunks_added), (8, 8, 8, 8), r)
        self.assertEqual(r.copied_bytes, 448 * MiB, r)
        self.assertEqual((r.paused_clients, r.resumed_clients), (2, 2), r)
        self.assert_exact(u, 448)
        self.assert_follows(engines, u.pool)
        for e in engines:
            self.assertEqual(e("state")["resumed"], [True] * (8 + r.steps), e.name)
        self.assert_intact(engines, kept(448))
        # The memory given back is the engines' to grow into again.
        u = self.c.grow("kv", 896)
        self.assert_follows(engines, u.pool)
        self.write_all(engines, 896)
        self.assert_intact(engines, kept(896))

    # -- metrics ----------------------------------------------------------------------------------
    def test_metrics_count_pauses_copies_and_compactions(self):
        self.create(64)
        self.c.grow("kv", 128)
        self.c.grow("kv", 256)  # 6 chunks: 64, 64 and 128 blocks per segment
        engines = self.engines()
        self.write_all(engines, 256)
        shrunk = self.c.shrink("kv", 200)  # inside the last chunk: 2 replaced
        # 6 chunks -> 2, in two steps (3 chunks a segment, at most 3 replaced a pause): a pause each.
        compacted = self.c.compact("kv", max_chunks_per_pause=3)
        self.assertEqual((shrunk.reshape.chunks_replaced, compacted.reshape.chunks_replaced), (2, 6))
        self.assertEqual(compacted.reshape.steps, 2)
        self.assert_intact(engines, kept(compacted.pool.committed_blocks))
        s = parse_samples(http_get(f"http://127.0.0.1:{self.metrics_port}/metrics"))
        dev = ("device", "0")
        self.assertEqual(s[("kvd_pause_seconds_count", frozenset({dev}))], 3)
        self.assertEqual(s[("kvd_reshape_chunks_replaced_total", frozenset({dev}))], 8)
        self.assertEqual(s[("kvd_reshape_copied_bytes_total", frozenset({dev}))],
                         shrunk.reshape.copied_bytes + compacted.reshape.copied_bytes)
        self.assertEqual(s[("kvd_operations_total", frozenset({dev, ("op", "compact"), ("result", "ok")}))], 1)
        self.assertEqual(s[("kvd_operations_total", frozenset({dev, ("op", "shrink"), ("result", "ok")}))], 1)

        # A compaction on the daemon's own (--compact-above-chunks=6) counts as one too.
        for blocks in (256, 320, 384):
            self.c.grow("kv", blocks)  # 2 more chunks each: 8 after the third
        poll(lambda: len(self.c.pool("kv").chunks) == 2, "the daemon to compact the pool on its own")
        poll(lambda: parse_samples(http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")).get(
            ("kvd_operations_total", frozenset({dev, ("op", "compact"), ("result", "ok")}))) == 2,
            "kvd_operations_total{op=\"compact\",result=\"ok\"} to count the daemon's own compaction")
        self.assertEqual(
            parse_samples(http_get(f"http://127.0.0.1:{self.metrics_port}/metrics"))[
                ("kvd_pause_seconds_count", frozenset({dev}))], 4)
        self.assert_intact(engines, kept(compacted.pool.committed_blocks))








if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--engine":
        sys.exit(engine_main(*sys.argv[2:]))
    unittest.main()
