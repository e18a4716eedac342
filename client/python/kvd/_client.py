"""kvd.connect() / Client / Mapping: the Python client of a kvd daemon (one daemon, one device)."""

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


def connect(socket=None, device=0, client_name=None, timeout=10.0):
    """Opens a session with the kvd daemon of `device` (or at `socket`) -> Client. `device` is an index
    (socket /run/kvd/gpu<N>.sock) or a device UUID (prefix), looked up among the node's kvds
    (find_socket): the way to find the kvd of a GPU whose index differs in this process."""
    if socket is None and isinstance(device, str) and not device.isdigit():
        from ._group import find_socket  # noqa: PLC0415 (_group imports this module)
        socket = find_socket(device, timeout=timeout)
    return Client(socket or default_socket(int(device)), client_name=client_name, timeout=timeout)


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


class Client:
    """A session with one kvd daemon: a gRPC channel on the control socket plus the handle-channel
    session (kept open as the session's liveness). Use as a context manager or call close()."""

    def __init__(self, socket, client_name=None, timeout=10.0):
        self.socket = socket
        self.timeout = timeout
        name = client_name if client_name is not None else f"py-{os.getpid()}"
        self.session = HandleSession(handles_path(socket), name, timeout=timeout)
        self.client_name = name
        self._channel = grpc.insecure_channel("unix:" + socket)
        self.stub = pb_grpc.KvdStub(self._channel)
        self._md = ((_wire.SESSION_METADATA_KEY, self.session.token),)
        self._lock = threading.Lock()
        self._mappings = {}  # pool name -> Mapping (at most one per pool: see attach)
        self._memories = {}  # local device index -> its mapper, opened on first use
        self._info = None

    # -- plumbing -------------------------------------------------------------------------------
    def _call(self, method, request, session=True, timeout=None):
        try:
            return getattr(self.stub, method)(request, metadata=self._md if session else None,
                                              timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise KvdError.from_rpc(e) from None

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

    def delete(self, name, force=False):
        """DeletePool -> released bytes."""
        return self._call("DeletePool", pb.DeletePoolRequest(name=name, force=force)).released_bytes

    def attach(self, name, on_grow=None, on_release=None, on_lost=None, client_name="", device=None):
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
        detaches). They must not close the Mapping nor shrink/sleep this pool with wait=True.
        One Mapping per pool per Client: the daemon hands the caller's lease to one client of the
        session."""
        with self._lock:
            if name in self._mappings and not self._mappings[name].closed:
                raise KvdError("ALREADY_EXISTS", f"pool {name} is already attached by this client; use its "
                               "Mapping or connect another client")
        memory, peer_uuid = self._memory_backend(device)
        resp = self._call("Attach", pb.AttachRequest(pool=name, client_name=client_name, device_uuid=peer_uuid))
        try:
            m = Mapping(self, memory, resp, on_grow, on_release, on_lost)
        except BaseException:
            try:
                self._call("Detach", pb.DetachRequest(pool=name, client_id=resp.client_id))
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

    def shrink(self, name, blocks, wait=False):
        """Shrink to `blocks` -> kvd.v1.PoolUpdate. wait: reply once every client acknowledged."""
        timeout = max(self.timeout, 70.0) if wait else None
        return self._call("Shrink", pb.ShrinkRequest(pool=name, target_blocks=blocks, wait_for_release=wait),
                          timeout=timeout)

    def sleep(self, name=None, wait=False):
        """Sleep one pool, or every awake pool (name None or "") -> [kvd.v1.PoolUpdate]. The Mappings
        learn of it from their release events (with wait: before this returns)."""
        req = pb.SleepRequest(wait_for_release=wait)
        if not name:
            req.all = True
        else:
            req.pool = name
        return list(self._call("Sleep", req, timeout=max(self.timeout, 70.0) if wait else None).updates)

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

    # -- engine groups and peer access ----------------------------------------------------------
    def grant_peer_access(self, name, device_uuid, revoke=False):
        """GrantPeerAccess -> kvd.v1.Pool: lets processes on the device `device_uuid` (as that device's
        daemon reports it, or "*" for every device) attach the pool; revoke takes the grant back
        (mappings that exist stay)."""
        return self._call("GrantPeerAccess", pb.GrantPeerAccessRequest(pool=name, device_uuid=device_uuid,
                                                                        revoke=revoke))

    def prepare(self, name, op, target_blocks=0, ttl=30.0):
        """Phase one of a group operation on this daemon -> kvd.v1.PrepareResponse (transaction,
        pool as it is now, prepared_bytes, expires_at_unix_ms). op: "grow", "shrink", "sleep", "wake"
        (or a kvd.v1 Operation); target_blocks for grow and shrink. The daemon does everything that
        can fail and holds the pool (other resizes get ABORTED) until commit() or abort() from this
        Client, `ttl` seconds, or the end of this Client's session. kvd.Group drives it on every rank."""
        req = pb.PrepareRequest(pool=name, operation=_operation(op), target_blocks=target_blocks,
                                ttl_ms=max(int(round(ttl * 1000)), 1))
        return self._call("Prepare", req)

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
        resp = self._call("ExportRanges", req)
        if not resp.handles:
            return resp, []
        fds = self.session.fetch(resp.lease.token)
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
        self._channel.close()
        self.session.close()
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


