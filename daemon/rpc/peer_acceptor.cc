#include "daemon/rpc/peer_acceptor.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <iterator>
#include <system_error>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "kvd/status.h"

namespace kvd::daemon {

absl::StatusOr<std::unique_ptr<PeerAcceptor>> PeerAcceptor::Listen(const std::string& path, Options options) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty()) return absl::InvalidArgumentError("path: must not be empty");
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("path: ", path.size(), " bytes exceed the ", sizeof(addr.sun_path) - 1, " of a Unix socket"));
  }
  if (options.type != SOCK_STREAM && options.type != SOCK_SEQPACKET) {
    return absl::InvalidArgumentError("type: must be SOCK_STREAM or SOCK_SEQPACKET");
  }
  if (options.max_connections == 0) return absl::InvalidArgumentError("max_connections: must be > 0");
  if (options.reserved_connections >= options.max_connections) {
    return absl::InvalidArgumentError("reserved_connections: must be < max_connections");
  }
  if (options.max_connections_per_uid == 0) {
    return absl::InvalidArgumentError("max_connections_per_uid: must be > 0");
  }
  std::memcpy(addr.sun_path, path.data(), path.size());

  auto acceptor = absl::WrapUnique(new PeerAcceptor(std::move(options)));
  acceptor->stop_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!acceptor->stop_fd_) return ErrnoStatus(errno, "eventfd");
  acceptor->listen_fd_.reset(socket(AF_UNIX, acceptor->options_.type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!acceptor->listen_fd_) return ErrnoStatus(errno, "socket");
  if (bind(acceptor->listen_fd_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("bind(", path, ")"));
  }
  const auto fail = [&path](absl::string_view call) {
    const int err = errno;
    unlink(path.c_str());
    return ErrnoStatus(err, absl::StrCat(call, "(", path, ")"));
  };
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return fail("stat");
  acceptor->socket_dev_ = st.st_dev;
  acceptor->socket_ino_ = st.st_ino;
  // The mode is set before anyone can connect: listen() comes after it.
  if (chmod(path.c_str(), acceptor->options_.mode) != 0) return fail("chmod");
  if (listen(acceptor->listen_fd_.get(), SOMAXCONN) != 0) return fail("listen");
  return acceptor;
}

PeerAcceptor::~PeerAcceptor() { Stop(); }

absl::Status PeerAcceptor::Start(Admitted admitted, Refused refused) {
  try {
    accept_thread_ = std::thread(&PeerAcceptor::AcceptLoop, this, std::move(admitted), std::move(refused));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat(options_.what, ": cannot start the accept thread: ", e.what()));
  }
  return absl::OkStatus();
}

