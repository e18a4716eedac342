// One program links the daemon's model (kvd_core, kvd_rpc) and libkvd (kvd_client) whole: every object
// of each archive is pulled in (WHOLE_ARCHIVE in tests/CMakeLists.txt), so a definition that both
// libraries make (the ODR violation of two `kvd::GroupOpName`s) fails this test's link instead of
// silently picking one. The daemon's vocabulary lives in kvd::daemon, the public client's in kvd.
// See Note [Two vocabularies] in docs/architecture.md.
#include <string>
#include <type_traits>

#include "daemon/core/geometry.h"
#include "daemon/core/pool_manager.h"
#include "gtest/gtest.h"
#include "kvd/client.h"

namespace kvd {
namespace {

static_assert(!std::is_same_v<PoolDims, daemon::PoolDims>);
static_assert(!std::is_same_v<Geometry, daemon::Geometry>);
static_assert(!std::is_same_v<ChunkInfo, daemon::ChunkInfo>);
static_assert(!std::is_same_v<PoolState, daemon::PoolState>);
static_assert(!std::is_same_v<GroupOp, daemon::GroupOp>);
static_assert(!std::is_same_v<DeviceStatus, daemon::DeviceStatus>);

TEST(VocabulariesTest, BothGroupOpNamesLinkAndAgree) {
  EXPECT_STREQ(GroupOpName(GroupOp::kGrow), daemon::GroupOpName(daemon::GroupOp::kGrow));
  EXPECT_STREQ(GroupOpName(GroupOp::kShrink), daemon::GroupOpName(daemon::GroupOp::kShrink));
  EXPECT_STREQ(GroupOpName(GroupOp::kSleep), daemon::GroupOpName(daemon::GroupOp::kSleep));
  EXPECT_STREQ(GroupOpName(GroupOp::kWake), daemon::GroupOpName(daemon::GroupOp::kWake));
}

TEST(VocabulariesTest, TheDaemonGeometryAndTheClientDimsDescribeTheSamePool) {
  const daemon::PoolDims dims{
      .layers = 4, .capacity_blocks = 64, .heads = 2, .block_tokens = 16, .channels = 8, .element_bytes = 2};
  absl::StatusOr<daemon::Geometry> geometry =
      daemon::Geometry::Compute(daemon::Layout::Default(), dims, uint64_t{2} << 20);
  ASSERT_TRUE(geometry.ok()) << geometry.status();
  const PoolDims client{.layers = dims.layers,
                        .capacity_blocks = dims.capacity_blocks,
                        .heads = dims.heads,
                        .block_tokens = dims.block_tokens,
                        .channels = dims.channels,
                        .element_bytes = dims.element_bytes};
  EXPECT_EQ(geometry->dims().layers, client.layers);
  EXPECT_EQ(geometry->segments(), client.layers);  // LBNHC: one segment per layer
}

}  // namespace
}  // namespace kvd
