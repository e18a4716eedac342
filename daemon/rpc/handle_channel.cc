#include "daemon/rpc/handle_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <list>
#include <map>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "daemon/codec/codec.h"
#include "kvd/fd_passing.h"
#include "kvd/status.h"
#include "kvd/v1/kvd.pb.h"

namespace kvd::daemon {

using Clock = std::chrono::steady_clock;

// A connection the channel serves: its socket, the peer's credentials (SO_PEERCRED at accept), the
// time by which its request must arrive, and once it is a session, the session's token.
struct HandleChannel::Connection {
  int fd = -1;
  uint32_t uid = 0;
  int32_t pid = 0;
  Clock::time_point deadline;
  std::string session;
};

// A FetchHandles request waiting for a worker.
// A queued job for a worker: a lease to redeem (FetchHandles), or FDs given back (ReturnHandles).
struct HandleChannel::Fetch {
  Connection conn;
  std::string session;
  std::string lease;
  bool skip_released = false;                 // FetchHandles.skip_released
  std::optional<v1::ReturnHandles> returned;  // set for ReturnHandles: its first packet
  std::vector<UniqueFd> fds;                  // and that packet's FDs
};

namespace {

constexpr size_t kMaxClientNameBytes = 64;
constexpr size_t kMaxTokenBytes = 1024;
// Packets drained from a connection before closing it (see CloseConnection).
constexpr int kMaxDrainedPackets = 16;

absl::Status ErrnoToStatus(absl::string_view call, int err) {
  // A peer that went away is how connections end, not a system failure: say so in words.
  if (err == EPIPE || err == ECONNRESET || err == ENOTCONN || err == ECONNREFUSED) {
    return absl::UnavailableError(absl::StrCat(call, ": the peer has closed the connection"));
  }
  return ErrnoStatus(err, call);
}

// Durations far beyond any sensible timeout are clamped so that `now + d` cannot overflow.
Clock::duration ToClock(absl::Duration d) {
  return std::chrono::duration_cast<Clock::duration>(
      absl::ToChronoNanoseconds(std::clamp(d, absl::ZeroDuration(), absl::Hours(24 * 365))));
}

// Milliseconds until `deadline` for poll(), rounded up so that poll does not return just before it.
int PollTimeoutMs(Clock::time_point deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<decltype(ms)>(ms, INT_MAX));
}

void CloseFds(absl::Span<const int> fds) {
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

// Sends one packet with `fds` (at most kMaxFdsPerMessage; they stay the caller's) without ever
// blocking: while the peer's queue is full it waits for room until `deadline`, or until `stop_fd`
// (when >= 0) is readable. A SOCK_SEQPACKET packet is sent whole or not at all.
absl::Status SendPacket(int fd, const std::string& payload, absl::Span<const int> fds, int stop_fd,
                        Clock::time_point deadline) {
  while (true) {
    const MessageIo io = SendMessage(fd, payload, fds, MSG_DONTWAIT);
    if (io.error == 0) return absl::OkStatus();
    if (io.error != EAGAIN && io.error != EWOULDBLOCK) return ErrnoToStatus("sendmsg", io.error);
    const int timeout_ms = PollTimeoutMs(deadline);
    if (timeout_ms == 0) return absl::DeadlineExceededError("the peer is not reading its replies");
    pollfd polled[2] = {{fd, POLLOUT, 0}, {stop_fd, POLLIN, 0}};
    if (poll(polled, stop_fd >= 0 ? 2 : 1, timeout_ms) < 0 && errno != EINTR) return ErrnoToStatus("poll", errno);
    if (stop_fd >= 0 && (polled[1].revents & POLLIN) != 0) {
      return absl::UnavailableError("the handle channel is stopping");
    }
    // POLLOUT, POLLERR, POLLHUP or a timeout: the next sendmsg tells which.
  }
}

std::string ErrorReply(const absl::Status& status) {
  v1::HandleChannelReply reply;
  reply.mutable_error()->set_code(static_cast<int32_t>(status.code()));
  reply.mutable_error()->set_message(std::string(status.message()));
  AppendDetails(status, reply.mutable_error()->mutable_details());
  return reply.SerializeAsString();
}

// Sends `status` as a HandleChannelError if the peer's queue has room now; best effort.
void SendError(int fd, const absl::Status& status) {
  SendPacket(fd, ErrorReply(status), {}, -1, Clock::now()).IgnoreError();
}

// The outcome of reading a connection's request.
struct Received {
  enum Kind { kRequest, kNothing, kClosed, kBad } kind = kNothing;
  std::string bytes;          // kRequest: the packet
  std::vector<UniqueFd> fds;  // kRequest: the FDs it carried (only ReturnHandles may carry any)
  absl::Status status;        // kBad: what to answer
};

// Reads one packet of at most `max_bytes` without blocking. Packets with more than kMaxFdsPerMessage
// FDs are refused (their FDs closed); so are empty and oversized packets.
Received ReadRequest(int fd, size_t max_bytes) {
  Received out;
  out.bytes.resize(max_bytes);
  const MessageIo io = ReceiveMessage(fd, absl::MakeSpan(out.bytes), MSG_DONTWAIT, &out.fds);
  if (io.error != 0) {
    out.kind = (io.error == EAGAIN || io.error == EWOULDBLOCK) ? Received::kNothing : Received::kClosed;
    return out;
  }
  if ((io.flags & MSG_TRUNC) != 0) {
    out.kind = Received::kBad;
    out.status = absl::InvalidArgumentError(absl::StrCat("request: larger than ", max_bytes, " bytes"));
  } else if ((io.flags & MSG_CTRUNC) != 0) {
    out.kind = Received::kBad;
    out.status =
        absl::InvalidArgumentError(absl::StrCat("request: more than ", kMaxFdsPerMessage, " file descriptors"));
  } else if (io.bytes == 0 && out.fds.empty()) {
    // A SOCK_SEQPACKET recv returns 0 both for an empty packet and at EOF; only EOF raises RDHUP.
    pollfd polled{fd, POLLRDHUP, 0};
    const bool hung_up = poll(&polled, 1, 0) > 0 && (polled.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
    out.kind = hung_up ? Received::kClosed : Received::kBad;
    if (!hung_up) out.status = absl::InvalidArgumentError("request: empty packet");
  } else {
    out.kind = Received::kRequest;
    out.bytes.resize(io.bytes);
  }
  return out;
}

bool IsValidClientName(absl::string_view name) {
  if (name.size() > kMaxClientNameBytes) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

absl::Status ValidateToken(absl::string_view field, absl::string_view token) {
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  if (token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": longer than ", kMaxTokenBytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

HandleChannel::HandleChannel(std::string path, HandleChannelBackend* backend, Options options)
    : path_(std::move(path)), backend_(backend), options_(options) {}

HandleChannel::~HandleChannel() { Stop(); }

absl::StatusOr<std::unique_ptr<HandleChannel>> HandleChannel::Start(std::string path, HandleChannelBackend* backend,
                                                                    Options options) {
  // The path and the connection limits are checked by PeerAcceptor::Listen.
  if (backend == nullptr) return absl::InvalidArgumentError("backend: must not be null");
  if (options.max_fetch_workers == 0) return absl::InvalidArgumentError("max_fetch_workers: must be > 0");
  if (options.max_request_bytes == 0) return absl::InvalidArgumentError("max_request_bytes: must be > 0");
  if (options.first_request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("first_request_timeout: must be > 0");
  }
  if (options.send_timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("send_timeout: must be > 0");
  // From here on the channel's destructor (Stop) undoes whatever was done: it closes the FDs that are
  // open, joins the threads that run and unlinks the socket once bound.
  auto channel = absl::WrapUnique(new HandleChannel(std::move(path), backend, options));
  channel->stop_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!channel->stop_fd_) return ErrnoToStatus("eventfd", errno);
  channel->notify_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!channel->notify_fd_) return ErrnoToStatus("eventfd", errno);
  KVD_ASSIGN_OR_RETURN(
      channel->acceptor_,
      PeerAcceptor::Listen(channel->path_, {.type = SOCK_SEQPACKET,
                                            .mode = 0660,
                                            .what = "handle-channel connections",
                                            .max_connections = options.max_connections,
                                            .max_connections_flag = "--max-handle-connections",
                                            .reserved_connections = options.reserved_connections,
                                            .operator_uid = options.operator_uid,
                                            .max_connections_per_uid = options.max_connections_per_uid,
                                            .max_connections_per_uid_flag = "--max-handle-connections-per-uid"}));

  try {
    channel->watch_thread_ = std::thread(&HandleChannel::WatchLoop, channel.get());
  } catch (const std::system_error& e) {
    // Out of threads or memory: the channel's destructor (Stop) unlinks the socket.
    return absl::ResourceExhaustedError(absl::StrCat("handle channel: cannot start its threads: ", e.what()));
  }
  HandleChannel* const served = channel.get();
  KVD_RETURN_IF_ERROR(
      channel->acceptor_->Start([served](int fd, const PeerCred& peer) { served->Accepted(fd, peer); },
                                [served](int fd, const absl::Status& why) { served->Reject(fd, why); }));
  return channel;
}

void HandleChannel::Stop() {
  absl::MutexLock stop_lock(&stop_mu_);
  if (stopped_) return;
  stopped_ = true;

  // The stop eventfd stays readable from now on: every poll in the channel returns.
  if (stop_fd_) {
    const uint64_t one = 1;
    while (write(stop_fd_.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
    }
  }
  // The acceptor stays (stopped) until the channel goes: CloseConnection releases connections in it.
  if (acceptor_ != nullptr) {
    acceptor_->Stop();
    // Unlink only our own socket: the path may have been taken over since.
    struct stat st {};
    if (stat(path_.c_str(), &st) == 0 && st.st_dev == acceptor_->socket_dev() && st.st_ino == acceptor_->socket_ino()) {
      unlink(path_.c_str());
    }
  }

  // The watcher closes every connection waiting for its request and every session on its way out.
  if (watch_thread_.joinable()) watch_thread_.join();

  std::vector<Connection> accepted;
  std::vector<std::thread> finished;
  {
    absl::MutexLock lock(&mu_);
    // Every worker sees the stop eventfd and gives up its fetch; the last thing it does is move itself
    // from workers_ to finished_.
    mu_.Await(absl::Condition(
        +[](std::list<std::thread>* workers) { return workers->empty(); }, &workers_));
    accepted.swap(accepted_);
    finished.swap(finished_);
  }
  for (std::thread& worker : finished) worker.join();
  for (Connection& conn : accepted) {
    SendError(conn.fd, absl::UnavailableError("the handle channel is stopping"));
    CloseConnection(conn.fd);
  }

  notify_fd_.reset();
  stop_fd_.reset();
}

std::map<uint32_t, uint64_t> HandleChannel::ConnectionsByUid() const {
  return acceptor_ != nullptr ? acceptor_->ConnectionsByUid() : std::map<uint32_t, uint64_t>();
}

HandleChannel::Refusals HandleChannel::refusals() const {
  return acceptor_ != nullptr ? acceptor_->refusals() : Refusals{};
}

HandleChannel::Stats HandleChannel::stats() const {
  Stats stats;
  stats.sessions_opened = sessions_opened_.load(std::memory_order_relaxed);
  stats.sessions_closed = sessions_closed_.load(std::memory_order_relaxed);
  stats.fetches_served = fetches_served_.load(std::memory_order_relaxed);
  stats.fds_sent = fds_sent_.load(std::memory_order_relaxed);
  stats.leases_pushed = leases_pushed_.load(std::memory_order_relaxed);
  stats.errors = errors_.load(std::memory_order_relaxed) + (acceptor_ != nullptr ? acceptor_->accept_errors() : 0);
  return stats;
}

void HandleChannel::Accepted(int fd, const PeerCred& peer) {
  Connection conn{
      .fd = fd, .uid = peer.uid, .pid = peer.pid, .deadline = Clock::now() + ToClock(options_.first_request_timeout)};
  {
    absl::MutexLock lock(&mu_);
    accepted_.push_back(std::move(conn));
  }
  const uint64_t one = 1;
  while (write(notify_fd_.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void HandleChannel::BackOffAfterPollFailure() {
  if (errno == EINTR) return;
  // ENOMEM, or EINVAL with more connections than RLIMIT_NOFILE: retrying at once would spin.
  errors_.fetch_add(1, std::memory_order_relaxed);
  WaitForStop(absl::Milliseconds(100));
}

void HandleChannel::WaitForStop(absl::Duration timeout) {
  pollfd stop{stop_fd_.get(), POLLIN, 0};
  poll(&stop, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
}

void HandleChannel::WatchLoop() {
  std::vector<Connection> pending;   // waiting for their request
  std::vector<Connection> sessions;  // open sessions: watched for EOF
  std::vector<pollfd> polled;
  while (true) {
    polled.clear();
    polled.push_back({stop_fd_.get(), POLLIN, 0});
    polled.push_back({notify_fd_.get(), POLLIN, 0});
    int timeout_ms = -1;
    for (const Connection& conn : pending) {
      polled.push_back({conn.fd, POLLIN | POLLRDHUP, 0});
      const int ms = PollTimeoutMs(conn.deadline);
      timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
    }
    for (const Connection& conn : sessions) polled.push_back({conn.fd, POLLIN | POLLRDHUP, 0});
    if (poll(polled.data(), polled.size(), timeout_ms) < 0) {
      BackOffAfterPollFailure();
      continue;
    }
    if ((polled[0].revents & POLLIN) != 0) break;
    if ((polled[1].revents & POLLIN) != 0) {
      uint64_t count;
      while (read(notify_fd_.get(), &count, sizeof(count)) < 0 && errno == EINTR) {
      }
    }

    // Sessions: any event ends one. EOF (the client closed or died) is the normal end; a packet on a
    // session connection breaks the protocol (one request per connection) and ends it too.
    const size_t first_session = 2 + pending.size();
    std::vector<Connection> live;
    live.reserve(sessions.size());
    for (size_t i = 0; i < sessions.size(); ++i) {
      const short revents = polled[first_session + i].revents;
      Connection& conn = sessions[i];
      if (revents == 0) {
        live.push_back(std::move(conn));
        continue;
      }
      ForgetSession(conn.session);
      backend_->CloseSession(conn.session);
      open_sessions_.fetch_sub(1, std::memory_order_relaxed);
      sessions_closed_.fetch_add(1, std::memory_order_relaxed);
      if ((revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) {
        CloseConnection(conn.fd);
      } else {
        Reject(conn.fd, absl::InvalidArgumentError(
                            "request: a session's connection carries one request; the session is closed"));
      }
    }
    sessions.swap(live);

    // Connections waiting for their request: serve the ones that sent it, drop the ones out of time.
    const Clock::time_point now = Clock::now();
    std::vector<Connection> waiting;
    waiting.reserve(pending.size());
    for (size_t i = 0; i < pending.size(); ++i) {
      Connection& conn = pending[i];
      if (polled[2 + i].revents != 0) {
        if (ServeFirstRequest(conn, sessions)) waiting.push_back(std::move(conn));
      } else if (now >= conn.deadline) {
        Reject(conn.fd,
               absl::DeadlineExceededError(absl::StrCat("handle channel: no request within ",
                                                        absl::FormatDuration(options_.first_request_timeout))));
      } else {
        waiting.push_back(std::move(conn));
      }
    }
    pending.swap(waiting);
    {
      absl::MutexLock lock(&mu_);
      for (Connection& conn : accepted_) pending.push_back(std::move(conn));
      accepted_.clear();
    }
    ReapFinishedWorkers();
  }

  for (Connection& conn : pending) {
    SendError(conn.fd, absl::UnavailableError("the handle channel is stopping"));
    CloseConnection(conn.fd);
  }
  for (Connection& conn : sessions) {
    ForgetSession(conn.session);
    backend_->CloseSession(conn.session);
    open_sessions_.fetch_sub(1, std::memory_order_relaxed);
    sessions_closed_.fetch_add(1, std::memory_order_relaxed);
    CloseConnection(conn.fd);
  }
}

bool HandleChannel::ServeFirstRequest(Connection& conn, std::vector<Connection>& sessions) {
  Received received = ReadRequest(conn.fd, options_.max_request_bytes);
  switch (received.kind) {
    case Received::kNothing:
      return true;
    case Received::kClosed:
      CloseConnection(conn.fd);
      return false;
    case Received::kBad:
      Reject(conn.fd, received.status);
      return false;
    case Received::kRequest:
      break;
  }
  v1::HandleChannelRequest request;
  if (!request.ParseFromString(received.bytes)) {
    Reject(conn.fd, absl::InvalidArgumentError("request: not a serialized kvd.v1.HandleChannelRequest"));
    return false;
  }
  if (!received.fds.empty() && request.kind_case() != v1::HandleChannelRequest::kReturnHandles) {
    Reject(conn.fd, absl::InvalidArgumentError("request: must carry no file descriptors"));
    return false;
  }
  switch (request.kind_case()) {
    case v1::HandleChannelRequest::kOpenSession: {
      std::string* name = request.mutable_open_session()->mutable_client_name();
      if (!IsValidClientName(*name)) {
        Reject(conn.fd, absl::InvalidArgumentError(absl::StrCat("open_session.client_name: must be at most ",
                                                                kMaxClientNameBytes, " characters of [A-Za-z0-9._-]")));
        return false;
      }
      absl::StatusOr<std::string> opened = backend_->OpenSession(conn.uid, conn.pid, std::move(*name));
      if (!opened.ok()) {
        Reject(conn.fd, opened.status());
        return false;
      }
      std::string token = *std::move(opened);
      v1::HandleChannelReply reply;
      reply.mutable_session_opened()->set_session_token(token);
      reply.mutable_session_opened()->set_uid(conn.uid);
      reply.mutable_session_opened()->set_pid(conn.pid);
      // Known before the client has its token: its first Attach may push on this connection at once.
      {
        absl::MutexLock lock(&sessions_mu_);
        session_fds_[token] = conn.fd;
      }
      // A fresh connection's queue is empty: the reply goes at once or the peer is gone.
      if (!SendPacket(conn.fd, reply.SerializeAsString(), {}, -1, Clock::now()).ok()) {
        ForgetSession(token);
        backend_->CloseSession(token);
        errors_.fetch_add(1, std::memory_order_relaxed);
        CloseConnection(conn.fd);
        return false;
      }
      conn.session = std::move(token);
      sessions.push_back(std::move(conn));
      open_sessions_.fetch_add(1, std::memory_order_relaxed);
      sessions_opened_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    case v1::HandleChannelRequest::kFetchHandles: {
      v1::FetchHandles* fetch = request.mutable_fetch_handles();
      absl::Status valid = ValidateToken("fetch_handles.session_token", fetch->session_token());
      if (valid.ok()) valid = ValidateToken("fetch_handles.lease_token", fetch->lease_token());
      if (!valid.ok()) {
        Reject(conn.fd, valid);
        return false;
      }
      SpawnFetch(Fetch{.conn = std::move(conn),
                       .session = std::move(*fetch->mutable_session_token()),
                       .lease = std::move(*fetch->mutable_lease_token()),
                       .skip_released = fetch->skip_released()});
      return false;
    }
    case v1::HandleChannelRequest::kReturnHandles: {
      v1::ReturnHandles* ret = request.mutable_return_handles();
      absl::Status valid = ValidateToken("return_handles.session_token", ret->session_token());
      if (valid.ok() && ret->pool().empty())
        valid = absl::InvalidArgumentError("return_handles.pool: must not be empty");
      if (!valid.ok()) {
        Reject(conn.fd, valid);
        return false;
      }
      SpawnFetch(Fetch{.conn = std::move(conn), .returned = std::move(*ret), .fds = std::move(received.fds)});
      return false;
    }
    case v1::HandleChannelRequest::KIND_NOT_SET:
      break;
  }
  Reject(conn.fd, absl::InvalidArgumentError("request: neither open_session nor fetch_handles is set"));
  return false;
}

void HandleChannel::SpawnFetch(Fetch fetch) {
  absl::MutexLock lock(&mu_);
  fetches_.push_back(std::move(fetch));
  if (workers_.size() >= options_.max_fetch_workers) return;  // a running worker takes it
  auto self = workers_.emplace(workers_.end());
  // The worker cannot finish before `*self` is assigned: it takes mu_, held here, before it ends.
  try {
    *self = std::thread(&HandleChannel::FetchWorker, this, self);
  } catch (const std::system_error&) {
    // Out of threads or memory (std::thread reports it only by throwing): never an abort. A running
    // worker serves the queue; with none, the fetch is refused.
    workers_.erase(self);
    if (!workers_.empty()) return;
    Fetch refused = std::move(fetches_.back());
    fetches_.pop_back();
    Reject(refused.conn.fd,
           absl::ResourceExhaustedError("handle channel: no thread to serve the fetch (the daemon is out of threads "
                                        "or memory); try again"));
  }
}

void HandleChannel::FetchWorker(std::list<std::thread>::iterator self) {
  while (true) {
    Fetch fetch;
    {
      absl::MutexLock lock(&mu_);
      if (fetches_.empty()) {
        finished_.push_back(std::move(*self));
        workers_.erase(self);
        return;
      }
      fetch = std::move(fetches_.front());
      fetches_.pop_front();
    }
    // Once Stop() began, queued fetches are answered without redeeming their leases.
    pollfd stop{stop_fd_.get(), POLLIN, 0};
    if (poll(&stop, 1, 0) > 0 && (stop.revents & POLLIN) != 0) {
      Reject(fetch.conn.fd, absl::UnavailableError("the handle channel is stopping"));
      continue;
    }
    if (fetch.returned.has_value()) {
      ServeReturn(std::move(fetch.conn), *std::move(fetch.returned), std::move(fetch.fds));
    } else {
      ServeFetch(std::move(fetch.conn), std::move(fetch.session), std::move(fetch.lease), fetch.skip_released);
    }
  }
}

void HandleChannel::ServeReturn(Connection conn, v1::ReturnHandles first, std::vector<UniqueFd> fds) {
  const std::string session = first.session_token();
  const std::string pool = first.pool();
  std::vector<std::pair<uint64_t, UniqueFd>> returned;
  v1::ReturnHandles packet = std::move(first);
  while (true) {
    if (static_cast<size_t>(packet.chunk_ids_size()) != fds.size()) {
      Reject(conn.fd, absl::InvalidArgumentError(absl::StrCat("return_handles.chunk_ids: ", packet.chunk_ids_size(),
                                                              " ids but ", fds.size(), " FDs attached")));
      return;
    }
    if (packet.session_token() != session || packet.pool() != pool) {
      Reject(conn.fd, absl::InvalidArgumentError("return_handles: every packet must name the same session and pool"));
      return;
    }
    for (int i = 0; i < packet.chunk_ids_size(); ++i) returned.emplace_back(packet.chunk_ids(i), std::move(fds[i]));
    if (packet.last()) break;
    if (returned.size() > options_.max_returned_fds) {
      Reject(conn.fd, absl::InvalidArgumentError(
                          absl::StrCat("return_handles: more than ", options_.max_returned_fds, " FDs in one call")));
      return;
    }
    // The next packet, within the first request's timeout (a signal does not cut the wait short).
    const Clock::time_point next_by = Clock::now() + ToClock(options_.first_request_timeout);
    pollfd polled[2];
    int ready;
    do {
      polled[0] = {conn.fd, POLLIN, 0};
      polled[1] = {stop_fd_.get(), POLLIN, 0};
      ready = poll(polled, 2, PollTimeoutMs(next_by));
    } while (ready < 0 && errno == EINTR);
    if (ready <= 0 || (polled[1].revents & POLLIN) != 0) {
      Reject(conn.fd, absl::DeadlineExceededError("return_handles: the next packet did not come"));
      return;
    }
    Received received = ReadRequest(conn.fd, options_.max_request_bytes);
    v1::HandleChannelRequest next;
    if (received.kind != Received::kRequest || !next.ParseFromString(received.bytes) || !next.has_return_handles()) {
      Reject(conn.fd, received.kind == Received::kBad
                          ? received.status
                          : absl::InvalidArgumentError("return_handles: every packet must be a ReturnHandles"));
      return;
    }
    packet = std::move(*next.mutable_return_handles());
    fds = std::move(received.fds);
  }
  absl::StatusOr<v1::HandlesReturned> result = backend_->ReturnHandles(session, conn.uid, pool, std::move(returned));
  if (!result.ok()) {
    Reject(conn.fd, result.status());
    return;
  }
  v1::HandleChannelReply reply;
  *reply.mutable_handles_returned() = *std::move(result);
  if (absl::Status sent = SendPacket(conn.fd, reply.SerializeAsString(), {}, stop_fd_.get(),
                                     Clock::now() + ToClock(options_.send_timeout));
      !sent.ok()) {
    Reject(conn.fd, sent);
    return;
  }
  CloseConnection(conn.fd);
}

void HandleChannel::ReapFinishedWorkers() {
  std::vector<std::thread> finished;
  {
    absl::MutexLock lock(&mu_);
    finished.swap(finished_);
  }
  for (std::thread& worker : finished) worker.join();
}

void HandleChannel::ServeFetch(Connection conn, std::string session, std::string lease, bool skip_released) {
  absl::StatusOr<std::vector<HandleChannelBackend::LeasedFd>> redeemed =
      backend_->RedeemLease(session, lease, conn.uid, skip_released);
  if (!redeemed.ok()) {
    Reject(conn.fd, redeemed.status());
    return;
  }
  std::vector<HandleChannelBackend::LeasedFd> leased = *std::move(redeemed);
  // Each batch's FDs are closed as soon as it is sent; whatever is left is closed on every other path.
  absl::Cleanup close_leased = [&leased] {
    for (HandleChannelBackend::LeasedFd& l : leased) {
      if (l.fd >= 0) close(l.fd);
    }
  };

  size_t sent = 0;
  do {
    const size_t count = std::min(kMaxFdsPerMessage, leased.size() - sent);
    v1::HandleChannelReply reply;
    v1::HandleBatch* batch = reply.mutable_handle_batch();
    std::vector<int> fds;
    fds.reserve(count);
    for (size_t i = sent; i < sent + count; ++i) {
      batch->add_chunk_ids(leased[i].chunk_id);
      fds.push_back(leased[i].fd);
    }
    batch->set_last(sent + count == leased.size());
    absl::Status status = SendPacket(conn.fd, reply.SerializeAsString(), fds, stop_fd_.get(),
                                     Clock::now() + ToClock(options_.send_timeout));
    if (!status.ok()) {
      Reject(conn.fd, status);
      return;
    }
    CloseFds(fds);
    for (size_t i = sent; i < sent + count; ++i) leased[i].fd = -1;
    sent += count;
  } while (sent < leased.size());

  fds_sent_.fetch_add(leased.size(), std::memory_order_relaxed);
  CloseConnection(conn.fd);
  fetches_served_.fetch_add(1, std::memory_order_relaxed);
}

absl::Status HandleChannel::Push(absl::string_view session, absl::string_view lease_token,
                                 absl::Span<const uint64_t> chunk_ids, absl::Span<const int> fds) {
  if (fds.size() > kMaxFdsPerMessage) {
    return absl::FailedPreconditionError(
        absl::StrCat("a lease of ", fds.size(), " chunks needs more than one packet of ", kMaxFdsPerMessage));
  }
  if (chunk_ids.size() != fds.size()) return absl::InvalidArgumentError("Push: one chunk id per FD");
  v1::HandleChannelReply reply;
  v1::HandleBatch* batch = reply.mutable_handle_batch();
  for (uint64_t id : chunk_ids) batch->add_chunk_ids(id);
  batch->set_last(true);
  batch->set_lease_token(std::string(lease_token));
  const std::string payload = reply.SerializeAsString();
  absl::MutexLock lock(&sessions_mu_);
  auto it = session_fds_.find(session);
  if (it == session_fds_.end()) return absl::NotFoundError("the session has no open handle-channel connection");
  const MessageIo io = SendMessage(it->second, payload, fds, MSG_DONTWAIT);
  if (io.error == EAGAIN || io.error == EWOULDBLOCK) {
    return absl::UnavailableError("the session's connection has no room now (its client is not reading it)");
  }
  if (io.error != 0) return ErrnoToStatus("sendmsg", io.error);
  fds_sent_.fetch_add(fds.size(), std::memory_order_relaxed);
  leases_pushed_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

void HandleChannel::ForgetSession(const std::string& session) {
  absl::MutexLock lock(&sessions_mu_);
  session_fds_.erase(session);
}

void HandleChannel::Reject(int fd, const absl::Status& status) {
  errors_.fetch_add(1, std::memory_order_relaxed);
  SendError(fd, status);
  CloseConnection(fd);
}

void HandleChannel::CloseConnection(int fd) {
  // Closing a Unix stream or seqpacket socket with unread packets makes the peer's next recv fail with
  // ECONNRESET before it can read what we sent. So: refuse further packets (the peer's send now fails
  // with EPIPE), drain what arrived, then close; packets sent to the peer stay readable until EOF.
  shutdown(fd, SHUT_RDWR);
  for (int i = 0; i < kMaxDrainedPackets; ++i) {
    char byte;
    std::vector<UniqueFd> fds;  // closed here
    const MessageIo io = ReceiveMessage(fd, absl::MakeSpan(&byte, 1), MSG_DONTWAIT, &fds);
    if (io.error != 0 || (io.bytes == 0 && fds.empty())) break;
  }
  if (acceptor_ != nullptr) acceptor_->Release(fd);
  close(fd);
}

}  // namespace kvd::daemon
