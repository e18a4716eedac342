"""kvd.torch: a torch.cuda.MemPool whose allocations are kvd pools (docs/engines.md, "A bare torch engine").

    import torch, kvd.torch
    alloc = kvd.torch.KvdAllocator(prefix="llama-r0")     # the kvd of torch's current GPU, found by its UUID
    with alloc.allocating():                              # torch.cuda.use_mem_pool(alloc.mem_pool())
        kv = torch.empty(n_bytes, dtype=torch.int8, device="cuda")
    if not alloc.adopted(kv):                             # re-attached after an engine restart: the bytes are kept
        kv.zero_()
    alloc.sleep(); alloc.wake()                           # the memory goes back to kvd, and comes back zeroed

Every allocation torch's caching allocator makes for the pool is one kvd pool "<prefix>-<n>" (n counting this
process's allocations from 0), mapped by the allocator of libkvd_c.so (client/torch/kvd_torch_alloc.h; the package's
own library) through its own kvd session: other processes can attach it, kvd keeps it across its own restarts, and a new engine process that allocates
the same sizes in the same order under the same prefix adopts the same memory with its bytes
(Note [Re-attaching an allocation]). Code that zeroes what it allocates (torch.zeros) would wipe an adopted cache;
`keep_adopted()` makes torch.zeros under it leave adopted memory as it is.

The library holds one allocator per process (one prefix, one kvd, one device); a second KvdAllocator reconfigures
it, which is refused while allocations are live. Only the torch parts (mem_pool, allocating, keep_adopted) import
torch; the rest is ctypes over the library and runs anywhere the library loads (the host backend's tests use it).
"""

import collections
import contextlib
import ctypes
import threading

from . import KvdError, find_socket
from ._lib import lib as _c_api

MALLOC_FN, FREE_FN = "kvd_torch_malloc", "kvd_torch_free"
KEEP_ON_FREE = 1

# One allocation as kvd_torch_list reports it. state: "awake", "sleeping" or "lost".
Allocation = collections.namedtuple("Allocation", "pool base size capacity_bytes committed_bytes adopted state")
_STATES = {0: "awake", 1: "sleeping", 2: "lost"}


class _Entry(ctypes.Structure):
    _fields_ = [("pool", ctypes.c_char * 64), ("base", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("capacity_bytes", ctypes.c_uint64), ("committed_bytes", ctypes.c_uint64), ("adopted", ctypes.c_int),
                ("state", ctypes.c_int)]


_PAUSE_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
_RESUME_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int)

_lib = None
_lib_path = None
_lib_lock = threading.Lock()


def library_path():
    """The allocator's library: the package's own libkvd_c.so (kvd._lib: $KVD_LIBRARY, else beside the package),
    which torch's CUDAPluggableAllocator loads again by this path (the same library, already loaded)."""
    return _c_api._name


def _library():
    global _lib, _lib_path
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = library_path()
        lib = ctypes.CDLL(path)  # loaded already, as the package's library
        vp, u64 = ctypes.c_void_p, ctypes.c_uint64
        for name, res, args in [("kvd_torch_configure", ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]),
                                ("kvd_torch_set_pause_hooks", ctypes.c_int, [_PAUSE_HOOK, _RESUME_HOOK, vp]),
                                (MALLOC_FN, vp, [ctypes.c_ssize_t, ctypes.c_int, vp]),
                                (FREE_FN, None, [vp, ctypes.c_ssize_t, ctypes.c_int, vp]),
                                ("kvd_torch_adopted", ctypes.c_int, [vp]),
                                ("kvd_torch_list", ctypes.c_int, [ctypes.POINTER(_Entry), ctypes.c_int]),
                                ("kvd_torch_sleep", ctypes.c_int, [vp]), ("kvd_torch_wake", ctypes.c_int, [vp]),
                                ("kvd_torch_resize", ctypes.c_int, [vp, u64]), ("kvd_torch_compact", ctypes.c_int, [vp]),
                                ("kvd_torch_last_error", ctypes.c_char_p, [])]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _lib, _lib_path = lib, path
        return lib


def _error():
    """The library's last error on this thread as a KvdError (its text is "CODE: message")."""
    text = (_library().kvd_torch_last_error() or b"").decode(errors="replace")
    code, sep, message = text.partition(": ")
    if not sep or not code.isupper():
        return KvdError("UNKNOWN", text or "kvd.torch: the allocator failed without saying why")
    return KvdError(code, message)


def _check(rc):
    if rc != 0:
        raise _error()


def _address(where):
    """A tensor (its data pointer), an int address, or None (every allocation)."""
    if where is None:
        return None
    ptr = getattr(where, "data_ptr", None)
    return int(ptr()) if callable(ptr) else int(where)


