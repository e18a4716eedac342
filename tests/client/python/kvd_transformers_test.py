"""kvd.transformers' cache logic against a real kvd on the host backend, WITH NUMPY ARRAYS INSTEAD OF TORCH TENSORS.

transformers and torch are not installed on this machine, so transformers' Cache base class is not here: these tests
drive KvdKVStore -- the object every KvdCache/KvdLayer call is delegated to -- with numpy arrays as the model's key
and value states, and compare it with what transformers' DynamicCache computes (per layer, the concatenation of every
update along the sequence dim). The same store under torch and a real Llama's generate() is
tests/gpu/engines_transformers.py (the GPU run's "engines" step).

Checked: the pool is LHBNC (rule backend_requirement) with the dims the model implies, and the bytes of every update
are where the pool's geometry says; growth in steps up to max_cache_len, and OUT_OF_RANGE past it with nothing written;
another session's compaction of a pool grown in many steps while a decoding thread runs, its pauses waiting out the
forward in flight; a SIGKILL of kvd; an engine process killed and a new one adopting the pool from its checkpoint;
sleep and wake, the engine's own and another session's, dropping the tokens or keeping them in kvd's host tier; a
shrink below the cached tokens; a pool of other dims refused.
"""
import os
import signal
import subprocess
import sys
import threading
import time
import unittest

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing"))

import kvd  # noqa: E402
from kvd.transformers import KvdKVStore  # noqa: E402
from kvd_daemon import KvdDaemonCase  # noqa: E402

# A small Llama-like shape: 3 layers, 2 KV heads of 32 channels, float32, 8-token blocks.
SHAPE = dict(layers=3, kv_heads=2, head_dim=32, max_tokens=512, dtype="float32", element_bytes=4, block_tokens=8)


def states(step, tokens, batch=1, shape=SHAPE):
    """The key and value states a model would hand update() for `tokens` new tokens at decoding step `step`."""
    rng = numpy.random.default_rng(step)
    dims = (batch, shape["kv_heads"], tokens, shape["head_dim"])
    return rng.standard_normal(dims, dtype=numpy.float32), rng.standard_normal(dims, dtype=numpy.float32)


class Reference:
    """What DynamicCache keeps: per layer, every update concatenated along the sequence dim."""

    def __init__(self, layers):
        self.k, self.v = [None] * layers, [None] * layers

    def update(self, keys, values, layer):
        self.k[layer] = keys if self.k[layer] is None else numpy.concatenate([self.k[layer], keys], axis=-2)
        self.v[layer] = values if self.v[layer] is None else numpy.concatenate([self.v[layer], values], axis=-2)
        return self.k[layer], self.v[layer]


def step(store, ref, n, tokens=1):
    """One forward: every layer appends `tokens` tokens; the views must equal the reference."""
    with store.forward():
        for l in range(store.layers):
            k, v = states(n * 100 + l, tokens)
            got_k, got_v = store.update(k, v, l)
            want_k, want_v = ref.update(k, v, l)
            numpy.testing.assert_array_equal(got_k, want_k)
            numpy.testing.assert_array_equal(got_v, want_v)


