#include "client/handle_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvd/fd_passing.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"
#include "kvd/v1/kvd.pb.h"

namespace kvd {
namespace {

using Clock = std::chrono::steady_clock;

// A reply is at most one HandleBatch of kMaxFdsPerMessage ids or an error message.
constexpr size_t kMaxReplyBytes = 64 * 1024;

Clock::time_point DeadlineAfter(absl::Duration timeout) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(
                            std::clamp(timeout, absl::ZeroDuration(), absl::Hours(24 * 365))));
}

Clock::duration Left(Clock::time_point deadline) { return std::max(deadline - Clock::now(), Clock::duration::zero()); }

// Connects a SOCK_SEQPACKET socket to `path`; sends (and a connect to a full backlog) give up at
// `deadline` through SO_SNDTIMEO.
absl::StatusOr<UniqueFd> Connect(const std::string& path, Clock::time_point deadline, absl::Duration timeout) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty()) return absl::InvalidArgumentError("handles_path: must not be empty");
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("handles_path: ", path.size(), " bytes exceed the ",
                                                   sizeof(addr.sun_path) - 1, " of a Unix socket"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd) return ErrnoStatus(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");

  // A zero timeval would mean "no timeout": wait at least a microsecond.
  const int64_t left_us =
      std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::microseconds>(Left(deadline)).count());
  timeval send_timeout{};
  send_timeout.tv_sec = static_cast<time_t>(left_us / 1000000);
  send_timeout.tv_usec = static_cast<suseconds_t>(left_us % 1000000);
  if (setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout)) != 0) {
    return ErrnoStatus(errno, "setsockopt(SO_SNDTIMEO)");
  }
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    switch (err) {
      case ENOENT:
      case ENOTDIR:
      case ECONNREFUSED:
        return absl::UnavailableError(absl::StrCat("no kvd daemon at ", path));
      case EACCES:
      case EPERM:
        return ErrnoStatus(err, absl::StrCat("connect(", path, ")"));
      case EAGAIN:
        return absl::DeadlineExceededError(
            absl::StrCat("connect(", path, "): the daemon did not accept within ", absl::FormatDuration(timeout)));
      default:
        // Whatever else stops a connect, the daemon is not reachable: UNAVAILABLE, with the errno text.
        return absl::UnavailableError(ErrnoStatus(err, absl::StrCat("connect(", path, ")")).message());
    }
  }
  return fd;
}

// Receives one packet, waiting for it until `deadline`.
absl::StatusOr<MessageWithFds> ReceivePacket(int fd, const std::string& path, Clock::time_point deadline,
                                             absl::Duration timeout) {
  while (true) {
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(Left(deadline)).count();
    pollfd polled{fd, POLLIN, 0};
    const int ready = poll(&polled, 1, static_cast<int>(std::min<decltype(ms)>(ms, INT_MAX)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return ErrnoStatus(errno, "poll");
    if (ready == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("handle channel ", path, ": no reply within ", absl::FormatDuration(timeout)));
    }
    break;
  }
  // A reset (the daemon closed the connection before reading it, or stopped before accepting it) is
  // reported once, ahead of any packet still queued: take it here, then read what is left or EOF.
  int pending_error = 0;
  socklen_t len = sizeof(pending_error);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &pending_error, &len) == 0 && pending_error != 0 &&
      pending_error != ECONNRESET) {
    // A socket error is the connection failing: UNAVAILABLE, with the errno text.
    return absl::UnavailableError(
        ErrnoStatus(pending_error, absl::StrCat("handle channel ", path, ": SO_ERROR")).message());
  }
  absl::StatusOr<MessageWithFds> packet = ReceiveWithFds(fd, kMaxReplyBytes);
  if (absl::IsUnavailable(packet.status())) {
    return absl::UnavailableError(absl::StrCat("handle channel ", path, ": the daemon closed the connection"));
  }
  if (!packet.ok()) {
    return absl::Status(packet.status().code(), absl::StrCat("handle channel ", path, ": ", packet.status().message()));
  }
  return packet;
}

