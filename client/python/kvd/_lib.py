"""libkvd_c, the C API of libkvd (client/include/kvd/kvd.h; docs/c_api.md), loaded with ctypes.

The package is a binding of libkvd: the follower, the reconnection, the pause protocol, the group
coordinator and the device selection are libkvd's (docs/architecture.md, Note [The Python package is a
binding of libkvd]). This module loads the library and declares each function once, in FUNCTIONS; the
other modules call them through `call` and `reply`.

The library is, in order: $KVD_LIBRARY (a path to libkvd_c.so, e.g. a build's <build>/client/libkvd_c.so),
kvd/libkvd_c.so inside this package (the assembled package, what pip installs), or libkvd_c.so.<major> on
the loader's path (an installed libkvd).
"""

import ctypes
import os

from ._errors import KvdError

API_MAJOR = 1

c_void_p, c_char_p, c_int, c_size_t = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t
c_uint32, c_int32, c_uint64, c_int64 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64
P = ctypes.POINTER


class Buffer(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("size", c_size_t)]


class Dims(ctypes.Structure):
    _fields_ = [(n, c_uint64) for n in ("layers", "capacity_blocks", "heads", "block_tokens", "channels",
                                         "element_bytes")]


class ByteRange(ctypes.Structure):
    _fields_ = [("segment", c_uint64), ("offset", c_uint64), ("bytes", c_uint64)]


class Chunk(ctypes.Structure):
    _fields_ = [("id", c_uint64), ("segment", c_uint64), ("offset", c_uint64), ("bytes", c_uint64)]


class Geometry(ctypes.Structure):
    _fields_ = [("layout", c_char_p), ("dims", Dims)] + [(n, c_uint64) for n in (
        "stride_l", "stride_b", "stride_h", "stride_n", "stride_c", "offset", "layer_stride", "block_stride",
        "segments", "segment_stride", "reserved_bytes", "granularity_bytes")]


class Restart(ctypes.Structure):
    _fields_ = [("epoch", c_uint64), ("lost_chunk_ids", P(c_uint64)), ("lost_chunk_count", c_size_t),
                ("lost_bytes", c_uint64), ("returned_chunk_ids", P(c_uint64)), ("returned_chunk_count", c_size_t),
                ("committed_blocks", c_uint64)]


class Reclaim(ctypes.Structure):
    _fields_ = [("pool", c_char_p), ("reclaim_id", c_uint64), ("bytes", c_uint64), ("deadline_unix_ms", c_int64),
                ("committed_blocks", c_uint64)]


class GroupChange(ctypes.Structure):
    _fields_ = [("op", c_int), ("rank_count", c_size_t), ("updates", P(Buffer)), ("prepare_us", c_uint64),
                ("commit_us", c_uint64), ("total_us", c_uint64), ("prepared_bytes", c_uint64)]


# The callbacks' types; ctypes takes the GIL for each call from libkvd's threads.
BLOCKS_FN = ctypes.CFUNCTYPE(None, c_void_p, c_uint64)
LOST_FN = ctypes.CFUNCTYPE(None, c_void_p, c_int, c_char_p)
RESTART_FN = ctypes.CFUNCTYPE(None, c_void_p, P(Restart))
RANGES_FN = ctypes.CFUNCTYPE(None, c_void_p, P(ByteRange), c_size_t)
RESUME_FN = ctypes.CFUNCTYPE(None, c_void_p, c_int)
BEFORE_COMMIT_FN = ctypes.CFUNCTYPE(c_int, c_void_p)
RECLAIM_FN = ctypes.CFUNCTYPE(c_int, c_void_p, P(Reclaim), c_void_p, c_size_t)  # the reason: a char[capacity]

OP_GROW, OP_SHRINK, OP_SLEEP, OP_WAKE = 1, 2, 3, 4
MAPPING_AWAKE, MAPPING_SLEEPING, MAPPING_LOST = 1, 2, 4
RECLAIM_NONE, RECLAIM_SHRINK, RECLAIM_SLEEP = 1, 2, 3

_S = P(c_void_p)  # kvd_status**, the last argument of every fallible function
_B = P(Buffer)
_OPTS = c_void_p  # every handle and option object

