"""kvd.connect() / Client / Mapping: the Python client of a kvd daemon (one daemon, one device)."""

import collections
import dataclasses
import logging
import os
import threading
import time

import grpc

from . import _memory, _wire
from ._errors import KvdError
from ._handles import HandleSession, handles_path
from ._proto import pb, pb_grpc

_log = logging.getLogger("kvd")

_DTYPES = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}


def default_socket(device=0):
    """$KVD_SOCKET, else /run/kvd/gpu<device>.sock (_wire.socket_from_environment)."""
    return _wire.socket_from_environment(device)


# The hint a call made while the daemon is away carries (docs/integrating.md, "When kvd restarts").
RETRY_HINT = "retry in 1s"


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
        d = g.dims
        return cls(layout=g.layout,
                   rule=layout_rule_name(resolution.rule) if resolution is not None else "",
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


# Client.prepare's operations by name.
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


def _merged(ranges):
    """ByteRanges (any order) as the fewest contiguous ranges per segment, as the daemon's events have them."""
    out = []
    for r in sorted(ranges):
        if out and out[-1].segment == r.segment and out[-1].offset + out[-1].bytes >= r.offset:
            last = out[-1]
            end = max(last.offset + last.bytes, r.offset + r.bytes)
            out[-1] = ByteRange(last.segment, last.offset, end - last.offset)
        else:
            out.append(r)
    return out


def _pause_options(pause_timeout, detach_unresponsive):
    """-> kvd.v1.PauseOptions; pause_timeout in seconds (None or 0: the daemon's --pause-timeout)."""
    ms = 0
    if pause_timeout is not None:
        if pause_timeout < 0:
            raise KvdError("INVALID_ARGUMENT", f"pause_timeout: {pause_timeout} s is negative")
        # Whole milliseconds, rounded up: a positive timeout never becomes 0 (the daemon's default).
        ms = -(-int(round(pause_timeout * 1e6)) // 1000)
    return pb.PauseOptions(timeout_ms=ms, detach_unresponsive=bool(detach_unresponsive))


def _reshape_call_timeout(client_timeout, pause_timeout):
    """The deadline of a change that may pause the attached clients (as libkvd's): the daemon waits up to
    the pause timeout for the PAUSE acknowledgements and again for the RESUME's, then copies."""
    return max(client_timeout, 65.0, 2 * (pause_timeout or 0) + 65.0)


def _steps_call_timeout(client_timeout, pause_timeout):
    """The deadline of a Compact or an exact Shrink (as libkvd's): they go in as many steps as the chunks per
    pause and the free memory make, a pause each, so they get 10 minutes at least."""
    return max(_reshape_call_timeout(client_timeout, pause_timeout), 600.0)


_raised_open_file_limit = False


def _raise_open_file_limit():
    """A Mapping keeps one FD per mapped chunk (to hand it back after a daemon restart): lift this
    process's soft open-file limit to its hard limit, once, as libkvd's Client::Connect does."""
    global _raised_open_file_limit
    if _raised_open_file_limit:
        return
    _raised_open_file_limit = True
    try:
        import resource  # noqa: PLC0415
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, OSError, ValueError):
        pass  # best effort: the limit stays as it was


class _Connection:
    """One session with the daemon: the handle-channel session and a gRPC channel opened with it (as
    libkvd's Client::Impl::Connection). A restarted daemon knows none of the old sessions, so both are
    replaced together."""

    def __init__(self, socket, client_name, timeout):
        self.session = HandleSession(handles_path(socket), client_name, timeout=timeout)
        # A subchannel of its own: gRPC's global pool would hand a new channel the old daemon's broken
        # connection (or its reconnect backoff).
        self.channel = grpc.insecure_channel("unix:" + socket, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.KvdStub(self.channel)
        self.md = ((_wire.SESSION_METADATA_KEY, self.session.token),)


class _Fatal(Exception):
    """A reconnect attempt that retrying cannot fix: the Mapping is lost with `error`."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


class Client:
    """A session with one kvd daemon: a gRPC channel on the control socket plus the handle-channel
    session (kept open as the session's liveness). Use as a context manager or call close().

    While the daemon is away every call fails at once with KvdError UNAVAILABLE "kvd at SOCKET is not
    answering (restarting?): retry in 1s: ..."; the first call once it is back opens a new session
    (the token changes). Mappings reconnect on their own for `reconnect_for` seconds (see attach)."""

    def __init__(self, socket, client_name=None, timeout=10.0, reconnect_for=300.0):
        self.socket = socket
        self.timeout = timeout
        self.reconnect_for = reconnect_for
        name = client_name if client_name is not None else f"py-{os.getpid()}"
        self.client_name = name
        _raise_open_file_limit()
        self._conn = _Connection(socket, name, timeout)
        self._reopen_lock = threading.Lock()
        self._lock = threading.Lock()
        self._mappings = {}  # pool name -> Mapping (at most one per pool: see attach)
        self._memories = {}  # local device index -> its mapper, opened on first use
        self._info = None

    # -- plumbing -------------------------------------------------------------------------------
    @property
    def session(self):
        """The current handle-channel session (a new one after a daemon restart)."""
        return self._conn.session

    @property
    def stub(self):
        return self._conn.stub

    def _not_answering(self, err):
        if err.code != "UNAVAILABLE":
            return err
        return KvdError("UNAVAILABLE", f"kvd at {self.socket} is not answering (restarting?): {RETRY_HINT}: "
                        f"{err.message}")

    def _live(self):
        """The current connection while its session is up; else a new one (the daemon restarted).
        Raises UNAVAILABLE with the retry hint while no daemon answers."""
        c = self._conn
        if c.session.alive():
            return c
        with self._reopen_lock:
            c = self._conn
            if c.session.alive():
                return c  # another thread re-opened it meanwhile
            try:
                fresh = _Connection(self.socket, self.client_name, self.timeout)
            except KvdError as e:
                raise self._not_answering(e) from None
            self._conn = fresh
        c.session.close()  # its daemon is gone; its channel closes with the last user
        return fresh

    def _call(self, method, request, session=True, timeout=None, conn=None):
        """One RPC on `conn` (default: a live connection, re-opened after a restart). wait_for_ready
        stays off: a call to a daemon that is away fails at once."""
        c = conn if conn is not None else self._live()
        try:
            return getattr(c.stub, method)(request, metadata=c.md if session else None,
                                           timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            err = KvdError.from_rpc(e)
            # The daemon's own UNAVAILABLE (a RECOVERING pool) leaves the session up; a daemon that went
            # away closed it.
            if err.code == "UNAVAILABLE" and not c.session.alive():
                err = self._not_answering(err)
            raise err from None

    def _memory_backend(self, device=None):
        """The mapper for the local device `device` (None: the daemon's) -> (memory, peer_uuid);
        peer_uuid is the local device's UUID when it is not the daemon's (the AttachRequest's
        device_uuid), else ""."""
        info = self.device_info()  # fresh: the daemon may have restarted on another device
        local = _memory.resolve_device(info, pb, device)
        peer_uuid = ""
        if (device is not None or info.device_uuid) and not _memory.same_device(local.uuid, info.device_uuid):
            # Peer access: this process maps memory of the daemon's device with access for its own.
            _memory.check_peer_access(info, pb, local)
            peer_uuid = local.uuid
        with self._lock:
            self._info = info
            memory = self._memories.get(local.index)
            if memory is None:
                memory = self._memories[local.index] = _memory.memory_for(info, pb, local)
        return memory, peer_uuid

    # -- device and pools -----------------------------------------------------------------------
    def device_info(self):
        """GetDeviceInfo -> kvd.v1.DeviceInfo (backend, free_bytes, budget_bytes, ...)."""
        return self._call("GetDeviceInfo", pb.GetDeviceInfoRequest(), session=False)

    def pools(self):
        """ListPools -> [kvd.v1.Pool] (only pools this uid may use), every page of it, by name."""
        out, token = [], ""
        while True:
            reply = self._call("ListPools", pb.ListPoolsRequest(page_token=token))
            out.extend(reply.pools)
            token = reply.next_page_token
            if not token:
                return out

    def pool(self, name):
        """GetPool -> kvd.v1.Pool."""
        return self._call("GetPool", pb.GetPoolRequest(name=name))

    @staticmethod
    def _layout_request(override=None, backend_requirements=None, connector_preferences=(), env_layout=None):
        req = pb.LayoutRequest()
        if override:
            req.override_layout = override
        for backend, layouts in (backend_requirements or {}).items():
            req.backend_requirements.add(backend=backend, layouts=[layouts] if isinstance(layouts, str) else layouts)
        for connector, layout in connector_preferences or ():
            req.connector_preferences.add(connector=connector, layout=layout)
        req.env_layout = os.environ.get(_wire.LAYOUT_ENV, "") if env_layout is None else env_layout
        return req

    @staticmethod
    def _dims(layers, capacity_blocks, heads, block_tokens, channels, element_bytes):
        return pb.PoolDims(layers=layers, capacity_blocks=capacity_blocks, heads=heads, block_tokens=block_tokens,
                           channels=channels, element_bytes=element_bytes)

    def create_pool(self, name, layers, capacity_blocks, heads, block_tokens, channels, element_bytes,
                    initial_blocks=0, override=None, backend_requirements=None, connector_preferences=(),
                    allowed_uids=(), env_layout=None, group=None, peer_devices=()):
        """CreatePool -> kvd.v1.Pool. backend_requirements: {"FLASHINFER": ["block-outermost"]};
        connector_preferences: [("nixl", "LBNHC")]; $KVD_KV_CACHE_LAYOUT is forwarded as env_layout.
        group: this pool is one rank of an engine group, a kvd.GroupMembership or (name, rank, size);
        peer_devices: device UUIDs (or "*") whose processes may attach it (see grant_peer_access).
        The returned Pool says both back (pool.group, pool.peer_devices), and pool.transaction while a
        group operation holds it."""
        req = pb.CreatePoolRequest(
            name=name, dims=self._dims(layers, capacity_blocks, heads, block_tokens, channels, element_bytes),
            initial_blocks=initial_blocks,
            layout_request=self._layout_request(override, backend_requirements, connector_preferences, env_layout),
            allowed_uids=list(allowed_uids), peer_devices=list(peer_devices))
        if group is not None:
            req.group.CopyFrom(GroupMembership.of(group).to_proto())
        return self._call("CreatePool", req)

    def resolve_layout(self, override=None, backend_requirements=None, connector_preferences=(), env_layout=None,
                       dims=None):
        """ResolveLayout (dry run) -> kvd.v1.ResolveLayoutResponse; dims: a dict of PoolDims fields."""
        req = pb.ResolveLayoutRequest(
            layout_request=self._layout_request(override, backend_requirements, connector_preferences, env_layout))
        if dims:
            req.dims.CopyFrom(pb.PoolDims(**dims))
        return self._call("ResolveLayout", req, session=False)

    def delete(self, name, force=False, pause_timeout=None):
        """DeletePool -> released bytes. force: even with clients attached; those of other sessions are
        paused first when pausable (within pause_timeout seconds, None: the daemon's --pause-timeout; one
        that does not acknowledge is detached), or keep what they map until they close when not
        (docs/api.md, "Releases and running engines")."""
        req = pb.DeletePoolRequest(name=name, force=force, pause=_pause_options(pause_timeout, False))
        return self._call("DeletePool", req,
                          timeout=_reshape_call_timeout(self.timeout, pause_timeout) if force else None).released_bytes

    def attach(self, name, on_grow=None, on_release=None, on_lost=None, client_name="", device=None,
               on_restart=None, on_pause=None, on_resume=None):
        """Attach + map every chunk + start following the pool -> Mapping.

        device: the device this process maps the pool from: None for the daemon's own (found by its
        UUID: indices are per process), else an index or UUID (prefix) of this process's devices of
        the daemon's backend (CUDA: as this process numbers them). Another device than the daemon's is
        peer access: the pair must support it (FAILED_PRECONDITION naming both devices; NOT_FOUND when
        this process does not see the daemon's device) and the pool must grant it (peer_devices,
        grant_peer_access; PERMISSION_DENIED otherwise). The chunks are then mapped with access for
        the local device.

        Callbacks run on the Mapping's follower thread, one at a time, for changes made by OTHER
        sessions (a grow/wake through this Client maps before returning and calls none), with the
        arguments libkvd's AttachOptions callbacks get: on_grow(committed_blocks) after new chunks
        are mapped; on_release(committed_blocks) after released chunks are unmapped and
        acknowledged; on_lost(why), a KvdError, once the Mapping is lost (everything unmapped):
        NOT_FOUND "pool P was deleted", UNAVAILABLE "kvd is stopping", the event stream's end or
        error, or a failure to map added chunks or to acknowledge a release (the Mapping then
        detaches); after a daemon restart also NOT_FOUND "pool P did not survive the restart of kvd
        ..." or UNAVAILABLE when the daemon was not back within reconnect_for.
        on_restart(DaemonRestart) once per daemon restart (DAEMON_RESTARTING, or a crash: the stream
        broke with UNAVAILABLE), after the Mapping reconnected: it handed its chunks' FDs back if the
        pool was RECOVERING, attached again (a new client_id), kept every chunk the daemon still has
        (same id, segment, offset, bytes) mapped untouched, unmapped the lost ones, mapped new ones.
        Pauses (docs/api.md, "Pauses and reshaping"): giving on_pause makes the Mapping pausable
        (AttachRequest.pausable), so the daemon may move the pool's bytes into new chunks at the same
        addresses (an exact shrink, compact) while it is attached. On a PAUSE the follower imports the
        new chunks (without mapping them), calls on_pause(ranges) -- ranges: [kvd.ByteRange(segment,
        offset, bytes)], the bytes that move; stop every access to the pool (synchronise the streams that
        use it) and return -- and acknowledges. On the RESUME it unmaps the replaced chunks, maps the new
        ones at the same addresses, sets committed_blocks and calls on_resume(applied), then acknowledges;
        applied is False when the change was called off (nothing moved, the imported chunks are dropped).
        Without on_pause the Mapping is not pausable: while it is attached, a shrink that must replace a
        chunk and compact fail with FAILED_PRECONDITION naming it.
        They must not close the Mapping nor shrink/sleep/compact this pool with wait=True (nor
        shrink/compact it at all from on_pause or on_resume).
        One Mapping per pool per Client: the daemon hands the caller's lease to one client of the
        session."""
        with self._lock:
            if name in self._mappings and not self._mappings[name].closed:
                raise KvdError("ALREADY_EXISTS", f"pool {name} is already attached by this client; use its "
                               "Mapping or connect another client")
        memory, peer_uuid = self._memory_backend(device)
        conn = self._live()
        resp = self._call("Attach", pb.AttachRequest(pool=name, client_name=client_name, device_uuid=peer_uuid,
                                                     pausable=on_pause is not None), conn=conn)
        try:
            m = Mapping(self, memory, resp, on_grow, on_release, on_lost, conn=conn, on_restart=on_restart,
                        client_name=client_name, peer_uuid=peer_uuid, on_pause=on_pause, on_resume=on_resume)
        except BaseException:
            try:
                self._call("Detach", pb.DetachRequest(pool=name, client_id=resp.client_id), conn=conn)
            except KvdError:
                pass
            raise
        with self._lock:
            self._mappings[name] = m
        return m

    # -- resizing -------------------------------------------------------------------------------
    def _absorb(self, update):
        """Maps the caller's lease of a PoolUpdate into this Client's Mapping of that pool, if any
        (as libkvd's Client::Impl::Route). An unredeemed lease just expires in the daemon."""
        if not update.lease.token or not update.added:
            return
        with self._lock:
            m = self._mappings.get(update.pool.name)
        if m is not None and not m.closed:
            m._apply_update(update)

    def grow(self, name, blocks):
        """Grow to `blocks` committed blocks -> kvd.v1.PoolUpdate; this Client's Mapping of the pool
        has mapped the new chunks when it returns."""
        update = self._call("Grow", pb.GrowRequest(pool=name, target_blocks=blocks))
        self._absorb(update)
        return update

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
        req = pb.ShrinkRequest(pool=name, target_blocks=blocks, wait_for_release=wait,
                               whole_chunks_only=whole_chunks_only,
                               pause=_pause_options(pause_timeout, detach_unresponsive), force=force)
        if live_blocks is not None:
            req.live.SetInParent()  # set, even empty: a compaction shrink with no live block
            req.live.blocks.extend(int(b) for b in live_blocks)
        # Every shrink may pause other sessions; one that moves bytes may go in steps.
        timeout = (_reshape_call_timeout if whole_chunks_only else _steps_call_timeout)(self.timeout, pause_timeout)
        update = self._call("Shrink", req, timeout=timeout)
        self._await_remap(update, timeout)
        return update

    def compact(self, name, pause_timeout=None, detach_unresponsive=False, max_chunks_per_pause=0):
        """Compact -> kvd.v1.PoolUpdate: rewrites a fragmented pool as one chunk per segment (split at the
        daemon's --max-chunk), copied on the device while the attached clients pause; reshape says the
        chunks before and after, the bytes copied, the pauses (steps, pause_us, max_pause_us).
        With clients attached it goes in steps that each replace at most max_chunks_per_pause chunks
        under a pause of their own (0: the daemon's --compact-chunks-per-pause); each step is all or
        nothing, and a step that fails leaves the steps before it done (the error says so). pause_timeout
        and detach_unresponsive as shrink's. This Client's own Mapping of the pool has remapped when it
        returns."""
        timeout = _steps_call_timeout(self.timeout, pause_timeout)
        req = pb.CompactRequest(pool=name, pause=_pause_options(pause_timeout, detach_unresponsive),
                                max_chunks_per_pause=max_chunks_per_pause)
        update = self._call("Compact", req, timeout=timeout)
        self._await_remap(update, timeout)
        return update

    def _await_remap(self, update, timeout):
        """After this Client's Shrink or Compact: waits, at most `timeout` seconds, until its Mapping of the
        pool (if any) has no pause pending with one of update.added: it remapped them, or dropped them. The
        daemon replies after every RESUME's acknowledgement and the follower acknowledges after remapping,
        so this normally finds nothing to wait for. As libkvd's Client::Impl::AwaitRemap."""
        if not update.added:
            return
        with self._lock:
            m = self._mappings.get(update.pool.name)
        if m is None:
            return
        added = {c.id for c in update.added}

        def settled():
            if m.closed or m.gone is not None:
                return True
            return not any(added.intersection(imported) for imported in m._paused.values())

        with m._changed:
            if m._changed.wait_for(settled, timeout=timeout):
                return
        raise KvdError("DEADLINE_EXCEEDED", f"pool {update.pool.name} changed but this client's Mapping of it did "
                       f"not remap within {timeout:g}s")

    def sleep(self, name=None, wait=False, force=False, pause_timeout=None, detach_unresponsive=False, keep=False,
              live_blocks=None):
        """Sleep one pool, or every awake pool (name None or "") -> [kvd.v1.PoolUpdate]. The Mappings
        learn of it from their release events (with wait: before this returns). The pausable Mappings of
        other sessions are paused first (pause_timeout and detach_unresponsive as shrink's); one that is not
        pausable refuses the sleep unless force (docs/api.md, "Releases and running engines").
        keep: the contents go to the daemon's host tier and wake() brings them back at the same addresses;
        live_blocks (with keep and a named pool): only those blocks are kept (docs/api.md, "Sleep that keeps
        the contents")."""
        req = pb.SleepRequest(wait_for_release=wait, force=force, keep=keep, live_blocks=list(live_blocks or []),
                              pause=_pause_options(pause_timeout, detach_unresponsive))
        if not name:
            req.all = True
        else:
            req.pool = name
        return list(self._call("Sleep", req, timeout=_reshape_call_timeout(self.timeout, pause_timeout)).updates)

    def wake(self, name=None):
        """Wake one pool, or every sleeping pool (name None or "") -> [kvd.v1.PoolUpdate]; this Client's
        Mappings have mapped the fresh (zeroed) chunks when it returns."""
        req = pb.WakeRequest()
        if not name:
            req.all = True
        else:
            req.pool = name
        updates = list(self._call("Wake", req).updates)
        first_error = None
        for u in updates:  # every pool woke: map each, then report the first failure
            try:
                self._absorb(u)
            except KvdError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return updates

    # -- pool metadata ---------------------------------------------------------------------------
    def metadata(self, name):
        """GetPoolMetadata -> kvd.v1.PoolMetadata (pool, version, data, updated_at_unix_ms): engine-defined
        bytes kept with the pool across restarts of kvd and of the engine; version 0 until first set."""
        return self._call("GetPoolMetadata", pb.GetPoolMetadataRequest(pool=name))

    def set_metadata(self, name, data, expected_version):
        """SetPoolMetadata -> kvd.v1.PoolMetadata, a compare-and-set: ABORTED (nothing changed) unless
        `expected_version` is the current version (0 for a pool never set); INVALID_ARGUMENT past the
        daemon's --max-metadata-bytes."""
        return self._call("SetPoolMetadata", pb.SetPoolMetadataRequest(pool=name, expected_version=expected_version,
                                                                        data=bytes(data)))

    # -- engine groups and peer access ----------------------------------------------------------
    def grant_peer_access(self, name, device_uuid, revoke=False):
        """GrantPeerAccess -> kvd.v1.Pool: lets processes on the device `device_uuid` (as that device's
        daemon reports it, or "*" for every device) attach the pool; revoke takes the grant back
        (mappings that exist stay)."""
        return self._call("GrantPeerAccess", pb.GrantPeerAccessRequest(pool=name, device_uuid=device_uuid,
                                                                        revoke=revoke))

    def prepare(self, name, op, target_blocks=0, ttl=30.0, force=False, keep=False):
        """Phase one of a group operation on this daemon -> kvd.v1.PrepareResponse (transaction,
        pool as it is now, prepared_bytes, expires_at_unix_ms). op: "grow", "shrink", "sleep", "wake"
        (or a kvd.v1 Operation); target_blocks for grow and shrink. The daemon does everything that
        can fail and holds the pool (other resizes get ABORTED) until commit() or abort() from this
        Client, `ttl` seconds, or the end of this Client's session. kvd.Group drives it on every rank.
        A shrink or sleep pauses the pausable Mappings of other sessions until the commit or abort; one that
        is not pausable refuses it unless force (docs/api.md, "Releases and running engines"). keep: a sleep
        keeps the contents in the host tier (sleep()'s keep), copied here."""
        req = pb.PrepareRequest(pool=name, operation=_operation(op), target_blocks=target_blocks,
                                ttl_ms=max(int(round(ttl * 1000)), 1), force=force, keep=keep)
        releases = req.operation in (pb.OPERATION_SHRINK, pb.OPERATION_SLEEP)
        return self._call("Prepare", req, timeout=_reshape_call_timeout(self.timeout, None) if releases else None)

    def commit(self, transaction, wait=False):
        """Phase two: makes a prepared change visible -> kvd.v1.PoolUpdate. As grow() and wake(), this
        Client's Mapping of the pool has mapped the new chunks when it returns; wait is shrink()'s and
        sleep()'s (reply once every attached client acknowledged)."""
        update = self._call("Commit", pb.CommitRequest(transaction=transaction, wait_for_release=wait),
                            timeout=max(self.timeout, 70.0) if wait else None)
        self._absorb(update)
        return update

    def abort(self, transaction):
        """Undoes a prepare -> the prepared bytes given back."""
        return self._call("Abort", pb.AbortRequest(transaction=transaction)).released_bytes

    def zero_blocks(self, name, block_ids):
        self._call("ZeroBlocks", pb.ZeroBlocksRequest(pool=name, block_ids=list(block_ids)))

    def copy_blocks(self, name, copies):
        self._call("CopyBlocks", pb.CopyBlocksRequest(pool=name, copies=[pb.BlockCopy(src=s, dst=d)
                                                                          for s, d in copies]))

    # -- KV connectors (docs/connectors.md) -----------------------------------------------------
    def describe_transfer(self, name, block_ids=None):
        """DescribeTransfer -> kvd.v1.DescribeTransferResponse: the strided descriptors (segment,
        offset, bytes, stride, count: `count` runs of `bytes` bytes, run i at offset + i*stride from the
        pool's base) covering `block_ids` (None or empty: every committed block) under the pool's
        layout. Raises INVALID_ARGUMENT naming block_ids[i] for an uncommitted or repeated id."""
        return self._call("DescribeTransfer",
                          pb.DescribeTransferRequest(pool=name, block_ids=list(block_ids or [])))

    def export_ranges(self, client_id, ranges=None):
        """ExportRanges -> (kvd.v1.ExportRangesResponse, [fd, ...]): FDs over byte ranges of the pool that
        the attached client `client_id` (of this Client) belongs to, one per response handle, in order;
        the pool's bytes [h.offset, h.offset + h.bytes) are at h.fd_offset in handle h's FD (CUDA: a
        DMA-BUF; host: a memfd). `ranges`: [(offset, bytes), ...], granularity multiples inside one
        segment's committed prefix; None: every segment's whole committed prefix. The caller closes the
        FDs (once registered)."""
        req = pb.ExportRangesRequest(client_id=client_id,
                                     ranges=[pb.ByteRange(offset=o, bytes=b) for o, b in (ranges or [])])
        conn = self._live()  # the lease is this session's
        resp = self._call("ExportRanges", req, conn=conn)
        if not resp.handles:
            return resp, []
        fds = conn.session.fetch(resp.lease.token)
        if [i for i, _ in fds] != list(range(len(resp.handles))):
            for _, fd in fds:
                os.close(fd)
            raise KvdError("DATA_LOSS", f"ExportRanges: {len(fds)} FDs for {len(resp.handles)} handles, or out of order")
        return resp, [fd for _, fd in fds]

    # -- lifetime -------------------------------------------------------------------------------
    def close(self):
        """Closes every Mapping, the channel and the session (the daemon detaches what is left)."""
        with self._lock:
            mappings = list(self._mappings.values())
            self._mappings.clear()
        for m in mappings:
            m.close()
        self._conn.channel.close()
        self._conn.session.close()
        with self._lock:
            memories, self._memories = list(self._memories.values()), {}
        for memory in memories:
            memory.close()

    def _forget(self, mapping):
        with self._lock:
            if self._mappings.get(mapping.pool_name) is mapping:
                del self._mappings[mapping.pool_name]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# One mapped chunk: where, its import handle, its FD (kept open to hand the chunk back after a daemon
# restart) and where the daemon placed it.
_Mapped = collections.namedtuple("_Mapped", "va bytes handle fd segment offset")
# A pause's new chunk, imported at the PAUSE and mapped at its RESUME: the Chunk, its FD and import handle.
_Imported = collections.namedtuple("_Imported", "chunk fd handle")


class Mapping:
    """One attached pool, mapped at `base` in this process: VA for geometry.reserved_bytes, every
    chunk at base + chunk.offset. A daemon thread follows the pool's Watch stream (maps grown/woken
    chunks, unmaps and acknowledges released ones; after a daemon restart it reconnects: see
    Client.attach's on_restart). close() detaches, unmaps and frees the VA.

    Views from layer() span the pool's whole capacity (the pointers never move); only blocks below
    `committed_blocks` are backed while the pool is awake. Touching others faults (SIGSEGV on
    host, an illegal address on CUDA). Views must not be used after close(). A pausable Mapping
    (attach(on_pause=...)) also acts on PAUSE and RESUME: the views stay valid across them, and read
    the same bytes from the new memory after the RESUME."""

    def __init__(self, client, memory, attached, on_grow, on_release, on_lost=None, conn=None, on_restart=None,
                 client_name="", peer_uuid="", on_pause=None, on_resume=None):
        self._client = client
        self._memory = memory
        self._conn = conn if conn is not None else client._live()
        self.client_id = attached.client_id
        pool = attached.pool
        self.pool_name = pool.name
        self.epoch = pool.epoch
        self.device_uuid = memory.device.uuid if memory.device is not None else ""
        self.geometry = Geometry.from_proto(pool.geometry, pool.layout)
        self.layout_resolution = pool.layout
        self.committed_blocks = pool.committed_blocks
        self.state = pool.state
        self.on_grow, self.on_release, self.on_lost, self.on_restart = on_grow, on_release, on_lost, on_restart
        self.on_pause, self.on_resume = on_pause, on_resume
        self.pausable = on_pause is not None
        self.pauses = self.resumes = 0  # PAUSE events acted on; RESUMEs (applied or not)
        self._client_name, self._peer_uuid = client_name, peer_uuid
        self.closed = False
        self.gone = None  # once the Mapping is lost: the KvdError on_lost got
        self._paused_for_restart = False  # on_pause ran for chunks a restarted daemon lacks
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified after each event the follower acted on
        self._closing = threading.Event()
        self._chunks = {}  # id -> _Mapped
        self._paused = {}  # pause_id -> {chunk id: _Imported}: imported at the PAUSE, not mapped yet
        self.events_seen = 0
        self._watch = self._thread = None
        self._restart_announced = False  # the follower's: the last stream ended with DAEMON_RESTARTING
        self.base = memory.reserve(self.geometry.reserved_bytes, self.geometry.granularity_bytes)
        try:
            self._map_lease(attached.lease, list(pool.chunks))
            self._watch = self._conn.stub.Watch(pb.WatchRequest(client_id=self.client_id), metadata=self._conn.md)
            self._watch.initial_metadata()  # the daemon registered the watch
            self._thread = threading.Thread(target=self._follow, name=f"kvd-follow-{self.pool_name}", daemon=True)
            self._thread.start()
        except BaseException:
            if self._watch is not None:
                self._watch.cancel()
            self._unmap_all()
            memory.free(self.base, self.geometry.reserved_bytes)
            raise

    # -- mapping --------------------------------------------------------------------------------
    def _map_lease(self, lease, chunks, conn=None):
        """Fetches `lease` and maps each of `chunks` at base + offset, keeping its FD; a chunk mapped
        already (same id, segment, offset, bytes: a re-attach after a restart) stays as it is."""
        if not chunks:
            return []
        fds = (conn or self._conn).session.fetch(lease.token)
        by_id = {c.id: c for c in chunks}
        mapped = []
        try:
            with self._lock:
                for i, (chunk_id, fd) in enumerate(fds):
                    c = by_id.get(chunk_id)
                    if c is None:
                        raise KvdError("INTERNAL", f"lease yielded chunk {chunk_id}, not one of {sorted(by_id)}")
                    have = self._chunks.get(chunk_id)
                    if have is not None and (have.segment, have.offset, have.bytes) == (c.segment, c.offset, c.bytes):
                        continue  # the same chunk, mapped already: its fetched FD closes below
                    if have is not None:
                        self._unmap([chunk_id])
                    va = self.base + c.offset
                    handle = self._memory.import_and_map(va, c.bytes, fd)
                    self._chunks[chunk_id] = _Mapped(va, c.bytes, handle, fd, c.segment, c.offset)
                    fds[i] = (chunk_id, -1)  # now the Mapping's: closed when the chunk is unmapped
                    mapped.append(c)
        finally:
            for _, fd in fds:
                if fd >= 0:
                    os.close(fd)
        return mapped

    def _unmap(self, chunk_ids, retired=None):
        """Unmaps the chunks, releases their handles and closes their FDs; with `retired`, only unmaps
        and appends them there for _release_retired (a RESUME's remap, while the pool is paused)."""
        done = []
        with self._lock:
            for cid in chunk_ids:
                entry = self._chunks.pop(cid, None)
                if entry is None:
                    continue
                if retired is not None:
                    retired.append(entry)
                    self._memory.unmap_only(entry.va, entry.bytes)
                else:
                    try:
                        self._memory.unmap(entry.va, entry.bytes, entry.handle)
                    finally:
                        os.close(entry.fd)
                done.append(cid)
        return done

    def _release_retired(self, retired):
        for entry in retired:
            try:
                self._memory.release_imported(entry.handle)
            finally:
                os.close(entry.fd)
        retired.clear()

    def _unmap_all(self):
        """Unmaps every chunk and drops every chunk imported for a pause that has not resumed."""
        with self._lock:
            self._unmap(list(self._chunks))
            paused, self._paused = self._paused, {}
            for imported in paused.values():
                self._drop_imported(imported)

    # -- pauses ---------------------------------------------------------------------------------
    def _import_lease(self, lease, chunks, conn):
        """A PAUSE's new chunks: fetches `lease` and imports each without mapping -> {chunk id: _Imported},
        the FDs now the Mapping's."""
        if not chunks:
            return {}
        fds = conn.session.fetch(lease.token)
        by_id = {c.id: c for c in chunks}
        out = {}
        try:
            for i, (chunk_id, fd) in enumerate(fds):
                c = by_id.get(chunk_id)
                if c is None or chunk_id in out:
                    raise KvdError("INTERNAL", f"lease yielded chunk {chunk_id}, not one of {sorted(by_id)}")
                out[chunk_id] = _Imported(c, fd, self._memory.import_chunk(fd))
                fds[i] = (chunk_id, -1)
            if len(out) != len(by_id):
                raise KvdError("INTERNAL", f"lease yielded chunks {sorted(out)} for {sorted(by_id)}")
        except BaseException:
            self._drop_imported(out)
            raise
        finally:
            for _, fd in fds:
                if fd >= 0:
                    os.close(fd)
        return out

    def _drop_imported(self, imported):
        """Releases imported, unmapped chunks ({id: _Imported}) and closes their FDs."""
        for entry in imported.values():
            try:
                self._memory.release_imported(entry.handle)
            except KvdError:
                _log.exception("kvd: releasing an imported chunk of pool %s", self.pool_name)
            finally:
                os.close(entry.fd)

    def _resume(self, ev, retired):
        """An applied RESUME: unmaps ev.chunks (their handles and FDs go to `retired`, released once the
        engine resumed), maps the PAUSE's imported chunks at their offsets (the same addresses) keeping
        their FDs, and takes the new committed_blocks. Raises KvdError when a chunk does not map (the
        Mapping is then lost)."""
        with self._lock:
            imported = self._paused.pop(ev.pause_id, {})
            try:
                self._unmap([c.id for c in ev.chunks], retired)
                for cid in sorted(imported, key=lambda i: imported[i].chunk.offset):
                    entry = imported[cid]
                    c = entry.chunk
                    # A chunk still mapped where the new one goes was released by a change whose event
                    # this follower has not acted on yet: it goes now (as libkvd's UnmapOverlapping).
                    self._unmap([i for i, mp in self._chunks.items()
                                 if mp.offset < c.offset + c.bytes and c.offset < mp.offset + mp.bytes])
                    va = self.base + c.offset
                    handle = self._memory.map_imported(va, c.bytes, entry.fd, entry.handle)
                    self._chunks[cid] = _Mapped(va, c.bytes, handle, entry.fd, c.segment, c.offset)
                    del imported[cid]
            finally:
                self._drop_imported(imported)  # what did not map
            self.committed_blocks = ev.committed_blocks
            if ev.state == pb.POOL_STATE_SLEEPING:
                self.state = ev.state  # a sleep's pause

    def _map_lease_unless_released(self, lease, chunks):
        """_map_lease, except that a lease refused because its chunks were released meanwhile (a
        concurrent shrink or sleep, whose release event follows) maps nothing and returns None. As
        libkvd's MapLeaseUnlessReleased: a fetch is all or nothing, so that is fine only when none of
        the lease's chunks is live any more; otherwise the error stands."""
        try:
            return self._map_lease(lease, chunks)
        except KvdError as e:
            if e.code != "FAILED_PRECONDITION":
                raise
            live = {c.id for c in self._client._call("GetPool", pb.GetPoolRequest(name=self.pool_name),
                                                     conn=self._conn).chunks}
            if any(c.id in live for c in chunks):
                raise
            _log.info("kvd: pool %s: chunks released before they were mapped: %s", self.pool_name, e.message)
            return None

    def _apply_update(self, update):
        """Maps this Client's lease of its own grow/wake/commit (Note [The grower maps first])."""
        with self._lock:
            if self.closed or self.gone is not None:
                return
            try:
                mapped = self._map_lease_unless_released(update.lease, list(update.added))
            except KvdError as e:
                raise KvdError(e.code, f"pool {self.pool_name} changed but mapping its new chunks failed: "
                               f"{e.message}") from None
            if mapped is not None:
                # Chunks are only ever added to an awake pool.
                self.committed_blocks, self.state = update.pool.committed_blocks, pb.POOL_STATE_AWAKE

    def _callback(self, fn, arg):
        try:
            fn(arg)
        except Exception:  # a failing callback must not stop the follower (that would detach us)
            _log.exception("kvd: a callback of pool %s raised", self.pool_name)

    def _follow(self):
        """The follower thread: follows the event stream, and after a daemon restart reattaches and
        follows the new one; mirrors libkvd's Mapping::Impl::Follow."""
        watch = self._watch
        while watch is not None:
            why = self._follow_stream(watch)
            if why is None:
                return
            watch = self._reattach(why)

    def _follow_stream(self, watch):
        """Acts on each event of one stream, then calls back. Returns why to reconnect (the daemon
        restarted), or None once the Mapping is lost or closing."""
        name = self.pool_name
        why = None
        engine_done = False  # why's loss needs no pause: the engine asked for it or is paused
        forced = False  # why's loss was forced on this Mapping: if not pausable, it keeps its chunks
        restarting = False
        ended = None  # the stream's own end: None (it ended), or the KvdError it broke with
        try:
            for ev in watch:
                self.events_seen += 1
                if ev.type == pb.EVENT_TYPE_CHUNKS_ADDED:
                    with self._lock:
                        if self.closed or self.gone is not None:
                            continue
                        try:
                            mapped = self._map_lease_unless_released(ev.lease, list(ev.chunks))
                        except KvdError as e:
                            why = KvdError(e.code, f"mapping chunks added to pool {name}: {e.message}")
                            break
                        if mapped is not None:
                            # Chunks are only ever added to an awake pool (a Wake's event may say
                            # SLEEPING: the daemon builds it before it flips the state).
                            self.committed_blocks, self.state = ev.committed_blocks, pb.POOL_STATE_AWAKE
                    if mapped is not None and self.on_grow:
                        self._callback(self.on_grow, ev.committed_blocks)
                elif ev.type == pb.EVENT_TYPE_CHUNKS_RELEASED and ev.forced:
                    why = KvdError("FAILED_PRECONDITION", f"pool {name}: {len(ev.chunks)} chunks were released by "
                                   "force while this Mapping, which is not pausable, mapped them: it keeps every "
                                   "chunk mapped (their bytes no longer the pool's) until it is closed")
                    forced = True
                    break
                elif ev.type == pb.EVENT_TYPE_CHUNKS_RELEASED:
                    with self._lock:
                        if self.closed or self.gone is not None:
                            continue
                        self._unmap([c.id for c in ev.chunks])
                        self.committed_blocks = ev.committed_blocks
                        if ev.state == pb.POOL_STATE_SLEEPING:
                            self.state = ev.state
                        conn, client_id = self._conn, self.client_id
                    if ev.release_id:
                        try:
                            self._client._call("Acknowledge", pb.AcknowledgeRequest(client_id=client_id,
                                                                                     release_id=ev.release_id),
                                               conn=conn)
                        except KvdError as e:
                            why = KvdError(e.code, f"acknowledging release {ev.release_id}: {e.message}")
                            break
                    if self.on_release:
                        self._callback(self.on_release, ev.committed_blocks)
                elif ev.type == pb.EVENT_TYPE_PAUSE:
                    with self._lock:
                        if self.closed or self.gone is not None:
                            continue
                        conn, client_id = self._conn, self.client_id
                    try:
                        imported = self._import_lease(ev.lease, list(ev.chunks), conn)
                    except KvdError as e:
                        why = KvdError(e.code, f"pausing pool {name} (pause {ev.pause_id}): importing its new "
                                       f"chunks: {e.message}")
                        break
                    with self._lock:
                        if self.closed or self.gone is not None:
                            self._drop_imported(imported)
                            continue
                        self._paused[ev.pause_id] = imported
                        self.pauses += 1
                    if self.on_pause:
                        self._callback(self.on_pause, [ByteRange(r.segment, r.offset, r.bytes) for r in ev.ranges])
                    try:
                        self._client._call("Acknowledge", pb.AcknowledgeRequest(client_id=client_id,
                                                                                 pause_id=ev.pause_id), conn=conn)
                    except KvdError as e:
                        # Too late (the pause timed out) or the daemon is going: its RESUME (not applied)
                        # or the stream's end follows and says what happened.
                        _log.warning("kvd: pool %s: acknowledging pause %d: %s", name, ev.pause_id, e)
                elif ev.type == pb.EVENT_TYPE_RESUME:
                    retired = []
                    with self._lock:
                        if self.closed or self.gone is not None:
                            continue
                        known = ev.pause_id in self._paused
                        before = self.committed_blocks
                        if not ev.applied:
                            self._drop_imported(self._paused.pop(ev.pause_id, {}))
                        elif not known:
                            why = KvdError("INTERNAL", f"pool {name}: RESUME of pause {ev.pause_id}, whose PAUSE "
                                           "this client never had")
                            break
                        else:
                            try:
                                self._resume(ev, retired)
                            except KvdError as e:
                                self._release_retired(retired)
                                why = KvdError(e.code, f"remapping pool {name} after pause {ev.pause_id}: "
                                               f"{e.message}")
                                break
                        self.resumes += 1
                        conn, client_id = self._conn, self.client_id
                        self._changed.notify_all()
                    if self.on_resume:
                        self._callback(self.on_resume, bool(ev.applied))
                    if ev.applied and ev.release_id:
                        try:
                            self._client._call("Acknowledge", pb.AcknowledgeRequest(client_id=client_id,
                                                                                     release_id=ev.release_id),
                                               conn=conn)
                        except KvdError as e:
                            self._release_retired(retired)
                            why = KvdError(e.code, f"acknowledging release {ev.release_id}: {e.message}")
                            break
                    self._release_retired(retired)  # after the engine resumed: not part of its pause
                    if ev.applied and ev.committed_blocks < before and self.on_release:
                        self._callback(self.on_release, ev.committed_blocks)
                elif ev.type == pb.EVENT_TYPE_POOL_DELETED:
                    # Not forced: this Mapping's own session deleted it, or a pause holds the engine.
                    why = KvdError("NOT_FOUND", f"pool {name} was deleted" + (
                        " by force: this Mapping, not pausable, keeps its chunks mapped until it is closed"
                        if ev.forced else ""))
                    with self._lock:
                        engine_done = not ev.forced or bool(self._paused)
                    forced = ev.forced
                    break
                elif ev.type == pb.EVENT_TYPE_DAEMON_STOPPING:
                    why = KvdError("UNAVAILABLE", "kvd is stopping")
                    break
                elif ev.type == pb.EVENT_TYPE_DAEMON_RESTARTING:
                    restarting = True
                    break
        except grpc.RpcError as e:
            ended = KvdError.from_rpc(e)
        except Exception as e:  # a bug: still lose the Mapping rather than leave it half followed
            _log.exception("kvd: following pool %s failed", name)
            why = KvdError("INTERNAL", f"following pool {name}: {type(e).__name__}: {e}")
        if why is None:
            with self._lock:
                if self.closed or self.gone is not None:
                    return None
            reconnect = self._client.reconnect_for > 0
            self._restart_announced = restarting
            if restarting:
                watch.cancel()  # the daemon closes it anyway
                if reconnect:
                    return KvdError("UNAVAILABLE", "kvd is restarting")
                why = KvdError("UNAVAILABLE", "kvd is restarting and this client does not reconnect "
                               "(reconnect_for = 0)")
            elif reconnect and ended is not None and (ended.code == "UNAVAILABLE" or not self._conn.session.alive()):
                return ended  # a crash: the stream broke and the daemon closed the session with it
            elif ended is not None:
                why = KvdError(ended.code, f"the event stream of pool {name} broke: {ended.message}")
            else:
                why = KvdError("UNAVAILABLE", f"the event stream of pool {name} ended")
        self._lose(why, engine_done, forced)
        return None

    def _reattach(self, why):
        """After a daemon restart: _try_reattach with backoff (50 ms doubling to 2 s) for the Client's
        reconnect_for seconds -> the new Watch stream, or None once the Mapping is lost or closing."""
        limit = self._client.reconnect_for
        give_up = time.monotonic() + limit
        delay = 0.05
        last = why
        restart = DaemonRestart(epoch=0, lost_chunk_ids=[], lost_bytes=0, returned_chunk_ids=[], committed_blocks=0)
        while True:
            with self._lock:
                if self.closed or self.gone is not None:
                    return None
            try:
                watch, resumed = self._try_reattach(restart)
            except _Fatal as e:
                self._lose(e.error)
                return None
            except KvdError as e:
                last = e
            else:
                if self.on_resume:  # the pauses the restart ended: whether their change was made
                    for applied in resumed:
                        self._callback(self.on_resume, applied)
                if self.on_restart:
                    self._callback(self.on_restart, restart)
                return watch
            if time.monotonic() + delay > give_up:
                self._lose(KvdError("UNAVAILABLE", f"kvd at {self._client.socket} did not take pool {self.pool_name} "
                                    f"back within {limit:g}s: {last.message}"))
                return None
            if self._closing.wait(delay):
                return None
            delay = min(delay * 2, 2.0)

    def _try_reattach(self, restart):
        """One attempt: raises KvdError to retry, _Fatal when retrying cannot help; -> (the new watch, for each
        pause in progress when the daemon went away whether its new chunks are in the pool now)."""
        client, name = self._client, self.pool_name
        old = self._conn
        c = client._live()
        if self._restart_announced and c is old:  # it says RESTARTING before it exits: attach to the next one
            raise KvdError("UNAVAILABLE", f"kvd at {client.socket} is still stopping")
        try:
            now = client._call("GetPool", pb.GetPoolRequest(name=name), conn=c)
        except KvdError as e:
            if e.code == "NOT_FOUND":
                raise _Fatal(KvdError("NOT_FOUND", f"pool {name} did not survive the restart of kvd at "
                                      f"{client.socket}: {e.message}")) from None
            raise
        # A pool restored without its memory waits for its clients to hand the chunks back.
        if now.state == pb.POOL_STATE_RECOVERING and now.missing_chunk_ids:
            mine = []
            try:
                with self._lock:  # dups: the Mapping's own FDs stay its own
                    for cid in now.missing_chunk_ids:
                        entry = self._chunks.get(cid)
                        if entry is not None:
                            mine.append((cid, os.dup(entry.fd)))
                if mine:
                    try:
                        returned = c.session.return_handles(name, mine)
                        restart.returned_chunk_ids.extend(returned.adopted_chunk_ids)
                    except KvdError as e:
                        if e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                            raise
                        # The pieces do not agree, or the pool no longer waits: nothing was adopted, and
                        # whatever the daemon lacks shows as lost below.
            finally:
                for _, fd in mine:
                    os.close(fd)
        try:
            resp = client._call("Attach", pb.AttachRequest(pool=name, client_name=self._client_name,
                                                           device_uuid=self._peer_uuid, pausable=self.pausable),
                                conn=c)
        except KvdError as e:
            # UNAVAILABLE: still RECOVERING, waiting for other clients' chunks or for its grace to pass.
            if e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                raise
            raise _Fatal(KvdError(e.code, f"attaching pool {name} again after kvd restarted: {e.message}")) from None
        watch = None
        try:
            found = Geometry.from_proto(resp.pool.geometry)
            if dataclasses.replace(found, rule="") != dataclasses.replace(self.geometry, rule=""):
                raise _Fatal(KvdError("FAILED_PRECONDITION", f"pool {name} has another geometry since kvd restarted "
                                      "(it was created again)"))
            # Chunk ids are the daemon's: only a daemon that restored its saved state (epoch 2 and up) has
            # the same chunks under the same ids. A fresh one (epoch 1) may have made a pool of the same
            # name since.
            restored = resp.pool.epoch > 1
            watch = c.stub.Watch(pb.WatchRequest(client_id=resp.client_id), metadata=c.md)
            # Keep what the daemon still has exactly as it was; unmap what it lost; map what it added. A
            # pausable Mapping unmaps what the daemon lost only with the engine paused for it
            # (docs/architecture.md, Note [Releases pause first]; on_resume once it follows again); one that
            # is not pausable unmaps it as it is (the daemon no longer counts that memory).
            theirs = {ch.id: (ch.segment, ch.offset, ch.bytes) for ch in resp.pool.chunks} if restored else {}
            with self._lock:
                gone = [cid for cid, m in self._chunks.items() if theirs.get(cid) != (m.segment, m.offset, m.bytes)]
                ranges = [ByteRange(self._chunks[cid].segment, self._chunks[cid].offset, self._chunks[cid].bytes)
                          for cid in gone]
                pause_now = bool(gone) and not self._paused and not self._paused_for_restart and self.pausable
            if pause_now:
                self._callback(self.on_pause, _merged(ranges))
                with self._lock:
                    self._paused_for_restart = True
            with self._lock:
                if self.closed or self.gone is not None:
                    raise _Fatal(KvdError("CANCELLED", "closing"))
                for cid in gone:
                    restart.lost_chunk_ids.append(cid)
                    restart.lost_bytes += self._chunks[cid].bytes
                self._unmap(gone)
                # A pause does not outlive the daemon that began it: its imported chunks go, and the new
                # daemon's chunk table says whether the change was made (those chunks come mapped from the
                # lease).
                paused, self._paused = self._paused, {}
                for imported in paused.values():
                    self._drop_imported(imported)
                self._changed.notify_all()
                try:
                    self._map_lease(resp.lease, list(resp.pool.chunks), conn=c)
                except KvdError as e:
                    raise _Fatal(KvdError(e.code, f"mapping pool {name} after kvd restarted: {e.message}")) from None
                resumed = [bool(ids) and all(i in self._chunks for i in ids) for ids in paused.values()]
                if self._paused_for_restart:
                    resumed.append(True)
                    self._paused_for_restart = False
                self.committed_blocks = resp.pool.committed_blocks
                self.state = pb.POOL_STATE_SLEEPING if resp.pool.state == pb.POOL_STATE_SLEEPING else \
                    pb.POOL_STATE_AWAKE
                self._conn, self.client_id, self.epoch, self._watch = c, resp.client_id, resp.pool.epoch, watch
                restart.epoch, restart.committed_blocks = self.epoch, self.committed_blocks
            watch.initial_metadata()  # the daemon registered the watch (events since the Attach are queued)
            return watch, resumed
        except BaseException:
            with self._lock:
                adopted = self._watch is watch
            if not adopted:
                if watch is not None:
                    watch.cancel()
                try:
                    client._call("Detach", pb.DetachRequest(pool=name, client_id=resp.client_id), conn=c)
                except KvdError:
                    pass
            raise

    def _lose(self, why, engine_done=False, forced=False):
        """Marks the Mapping lost and calls on_lost(why), once; nothing after close(). The watch is
        cancelled, so the daemon detaches this client: a lost Mapping never holds up a shrink or sleep that
        waits for acknowledgements. Nothing is unmapped while the engine may touch it (docs/architecture.md,
        Note [Releases pause first]): engine_done (its own session's delete, or a pause holds it) unmaps
        everything now; otherwise a pausable Mapping calls on_pause first, and one that is not pausable keeps
        every chunk mapped until close() when the loss was forced on it (a forced release, chunks a restart
        lost), the daemon counting them as its until then."""
        with self._lock:
            if self.closed or self.gone is not None:
                return
            pause_first = not engine_done and not self._paused and self.on_pause is not None
            mapped = [ByteRange(m.segment, m.offset, m.bytes) for m in self._chunks.values()]
        if pause_first:
            self._callback(self.on_pause, _merged(mapped))
        with self._lock:
            if self.closed or self.gone is not None:
                return
            released = engine_done or self.on_pause is not None or not forced or not self._chunks
            if released:
                self._unmap_all()
            self.committed_blocks = 0
            self.gone = why
            watch = self._watch
            conn, client_id = self._conn, self.client_id
            self._changed.notify_all()
        watch.cancel()
        # Everything is unmapped and closed: say so, so that the daemon stops counting what this Mapping
        # held (a deleted pool's memory stays counted until its clients let go), as libkvd does. One that
        # keeps its chunks says so at close().
        try:
            if not released:
                raise KvdError("FAILED_PRECONDITION", "still mapped")
            self._client._call("Detach", pb.DetachRequest(pool=self.pool_name, client_id=client_id, released=True),
                               conn=conn, timeout=min(self._client.timeout, 5.0))
        except KvdError:
            pass  # the daemon may be gone
        if self.on_lost:
            self._callback(self.on_lost, why)

    # -- views ----------------------------------------------------------------------------------
    def _dtype(self, dtype):
        import numpy
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
        pool's byte strides. Host: a numpy array. CUDA: a CudaArray (__cuda_array_interface__).
        dtype: default by element_bytes (1 uint8, 2 float16, 4 float32, 8 float64, else raw uint8
        bytes); pass e.g. "int16"/"uint16" or a numpy dtype of the same size (bf16: take float16/
        uint16 and .view(torch.bfloat16) on the torch side)."""
        if self.closed:
            raise KvdError("FAILED_PRECONDITION", f"the mapping of pool {self.pool_name} is closed")
        import numpy
        dt = self._dtype(dtype)
        addr, shape, strides = self._layer_geometry(l, dt)
        if self._memory.kind == "cuda":
            return CudaArray(addr, shape, dt.str, strides, self)
        # numpy reads __array_interface__ (no copy); the array's .base keeps the Mapping referenced.
        return numpy.asarray(_HostArray(addr, shape, dt, strides, self))

    def layers(self, dtype=None):
        return [self.layer(l, dtype) for l in range(self.geometry.dims["layers"])]

    @property
    def cuda_device(self):
        """The CUDA ordinal (in this process's numbering) the pool is mapped on; None on host."""
        return getattr(self._memory, "ordinal", None)

    @property
    def mapped_chunks(self):
        with self._lock:
            return sorted(self._chunks)

    # -- lifetime -------------------------------------------------------------------------------
    def close(self):
        """Stops the follower, unmaps every chunk, frees the VA, then detaches saying so (released: the
        daemon gives back what this client held at once, as libkvd's Mapping does). Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            conn, client_id = self._conn, self.client_id
            self._changed.notify_all()
        self._closing.set()
        with self._lock:
            watch = self._watch
        watch.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self._unmap_all()
        self._memory.free(self.base, self.geometry.reserved_bytes)
        try:
            self._client._call("Detach", pb.DetachRequest(pool=self.pool_name, client_id=client_id, released=True),
                               conn=conn, timeout=min(self._client.timeout, 5.0))
        except KvdError:
            pass  # already gone (pool deleted, daemon gone): nothing to undo there
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
