// GoogleMock matchers for absl::Status / absl::StatusOr (Debian's Abseil ships none).
//   EXPECT_THAT(status, IsOk());
//   EXPECT_THAT(result, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dims.heads")));
#pragma once

#include <ostream>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "kvd/status.h"

namespace kvd::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

MATCHER_P2(StatusIs, code, message_matcher, "has the status code and a matching message") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code && ::testing::ExplainMatchResult(::testing::MatcherCast<std::string>(message_matcher),
                                                           std::string(s.message()), result_listener);
}

// An OK absl::StatusOr whose value matches `value_matcher`.
MATCHER_P(IsOkAndHolds, value_matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace kvd::testing

// Asserts that `rexpr` (an absl::StatusOr) is OK and moves its value into `lhs`.
#define KVD_ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  KVD_ASSERT_OK_AND_ASSIGN_IMPL_(KVD_STATUS_CONCAT_(kvd_test_statusor_, __LINE__), lhs, rexpr)
#define KVD_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  ASSERT_TRUE(statusor.ok()) << statusor.status();           \
  lhs = *std::move(statusor)