class Mapping:
    """One attached pool, mapped at `base` in this process: VA for geometry.reserved_bytes, every
    chunk at base + chunk.offset. A daemon thread follows the pool's Watch stream (maps grown/woken
    chunks, unmaps and acknowledges released ones). close() detaches, unmaps and frees the VA.

    Views from layer() span the pool's whole capacity (the pointers never move); only blocks below
    `committed_blocks` are backed while the pool is awake. Touching others faults (SIGSEGV on
    host, an illegal address on CUDA). Views must not be used after close()."""

    def __init__(self, client, memory, attached, on_grow, on_release, on_lost=None):
        self._client = client
        self._memory = memory
        self.client_id = attached.client_id
        pool = attached.pool
        self.pool_name = pool.name
        self.device_uuid = memory.device.uuid if memory.device is not None else ""
        self.geometry = Geometry.from_proto(pool.geometry, pool.layout)
        self.layout_resolution = pool.layout
        self.committed_blocks = pool.committed_blocks
        self.state = pool.state
        self.on_grow, self.on_release, self.on_lost = on_grow, on_release, on_lost
        self.closed = False
        self.gone = None  # once the Mapping is lost: the KvdError on_lost got (everything is unmapped then)
        self._lock = threading.RLock()
        self._chunks = {}  # id -> (va, bytes, import handle)
        self.events_seen = 0
        self._watch = self._thread = None
        self.base = memory.reserve(self.geometry.reserved_bytes, self.geometry.granularity_bytes)
        try:
            self._map_lease(attached.lease, list(pool.chunks))
            self._watch = client.stub.Watch(pb.WatchRequest(client_id=self.client_id), metadata=client._md)
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
    def _map_lease(self, lease, chunks):
        if not chunks:
            return []
        fds = self._client.session.fetch(lease.token)
        by_id = {c.id: c for c in chunks}
        mapped = []
        try:
            with self._lock:
                for i, (chunk_id, fd) in enumerate(fds):
                    try:
                        c = by_id.get(chunk_id)
                        if c is None:
                            raise KvdError("INTERNAL", f"lease yielded chunk {chunk_id}, not one of {sorted(by_id)}")
                        if chunk_id not in self._chunks:
                            va = self.base + c.offset
                            handle = self._memory.import_and_map(va, c.bytes, fd)
                            self._chunks[chunk_id] = (va, c.bytes, handle)
                            mapped.append(c)
                    finally:
                        os.close(fd)  # the mapping keeps the memory
                        fds[i] = (chunk_id, -1)
        finally:
            for _, fd in fds:
                if fd >= 0:
                    os.close(fd)
        return mapped

    def _unmap(self, chunk_ids):
        done = []
        with self._lock:
            for cid in chunk_ids:
                entry = self._chunks.pop(cid, None)
                if entry is not None:
                    self._memory.unmap(*entry)
                    done.append(cid)
        return done

    def _unmap_all(self):
        with self._lock:
            self._unmap(list(self._chunks))

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
            live = {c.id for c in self._client.pool(self.pool_name).chunks}
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
        """The follower thread: acts on each event, then calls back; mirrors libkvd's Mapping::Impl::Follow."""
        name = self.pool_name
        why = None
        try:
            for ev in self._watch:
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
                elif ev.type == pb.EVENT_TYPE_CHUNKS_RELEASED:
                    with self._lock:
                        if self.closed or self.gone is not None:
                            continue
                        self._unmap([c.id for c in ev.chunks])
                        self.committed_blocks = ev.committed_blocks
                        if ev.state == pb.POOL_STATE_SLEEPING:
                            self.state = ev.state
                    if ev.release_id:
                        try:
                            self._client._call("Acknowledge", pb.AcknowledgeRequest(client_id=self.client_id,
                                                                                     release_id=ev.release_id))
                        except KvdError as e:
                            why = KvdError(e.code, f"acknowledging release {ev.release_id}: {e.message}")
                            break
                    if self.on_release:
                        self._callback(self.on_release, ev.committed_blocks)
                elif ev.type == pb.EVENT_TYPE_POOL_DELETED:
                    why = KvdError("NOT_FOUND", f"pool {name} was deleted")
                    break
                elif ev.type == pb.EVENT_TYPE_DAEMON_STOPPING:
                    why = KvdError("UNAVAILABLE", "kvd is stopping")
                    break
            else:
                why = KvdError("UNAVAILABLE", f"the event stream of pool {name} ended")
        except grpc.RpcError as e:
            err = KvdError.from_rpc(e)
            why = KvdError(err.code, f"the event stream of pool {name} broke: {err.message}")
        except Exception as e:  # a bug: still lose the Mapping rather than leave it half followed
            _log.exception("kvd: following pool %s failed", name)
            why = KvdError("INTERNAL", f"following pool {name}: {type(e).__name__}: {e}")
        self._lose(why)

    def _lose(self, why):
        """Unmaps everything, marks the Mapping lost and calls on_lost(why), once; nothing after close().
        The watch is cancelled, so the daemon detaches this client: a lost Mapping never holds up a
        shrink or sleep that waits for acknowledgements."""
        with self._lock:
            if self.closed or self.gone is not None:
                return
            self._unmap_all()
            self.committed_blocks = 0
            self.gone = why
        self._watch.cancel()
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
        """Stops the follower, detaches, unmaps every chunk and frees the VA. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            self._client._call("Detach", pb.DetachRequest(pool=self.pool_name, client_id=self.client_id))
        except KvdError:
            pass  # already detached (pool deleted, daemon gone): nothing to undo there
        self._watch.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self._unmap_all()
        self._memory.free(self.base, self.geometry.reserved_bytes)
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
