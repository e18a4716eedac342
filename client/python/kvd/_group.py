"""kvd.Group: one engine's tensor-parallel ranks as one unit (docs/integrating.md, "Engine groups").

Each rank owns one pool on the kvd of its GPU; the pools carry the same GroupMembership name and size
and distinct ranks. A Group resizes all of them or none: it prepares the operation on every daemon
(each does everything that can fail and holds its pool), then commits on every daemon; when a prepare
fails it aborts the prepared ranks, so every pool stays as it was.

A commit cannot fail for want of memory, but a daemon can die or a ttl pass between the phases. Then
the ranks that did commit are put back with the opposite operation (grow <-> shrink to their blocks
before, sleep <-> wake) and the error (ABORTED) says so; if even that fails the error (INTERNAL) says
THE GROUP IS INCONSISTENT and lists each rank's state.

Ownership and threads: a Group owns one Client (session) per rank; close() closes them. Its methods
may be called from any thread; operations on one Group are serialised, and each phase runs on every
daemon in parallel (one thread per rank). The daemons abort a coordinator's prepared ranks when its
sessions close, so a coordinator that dies between the phases leaves nothing held.

Mirrors client/group.cc (kvd::Group): same checks, same messages.
"""

import dataclasses
import os
import threading
import time

from . import _wire
from ._client import Client
from ._errors import KvdError

DEFAULT_SOCKET_DIR = _wire.DEFAULT_SOCKET_DIR


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


def node_sockets(directory=None):
    """The kvd sockets of this node: every *.sock in `directory` (default $KVD_SOCKET_DIR, else
    $NVIDIA_DRA_LOCAL_IPC_DIR, else /run/kvd), sorted. NOT_FOUND when the directory is unreadable or holds none."""
    directory = directory or _wire.socket_dir_from_environment()
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise KvdError("NOT_FOUND", f"socket directory {directory}: {e.strerror}") from None
    sockets = sorted(os.path.join(directory, n) for n in names if n.endswith(_wire.SOCKET_SUFFIX))
    if not sockets:
        raise KvdError("NOT_FOUND", f"no kvd socket (*.sock) in {directory}")
    return sockets


def find_socket(device_uuid, socket_dir=None, timeout=10.0):
    """The socket of the kvd that serves the device `device_uuid` -- a UUID as device_info() reports
    it, or a unique case-insensitive prefix of one ("GPU-" may be left out) -- among
    node_sockets(socket_dir). Processes number GPUs differently (CUDA_VISIBLE_DEVICES), so an engine
    finds its kvd by its GPU's UUID. KvdError NOT_FOUND naming the daemons and devices seen;
    INVALID_ARGUMENT when the prefix is ambiguous. Mirrors kvd::FindSocket."""
    if not device_uuid:
        raise KvdError("INVALID_ARGUMENT", "device_uuid: must not be empty")
    want = device_uuid.lower()
    seen, matches = [], []
    for socket in node_sockets(socket_dir):
        try:
            with Client(socket, client_name="find-socket", timeout=timeout) as c:
                uuid = c.device_info().device_uuid
        except KvdError:
            seen.append(f"{socket} (not answering)")
            continue
        seen.append(f"{socket} {uuid}")
        if uuid.lower() in (want, "gpu-" + want):
            return socket  # an exact UUID wins
        if uuid.lower().startswith(want) or uuid.lower().startswith("gpu-" + want):
            matches.append((socket, uuid))
    if len(matches) == 1:
        return matches[0][0]
    if matches:
        raise KvdError("INVALID_ARGUMENT", f"device {device_uuid}: matches several daemons: "
                       + ", ".join(f"{s} {u}" for s, u in matches))
    raise KvdError("NOT_FOUND", f"device {device_uuid}: no kvd serves it; seen: {', '.join(seen)}")


def _rank_name(r):
    return f"rank {r.rank} ({r.pool.name} on {r.socket})"


def _rank_list(ranks):
    return ", ".join(str(r) for r in ranks) if ranks else "none"


