"""kvd: the Python client of the kvd daemon (per-GPU KV-cache memory), for vLLM/SGLang-style workers.

    import kvd
    with kvd.connect() as c:                      # $KVD_SOCKET or /run/kvd/gpu0.sock
        c.create_pool("kv", layers=32, capacity_blocks=4096, heads=8, block_tokens=16,
                      channels=128, element_bytes=2, initial_blocks=1024,
                      backend_requirements={"FLASHINFER": ["block-outermost"]},
                      connector_preferences=[("nixl", "LBNHC")],
                      group=kvd.GroupMembership("llama", rank=0, size=2))  # optional: one TP rank
        with c.attach("kv") as m:                 # maps every chunk, follows grow/shrink/sleep/wake
            k0 = m.layer(0)                       # numpy on host, __cuda_array_interface__ on CUDA

Engine groups: a coordinator resizes every rank's pool (one per daemon) or none, in two phases:

    with kvd.Group.open("llama") as g:            # every *.sock in $KVD_SOCKET_DIR or /run/kvd
        g.grow(8192)                              # each rank's Mappings follow
        g.sleep(wait=True); g.wake()

Peer access: a process on another device of the node maps a pool once it is granted:
c.grant_peer_access("kv", uuid_of_gpu1), then c.attach("kv", device=1) from that process.

The package is a binding of libkvd (its C API, libkvd_c.so, loaded with ctypes): every client behaviour is
libkvd's, and the replies are the daemon's kvd.v1 messages (kvd.v1_pb2).
"""

from ._errors import KvdError
from ._proto import pb as v1_pb2  # noqa: F401  (the generated messages, for callers that need them)
from ._client import (ByteRange, Client, CudaArray, DaemonRestart, Geometry, GroupMembership, Mapping, ReclaimRequest,
                      connect, default_socket, handles_path, layout_rule_name)
from ._group import Group, GroupChange, GroupRank, find_socket, node_sockets

__all__ = ["connect", "default_socket", "handles_path", "Client", "Mapping", "DaemonRestart", "ByteRange",
           "Geometry", "CudaArray", "KvdError", "ReclaimRequest", "v1_pb2", "GroupMembership", "Group", "GroupRank",
           "GroupChange", "node_sockets", "find_socket", "layout_rule_name"]
__version__ = "0.1.0"
