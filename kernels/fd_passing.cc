#include "kvd/fd_passing.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

absl::Status ErrnoStatus(absl::string_view call, int err) {
  return absl::InternalError(absl::StrCat(call, ": ", std::strerror(err), " (errno ", err, ")"));
}

}  // namespace

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
    return ErrnoStatus("sendmsg", errno);
  }
  // The FDs went with the first byte; a stream socket may split the rest of the payload.
  for (size_t sent = n; sent < payload.size(); sent += n) {
    do {
      n = send(socket, payload.data() + sent, payload.size() - sent, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return ErrnoStatus("send", errno);
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
  if (n < 0) return ErrnoStatus("recvmsg", errno);
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      const size_t first = out.fds.size();
      out.fds.resize(first + count);
      std::memcpy(out.fds.data() + first, CMSG_DATA(c), count * sizeof(int));
    }
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    for (int fd : out.fds) close(fd);
    return absl::DataLossError("recvmsg: message or FDs truncated");
  }
  if (n == 0 && out.fds.empty()) return absl::UnavailableError("recvmsg: the peer has closed the socket");
  out.payload.resize(n);
  return out;
}

}  // namespace kvd
