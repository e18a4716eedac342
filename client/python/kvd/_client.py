"""kvd.connect() / Client / Mapping: a kvd daemon's client (one daemon, one device), through libkvd's C API.

Everything a Client and a Mapping do is libkvd's (docs/integrating.md); this module turns Python arguments
into the C API's, the replies into kvd.v1 messages, and the Mapping into numpy or __cuda_array_interface__
views.
"""

import atexit
import collections
import ctypes
import dataclasses
import logging
import os
import threading
import time
import weakref

from . import _lib
from ._errors import KvdError
from ._lib import call, lib, reply, text, us
from ._proto import pb

_log = logging.getLogger("kvd")

_DTYPES = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}


def default_socket(device=0):
    """$KVD_SOCKET, else /run/kvd/gpu<device>.sock: the socket connect() uses (libkvd's)."""
    return _lib.take_string(lib.kvd_default_socket(int(device)))


def handles_path(socket):
    """The handle channel beside a gRPC socket: X.sock -> X.handles; any other path -> PATH.handles."""
    return _lib.take_string(lib.kvd_handles_path(text(socket)))


def connect(socket=None, device=0, client_name=None, timeout=10.0, reconnect_for=300.0):
    """Opens a session with the kvd daemon of `device` (or at `socket`) -> Client. `device` is an index
    (socket /run/kvd/gpu<N>.sock) or a device UUID (prefix), looked up among the node's kvds
    (find_socket): the way to find the kvd of a GPU whose index differs in this process.
    reconnect_for: seconds a Mapping's follower keeps trying to reach a restarted daemon (0: never)."""
    if socket is None and isinstance(device, str) and not device.isdigit():
        from ._group import find_socket  # noqa: PLC0415 (_group imports this module)
        socket = find_socket(device, timeout=timeout)
    return Client(socket or default_socket(int(device)), client_name=client_name, timeout=timeout,
                  reconnect_for=reconnect_for)


def layout_rule_name(rule):
    """A kvd.v1.LayoutRule -> its name as libkvd's LayoutResolution::rule and kvctl spell it:
    "request_override", "operator_override", "backend_requirement", "client_env", "daemon_env",
    "connector_preference", "default"."""
    return pb.LayoutRule.Name(rule)[len("LAYOUT_RULE_"):].lower()


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where every byte of a pool lives (see kvd.proto `Geometry`); all strides in bytes.

    Byte (l, b, h, n, c) is at base + offset + l*strides[0] + b*strides[1] + h*strides[2] +
    n*strides[3] + c*strides[4]."""

    layout: str
    rule: str              # which rule of the layout chain decided ("backend_requirement": layout_rule_name)
    dims: dict             # layers, capacity_blocks, heads, block_tokens, channels, element_bytes
    strides: tuple         # (stride_l, stride_b, stride_h, stride_n, stride_c)
    offset: int
    layer_stride: int
    block_stride: int
    segments: int
    segment_stride: int
    reserved_bytes: int
    granularity_bytes: int

    @classmethod
    def from_proto(cls, g, resolution=None):
        """From a kvd.v1.Geometry (and the kvd.v1.LayoutResolution that says its rule)."""
        return cls._of(g, g.dims, g.layout, resolution)

    @classmethod
    def _of(cls, g, d, layout, resolution):
        return cls(layout=layout, rule=layout_rule_name(resolution.rule) if resolution is not None else "",
                   dims=dict(layers=d.layers, capacity_blocks=d.capacity_blocks, heads=d.heads,
                             block_tokens=d.block_tokens, channels=d.channels, element_bytes=d.element_bytes),
                   strides=(g.stride_l, g.stride_b, g.stride_h, g.stride_n, g.stride_c), offset=g.offset,
                   layer_stride=g.layer_stride, block_stride=g.block_stride, segments=g.segments,
                   segment_stride=g.segment_stride, reserved_bytes=g.reserved_bytes,
                   granularity_bytes=g.granularity_bytes)


@dataclasses.dataclass(frozen=True)
class GroupMembership:
    """One rank of an engine group (kvd.proto `GroupMembership`): the pools of one engine's
    tensor-parallel ranks, one per daemon, carry the same name and size and distinct ranks.
    create_pool(group=...) takes one of these or a (name, rank, size) tuple; kvd.Group resizes the
    ranks together."""

    name: str
    rank: int
    size: int

    @classmethod
    def of(cls, group):
        """A GroupMembership, a (name, rank, size) tuple or a kvd.v1.GroupMembership -> GroupMembership."""
        if isinstance(group, cls):
            return group
        if isinstance(group, pb.GroupMembership):
            return cls(group.name, group.rank, group.size)
        name, rank, size = group
        return cls(str(name), int(rank), int(size))

    def to_proto(self):
        return pb.GroupMembership(name=self.name, rank=self.rank, size=self.size)


# Client.prepare's operations by name (the C API's numbers are kvd.v1.Operation's).
OPERATIONS = {"grow": pb.OPERATION_GROW, "shrink": pb.OPERATION_SHRINK, "sleep": pb.OPERATION_SLEEP,
              "wake": pb.OPERATION_WAKE}


def _operation(op):
    if isinstance(op, str) and op.lower() in OPERATIONS:
        return OPERATIONS[op.lower()]
    if isinstance(op, int) and not isinstance(op, bool) and op in OPERATIONS.values():
        return op
    raise KvdError("INVALID_ARGUMENT", f"operation: {op!r} is not one of grow, shrink, sleep, wake "
                   "(or a kvd.v1 Operation value)")


class CudaArray:
    """A zero-copy view of device memory: `torch.as_tensor(view, device="cuda")` or
    `cupy.asarray(view)` use the memory in place (__cuda_array_interface__ version 3)."""

    def __init__(self, ptr, shape, typestr, strides, owner):
        self.ptr, self.shape, self.typestr, self.strides = ptr, tuple(shape), typestr, tuple(strides)
        self._owner = owner  # keeps the Mapping referenced while the view lives

    @property
    def __cuda_array_interface__(self):
        return {"version": 3, "shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False),
                "strides": self.strides, "stream": None}

    def __repr__(self):
        return f"CudaArray(ptr={self.ptr:#x}, shape={self.shape}, typestr={self.typestr!r}, strides={self.strides})"


class _HostArray:
    """The host-memory counterpart of CudaArray, for numpy.asarray."""

    def __init__(self, ptr, shape, dtype, strides, owner):
        self.__array_interface__ = {"version": 3, "shape": tuple(shape), "typestr": dtype.str,
                                    "descr": dtype.descr, "data": (ptr, False), "strides": tuple(strides)}
        self._owner = owner


@dataclasses.dataclass
class DaemonRestart:
    """What a Mapping reports once it is attached again after its daemon restarted (on_restart); as
    libkvd's DaemonRestart."""

    epoch: int                 # the new daemon's
    lost_chunk_ids: list       # chunks this Mapping had that the daemon no longer has (unmapped); [] = nothing lost
    lost_bytes: int
    returned_chunk_ids: list   # chunks whose FDs it handed back to a RECOVERING pool (adopted by the daemon)
    committed_blocks: int      # the pool's, now