// The daemon's error as a status, code and message unchanged.
absl::Status FromReply(const v1::HandleChannelError& error) {
  const int code = error.code();
  if (code <= static_cast<int>(absl::StatusCode::kOk) || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(absl::StrCat("daemon error with code ", code, ": ", error.message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), error.message());
}

// Sends `request` (SO_SNDTIMEO bounds the wait for room).
absl::Status SendRequest(int fd, const std::string& path, const v1::HandleChannelRequest& request,
                         absl::Duration timeout) {
  const std::string payload = request.SerializeAsString();
  ssize_t n;
  do {
    n = send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n >= 0) return absl::OkStatus();
  const int err = errno;
  switch (err) {
    case EAGAIN:
      return absl::DeadlineExceededError(
          absl::StrCat("handle channel ", path, ": could not send within ", absl::FormatDuration(timeout)));
    case EPIPE:
    case ECONNRESET:
    case ENOTCONN:
      return absl::UnavailableError(absl::StrCat("handle channel ", path, ": the daemon closed the connection"));
    default:
      return ErrnoStatus(err, absl::StrCat("handle channel ", path, ": send"));
  }
}

// Sends `request` on a fresh connection and receives the first reply. When the send fails the daemon
// may still have answered (it refuses connections beyond its limit without reading them), so that
// reply is looked for anyway and wins over the send's error.
absl::StatusOr<MessageWithFds> Exchange(int fd, const std::string& path, const v1::HandleChannelRequest& request,
                                        Clock::time_point deadline, absl::Duration timeout) {
  const absl::Status sent = SendRequest(fd, path, request, timeout);
  absl::StatusOr<MessageWithFds> reply = ReceivePacket(fd, path, sent.ok() ? deadline : Clock::now(), timeout);
  if (!sent.ok() && !reply.ok()) return sent;
  return reply;
}

void CloseAll(std::vector<int>& fds) {
  for (int fd : fds) close(fd);
  fds.clear();
}

}  // namespace

absl::StatusOr<HandleSession> HandleSession::Open(std::string handles_path, absl::string_view client_name,
                                                  HandleClientOptions options) {
  const Clock::time_point deadline = DeadlineAfter(options.timeout);
  HandleSession session(std::move(handles_path), options);  // closes the connection on every early return
  KVD_ASSIGN_OR_RETURN(UniqueFd connection, Connect(session.path_, deadline, options.timeout));
  session.fd_ = connection.release();

  v1::HandleChannelRequest request;
  request.mutable_open_session()->set_client_name(std::string(client_name));
  KVD_ASSIGN_OR_RETURN(MessageWithFds packet, Exchange(session.fd_, session.path_, request, deadline, options.timeout));
  absl::Cleanup close_packet_fds = [&packet] { CloseAll(packet.fds); };
  v1::HandleChannelReply reply;
  if (!reply.ParseFromString(packet.payload)) {
    return absl::InternalError(absl::StrCat("handle channel ", session.path_, ": reply is not a HandleChannelReply"));
  }
  if (reply.has_error()) return FromReply(reply.error());
  if (!reply.has_session_opened() || !packet.fds.empty() || reply.session_opened().session_token().empty()) {
    return absl::InternalError(absl::StrCat("handle channel ", session.path_, ": unexpected reply to OpenSession"));
  }
  session.token_ = reply.session_opened().session_token();
  session.uid_ = reply.session_opened().uid();
  session.pid_ = reply.session_opened().pid();
  return session;
}

HandleSession::HandleSession(HandleSession&& other) noexcept
    : path_(std::move(other.path_)),
      options_(other.options_),
      fd_(std::exchange(other.fd_, -1)),
      token_(std::move(other.token_)),
      uid_(other.uid_),
      pid_(other.pid_) {}

HandleSession& HandleSession::operator=(HandleSession&& other) noexcept {
  if (this != &other) {
    Close();
    path_ = std::move(other.path_);
    options_ = other.options_;
    fd_ = std::exchange(other.fd_, -1);
    token_ = std::move(other.token_);
    uid_ = other.uid_;
    pid_ = other.pid_;
  }
  return *this;
}

