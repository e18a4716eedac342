#include "daemon/core/pool_spec.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::HasSubstr;

constexpr DeviceLimits kLimits{.granularity = 2 << 20, .max_reserved_bytes = uint64_t{1} << 40};

PoolSpec Valid() {
  return {
      .name = "llama-70b.rank0",
      .dims =
          {.layers = 80, .capacity_blocks = 4096, .heads = 16, .block_tokens = 16, .channels = 128, .element_bytes = 2},
      .initial_blocks = 128,
      .layout_request = {.backend_requirements = {{"FLASHINFER", {"block-outermost"}}}}};
}

TEST(ValidateNameTest, AcceptsTheSafeCharacterSet) {
  for (const std::string& ok : {std::string("a"), std::string("pool_0"), std::string("llama-70b.rank3"),
                                std::string("A.B-C_D"), std::string(64, 'x')}) {
    EXPECT_THAT(ValidateName(ok, "name"), IsOk()) << ok;
  }
}

TEST(ValidateNameTest, RejectsEverythingElseNamingTheField) {
  for (const std::string& bad : {std::string(""), std::string(65, 'x'), std::string("../etc"), std::string("a b"),
                                 std::string("-flag"), std::string(".hidden"), std::string("pool/1"),
                                 std::string("p\n"), std::string("p\0q", 3), std::string("pööl")}) {
    EXPECT_THAT(ValidateName(bad, "pool"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pool: "))) << bad;
  }
}

TEST(PlanPoolTest, ResolvesTheLayoutAndComputesTheGeometry) {
  KVD_ASSERT_OK_AND_ASSIGN(PoolPlan plan, PlanPool(Valid(), {}, kLimits));
  EXPECT_EQ(plan.layout.layout.name(), "BLHNC");
  EXPECT_EQ(plan.layout.rule, LayoutRule::kDefault);
  EXPECT_EQ(plan.geometry.segments(), 1u);
  EXPECT_EQ(plan.geometry.block_stride(), 80u * 16 * 16 * 128 * 2);
}

TEST(PlanPoolTest, RejectsBadFieldsNamingThem) {
  PoolSpec bad_name = Valid();
  bad_name.name = "no spaces";
  EXPECT_THAT(PlanPool(bad_name, {}, kLimits), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name:")));

  PoolSpec zero_heads = Valid();
  zero_heads.dims.heads = 0;
  EXPECT_THAT(PlanPool(zero_heads, {}, kLimits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dims.heads: must be > 0")));

  PoolSpec too_many = Valid();
  too_many.initial_blocks = 4097;
  EXPECT_THAT(PlanPool(too_many, {}, kLimits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("initial_blocks: 4097 exceeds")));

  PoolSpec huge = Valid();
  huge.dims.capacity_blocks = uint64_t{1} << 30;
  EXPECT_THAT(PlanPool(huge, {}, kLimits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dims.capacity_blocks: a pool of")));

  PoolSpec overflow = Valid();
  overflow.dims.capacity_blocks = uint64_t{1} << 62;
  EXPECT_THAT(PlanPool(overflow, {}, kLimits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows 64 bits")));

  PoolSpec conflict = Valid();
  conflict.layout_request.backend_requirements.push_back({"FLASH_ATTN", {"LBHNC"}});
  EXPECT_THAT(PlanPool(conflict, {}, kLimits),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("FLASHINFER")));
}

}  // namespace
}  // namespace kvd::daemon