class KvdAllocator:
    """The process's kvd allocator, configured for `prefix` on one kvd.

    socket: the kvd's gRPC socket; None: the kvd serving `device` (a device UUID or prefix, found with
    kvd.find_socket among $KVD_SOCKET_DIR's daemons) or, with neither, the kvd of torch's current CUDA device found by
    its UUID when torch sees one, else $KVD_SOCKET / /run/kvd/gpu<device>.sock.
    keep_on_free: torch freeing an allocation (empty_cache, the pool's end) keeps its kvd pool for the next process to
    adopt; by default the pool is deleted then.
    on_pause(pool) / on_resume(pool, applied): pause hooks (docs/integrating.md, "What the pause hook must do"); with
    them every allocation is pausable, so kvd pauses the engine before another session's sleep, shrink, compaction
    or forced delete of it. on_pause must stop every use of the memory (hold the engine's loop, then
    torch.cuda.synchronize()) before returning. Without them other sessions' releases of these pools are refused
    (FAILED_PRECONDITION naming this process) unless forced."""

    def __init__(self, prefix, socket=None, device=None, keep_on_free=False, on_pause=None, on_resume=None):
        if (on_pause is None) != (on_resume is None):
            raise KvdError("INVALID_ARGUMENT", "on_pause and on_resume: give both or neither")
        lib = _library()
        self.prefix = prefix
        self.socket = socket if socket is not None else _socket_for(device)
        self._pool = None
        self._hooks = None
        _check(lib.kvd_torch_configure((self.socket or "").encode(), str(prefix).encode(),
                                       KEEP_ON_FREE if keep_on_free else 0))
        if on_pause is not None:
            def pause(_, pool):
                on_pause(pool.decode())

            def resume(_, pool, applied):
                on_resume(pool.decode(), bool(applied))

            self._hooks = (_PAUSE_HOOK(pause), _RESUME_HOOK(resume))  # referenced for the library's lifetime
        else:
            self._hooks = (_PAUSE_HOOK(), _RESUME_HOOK())
        _check(lib.kvd_torch_set_pause_hooks(self._hooks[0], self._hooks[1], None))

    # -- the allocator's entry points, as torch calls them (also for engines that manage raw memory) --------------
    def malloc(self, size, device=0):
        """One allocation of `size` bytes -> its address (int). Raises KvdError with the library's reason."""
        p = _library().kvd_torch_malloc(int(size), int(device), None)
        if not p:
            raise _error()
        return p

    def free(self, address):
        """Gives an allocation back (deletes its pool unless keep_on_free)."""
        lib = _library()
        lib.kvd_torch_free(int(address), 0, 0, None)
        if lib.kvd_torch_last_error():
            raise _error()

    # -- what there is ------------------------------------------------------------------------------------------
    def allocations(self):
        """[Allocation] in allocation order."""
        lib = _library()
        n = lib.kvd_torch_list(None, 0)
        entries = (_Entry * max(n, 1))()
        n = min(n, lib.kvd_torch_list(entries, n))
        return [Allocation(e.pool.decode(), e.base, e.size, e.capacity_bytes, e.committed_bytes, bool(e.adopted),
                           _STATES.get(e.state, "unknown")) for e in entries[:n]]

    def adopted(self, where):
        """Whether the allocation holding `where` (a tensor or an address) was adopted with its previous owner's
        bytes (Note [Re-attaching an allocation]). NOT_FOUND when no allocation of this allocator holds it."""
        rc = _library().kvd_torch_adopted(_address(where))
        if rc < 0:
            raise KvdError("NOT_FOUND", f"kvd.torch: {_address(where):#x} is in no allocation of prefix {self.prefix}")
        return rc == 1

    # -- resizing, through the allocator's own session ----------------------------------------------------------
    def sleep(self, where=None):
        """Releases the memory of one allocation (`where`: a tensor or an address inside it) or of all; returns
        once it is released. The tensors keep their addresses; touching them before wake() faults."""
        _check(_library().kvd_torch_sleep(_address(where)))

    def wake(self, where=None):
        """Backs the memory again, at the same addresses, zeroed."""
        _check(_library().kvd_torch_wake(_address(where)))

    def resize(self, where, nbytes):
        """Backs exactly the first `nbytes` (rounded up to the granularity) of one allocation: less releases its
        tail (an exact shrink), more grows it back, up to its capacity."""
        _check(_library().kvd_torch_resize(_address(where), int(nbytes)))

    def compact(self, where=None):
        """Rewrites an allocation grown in steps as one chunk (docs/api.md, "Pauses and reshaping")."""
        _check(_library().kvd_torch_compact(_address(where)))

    # -- torch ----------------------------------------------------------------------------------------------------
    def mem_pool(self):
        """The torch.cuda.MemPool over this allocator (one per KvdAllocator)."""
        if self._pool is None:
            import torch  # noqa: PLC0415
            allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, MALLOC_FN, FREE_FN)
            self._pool = torch.cuda.MemPool(allocator.allocator())
        return self._pool

    @contextlib.contextmanager
    def allocating(self, keep_adopted=True):
        """torch.cuda.use_mem_pool(self.mem_pool()): what torch allocates on the current device inside is kvd
        memory. keep_adopted: torch.zeros inside leaves adopted memory as it is (keep_adopted())."""
        import torch  # noqa: PLC0415
        with torch.cuda.use_mem_pool(self.mem_pool()):
            if keep_adopted:
                with self.keep_adopted():
                    yield self
            else:
                yield self

    def keep_adopted(self):
        """A torch dispatch mode under which torch.zeros (and zeros_like, new_zeros) allocate as torch.empty does
        and zero the result only when it is not in adopted memory: an engine that zeroes its KV cache at
        allocation (vLLM, SGLang) keeps what a re-attach adopted. Every other operation runs as it is."""
        return _keep_adopted_mode(self)


def _socket_for(device):
    if device is not None:
        return find_socket(str(device))
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return find_socket(text if text.upper().startswith("GPU-") else "GPU-" + text)


def _keep_adopted_mode(allocator):
    import torch  # noqa: PLC0415
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415
    aten = torch.ops.aten
    zeros = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}

    class KeepAdopted(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func not in zeros:
                return func(*args, **kwargs)
            if func is aten.zeros.default:
                out = aten.empty.memory_format(*args, **kwargs)
            elif func is aten.zeros_like.default:
                out = aten.empty_like.default(*args, **kwargs)
            else:
                out = aten.new_empty.default(*args, **kwargs)
            if out.device.type != "cuda" or out.numel() == 0 or _library().kvd_torch_adopted(out.data_ptr()) != 1:
                out.zero_()
            return out

    return KeepAdopted()
