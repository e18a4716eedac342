"""The device this process maps pools from, and address-space reservation and chunk mapping, per
backend, through ctypes.

resolve_device() finds the local device (an index or UUID of this process's devices; by default the
daemon's own, found by its UUID because indices are per process), check_peer_access() says whether it
may map memory that lives on the daemon's device, and memory_for() opens the mapper for it:
HostMemory: memfd chunks mmap'ed MAP_SHARED|MAP_FIXED into a PROT_NONE anonymous reservation.
CudaMemory: cuMemAddressReserve / cuMemImportFromShareableHandle(POSIX FD) / cuMemMap /
cuMemSetAccess (for the local device) on libcuda.so.1, exercised by kvd_cuda_check.py on a GPU machine.
Mirrors kernels/device.cc (ResolveDeviceSelector) and the backends' CheckPeerAccess.
"""

import ctypes
import dataclasses
import mmap as _mmap
import os
import socket as _socket
import threading

from ._errors import KvdError

PROT_NONE = 0
PROT_READ = _mmap.PROT_READ
PROT_WRITE = _mmap.PROT_WRITE
MAP_SHARED = _mmap.MAP_SHARED
MAP_PRIVATE = _mmap.MAP_PRIVATE
MAP_ANONYMOUS = getattr(_mmap, "MAP_ANONYMOUS", 0x20)
MAP_FIXED = 0x10  # Linux, every architecture
MAP_NORESERVE = getattr(_mmap, "MAP_NORESERVE", 0x4000)
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = None


def _libc_fns():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


def _mmap_or_raise(what, addr, length, prot, flags, fd, offset):
    libc = _libc_fns()
    p = libc.mmap(addr, length, prot, flags, fd, offset)
    if p is None or p == MAP_FAILED:
        err = ctypes.get_errno()
        code = "RESOURCE_EXHAUSTED" if err in (12,) else "INTERNAL"
        raise KvdError(code, f"{what}: {os.strerror(err)} (errno {err})")
    return p


# --- which device -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LocalDevice:
    """A device of this process: its index in this process's numbering and its UUID as the daemon of
    that device reports it (GetDeviceInfo.device_uuid)."""

    index: int
    uuid: str


