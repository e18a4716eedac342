// ControlSocket: the gRPC control socket, accepted by kvd itself so that every RPC has a known peer
// (Note [Every RPC has a peer] in docs/architecture.md; docs/api.md "Identity"). gRPC's own Unix listener does not tell
// a handler who is calling; this one binds and listens on the socket path, and its accept loop (PeerAcceptor, shared
// with the handle channel) reads each connection's SO_PEERCRED (uid, gid, pid) and checks the connection
// limits before handing the connection to the gRPC server with grpc::AddInsecureChannelFromFd. gRPC then
// names the connection's peer "fd:<N>" (ServerContext::peer()), which PeerOf maps back to the credentials
// read at accept.
//
// A connection's credentials are recorded before gRPC sees a byte of it, and replaced when a later
// connection is accepted on the same FD number (which the kernel reuses only once gRPC closed the old
// connection), so a peer string always names the credentials of the connection that carries it.
//
// Limits. At most Options::max_connections_per_uid connections of one uid and Options::max_connections
// of all uids are open at once, the last Options::reserved_connections of them kept for root and
// Options::operator_uid (--max-control-connections, --max-control-connections-per-uid,
// --operator-reserve). A connection past a limit is closed at once, before gRPC reads it (its client's
// RPC fails UNAVAILABLE), counted (refusals()) and logged: one warning line a second at most. A
// connection stops counting when gRPC closes it (the client went away), seen the next time a limit is
// checked or usage read.
//
// Errors. Listen fails with the errno of socket/bind/chmod/listen. At run time a failed accept (EMFILE:
// the daemon is out of file descriptors) leaves the connection waiting in the backlog; the acceptor
// retries every 100 ms and counts it (accept_errors()), never spinning.
//
// Threads. One accept thread, started by Serve and joined by Stop (also by the destructor). PeerOf and
// the accessors are thread-safe; PeerOf is called from gRPC's handler threads. The socket file is the
// caller's to remove.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/rpc/peer_acceptor.h"

namespace grpc {
class Server;
}

namespace kvd::daemon {

class ControlSocket {
 public:
  struct Options {
    size_t max_connections = 1024;          // --max-control-connections
    size_t reserved_connections = 0;        // its operators' share (< max_connections)
    uint32_t operator_uid = 0;              // besides root
    size_t max_connections_per_uid = 1024;  // --max-control-connections-per-uid
  };

  // Binds `path` (which must not exist: the caller claims it), makes it `mode` and listens.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ControlSocket>> Listen(const std::string& path, mode_t mode,
                                                                             Options options);
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ControlSocket>> Listen(const std::string& path, mode_t mode) {
    return Listen(path, mode, Options());
  }
  ~ControlSocket();
  ControlSocket(const ControlSocket&) = delete;
  ControlSocket& operator=(const ControlSocket&) = delete;

  // Starts accepting; every connection within the limits goes to `server` (built with no listening port
  // of its own), which must outlive Stop(). RESOURCE_EXHAUSTED when the accept thread cannot start.
  [[nodiscard]] absl::Status Serve(grpc::Server* server);
  // Stops accepting and joins the accept thread; connections already handed to gRPC are gRPC's.
  // Idempotent.
  void Stop();

  // The credentials of the connection gRPC calls `grpc_peer` ("fd:<N>"); nullopt for any other peer.
  std::optional<PeerCred> PeerOf(absl::string_view grpc_peer) const;
  uint64_t accept_errors() const { return acceptor_->accept_errors(); }
  // Open connections by peer uid, and the connections refused by the limits since start; for metrics.
  std::map<uint32_t, uint64_t> ConnectionsByUid() const { return acceptor_->ConnectionsByUid(); }
  PeerAcceptor::Refusals refusals() const { return acceptor_->refusals(); }

 private:
  explicit ControlSocket(std::unique_ptr<PeerAcceptor> acceptor) : acceptor_(std::move(acceptor)) {}
  // A refused connection: closed, and logged at most once a second (on the accept thread).
  void Refuse(int fd, const absl::Status& why);

  std::unique_ptr<PeerAcceptor> acceptor_;
  std::chrono::steady_clock::time_point last_logged_{};  // accept thread only
  uint64_t unlogged_ = 0;                                // accept thread only
};

}  // namespace kvd::daemon
