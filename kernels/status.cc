#include "kvd/status.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

constexpr absl::string_view kOutOfFds = "; out of file descriptors, not out of memory";

}  // namespace

bool IsOutOfFileDescriptors(const absl::Status& status) {
  return absl::IsResourceExhausted(status) && absl::StrContains(status.message(), kOutOfFds);
}

absl::Status ErrnoStatus(int err, absl::string_view call) {
  // strerrordesc_np/strerrorname_np (glibc 2.32) are thread-safe and never format into a buffer.
  const char* text = strerrordesc_np(err);
  const char* name = strerrorname_np(err);
  std::string message = absl::StrCat(call, ": ", text != nullptr ? text : "Unknown error", " (",
                                     name != nullptr ? std::string(name) : absl::StrCat("errno ", err), ")");
  switch (err) {
    case ENOMEM:
    case ENOSPC:
    case ENOBUFS:
    case ETOOMANYREFS:
      return absl::ResourceExhaustedError(message);
    case EMFILE:
    case ENFILE:
      // Not device or host memory: the process (EMFILE) or the system (ENFILE) ran out of FDs.
      return absl::ResourceExhaustedError(
          absl::StrCat(message, kOutOfFds, ": raise the limit (ulimit -n, LimitNOFILE=)"));
    case EINVAL:
    case EBADF:
      return absl::InvalidArgumentError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EEXIST:
    case EADDRINUSE:
      return absl::AlreadyExistsError(message);
    case EAGAIN:  // == EWOULDBLOCK on Linux
    case EINTR:
    case EPIPE:
    case ECONNRESET:
    case ENOTCONN:
    case ECONNREFUSED:
      return absl::UnavailableError(message);
    case ETIMEDOUT:
      return absl::DeadlineExceededError(message);
    case ENOSYS:
    case EOPNOTSUPP:  // == ENOTSUP on Linux
      return absl::UnimplementedError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace kvd