def _boot_id():
    """As kvd's host backend names its devices: host-<boot id>-<index> (kernels/host/host_device.cc)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        if boot:
            return boot
    except OSError:
        pass
    return _socket.gethostname() or "unknown"


def host_uuid(index):
    return f"host-{_boot_id()}-{index}"


def parse_host_uuid(uuid):
    """host-<this boot>-<N> -> N; None for anything else."""
    prefix = f"host-{_boot_id()}-"
    if len(uuid) <= len(prefix) or not uuid.lower().startswith(prefix.lower()):
        return None
    digits = uuid[len(prefix):]
    return int(digits) if digits.isascii() and digits.isdigit() else None


def _visibility_note(kind):
    names = {"cuda": ["CUDA_VISIBLE_DEVICES"]}.get(kind, [])
    note = "".join(f"; {n}={os.environ[n]}" for n in names if n in os.environ)
    return note + " limits which devices this process sees" if note else ""


def _listing(devices):
    return ", ".join(f"{d.index} {d.uuid}" for d in devices)


def _resolve_host(selector):
    family = f"host-{_boot_id()}-"
    for candidate in (selector, "host-" + selector):
        index = parse_host_uuid(candidate)
        if index is not None:
            return index
        if family.lower().startswith(candidate.lower()):  # short of the index, it names every host device
            raise KvdError("INVALID_ARGUMENT", f"device {selector}: ambiguous, every host device's UUID ({family}0, "
                           f"{family}1, ...) starts with it; add the index: {family}<N>")
    raise KvdError("NOT_FOUND", f"device {selector}: no host device has this UUID; host devices are {family}<N> "
                   "for any index N")


def _resolve_gpu(selector, devices, kind):
    vendor = {"cuda": "CUDA"}.get(kind, kind)
    if selector.isascii() and selector.isdigit():
        index = int(selector)
        if not any(d.index == index for d in devices):
            n = len(devices)
            raise KvdError("NOT_FOUND", f"device {selector}: this node has {n} {vendor} device{'' if n == 1 else 's'} "
                           f"({_listing(devices)}){_visibility_note(kind)}")
        return index

    # A UUID or a prefix of one, with or without the "GPU-" every GPU UUID starts with.
    def matches(uuid, exact):
        for u in (uuid, uuid[4:] if uuid.upper().startswith("GPU-") else None):
            if u is not None and (u.lower() == selector.lower() if exact else u.lower().startswith(selector.lower())):
                return True
        return False

    for d in devices:
        if matches(d.uuid, True):
            return d.index
    found = [d for d in devices if matches(d.uuid, False)]
    if len(found) == 1:
        return found[0].index
    if not found:
        raise KvdError("NOT_FOUND", f"device {selector}: no {vendor} device visible to this process has this UUID "
                       f"(visible: {_listing(devices)}){_visibility_note(kind)}")
    raise KvdError("INVALID_ARGUMENT", f"device {selector}: ambiguous, it starts the UUIDs of {_listing(found)}; "
                   "give more of the UUID")


def resolve_device(device_info, pb, selector=None):
    """The device this process maps from -> LocalDevice.

    selector: a device index (int or digits) or a UUID (prefix) of this process's devices of the daemon's
    backend; None: the daemon's own device, found by its UUID (indices are per process:
    CUDA_VISIBLE_DEVICES renumbers them), or by its index when the daemon reports no UUID."""
    if selector is None:
        wanted = device_info.device_uuid
        prefix = "the daemon's "
    else:
        wanted = str(selector).strip()
        prefix = "attach: "
    backend = device_info.backend
    try:
        if not wanted:
            if selector is not None:
                raise KvdError("INVALID_ARGUMENT",
                               'device "": empty; give an index (0, 1, ...) or a device UUID (prefix)')
            index = int(device_info.device_index)
        elif backend == pb.BACKEND_HOST:
            index = int(wanted) if wanted.isascii() and wanted.isdigit() else _resolve_host(wanted)
        elif backend == pb.BACKEND_CUDA:
            index = _resolve_gpu(wanted, cuda_devices(), "cuda")
        else:
            raise KvdError("UNIMPLEMENTED",
                           f"the Python client does not map {pb.Backend.Name(backend)} pools yet")
    except KvdError as e:
        if e.code == "UNIMPLEMENTED":
            raise
        raise KvdError(e.code, prefix + e.message) from None
    if backend == pb.BACKEND_HOST:
        return LocalDevice(index, host_uuid(index))
    devices = {d.index: d for d in cuda_devices()}
    if index not in devices:
        raise KvdError("NOT_FOUND", f"{prefix}device {wanted or index}: this process sees {len(devices)} CUDA devices "
                       f"({_listing(devices.values())}){_visibility_note('cuda')}")
    return devices[index]


def same_device(a, b):
    return a.lower() == b.lower()


def check_peer_access(device_info, pb, local):
    """Raises unless `local` can map memory that lives on the daemon's device (device_info.device_uuid)."""
    owner = device_info.device_uuid
    if not owner:
        raise KvdError("FAILED_PRECONDITION", f"peer access: the daemon reports no device UUID, so device "
                       f"{local.index} ({local.uuid}) cannot be checked against it")
    if same_device(owner, local.uuid):
        return
    if device_info.backend == pb.BACKEND_HOST:
        me = f"peer access: host device {local.index} ({local.uuid})"
        if parse_host_uuid(owner) is not None:
            return  # host memory is reachable from every host "device" of this boot: a memfd is a memfd
        if owner.lower().startswith("host-"):
            raise KvdError("FAILED_PRECONDITION", f"{me} cannot import memory of {owner}: that is host memory of "
                           "another machine or boot")
        raise KvdError("FAILED_PRECONDITION", f"{me} cannot import memory of device {owner}: it belongs to another "
                       "backend (host chunks are memfds)")
    if device_info.backend == pb.BACKEND_CUDA:
        _cuda_check_peer_access(local, owner)
        return
    raise KvdError("UNIMPLEMENTED", f"the Python client does not map {pb.Backend.Name(device_info.backend)} pools yet")


