#include "kvd/units.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd {
namespace {

using ::kvd::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ParseBytesTest, AcceptsPlainNumbersAndBinaryAndDecimalUnits) {
  const std::pair<const char*, uint64_t> cases[] = {
      {"0", 0},
      {"4096", 4096},
      {"17B", 17},
      {"2MiB", uint64_t{2} << 20},
      {"10GiB", uint64_t{10} << 30},
      {"10 gib", uint64_t{10} << 30},
      {" 1TiB ", uint64_t{1} << 40},
      {"512m", uint64_t{512} << 20},
      {"2MB", 2000000},
      {"1.5GiB", uint64_t{3} << 29},
      {"0.5KiB", 512},
      {"1TB", uint64_t{1000} * 1000 * 1000 * 1000},
  };
  for (const auto& [text, want] : cases) {
    KVD_ASSERT_OK_AND_ASSIGN(uint64_t got, ParseBytes(text, "--budget"));
    EXPECT_EQ(got, want) << text;
  }
}

TEST(ParseBytesTest, RejectsGarbageAndOverflowNamingTheField) {
  for (const char* bad : {"", "GiB", "-1", "10 GiBs", "1.2.3MiB", "ten", "0x10", "5%"}) {
    EXPECT_THAT(ParseBytes(bad, "--host-capacity"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--host-capacity")))
        << bad;
  }
  EXPECT_THAT(ParseBytes("17179869184TiB", "--budget"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too large")));
  EXPECT_THAT(ParseBytes("99999999999999999999", "--budget"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--budget")));
}

TEST(FormatBytesTest, UsesBinaryUnitsWithThreeSignificantDigits) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(2 << 20), "2.00 MiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 29), "1.50 GiB");
  EXPECT_EQ(FormatBytes(uint64_t{32} << 20), "32.0 MiB");
  EXPECT_EQ(FormatBytes(uint64_t{140} << 30), "140 GiB");
  EXPECT_EQ(FormatBytes(~uint64_t{0}), "16.0 EiB");
}

}  // namespace
}  // namespace kvd
