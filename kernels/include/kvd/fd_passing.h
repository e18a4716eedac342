// Passing FDs between processes over a connected Unix socket with SCM_RIGHTS (Note [FD hygiene] in
// docs/architecture.md). Each message carries a payload (at least one byte) and up to kMaxFdsPerMessage FDs. Thread
// compatible: one sender and one receiver per socket at a time.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

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

// Lifts this process's soft open-file limit to its hard limit (children inherit it), for programs
// that hold one FD per chunk of many chunks at once (the benchmarks). Best effort: a failure leaves
// the limit as it was.
void RaiseOpenFileLimit();

}  // namespace kvd
