// Status helpers used across kvd. Debian's Abseil (20220623) has no ABSL_RETURN_IF_ERROR or
// ABSL_ASSIGN_OR_RETURN, so kvd defines its own, once, here.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVD_STATUS_CONCAT_INNER_(a, b) a##b
#define KVD_STATUS_CONCAT_(a, b) KVD_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define KVD_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status kvd_status_ = (expr);       \
    if (!kvd_status_.ok()) return kvd_status_; \
  } while (false)

// `lhs` = the value of `rexpr` (an absl::StatusOr<T>), or returns its status from the enclosing
// function. `lhs` may declare a variable: KVD_ASSIGN_OR_RETURN(Chunk c, device->Create(n));
#define KVD_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVD_ASSIGN_OR_RETURN_IMPL_(KVD_STATUS_CONCAT_(kvd_statusor_, __LINE__), lhs, rexpr)

#define KVD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)   \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)
