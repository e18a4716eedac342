"""kvd.transformers: a transformers Cache whose keys and values live in a kvd pool (docs/engines.md, "transformers").

    import kvd.transformers
    cache = kvd.transformers.KvdCache(model, pool="chat-0", max_cache_len=4096)   # creates the pool, or adopts it
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    cache.checkpoint(out[0].tolist())           # the pool's metadata: lengths and tokens, for a restarted engine

The layout (Note [A transformers cache is LHBNC], docs/engines.md): layer l's keys and values are the pool's layer l,
heads 0 .. batch*kv_heads-1 the keys and the next batch*kv_heads the values, B*N tokens of C = head_dim channels.
Only under LHBNC (head before block, block stride = N tokens) is one layer's K (or V) a single dense strided tensor
[batch, kv_heads, tokens, head_dim] with each head's tokens contiguous rows -- what eager and SDPA attention (and
DynamicCache) hand the kernels -- so the cache requires it of the layout chain as backend "transformers-<attn>".

What the cache does (KvdKVStore):
- growth: the pool starts with `initial_tokens` backed and grows (doubling) before a write would pass its committed
  blocks; the views never move. Past max_cache_len, update raises OUT_OF_RANGE and writes nothing.
- pauses: the Mapping is pausable. Every forward of the bound model (forward pre/post hooks, or `with
  cache.store.forward():`) holds the cache; a PAUSE (another session's compaction, exact shrink, sleep, delete) waits
  for the forward in flight, synchronises the device and blocks the next forward until the RESUME.
- restarts of kvd: the Mapping rides through; if chunks were lost, the cache empties itself (lengths 0).
- restarts of the engine: a new process that builds the cache on the same pool adopts it with the lengths and tokens of
  the last checkpoint() (the pool's metadata) and decodes on without a new prefill.
- sleep and wake (its own, or another session's): the memory comes back zeroed, so the cache empties itself
  (`emptied` counts it) and the engine prefills again; a forward while it sleeps raises FAILED_PRECONDITION.
  `sleep(keep=True)` keeps the cached tokens instead: kvd copies the blocks that hold them to its host tier
  (`--host-tier-bytes`) and the wake copies them back, so the cache decodes on without a prefill -- unless kvd lost
  them meanwhile (it restarted without its FD store or with another tier), which the cache sees and empties itself.

KvdKVStore is array-agnostic: numpy views on the host backend (what the tests without torch drive), torch tensors
on CUDA. KvdCache (needs transformers with cache_utils.CacheLayerMixin) delegates every call to it.
"""

import contextlib
import json
import math
import threading
import time

from . import CudaArray, KvdError, v1_pb2

ATTACH_RETRY_S = 60.0  # how long a new cache waits for a pool that is recovering after a kvd restart

METADATA_FORMAT = "kvd.transformers/1"
LAYOUT = "LHBNC"


class _HostArray:
    def __init__(self, ptr, shape, strides, dtype, owner):
        self.__array_interface__ = {"version": 3, "shape": tuple(shape), "typestr": dtype.str, "descr": dtype.descr,
                                    "data": (ptr, False), "strides": tuple(strides)}
        self._owner = owner