# A contiguous byte range of a pool, from its base address, inside one segment (kvd.v1.ByteRange; libkvd's
# ByteRange): what on_pause gets.
ByteRange = collections.namedtuple("ByteRange", "segment offset bytes")


@dataclasses.dataclass
class ReclaimRequest:
    """A RECLAIM event (attach(on_reclaim=...); docs/api.md, "Policy, waiting and reclaim"): give back `bytes`
    of `pool` by `deadline` (Unix seconds), or decline; as libkvd's ReclaimRequest."""

    pool: str
    reclaim_id: int
    bytes: int
    deadline: float
    committed_blocks: int  # the pool's when asked


_RECLAIM_ACTIONS = {"none": _lib.RECLAIM_NONE, "shrink": _lib.RECLAIM_SHRINK, "sleep": _lib.RECLAIM_SLEEP}


def _policy_options(priority=None, min_bytes=None, max_bytes=None, reclaim_timeout=None, on_reclaim_timeout=None):
    """The C API's kvd_policy_options with the fields given (not None); reclaim_timeout in seconds (0: the
    daemon's --reclaim-timeout), on_reclaim_timeout "none", "shrink" or "sleep"."""
    if reclaim_timeout is not None and reclaim_timeout < 0:
        raise KvdError("INVALID_ARGUMENT", f"reclaim_timeout: {reclaim_timeout} s is negative")
    if on_reclaim_timeout is not None and on_reclaim_timeout not in _RECLAIM_ACTIONS:
        raise KvdError("INVALID_ARGUMENT", f"on_reclaim_timeout: {on_reclaim_timeout!r} is not one of none, shrink, "
                       "sleep")
    o = _lib.Options("policy")
    if priority is not None:
        o.set("set_priority", int(priority))
    if min_bytes is not None:
        o.set("set_min_bytes", int(min_bytes))
    if max_bytes is not None:
        o.set("set_max_bytes", int(max_bytes))
    if reclaim_timeout is not None:
        o.set("set_reclaim_timeout_us", us(reclaim_timeout))
    if on_reclaim_timeout is not None:
        o.set("set_on_reclaim_timeout", _RECLAIM_ACTIONS[on_reclaim_timeout])
    return o


def _change_options(wait=False, force=False, whole_chunks_only=False, live_blocks=None, pause_timeout=None,
                    detach_unresponsive=False, max_chunks_per_pause=0, keep=False):
    """The C API's kvd_change_options; pause_timeout in seconds (None or 0: the daemon's --pause-timeout)."""
    o = _lib.Options("change")
    o.set("set_wait", int(bool(wait))).set("set_force", int(bool(force))).set("set_keep", int(bool(keep)))
    o.set("set_whole_chunks_only", int(bool(whole_chunks_only)))
    if live_blocks is not None:
        o.set("set_live_blocks", *_lib.u64_array(live_blocks))
    if pause_timeout is not None:
        if pause_timeout < 0:
            o.__exit__()
            raise KvdError("INVALID_ARGUMENT", f"pause_timeout: {pause_timeout} s is negative")
        o.set("set_pause_timeout_us", us(pause_timeout))
    o.set("set_detach_unresponsive", int(bool(detach_unresponsive)))
    o.set("set_max_chunks_per_pause", int(max_chunks_per_pause))
    return o


class _Handle:
    """A C API handle that calls use while another thread may close it: close() waits for the calls in
    progress, and a call after it finds no handle."""

    def __init__(self, handle):
        self._handle = handle
        self._users = 0
        self._cv = threading.Condition()

    def acquire(self):
        with self._cv:
            if self._handle is None:
                return None
            self._users += 1
            return self._handle

    def release(self):
        with self._cv:
            self._users -= 1
            if self._users == 0:
                self._cv.notify_all()

    def use(self, fn, closed):
        """fn(handle); closed() when the handle is gone."""
        h = self.acquire()
        if h is None:
            return closed()
        try:
            return fn(h)
        finally:
            self.release()

    def take(self):
        """The handle, once no call uses it; None when taken already."""
        with self._cv:
            h, self._handle = self._handle, None
            self._cv.wait_for(lambda: self._users == 0)
            return h


# What is open, closed when the interpreter exits (before it stops running Python code, which libkvd's
# threads call back into): every Mapping until it is closed, the Clients and Groups while they live.
_mappings = set()
_mappings_lock = threading.Lock()
_clients = weakref.WeakSet()
_groups = weakref.WeakSet()


@atexit.register
def _close_everything():
    with _mappings_lock:
        mappings = list(_mappings)
    for m in mappings:
        m.close()
    for g in list(_groups):
        g.close()
    for c in list(_clients):
        c.close()


class Session:
    """A Client's handle-channel session as it is now (a new one after a daemon restart): its token (the
    kvd-session metadata of every call), the uid and pid the daemon saw, and lease redemption."""

    def __init__(self, client, token, uid, pid):
        self._client, self.token, self.uid, self.pid = client, token, uid, pid

    def fetch(self, lease_token, timeout=None):
        """Redeems a lease on the Client's session -> [(chunk_id, fd), ...]; the caller owns the FDs."""
        del timeout  # the Client's
        return self._client._fetch_lease(lease_token)


