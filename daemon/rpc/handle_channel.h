// The handle channel server (docs/api.md, "The handle channel protocol" and "Identity"; its messages are
// at the bottom of proto/kvd/v1/kvd.proto). A SOCK_SEQPACKET Unix socket beside the gRPC one, on which a client
//   - opens a session (OpenSession): the daemon learns the peer's uid and pid from SO_PEERCRED, asks the
//     backend for a session token and keeps the connection open as the session's liveness; when the
//     connection reaches EOF (the client closed it or died) the backend's CloseSession is called;
//   - redeems a lease (FetchHandles): the backend checks the lease against the session and the peer's
//     uid and hands over one FD per chunk; the channel sends them as HandleBatch packets of at most
//     kMaxFdsPerMessage FDs, closes every FD and then the connection;
//   - is pushed a lease on its session's connection (Push, for Attach's push_handles: Note [Pushed handles] in
//     docs/architecture.md).
// Every failure is answered with one HandleChannelError (a canonical absl::StatusCode and a message)
// before the connection is closed.
//
// Threads. One accept thread (PeerAcceptor, shared with the control socket) reads the peer's credentials
// and checks the connection limits; one watcher thread polls every connection that has not sent its request yet (with
// a deadline) and every open session (for EOF), and answers OpenSession itself; FetchHandles requests
// are queued and served by at most Options::max_fetch_workers worker threads, started on demand and
// ending when the queue is empty. A worker that cannot be started (the process is out of threads or
// memory) is not an abort: the fetch waits for a running worker, or, when none runs, is answered
// RESOURCE_EXHAUSTED. The number of connections of any kind is bounded by Options::max_connections in
// total and Options::max_connections_per_uid per peer uid, so the queue is too. No socket operation
// blocks: a peer that stops reading is dropped after Options::send_timeout, and Stop() interrupts
// every wait.
//
// Ownership. The channel owns its sockets and every FD that RedeemLease hands it (closed on every path,
// success or failure). The backend must outlive the channel; its methods are called from the
// channel's threads, concurrently, and must be thread-safe. The channel logs nothing: it counts.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/rpc/peer_acceptor.h"
#include "kvd/unique_fd.h"
#include "kvd/v1/kvd.pb.h"

namespace kvd::daemon {

// What the channel needs from the daemon (PoolManager implements it through a small adapter).
// Called from the channel's threads, concurrently: implementations must be thread-safe.
class HandleChannelBackend {
 public:
  virtual ~HandleChannelBackend() = default;

  // A new session for the peer (uid and pid from SO_PEERCRED; `name` is what the client called itself,
  // already checked to be [A-Za-z0-9._-]{0,64}). Returns the session token, or an error (a session
  // limit: RESOURCE_EXHAUSTED) that reaches the client unchanged.
  [[nodiscard]] virtual absl::StatusOr<std::string> OpenSession(uint32_t uid, int32_t pid, std::string name) = 0;
  // The session's connection has closed (or the channel is stopping). Called exactly once per token
  // that OpenSession returned.
  virtual void CloseSession(absl::string_view session) = 0;

