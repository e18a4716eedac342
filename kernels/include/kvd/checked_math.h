// Overflow-checked unsigned arithmetic for sizes that come from requests and callers, used by the
// device layer and the daemon alike.
#pragma once

#include <cstdint>
#include <optional>

namespace kvd {

inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// `value` rounded up to a multiple of `align` (a power of two).
inline std::optional<uint64_t> CheckedRoundUp(uint64_t value, uint64_t align) {
  std::optional<uint64_t> r = CheckedAdd(value, align - 1);
  if (!r) return std::nullopt;
  return *r & ~(align - 1);
}

}  // namespace kvd
