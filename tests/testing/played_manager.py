"""The service manager's side of kvd's durability, played exactly as systemd plays it (CI has no systemd
as PID 1): a notify socket ($NOTIFY_SOCKET, SOCK_DGRAM) on which the daemon says READY=1 and hands chunk
FDs over with FDSTORE=1/FDNAME= (taking them back with FDSTOREREMOVE=1), and on each start the stored FDs
passed as FDs 3.. with $LISTEN_FDS, $LISTEN_FDNAMES and $LISTEN_PID, as sd_listen_fds_with_names reads
them.

    manager = PlayedManager(directory)
    proc = manager.start([kvd, "--backend=host", ...], log_path)   # returns once READY=1 came
    manager.fds                                                    # {"c12": fd, ...}, the store
    manager.kill(signal.SIGKILL); manager.start(...)               # a crash under Restart=on-failure
"""
import array
import fcntl
import os
import select
import signal
import socket
import threading
import time

READY_TIMEOUT_S = 30


class PlayedManager:
    def __init__(self, directory):
        self.path = os.path.join(directory, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.fds = {}            # FDNAME -> FD: the store
        self.messages = []       # every notify message, in order
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.proc = None
        self._lock = threading.Lock()
        self._busy = threading.Lock()  # held from a datagram's arrival until it is handled
        self._closed = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self):
        fd_size = array.array("i").itemsize
        while not self._closed:
            try:
                if not select.select([self.sock], [], [], 0.05)[0]:
                    continue
            except (OSError, ValueError):
                return
            with self._busy:
                if not self._handle_one(fd_size):
                    return

    def _handle_one(self, fd_size):
        try:
            data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(253 * fd_size), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        received = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[:len(payload) - len(payload) % fd_size])
                received.extend(fds)
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        with self._lock:
            self.messages.append(fields)
            if fields.get("FDSTORE") == "1":
                name = fields.get("FDNAME", "stored")
                for fd in received:
                    old = self.fds.pop(name, None)  # systemd replaces an FD stored under the same name
                    if old is not None:
                        os.close(old)
                    self.fds[name] = fd
                received = []
            if fields.get("FDSTOREREMOVE") == "1":
                old = self.fds.pop(fields.get("FDNAME", ""), None)
                if old is not None:
                    os.close(old)
        for fd in received:
            os.close(fd)
        if fields.get("READY") == "1":
            self.ready.set()
        if fields.get("STOPPING") == "1":
            self.stopping.set()
        return True

    def _settle(self, timeout=5):
        """Returns once every notification already sent has been handled: systemd handles what a process
        sent before it handles the process's exit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._busy:
                if not select.select([self.sock], [], [], 0)[0]:
                    return
            time.sleep(0.002)

    def stored(self):
        """The FD store's names, sorted, once every notification already sent has been handled (kvd sends
        FDSTORE=1 before it answers the RPC that made the chunk; the receiving thread may not have run yet)."""
        self._settle()
        with self._lock:
            return sorted(self.fds)

    def start(self, argv, log_path, env=None):
        """Starts `argv` as the unit's main process with the store's FDs; waits for READY=1."""
        self.ready.clear()
        self.stopping.clear()
        with self._lock:
            names = sorted(self.fds)
            fds = [self.fds[n] for n in names]
        child_env = dict(os.environ if env is None else env)
        for key in ("LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID", "FDSTORE"):
            child_env.pop(key, None)
        child_env["NOTIFY_SOCKET"] = self.path
        if names:
            child_env["LISTEN_FDS"] = str(len(names))
            child_env["LISTEN_FDNAMES"] = ":".join(names)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        pid = os.fork()
        if pid == 0:  # the child: FDs 3.. as systemd passes them, then exec
            try:
                floor = 3 + len(fds) + 16  # every FD moved out of the way of 3.. first
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
                high_log = fcntl.fcntl(log, fcntl.F_DUPFD, floor)
                for i, fd in enumerate(high):
                    os.dup2(fd, 3 + i, inheritable=True)
                os.dup2(high_log, 1)
                os.dup2(high_log, 2)
                os.closerange(3 + len(high), 1 << 20)
                if names:
                    child_env["LISTEN_PID"] = str(os.getpid())
                os.execve(argv[0], argv, child_env)
            finally:
                os._exit(127)
        os.close(log)
        self.proc = _Child(pid)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready.wait(0.02):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd exited with {self.proc.returncode} before READY=1")
            if time.monotonic() > deadline:
                raise RuntimeError("kvd did not say READY=1")
        return self.proc

    def kill(self, sig=signal.SIGTERM, timeout=30):
        """Signals the main process and waits for it; returns its exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.kill(self.proc.pid, sig)
        rc = self.proc.wait(timeout)
        self._settle()
        return rc

    def close(self):
        """The unit is stopped for good: the store is emptied (systemd closes its FDs)."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGKILL)
        self._closed = True
        self.sock.close()
        with self._lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


class _Child:
    """A forked child, waitable like a Popen."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise TimeoutError(f"pid {self.pid} did not exit within {timeout} s")
            time.sleep(0.01)
        return self.returncode