  struct LeasedFd {
    uint64_t chunk_id;
    int fd;  // owned by the channel after the call: it closes it once sent (or on failure)
  };
  // The FDs of a lease, in the lease's order. `peer_uid` is the fetching connection's SO_PEERCRED uid;
  // `skip_released` is the request's FetchHandles.skip_released. Errors (UNAUTHENTICATED,
  // PERMISSION_DENIED, NOT_FOUND, ...) reach the client unchanged. On error the backend keeps (and closes)
  // whatever it opened.
  [[nodiscard]] virtual absl::StatusOr<std::vector<LeasedFd>> RedeemLease(absl::string_view session,
                                                                          absl::string_view lease, uint32_t peer_uid,
                                                                          bool skip_released) = 0;
  // ReturnHandles after a restart: FDs of `pool`'s chunks, by chunk id, from a connection whose
  // SO_PEERCRED uid is `peer_uid`. The backend owns the FDs.
  [[nodiscard]] virtual absl::StatusOr<v1::HandlesReturned> ReturnHandles(
      absl::string_view session, uint32_t peer_uid, absl::string_view pool,
      std::vector<std::pair<uint64_t, UniqueFd>> fds) = 0;
};

class HandleChannel {
 public:
  struct Options {
    // Connections of every kind (waiting for their request, sessions, fetches) served at once; beyond
    // it a new connection gets RESOURCE_EXHAUSTED naming --max-handle-connections and is closed. The
    // last `reserved_connections` of them only operator uids (root and `operator_uid`) may take.
    size_t max_connections = 1024;
    size_t reserved_connections = 0;
    uint32_t operator_uid = 0;
    // Connections of one peer uid at once (operator uids are bound by max_connections alone); beyond
    // it RESOURCE_EXHAUSTED naming --max-handle-connections-per-uid.
    size_t max_connections_per_uid = 1024;
    // Fetches served at once; the rest wait in a queue, in arrival order.
    size_t max_fetch_workers = 16;
    // A peer that connects and sends no request within this is sent DEADLINE_EXCEEDED and dropped.
    absl::Duration first_request_timeout = absl::Seconds(5);
    // A larger request is refused with INVALID_ARGUMENT.
    size_t max_request_bytes = 64 * 1024;
    // A peer that does not read a reply within this is dropped (its fetch fails, its FDs are closed).
    absl::Duration send_timeout = absl::Seconds(10);
    // Most FDs one ReturnHandles call may give back (its packets together).
    size_t max_returned_fds = 65536;
  };

  // Monotonic counters, for metrics.
  struct Stats {
    uint64_t sessions_opened = 0;
    uint64_t sessions_closed = 0;
    uint64_t fetches_served = 0;  // leases whose every batch was sent
    uint64_t fds_sent = 0;        // fetched and pushed
    uint64_t leases_pushed = 0;   // leases sent on their session's connection (Push)
    uint64_t errors = 0;          // error replies sent, connections refused, dropped or failed
  };

  // Binds a SOCK_SEQPACKET|SOCK_CLOEXEC Unix socket at `path` (the caller has already made sure no live
  // daemon owns it and removed a stale file), chmod 0660, listens, and serves on background threads.
  // `backend` must outlive the channel. Errors: INVALID_ARGUMENT (empty or too long a path, no backend,
  // bad options), ALREADY_EXISTS (the path exists), PERMISSION_DENIED, NOT_FOUND (no such directory),
  // RESOURCE_EXHAUSTED (out of FDs or threads), INTERNAL; nothing is left behind on failure.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HandleChannel>> Start(std::string path,
                                                                            HandleChannelBackend* backend,
                                                                            Options options);
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HandleChannel>> Start(std::string path,
                                                                            HandleChannelBackend* backend) {
    return Start(std::move(path), backend, Options());
  }

  HandleChannel(const HandleChannel&) = delete;
  HandleChannel& operator=(const HandleChannel&) = delete;
  ~HandleChannel();  // Stop()

  // Stops accepting, closes every connection (each open session is closed through the backend, every
  // in-flight fetch is abandoned and its FDs closed), joins all threads and unlinks the socket (if the
  // path still names it). Returns promptly whatever the peers do (a backend call in progress is waited
  // for). Idempotent and thread-safe; must not be called from a backend callback.
  void Stop();

  // Sends `fds`, the FDs of `chunk_ids` (a lease just redeemed for Attach's push_handles; they stay the caller's),
  // on the connection of session `session` as one HandleBatch with last and `lease_token` set (docs/api.md,
  // "Pushed handles"). Never blocks: FAILED_PRECONDITION when they need more than one packet, NOT_FOUND when the
  // session has no open connection, UNAVAILABLE when its queue has no room now or the send fails. Thread-safe.
  [[nodiscard]] absl::Status Push(absl::string_view session, absl::string_view lease_token,
                                  absl::Span<const uint64_t> chunk_ids, absl::Span<const int> fds);

