#include "daemon/rpc/convert.h"

#include <set>

#include "daemon/core/limits.h"
#include "daemon/rpc/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

TEST(ConvertTest, LayoutRequestKeepsEveryFieldInOrder) {
  v1::LayoutRequest p;
  p.set_override_layout("BLHNC");
  p.set_env_layout("LBNHC");
  v1::BackendRequirement* b = p.add_backend_requirements();
  b->set_backend("FLASHINFER");
  b->add_layouts("block-outermost");
  b->add_layouts("LBNHC");
  v1::ConnectorPreference* c = p.add_connector_preferences();
  c->set_connector("nixl");
  c->set_layout("BHLNC");
  const LayoutRequest r = FromProto(p);
  EXPECT_EQ(r.override_layout, "BLHNC");
  EXPECT_EQ(r.env_layout, "LBNHC");
  ASSERT_EQ(r.backend_requirements.size(), 1u);
  EXPECT_EQ(r.backend_requirements[0].backend, "FLASHINFER");
  EXPECT_THAT(r.backend_requirements[0].layouts, ::testing::ElementsAre("block-outermost", "LBNHC"));
  ASSERT_EQ(r.connector_preferences.size(), 1u);
  EXPECT_EQ(r.connector_preferences[0].connector, "nixl");
  EXPECT_EQ(r.connector_preferences[0].layout, "BHLNC");
}

TEST(ConvertTest, GeometryCarriesEveryStrideAndTheSegments) {
  const PoolDims dims{
      .layers = 3, .capacity_blocks = 7, .heads = 2, .block_tokens = 5, .channels = 9, .element_bytes = 2};
  EXPECT_EQ(FromProto(ToProto(dims)).channels, 9u);
  for (Layout layout : Layout::All()) {
    KVD_ASSERT_OK_AND_ASSIGN(Geometry g, Geometry::Compute(layout, dims, 4096));
    const v1::Geometry p = ToProto(g);
    EXPECT_EQ(p.layout(), layout.name());
    EXPECT_EQ(p.stride_l(), g.stride(Dim::kL));
    EXPECT_EQ(p.stride_b(), g.stride(Dim::kB));
    EXPECT_EQ(p.stride_h(), g.stride(Dim::kH));
    EXPECT_EQ(p.stride_n(), g.stride(Dim::kN));
    EXPECT_EQ(p.stride_c(), g.stride(Dim::kC));
    EXPECT_EQ(p.layer_stride(), g.layer_stride());
    EXPECT_EQ(p.block_stride(), g.block_stride());
    EXPECT_EQ(p.segments(), g.segments());
    EXPECT_EQ(p.segment_stride(), g.segment_stride());
    EXPECT_EQ(p.reserved_bytes(), g.reserved_bytes());
    EXPECT_EQ(p.granularity_bytes(), 4096u);
    EXPECT_EQ(p.dims().heads(), 2u);
  }
}

TEST(ConvertTest, EveryRuleHasItsOwnWireValue) {
  std::set<int> seen;
  for (LayoutRule r :
       {LayoutRule::kRequestOverride, LayoutRule::kOperatorOverride, LayoutRule::kBackendRequirement,
        LayoutRule::kClientEnv, LayoutRule::kDaemonEnv, LayoutRule::kConnectorPreference, LayoutRule::kDefault}) {
    const v1::LayoutRule p = ToProto(r);
    EXPECT_NE(p, v1::LAYOUT_RULE_UNSPECIFIED);
    EXPECT_TRUE(seen.insert(p).second) << LayoutRuleName(r);
  }
}

// The status mapping keeps code and message; a limit's refusal also travels in numbers, as gRPC's error
// details (an RpcStatus holding one LimitExceeded), and nothing else does.
TEST(StatusTest, ALimitsRefusalTravelsAsALimitExceededDetail) {
  const grpc::Status plain = ToGrpcStatus(absl::NotFoundError("pool kv does not exist"));
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(plain.error_message(), "pool kv does not exist");
  EXPECT_EQ(plain.error_details(), "");
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("out of memory")).error_details(), "");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());

  const Limits limits{.max_block_ids = 4};
  const grpc::Status refused = ToGrpcStatus(CheckBlockIds("block_ids", 9, 1000, limits));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(refused.error_message(), "block_ids: 9 in one request, more than 4 (--max-block-ids)");
  v1::RpcStatus rich;
  ASSERT_TRUE(rich.ParseFromString(refused.error_details()));
  EXPECT_EQ(rich.code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_EQ(rich.message(), refused.error_message());
  ASSERT_EQ(rich.details_size(), 1);
  EXPECT_EQ(rich.details(0).type_url(), "type.googleapis.com/kvd.v1.LimitExceeded");
  v1::LimitExceeded exceeded;
  ASSERT_TRUE(rich.details(0).UnpackTo(&exceeded));
  EXPECT_EQ(exceeded.limit(), "max-block-ids");
  EXPECT_EQ(exceeded.uid(), 1000u);
  EXPECT_EQ(exceeded.allowed(), 4u);
  EXPECT_EQ(exceeded.used(), 0u);
  EXPECT_EQ(exceeded.asked(), 9u);
}

}  // namespace
}  // namespace kvd::daemon
