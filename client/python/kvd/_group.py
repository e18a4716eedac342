"""kvd.Group: one engine's tensor-parallel ranks as one unit (docs/integrating.md, "Engine groups"), libkvd's
kvd::Group through the C API.

Each rank owns one pool on the kvd of its GPU; the pools carry the same GroupMembership name and size
and distinct ranks. A Group resizes all of them or none: it prepares the operation on every daemon
(each does everything that can fail and holds its pool), then commits on every daemon; when a prepare
fails it aborts the prepared ranks, so every pool stays as it was.

A commit cannot fail for want of memory, but a daemon can die or a ttl pass between the phases. Then
the ranks that did commit are put back with the opposite operation (grow <-> shrink to their blocks
before, sleep <-> wake) and the error (ABORTED) says so; if even that fails the error (INTERNAL) says
THE GROUP IS INCONSISTENT and lists each rank's state.

Ownership and threads: a Group owns one session per rank; close() closes them. Its methods may be
called from any thread; operations on one Group are serialised, and each phase runs on every daemon in
parallel. The daemons abort a coordinator's prepared ranks when its sessions close, so a coordinator
that dies between the phases leaves nothing held.
"""

import ctypes
import dataclasses
import weakref

from . import _client, _lib
from ._errors import KvdError
from ._lib import call, lib, text, us
from ._proto import pb


@dataclasses.dataclass
class GroupRank:
    """One rank as found on its daemon: `pool` is its kvd.v1.Pool as last seen."""

    rank: int
    socket: str
    device_uuid: str
    pool: object


@dataclasses.dataclass
class GroupChange:
    """The result of one group operation: every rank's kvd.v1.PoolUpdate by rank, and the
    coordinator's timings (prepare: first prepare sent to last answered)."""

    op: str
    ranks: list
    prepare_us: int = 0
    commit_us: int = 0
    total_us: int = 0
    prepared_bytes: int = 0  # memory made ready on all daemons (grow, wake)


_OP_NAMES = {_lib.OP_GROW: "grow", _lib.OP_SHRINK: "shrink", _lib.OP_SLEEP: "sleep", _lib.OP_WAKE: "wake"}


def node_sockets(directory=None):
    """The kvd sockets of this node: every *.sock in `directory` (default $KVD_SOCKET_DIR, else
    $NVIDIA_DRA_LOCAL_IPC_DIR, else /run/kvd), sorted. NOT_FOUND when the directory is unreadable or holds none."""
    sockets, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
    call(lib.kvd_node_sockets, text(directory or ""), ctypes.byref(sockets), ctypes.byref(n))
    try:
        return [ctypes.string_at(sockets[i]).decode() for i in range(n.value)]
    finally:
        lib.kvd_strings_free(sockets, n.value)


def find_socket(device_uuid, socket_dir=None, timeout=10.0):
    """The socket of the kvd that serves the device `device_uuid` -- a UUID as device_info() reports
    it, or a unique case-insensitive prefix of one ("GPU-" may be left out) -- among
    node_sockets(socket_dir), each asked within `timeout` seconds. Processes number GPUs differently
    (CUDA_VISIBLE_DEVICES), so an engine finds its kvd by its GPU's UUID. KvdError NOT_FOUND naming the
    daemons and devices seen; INVALID_ARGUMENT when the prefix is ambiguous (libkvd's kvd::FindSocket)."""
    socket = ctypes.c_void_p()
    call(lib.kvd_find_socket, text(device_uuid), text(socket_dir or ""), us(timeout), ctypes.byref(socket))
    return _lib.take_string(socket)


