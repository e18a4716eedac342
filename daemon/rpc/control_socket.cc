#include "daemon/rpc/control_socket.h"

#include <errno.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kvd/status.h"

namespace kvd::daemon {

absl::StatusOr<std::unique_ptr<ControlSocket>> ControlSocket::Listen(const std::string& path, mode_t mode) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty()) return absl::InvalidArgumentError("path: must not be empty");
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("path: ", path.size(), " bytes exceed the ", sizeof(addr.sun_path) - 1, " of a Unix socket"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  auto socket_owner = absl::WrapUnique(new ControlSocket());
  socket_owner->stop_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!socket_owner->stop_fd_) return ErrnoStatus(errno, "eventfd");
  socket_owner->listen_fd_.reset(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!socket_owner->listen_fd_) return ErrnoStatus(errno, "socket");
  if (bind(socket_owner->listen_fd_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("bind ", path));
  }
  // The mode is set before anyone can connect: listen() comes after it.
  if (chmod(path.c_str(), mode) != 0) {
    const int err = errno;
    unlink(path.c_str());
    return ErrnoStatus(err, absl::StrCat("chmod ", path));
  }
  if (listen(socket_owner->listen_fd_.get(), SOMAXCONN) != 0) {
    const int err = errno;
    unlink(path.c_str());
    return ErrnoStatus(err, absl::StrCat("listen ", path));
  }
  return socket_owner;
}

ControlSocket::~ControlSocket() { Stop(); }

void ControlSocket::Serve(grpc::Server* server) {
  accept_thread_ = std::thread(&ControlSocket::AcceptLoop, this, server);
}

void ControlSocket::Stop() {
  if (stop_fd_) {
    const uint64_t one = 1;
    while (write(stop_fd_.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
    }
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  listen_fd_.reset();
}

std::optional<PeerCred> ControlSocket::PeerOf(absl::string_view grpc_peer) const {
  absl::string_view rest = grpc_peer;
  int fd = -1;
  if (!absl::ConsumePrefix(&rest, "fd:") || !absl::SimpleAtoi(rest, &fd)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

void ControlSocket::AcceptLoop(grpc::Server* server) {
  const auto wait_for_stop = [this](int timeout_ms) {
    pollfd stop{stop_fd_.get(), POLLIN, 0};
    return poll(&stop, 1, timeout_ms) > 0;
  };
  while (true) {
    pollfd polled[2] = {{listen_fd_.get(), POLLIN, 0}, {stop_fd_.get(), POLLIN, 0}};
    if (poll(polled, 2, -1) < 0) {
      if (errno != EINTR && wait_for_stop(100)) return;
      continue;
    }
    if ((polled[1].revents & POLLIN) != 0) return;
    if ((polled[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) continue;
      // Out of FDs or memory: the connection stays in the backlog and the socket readable; back off.
      accept_errors_.fetch_add(1, std::memory_order_relaxed);
      if (wait_for_stop(100)) return;
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      accept_errors_.fetch_add(1, std::memory_order_relaxed);
      close(fd);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      peers_[fd] = PeerCred{.uid = cred.uid, .gid = cred.gid, .pid = cred.pid};
    }
    // gRPC owns the FD from here and closes it with the connection.
    grpc::AddInsecureChannelFromFd(server, fd);
  }
}

}  // namespace kvd::daemon
