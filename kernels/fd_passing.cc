#include "kvd/fd_passing.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvd/status.h"

namespace kvd {

MessageIo SendMessage(int socket, absl::string_view payload, absl::Span<const int> fds, int flags) {
  iovec iov{const_cast<char*>(payload.data()), payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  if (!fds.empty()) {
    if (fds.size() > kMaxFdsPerMessage) return {.error = EINVAL};
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = sendmsg(socket, &msg, flags | MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return {.error = errno};
  return {.bytes = static_cast<size_t>(n)};
}

MessageIo ReceiveMessage(int socket, absl::Span<char> buffer, int flags, std::vector<UniqueFd>* fds) {
  iovec iov{buffer.data(), buffer.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(socket, &msg, flags | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return {.error = errno};
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->emplace_back(fd);
    }
  }
  return {.bytes = static_cast<size_t>(n), .flags = msg.msg_flags};
}

absl::Status SendWithFds(int socket, absl::string_view payload, absl::Span<const int> fds) {
  if (payload.empty()) return absl::InvalidArgumentError("payload: must not be empty");
  if (fds.size() > kMaxFdsPerMessage) {
    return absl::InvalidArgumentError(absl::StrCat("fds: ", fds.size(), " exceed ", kMaxFdsPerMessage, " per message"));
  }
  // The FDs go with the first byte; a stream socket may split the rest of the payload.
  for (size_t sent = 0; sent < payload.size();) {
    const MessageIo io = SendMessage(socket, payload.substr(sent), sent == 0 ? fds : absl::Span<const int>(), 0);
    if (io.error != 0 && sent > 0) return ErrnoStatus(io.error, "send");
    if (io.error == EPIPE || io.error == ECONNRESET) {
      return absl::UnavailableError("sendmsg: the peer has closed the socket");
    }
    if (io.error != 0) return ErrnoStatus(io.error, "sendmsg");
    sent += io.bytes;
  }
  return absl::OkStatus();
}

absl::StatusOr<MessageWithFds> ReceiveWithFds(int socket, size_t max_payload) {
  MessageWithFds out;
  out.payload.resize(max_payload);
  // Owned here until the message is known to be whole, so that every early return closes them.
  std::vector<UniqueFd> received;
  const MessageIo io = ReceiveMessage(socket, absl::MakeSpan(out.payload), 0, &received);
  if (io.error != 0) return ErrnoStatus(io.error, "recvmsg");
  if ((io.flags & MSG_TRUNC) != 0) return absl::DataLossError("recvmsg: message truncated");
  if ((io.flags & MSG_CTRUNC) != 0) {
    // The kernel installs the FDs it can and drops the rest: this process reached its open-file limit, or the
    // peer sent more than one message carries.
    rlimit files{};
    getrlimit(RLIMIT_NOFILE, &files);
    return absl::DataLossError(
        absl::StrCat("recvmsg: file descriptors dropped: this process is at its open-file "
                     "limit (RLIMIT_NOFILE ",
                     files.rlim_cur, "), or more than ", kMaxFdsPerMessage, " came"));
  }
  if (io.bytes == 0 && received.empty()) return absl::UnavailableError("recvmsg: the peer has closed the socket");
  out.payload.resize(io.bytes);
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