def _each(n, fn):
    """Runs fn(i) for every i in [0, n) on its own thread (the daemons work in parallel) -> a list of
    (result, None) or (None, KvdError) by i."""
    out = [None] * n

    def run(i):
        try:
            out[i] = (fn(i), None)
        except KvdError as e:
            out[i] = (None, e)
        except Exception as e:  # a bug or a mapping failure: still an answer for this rank
            out[i] = (None, KvdError("UNKNOWN", f"{type(e).__name__}: {e}"))

    threads = [threading.Thread(target=run, args=(i,), name=f"kvd-group-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _us(seconds):
    return int(seconds * 1e6)


class Group:
    """One engine group on the daemons of a node. Open with Group.open(); use as a context manager
    or call close()."""

    def __init__(self, name, members, ttl, before_commit):
        self.name = name
        self._members = members  # [(GroupRank, Client)] by rank
        self._ttl = ttl
        self._before_commit = before_commit
        self._lock = threading.Lock()  # one operation at a time; guards the GroupRanks

    @classmethod
    def open(cls, name, sockets=None, socket_dir=None, ttl=30.0, client_name="kvd-group", timeout=10.0,
             before_commit=None):
        """Finds the pools of group `name` on the daemons at `sockets` (default: node_sockets(socket_dir))
        -> Group, and checks that they form the whole group: one size, every rank 0..size-1 exactly once.

        A daemon that does not answer (or refuses this uid) is passed over: the group may live on the
        others. KvdError NOT_FOUND when no daemon that answered has a pool of it; UNAVAILABLE when none
        answered; FAILED_PRECONDITION naming the missing or duplicated rank, or the disagreeing size.
        The messages name the daemons searched and why any did not answer. ttl: seconds each daemon holds a prepared pool before it aborts on its own.
        before_commit: called after every rank prepared and before the first commit (for tests); if it
        raises, every rank is aborted and the exception propagates."""
        if not name:
            raise KvdError("INVALID_ARGUMENT", "group: a group name is required")
        if sockets is not None and socket_dir is not None:
            raise KvdError("INVALID_ARGUMENT", "sockets, socket_dir: give one of them, not both")
        sockets = list(sockets) if sockets is not None else node_sockets(socket_dir)
        if not sockets:
            raise KvdError("INVALID_ARGUMENT", "sockets: at least one daemon socket is required")

        def connect(socket):
            try:
                return Client(socket, client_name=client_name, timeout=timeout)
            except KvdError as e:
                raise KvdError(e.code, f"{socket}: {e.message}") from None

        members, spare = [], []
        answered, silent = [], []  # silent: "socket: why" of daemons that could not be read
        try:
            for socket in sockets:
                # A node's socket directory may hold a stopped or foreign kvd: the group may live elsewhere.
                try:
                    scan = connect(socket)
                except KvdError as e:
                    silent.append(e.message)  # connect() named the socket
                    continue
                try:
                    device = scan.device_info()
                    pools = scan.pools()
                except KvdError as e:
                    scan.close()
                    silent.append(f"{socket}: {e.message}")
                    continue
                answered.append(socket)
                for pool in pools:
                    if pool.group.name != name:
                        continue
                    # Every rank gets a session of its own; the first one on a daemon reuses the scanning one.
                    client, scan = (scan, None) if scan is not None else (connect(socket), None)
                    members.append((GroupRank(pool.group.rank, socket, device.device_uuid, pool), client))
                if scan is not None:
                    spare.append(scan)
            if not answered:
                raise KvdError("UNAVAILABLE", f"group {name}: no daemon answered: {'; '.join(silent)}")
            searched = ", ".join(answered) + (f" (not answering: {'; '.join(silent)})" if silent else "")
            cls._check_whole(name, searched, members)
        except BaseException:
            for _, client in members:
                client.close()
            raise
        finally:
            for client in spare:
                client.close()
        return cls(name, members, ttl, before_commit)

    @staticmethod
    def _check_whole(name, searched, members):
        if not members:
            raise KvdError("NOT_FOUND", f"group {name}: no pool of it on {searched}")
        members.sort(key=lambda m: m[0].rank)
        ranks = [r for r, _ in members]
        size = ranks[0].pool.group.size
        for r in ranks:
            if r.pool.group.size != size:
                raise KvdError("FAILED_PRECONDITION", f"group {name}: {_rank_name(ranks[0])} says the group has "
                               f"{size} ranks but {_rank_name(r)} says {r.pool.group.size}")
        for a, b in zip(ranks, ranks[1:]):
            if a.rank == b.rank:
                raise KvdError("FAILED_PRECONDITION", f"group {name}: rank {a.rank} appears twice: {_rank_name(a)} "
                               f"and {_rank_name(b)}")
        missing = sorted(set(range(size)) - {r.rank for r in ranks})
        if missing:
            raise KvdError("FAILED_PRECONDITION", f"group {name}: rank{'s ' if len(missing) > 1 else ' '}"
                           f"{_rank_list(missing)} of {size} not found on {searched}")

    # -- reading ---------------------------------------------------------------------------------------
    @property
    def ranks(self):
        """Every rank as last seen (open, refresh, or the last operation) -> [GroupRank] by rank."""
        with self._lock:
            return [dataclasses.replace(r) for r, _ in self._members]

    def refresh(self):
        """Re-reads every rank's pool -> [GroupRank]."""
        with self._lock:
            got = _each(len(self._members), lambda i: self._members[i][1].pool(self._members[i][0].pool.name))
            for (r, _), (pool, err) in zip(self._members, got):
                if err is not None:
                    raise KvdError(err.code, f"{_rank_name(r)}: {err.message}")
            for (r, _), (pool, _) in zip(self._members, got):
                r.pool = pool
            return [dataclasses.replace(r) for r, _ in self._members]

    # -- all ranks or none -----------------------------------------------------------------------------
    def grow(self, blocks):
        """Grows every rank to `blocks` committed blocks -> GroupChange; the engines' Mappings follow."""
        return self._run("grow", blocks, False)

    def shrink(self, blocks, wait=False, force=False):
        """Shrinks every rank to `blocks`; wait: reply once every attached client acknowledged. The ranks'
        pausable Mappings of other sessions pause from the prepare to the commit; one that is not pausable
        refuses it unless force (docs/api.md, "Releases and running engines")."""
        return self._run("shrink", blocks, wait, force)

    def sleep(self, wait=False, force=False, keep=False):
        """Sleeps every rank; wait and force as shrink's; keep: every rank keeps its contents in its daemon's
        host tier (Client.sleep's keep), or none sleeps."""
        return self._run("sleep", 0, wait, force, keep)

    def wake(self):
        return self._run("wake", 0, False)

    def _run(self, op, target_blocks, wait, force=False, keep=False):
        with self._lock:
            members = self._members
            if not members:
                raise KvdError("FAILED_PRECONDITION", f"group {self.name}: the Group is closed")
            n = len(members)
            start = time.monotonic()
            what = f"group {self.name}: {op} to {target_blocks} blocks" if op in ("grow", "shrink") \
                else f"group {self.name}: {op}"

            # Phase 1: every daemon does what can fail and holds its pool.
            prepared = _each(n, lambda i: members[i][1].prepare(members[i][0].pool.name, op, target_blocks,
                                                                  self._ttl, force, keep))
            prepared_at = time.monotonic()
            failed = next((i for i, (_, err) in enumerate(prepared) if err is not None), None)
            if failed is not None:
                aborted = _each(n, lambda i: members[i][1].abort(prepared[i][0].transaction)
                                if prepared[i][1] is None else None)
                rolled_back, stuck = [], []
                for i in range(n):
                    if prepared[i][1] is not None:
                        continue
                    if aborted[i][1] is None:
                        rolled_back.append(members[i][0].rank)
                    else:  # the daemon aborts it anyway when this session closes or the ttl passes
                        stuck.append(f"rank {members[i][0].rank}: {aborted[i][1].message}")
                cause = prepared[failed][1]
                raise KvdError(cause.code, f"{what} failed on {_rank_name(members[failed][0])}: {cause.message}; "
                               f"no rank changed (prepared ranks rolled back: {_rank_list(rolled_back)})" +
                               (f"; abort failed on {'; '.join(stuck)} (the daemon aborts it at its ttl)"
                                if stuck else ""))

            # Phase 2: every daemon makes its change visible.
            if self._before_commit is not None:
                try:
                    self._before_commit()
                except BaseException:  # give the prepared memory back now, not at the ttl
                    _each(n, lambda i: members[i][1].abort(prepared[i][0].transaction))
                    raise
            committed = _each(n, lambda i: members[i][1].commit(prepared[i][0].transaction, wait))
            committed_at = time.monotonic()
            failed = next((i for i, (_, err) in enumerate(committed) if err is not None), None)
            if failed is not None:
                self._put_back(op, what, members, prepared, committed, failed)

            prepared_bytes = 0
            for i in range(n):
                prepared_bytes += prepared[i][0].prepared_bytes
                members[i][0].pool = committed[i][0].pool
            return GroupChange(op=op, ranks=[u for u, _ in committed], prepare_us=_us(prepared_at - start),
                               commit_us=_us(committed_at - prepared_at), total_us=_us(time.monotonic() - start),
                               prepared_bytes=prepared_bytes)

    def _put_back(self, op, what, members, prepared, committed, failed):
        """A commit failed: puts the committed ranks back where they were before, then raises."""
        def undo(i):
            if committed[i][1] is not None:
                return None
            client, before = members[i][1], prepared[i][0].pool
            if op == "grow":
                return client.shrink(before.name, before.committed_blocks, wait=False)
            if op == "shrink":
                return client.grow(before.name, before.committed_blocks)
            if op == "sleep":
                return client.wake(before.name)
            return client.sleep(before.name, wait=False)

        undone = _each(len(members), undo)
        restored, inconsistent = [], []
        for i, (r, _) in enumerate(members):
            if committed[i][1] is not None:
                continue
            if undone[i][1] is None:
                restored.append(r.rank)
            else:
                inconsistent.append(f"rank {r.rank} stays changed ({undone[i][1].message})")
        cause = committed[failed][1]
        where = f"{what}: commit failed on {_rank_name(members[failed][0])}: {cause.message}"
        if inconsistent:
            raise KvdError("INTERNAL", f"{where}; THE GROUP IS INCONSISTENT: {'; '.join(inconsistent)}; restored "
                           f"ranks: {_rank_list(restored)}. Check with kvctl group status {self.name}")
        raise KvdError("ABORTED", f"{where}; ranks that had committed were put back: {_rank_list(restored)}")

    # -- lifetime --------------------------------------------------------------------------------------
    def close(self):
        """Closes every rank's session (the daemons abort whatever they still hold of it). Idempotent."""
        with self._lock:
            members, self._members = self._members, []
        for _, client in members:
            client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Group({self.name!r}, ranks={[r.rank for r, _ in self._members]})"