class HostMemory:
    """The host backend: chunk FDs are memfds, reachable from every host "device" alike."""

    kind = "host"

    def __init__(self, device=None):
        self.device = device

    def reserve(self, nbytes, alignment):
        return _mmap_or_raise(f"mmap(PROT_NONE, {nbytes} bytes)", None, nbytes, PROT_NONE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)

    def import_and_map(self, va, nbytes, fd):
        """Maps the chunk FD at va; returns a handle for unmap(). The caller closes fd."""
        return self.map_imported(va, nbytes, fd, self.import_chunk(fd))

    def import_chunk(self, fd):
        """A pause's new chunk, imported without mapping (map_imported at the RESUME, else
        release_imported): a memfd needs nothing more than its FD, which the caller keeps."""
        return None

    def map_imported(self, va, nbytes, fd, handle):
        """Maps an imported chunk at va; returns the handle for unmap()."""
        _mmap_or_raise(f"mmap(chunk fd {fd} at {va:#x}, {nbytes} bytes)", va, nbytes, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, fd, 0)
        return handle

    def release_imported(self, handle):
        pass

    def unmap(self, va, nbytes, handle):
        self.unmap_only(va, nbytes)

    def unmap_only(self, va, nbytes):
        """Unmaps without releasing the handle (release_imported later): a RESUME's remap does only this
        while the pool is paused."""
        # Put PROT_NONE anonymous memory back rather than munmap: the reservation keeps its hole.
        _mmap_or_raise(f"mmap(PROT_NONE over {va:#x}, {nbytes} bytes)", va, nbytes, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)

    def close(self):
        pass

    def free(self, va, nbytes):
        if _libc_fns().munmap(va, nbytes) != 0:
            err = ctypes.get_errno()
            raise KvdError("INTERNAL", f"munmap({va:#x}, {nbytes}): {os.strerror(err)} (errno {err})")


# --- CUDA driver API -------------------------------------------------------------------------------

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


def _uuid_text(raw):
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_cuda = None
_cuda_lock = threading.Lock()


def _cuda_check(cu, r, what):
    if r != 0:
        name = ctypes.c_char_p()
        try:
            cu.cuGetErrorString(r, ctypes.byref(name))
            text = name.value.decode() if name.value else f"CUresult {r}"
        except Exception:
            text = f"CUresult {r}"
        # CUDA_ERROR_OUT_OF_MEMORY; CUDA_ERROR_INSUFFICIENT_DRIVER and CUDA_ERROR_NO_DEVICE (no GPU visible).
        code = {2: "RESOURCE_EXHAUSTED", 35: "UNAVAILABLE", 100: "UNAVAILABLE"}.get(r, "INTERNAL")
        raise KvdError(code, f"{what}: {text} ({r})")


def _cuda_driver():
    """libcuda.so.1 with the argument types this module uses, initialised once per process."""
    global _cuda
    with _cuda_lock:
        if _cuda is not None:
            return _cuda
        try:
            cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise KvdError("FAILED_PRECONDITION",
                           f"the daemon serves a CUDA device but libcuda.so.1 does not load: {e}") from None
        u64 = ctypes.c_ulonglong
        cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.c_size_t, u64, u64]
        cu.cuMemAddressFree.argtypes = [u64, ctypes.c_size_t]
        cu.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int]
        cu.cuMemMap.argtypes = [u64, ctypes.c_size_t, ctypes.c_size_t, u64, u64]
        cu.cuMemUnmap.argtypes = [u64, ctypes.c_size_t]
        cu.cuMemRelease.argtypes = [u64]
        cu.cuMemSetAccess.argtypes = [u64, ctypes.c_size_t, ctypes.POINTER(_CUmemAccessDesc), ctypes.c_size_t]
        cu.cuDeviceCanAccessPeer.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        _cuda_check(cu, cu.cuInit(0), "cuInit")
        _cuda = cu
        return cu


