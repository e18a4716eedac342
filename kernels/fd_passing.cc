#include "kvd/fd_passing.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"

namespace kvd {

absl::Status SendWithFds(int socket, absl::string_view payload, absl::Span<const int> fds) {
  if (payload.empty()) return absl::InvalidArgumentError("payload: must not be empty");
  if (fds.size() > kMaxFdsPerMessage) {
    return absl::InvalidArgumentError(absl::StrCat("fds: ", fds.size(), " exceed ", kMaxFdsPerMessage, " per message"));
  }
  iovec iov{const_cast<char*>(payload.data()), payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = sendmsg(socket, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EPIPE || errno == ECONNRESET) return absl::UnavailableError("sendmsg: the peer has closed the socket");
    return ErrnoStatus(errno, "sendmsg");
  }
  // The FDs went with the first byte; a stream socket may split the rest of the payload.
  for (size_t sent = n; sent < payload.size(); sent += n) {
    do {
      n = send(socket, payload.data() + sent, payload.size() - sent, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return ErrnoStatus(errno, "send");
  }
  return absl::OkStatus();
}

absl::StatusOr<MessageWithFds> ReceiveWithFds(int socket, size_t max_payload) {
  MessageWithFds out;
  out.payload.resize(max_payload);
  iovec iov{out.payload.data(), out.payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage));
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus(errno, "recvmsg");
  // Owned here until the message is known to be whole, so that every early return closes them.
  std::vector<UniqueFd> received;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        received.emplace_back(fd);
      }
    }
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) return absl::DataLossError("recvmsg: message or FDs truncated");
  if (n == 0 && received.empty()) return absl::UnavailableError("recvmsg: the peer has closed the socket");
  out.payload.resize(n);
  out.fds.reserve(received.size());
  for (UniqueFd& fd : received) out.fds.push_back(fd.release());
  return out;
}

void RaiseOpenFileLimit() {
  if (rlimit files{}; getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &files);
  }
}

}  // namespace kvd
