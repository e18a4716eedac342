// End-to-end tests of the KV-connector API (docs/connectors.md) against a real kvd child process on the
// host backend: DescribeTransfer through libkvd, the capability report, and range exports over the
// handle channel. Every wait is bounded; no test asserts on wall-clock time.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvd/client.h"
#include "tests/testing/kvd_process.h"
#include "tests/testing/status_matchers.h"

#ifndef KVD_BINARY
#define KVD_BINARY "kvd"
#endif

namespace kvd {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::HasSubstr;

class ConnectorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status s = daemon_.Start(KVD_BINARY);
    ASSERT_TRUE(s.ok()) << s;
  }
  void TearDown() override {
    if (HasFailure()) std::cerr << "---- kvd log ----\n" << daemon_.log() << "-----------------\n";
  }
  absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& name) {
    return Client::Connect({.socket = daemon_.socket(), .client_name = name});
  }

  ::kvd::testing::KvdProcess daemon_;
};

// 2 layers x 2 heads x 16 tokens x 64 channels x 2 bytes: 4 KiB per layer, head group and block.
PoolOptions Pool(const std::string& name, const std::string& layout, uint64_t initial_blocks) {
  PoolOptions o;
  o.name = name;
  o.dims = PoolDims{
      .layers = 2, .capacity_blocks = 1000, .heads = 2, .block_tokens = 16, .channels = 64, .element_bytes = 2};
  o.initial_blocks = initial_blocks;
  o.layout.override_layout = layout;
  return o;
}

// Writing 0xAB through the descriptors' runs marks exactly the requested blocks' elements, as the layer
// views (the placement formula) see them, under every layout.
TEST_F(ConnectorsTest, DescribeTransferRunsHoldExactlyTheBlocksElements) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Connect("connector"));
  for (const std::string layout : {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}) {
    SCOPED_TRACE(layout);
    const std::string name = absl::StrCat("kv-", layout);
    KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, c->CreatePool(Pool(name, layout, 300)));
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> m, c->Attach(name));
    const std::vector<uint64_t> blocks = {7, 1, 2, 3, 100, 102, 104, 106, 250};
    KVD_ASSERT_OK_AND_ASSIGN(TransferPlan plan, c->DescribeTransfer(name, blocks));
    EXPECT_EQ(plan.blocks, blocks.size());
    EXPECT_EQ(plan.bytes, blocks.size() * p.geometry.block_bytes());
    EXPECT_EQ(plan.committed_blocks, p.committed_blocks);
    EXPECT_LT(plan.descriptors.size(), blocks.size() * p.geometry.segments) << "fewer than one per block run";
    auto* base = static_cast<unsigned char*>(m->base());
    for (const TransferDescriptor& d : plan.descriptors) {
      for (uint64_t i = 0; i < d.count; ++i) std::memset(base + d.offset + i * d.stride, 0xAB, d.bytes);
    }
    const std::set<uint64_t> wanted(blocks.begin(), blocks.end());
    uint64_t wrong = 0;
    const PoolDims& dims = p.geometry.dims;
    for (uint64_t l = 0; l < dims.layers; ++l) {
      const LayerView v = m->layer(l);
      for (uint64_t b = 0; b < p.committed_blocks; ++b) {
        const unsigned char expected = wanted.contains(b) ? 0xAB : 0;
        for (uint64_t h = 0; h < dims.heads; ++h) {
          for (uint64_t n = 0; n < dims.block_tokens; ++n) {
            for (uint64_t ch = 0; ch < dims.channels; ++ch) {
              const unsigned char* at = static_cast<unsigned char*>(v.data) + b * v.stride_b + h * v.stride_h +
                                        n * v.stride_n + ch * v.stride_c;
              wrong += (at[0] != expected) + (at[1] != expected);
            }
          }
        }
      }
    }
    EXPECT_EQ(wrong, 0u);
    // Every committed block: one descriptor whatever the layout.
    KVD_ASSERT_OK_AND_ASSIGN(TransferPlan all, c->DescribeTransfer(name));
    EXPECT_EQ(all.descriptors.size(), 1u);
    EXPECT_EQ(all.bytes, p.committed_blocks * p.geometry.block_bytes());
  }
}

TEST_F(ConnectorsTest, DescribeTransferValidatesItsRequest) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Connect("connector"));
  ASSERT_THAT(c->CreatePool(Pool("kv", "LBNHC", 300)).status(), IsOk());
  EXPECT_THAT(c->DescribeTransfer("kv", {1, 2, 512}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block_ids[2]: 512 is not a committed block")));
  EXPECT_THAT(c->DescribeTransfer("kv", {4, 9, 4}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block_ids[2]: 4 repeats block_ids[0]")));
  EXPECT_THAT(c->DescribeTransfer("missing").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  EXPECT_THAT(c->DescribeTransfer("").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pool")));
  ASSERT_THAT(c->Sleep("kv", /*wait=*/false).status(), IsOk());
  EXPECT_THAT(c->DescribeTransfer("kv").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("sleeping")));
}

// The host backend's report: POSIX FD yes, FABRIC no (and never advertised), GPUDirect RDMA no.
TEST_F(ConnectorsTest, HostCapabilitiesAreProbedAndStated) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Connect("operator"));
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, c->DeviceInfo());
  const CapabilityReport& caps = d.capabilities;
  EXPECT_TRUE(caps.posix_fd.supported) << caps.posix_fd.detail;
  EXPECT_FALSE(caps.fabric.supported);
  EXPECT_THAT(caps.fabric.detail, HasSubstr("no fabric"));
  EXPECT_FALSE(caps.gpu_direct_rdma_vmm.supported);
  EXPECT_FALSE(caps.range_spans_chunks);
  EXPECT_EQ(caps.granularity_bytes, d.granularity_bytes);
  EXPECT_EQ(caps.max_chunk_bytes, d.max_chunk_bytes);
  EXPECT_THAT(d.handle_types, ::testing::Not(::testing::Contains("fabric")));
  EXPECT_THAT(d.handle_types, ::testing::Contains("posix_fd"));
}

}  // namespace
}  // namespace kvd
