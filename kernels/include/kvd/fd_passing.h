// Passing FDs between processes over a connected Unix socket with SCM_RIGHTS (Note [FD hygiene] in
// docs/architecture.md). Each message carries a payload (at least one byte) and up to kMaxFdsPerMessage FDs. Thread
// compatible: one sender and one receiver per socket at a time.
//
// Two levels: SendWithFds/ReceiveWithFds (blocking, a Status each) for the tools and libkvd, and the one
// sendmsg/recvmsg under them, SendMessage/ReceiveMessage, which the daemon's non-blocking handle channel
// calls with MSG_DONTWAIT. The SCM_RIGHTS control message is built and read only there.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvd/unique_fd.h"

namespace kvd {

// Linux caps one SCM_RIGHTS message at 253 FDs (SCM_MAX_FD); kvd sends at most 250.
inline constexpr size_t kMaxFdsPerMessage = 250;

// Sends `payload` (non-empty) with `fds` (at most kMaxFdsPerMessage; they stay the caller's).
[[nodiscard]] absl::Status SendWithFds(int socket, absl::string_view payload, absl::Span<const int> fds);

struct MessageWithFds {
  std::string payload;
  std::vector<int> fds;  // owned by the receiver: close each one
};

// Receives one message of at most `max_payload` bytes. UNAVAILABLE when the peer has closed the
// socket; DATA_LOSS when the payload or the FDs were truncated (received FDs are closed then).
[[nodiscard]] absl::StatusOr<MessageWithFds> ReceiveWithFds(int socket, size_t max_payload);

// What one sendmsg(2) or recvmsg(2) did: `bytes` moved, or `error` (its errno; 0 when it succeeded), and for a
// receive the message's flags (MSG_TRUNC, MSG_CTRUNC).
struct MessageIo {
  size_t bytes = 0;
  int error = 0;
  int flags = 0;
};

// One sendmsg of `payload` with `fds` (at most kMaxFdsPerMessage; they stay the caller's) as one SCM_RIGHTS
// control message, none when `fds` is empty; `flags` | MSG_NOSIGNAL, retried on EINTR. On a stream socket the
// FDs travel with the first byte and `bytes` may be short of the payload.
[[nodiscard]] MessageIo SendMessage(int socket, absl::string_view payload, absl::Span<const int> fds, int flags);

// One recvmsg into `buffer` with `flags` | MSG_CMSG_CLOEXEC, retried on EINTR. Every FD that arrived (a peer may
// attach FDs to anything it sends, up to kMaxFdsPerMessage) is appended to `*fds`, owned, whatever else happened.
[[nodiscard]] MessageIo ReceiveMessage(int socket, absl::Span<char> buffer, int flags, std::vector<UniqueFd>* fds);

// Lifts this process's soft open-file limit to its hard limit (children inherit it), for programs
// that hold one FD per chunk of many chunks at once (the benchmarks). Best effort: a failure leaves
// the limit as it was.
void RaiseOpenFileLimit();

}  // namespace kvd