class KvdKVStore:
    """The keys and values of `layers` attention layers in the kvd pool `pool`, through `client` (a kvd.Client).

    shape: batch_size sequences of kv_heads heads of head_dim channels, up to max_tokens tokens, element_bytes each.
    dtype: the element type of the views (numpy dtype on host; torch dtype on CUDA). A pool of that name is adopted
    when its dims match (else FAILED_PRECONDITION naming both), with the lengths of its last checkpoint.
    attn: the model's attention implementation, sent as the layout requirement's backend name."""

    def __init__(self, client, pool, layers, kv_heads, head_dim, max_tokens, dtype, element_bytes, batch_size=1,
                 block_tokens=16, initial_tokens=None, attn="sdpa", device=None):
        self.client, self.pool = client, pool
        self.layers, self.kv_heads, self.head_dim, self.batch = layers, kv_heads, head_dim, batch_size
        self.block_tokens, self.dtype, self.element_bytes = block_tokens, dtype, element_bytes
        blocks = max(1, math.ceil(max_tokens / block_tokens))
        self.dims = dict(layers=layers, capacity_blocks=blocks, heads=2 * batch_size * kv_heads,
                         block_tokens=block_tokens, channels=head_dim, element_bytes=element_bytes)
        self.max_tokens = blocks * block_tokens
        self.lengths = [0] * layers
        self.tokens = []
        self.emptied = 0  # times the contents were lost (a sleep, a restart that lost chunks, a shrink below them)
        self._cv = threading.Condition()
        self._active = 0  # forwards in flight
        self._held = threading.local()  # .depth: this thread's forwards in flight
        self._paused = False
        self._sleeping = False
        self._kept = False  # sleeping with the cached tokens in kvd's host tier
        self._metadata_version = 0
        self.adopted = False
        initial = max(1, math.ceil((initial_tokens or block_tokens) / block_tokens))
        try:
            client.create_pool(pool, initial_blocks=min(initial, blocks),
                               backend_requirements={f"transformers-{attn}": [LAYOUT]}, **self.dims)
        except KvdError as e:
            if e.code != "ALREADY_EXISTS":
                raise
            self._check_adoptable(client.pool(pool))
            self.adopted = True
        # A pool still recovering after a kvd restart (its chunks not yet handed back by the clients that map
        # them, docs/reliability.md) answers UNAVAILABLE "retry": wait for it, as long as the grace lasts.
        deadline = time.monotonic() + ATTACH_RETRY_S
        while True:
            try:
                self.mapping = client.attach(pool, on_pause=self._on_pause, on_resume=self._on_resume,
                                             on_grow=self._on_grow, on_release=self._on_release,
                                             on_restart=self._on_restart, device=device)
                break
            except KvdError as e:
                if e.code != "UNAVAILABLE" or "recovering" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        g = self.mapping.geometry
        if g.layout != LAYOUT:
            raise KvdError("FAILED_PRECONDITION", f"pool {pool} has layout {g.layout}; kvd.transformers needs {LAYOUT} "
                           "(an override or the daemon's --layout-override chose another)")
        if self.adopted:
            self._adopt_checkpoint()
        self._views = [self._layer_views(l) for l in range(layers)]

    # -- the pool --------------------------------------------------------------------------------------------------
    def _check_adoptable(self, found):
        d = found.geometry.dims
        have = dict(layers=d.layers, capacity_blocks=d.capacity_blocks, heads=d.heads, block_tokens=d.block_tokens,
                    channels=d.channels, element_bytes=d.element_bytes)
        if have != self.dims:
            raise KvdError("FAILED_PRECONDITION", f"pool {self.pool} exists with dims {have}; this cache needs "
                           f"{self.dims}: delete it or name another pool")

    def _adopt_checkpoint(self):
        meta = self.client.metadata(self.pool)
        self._metadata_version = meta.version
        if not meta.data or self.mapping.state != v1_pb2.POOL_STATE_AWAKE:  # asleep, the bytes are gone
            return
        try:
            saved = json.loads(meta.data)
        except ValueError:
            return  # not ours: start empty
        if saved.get("format") != METADATA_FORMAT:
            return
        lengths = [int(x) for x in saved.get("lengths", [])]
        backed = self.mapping.committed_blocks * self.block_tokens
        if len(lengths) == self.layers and max(lengths) <= backed:
            self.lengths = lengths
            self.tokens = [int(t) for t in saved.get("tokens", [])]

    def _layer_views(self, l):
        """(K, V) of layer l over the whole capacity: [batch, kv_heads, max_tokens, head_dim]."""
        g, m = self.mapping.geometry, self.mapping
        s_l, s_b, s_h, s_n, s_c = g.strides
        assert s_b == self.block_tokens * s_n, "LHBNC: a block is N consecutive tokens"
        shape = (self.batch, self.kv_heads, self.max_tokens, self.head_dim)
        strides = (self.kv_heads * s_h, s_h, s_n, s_c)
        base = m.base + g.offset + l * s_l
        return tuple(self._view(base + i * self.batch * self.kv_heads * s_h, shape, strides) for i in (0, 1))

    def _view(self, ptr, shape, strides):
        if self.mapping.cuda_device is None:
            import numpy  # noqa: PLC0415
            dt = numpy.dtype(self.dtype)
            return numpy.asarray(_HostArray(ptr, shape, strides, dt, self.mapping))
        import torch  # noqa: PLC0415
        typestr = {1: "|u1", 2: "<f2", 4: "<f4", 8: "<f8"}[self.element_bytes]
        t = torch.as_tensor(CudaArray(ptr, shape, typestr, strides, self.mapping),
                            device=f"cuda:{self.mapping.cuda_device}")
        return t if t.dtype == self.dtype else t.view(self.dtype)

    def _ensure_backed(self, tokens):
        if tokens > self.max_tokens:
            raise KvdError("OUT_OF_RANGE", f"pool {self.pool}: {tokens} tokens do not fit; the cache holds at most "
                           f"{self.max_tokens} (max_cache_len)")
        need = math.ceil(tokens / self.block_tokens)
        have = self.mapping.committed_blocks
        if need > have:
            target = min(self.dims["capacity_blocks"], max(need, 2 * have))
            with self._let_go():  # this process's Mapping maps before it returns
                self.client.grow(self.pool, target)

    # -- the engine's calls ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self):
        """Holds the cache for one forward pass (or any access to its memory): waits out a pause, refuses while the
        pool sleeps or is lost. Re-entrant."""
        with self._cv:
            while self._paused and not getattr(self._held, "depth", 0):  # a nested hold is inside already
                self._cv.wait()
            self._check_usable_locked()
            self._active += 1
            self._held.depth = getattr(self._held, "depth", 0) + 1
        try:
            yield self
        finally:
            with self._cv:
                self._active -= 1
                self._held.depth -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def _let_go(self):
        """Inside a forward, around a call into kvd (a grow): a pause may go on meanwhile -- this thread touches no
        memory in the call, and the pause hook synchronises the device -- and this thread waits it out after. Without
        it, a grow queued behind a compaction would wait for the compaction's pause, which waits for this forward."""
        with self._cv:
            depth = getattr(self._held, "depth", 0)
            self._active -= depth
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                while self._paused:
                    self._cv.wait()
                self._active += depth

    def _check_usable_locked(self):
        if self.mapping.gone is not None:
            raise KvdError(self.mapping.gone.code, f"pool {self.pool} is lost: {self.mapping.gone.message}")
        if self._sleeping:
            raise KvdError("FAILED_PRECONDITION", f"pool {self.pool} is asleep: wake it (cache.wake()) and "
                           "prefill again")

    def update(self, keys, values, layer):
        """Appends keys and values ([batch, kv_heads, new, head_dim]) to `layer` -> (K, V) views of every cached
        token of the layer, [batch, kv_heads, length, head_dim]."""
        with self.forward():
            start = self.lengths[layer]
            end = start + keys.shape[-2]
            self._ensure_backed(end)
            k, v = self._views[layer]
            k[:, :, start:end] = keys
            v[:, :, start:end] = values
            self.lengths[layer] = end
            return k[:, :, :end], v[:, :, :end]

    def cached(self, layer):
        """(K, V) of the cached tokens of `layer`."""
        k, v = self._views[layer]
        n = self.lengths[layer]
        return k[:, :, :n], v[:, :, :n]

    def length(self, layer=0):
        return self.lengths[layer] if 0 <= layer < self.layers else 0

    def crop(self, max_length):
        if max_length < 0:
            max_length = self.length() + max_length
        self.lengths = [min(n, max(0, max_length)) for n in self.lengths]

    def reset(self):
        """Forgets every token (the memory stays)."""
        self.lengths = [0] * self.layers
        self.tokens = []

    def reorder(self, beam_idx):
        """Beam search: sequence i becomes sequence beam_idx[i], in place."""
        with self.forward():
            for l in range(self.layers):
                for view in self._views[l]:
                    n = self.lengths[l]
                    part = view[:, :, :n]
                    picked = part[beam_idx.to(part.device) if hasattr(beam_idx, "to") else beam_idx]
                    if hasattr(part, "copy_"):
                        part.copy_(picked)
                    else:
                        part[...] = picked

    def checkpoint(self, tokens=None):
        """Saves the lengths (and the sequence's token ids) as the pool's metadata, once the device has finished
        writing them: what a restarted engine adopts. Compare-and-set: a pool another process checkpointed since
        is ABORTED."""
        if tokens is not None:
            self.tokens = [int(t) for t in tokens]
        if self.mapping.cuda_device is not None:
            import torch  # noqa: PLC0415
            torch.cuda.synchronize(self.mapping.cuda_device)
        data = json.dumps({"format": METADATA_FORMAT, "lengths": self.lengths, "tokens": self.tokens}).encode()
        self._metadata_version = self.client.set_metadata(self.pool, data, self._metadata_version).version

    # -- resizing from the engine ---------------------------------------------------------------------------------
    def compact(self):
        """Rewrites a pool grown in many steps as one chunk per segment (this Mapping pauses for it)."""
        return self.client.compact(self.pool)

    def sleep(self, keep=False):
        """Gives the memory back to kvd. The cached tokens are lost, or with `keep` kept in kvd's host tier (only the
        blocks that hold them): KvdError RESOURCE_EXHAUSTED when the tier cannot hold them, FAILED_PRECONDITION when
        kvd has none, and the cache is as it was."""
        with self._cv:
            while self._active:
                self._cv.wait()
            blocks = math.ceil(max(self.lengths) / self.block_tokens)
        if self.mapping.cuda_device is not None:
            import torch  # noqa: PLC0415
            torch.cuda.synchronize(self.mapping.cuda_device)
        if keep and blocks:
            self.client.sleep(self.pool, wait=True, keep=True, live_blocks=list(range(blocks)))
        else:
            self.client.sleep(self.pool, wait=True)
        with self._cv:
            self._sleeping = True
            self._kept = bool(keep and blocks)

    def wake(self):
        """Backs the pool again: with the cached tokens after sleep(keep=True), else zeroed (the cache is empty,
        prefill again)."""
        with self._cv:
            kept = self._kept and self.client.pool(self.pool).kept_bytes > 0
        self.client.wake(self.pool)
        self._woken(kept)

    def _woken(self, kept):
        if kept:
            with self._cv:
                self._sleeping = self._kept = False
                self._cv.notify_all()
        else:
            self._emptied()

    def close(self, delete=False):
        self.mapping.close()
        if delete:
            self.client.delete(self.pool)

    # -- the Mapping's callbacks (its follower thread) --------------------------------------------------------------
    def _on_pause(self, ranges):
        with self._cv:
            self._paused = True
            while self._active:
                self._cv.wait()
        if self.mapping.cuda_device is not None:
            import torch  # noqa: PLC0415
            torch.cuda.synchronize(self.mapping.cuda_device)

    def _on_resume(self, applied):
        with self._cv:
            self._paused = False
            if self.mapping.committed_blocks == 0:  # a sleep's RESUME
                self._sleeping = True
            self._clip_locked()
            self._cv.notify_all()

    def _on_grow(self, committed_blocks):
        with self._cv:
            woke, kept = self._sleeping, self._kept
        if woke:  # another session's wake (this one's own ends in wake())
            self._woken(kept)

    def _on_release(self, committed_blocks):
        with self._cv:
            self._clip_locked()

    def _on_restart(self, restart):
        if restart.lost_chunk_ids:
            self._emptied()
        with self._cv:
            kept = self._kept
        if kept and self.client.pool(self.pool).kept_bytes == 0:  # the restarted kvd did not keep them
            with self._cv:
                self._kept = False

    def _clip_locked(self):
        backed = self.mapping.committed_blocks * self.block_tokens
        if backed and any(n > backed for n in self.lengths):
            self.lengths = [min(n, backed) for n in self.lengths]
            self.emptied += 1

    def _emptied(self):
        with self._cv:
            self._sleeping = self._kept = False
            self.lengths = [0] * self.layers
            self.tokens = []
            self.emptied += 1
            self._cv.notify_all()


