"""The handle channel: a SOCK_SEQPACKET Unix socket carrying sessions and chunk FDs (SCM_RIGHTS).
Mirrors client/handle_client.cc."""

import os
import select
import socket
import time

from . import _wire
from ._errors import KvdError
from ._proto import pb

MAX_REPLY_BYTES = 64 * 1024
MAX_FDS_PER_PACKET = 250


def handles_path(control_socket):
    """gpu0.sock -> gpu0.handles; anything else -> PATH.handles (_wire.handles_path_for)."""
    return _wire.handles_path_for(control_socket)


def _connect(path, timeout):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        s.close()
        raise KvdError("UNAVAILABLE", f"no kvd daemon at {path}") from None
    except PermissionError as e:
        s.close()
        raise KvdError("PERMISSION_DENIED", f"connect({path}): {e.strerror} (errno {e.errno})") from None
    except socket.timeout:
        s.close()
        raise KvdError("DEADLINE_EXCEEDED", f"connect({path}): the daemon did not accept within {timeout} s") from None
    except OSError as e:
        s.close()
        raise KvdError("UNAVAILABLE", f"connect({path}): {e.strerror} (errno {e.errno})") from None
    return s


def _close_all(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _send(s, path, request):
    try:
        s.send(request.SerializeToString())
    except socket.timeout:
        raise KvdError("DEADLINE_EXCEEDED", f"handle channel {path}: could not send") from None
    except (BrokenPipeError, ConnectionResetError):
        raise KvdError("UNAVAILABLE", f"handle channel {path}: the daemon closed the connection") from None


def _receive(s, path, deadline):
    """One packet -> (HandleChannelReply, fds). The caller owns the fds."""
    s.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        payload, fds, flags, _ = socket.recv_fds(s, MAX_REPLY_BYTES, MAX_FDS_PER_PACKET)
    except socket.timeout:
        raise KvdError("DEADLINE_EXCEEDED", f"handle channel {path}: no reply in time") from None
    except ConnectionResetError:
        raise KvdError("UNAVAILABLE", f"handle channel {path}: the daemon closed the connection") from None
    if not payload:
        _close_all(fds)
        raise KvdError("UNAVAILABLE", f"handle channel {path}: the daemon closed the connection")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        _close_all(fds)
        raise KvdError("INTERNAL", f"handle channel {path}: a reply packet was truncated")
    reply = pb.HandleChannelReply()
    try:
        reply.ParseFromString(payload)
    except Exception:  # protobuf's DecodeError
        _close_all(fds)
        raise KvdError("INTERNAL", f"handle channel {path}: reply is not a HandleChannelReply") from None
    if reply.HasField("error"):
        _close_all(fds)
        raise KvdError(reply.error.code, reply.error.message)
    return reply, fds


class HandleSession:
    """An open session: the connection stays open as the session's liveness until close()."""

    def __init__(self, path, client_name="", timeout=10.0):
        self.path = path
        self.timeout = timeout
        deadline = time.monotonic() + timeout
        self._sock = _connect(path, timeout)
        try:
            req = pb.HandleChannelRequest()
            req.open_session.client_name = client_name
            _send(self._sock, path, req)
            reply, fds = _receive(self._sock, path, deadline)
            if fds or not reply.HasField("session_opened") or not reply.session_opened.session_token:
                _close_all(fds)
                raise KvdError("INTERNAL", f"handle channel {path}: unexpected reply to OpenSession")
        except BaseException:
            self._sock.close()
            raise
        self.token = reply.session_opened.session_token
        self.uid = reply.session_opened.uid
        self.pid = reply.session_opened.pid

    def fetch(self, lease_token, timeout=None):
        """Redeems a lease on a new connection -> [(chunk_id, fd), ...]; the caller owns the FDs."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        out = []
        s = _connect(self.path, timeout)
        try:
            req = pb.HandleChannelRequest()
            req.fetch_handles.session_token = self.token
            req.fetch_handles.lease_token = lease_token
            _send(s, self.path, req)
            while True:
                reply, fds = _receive(s, self.path, deadline)
                if not reply.HasField("handle_batch") or len(fds) != len(reply.handle_batch.chunk_ids):
                    _close_all(fds)
                    raise KvdError("INTERNAL", f"handle channel {self.path}: a HandleBatch carried {len(fds)} FDs "
                                   f"for {len(reply.handle_batch.chunk_ids)} chunks")
                out.extend(zip(reply.handle_batch.chunk_ids, fds))
                if reply.handle_batch.last:
                    return out
        except BaseException:
            _close_all(fd for _, fd in out)
            raise
        finally:
            s.close()

    def alive(self):
        """Whether the session's connection is still up: False once the daemon closed it (it exited or
        restarted; its sessions do not survive) or after close(). Does not block. As libkvd's
        HandleSession::Alive."""
        sock = self._sock
        if sock is None:
            return False
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0x2000))
        # The daemon sends nothing on a session's connection after SessionOpened: anything readable is
        # its end of file.
        return not p.poll(0)

    def return_handles(self, pool, chunks, timeout=None):
        """After a daemon restart: gives the FDs of `pool`'s chunks ([(chunk_id, fd), ...], the caller's
        still) back to a RECOVERING pool, at most 250 per packet -> kvd.v1.HandlesReturned."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        chunks = list(chunks)
        s = _connect(self.path, timeout)
        try:
            i = 0
            while True:
                part = chunks[i:i + MAX_FDS_PER_PACKET]
                i += len(part)
                req = pb.HandleChannelRequest()
                r = req.return_handles
                r.session_token, r.pool, r.last = self.token, pool, i >= len(chunks)
                r.chunk_ids.extend(cid for cid, _ in part)
                try:
                    socket.send_fds(s, [req.SerializeToString()], [fd for _, fd in part])
                except (BrokenPipeError, ConnectionResetError):
                    break  # the daemon refused an earlier packet: its error follows
                except socket.timeout:
                    raise KvdError("DEADLINE_EXCEEDED", f"handle channel {self.path}: could not send") from None
                if i >= len(chunks):
                    break
            reply, fds = _receive(s, self.path, deadline)
            _close_all(fds)
            if not reply.HasField("handles_returned"):
                raise KvdError("INTERNAL", f"handle channel {self.path}: unexpected reply to ReturnHandles")
            return reply.handles_returned
        finally:
            s.close()

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None