def _cuda_device(cu, ordinal):
    dev = ctypes.c_int(0)
    _cuda_check(cu, cu.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
    return dev


def cuda_devices():
    """The CUDA devices this process sees -> [LocalDevice] in ordinal order."""
    cu = _cuda_driver()
    count = ctypes.c_int(0)
    _cuda_check(cu, cu.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or getattr(cu, "cuDeviceGetUuid")
    out = []
    for i in range(count.value):
        uuid = _CUuuid()
        _cuda_check(cu, get_uuid(ctypes.byref(uuid), _cuda_device(cu, i)), f"cuDeviceGetUuid({i})")
        out.append(LocalDevice(i, _uuid_text(uuid.bytes)))
    return out


def _cuda_check_peer_access(local, owner):
    me = f"peer access: CUDA device {local.index} ({local.uuid})"
    if not owner.upper().startswith("GPU-"):
        raise KvdError("FAILED_PRECONDITION", f"{me} cannot import memory of device {owner}: it belongs to another "
                       "backend (CUDA UUIDs start with GPU-)")
    cu = _cuda_driver()
    devices = cuda_devices()
    for d in devices:
        if not same_device(d.uuid, owner):
            continue
        # Whether the local device can access memory that lives on the owner: the importer is the local one.
        can = ctypes.c_int(0)
        _cuda_check(cu, cu.cuDeviceCanAccessPeer(ctypes.byref(can), _cuda_device(cu, local.index),
                                                 _cuda_device(cu, d.index)),
                    f"cuDeviceCanAccessPeer(device {local.index}, peer {d.index})")
        if not can.value:
            raise KvdError("FAILED_PRECONDITION", f"{me} has no peer access to CUDA device {d.index} ({d.uuid}) "
                           "that owns the memory (cuDeviceCanAccessPeer = 0)")
        return
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise KvdError("NOT_FOUND", f"{me}: the owner {owner} is not among the CUDA devices this process sees "
                   f"({_listing(devices)}); an importer must see "
                   "both devices: check CUDA_VISIBLE_DEVICES" + (f' (now "{env}")' if env is not None else " (unset)"))


class CudaMemory:
    """The CUDA backend on one local device, through libcuda.so.1 (the driver API; no CUDA toolkit
    needed). Chunks are imported from their FDs (they may live on another device: peer access) and
    mapped with read/write access for this device. Its primary context is made current on the
    calling thread."""

    kind = "cuda"

    def __init__(self, device):
        self._cu = _cuda_driver()
        self.device = device
        self.ordinal = device.index
        self._dev = _cuda_device(self._cu, self.ordinal)
        self._ctx = ctypes.c_void_p()
        self._check(self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), self._dev), "cuDevicePrimaryCtxRetain")

    def close(self):
        """Drops this object's reference on the device's primary context."""
        if self._ctx is not None:
            release = getattr(self._cu, "cuDevicePrimaryCtxRelease_v2", None) or self._cu.cuDevicePrimaryCtxRelease
            release(self._dev)
            self._ctx = None

    def _check(self, r, what):
        _cuda_check(self._cu, r, what)

    def _current(self):
        self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def reserve(self, nbytes, alignment):
        self._current()
        va = ctypes.c_ulonglong(0)
        self._check(self._cu.cuMemAddressReserve(ctypes.byref(va), nbytes, alignment, 0, 0),
                    f"cuMemAddressReserve({nbytes} bytes)")
        return va.value

    def import_and_map(self, va, nbytes, fd):
        handle = self.import_chunk(fd)
        try:
            return self.map_imported(va, nbytes, fd, handle)
        except BaseException:
            self.release_imported(handle)
            raise

    def import_chunk(self, fd):
        """cuMemImportFromShareableHandle(fd) -> the allocation handle (a pause's new chunk is imported at
        the PAUSE and mapped at the RESUME: map_imported, else release_imported)."""
        self._current()
        handle = ctypes.c_ulonglong(0)
        self._check(self._cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    f"cuMemImportFromShareableHandle(POSIX FD {fd})")
        return handle.value

    def map_imported(self, va, nbytes, fd, handle):
        """cuMemMap + cuMemSetAccess of an imported handle at va; on failure the handle stays the
        caller's (release_imported)."""
        self._current()
        self._check(self._cu.cuMemMap(va, nbytes, 0, handle, 0), f"cuMemMap({va:#x}, {nbytes})")
        desc = _CUmemAccessDesc(_CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal),
                                CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        r = self._cu.cuMemSetAccess(va, nbytes, ctypes.byref(desc), 1)
        if r != 0:
            self._cu.cuMemUnmap(va, nbytes)
            self._check(r, f"cuMemSetAccess({va:#x}, {nbytes}, READWRITE for device {self.ordinal})")
        return handle

    def release_imported(self, handle):
        self._current()
        self._check(self._cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")

    def unmap(self, va, nbytes, handle):
        self.unmap_only(va, nbytes)
        self._check(self._cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")

    def unmap_only(self, va, nbytes):
        self._current()
        self._check(self._cu.cuMemUnmap(va, nbytes), f"cuMemUnmap({va:#x}, {nbytes})")

    def free(self, va, nbytes):
        self._current()
        self._check(self._cu.cuMemAddressFree(va, nbytes), f"cuMemAddressFree({va:#x}, {nbytes})")


def memory_for(device_info, pb, device):
    """The mapper for pools of the daemon's backend on the local `device` (a LocalDevice)."""
    if device_info.backend == pb.BACKEND_HOST:
        return HostMemory(device)
    if device_info.backend == pb.BACKEND_CUDA:
        return CudaMemory(device)
    raise KvdError("UNIMPLEMENTED", f"the Python client does not map {pb.Backend.Name(device_info.backend)} pools yet")