class Group:
    """One engine group on the daemons of a node. Open with Group.open(); use as a context manager
    or call close()."""

    def __init__(self, name, handle, before_commit):
        self.name = name
        self._h = _client._Handle(handle)
        self._before_commit = before_commit  # the C callback, referenced while the group lives
        self._before_commit_error = None
        _client._groups.add(self)
        self._finalizer = weakref.finalize(self, lib.kvd_group_close, handle)
        self._finalizer.atexit = False  # _client._close_everything closes it

    @classmethod
    def open(cls, name, sockets=None, socket_dir=None, ttl=30.0, client_name="kvd-group", timeout=10.0,
             before_commit=None):
        """Finds the pools of group `name` on the daemons at `sockets` (default: node_sockets(socket_dir))
        -> Group, and checks that they form the whole group: one size, every rank 0..size-1 exactly once.

        A daemon that does not answer (or refuses this uid) is passed over: the group may live on the
        others. KvdError NOT_FOUND when no daemon that answered has a pool of it; UNAVAILABLE when none
        answered; FAILED_PRECONDITION naming the missing or duplicated rank, or the disagreeing size.
        The messages name the daemons searched and why any did not answer. ttl: seconds each daemon holds
        a prepared pool before it aborts on its own.
        before_commit: called after every rank prepared and before the first commit (for tests); if it
        raises, every rank is aborted and the exception propagates."""
        if not name:
            raise KvdError("INVALID_ARGUMENT", "group: a group name is required")
        if sockets is not None and socket_dir is not None:
            raise KvdError("INVALID_ARGUMENT", "sockets, socket_dir: give one of them, not both")
        sockets = list(sockets) if sockets is not None else node_sockets(socket_dir)
        holder = {}

        def trampoline(_):
            try:
                before_commit()
                return 0
            except BaseException as e:  # libkvd aborts every rank; the operation raises it again
                holder["group"]._before_commit_error = e
                return 10  # ABORTED

        fn = _lib.BEFORE_COMMIT_FN(trampoline) if before_commit is not None else None
        handle = ctypes.c_void_p()
        with _lib.Options("group") as o:
            o.set("set_client_name", text(client_name)).set("set_timeout_us", us(timeout)).set("set_ttl_us", us(ttl))
            if fn is not None:
                o.set("set_before_commit", fn, None)
            array = (ctypes.c_char_p * max(len(sockets), 1))(*[text(s) for s in sockets])
            call(lib.kvd_group_open, text(name), array, len(sockets), o.handle, ctypes.byref(handle))
        g = holder["group"] = cls(name, handle.value, fn)
        return g

    def _c(self, fn):
        def closed():
            raise KvdError("FAILED_PRECONDITION", f"group {self.name}: the Group is closed")
        return self._h.use(fn, closed)

    # -- reading ---------------------------------------------------------------------------------------
    def _ranks(self, h):
        out = []
        for r in range(lib.kvd_group_rank_count(h)):
            buffer = _lib.Buffer()
            call(lib.kvd_group_rank_pool, h, r, ctypes.byref(buffer))
            try:
                pool = pb.Pool.FromString(_lib.take_buffer(buffer))
            finally:
                lib.kvd_buffer_free(ctypes.byref(buffer))
            out.append(GroupRank(rank=r, socket=lib.kvd_group_rank_socket(h, r).decode(),
                                 device_uuid=lib.kvd_group_rank_device_uuid(h, r).decode(), pool=pool))
        return out

    @property
    def ranks(self):
        """Every rank as last seen (open, refresh, or the last operation) -> [GroupRank] by rank."""
        return self._h.use(self._ranks, lambda: [])

    def refresh(self):
        """Re-reads every rank's pool -> [GroupRank]."""
        return self._c(lambda h: (call(lib.kvd_group_refresh, h), self._ranks(h))[1])

    # -- all ranks or none -----------------------------------------------------------------------------
    def grow(self, blocks):
        """Grows every rank to `blocks` committed blocks -> GroupChange; the engines' Mappings follow."""
        return self._run(lib.kvd_group_grow, int(blocks))

    def shrink(self, blocks, wait=False, force=False):
        """Shrinks every rank to `blocks`; wait: reply once every attached client acknowledged. The ranks'
        pausable Mappings of other sessions pause from the prepare to the commit; one that is not pausable
        refuses it unless force (docs/api.md, "Releases and running engines")."""
        return self._run(lib.kvd_group_shrink, int(blocks), int(bool(wait)), int(bool(force)))

    def sleep(self, wait=False, force=False, keep=False):
        """Sleeps every rank; wait and force as shrink's; keep: every rank keeps its contents in its daemon's
        host tier (Client.sleep's keep), or none sleeps."""
        return self._run(lib.kvd_group_sleep, int(bool(wait)), int(bool(force)), int(bool(keep)))

    def wake(self):
        return self._run(lib.kvd_group_wake)

    def _run(self, fn, *args):
        def run(h):
            change = ctypes.POINTER(_lib.GroupChange)()
            self._before_commit_error = None
            try:
                call(fn, h, *args, ctypes.byref(change))
            except KvdError:
                error, self._before_commit_error = self._before_commit_error, None
                if error is not None:
                    raise error from None
                raise
            try:
                c = change[0]
                return GroupChange(op=_OP_NAMES[c.op],
                                   ranks=[pb.PoolUpdate.FromString(_lib.take_buffer(c.updates[r]))
                                          for r in range(c.rank_count)],
                                   prepare_us=c.prepare_us, commit_us=c.commit_us, total_us=c.total_us,
                                   prepared_bytes=c.prepared_bytes)
            finally:
                lib.kvd_group_change_free(change)
        return self._c(run)

    # -- lifetime --------------------------------------------------------------------------------------
    def close(self):
        """Closes every rank's session (the daemons abort whatever they still hold of it). Idempotent."""
        if self._h.take() is not None:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Group({self.name!r}, ranks={[r.rank for r in self.ranks]})"
