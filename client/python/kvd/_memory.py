"""Address-space reservation and chunk mapping for one pool, per backend, through ctypes.

HostMemory: memfd chunks mmap'ed MAP_SHARED|MAP_FIXED into a PROT_NONE anonymous reservation.
CudaMemory: cuMemAddressReserve / cuMemImportFromShareableHandle(POSIX FD) / cuMemMap /
cuMemSetAccess on libcuda.so.1 (untested on this CPU-only host; exercised on the GPU machine).
"""

import ctypes
import ctypes.util
import mmap as _mmap
import os

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


class HostMemory:
    """The host backend: chunk FDs are memfds."""

    kind = "host"

    def __init__(self, device_info=None):
        pass

    def reserve(self, nbytes, alignment):
        return _mmap_or_raise(f"mmap(PROT_NONE, {nbytes} bytes)", None, nbytes, PROT_NONE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)

    def import_and_map(self, va, nbytes, fd):
        """Maps the chunk FD at va; returns a handle for unmap(). The caller closes fd."""
        _mmap_or_raise(f"mmap(chunk fd {fd} at {va:#x}, {nbytes} bytes)", va, nbytes, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, fd, 0)
        return None

    def unmap(self, va, nbytes, handle):
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


class CudaMemory:
    """The CUDA backend, through libcuda.so.1 (the driver API; no CUDA toolkit needed).

    The device is the one whose UUID is the daemon's (so CUDA_VISIBLE_DEVICES renumbering is fine),
    else ordinal `device_info.device_index`. Its primary context is made current on the calling thread."""

    kind = "cuda"

    def __init__(self, device_info):
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise KvdError("FAILED_PRECONDITION", f"the daemon serves a CUDA device but libcuda.so.1 does not load: {e}")
        cu = self._cu
        u64 = ctypes.c_ulonglong
        cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.c_size_t, u64, u64]
        cu.cuMemAddressFree.argtypes = [u64, ctypes.c_size_t]
        cu.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int]
        cu.cuMemMap.argtypes = [u64, ctypes.c_size_t, ctypes.c_size_t, u64, u64]
        cu.cuMemUnmap.argtypes = [u64, ctypes.c_size_t]
        cu.cuMemRelease.argtypes = [u64]
        cu.cuMemSetAccess.argtypes = [u64, ctypes.c_size_t, ctypes.POINTER(_CUmemAccessDesc), ctypes.c_size_t]
        self._check(cu.cuInit(0), "cuInit")
        count = ctypes.c_int(0)
        self._check(cu.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        want = getattr(device_info, "device_uuid", "")
        self.ordinal = None
        get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or getattr(cu, "cuDeviceGetUuid", None)
        for i in range(count.value):
            dev = ctypes.c_int(0)
            uuid = _CUuuid()
            if cu.cuDeviceGet(ctypes.byref(dev), i) == 0 and get_uuid is not None and \
                    get_uuid(ctypes.byref(uuid), dev) == 0 and _uuid_text(uuid.bytes) == want:
                self.ordinal = i
                break
        if self.ordinal is None:
            self.ordinal = int(getattr(device_info, "device_index", 0))
        if self.ordinal >= count.value:
            raise KvdError("FAILED_PRECONDITION", f"CUDA device {want or self.ordinal} is not visible to this process "
                           f"({count.value} visible; check CUDA_VISIBLE_DEVICES)")
        self._dev = ctypes.c_int(0)
        self._check(cu.cuDeviceGet(ctypes.byref(self._dev), self.ordinal), f"cuDeviceGet({self.ordinal})")
        self._ctx = ctypes.c_void_p()
        self._check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), self._dev), "cuDevicePrimaryCtxRetain")

    def close(self):
        """Drops this object's reference on the device's primary context."""
        if self._ctx is not None:
            release = getattr(self._cu, "cuDevicePrimaryCtxRelease_v2", None) or self._cu.cuDevicePrimaryCtxRelease
            release(self._dev)
            self._ctx = None

    def _check(self, r, what):
        if r != 0:
            name = ctypes.c_char_p()
            try:
                self._cu.cuGetErrorString(r, ctypes.byref(name))
                text = name.value.decode() if name.value else f"CUresult {r}"
            except Exception:
                text = f"CUresult {r}"
            code = "RESOURCE_EXHAUSTED" if r == 2 else "INTERNAL"
            raise KvdError(code, f"{what}: {text} ({r})")

    def _current(self):
        self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def reserve(self, nbytes, alignment):
        self._current()
        va = ctypes.c_ulonglong(0)
        self._check(self._cu.cuMemAddressReserve(ctypes.byref(va), nbytes, alignment, 0, 0),
                    f"cuMemAddressReserve({nbytes} bytes)")
        return va.value

    def import_and_map(self, va, nbytes, fd):
        self._current()
        handle = ctypes.c_ulonglong(0)
        self._check(self._cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    f"cuMemImportFromShareableHandle(POSIX FD {fd})")
        try:
            self._check(self._cu.cuMemMap(va, nbytes, 0, handle, 0), f"cuMemMap({va:#x}, {nbytes})")
            desc = _CUmemAccessDesc(_CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal),
                                    CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            r = self._cu.cuMemSetAccess(va, nbytes, ctypes.byref(desc), 1)
            if r != 0:
                self._cu.cuMemUnmap(va, nbytes)
                self._check(r, f"cuMemSetAccess({va:#x}, {nbytes}, READWRITE)")
        except BaseException:
            self._cu.cuMemRelease(handle)
            raise
        return handle.value

    def unmap(self, va, nbytes, handle):
        self._current()
        self._check(self._cu.cuMemUnmap(va, nbytes), f"cuMemUnmap({va:#x}, {nbytes})")
        self._check(self._cu.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")

    def free(self, va, nbytes):
        self._current()
        self._check(self._cu.cuMemAddressFree(va, nbytes), f"cuMemAddressFree({va:#x}, {nbytes})")


def memory_for(device_info, pb):
    if device_info.backend == pb.BACKEND_HOST:
        return HostMemory(device_info)
    if device_info.backend == pb.BACKEND_CUDA:
        return CudaMemory(device_info)
    raise KvdError("UNIMPLEMENTED", f"the Python client does not map {pb.Backend.Name(device_info.backend)} pools yet")
