// The wire conventions of kvd beside the wire contract (proto/kvd/v1/kvd.proto): the names a daemon
// and its clients must agree on that are not messages — where the sockets are, how the handle channel
// is found from the gRPC socket, the session metadata key and the environment variables. The daemon
// (daemon/main.cc, daemon/rpc/), libkvd, kvctl, the benches and the probe take them from here; the
// Python package keeps its copy in client/python/kvd/_wire.py, and tests/client/python/wire_test.py
// (with tests/client/kvd_wire_dump.cc) fails when the two disagree. docs/api.md, "Sockets".
//
// Everything here is a constant or a pure function of its arguments and the process environment;
// safe from any thread.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace kvd::wire {

// The constants are NUL-terminated so that getenv() and gRPC take them as they are.

// Where a node's kvds put their sockets, one pair per device: gpu<N>.sock and gpu<N>.handles.
inline constexpr char kDefaultSocketDir[] = "/run/kvd";
inline constexpr char kSocketPrefix[] = "gpu";
// The gRPC socket's suffix; every *.sock in the socket directory is taken to be a kvd.
inline constexpr char kSocketSuffix[] = ".sock";
// The handle channel's suffix: it replaces kSocketSuffix, or is appended to any other path.
inline constexpr char kHandlesSuffix[] = ".handles";

// gRPC metadata carrying the session token (SessionOpened.session_token) on every session RPC.
inline constexpr char kSessionMetadataKey[] = "kvd-session";

// Environment: a client's gRPC socket, the directory holding a node's sockets, and the KV-cache
// layout (rule 3 of the layout chain, read by the engine's client and by the daemon).
inline constexpr char kSocketEnv[] = "KVD_SOCKET";
inline constexpr char kSocketDirEnv[] = "KVD_SOCKET_DIR";
inline constexpr char kLayoutEnv[] = "KVD_KV_CACHE_LAYOUT";
// A DRA claim-scoped IPC directory (kubernetes-sigs/dra-driver-nvidia-gpu#1391): the NVIDIA DRA driver mounts one
// directory into every container of the pods that share a GPU claim and names it here. Where it is set, it replaces
// kDefaultSocketDir for the daemon and its clients (docs/operations.md, "Pods without hostIPC").
inline constexpr char kDraIpcDirEnv[] = "NVIDIA_DRA_LOCAL_IPC_DIR";

// "<directory>/gpu<device>.sock"; the default socket of device N is "/run/kvd/gpu<N>.sock".
std::string DefaultSocket(int device, absl::string_view directory = kDefaultSocketDir);

// The handle channel beside a gRPC socket: "X.sock" -> "X.handles"; any other path (including a bare
// ".sock") -> path + ".handles".
std::string HandlesPathFor(absl::string_view socket);

// Whether a file name in the socket directory names a kvd's gRPC socket (ends in kSocketSuffix).
bool IsSocketName(absl::string_view file_name);

// Where a kvd puts its sockets when told no path: $NVIDIA_DRA_LOCAL_IPC_DIR if set and not empty, else
// kDefaultSocketDir.
std::string DefaultSocketDirFromEnvironment();

// A client's socket when none is given: $KVD_SOCKET if set and not empty, else
// DefaultSocket(device, DefaultSocketDirFromEnvironment()).
std::string SocketFromEnvironment(int device);

// The node's socket directory: $KVD_SOCKET_DIR if set and not empty, else DefaultSocketDirFromEnvironment().
std::string SocketDirFromEnvironment();

}  // namespace kvd::wire