void PeerAcceptor::Stop() {
  if (stop_fd_) {
    const uint64_t one = 1;
    while (write(stop_fd_.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
    }
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  listen_fd_.reset();
}

bool PeerAcceptor::WaitForStop(int ms) {
  pollfd stop{stop_fd_.get(), POLLIN, 0};
  return poll(&stop, 1, ms) > 0 && (stop.revents & POLLIN) != 0;
}

void PeerAcceptor::AcceptLoop(Admitted admitted, Refused refused) {
  while (true) {
    pollfd polled[2] = {{listen_fd_.get(), POLLIN, 0}, {stop_fd_.get(), POLLIN, 0}};
    if (poll(polled, 2, -1) < 0) {
      if (errno == EINTR) continue;
      // ENOMEM: retrying at once would spin.
      accept_errors_.fetch_add(1, std::memory_order_relaxed);
      if (WaitForStop(100)) return;
      continue;
    }
    if ((polled[1].revents & POLLIN) != 0) return;
    if ((polled[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) continue;
      // Out of FDs or memory: the connection stays in the backlog and the socket readable; back off.
      accept_errors_.fetch_add(1, std::memory_order_relaxed);
      if (WaitForStop(100)) return;
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      refused(fd, ErrnoStatus(errno, "getsockopt(SO_PEERCRED)"));
      continue;
    }
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      refused(fd, ErrnoStatus(errno, "fstat"));
      continue;
    }
    const PeerCred peer{.uid = cred.uid, .gid = cred.gid, .pid = cred.pid};
    // Counted from here against the limits; Release (or closing the FD) uncounts it.
    if (absl::Status admit = Admit(fd, peer, st.st_dev, st.st_ino); !admit.ok()) {
      refused(fd, admit);
      continue;
    }
    admitted(fd, peer);
  }
}

absl::Status PeerAcceptor::Admit(int fd, const PeerCred& peer, dev_t dev, ino_t ino) {
  absl::MutexLock lock(&mu_);
  // The kernel hands out an FD number only once it is closed: a connection still recorded under `fd`
  // was closed without Release.
  if (auto it = open_.find(fd); it != open_.end()) EraseLocked(it);
  if (!CheckLimits(peer.uid, /*count_refusal=*/false).ok()) {
    // Connections closed behind the acceptor's back may be what fills the limit.
    ForgetClosedLocked();
    KVD_RETURN_IF_ERROR(CheckLimits(peer.uid, /*count_refusal=*/true));
  }
  open_[fd] = Open{.peer = peer, .dev = dev, .ino = ino};
  ++by_uid_[peer.uid];
  return absl::OkStatus();
}

absl::Status PeerAcceptor::CheckLimits(uint32_t uid, bool count_refusal) {
  const bool operator_uid = uid == 0 || uid == options_.operator_uid;
  const auto mine = by_uid_.find(uid);
  const uint64_t of_uid = mine == by_uid_.end() ? 0 : mine->second;
  if (!operator_uid && of_uid >= options_.max_connections_per_uid) {
    if (count_refusal) refused_per_uid_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrCat(options_.what, " of uid ", uid, ": ", of_uid, " of ",
                                                     options_.max_connections_per_uid, " (",
                                                     options_.max_connections_per_uid_flag, ")"));
  }
  const size_t usable =
      operator_uid ? options_.max_connections : options_.max_connections - options_.reserved_connections;
  if (open_.size() >= usable) {
    if (count_refusal) refused_total_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(
        absl::StrCat(options_.what, " of all uids: ", open_.size(), " of ", usable, " for uid ", uid, " (",
                     operator_uid || options_.reserved_connections == 0
                         ? options_.max_connections_flag
                         : absl::StrCat(options_.max_connections_flag, "=", options_.max_connections, ", less ",
                                        options_.reserved_connections, " kept for root and uid ", options_.operator_uid,
                                        " by --operator-reserve"),
                     ")"));
  }
  return absl::OkStatus();
}

void PeerAcceptor::ForgetClosedLocked() {
  for (auto it = open_.begin(); it != open_.end();) {
    struct stat st {};
    const auto next = std::next(it);
    if (fstat(it->first, &st) != 0 || st.st_dev != it->second.dev || st.st_ino != it->second.ino) EraseLocked(it);
    it = next;
  }
}

void PeerAcceptor::EraseLocked(std::map<int, Open>::iterator it) {
  if (auto mine = by_uid_.find(it->second.peer.uid); mine != by_uid_.end() && --mine->second == 0) by_uid_.erase(mine);
  open_.erase(it);
}

void PeerAcceptor::Release(int fd) {
  absl::MutexLock lock(&mu_);
  if (auto it = open_.find(fd); it != open_.end()) EraseLocked(it);
}

std::optional<PeerCred> PeerAcceptor::PeerOf(int fd) const {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(fd);
  if (it == open_.end()) return std::nullopt;
  return it->second.peer;
}

std::map<uint32_t, uint64_t> PeerAcceptor::ConnectionsByUid() {
  absl::MutexLock lock(&mu_);
  ForgetClosedLocked();
  return by_uid_;
}

PeerAcceptor::Refusals PeerAcceptor::refusals() const {
  return {.total = refused_total_.load(std::memory_order_relaxed),
          .per_uid = refused_per_uid_.load(std::memory_order_relaxed)};
}

}  // namespace kvd::daemon