# name: (result, [arguments]), as kvd.h declares them. A char* the caller frees is c_void_p here.
FUNCTIONS = {
    "kvd_api_version": (c_int, []),
    "kvd_status_code": (c_int, [c_void_p]),
    "kvd_status_message": (c_char_p, [c_void_p]),
    "kvd_status_free": (None, [c_void_p]),
    "kvd_buffer_free": (None, [_B]),
    "kvd_free": (None, [c_void_p]),
    "kvd_strings_free": (None, [P(c_void_p), c_size_t]),
    "kvd_default_socket": (c_void_p, [c_int]),
    "kvd_handles_path": (c_void_p, [c_char_p]),
    "kvd_node_sockets": (c_int, [c_char_p, P(P(c_void_p)), P(c_size_t), _S]),
    "kvd_find_socket": (c_int, [c_char_p, c_char_p, c_int64, P(c_void_p), _S]),
    "kvd_connect_options_create": (_OPTS, []),
    "kvd_connect_options_destroy": (None, [_OPTS]),
    "kvd_connect_options_set_socket": (None, [_OPTS, c_char_p]),
    "kvd_connect_options_set_client_name": (None, [_OPTS, c_char_p]),
    "kvd_connect_options_set_timeout_us": (None, [_OPTS, c_int64]),
    "kvd_connect_options_set_reconnect_for_us": (None, [_OPTS, c_int64]),
    "kvd_connect": (c_int, [_OPTS, P(c_void_p), _S]),
    "kvd_client_close": (None, [c_void_p]),
    "kvd_client_socket": (c_char_p, [c_void_p]),
    "kvd_client_device_info": (c_int, [c_void_p, _B, _S]),
    "kvd_client_list_pools": (c_int, [c_void_p, _B, _S]),
    "kvd_client_get_pool": (c_int, [c_void_p, c_char_p, _B, _S]),
    "kvd_pool_options_create": (_OPTS, [c_char_p]),
    "kvd_pool_options_destroy": (None, [_OPTS]),
    "kvd_pool_options_set_dims": (None, [_OPTS, P(Dims)]),
    "kvd_pool_options_set_initial_blocks": (None, [_OPTS, c_uint64]),
    "kvd_pool_options_set_override_layout": (None, [_OPTS, c_char_p]),
    "kvd_pool_options_add_backend_requirement": (None, [_OPTS, c_char_p, P(c_char_p), c_size_t]),
    "kvd_pool_options_set_env_layout": (None, [_OPTS, c_char_p]),
    "kvd_pool_options_add_connector_preference": (None, [_OPTS, c_char_p, c_char_p]),
    "kvd_pool_options_add_allowed_uid": (None, [_OPTS, c_uint32]),
    "kvd_pool_options_set_group": (None, [_OPTS, c_char_p, c_uint32, c_uint32]),
    "kvd_pool_options_add_peer_device": (None, [_OPTS, c_char_p]),
    "kvd_policy_options_create": (_OPTS, []),
    "kvd_policy_options_destroy": (None, [_OPTS]),
    "kvd_policy_options_set_priority": (None, [_OPTS, c_uint32]),
    "kvd_policy_options_set_min_bytes": (None, [_OPTS, c_uint64]),
    "kvd_policy_options_set_max_bytes": (None, [_OPTS, c_uint64]),
    "kvd_policy_options_set_reclaim_timeout_us": (None, [_OPTS, c_int64]),
    "kvd_policy_options_set_on_reclaim_timeout": (None, [_OPTS, c_int]),
    "kvd_pool_options_set_policy": (None, [_OPTS, _OPTS]),
    "kvd_client_create_pool": (c_int, [c_void_p, _OPTS, _B, _S]),
    "kvd_client_resolve_layout": (c_int, [c_void_p, _OPTS, _B, _S]),
    "kvd_change_options_create": (_OPTS, []),
    "kvd_change_options_destroy": (None, [_OPTS]),
    "kvd_change_options_set_wait": (None, [_OPTS, c_int]),
    "kvd_change_options_set_force": (None, [_OPTS, c_int]),
    "kvd_change_options_set_keep": (None, [_OPTS, c_int]),
    "kvd_change_options_set_whole_chunks_only": (None, [_OPTS, c_int]),
    "kvd_change_options_set_live_blocks": (None, [_OPTS, P(c_uint64), c_size_t]),
    "kvd_change_options_set_pause_timeout_us": (None, [_OPTS, c_int64]),
    "kvd_change_options_set_detach_unresponsive": (None, [_OPTS, c_int]),
    "kvd_change_options_set_max_chunks_per_pause": (None, [_OPTS, c_uint32]),
    "kvd_client_grow": (c_int, [c_void_p, c_char_p, c_uint64, _B, _S]),
    "kvd_client_grow_waiting": (c_int, [c_void_p, c_char_p, c_uint64, c_int64, _B, _S]),
    "kvd_client_shrink": (c_int, [c_void_p, c_char_p, c_uint64, _OPTS, _B, _S]),
    "kvd_client_compact": (c_int, [c_void_p, c_char_p, _OPTS, _B, _S]),
    "kvd_client_sleep": (c_int, [c_void_p, c_char_p, _OPTS, _B, _S]),
    "kvd_client_wake": (c_int, [c_void_p, c_char_p, _B, _S]),
    "kvd_client_wake_waiting": (c_int, [c_void_p, c_char_p, c_int64, _B, _S]),
    "kvd_client_delete_pool": (c_int, [c_void_p, c_char_p, _OPTS, _B, _S]),
    "kvd_client_grant_peer_access": (c_int, [c_void_p, c_char_p, c_char_p, c_int, _B, _S]),
    "kvd_client_get_metadata": (c_int, [c_void_p, c_char_p, _B, _S]),
    "kvd_client_set_metadata": (c_int, [c_void_p, c_char_p, c_uint64, c_char_p, c_size_t, _B, _S]),
    "kvd_client_set_pool_policy": (c_int, [c_void_p, c_char_p, _OPTS, _B, _S]),
    "kvd_client_report_usage": (c_int, [c_void_p, c_char_p, c_uint64, c_uint64, c_uint64, _B, _S]),
    "kvd_client_decline_reclaim": (c_int, [c_void_p, c_char_p, c_uint64, c_char_p, _B, _S]),
    "kvd_client_shrink_for_reclaim": (c_int, [c_void_p, c_char_p, c_uint64, P(c_uint64), c_size_t, _OPTS, _B, _S]),
    "kvd_client_describe_transfer": (c_int, [c_void_p, c_char_p, P(c_uint64), c_size_t, _B, _S]),
    "kvd_client_export_ranges": (c_int, [c_void_p, c_char_p, P(ByteRange), c_size_t, _B, P(P(c_int)),
                                         P(c_size_t), _S]),
    "kvd_client_zero_blocks": (c_int, [c_void_p, c_char_p, P(c_uint64), c_size_t, _B, _S]),
    "kvd_client_copy_blocks": (c_int, [c_void_p, c_char_p, P(c_uint64), c_size_t, _B, _S]),
    "kvd_client_prepare": (c_int, [c_void_p, c_char_p, c_int, c_uint64, c_int64, c_int, c_int, _B, _S]),
    "kvd_client_commit": (c_int, [c_void_p, c_char_p, c_int, _B, _S]),
    "kvd_client_abort": (c_int, [c_void_p, c_char_p, _B, _S]),
    "kvd_client_call": (c_int, [c_void_p, c_char_p, c_char_p, c_size_t, c_int64, _B, _S]),
    "kvd_client_fetch_lease": (c_int, [c_void_p, c_char_p, P(P(c_uint64)), P(P(c_int)), P(c_size_t), _S]),
    "kvd_client_session": (c_int, [c_void_p, P(c_void_p), P(c_uint32), P(c_int32), _S]),
    "kvd_attach_options_create": (_OPTS, []),
    "kvd_attach_options_destroy": (None, [_OPTS]),
    "kvd_attach_options_set_client_name": (None, [_OPTS, c_char_p]),
    "kvd_attach_options_set_device": (None, [_OPTS, c_char_p]),
    "kvd_attach_options_set_on_grow": (None, [_OPTS, BLOCKS_FN]),
    "kvd_attach_options_set_on_release": (None, [_OPTS, BLOCKS_FN]),
    "kvd_attach_options_set_on_lost": (None, [_OPTS, LOST_FN]),
    "kvd_attach_options_set_on_restart": (None, [_OPTS, RESTART_FN]),
    "kvd_attach_options_set_on_pause": (None, [_OPTS, RANGES_FN]),
    "kvd_attach_options_set_on_resume": (None, [_OPTS, RESUME_FN]),
    "kvd_attach_options_set_on_reclaim": (None, [_OPTS, RECLAIM_FN]),
    "kvd_client_attach": (c_int, [c_void_p, c_char_p, _OPTS, P(c_void_p), _S]),
    "kvd_mapping_close": (None, [c_void_p]),
    "kvd_mapping_base": (c_void_p, [c_void_p]),
    "kvd_mapping_geometry": (P(Geometry), [c_void_p]),
    "kvd_mapping_layout": (c_int, [c_void_p, _B]),
    "kvd_mapping_pool": (c_char_p, [c_void_p]),
    "kvd_mapping_client_id": (c_void_p, [c_void_p]),
    "kvd_mapping_epoch": (c_uint64, [c_void_p]),
    "kvd_mapping_committed_blocks": (c_uint64, [c_void_p]),
    "kvd_mapping_state": (c_int, [c_void_p]),
    "kvd_mapping_pool_state": (c_int, [c_void_p]),
    "kvd_mapping_chunks": (c_size_t, [c_void_p, P(Chunk), c_size_t]),
    "kvd_mapping_device_backend": (c_char_p, [c_void_p]),
    "kvd_mapping_device_index": (c_int, [c_void_p]),
    "kvd_mapping_device_uuid": (c_char_p, [c_void_p]),
    "kvd_mapping_events": (c_uint64, [c_void_p]),
    "kvd_mapping_pauses": (c_uint64, [c_void_p]),
    "kvd_mapping_resumes": (c_uint64, [c_void_p]),
    "kvd_group_options_create": (_OPTS, []),
    "kvd_group_options_destroy": (None, [_OPTS]),
    "kvd_group_options_set_client_name": (None, [_OPTS, c_char_p]),
    "kvd_group_options_set_timeout_us": (None, [_OPTS, c_int64]),
    "kvd_group_options_set_ttl_us": (None, [_OPTS, c_int64]),
    "kvd_group_options_set_before_commit": (None, [_OPTS, BEFORE_COMMIT_FN, c_void_p]),
    "kvd_group_open": (c_int, [c_char_p, P(c_char_p), c_size_t, _OPTS, P(c_void_p), _S]),
    "kvd_group_close": (None, [c_void_p]),
    "kvd_group_rank_count": (c_size_t, [c_void_p]),
    "kvd_group_rank_socket": (c_char_p, [c_void_p, c_size_t]),
    "kvd_group_rank_device_uuid": (c_char_p, [c_void_p, c_size_t]),
    "kvd_group_rank_pool": (c_int, [c_void_p, c_size_t, _B, _S]),
    "kvd_group_refresh": (c_int, [c_void_p, _S]),
    "kvd_group_change_free": (None, [P(GroupChange)]),
    "kvd_group_grow": (c_int, [c_void_p, c_uint64, P(P(GroupChange)), _S]),
    "kvd_group_shrink": (c_int, [c_void_p, c_uint64, c_int, c_int, P(P(GroupChange)), _S]),
    "kvd_group_sleep": (c_int, [c_void_p, c_int, c_int, c_int, P(P(GroupChange)), _S]),
    "kvd_group_wake": (c_int, [c_void_p, P(P(GroupChange)), _S]),
}


