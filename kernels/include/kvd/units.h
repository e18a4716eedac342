// Byte sizes for people: "10GiB", "512MiB", "2MB", "4096" in, "1.5 GiB" out. Shared by kvd's flags,
// kvctl and the tools.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvd {

// A non-negative size with an optional unit: B, KiB/MiB/GiB/TiB (powers of 1024), KB/MB/GB/TB (powers
// of 1000); case-insensitive, spaces allowed before the unit, decimals allowed ("1.5GiB"), the result
// rounded down to whole bytes. INVALID_ARGUMENT naming `field` on anything else or on overflow.
[[nodiscard]] absl::StatusOr<uint64_t> ParseBytes(absl::string_view text, absl::string_view field);

// "0 B", "512 B", "2.00 MiB", "32.0 MiB", "140 GiB": binary units, three significant digits.
std::string FormatBytes(uint64_t bytes);

}  // namespace kvd
