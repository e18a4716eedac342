#include "daemon/core/layout.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(LayoutTest, ParsesEachOfTheSixAndPrintsItBack) {
  ASSERT_EQ(Layout::All().size(), 6u);
  for (Layout layout : Layout::All()) {
    KVD_ASSERT_OK_AND_ASSIGN(Layout parsed, Layout::Parse(layout.name()));
    EXPECT_EQ(parsed, layout);
    std::string lower(layout.name());
    for (char& c : lower) c = static_cast<char>(std::tolower(c));
    KVD_ASSERT_OK_AND_ASSIGN(Layout from_lower, Layout::Parse(lower));
    EXPECT_EQ(from_lower, layout);
  }
  EXPECT_EQ(Layout::Default().name(), "LBNHC");
}

TEST(LayoutTest, OrderIsAPermutationOfTheFiveDimsWithBWhereTheNameSays) {
  for (Layout layout : Layout::All()) {
    std::string spelled;
    for (Dim d : layout.order()) spelled += DimName(d);
    EXPECT_EQ(spelled, layout.name());
    EXPECT_EQ(spelled.find('B'), static_cast<size_t>(layout.block_position()));
    EXPECT_EQ(layout.block_outermost(), spelled.front() == 'B');
  }
}

TEST(LayoutTest, UnknownStringsAreInvalidArgumentNamingTheFieldAndTheAcceptedValues) {
  for (const char* bad : {"", "LBHN", "LBHNCC", "LLHNC", "XBHNC", "block-outermost", " LBNHC"}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(Layout::Parse(bad, "layout_request.override_layout"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("layout_request.override_layout"), HasSubstr("LBHNC, LBNHC, LHBNC"))));
  }
}

TEST(LayoutSetTest, ClassesExpandToTheirMembers) {
  KVD_ASSERT_OK_AND_ASSIGN(LayoutSet block, LayoutSet::Parse("block-outermost", "f"));
  EXPECT_EQ(block.ToString(), "{BLHNC, BLNHC, BHLNC}");
  KVD_ASSERT_OK_AND_ASSIGN(LayoutSet layer, LayoutSet::Parse("Layer-Outermost", "f"));
  EXPECT_EQ(layer.ToString(), "{LBHNC, LBNHC, LHBNC}");
  KVD_ASSERT_OK_AND_ASSIGN(LayoutSet any, LayoutSet::Parse("any", "f"));
  EXPECT_EQ(any.size(), 6);
  KVD_ASSERT_OK_AND_ASSIGN(LayoutSet one, LayoutSet::Parse("bhlnc", "f"));
  EXPECT_EQ(one.ToString(), "{BHLNC}");
  EXPECT_TRUE(block.Intersect(layer).empty());
  EXPECT_EQ(block.Union(layer), any);
  EXPECT_THAT(LayoutSet::Parse("blocks-outermost", "backend_requirements[0].layouts[1]"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("backend_requirements[0].layouts[1]"), HasSubstr("block-outermost"))));
}

TEST(LayoutSetTest, IteratesInCanonicalOrder) {
  LayoutSet s = LayoutSet::Of(*Layout::Parse("BHLNC")).Union(LayoutSet::Of(*Layout::Parse("LBHNC")));
  std::vector<absl::string_view> names;
  for (Layout l : s.layouts()) names.push_back(l.name());
  EXPECT_THAT(names, ElementsAre("LBHNC", "BHLNC"));
}

}  // namespace
}  // namespace kvd::daemon
