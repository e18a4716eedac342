#include "daemon/core/layout_chain.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::StatusIs;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

Layout L(absl::string_view name) { return *Layout::Parse(name); }

// The inputs of one resolution, every rule switched on or off.
struct Inputs {
  std::string request_override;
  std::optional<Layout> operator_override;
  std::vector<BackendRequirement> backends;
  std::string client_env;
  std::optional<Layout> daemon_env;
  std::vector<ConnectorPreference> connectors;
};

absl::StatusOr<LayoutResolution> Resolve(const Inputs& in) {
  return ResolveLayout({.override_layout = in.request_override,
                        .backend_requirements = in.backends,
                        .env_layout = in.client_env,
                        .connector_preferences = in.connectors},
                       {.operator_override = in.operator_override, .daemon_env = in.daemon_env});
}

struct Case {
  const char* name;
  Inputs in;
  const char* want_layout;
  LayoutRule want_rule;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class LayoutChainRuleTest : public ::testing::TestWithParam<Case> {};

TEST_P(LayoutChainRuleTest, TheRightRuleWins) {
  const Case& c = GetParam();
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution r, Resolve(c.in));
  EXPECT_EQ(r.layout.name(), c.want_layout);
  EXPECT_EQ(r.rule, c.want_rule) << "won by " << LayoutRuleName(r.rule) << " (" << r.rule_detail << ")";
}

// Every lower rule is present in each case so that only precedence decides.
const std::vector<BackendRequirement> kFlashOnly = {{"FLASH_ATTN", {"LBHNC"}}};
const std::vector<BackendRequirement> kBlockOutermost = {{"FLASHINFER", {"block-outermost"}}};
const std::vector<BackendRequirement> kTwoLayerFirst = {{"A", {"LBHNC", "LHBNC"}}, {"B", {"layer-outermost"}}};
const std::vector<ConnectorPreference> kNixlBlhnc = {{"nixl", "BLHNC"}};

INSTANTIATE_TEST_SUITE_P(
    Precedence, LayoutChainRuleTest,
    ::testing::Values(
        Case{"NothingGivenIsTheDefault", {}, "LBNHC", LayoutRule::kDefault},
        Case{"RequestOverrideBeatsEverything",
             {"BHLNC", L("LHBNC"), kFlashOnly, "LBNHC", L("BLNHC"), kNixlBlhnc},
             "BHLNC",
             LayoutRule::kRequestOverride},
        Case{"OperatorOverrideBeatsBackendsEnvAndConnectors",
             {"", L("LHBNC"), kFlashOnly, "LBNHC", L("BLNHC"), kNixlBlhnc},
             "LHBNC",
             LayoutRule::kOperatorOverride},
        Case{"ASingleSurvivingBackendLayoutBeatsEnvAndConnectors",
             {"", {}, kFlashOnly, "LBNHC", L("BLNHC"), kNixlBlhnc},
             "LBHNC",
             LayoutRule::kBackendRequirement},
        Case{"IntersectionOfClassAndListLeavingOneWins",
             {"", {}, {{"X", {"block-outermost"}}, {"Y", {"BLNHC", "LBNHC"}}}, "", {}, {}},
             "BLNHC",
             LayoutRule::kBackendRequirement},
        Case{"ClientEnvBeatsDaemonEnvAndConnectorsWhenAllowed",
             {"", {}, kTwoLayerFirst, "LHBNC", L("LBHNC"), {{"nixl", "LBHNC"}}},
             "LHBNC",
             LayoutRule::kClientEnv},
        Case{"DaemonEnvWhenTheClientForwardsNone",
             {"", {}, kBlockOutermost, "", L("BHLNC"), kNixlBlhnc},
             "BHLNC",
             LayoutRule::kDaemonEnv},
        Case{"EnvOutsideTheAllowedSetFallsToTheConnector",
             {"", {}, kBlockOutermost, "LBNHC", {}, kNixlBlhnc},
             "BLHNC",
             LayoutRule::kConnectorPreference},
        Case{"FirstAllowedConnectorWins",
             {"", {}, kBlockOutermost, "", {}, {{"lmcache", "LBHNC"}, {"nixl", "BLNHC"}, {"mooncake", "BHLNC"}}},
             "BLNHC",
             LayoutRule::kConnectorPreference},
        Case{"DefaultIsLbnhcWhenAllowed",
             {"", {}, kTwoLayerFirst, "", {}, {{"x", "BLHNC"}}},
             "LBHNC",
             LayoutRule::kDefault},
        Case{"DefaultIsTheFirstAllowedOtherwise", {"", {}, kBlockOutermost, "", {}, {}}, "BLHNC", LayoutRule::kDefault},
        Case{"BackendsAllowingAnythingChangeNothing",
             {"", {}, {{"TRITON", {"any"}}}, "", {}, {}},
             "LBNHC",
             LayoutRule::kDefault}));

TEST(LayoutChainTest, DefaultLbnhcWhenOnlyLayerOutermostAndLbnhcAllowed) {
  // "A" allows {LBHNC, LHBNC} so LBNHC is not allowed and the default is LBHNC (the first allowed).
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution r, Resolve({.backends = kTwoLayerFirst}));
  EXPECT_EQ(r.allowed.ToString(), "{LBHNC, LHBNC}");
  EXPECT_EQ(r.layout.name(), "LBHNC");
  EXPECT_EQ(r.rule, LayoutRule::kDefault);
}

