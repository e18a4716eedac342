// PeerAcceptor: the accept loop of both of kvd's Unix sockets, the gRPC control socket (ControlSocket)
// and the handle channel (HandleChannel). It binds and listens on a path, accepts every connection, reads
// its SO_PEERCRED (uid, gid, pid) and counts it against the socket's connection limits before anyone
// reads a byte of it: at most Options::max_connections_per_uid connections of one peer uid, and at most
// Options::max_connections of all uids together, the last Options::reserved_connections of which only
// operator uids (root and Options::operator_uid) may take. Operator uids are bound by the total alone
// (daemon/core/limits.h). A connection within the limits goes to the `admitted` callback, any other to
// `refused` with RESOURCE_EXHAUSTED naming the limit and its flag, e.g.
//   "handle-channel connections of uid 1000: 3 of 3 (--max-handle-connections-per-uid)"
//   "control-socket connections of all uids: 7 of 7 for uid 1002 (--max-control-connections=8, less 1
//    kept for root and uid 0 by --operator-reserve)".
//
// Counting. An admitted connection counts until its owner calls Release(fd) (before closing it), or
// until its FD is seen closed: the acceptor records each connection's socket inode, and before it
// refuses a connection (and whenever usage is read) it drops the connections whose FD number no longer
// names that socket. So a connection handed to code that closes it without telling (gRPC, for the
// control socket) stops counting once closed, and one that is Released is uncounted at once.
//
// Errors. Listen fails with the errno of socket/bind/stat/chmod/listen (ErrnoStatus: ALREADY_EXISTS for a
// path that exists, NOT_FOUND for a missing directory, ...); nothing is left behind. At run time a failed
// accept (EMFILE: the daemon is out of file descriptors) leaves the connection in the backlog; the loop
// counts it (accept_errors()) and retries after 100 ms, never spinning.
//
// Threads. One accept thread, started by Start and joined by Stop (also by the destructor); the
// callbacks run on it and must not block. Release, PeerOf and the accessors are thread-safe. The socket
// file is the owner's to remove (socket_id() tells whether the path still names it).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvd/unique_fd.h"

namespace kvd::daemon {

// A connection's peer as SO_PEERCRED reported it at accept.
struct PeerCred {
  uint32_t uid = 0;
  uint32_t gid = 0;
  int32_t pid = 0;
};

class PeerAcceptor {
 public:
  struct Options {
    int type = 0;      // SOCK_STREAM or SOCK_SEQPACKET
    mode_t mode = 0;   // of the socket file, set before listen()
    std::string what;  // in refusals: "handle-channel connections"
    size_t max_connections = 1024;
    std::string max_connections_flag;  // "--max-handle-connections"
    size_t reserved_connections = 0;   // < max_connections
    uint32_t operator_uid = 0;         // besides root
    size_t max_connections_per_uid = 1024;
    std::string max_connections_per_uid_flag;  // "--max-handle-connections-per-uid"
  };
  // Called on the accept thread with a connection's FD, which the callee owns from then on.
  using Admitted = std::function<void(int fd, const PeerCred& peer)>;
  // `why`: RESOURCE_EXHAUSTED from a limit, or the failure to read the peer's credentials.
  using Refused = std::function<void(int fd, const absl::Status& why)>;

  // Binds a `options.type` Unix socket (CLOEXEC, non-blocking) at `path`, which must not exist, makes it
  // `options.mode` and listens. INVALID_ARGUMENT for an empty or too long path or bad options.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PeerAcceptor>> Listen(const std::string& path, Options options);
  ~PeerAcceptor();
  PeerAcceptor(const PeerAcceptor&) = delete;
  PeerAcceptor& operator=(const PeerAcceptor&) = delete;

  // Starts the accept thread. RESOURCE_EXHAUSTED when it cannot be started (out of threads or memory).
  [[nodiscard]] absl::Status Start(Admitted admitted, Refused refused);
  // Stops accepting, joins the accept thread and closes the listening socket; admitted connections are
  // their owners'. Idempotent.
  void Stop();

  // The admitted connection `fd` is about to be closed: it stops counting. Call before closing it.
  void Release(int fd) ABSL_LOCKS_EXCLUDED(mu_);
  // The credentials of the open connection `fd`; nullopt for any other FD.
  std::optional<PeerCred> PeerOf(int fd) const ABSL_LOCKS_EXCLUDED(mu_);
  // Open connections by peer uid (uids with none are absent).
  std::map<uint32_t, uint64_t> ConnectionsByUid() ABSL_LOCKS_EXCLUDED(mu_);
  struct Refusals {
    uint64_t total = 0;    // by max_connections
    uint64_t per_uid = 0;  // by max_connections_per_uid
  };
  Refusals refusals() const;
  uint64_t accept_errors() const { return accept_errors_.load(std::memory_order_relaxed); }
  // The bound socket file's device and inode.
  dev_t socket_dev() const { return socket_dev_; }
  ino_t socket_ino() const { return socket_ino_; }

 private:
  struct Open {
    PeerCred peer;
    dev_t dev = 0;
    ino_t ino = 0;
  };

  explicit PeerAcceptor(Options options) : options_(std::move(options)) {}
  void AcceptLoop(Admitted admitted, Refused refused);
  // Counts `fd` (socket `dev`/`ino`) of `peer` against the limits, or says which limit it would pass.
  [[nodiscard]] absl::Status Admit(int fd, const PeerCred& peer, dev_t dev, ino_t ino) ABSL_LOCKS_EXCLUDED(mu_);
  // RESOURCE_EXHAUSTED when one more connection of `uid` would pass a limit; `count_refusal` counts it.
  [[nodiscard]] absl::Status CheckLimits(uint32_t uid, bool count_refusal) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the connections whose FD no longer names their socket (closed without Release).
  void ForgetClosedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(std::map<int, Open>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits `ms` or until Stop() began; true in the latter case.
  bool WaitForStop(int ms);

  const Options options_;
  UniqueFd listen_fd_;
  UniqueFd stop_fd_;  // an eventfd: readable once Stop() was called
  dev_t socket_dev_ = 0;
  ino_t socket_ino_ = 0;
  std::thread accept_thread_;
  std::atomic<uint64_t> accept_errors_{0};
  std::atomic<uint64_t> refused_total_{0};
  std::atomic<uint64_t> refused_per_uid_{0};

  // A leaf lock.
  mutable absl::Mutex mu_;
  std::map<int, Open> open_ ABSL_GUARDED_BY(mu_);             // by FD
  std::map<uint32_t, uint64_t> by_uid_ ABSL_GUARDED_BY(mu_);  // open connections of each uid
};

}  // namespace kvd::daemon
