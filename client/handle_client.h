// The client side of a kvd daemon's handle channel (docs/api.md, "The handle channel protocol"; its
// messages are at the bottom of proto/kvd/v1/kvd.proto): opening a session, whose token authenticates the client's gRPC
// calls, and redeeming leases for chunk FDs. Used by the client library and the daemon's tests.
//
// Errors are absl::Status: the daemon's HandleChannelError arrives with its code and message unchanged;
// UNAVAILABLE when no daemon listens at the path or the daemon went away mid-way; DEADLINE_EXCEEDED
// when the daemon does not answer within HandleClientOptions::timeout; INTERNAL/DATA_LOSS when a
// reply breaks the protocol. No call leaves an FD behind on failure.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvd {

struct HandleClientOptions {
  // The longest one call (Open, Fetch) waits for the daemon: to connect, to send, for every reply.
  absl::Duration timeout = absl::Seconds(30);
};

// A session with a kvd daemon's handle channel. Move-only; closing it (destructor) ends the session,
// and the daemon then detaches every client attached through it.
//
// Threads: Fetch may be called from several threads at once (each call uses its own connection);
// Close, moves and destruction must not race with anything else on the same object.
class HandleSession {
 public:
  // Connects to the handle channel at `handles_path` and opens a session named `client_name`
  // ([A-Za-z0-9._-]{0,64}; the daemon refuses other names with INVALID_ARGUMENT).
  [[nodiscard]] static absl::StatusOr<HandleSession> Open(std::string handles_path, absl::string_view client_name,
                                                          HandleClientOptions options = {});

  HandleSession(HandleSession&& other) noexcept;
  HandleSession& operator=(HandleSession&& other) noexcept;
  HandleSession(const HandleSession&) = delete;
  HandleSession& operator=(const HandleSession&) = delete;
  ~HandleSession();  // Close()

  // The session token: send it as "kvd-session" metadata on RPCs.
  const std::string& token() const { return token_; }
  // The peer identity the daemon saw (SO_PEERCRED).
  uint32_t uid() const { return uid_; }
  int32_t pid() const { return pid_; }
  const std::string& path() const { return path_; }
  bool is_open() const { return fd_ >= 0; }
  // Whether the session's connection is still up: false once the daemon closed it (it exited or
  // restarted; its sessions do not survive) or after Close(). Does not block.
  bool Alive() const;

  // Redeems a lease: (chunk id, FD) in the lease's order. The caller owns and closes the FDs (each has
  // FD_CLOEXEC set). On failure every FD received so far is closed. FAILED_PRECONDITION once closed.
  // `skip_released` (FetchHandles.skip_released): the chunks a release took out of the pool since the lease
  // was issued are left out of the result instead of failing the fetch.
  using LeasedFds = std::vector<std::pair<uint64_t, int>>;
  [[nodiscard]] absl::StatusOr<LeasedFds> Fetch(absl::string_view lease_token, bool skip_released = false) const;

  // After an Attach with push_handles answered handles_pushed (docs/api.md, "Pushed handles"): the lease's
  // (chunk id, FD) from the batch the daemon pushed on the session's connection before its reply. Batches of
  // other leases queued before it (an earlier Attach whose reply never came) are dropped, their FDs closed.
  // Never waits. One caller at a time per session (libkvd: Client::Impl::push_mu).
  [[nodiscard]] absl::StatusOr<LeasedFds> TakePushed(absl::string_view lease_token) const;

  // What the daemon answered to ReturnHandles (proto HandlesReturned).
  struct Returned {
    std::vector<uint64_t> adopted_chunk_ids;
    std::vector<uint64_t> missing_chunk_ids;
    int state = 0;  // kvd.v1.PoolState
  };
  // After a daemon restart: gives the FDs of `pool`'s chunks back to the daemon (a RECOVERING pool),
  // in packets of at most 250 FDs, on a connection of its own. The FDs stay the caller's. The
  // daemon's refusal arrives with its code and message unchanged.
  [[nodiscard]] absl::StatusOr<Returned> ReturnHandles(absl::string_view pool,
                                                       const std::vector<std::pair<uint64_t, int>>& chunks) const;

  // Ends the session (closes its connection). Idempotent.
  void Close();

 private:
  HandleSession(std::string path, HandleClientOptions options) : path_(std::move(path)), options_(options) {}

  std::string path_;
  HandleClientOptions options_;
  int fd_ = -1;  // the session's connection: its liveness
  std::string token_;
  uint32_t uid_ = 0;
  int32_t pid_ = 0;
};

// Closes every FD of `fds` and empties it.
void CloseLeased(HandleSession::LeasedFds& fds);

}  // namespace kvd
