// Status helpers used across kvd. Debian's Abseil (20220623) has no ABSL_RETURN_IF_ERROR or
// ABSL_ASSIGN_OR_RETURN, so kvd defines its own, once, here; and the one errno -> Status table.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvd {

// The one translation of an errno value into a Status, used wherever a system call fails (docs/backends.md,
// the errors paragraph at its top). The message is "<call>: <strerror> (<errno name>)", e.g.
// "mmap(PROT_NONE, 4194304 bytes): Cannot allocate memory (ENOMEM)"; `call` should name the system
// call and what it was asked. The code:
//   ENOMEM, ENOSPC, ENOBUFS, ETOOMANYREFS      RESOURCE_EXHAUSTED
//   EMFILE, ENFILE                             RESOURCE_EXHAUSTED, saying it is file descriptors, not memory
//   EINVAL, EBADF                              INVALID_ARGUMENT
//   EACCES, EPERM                              PERMISSION_DENIED
//   ENOENT, ENOTDIR                            NOT_FOUND
//   EEXIST, EADDRINUSE                         ALREADY_EXISTS
//   EAGAIN (EWOULDBLOCK), EINTR                UNAVAILABLE
//   EPIPE, ECONNRESET, ENOTCONN, ECONNREFUSED  UNAVAILABLE (the peer is gone)
//   ETIMEDOUT                                  DEADLINE_EXCEEDED
//   ENOSYS, EOPNOTSUPP (ENOTSUP)               UNIMPLEMENTED
//   anything else                              INTERNAL
// Callers that know better for one errno (a closed peer is UNAVAILABLE, say) decide that themselves
// before calling this.
[[nodiscard]] absl::Status ErrnoStatus(int err, absl::string_view call);

// Whether `status` is ErrnoStatus's answer to EMFILE or ENFILE: out of file descriptors, which callers
// that word RESOURCE_EXHAUSTED as a shortage of memory must not.
bool IsOutOfFileDescriptors(const absl::Status& status);

}  // namespace kvd

#define KVD_STATUS_CONCAT_INNER_(a, b) a##b
#define KVD_STATUS_CONCAT_(a, b) KVD_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK. The local gets a
// unique name, so the macro nests (inside a lambda passed to a call that is itself checked).
#define KVD_RETURN_IF_ERROR(expr) KVD_RETURN_IF_ERROR_IMPL_(KVD_STATUS_CONCAT_(kvd_status_, __COUNTER__), expr)

#define KVD_RETURN_IF_ERROR_IMPL_(status, expr) \
  do {                                          \
    ::absl::Status status = (expr);             \
    if (!status.ok()) return status;            \
  } while (false)

// `lhs` = the value of `rexpr` (an absl::StatusOr<T>), or returns its status from the enclosing
// function. `lhs` may declare a variable: KVD_ASSIGN_OR_RETURN(Chunk c, device->Create(n));
#define KVD_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVD_ASSIGN_OR_RETURN_IMPL_(KVD_STATUS_CONCAT_(kvd_statusor_, __LINE__), lhs, rexpr)

#define KVD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)   \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)
