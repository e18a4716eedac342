#include "daemon/rpc/control_socket.h"

#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <sys/socket.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "kvd/status.h"
#include "spdlog/spdlog.h"

namespace kvd::daemon {

absl::StatusOr<std::unique_ptr<ControlSocket>> ControlSocket::Listen(const std::string& path, mode_t mode,
                                                                     Options options) {
  KVD_ASSIGN_OR_RETURN(
      std::unique_ptr<PeerAcceptor> acceptor,
      PeerAcceptor::Listen(path, {.type = SOCK_STREAM,
                                  .mode = mode,
                                  .what = "control-socket connections",
                                  .max_connections = options.max_connections,
                                  .max_connections_flag = "--max-control-connections",
                                  .reserved_connections = options.reserved_connections,
                                  .operator_uid = options.operator_uid,
                                  .max_connections_per_uid = options.max_connections_per_uid,
                                  .max_connections_per_uid_flag = "--max-control-connections-per-uid"}));
  return std::unique_ptr<ControlSocket>(new ControlSocket(std::move(acceptor)));
}

ControlSocket::~ControlSocket() { Stop(); }

absl::Status ControlSocket::Serve(grpc::Server* server) {
  return acceptor_->Start(
      // gRPC owns the FD from here and closes it with the connection.
      [server](int fd, const PeerCred&) { grpc::AddInsecureChannelFromFd(server, fd); },
      [this](int fd, const absl::Status& why) { Refuse(fd, why); });
}

void ControlSocket::Stop() { acceptor_->Stop(); }

void ControlSocket::Refuse(int fd, const absl::Status& why) {
  close(fd);
  const auto now = std::chrono::steady_clock::now();
  if (now - last_logged_ < std::chrono::seconds(1)) {
    ++unlogged_;
    return;
  }
  last_logged_ = now;
  spdlog::warn(
      "control socket: refused a connection: {} ({} more refused since the previous such line: at most "
      "one a second is logged)",
      std::string_view(why.message().data(), why.message().size()), unlogged_);
  unlogged_ = 0;
}

std::optional<PeerCred> ControlSocket::PeerOf(absl::string_view grpc_peer) const {
  absl::string_view rest = grpc_peer;
  int fd = -1;
  if (!absl::ConsumePrefix(&rest, "fd:") || !absl::SimpleAtoi(rest, &fd)) return std::nullopt;
  return acceptor_->PeerOf(fd);
}

}  // namespace kvd::daemon