def _open():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libkvd_c.so")
    candidates = [os.environ["KVD_LIBRARY"]] if os.environ.get("KVD_LIBRARY") else []
    candidates += [here] if os.path.exists(here) else []
    candidates.append(f"libkvd_c.so.{API_MAJOR}")
    errors = []
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise ImportError("kvd: libkvd_c (the C API of libkvd) does not load: " + "; ".join(errors) +
                      ". Use the assembled package (cmake --build BUILD --target kvd_python; then "
                      "BUILD/client/python/package on sys.path) or set KVD_LIBRARY=BUILD/client/libkvd_c.so")


def _declare(lib):
    for name, (result, arguments) in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = result, arguments
    version = lib.kvd_api_version()
    if version // 1000 != API_MAJOR:
        raise ImportError(f"kvd: libkvd_c has C API version {version // 1000}.{version % 1000}, this package "
                          f"speaks {API_MAJOR}.x")
    return lib


lib = _declare(_open())


def text(s):
    """A str (or None) as the C API takes it."""
    return None if s is None else str(s).encode()


def take_string(p):
    """A char* the API allocated -> str, freed."""
    try:
        return ctypes.string_at(p).decode() if p else ""
    finally:
        lib.kvd_free(p)


def error_of(status, code):
    try:
        message = lib.kvd_status_message(status).decode(errors="replace") if status else ""
    finally:
        lib.kvd_status_free(status)
    return KvdError(code, message)


