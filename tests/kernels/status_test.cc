// Tests ErrnoStatus (kvd/status.h): the one errno -> Status table, and the macros' nesting.
#include "kvd/status.h"

#include <cerrno>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd {
namespace {

using ::kvd::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ErrnoStatusTest, EveryErrnoOfTheTableGetsItsCode) {
  const struct {
    int err;
    absl::StatusCode code;
  } kTable[] = {
      {ENOMEM, absl::StatusCode::kResourceExhausted},
      {ENOSPC, absl::StatusCode::kResourceExhausted},
      {EMFILE, absl::StatusCode::kResourceExhausted},
      {ENFILE, absl::StatusCode::kResourceExhausted},
      {EINVAL, absl::StatusCode::kInvalidArgument},
      {EBADF, absl::StatusCode::kInvalidArgument},
      {EACCES, absl::StatusCode::kPermissionDenied},
      {EPERM, absl::StatusCode::kPermissionDenied},
      {ENOENT, absl::StatusCode::kNotFound},
      {EAGAIN, absl::StatusCode::kUnavailable},
      {EWOULDBLOCK, absl::StatusCode::kUnavailable},
      {EINTR, absl::StatusCode::kUnavailable},
      {ETIMEDOUT, absl::StatusCode::kDeadlineExceeded},
      {ENOSYS, absl::StatusCode::kUnimplemented},
      {EOPNOTSUPP, absl::StatusCode::kUnimplemented},
      {ENOTSUP, absl::StatusCode::kUnimplemented},
      {EIO, absl::StatusCode::kInternal},
      {EPIPE, absl::StatusCode::kUnavailable},
      {ECONNRESET, absl::StatusCode::kUnavailable},
      {ENOTCONN, absl::StatusCode::kUnavailable},
      {ECONNREFUSED, absl::StatusCode::kUnavailable},
      {EEXIST, absl::StatusCode::kAlreadyExists},
      {EADDRINUSE, absl::StatusCode::kAlreadyExists},
      {ENOTDIR, absl::StatusCode::kNotFound},
      {ENOBUFS, absl::StatusCode::kResourceExhausted},
      {ETOOMANYREFS, absl::StatusCode::kResourceExhausted},
      {EROFS, absl::StatusCode::kInternal},
  };
  for (const auto& row : kTable) {
    EXPECT_EQ(ErrnoStatus(row.err, "call").code(), row.code) << "errno " << row.err;
  }
}

TEST(ErrnoStatusTest, MessageNamesTheCallTheTextAndTheErrnoName) {
  EXPECT_THAT(
      ErrnoStatus(ENOMEM, "mmap(PROT_NONE, 4096 bytes)"),
      StatusIs(absl::StatusCode::kResourceExhausted, "mmap(PROT_NONE, 4096 bytes): Cannot allocate memory (ENOMEM)"));
}

TEST(ErrnoStatusTest, OutOfFileDescriptorsSaysItIsNotMemory) {
  EXPECT_THAT(ErrnoStatus(EMFILE, "memfd_create"),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("EMFILE"), HasSubstr("file descriptors, not out of memory"))));
  EXPECT_THAT(ErrnoStatus(ENFILE, "socket"), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("ulimit -n")));
  EXPECT_THAT(ErrnoStatus(ENOMEM, "mmap"),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::Not(HasSubstr("file descriptors"))));
}

TEST(ErrnoStatusTest, AnUnknownErrnoIsInternalAndKeepsItsNumber) {
  EXPECT_THAT(ErrnoStatus(9999, "ioctl"), StatusIs(absl::StatusCode::kInternal, HasSubstr("9999")));
}

absl::Status Nested(bool fail_inner) {
  auto inner = [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(fail_inner ? absl::InternalError("inner") : absl::OkStatus());
    return absl::OkStatus();
  };
  // Both on one line: the macro's locals must not collide (-Wshadow is an error here).
  KVD_RETURN_IF_ERROR([&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(inner());
    return absl::OkStatus();
  }());
  return absl::NotFoundError("after");
}

TEST(StatusMacrosTest, ReturnIfErrorNestsInsideALambdaOnOneLine) {
  EXPECT_THAT(Nested(true), StatusIs(absl::StatusCode::kInternal, "inner"));
  EXPECT_THAT(Nested(false), StatusIs(absl::StatusCode::kNotFound, "after"));
}

}  // namespace
}  // namespace kvd