def store_for_model(model_or_config, pool, client=None, socket=None, batch_size=1, max_cache_len=None, dtype=None,
                    device=None, block_tokens=16, initial_tokens=None):
    """A KvdKVStore shaped for a transformers model (or its config) on CUDA, torch tensors as views."""
    import torch  # noqa: PLC0415
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        others = sorted({t for t in layer_types if t != "full_attention"})
        raise KvdError("UNIMPLEMENTED", f"kvd.transformers caches full-attention layers only; this model has {others}")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    dtype = dtype or getattr(model_or_config, "dtype", None) or torch.float32
    if isinstance(dtype, str):  # a config's "float32"
        dtype = getattr(torch, dtype)
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    if client is None:
        import kvd  # noqa: PLC0415
        client = kvd.connect(socket)
    return KvdKVStore(client, pool, text.num_hidden_layers, kv_heads, head_dim,
                      max_cache_len or text.max_position_embeddings, dtype, torch.empty((), dtype=dtype).element_size(),
                      batch_size=batch_size, block_tokens=block_tokens, initial_tokens=initial_tokens, attn=attn,
                      device=device)


def _make_cache_classes():
    from transformers import cache_utils  # noqa: PLC0415
    if not hasattr(cache_utils, "CacheLayerMixin"):
        import transformers  # noqa: PLC0415
        raise ImportError(f"kvd.transformers needs a transformers whose Cache is made of CacheLayerMixin layers; "
                          f"transformers {transformers.__version__} has none")

    class KvdLayer(cache_utils.CacheLayerMixin):
        """One layer of a KvdCache: its keys and values are views of the pool (KvdKVStore)."""

        is_compileable = False
        is_sliding = False

        def __init__(self, store, layer):
            super().__init__()
            self.store, self.layer = store, layer
            self.max_batch_size, self.max_cache_len = store.batch, store.max_tokens
            self.is_initialized = True
            self.keys, self.values = store.cached(layer)

        def lazy_initialization(self, key_states):
            self.dtype, self.device = key_states.dtype, key_states.device

        def update(self, key_states, value_states, cache_kwargs=None):
            self.keys, self.values = self.store.update(key_states, value_states, self.layer)
            return self.keys, self.values

        def get_mask_sizes(self, cache_position):
            # transformers 5 passes the query length, earlier releases the cache positions.
            queries = cache_position if isinstance(cache_position, int) else cache_position.shape[0]
            return self.store.length(self.layer) + queries, 0

        def get_seq_length(self):
            return self.store.length(self.layer)

        def get_max_cache_shape(self):
            return -1

        def get_max_length(self):  # what transformers releases before get_max_cache_shape call it
            return -1

        def crop(self, max_length):
            self.store.crop(max_length)

        def reset(self):
            self.store.reset()

        def reorder_cache(self, beam_idx):
            if self.layer == 0:
                self.store.reorder(beam_idx)

        def offload(self):
            raise NotImplementedError("kvd.transformers: the cache lives in kvd memory; sleep() it instead")

        def batch_repeat_interleave(self, repeats):
            raise NotImplementedError("kvd.transformers: the batch size is the pool's; make a cache of that batch")

        def batch_select_indices(self, indices):
            raise NotImplementedError("kvd.transformers: the batch size is the pool's; make a cache of that batch")

    class KvdCache(cache_utils.Cache):
        """A transformers Cache in a kvd pool (see the module's doc). `model_or_config` shapes it; with a model, its
        forward passes are bound (forward pre/post hooks) so that pauses wait for them."""

        def __init__(self, model_or_config, pool, client=None, socket=None, batch_size=1, max_cache_len=None,
                     dtype=None, device=None, block_tokens=16, initial_tokens=None):
            self.store = store_for_model(model_or_config, pool, client=client, socket=socket, batch_size=batch_size,
                                         max_cache_len=max_cache_len, dtype=dtype, device=device,
                                         block_tokens=block_tokens, initial_tokens=initial_tokens)
            super().__init__(layers=[KvdLayer(self.store, l) for l in range(self.store.layers)])
            self._hooks = []
            if hasattr(model_or_config, "register_forward_pre_hook"):
                self.bind(model_or_config)

        def bind(self, model):
            """Every forward of `model` holds the cache (torch module hooks): a pause waits for it."""
            held = []

            def begin(module, args, kwargs=None):
                cm = self.store.forward()
                cm.__enter__()
                held.append(cm)

            def end(module, args, output, kwargs=None):
                if held:
                    held.pop().__exit__(None, None, None)

            self._hooks.append(model.register_forward_pre_hook(begin))
            try:
                self._hooks.append(model.register_forward_hook(end, always_call=True))
            except TypeError:  # a torch without always_call
                self._hooks.append(model.register_forward_hook(end))

        @property
        def tokens(self):
            return self.store.tokens

        def checkpoint(self, tokens=None):
            self.store.checkpoint(tokens)

        def sleep(self, keep=False):
            self.store.sleep(keep=keep)

        def wake(self):
            self.store.wake()
            self._refresh()

        def compact(self):
            return self.store.compact()

        def _refresh(self):
            for layer in self.layers:
                layer.keys, layer.values = self.store.cached(layer.layer)

        def close(self, delete=False):
            for h in self._hooks:
                h.remove()
            self.store.close(delete=delete)

    return KvdCache, KvdLayer


def __getattr__(name):
    """KvdCache and KvdLayer are made on first use: they need transformers (and torch)."""
    if name in ("KvdCache", "KvdLayer"):
        cache, layer = _make_cache_classes()
        globals().update(KvdCache=cache, KvdLayer=layer)
        return globals()[name]
    raise AttributeError(name)
