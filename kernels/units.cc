#include "kvd/units.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvd {
namespace {

struct Unit {
  const char* name;
  uint64_t factor;
};
constexpr Unit kUnits[] = {{"", 1},
                           {"b", 1},
                           {"kib", uint64_t{1} << 10},
                           {"mib", uint64_t{1} << 20},
                           {"gib", uint64_t{1} << 30},
                           {"tib", uint64_t{1} << 40},
                           {"k", uint64_t{1} << 10},
                           {"m", uint64_t{1} << 20},
                           {"g", uint64_t{1} << 30},
                           {"t", uint64_t{1} << 40},
                           {"kb", 1000},
                           {"mb", 1000 * 1000},
                           {"gb", 1000 * 1000 * 1000},
                           {"tb", uint64_t{1000} * 1000 * 1000 * 1000}};

}  // namespace

absl::StatusOr<uint64_t> ParseBytes(absl::string_view text, absl::string_view field) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", text, "\" is not a size (examples: 4096, 512MiB, 10GiB, 1.5TB)"));
  };
  absl::string_view s = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < s.size() && (absl::ascii_isdigit(static_cast<unsigned char>(s[digits])) || s[digits] == '.')) {
    ++digits;
  }
  if (digits == 0) return bad();
  const absl::string_view number = s.substr(0, digits);
  const std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(digits)));
  for (const Unit& u : kUnits) {
    if (unit != u.name) continue;
    uint64_t whole = 0;
    if (number.find('.') == absl::string_view::npos) {
      if (!absl::SimpleAtoi(number, &whole)) return bad();
      uint64_t r;
      if (__builtin_mul_overflow(whole, u.factor, &r)) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": \"", text, "\" is too large"));
      }
      return r;
    }
    double d = 0;
    if (!absl::SimpleAtod(number, &d) || !std::isfinite(d)) return bad();
    const long double bytes = static_cast<long double>(d) * u.factor;
    if (bytes >= 18446744073709551615.0L) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": \"", text, "\" is too large"));
    }
    return static_cast<uint64_t>(bytes);
  }
  return bad();
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  if (v < 10) return absl::StrFormat("%.2f %s", v, kNames[u]);
  if (v < 100) return absl::StrFormat("%.1f %s", v, kNames[u]);
  return absl::StrFormat("%.0f %s", v, kNames[u]);
}

}  // namespace kvd