HandleSession::~HandleSession() { Close(); }

bool HandleSession::Alive() const {
  if (fd_ < 0) return false;
  pollfd polled{fd_, POLLIN | POLLRDHUP, 0};
  int ready;
  do {
    ready = poll(&polled, 1, 0);
  } while (ready < 0 && errno == EINTR);
  if (ready == 0) return true;
  if (ready < 0 || (polled.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) return false;
  // Readable: a batch pushed with an Attach and not read yet (docs/api.md, "Pushed handles"), or the end of file,
  // which a peek of 0 bytes tells apart.
  char byte;
  ssize_t n;
  do {
    n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
}

absl::StatusOr<HandleSession::LeasedFds> HandleSession::TakePushed(absl::string_view lease_token) const {
  if (fd_ < 0) return absl::FailedPreconditionError("handle session: closed");
  while (true) {
    // The batch came before the Attach's reply: it is in the queue now, or the daemon broke the protocol.
    absl::StatusOr<MessageWithFds> received = ReceivePacket(fd_, path_, Clock::now(), options_.timeout);
    if (absl::IsDeadlineExceeded(received.status())) {
      return absl::InternalError(absl::StrCat("handle channel ", path_, ": the daemon pushed lease ", lease_token,
                                              " but the session's connection holds no batch"));
    }
    if (!received.ok()) return received.status();
    MessageWithFds& packet = *received;
    absl::Cleanup close_packet_fds = [&packet] { CloseAll(packet.fds); };
    v1::HandleChannelReply reply;
    if (!reply.ParseFromString(packet.payload) || !reply.has_handle_batch() ||
        reply.handle_batch().lease_token().empty()) {
      return absl::InternalError(absl::StrCat("handle channel ", path_,
                                              ": the session's connection carried something else than a pushed batch"));
    }
    const v1::HandleBatch& batch = reply.handle_batch();
    if (batch.lease_token() != lease_token) continue;  // an earlier Attach's, whose reply never came: dropped
    if (!batch.last() || static_cast<size_t>(batch.chunk_ids_size()) != packet.fds.size()) {
      return absl::DataLossError(absl::StrCat("handle channel ", path_, ": a pushed batch of ", batch.chunk_ids_size(),
                                              " chunk ids came with ", packet.fds.size(), " FDs"));
    }
    LeasedFds handles;
    for (size_t i = 0; i < packet.fds.size(); ++i)
      handles.emplace_back(batch.chunk_ids(static_cast<int>(i)), packet.fds[i]);
    packet.fds.clear();  // now the caller's
    return handles;
  }
}

void CloseLeased(HandleSession::LeasedFds& fds) {
  for (const auto& [chunk_id, fd] : fds) close(fd);
  fds.clear();
}

void HandleSession::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

absl::StatusOr<std::vector<std::pair<uint64_t, int>>> HandleSession::Fetch(absl::string_view lease_token,
                                                                           bool skip_released) const {
  if (fd_ < 0) return absl::FailedPreconditionError("handle session: closed");
  if (lease_token.empty()) return absl::InvalidArgumentError("lease_token: must not be empty");
  const Clock::time_point deadline = DeadlineAfter(options_.timeout);
  KVD_ASSIGN_OR_RETURN(const UniqueFd connection, Connect(path_, deadline, options_.timeout));
  const int fd = connection.get();

  v1::HandleChannelRequest request;
  request.mutable_fetch_handles()->set_session_token(token_);
  request.mutable_fetch_handles()->set_lease_token(std::string(lease_token));
  request.mutable_fetch_handles()->set_skip_released(skip_released);

  std::vector<std::pair<uint64_t, int>> handles;
  absl::Cleanup close_handles = [&handles] {
    for (const auto& [chunk_id, handle] : handles) close(handle);
  };
  bool first = true;
  while (true) {
    absl::StatusOr<MessageWithFds> received = first ? Exchange(fd, path_, request, deadline, options_.timeout)
                                                    : ReceivePacket(fd, path_, deadline, options_.timeout);
    first = false;
    if (!received.ok()) return received.status();
    MessageWithFds& packet = *received;
    absl::Cleanup close_packet_fds = [&packet] { CloseAll(packet.fds); };
    v1::HandleChannelReply reply;
    if (!reply.ParseFromString(packet.payload)) {
      return absl::InternalError(absl::StrCat("handle channel ", path_, ": reply is not a HandleChannelReply"));
    }
    if (reply.has_error()) return FromReply(reply.error());
    if (!reply.has_handle_batch()) {
      return absl::InternalError(absl::StrCat("handle channel ", path_, ": unexpected reply to FetchHandles"));
    }
    const v1::HandleBatch& batch = reply.handle_batch();
    if (static_cast<size_t>(batch.chunk_ids_size()) != packet.fds.size()) {
      return absl::DataLossError(absl::StrCat("handle channel ", path_, ": a batch of ", batch.chunk_ids_size(),
                                              " chunk ids came with ", packet.fds.size(), " FDs"));
    }
    for (size_t i = 0; i < packet.fds.size(); ++i)
      handles.emplace_back(batch.chunk_ids(static_cast<int>(i)), packet.fds[i]);
    packet.fds.clear();  // now owned by `handles`
    if (batch.last()) break;
  }
  std::move(close_handles).Cancel();
  return handles;
}

absl::StatusOr<HandleSession::Returned> HandleSession::ReturnHandles(
    absl::string_view pool, const std::vector<std::pair<uint64_t, int>>& chunks) const {
  if (fd_ < 0) return absl::FailedPreconditionError("handle session: closed");
  const Clock::time_point deadline = DeadlineAfter(options_.timeout);
  KVD_ASSIGN_OR_RETURN(const UniqueFd connection, Connect(path_, deadline, options_.timeout));
  const int fd = connection.get();
  size_t next = 0;
  do {
    const size_t n = std::min(kMaxFdsPerMessage, chunks.size() - next);
    v1::HandleChannelRequest request;
    v1::ReturnHandles* r = request.mutable_return_handles();
    r->set_session_token(token_);
    r->set_pool(std::string(pool));
    std::vector<int> fds;
    for (size_t i = next; i < next + n; ++i) {
      r->add_chunk_ids(chunks[i].first);
      fds.push_back(chunks[i].second);
    }
    next += n;
    r->set_last(next == chunks.size());
    if (absl::Status sent = SendWithFds(fd, request.SerializeAsString(), fds); !sent.ok()) {
      // The daemon may have refused an earlier packet and closed: its error wins.
      absl::StatusOr<MessageWithFds> reply = ReceivePacket(fd, path_, Clock::now(), options_.timeout);
      v1::HandleChannelReply parsed;
      if (reply.ok() && parsed.ParseFromString(reply->payload) && parsed.has_error()) {
        CloseAll(reply->fds);
        return FromReply(parsed.error());
      }
      if (reply.ok()) CloseAll(reply->fds);
      return absl::UnavailableError(absl::StrCat("handle channel ", path_, ": returning handles: ", sent.message()));
    }
  } while (next < chunks.size());
  KVD_ASSIGN_OR_RETURN(MessageWithFds packet, ReceivePacket(fd, path_, deadline, options_.timeout));
  absl::Cleanup close_packet_fds = [&packet] { CloseAll(packet.fds); };
  v1::HandleChannelReply reply;
  if (!reply.ParseFromString(packet.payload)) {
    return absl::InternalError(absl::StrCat("handle channel ", path_, ": reply is not a HandleChannelReply"));
  }
  if (reply.has_error()) return FromReply(reply.error());
  if (!reply.has_handles_returned()) {
    return absl::InternalError(absl::StrCat("handle channel ", path_, ": unexpected reply to ReturnHandles"));
  }
  const v1::HandlesReturned& h = reply.handles_returned();
  return Returned{.adopted_chunk_ids = {h.adopted_chunk_ids().begin(), h.adopted_chunk_ids().end()},
                  .missing_chunk_ids = {h.missing_chunk_ids().begin(), h.missing_chunk_ids().end()},
                  .state = h.state()};
}

}  // namespace kvd