class Client:
    """A session with one kvd daemon (libkvd's Client). Use as a context manager or call close().

    While the daemon is away every call fails at once with KvdError UNAVAILABLE "kvd at SOCKET is not
    answering (restarting?): retry in 1s: ..."; the first call once it is back opens a new session
    (the token changes). Mappings reconnect on their own for `reconnect_for` seconds (see attach)."""

    def __init__(self, socket, client_name=None, timeout=10.0, reconnect_for=300.0):
        self.timeout = timeout
        self.reconnect_for = reconnect_for
        name = client_name if client_name is not None else f"py-{os.getpid()}"
        self.client_name = name
        handle = ctypes.c_void_p()
        with _lib.Options("connect") as o:
            o.set("set_socket", text(socket)).set("set_client_name", text(name))
            o.set("set_timeout_us", us(timeout)).set("set_reconnect_for_us", us(reconnect_for))
            call(lib.kvd_connect, o.handle, ctypes.byref(handle))
        self.socket = lib.kvd_client_socket(handle).decode()
        self._h = _Handle(handle.value)
        self._lock = threading.Lock()
        self._mappings = {}  # pool name -> Mapping (at most one per pool: see attach)
        _clients.add(self)
        # An unclosed Client that is collected still ends its session, as a closed one does.
        self._finalizer = weakref.finalize(self, lib.kvd_client_close, handle.value)
        self._finalizer.atexit = False  # _close_everything closes it

    # -- plumbing -------------------------------------------------------------------------------
    def _c(self, fn, *args):
        """fn(handle, *args) on the open client; FAILED_PRECONDITION once closed."""
        def closed():
            raise KvdError("FAILED_PRECONDITION", f"the client of kvd at {self.socket} is closed")
        return self._h.use(lambda h: fn(h, *args), closed)

    def _reply(self, message_type, fn, *args):
        return self._c(lambda h: reply(message_type, fn, h, *args))

    def _call(self, method, request, timeout=None):
        """One RPC of kvd.v1.Kvd by name on this Client's session, and nothing more (an Attach maps
        nothing) -> its reply message. timeout: seconds (None: the Client's)."""
        desc = pb.DESCRIPTOR.services_by_name["Kvd"].methods_by_name.get(method)
        data = request.SerializeToString()
        args = (lib.kvd_client_call, text(method), data, len(data), us(timeout) if timeout is not None else 0)
        if desc is None:  # libkvd says why
            self._c(lambda h: call(args[0], h, *args[1:], None))
        return self._reply(getattr(pb, desc.output_type.name), *args)

    @property
    def session(self):
        """The current handle-channel session (a new one after a daemon restart)."""
        token, uid, pid = ctypes.c_void_p(), ctypes.c_uint32(), ctypes.c_int32()
        self._c(lambda h: call(lib.kvd_client_session, h, ctypes.byref(token), ctypes.byref(uid), ctypes.byref(pid)))
        return Session(self, _lib.take_string(token), uid.value, pid.value)

    def _fetch_lease(self, lease_token):
        ids, fds, n = ctypes.POINTER(ctypes.c_uint64)(), ctypes.POINTER(ctypes.c_int)(), ctypes.c_size_t()
        self._c(lambda h: call(lib.kvd_client_fetch_lease, h, text(lease_token), ctypes.byref(ids), ctypes.byref(fds),
                               ctypes.byref(n)))
        try:
            return [(ids[i], fds[i]) for i in range(n.value)]
        finally:
            lib.kvd_free(ids)
            lib.kvd_free(fds)

    # -- device and pools -----------------------------------------------------------------------
    def device_info(self):
        """GetDeviceInfo -> kvd.v1.DeviceInfo (backend, free_bytes, budget_bytes, ...)."""
        return self._reply(pb.DeviceInfo, lib.kvd_client_device_info)

    def pools(self):
        """ListPools -> [kvd.v1.Pool] (only pools this uid may use), every page of it, by name."""
        return list(self._reply(pb.ListPoolsResponse, lib.kvd_client_list_pools).pools)

    def pool(self, name):
        """GetPool -> kvd.v1.Pool."""
        return self._reply(pb.Pool, lib.kvd_client_get_pool, text(name))

    @staticmethod
    def _pool_options(o, layers=0, capacity_blocks=0, heads=0, block_tokens=0, channels=0, element_bytes=0,
                      dims=True, override=None, backend_requirements=None, connector_preferences=(), env_layout=None):
        if dims:
            o.set("set_dims", ctypes.byref(_lib.Dims(layers, capacity_blocks, heads, block_tokens, channels,
                                                     element_bytes)))
        if override:
            o.set("set_override_layout", text(override))
        for backend, layouts in (backend_requirements or {}).items():
            layouts = [layouts] if isinstance(layouts, str) else list(layouts)
            o.set("add_backend_requirement", text(backend), (ctypes.c_char_p * max(len(layouts), 1))(
                *[text(x) for x in layouts]), len(layouts))
        for connector, layout in connector_preferences or ():
            o.set("add_connector_preference", text(connector), text(layout))
        if env_layout is not None:  # None: libkvd forwards this process's $KVD_KV_CACHE_LAYOUT
            o.set("set_env_layout", text(env_layout))
        return o

    def create_pool(self, name, layers, capacity_blocks, heads, block_tokens, channels, element_bytes,
                    initial_blocks=0, override=None, backend_requirements=None, connector_preferences=(),
                    allowed_uids=(), env_layout=None, group=None, peer_devices=(), priority=0, min_bytes=0,
                    max_bytes=0, reclaim_timeout=0, on_reclaim_timeout="none"):
        """CreatePool -> kvd.v1.Pool. backend_requirements: {"FLASHINFER": ["block-outermost"]};
        connector_preferences: [("nixl", "LBNHC")]; $KVD_KV_CACHE_LAYOUT is forwarded as env_layout.
        group: this pool is one rank of an engine group, a kvd.GroupMembership or (name, rank, size);
        peer_devices: device UUIDs (or "*") whose processes may attach it (see grant_peer_access).
        The returned Pool says both back (pool.group, pool.peer_devices), and pool.transaction while a
        group operation holds it. priority, min_bytes, max_bytes, reclaim_timeout (seconds; 0: the daemon's)
        and on_reclaim_timeout ("none", "shrink", "sleep"): the pool's policy (set_policy)."""
        with _policy_options(priority, min_bytes, max_bytes, reclaim_timeout, on_reclaim_timeout) as policy, \
                _lib.Options("pool", text(name)) as o:
            o.set("set_policy", policy.handle)
            self._pool_options(o, layers, capacity_blocks, heads, block_tokens, channels, element_bytes,
                               override=override, backend_requirements=backend_requirements,
                               connector_preferences=connector_preferences, env_layout=env_layout)
            o.set("set_initial_blocks", int(initial_blocks))
            for uid in allowed_uids:
                o.set("add_allowed_uid", int(uid))
            if group is not None:
                g = GroupMembership.of(group)
                o.set("set_group", text(g.name), g.rank, g.size)
            for device in peer_devices:
                o.set("add_peer_device", text(device))
            return self._reply(pb.Pool, lib.kvd_client_create_pool, o.handle)

    def resolve_layout(self, override=None, backend_requirements=None, connector_preferences=(), env_layout=None,
                       dims=None):
        """ResolveLayout (dry run) -> kvd.v1.ResolveLayoutResponse; dims: a dict of PoolDims fields."""
        with _lib.Options("pool", None) as o:
            self._pool_options(o, **(dims or {}), dims=bool(dims), override=override,
                               backend_requirements=backend_requirements, connector_preferences=connector_preferences,
                               env_layout=env_layout)
            return self._reply(pb.ResolveLayoutResponse, lib.kvd_client_resolve_layout, o.handle)

    def delete(self, name, force=False, pause_timeout=None):
        """DeletePool -> released bytes. force: even with clients attached; those of other sessions are
        paused first when pausable (within pause_timeout seconds, None: the daemon's --pause-timeout; one
        that does not acknowledge is detached), or keep what they map until they close when not
        (docs/api.md, "Releases and running engines")."""
        with _change_options(force=force, pause_timeout=pause_timeout) as o:
            return self._reply(pb.DeletePoolResponse, lib.kvd_client_delete_pool, text(name), o.handle).released_bytes

    def attach(self, name, on_grow=None, on_release=None, on_lost=None, client_name="", device=None,
               on_restart=None, on_pause=None, on_resume=None, on_reclaim=None):
        """Attach + map every chunk + start following the pool -> Mapping.

        device: the device this process maps the pool from: None for the daemon's own (found by its
        UUID: indices are per process), else an index or UUID (prefix) of this process's devices of
        the daemon's backend (CUDA: as this process numbers them). Another device than the daemon's is
        peer access: the pair must support it (FAILED_PRECONDITION naming both devices; NOT_FOUND when
        this process does not see the daemon's device) and the pool must grant it (peer_devices,
        grant_peer_access; PERMISSION_DENIED otherwise). The chunks are then mapped with access for
        the local device.

        Callbacks run on the Mapping's follower thread (libkvd's), one at a time, for changes made by
        OTHER sessions (a grow/wake through this Client maps before returning and calls none), with the
        arguments libkvd's AttachOptions callbacks get: on_grow(committed_blocks) after new chunks
        are mapped; on_release(committed_blocks) after released chunks are unmapped and
        acknowledged; on_lost(why), a KvdError, once the Mapping is lost: NOT_FOUND "pool P was
        deleted", UNAVAILABLE "kvd is stopping", the event stream's end or error, or a failure to map
        added chunks or to acknowledge a release (the Mapping then detaches); after a daemon restart
        also NOT_FOUND "pool P did not survive the restart of kvd ..." or UNAVAILABLE when the daemon
        was not back within reconnect_for.
        on_restart(DaemonRestart) once per daemon restart (DAEMON_RESTARTING, or a crash: the stream
        broke with UNAVAILABLE), after the Mapping reconnected: it handed its chunks' FDs back if the
        pool was RECOVERING, attached again (a new client_id), kept every chunk the daemon still has
        (same id, segment, offset, bytes) mapped untouched, unmapped the lost ones, mapped new ones.
        Pauses (docs/api.md, "Pauses and reshaping"): giving on_pause makes the Mapping pausable
        (AttachRequest.pausable), so the daemon may move the pool's bytes into new chunks at the same
        addresses (an exact shrink, compact) while it is attached, and pauses it before another
        session's shrink, sleep or forced delete takes memory away. On a PAUSE the follower imports the
        new chunks (without mapping them), calls on_pause(ranges) -- ranges: [kvd.ByteRange(segment,
        offset, bytes)], the bytes that move or go; stop every access to the pool (synchronise the
        streams that use it) and return -- and acknowledges. On the RESUME it unmaps the replaced chunks,
        maps the new ones at the same addresses, sets committed_blocks and calls on_resume(applied), then
        acknowledges; applied is False when the change was called off (nothing moved).
        Without on_pause the Mapping is not pausable: while it is attached, a shrink that must replace a
        chunk and compact fail with FAILED_PRECONDITION naming it, and so do other sessions' releases
        unless forced (a forced one leaves it everything mapped, lost, until it is closed).
        They must not close the Mapping nor shrink/sleep/compact this pool with wait=True (nor
        shrink/compact it at all from on_pause or on_resume).
        Reclaims (docs/api.md, "Policy, waiting and reclaim"): on_reclaim(kvd.ReclaimRequest) runs on a
        thread of its own (libkvd's, not the follower) when a waiting grow of higher priority asks this pool
        for memory, so it may give back right there (drop prefix cache, then shrink_for_reclaim with the live
        blocks) and return; raising declines, with its message (decline_reclaim), and the pool's
        on_reclaim_timeout policy applies at once. Without it the event is ignored. close() waits for it.
        One Mapping per pool per Client: the daemon hands the caller's lease to one client of the
        session."""
        if device is not None and not str(device).strip():
            raise KvdError("INVALID_ARGUMENT", 'attach: device "": empty; give an index (0, 1, ...) or a device UUID '
                           "(prefix)")
        m = Mapping(self, name, on_grow, on_release, on_lost, on_restart, on_pause, on_resume, on_reclaim)
        handle = ctypes.c_void_p()
        with _lib.Options("attach") as o:
            o.set("set_client_name", text(client_name))
            if device is not None:
                o.set("set_device", text(str(device).strip()))
            for event, fn in m._callbacks.items():
                o.set(f"set_on_{event}", fn)
            try:
                self._c(lambda h: call(lib.kvd_client_attach, h, text(name), o.handle, ctypes.byref(handle)))
            except BaseException:
                m._ready.set()
                raise
        m._attached(handle.value)
        with self._lock:
            self._mappings[name] = m
        return m

    # -- resizing -------------------------------------------------------------------------------
    def grow(self, name, blocks, wait=False, wait_for=None):
        """Grow to `blocks` committed blocks -> kvd.v1.PoolUpdate; this Client's Mapping of the pool
        has mapped the new chunks when it returns (those another session's release took first are left to
        that release's event: docs/api.md, "Leases and concurrent releases"). wait: when memory is short,
        wait for it (queued by the pool's priority, memory reclaimed from pools of lower priority) for at most
        wait_for seconds (None: the Client's timeout); then RESOURCE_EXHAUSTED saying what it waited for and
        whom it asked."""
        if wait:
            return self._reply(pb.PoolUpdate, lib.kvd_client_grow_waiting, text(name), int(blocks),
                               us(wait_for or 0))
        return self._reply(pb.PoolUpdate, lib.kvd_client_grow, text(name), int(blocks))

    def shrink(self, name, blocks, wait=False, whole_chunks_only=False, live_blocks=None, pause_timeout=None,
               detach_unresponsive=False, force=False):
        """Shrink to `blocks` -> kvd.v1.PoolUpdate (its `reshape` says what it did). Exact: every segment's
        committed prefix ends at `blocks` rounded up to the granularity; a chunk straddling it is replaced
        by a smaller one, copied on the device while the attached clients pause (docs/api.md, "Pauses and
        reshaping"). wait: reply once every client acknowledged the release.
        whole_chunks_only: release whole chunks only and move no byte; the pool may stay above the target
        (reshape.target_reached False, pool.committed_blocks says where).
        live_blocks: a compaction shrink: the blocks the engine still uses (an iterable; [] for none); live
        blocks at or above `blocks` are first copied into free blocks below it, reshape.moved_blocks
        ([BlockCopy(src, dst)]) says where each went. None: no compaction.
        pause_timeout: seconds each client has to acknowledge the PAUSE (None: the daemon's
        --pause-timeout); detach_unresponsive: detach a client that does not instead of failing with
        DEADLINE_EXCEEDED. Whole chunks also go only once the pausable clients of other sessions paused; one
        that is not pausable refuses the shrink (FAILED_PRECONDITION naming it) unless force, which leaves
        it what it maps until it closes (docs/api.md, "Releases and running engines"). This Client's own
        Mapping of the pool has remapped when it returns."""
        with _change_options(wait=wait, force=force, whole_chunks_only=whole_chunks_only, live_blocks=live_blocks,
                             pause_timeout=pause_timeout, detach_unresponsive=detach_unresponsive) as o:
            return self._reply(pb.PoolUpdate, lib.kvd_client_shrink, text(name), int(blocks), o.handle)

    def compact(self, name, pause_timeout=None, detach_unresponsive=False, max_chunks_per_pause=0):
        """Compact -> kvd.v1.PoolUpdate: rewrites a fragmented pool as one chunk per segment (split at the
        daemon's --max-chunk), copied on the device while the attached clients pause; reshape says the
        chunks before and after, the bytes copied, the pauses (steps, pause_us, max_pause_us).
        With clients attached it goes in steps that each replace at most max_chunks_per_pause chunks
        under a pause of their own (0: the daemon's --compact-chunks-per-pause); each step is all or
        nothing, and a step that fails leaves the steps before it done (the error says so). pause_timeout
        and detach_unresponsive as shrink's. This Client's own Mapping of the pool has remapped when it
        returns."""
        with _change_options(pause_timeout=pause_timeout, detach_unresponsive=detach_unresponsive,
                             max_chunks_per_pause=max_chunks_per_pause) as o:
            return self._reply(pb.PoolUpdate, lib.kvd_client_compact, text(name), o.handle)

    def sleep(self, name=None, wait=False, force=False, pause_timeout=None, detach_unresponsive=False, keep=False,
              live_blocks=None):
        """Sleep one pool, or every awake pool (name None or "") -> [kvd.v1.PoolUpdate]. The Mappings
        learn of it from their release events (with wait: before this returns). The pausable Mappings of
        other sessions are paused first (pause_timeout and detach_unresponsive as shrink's); one that is not
        pausable refuses the sleep unless force (docs/api.md, "Releases and running engines").
        keep: the contents go to the daemon's host tier and wake() brings them back at the same addresses;
        live_blocks (with keep and a named pool): only those blocks are kept (docs/api.md, "Sleep that keeps
        the contents")."""
        with _change_options(wait=wait, force=force, pause_timeout=pause_timeout,
                             detach_unresponsive=detach_unresponsive, keep=keep, live_blocks=live_blocks) as o:
            return list(self._reply(pb.PoolUpdates, lib.kvd_client_sleep, text(name or ""), o.handle).updates)

    def wake(self, name=None, wait=False, wait_for=None):
        """Wake one pool, or every sleeping pool (name None or "") -> [kvd.v1.PoolUpdate]; this Client's
        Mappings have mapped the fresh (zeroed) chunks when it returns. wait, wait_for: as grow's (one
        pool only)."""
        if wait:
            return list(self._reply(pb.PoolUpdates, lib.kvd_client_wake_waiting, text(name or ""),
                                    us(wait_for or 0)).updates)
        return list(self._reply(pb.PoolUpdates, lib.kvd_client_wake, text(name or "")).updates)

    # -- arbitration (docs/api.md, "Policy, waiting and reclaim") --------------------------------
    def set_policy(self, name, priority=None, min_bytes=None, max_bytes=None, reclaim_timeout=None,
                   on_reclaim_timeout=None):
        """SetPoolPolicy: the fields given replace the pool's -> kvd.v1.Pool. A uid other than root and kvd's
        may lower its pool's claim, and raise it only within what the operator grants it (PERMISSION_DENIED
        naming the field); INVALID_ARGUMENT names a field out of range, or says none was given.
        reclaim_timeout in seconds (0: the daemon's --reclaim-timeout); on_reclaim_timeout "none", "shrink" or
        "sleep"."""
        with _policy_options(priority, min_bytes, max_bytes, reclaim_timeout, on_reclaim_timeout) as o:
            return self._reply(pb.Pool, lib.kvd_client_set_pool_policy, text(name), o.handle)

    def report_usage(self, name, live_blocks, evictable_blocks=0, used_blocks=None):
        """ReportUsage: the blocks the engine needs (live), those it could drop (evictable), and the bound
        below which all of them lie (used_blocks; None: live + evictable, for an engine that keeps them
        packed from block 0). kvd asks the pools with the most to give first, and an on_reclaim_timeout of
        "shrink" shrinks to used_blocks."""
        used = int(live_blocks) + int(evictable_blocks) if used_blocks is None else int(used_blocks)
        self._reply(pb.ReportUsageResponse, lib.kvd_client_report_usage, text(name), int(live_blocks),
                    int(evictable_blocks), used)

    def decline_reclaim(self, request, reason=""):
        """DeclineReclaim of a kvd.ReclaimRequest (on_reclaim does this when it raises)."""
        self._reply(pb.DeclineReclaimResponse, lib.kvd_client_decline_reclaim, text(request.pool),
                    int(request.reclaim_id), text(reason))

    def shrink_for_reclaim(self, request, live_blocks, pause_timeout=None):
        """From "these blocks are live" to the compaction shrink that answers `request` (libkvd's
        ShrinkForReclaim): shrinks the pool to the fewest blocks that give back at least request.bytes, never
        below len(live_blocks), at a chunk boundary where one lies between (nothing then needs copying but the
        live blocks that move), waiting for the release -> kvd.v1.PoolUpdate; update.reshape.moved_blocks
        says where each moved live block went (apply it to the engine's block table). FAILED_PRECONDITION
        when the live blocks fill the pool."""
        ids, n = _lib.u64_array(live_blocks)
        with _change_options(pause_timeout=pause_timeout) as o:
            return self._reply(pb.PoolUpdate, lib.kvd_client_shrink_for_reclaim, text(request.pool),
                               int(request.bytes), ids, n, o.handle)

    # -- pool metadata ---------------------------------------------------------------------------
    def metadata(self, name):
        """GetPoolMetadata -> kvd.v1.PoolMetadata (pool, version, data, updated_at_unix_ms): engine-defined
        bytes kept with the pool across restarts of kvd and of the engine; version 0 until first set."""
        return self._reply(pb.PoolMetadata, lib.kvd_client_get_metadata, text(name))

    def set_metadata(self, name, data, expected_version):
        """SetPoolMetadata -> kvd.v1.PoolMetadata, a compare-and-set: ABORTED (nothing changed) unless
        `expected_version` is the current version (0 for a pool never set); INVALID_ARGUMENT past the
        daemon's --max-metadata-bytes."""
        data = bytes(data)
        return self._reply(pb.PoolMetadata, lib.kvd_client_set_metadata, text(name), int(expected_version), data,
                           len(data))

    # -- engine groups and peer access ----------------------------------------------------------
    def grant_peer_access(self, name, device_uuid, revoke=False):
        """GrantPeerAccess -> kvd.v1.Pool: lets processes on the device `device_uuid` (as that device's
        daemon reports it, or "*" for every device) attach the pool; revoke takes the grant back
        (mappings that exist stay)."""
        return self._reply(pb.Pool, lib.kvd_client_grant_peer_access, text(name), text(device_uuid), int(bool(revoke)))

    def prepare(self, name, op, target_blocks=0, ttl=30.0, force=False, keep=False):
        """Phase one of a group operation on this daemon -> kvd.v1.PrepareResponse (transaction,
        pool as it is now, prepared_bytes, expires_at_unix_ms). op: "grow", "shrink", "sleep", "wake"
        (or a kvd.v1 Operation); target_blocks for grow and shrink. The daemon does everything that
        can fail and holds the pool (other resizes get ABORTED) until commit() or abort() from this
        Client, `ttl` seconds, or the end of this Client's session. kvd.Group drives it on every rank.
        A shrink or sleep pauses the pausable Mappings of other sessions until the commit or abort; one that
        is not pausable refuses it unless force (docs/api.md, "Releases and running engines"). keep: a sleep
        keeps the contents in the host tier (sleep()'s keep), copied here."""
        return self._reply(pb.PrepareResponse, lib.kvd_client_prepare, text(name), _operation(op), int(target_blocks),
                           us(ttl), int(bool(force)), int(bool(keep)))

    def commit(self, transaction, wait=False):
        """Phase two: makes a prepared change visible -> kvd.v1.PoolUpdate. As grow() and wake(), this
        Client's Mapping of the pool has mapped the new chunks when it returns; wait is shrink()'s and
        sleep()'s (reply once every attached client acknowledged)."""
        return self._reply(pb.PoolUpdate, lib.kvd_client_commit, text(transaction), int(bool(wait)))

    def abort(self, transaction):
        """Undoes a prepare -> the prepared bytes given back."""
        return self._reply(pb.AbortResponse, lib.kvd_client_abort, text(transaction)).released_bytes

    def zero_blocks(self, name, block_ids):
        """ZeroBlocks: the blocks' bytes become zero, on the device."""
        ids, n = _lib.u64_array(block_ids)
        self._reply(pb.ZeroBlocksResponse, lib.kvd_client_zero_blocks, text(name), ids, n)

    def copy_blocks(self, name, copies):
        """CopyBlocks: copies: [(src, dst), ...], block to block on the device."""
        flat, n = _lib.u64_array([x for pair in copies for x in pair])
        self._reply(pb.CopyBlocksResponse, lib.kvd_client_copy_blocks, text(name), flat, n // 2)

    # -- KV connectors (docs/connectors.md) -----------------------------------------------------
    def describe_transfer(self, name, block_ids=None):
        """DescribeTransfer -> kvd.v1.DescribeTransferResponse: the strided descriptors (segment,
        offset, bytes, stride, count: `count` runs of `bytes` bytes, run i at offset + i*stride from the
        pool's base) covering `block_ids` (None or empty: every committed block) under the pool's
        layout. Raises INVALID_ARGUMENT naming block_ids[i] for an uncommitted or repeated id."""
        ids, n = _lib.u64_array(block_ids or [])
        return self._reply(pb.DescribeTransferResponse, lib.kvd_client_describe_transfer, text(name), ids, n)

    def export_ranges(self, client_id, ranges=None):
        """ExportRanges -> (kvd.v1.ExportRangesResponse, [fd, ...]): FDs over byte ranges of the pool that
        the attached client `client_id` (of this Client) belongs to, one per response handle, in order;
        the pool's bytes [h.offset, h.offset + h.bytes) are at h.fd_offset in handle h's FD (CUDA: a
        DMA-BUF; host: a memfd). `ranges`: [(offset, bytes), ...], granularity multiples inside one
        segment's committed prefix; None: every segment's whole committed prefix. The caller closes the
        FDs (once registered)."""
        ranges = list(ranges or [])
        array = (_lib.ByteRange * max(len(ranges), 1))(*[_lib.ByteRange(0, o, b) for o, b in ranges])
        buffer, fds, n = _lib.Buffer(), ctypes.POINTER(ctypes.c_int)(), ctypes.c_size_t()
        self._c(lambda h: call(lib.kvd_client_export_ranges, h, text(client_id), array, len(ranges),
                               ctypes.byref(buffer), ctypes.byref(fds), ctypes.byref(n)))
        try:
            return pb.ExportRangesResponse.FromString(_lib.take_buffer(buffer)), [fds[i] for i in range(n.value)]
        finally:
            lib.kvd_buffer_free(ctypes.byref(buffer))
            lib.kvd_free(fds)

    # -- lifetime -------------------------------------------------------------------------------
    def close(self):
        """Closes every Mapping and the session (the daemon detaches what is left). Idempotent."""
        with self._lock:
            mappings = list(self._mappings.values())
            self._mappings.clear()
        for m in mappings:
            m.close()
        if self._h.take() is not None:
            self._finalizer()

    def _forget(self, mapping):
        with self._lock:
            if self._mappings.get(mapping.pool_name) is mapping:
                del self._mappings[mapping.pool_name]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# The Mapping a callback of this thread belongs to, while it runs: it must not close that Mapping.
_in_callback = threading.local()


class Mapping:
    """One attached pool, mapped at `base` in this process (libkvd's Mapping): VA for
    geometry.reserved_bytes, every chunk at base + chunk.offset. libkvd's follower thread follows the
    pool (maps grown/woken chunks, unmaps and acknowledges released ones, pauses and resumes; after a
    daemon restart it reconnects: see Client.attach's on_restart). close() detaches, unmaps and frees the
    VA.

    Views from layer() span the pool's whole capacity (the pointers never move); only blocks below
    `committed_blocks` are backed while the pool is awake. Touching others faults (SIGSEGV on
    host, an illegal address on CUDA). Views must not be used after close(). A pausable Mapping
    (attach(on_pause=...)) also acts on PAUSE and RESUME: the views stay valid across them, and read
    the same bytes from the new memory after the RESUME. `state` is the pool's as the Mapping last knew
    it (kvd.v1.PoolState), also once it is lost; `gone` says that it is."""

    def __init__(self, client, pool_name, on_grow, on_release, on_lost, on_restart, on_pause, on_resume,
                 on_reclaim=None):
        self._client = client
        self.pool_name = pool_name
        self.on_grow, self.on_release, self.on_lost, self.on_restart = on_grow, on_release, on_lost, on_restart
        self.on_pause, self.on_resume = on_pause, on_resume
        self.on_reclaim = on_reclaim
        self.pausable = on_pause is not None
        self.closed = False
        self.gone = None  # once the Mapping is lost: the KvdError on_lost got
        self._h = _Handle(None)
        self._ready = threading.Event()  # attached: the callbacks may run
        self._final = {}  # what the accessors answer once closed
        # The C API's callbacks, kept referenced while libkvd may call them.
        self._callbacks = {
            "grow": _lib.BLOCKS_FN(lambda _, blocks: self._callback("on_grow", int(blocks))),
            "release": _lib.BLOCKS_FN(lambda _, blocks: self._callback("on_release", int(blocks))),
            "lost": _lib.LOST_FN(lambda _, code, message: self._lost(code, message)),
            "restart": _lib.RESTART_FN(lambda _, r: self._callback("on_restart", DaemonRestart(
                epoch=r[0].epoch, lost_chunk_ids=[r[0].lost_chunk_ids[i] for i in range(r[0].lost_chunk_count)],
                lost_bytes=r[0].lost_bytes, committed_blocks=r[0].committed_blocks,
                returned_chunk_ids=[r[0].returned_chunk_ids[i] for i in range(r[0].returned_chunk_count)]))),
        }
        if on_pause is not None:
            self._callbacks["pause"] = _lib.RANGES_FN(lambda _, ranges, n: self._callback(
                "on_pause", [ByteRange(ranges[i].segment, ranges[i].offset, ranges[i].bytes) for i in range(n)]))
            self._callbacks["resume"] = _lib.RESUME_FN(lambda _, applied: self._callback("on_resume", bool(applied)))
        if on_reclaim is not None:
            self._callbacks["reclaim"] = _lib.RECLAIM_FN(self._reclaim)

    def _attached(self, handle):
        self._h = _Handle(handle)
        g = lib.kvd_mapping_geometry(handle)[0]
        layout = _lib.Buffer()
        lib.kvd_mapping_layout(handle, ctypes.byref(layout))
        try:
            self.layout_resolution = pb.LayoutResolution.FromString(_lib.take_buffer(layout))
        finally:
            lib.kvd_buffer_free(ctypes.byref(layout))
        self.geometry = Geometry._of(g, g.dims, g.layout.decode(), self.layout_resolution)
        self.base = lib.kvd_mapping_base(handle) or 0
        self._backend = lib.kvd_mapping_device_backend(handle).decode()
        self.device_uuid = lib.kvd_mapping_device_uuid(handle).decode()
        self._device_index = lib.kvd_mapping_device_index(handle)
        with _mappings_lock:
            _mappings.add(self)
        self._ready.set()

    # -- callbacks (on libkvd's follower thread) ------------------------------------------------
    def _callback(self, name, arg):
        self._ready.wait()
        fn = getattr(self, name)
        if fn is None:
            return
        _in_callback.mapping = self
        try:
            fn(arg)
        except Exception:  # a failing callback must not stop the follower (that would detach us)
            _log.exception("kvd: a callback of pool %s raised", self.pool_name)
        finally:
            _in_callback.mapping = None

    def _reclaim(self, _, r, reason, capacity):
        """on_reclaim, on libkvd's reclaim thread: 0 answers; an exception declines with its message."""
        try:
            self._ready.wait()
            request = ReclaimRequest(pool=r[0].pool.decode(), reclaim_id=r[0].reclaim_id, bytes=r[0].bytes,
                                     deadline=r[0].deadline_unix_ms / 1000.0, committed_blocks=r[0].committed_blocks)
            _in_callback.mapping = self
            try:
                self.on_reclaim(request)
            finally:
                _in_callback.mapping = None
            return 0
        except Exception as e:  # noqa: BLE001 -- any failure of the engine's hook is a decline
            why = (str(e) or type(e).__name__).encode(errors="replace")[:max(capacity - 1, 0)]
            ctypes.memmove(reason, why, len(why))
            ctypes.memset(reason + len(why), 0, 1)
            return 2  # UNKNOWN: declined

    def _lost(self, code, message):
        self.gone = KvdError(code, message.decode(errors="replace") if message else "")
        self._callback("on_lost", self.gone)

    # -- state ------------------------------------------------------------------------------------
    def _read(self, fn, what):
        return self._h.use(fn, lambda: self._final[what])

    @property
    def client_id(self):
        """The daemon's id of this attachment; a new one after each daemon restart."""
        return self._read(lambda h: _lib.take_string(lib.kvd_mapping_client_id(h)), "client_id")

    @property
    def epoch(self):
        """The epoch of the daemon this Mapping is attached to now."""
        return self._read(lib.kvd_mapping_epoch, "epoch")

    @property
    def committed_blocks(self):
        """The committed blocks as the daemon last reported them to this Mapping (0 once it is lost)."""
        return self._read(lib.kvd_mapping_committed_blocks, "committed_blocks")

    @property
    def state(self):
        """kvd.v1.POOL_STATE_AWAKE or POOL_STATE_SLEEPING: the pool's as the Mapping last knew it."""
        return self._read(lib.kvd_mapping_pool_state, "state")

    @property
    def mapped_chunks(self):
        """The ids of the chunks mapped now, sorted ([] once closed)."""
        def chunks(h):
            while True:
                n = lib.kvd_mapping_chunks(h, None, 0)
                array = (_lib.Chunk * max(n, 1))()
                got = lib.kvd_mapping_chunks(h, array, n)
                if got <= n:
                    return sorted(array[i].id for i in range(got))
        return self._read(chunks, "mapped_chunks")

    @property
    def pauses(self):
        """The PAUSE events acted on."""
        return self._read(lib.kvd_mapping_pauses, "pauses")

    @property
    def resumes(self):
        """The RESUME events acted on (applied or not)."""
        return self._read(lib.kvd_mapping_resumes, "resumes")

    @property
    def events_seen(self):
        """The events the follower read."""
        return self._read(lib.kvd_mapping_events, "events_seen")

    @property
    def cuda_device(self):
        """The CUDA (or HIP) ordinal, in this process's numbering, the pool is mapped on; None on host."""
        return None if self._backend == "host" else self._device_index

    # -- views ----------------------------------------------------------------------------------
    def _dtype(self, dtype):
        import numpy  # noqa: PLC0415
        eb = self.geometry.dims["element_bytes"]
        dt = numpy.dtype(dtype if dtype is not None else _DTYPES.get(eb, "uint8"))
        if dt.itemsize != eb and not (dtype is None and dt.itemsize == 1):
            raise ValueError(f"dtype {dt} has {dt.itemsize} bytes, the pool's elements {eb}")
        return dt

    def _layer_geometry(self, l, dt):
        g = self.geometry
        if not 0 <= l < g.dims["layers"]:
            raise IndexError(f"layer {l} out of range [0, {g.dims['layers']})")
        d = g.dims
        shape = [d["capacity_blocks"], d["heads"], d["block_tokens"], d["channels"]]
        strides = list(g.strides[1:])
        eb = d["element_bytes"]
        if dt.itemsize != eb:  # raw bytes of wider elements: C becomes C*e bytes
            shape[3] *= eb
            strides[3] = 1
        return self.base + g.offset + l * g.strides[0], shape, strides

    def layer(self, l, dtype=None):
        """Zero-copy view of layer l over the logical [B, H, N, C] (B = capacity_blocks), with the
        pool's byte strides. Host: a numpy array. CUDA (and HIP): a CudaArray (__cuda_array_interface__).
        dtype: default by element_bytes (1 uint8, 2 float16, 4 float32, 8 float64, else raw uint8
        bytes); pass e.g. "int16"/"uint16" or a numpy dtype of the same size (bf16: take float16/
        uint16 and .view(torch.bfloat16) on the torch side)."""
        if self.closed:
            raise KvdError("FAILED_PRECONDITION", f"the mapping of pool {self.pool_name} is closed")
        import numpy  # noqa: PLC0415
        dt = self._dtype(dtype)
        addr, shape, strides = self._layer_geometry(l, dt)
        if self._backend != "host":
            return CudaArray(addr, shape, dt.str, strides, self)
        # numpy reads __array_interface__ (no copy); the array's .base keeps the Mapping referenced.
        return numpy.asarray(_HostArray(addr, shape, dt, strides, self))

    def layers(self, dtype=None):
        return [self.layer(l, dtype) for l in range(self.geometry.dims["layers"])]

    # -- lifetime -------------------------------------------------------------------------------
    def close(self):
        """Stops the follower, unmaps every chunk, frees the VA, then detaches saying so (released: the
        daemon gives back what this client held at once). Idempotent. Not from this Mapping's callbacks."""
        if getattr(_in_callback, "mapping", None) is self:
            raise KvdError("FAILED_PRECONDITION", f"pool {self.pool_name}: a Mapping's callbacks must not close it; "
                           "close it from another thread")
        if self.closed:
            return
        self.closed = True
        h = self._h.acquire()
        if h is not None:
            self._final = {"client_id": _lib.take_string(lib.kvd_mapping_client_id(h)),
                           "epoch": lib.kvd_mapping_epoch(h), "committed_blocks": lib.kvd_mapping_committed_blocks(h),
                           "state": lib.kvd_mapping_pool_state(h), "mapped_chunks": [],
                           "pauses": lib.kvd_mapping_pauses(h), "resumes": lib.kvd_mapping_resumes(h),
                           "events_seen": lib.kvd_mapping_events(h)}
            self._h.release()
        h = self._h.take()
        if h is not None:
            lib.kvd_mapping_close(h)
        with _mappings_lock:
            _mappings.discard(self)
        self._client._forget(self)

    def wait_for(self, predicate, timeout=10.0, interval=0.005):
        """Polls predicate(self) until true or timeout (bounded); returns its last value."""
        deadline = time.monotonic() + timeout
        while True:
            v = predicate(self)
            if v or time.monotonic() >= deadline:
                return v
            time.sleep(interval)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