TEST(LayoutChainTest, EnvOutsideTheAllowedSetIsIgnoredWithAWarning) {
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution r, Resolve({.backends = kBlockOutermost, .client_env = "LBNHC"}));
  EXPECT_EQ(r.layout.name(), "BLHNC");
  EXPECT_EQ(r.rule, LayoutRule::kDefault);
  EXPECT_THAT(r.warnings, ElementsAre(AllOf(HasSubstr("KVD_KV_CACHE_LAYOUT=LBNHC"), HasSubstr("ignored"),
                                            HasSubstr("{BLHNC, BLNHC, BHLNC}"))));
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution d, Resolve({.backends = kBlockOutermost, .daemon_env = L("LHBNC")}));
  EXPECT_THAT(d.warnings, ElementsAre(AllOf(HasSubstr("LHBNC"), HasSubstr("daemon env"), HasSubstr("ignored"))));
}

TEST(LayoutChainTest, AnAllowedEnvGivesNoWarning) {
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution r, Resolve({.client_env = "blhnc"}));
  EXPECT_EQ(r.layout.name(), "BLHNC");
  EXPECT_THAT(r.warnings, IsEmpty());
  EXPECT_EQ(r.allowed, LayoutSet::Any());
}

TEST(LayoutChainTest, ConflictingBackendsFailNamingBoth) {
  EXPECT_THAT(
      Resolve({.backends = {{"TRITON", {"any"}}, {"FLASH_ATTN", {"LBHNC"}}, {"AITER", {"block-outermost"}}}}),
      StatusIs(absl::StatusCode::kFailedPrecondition, AllOf(HasSubstr("FLASH_ATTN"), HasSubstr("AITER"),
                                                            HasSubstr("{LBHNC}"), HasSubstr("{BLHNC, BLNHC, BHLNC}"))));
}

TEST(LayoutChainTest, AThreeWayConflictNamesTheBackendThatEmptiedTheSet) {
  // Each pair agrees on something; all three agree on nothing.
  EXPECT_THAT(Resolve({.backends = {{"A", {"LBHNC", "LBNHC"}}, {"B", {"LBNHC", "BLHNC"}}, {"C", {"LBHNC", "BLHNC"}}}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, AllOf(HasSubstr("backend C"), HasSubstr("{LBNHC}"))));
}

TEST(LayoutChainTest, AnOverrideDecidesDespiteConflictsAndSaysSo) {
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution r,
                           Resolve({.request_override = "LBHNC", .backends = {{"X", {"LBHNC"}}, {"Y", {"BLHNC"}}}}));
  EXPECT_EQ(r.layout.name(), "LBHNC");
  EXPECT_THAT(r.warnings, Contains(HasSubstr("conflict")));
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution o, Resolve({.operator_override = L("LBNHC"), .backends = kFlashOnly}));
  EXPECT_EQ(o.rule, LayoutRule::kOperatorOverride);
  EXPECT_THAT(o.warnings, Contains(AllOf(HasSubstr("operator override LBNHC"), HasSubstr("{LBHNC}"))));
}

TEST(LayoutChainTest, ConnectorsNotHonouredAreReported) {
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution r,
                           Resolve({.client_env = "LBHNC", .connectors = {{"nixl", "BLHNC"}, {"lmcache", "LBHNC"}}}));
  EXPECT_EQ(r.rule, LayoutRule::kClientEnv);
  EXPECT_THAT(r.warnings, ElementsAre(AllOf(HasSubstr("connector nixl prefers BLHNC"), HasSubstr("client env"))));
  KVD_ASSERT_OK_AND_ASSIGN(LayoutResolution c, Resolve({.backends = kFlashOnly, .connectors = {{"nixl", "BLHNC"}}}));
  EXPECT_THAT(c.warnings, ElementsAre(HasSubstr("connector nixl prefers BLHNC")));
  EXPECT_EQ(c.rule_detail, "required by FLASH_ATTN");
}

TEST(LayoutChainTest, MalformedInputIsInvalidArgumentNamingTheField) {
  struct Bad {
    Inputs in;
    const char* field;
  };
  const Bad bads[] = {
      {{.request_override = "LBNCH"}, "layout_request.override_layout"},
      {{.client_env = "lbnh"}, "layout_request.env_layout"},
      {{.backends = {{"A", {"any"}}, {"B", {"LBHNC", "nope"}}}}, "layout_request.backend_requirements[1].layouts[1]"},
      {{.backends = {{"A", {}}}}, "layout_request.backend_requirements[0].layouts"},
      {{.backends = {{"", {"LBHNC"}}}}, "layout_request.backend_requirements[0].backend"},
      {{.connectors = {{"nixl", "block-outermost"}}}, "layout_request.connector_preferences[0].layout"},
      {{.connectors = {{"", "LBHNC"}}}, "layout_request.connector_preferences[0].connector"},
      // Validated even when a higher rule would decide.
      {{.request_override = "LBHNC", .connectors = {{"nixl", "XYZ"}}}, "layout_request.connector_preferences[0]"},
  };
  for (const Bad& b : bads) {
    SCOPED_TRACE(b.field);
    EXPECT_THAT(Resolve(b.in), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(b.field)));
  }
}

TEST(LayoutChainTest, RuleNamesAreReadable) {
  EXPECT_STREQ(LayoutRuleName(LayoutRule::kBackendRequirement), "backend requirement");
  EXPECT_STREQ(LayoutRuleName(LayoutRule::kConnectorPreference), "connector preference");
}

}  // namespace
}  // namespace kvd::daemon