  const std::string& path() const { return path_; }
  size_t open_sessions() const { return open_sessions_.load(std::memory_order_relaxed); }
  Stats stats() const;
  // Open connections by peer uid (uids with none are absent), and connections refused by the limits
  // (total, per uid) since start; for metrics.
  std::map<uint32_t, uint64_t> ConnectionsByUid() const;
  using Refusals = PeerAcceptor::Refusals;  // total: --max-handle-connections; per_uid: its -per-uid
  Refusals refusals() const;

 private:
  struct Connection;

  HandleChannel(std::string path, HandleChannelBackend* backend, Options options);

  // A connection the acceptor admitted: queued for the watcher.
  void Accepted(int fd, const PeerCred& peer);
  void WatchLoop();
  // Reads and answers the first request of `conn` (readable now). Returns true when there is no request
  // yet and `conn` keeps waiting; otherwise `conn` was moved into `sessions`, handed to a fetch worker
  // or closed.
  bool ServeFirstRequest(Connection& conn, std::vector<Connection>& sessions);
  struct Fetch;
  void ServeFetch(Connection conn, std::string session, std::string lease, bool skip_released);
  // Queues a fetch and starts a worker when fewer than max_fetch_workers run.
  void SpawnFetch(Fetch fetch);
  // ReturnHandles: the rest of the packets, then the backend (on a fetch worker).
  void ServeReturn(Connection conn, v1::ReturnHandles first, std::vector<UniqueFd> fds);
  // A worker: serves queued fetches until the queue is empty.
  void FetchWorker(std::list<std::thread>::iterator self);
  void ReapFinishedWorkers();
  // After a failed poll (errno set): returns at once on EINTR, else counts an error and waits a little.
  void BackOffAfterPollFailure();
  // Returns after `timeout` or as soon as Stop() began.
  void WaitForStop(absl::Duration timeout);
  // Sends `status` as a HandleChannelError (best effort, never blocking) and closes the connection.
  void Reject(int fd, const absl::Status& status);
  void CloseConnection(int fd);
  // A session's connection is about to close: Push no longer sends on it.
  void ForgetSession(const std::string& session);

  const std::string path_;
  HandleChannelBackend* const backend_;
  const Options options_;
  // Listens, accepts and counts the connections; CloseConnection releases each.
  std::unique_ptr<PeerAcceptor> acceptor_;
  UniqueFd stop_fd_;    // eventfd: readable once Stop() began; every poll in the channel watches it
  UniqueFd notify_fd_;  // eventfd: the accept thread has queued connections for the watcher

  std::atomic<size_t> open_sessions_{0};
  std::atomic<uint64_t> sessions_opened_{0};
  std::atomic<uint64_t> sessions_closed_{0};
  std::atomic<uint64_t> fetches_served_{0};
  std::atomic<uint64_t> fds_sent_{0};
  std::atomic<uint64_t> leases_pushed_{0};
  std::atomic<uint64_t> errors_{0};

  std::thread watch_thread_;

  // Each open session's connection by token, for Push. The watcher adds a session and removes it before it
  // closes the connection; Push sends under the lock, so the FD it sends on is the session's.
  absl::Mutex sessions_mu_;
  absl::flat_hash_map<std::string, int> session_fds_ ABSL_GUARDED_BY(sessions_mu_);

  mutable absl::Mutex mu_;
  std::vector<Connection> accepted_ ABSL_GUARDED_BY(mu_);   // accept thread -> watcher
  std::list<Fetch> fetches_ ABSL_GUARDED_BY(mu_);           // fetches waiting for a worker
  std::list<std::thread> workers_ ABSL_GUARDED_BY(mu_);     // running workers
  std::vector<std::thread> finished_ ABSL_GUARDED_BY(mu_);  // workers done, to be joined

  absl::Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
};

}  // namespace kvd::daemon
