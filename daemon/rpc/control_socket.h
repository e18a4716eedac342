// ControlSocket: the gRPC control socket, accepted by kvd itself so that every RPC has a known peer
// (DESIGN.md section 7; docs/api.md "Identity"). gRPC's own Unix listener does not tell a handler who
// is calling; this one binds and listens on the socket path, reads each accepted connection's
// SO_PEERCRED (uid, gid, pid) and hands the connection to the gRPC server with
// grpc::AddInsecureChannelFromFd. gRPC then names the connection's peer "fd:<N>" (ServerContext::peer()),
// which PeerOf maps back to the credentials read at accept.
//
// A connection's credentials are recorded before gRPC sees a byte of it, and replaced when a later
// connection is accepted on the same FD number (which the kernel reuses only once gRPC closed the old
// connection), so a peer string always names the credentials of the connection that carries it.
//
// Errors. Listen fails with the errno of socket/bind/chmod/listen. At run time a failed accept (EMFILE:
// the daemon is out of file descriptors) leaves the connection waiting in the backlog; the acceptor
// retries every 100 ms and counts it (accept_errors()), never spinning.
//
// Threads. One accept thread, started by Serve and joined by Stop (also by the destructor). PeerOf is
// thread-safe and called from gRPC's handler threads. The socket file is the caller's to remove.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvd/unique_fd.h"

namespace grpc {
class Server;
}

namespace kvd::daemon {

// A connection's peer as SO_PEERCRED reported it at accept.
struct PeerCred {
  uint32_t uid = 0;
  uint32_t gid = 0;
  int32_t pid = 0;
};

class ControlSocket {
 public:
  // Binds `path` (which must not exist: the caller claims it), makes it `mode` and listens.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ControlSocket>> Listen(const std::string& path, mode_t mode);
  ~ControlSocket();
  ControlSocket(const ControlSocket&) = delete;
  ControlSocket& operator=(const ControlSocket&) = delete;

  // Starts accepting; every connection goes to `server` (built with no listening port of its own),
  // which must outlive Stop().
  void Serve(grpc::Server* server);
  // Stops accepting and joins the accept thread; connections already handed to gRPC are gRPC's.
  // Idempotent.
  void Stop();

  // The credentials of the connection gRPC calls `grpc_peer` ("fd:<N>"); nullopt for any other peer.
  std::optional<PeerCred> PeerOf(absl::string_view grpc_peer) const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t accept_errors() const { return accept_errors_.load(std::memory_order_relaxed); }

 private:
  ControlSocket() = default;
  void AcceptLoop(grpc::Server* server);

  UniqueFd listen_fd_;
  UniqueFd stop_fd_;  // an eventfd: readable once Stop() was called
  std::thread accept_thread_;
  std::atomic<uint64_t> accept_errors_{0};
  mutable absl::Mutex mu_;
  std::map<int, PeerCred> peers_ ABSL_GUARDED_BY(mu_);  // by the FD number gRPC names the connection with
};

}  // namespace kvd::daemon