def call(fn, *args):
    """fn(*args, &status); raises KvdError with the call's code and message."""
    status = c_void_p()
    code = fn(*args, ctypes.byref(status))
    if code != 0:
        raise error_of(status, code)


def reply(message_type, fn, *args):
    """fn(*args, &buffer, &status) -> the reply as a `message_type` (a kvd.v1 message class)."""
    buffer = Buffer()
    call(fn, *args, ctypes.byref(buffer))
    try:
        return message_type.FromString(ctypes.string_at(buffer.data, buffer.size))
    finally:
        lib.kvd_buffer_free(ctypes.byref(buffer))


def take_buffer(buffer):
    """A Buffer the API filled -> bytes (without freeing it)."""
    return ctypes.string_at(buffer.data, buffer.size) if buffer.size else b""


def us(seconds):
    """Seconds (a float) -> whole microseconds, as the C API takes durations."""
    return int(round(float(seconds) * 1e6))


def u64_array(values):
    values = [int(v) for v in values]
    return (c_uint64 * max(len(values), 1))(*values), len(values)


class Options:
    """An option object of the C API (kvd_<kind>_options), destroyed when the `with` block ends."""

    def __init__(self, kind, *args):
        self._kind = kind
        self.handle = getattr(lib, f"kvd_{kind}_options_create")(*args)

    def set(self, what, *args):
        getattr(lib, f"kvd_{self._kind}_options_{what}")(self.handle, *args)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        getattr(lib, f"kvd_{self._kind}_options_destroy")(self.handle)
