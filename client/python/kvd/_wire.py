"""kvd's wire conventions beside the proto: socket paths, the session metadata key, environment variables.

The Python copy of proto/kvd/wire.h, which the daemon, libkvd and kvctl use; every other module of this
package takes these names from here. tests/client/python/wire_test.py compares both, value by value and
for a table of inputs, and fails when they disagree.
"""

import os

# Where a node's kvds put their sockets, one pair per device: gpu<N>.sock and gpu<N>.handles.
DEFAULT_SOCKET_DIR = "/run/kvd"
SOCKET_PREFIX = "gpu"
# The gRPC socket's suffix; every *.sock in the socket directory is taken to be a kvd.
SOCKET_SUFFIX = ".sock"
# The handle channel's suffix: it replaces SOCKET_SUFFIX, or is appended to any other path.
HANDLES_SUFFIX = ".handles"

# gRPC metadata carrying the session token on every session RPC.
SESSION_METADATA_KEY = "kvd-session"

# Environment: a client's gRPC socket, the directory of a node's sockets, the KV-cache layout (rule 3).
SOCKET_ENV = "KVD_SOCKET"
SOCKET_DIR_ENV = "KVD_SOCKET_DIR"
LAYOUT_ENV = "KVD_KV_CACHE_LAYOUT"
# A DRA claim-scoped IPC directory (kubernetes-sigs/dra-driver-nvidia-gpu#1391); where set it replaces
# DEFAULT_SOCKET_DIR for the daemon and its clients.
DRA_IPC_DIR_ENV = "NVIDIA_DRA_LOCAL_IPC_DIR"


def default_socket(device, directory=DEFAULT_SOCKET_DIR):
    """"<directory>/gpu<device>.sock"."""
    return f"{directory}/{SOCKET_PREFIX}{device}{SOCKET_SUFFIX}"


def handles_path_for(socket):
    """The handle channel beside a gRPC socket: X.sock -> X.handles; any other path -> PATH.handles."""
    if len(socket) > len(SOCKET_SUFFIX) and socket.endswith(SOCKET_SUFFIX):
        return socket[: -len(SOCKET_SUFFIX)] + HANDLES_SUFFIX
    return socket + HANDLES_SUFFIX


def is_socket_name(file_name):
    """Whether a file name in the socket directory names a kvd's gRPC socket."""
    return file_name.endswith(SOCKET_SUFFIX)


def default_socket_dir_from_environment():
    """$NVIDIA_DRA_LOCAL_IPC_DIR if set and not empty, else DEFAULT_SOCKET_DIR."""
    return os.environ.get(DRA_IPC_DIR_ENV) or DEFAULT_SOCKET_DIR


def socket_from_environment(device):
    """$KVD_SOCKET if set and not empty, else default_socket(device, default_socket_dir_from_environment())."""
    return os.environ.get(SOCKET_ENV) or default_socket(device, default_socket_dir_from_environment())


def socket_dir_from_environment():
    """$KVD_SOCKET_DIR if set and not empty, else default_socket_dir_from_environment()."""
    return os.environ.get(SOCKET_DIR_ENV) or default_socket_dir_from_environment()