class KvdTransformersStoreTest(KvdDaemonCase):
    def kvd_args(self):
        # A granule is 4 blocks of a segment here: the pool grows in steps. The host tier: sleeps that keep tokens.
        return ["--host-granularity=4KiB", "--host-tier-bytes=16MiB"]

    def setUp(self):
        super().setUp()
        self.c = kvd.connect(self.socket)
        self.addCleanup(self.c.close)

    def store(self, pool="chat", client=None, **kw):
        s = KvdKVStore(client or self.c, pool, **{**SHAPE, **kw})
        self.addCleanup(s.mapping.close)
        return s

    def test_layout_and_placement(self):
        s = self.store(batch_size=2, initial_tokens=64)
        pool = self.c.pool("chat")
        self.assertEqual(pool.geometry.layout, "LHBNC")
        self.assertEqual(kvd.layout_rule_name(pool.layout.rule), "backend_requirement")
        d = pool.geometry.dims
        self.assertEqual((d.layers, d.capacity_blocks, d.heads, d.block_tokens, d.channels, d.element_bytes),
                         (3, 64, 8, 8, 32, 4))  # heads: 2 sequences x (K, V) x 2 KV heads
        k, v = states(7, 11, batch=2)
        s.update(k, v, 1)
        # Element (layer 1, token t, sequence b, head h, channel c) of K is pool element (l=1, b=t//8, h=b*2+h,
        # n=t%8, c) by the pool's own formula; V's heads follow K's.
        g = pool.geometry
        with kvd.connect(self.socket) as other, other.attach("chat") as m:
            raw = numpy.asarray(m.layer(1, dtype="float32"))  # [B, H, N, C] of layer 1, the pool's strides
            for seq in range(2):
                for h in range(2):
                    for t in (0, 7, 8, 10):
                        numpy.testing.assert_array_equal(raw[t // 8, seq * 2 + h, t % 8], k[seq, h, t])
                        numpy.testing.assert_array_equal(raw[t // 8, 4 + seq * 2 + h, t % 8], v[seq, h, t])
        self.assertEqual(g.stride_b, 8 * g.stride_n)  # a block is 8 consecutive token rows of a head

    def test_growth_and_the_capacity(self):
        s, ref = self.store(initial_tokens=8), Reference(3)
        self.assertEqual(self.c.pool("chat").committed_blocks, 4)  # one granule of each segment
        step(s, ref, 0, tokens=5)
        for n in range(1, 40):
            step(s, ref, n)
        self.assertEqual(s.length(), 44)
        self.assertGreaterEqual(self.c.pool("chat").committed_blocks * 8, 44)
        self.assertGreater(len(self.c.pool("chat").chunks), 3)  # grew in steps
        with self.assertRaises(kvd.KvdError) as full:
            with s.forward():
                s.update(*states(1, 512 - 44 + 1), 0)
        self.assertEqual(full.exception.code, "OUT_OF_RANGE")
        self.assertIn("at most 512", full.exception.message)
        self.assertEqual(s.length(0), 44)  # nothing written
        numpy.testing.assert_array_equal(s.cached(0)[0], ref.k[0])

    def test_compaction_while_decoding(self):
        s, ref = self.store(initial_tokens=8), Reference(3)
        step(s, ref, 0, tokens=8)
        for n in range(1, 200):  # 207 tokens, grown block by block doubling: many chunks per segment
            step(s, ref, n)
        before = len(self.c.pool("chat").chunks)
        errors = []
        stop = threading.Event()

        def decode():
            n = 200
            try:
                while not stop.is_set() and s.length() < 480:
                    step(s, ref, n)
                    n += 1
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        t = threading.Thread(target=decode)
        t.start()
        with kvd.connect(self.socket) as operator:
            reply = operator.compact("chat", max_chunks_per_pause=4)
        stop.set()
        t.join(30)
        self.assertEqual(errors, [])
        self.assertGreaterEqual(reply.reshape.steps, 2)
        self.assertLess(len(self.c.pool("chat").chunks), before)
        self.assertGreaterEqual(s.mapping.pauses, reply.reshape.steps)
        step(s, ref, 999)  # and on after it, every byte as DynamicCache has it
        for l in range(3):
            numpy.testing.assert_array_equal(s.cached(l)[0], ref.k[l])
            numpy.testing.assert_array_equal(s.cached(l)[1], ref.v[l])

    def test_a_kvd_crash(self):
        s, ref = self.store(), Reference(3)
        for n in range(20):
            step(s, ref, n)
        self.kvd.send_signal(signal.SIGKILL)
        self.restart_daemon(0)
        deadline = time.monotonic() + 20
        while s.mapping.epoch < 2:
            self.assertLess(time.monotonic(), deadline, "the cache's Mapping did not reattach")
            time.sleep(0.05)
        self.assertEqual(s.emptied, 0)
        for n in range(20, 40):  # grows once more on the restarted daemon
            step(s, ref, n)
        self.assertEqual(s.length(), 40)

    def test_an_engine_restart_adopts_the_checkpoint(self):
        child = subprocess.Popen([sys.executable, "-c", CHILD, self.socket], stdout=subprocess.PIPE, text=True)
        self.assertEqual(child.stdout.readline().strip(), "checkpointed 30")
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        deadline = time.monotonic() + 10
        while self.c.pool("chat").client_count:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.02)
        s, ref = self.store(), Reference(3)
        for n in range(30):  # what the killed engine wrote
            for l in range(3):
                ref.update(*states(n * 100 + l, 1), l)
        self.assertTrue(s.adopted)
        self.assertEqual(s.lengths, [30, 30, 30])
        self.assertEqual(s.tokens, list(range(31)))
        for l in range(3):
            numpy.testing.assert_array_equal(s.cached(l)[0], ref.k[l])
            numpy.testing.assert_array_equal(s.cached(l)[1], ref.v[l])
        step(s, ref, 30)  # decodes on without a prefill
        self.assertEqual(s.length(), 31)

    def test_other_dims_are_refused(self):
        self.store()
        with self.assertRaises(kvd.KvdError) as other:
            KvdKVStore(self.c, "chat", **{**SHAPE, "head_dim": 64})
        self.assertEqual(other.exception.code, "FAILED_PRECONDITION")
        self.assertIn("exists with dims", other.exception.message)

    def test_sleep_and_wake(self):
        s, ref = self.store(), Reference(3)
        for n in range(10):
            step(s, ref, n)
        s.sleep()
        self.assertEqual(self.c.pool("chat").state, kvd.v1_pb2.POOL_STATE_SLEEPING)
        with self.assertRaises(kvd.KvdError) as asleep:
            step(s, Reference(3), 0)
        self.assertEqual(asleep.exception.code, "FAILED_PRECONDITION")
        s.wake()
        self.assertEqual((s.length(), s.emptied), (0, 1))
        ref = Reference(3)
        step(s, ref, 50, tokens=12)  # the engine prefills again

        # Another session's sleep pauses the cache first; its wake empties it.
        with kvd.connect(self.socket) as operator:
            operator.sleep("chat", wait=True)
            self.assertGreaterEqual(s.mapping.pauses, 1)
            with self.assertRaises(kvd.KvdError):
                step(s, Reference(3), 0)
            operator.wake("chat")
        deadline = time.monotonic() + 10
        while s.emptied < 2:
            self.assertLess(time.monotonic(), deadline, "the cache did not see the wake")
            time.sleep(0.02)
        self.assertEqual(s.length(), 0)
        step(s, Reference(3), 60, tokens=3)

    def test_a_sleep_that_keeps_the_tokens_decodes_on_after_the_wake(self):
        s, ref = self.store(), Reference(3)
        for n in range(21):  # 21 tokens: 3 blocks of 8
            step(s, ref, n)
        s.checkpoint(list(range(21)))
        s.sleep(keep=True)
        pool = self.c.pool("chat")
        self.assertEqual(pool.state, kvd.v1_pb2.POOL_STATE_SLEEPING)
        self.assertEqual(pool.kept_bytes, 3 * 3 * 4096)  # only the blocks that hold tokens, of every layer
        with self.assertRaises(kvd.KvdError) as asleep:
            step(s, Reference(3), 0)
        self.assertEqual(asleep.exception.code, "FAILED_PRECONDITION")
        s.wake()
        self.assertEqual((s.length(), s.emptied, s.tokens), (21, 0, list(range(21))))
        step(s, ref, 30)  # decodes on: the views hold every kept token, and the new one after them

        # Another session's wake of a keeping sleep brings them back too.
        s.sleep(keep=True)
        with kvd.connect(self.socket) as operator:
            operator.wake("chat")
        deadline = time.monotonic() + 10
        while s._sleeping:
            self.assertLess(time.monotonic(), deadline, "the cache did not see the wake")
            time.sleep(0.02)
        self.assertEqual((s.length(), s.emptied), (22, 0))
        step(s, ref, 31)

    def test_a_shrink_below_the_cached_tokens_clips_them(self):
        s, ref = self.store(initial_tokens=64), Reference(3)
        step(s, ref, 0, tokens=40)
        with kvd.connect(self.socket) as operator:
            operator.shrink("chat", 3, wait=True)  # 4 blocks (a granule), 32 tokens stay: the cache pauses for it
        self.assertEqual((s.lengths, s.emptied), ([32, 32, 32], 1))
        numpy.testing.assert_array_equal(s.cached(0)[0], ref.k[0][:, :, :32])


# The engine process of test_an_engine_restart_adopts_the_checkpoint: 30 decoding steps, a checkpoint, then it
# waits to be killed.
CHILD = f"""
import sys, time
sys.path.insert(0, {HERE!r})
import kvd
from kvd.transformers import KvdKVStore
from kvd_transformers_test import SHAPE, states
c = kvd.connect(sys.argv[1])
s = KvdKVStore(c, "chat", **SHAPE)
for n in range(30):
    with s.forward():
        for l in range(3):
            s.update(*states(n * 100 + l, 1), l)
s.checkpoint(list(range(31)))
print("checkpointed", s.length(), flush=True)
time.sleep(600)
"""

if __name__ == "__main__":
    unittest.main()
