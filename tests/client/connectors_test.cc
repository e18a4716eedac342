// End-to-end tests of the KV-connector API (docs/connectors.md) against a real kvd child process on the
// host backend: DescribeTransfer through libkvd, the capability report, and range exports over the
// handle channel. Every wait is bounded; no test asserts on wall-clock time.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/handle_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvd/client.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/testing/kvd_process.h"
#include "tests/testing/status_matchers.h"

#ifndef KVD_BINARY
#define KVD_BINARY "kvd"
#endif
#ifndef CONNECTOR_PEER_BINARY
#define CONNECTOR_PEER_BINARY "connector_peer"
#endif

extern char** environ;

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

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr absl::Duration kWait = absl::Seconds(30);

uint64_t Fnv64(const unsigned char* p, uint64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// tests/client/connector_peer.cc in its own process: commands on its stdin, one fact per line on its stdout.
class Peer {
 public:
  ~Peer() {
    if (pid_ > 0) {
      Send("quit");
      if (in_ >= 0) close(in_);
      int status = 0;
      const absl::Time deadline = absl::Now() + kWait;
      while (waitpid(pid_, &status, WNOHANG) == 0) {
        if (absl::Now() > deadline) {
          kill(pid_, SIGKILL);
          waitpid(pid_, &status, 0);
          break;
        }
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    if (out_ >= 0) close(out_);
  }
  absl::Status Start(const std::string& socket, const std::string& pool) {
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) return absl::InternalError("pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    std::vector<std::string> args = {CONNECTOR_PEER_BINARY, socket, pool};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    in_ = to_child[1];
    out_ = from_child[0];
    if (rc != 0) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(rc)));
    }
    return absl::OkStatus();
  }
  void Send(const std::string& line) {
    const std::string l = line + "\n";
    if (in_ >= 0) (void)!write(in_, l.data(), l.size());
  }
  // The next line, or an error after kWait or at EOF.
  absl::StatusOr<std::string> Line() {
    const absl::Time deadline = absl::Now() + kWait;
    while (true) {
      if (size_t nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        if (absl::StartsWith(line, "error ")) return absl::InternalError(absl::StrCat("peer: ", line));
        return line;
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("peer: no line within the bound");
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
      char buf[4096];
      const ssize_t n = read(out_, buf, sizeof buf);
      if (n <= 0) return absl::UnavailableError("peer: exited");
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }
  // Lines up to and including the first that starts with `last`.
  absl::StatusOr<std::vector<std::string>> LinesUntil(absl::string_view last) {
    std::vector<std::string> lines;
    while (true) {
      absl::StatusOr<std::string> l = Line();
      if (!l.ok()) return l.status();
      lines.push_back(*l);
      if (absl::StartsWith(*l, last)) return lines;
    }
  }

 private:
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buffer_;
};

struct PeerHandle {
  uint64_t segment, offset, bytes, fd_offset, sum;
};

std::vector<PeerHandle> Handles(const std::vector<std::string>& lines) {
  std::vector<PeerHandle> out;
  for (const std::string& l : lines) {
    std::vector<std::string> f = absl::StrSplit(l, ' ');
    if (f.size() != 6 || f[0] != "handle") continue;
    PeerHandle h{};
    EXPECT_TRUE(absl::SimpleAtoi(f[1], &h.segment) && absl::SimpleAtoi(f[2], &h.offset) &&
                absl::SimpleAtoi(f[3], &h.bytes) && absl::SimpleAtoi(f[4], &h.fd_offset) &&
                absl::SimpleAtoi(f[5], &h.sum))
        << l;
    out.push_back(h);
  }
  return out;
}

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

// Fills [offset, offset + bytes) of the mapping with a pattern of the pool offset.
void Fill(const Mapping& m, uint64_t offset, uint64_t bytes) {
  auto* base = static_cast<unsigned char*>(m.base());
  for (uint64_t k = offset; k < offset + bytes; ++k) base[k] = static_cast<unsigned char>((k * 131 + k / 4093) & 0xff);
}

// A connector in another process exports the committed ranges, finds the engine's bytes at the stated
// offsets of its FDs, is told the new ranges after a grow (and exports just those), and deregisters
// before a shrink's release completes.
TEST_F(ConnectorsTest, RangeFdsReachAnotherProcessAndFollowGrowAndShrink) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, engine->DeviceInfo());
  ASSERT_TRUE(d.capabilities.dma_buf.supported) << d.capabilities.dma_buf.detail;
  EXPECT_THAT(d.handle_types, ::testing::Contains("dma_buf"));
  // LBNHC: 2 segments of 1000 blocks x 4 KiB, each padded to 4 MiB; 300 blocks commit 2 MiB of each.
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, engine->CreatePool(Pool("kv", "LBNHC", 300)));
  ASSERT_EQ(p.geometry.segments, 2u);
  ASSERT_EQ(p.geometry.segment_stride, 4 * kMiB);
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> m, engine->Attach("kv"));
  for (uint64_t s = 0; s < 2; ++s) Fill(*m, s * 4 * kMiB, 2 * kMiB);
  auto expected_sum = [&](const PeerHandle& h) {
    return Fnv64(static_cast<unsigned char*>(m->base()) + h.offset, h.bytes);
  };

  Peer peer;
  ASSERT_THAT(peer.Start(daemon_.socket(), "kv"), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<std::string> lines, peer.LinesUntil("exported"));
  std::vector<PeerHandle> handles = Handles(lines);
  ASSERT_EQ(handles.size(), 2u) << "one per segment's committed prefix (one chunk each)";
  for (uint64_t s = 0; s < 2; ++s) {
    EXPECT_EQ(handles[s].segment, s);
    EXPECT_EQ(handles[s].offset, s * 4 * kMiB);
    EXPECT_EQ(handles[s].bytes, 2 * kMiB);
    EXPECT_EQ(handles[s].fd_offset, 0u);
    EXPECT_EQ(handles[s].sum, expected_sum(handles[s])) << "segment " << s;
  }

  // Grow: the peer is told exactly the new 2 MiB of each segment, and exports just those.
  KVD_ASSERT_OK_AND_ASSIGN(PoolChange grown, engine->Grow("kv", 800));
  ASSERT_EQ(grown.pool.committed_blocks, 1000u);
  for (uint64_t s = 0; s < 2; ++s) Fill(*m, s * 4 * kMiB + 2 * kMiB, 2 * kMiB);
  std::vector<std::string> added;
  while (added.size() < 2) {
    KVD_ASSERT_OK_AND_ASSIGN(std::string l, peer.Line());
    if (absl::StartsWith(l, "added ")) added.push_back(l);
  }
  EXPECT_EQ(added[0], absl::StrCat("added 0 ", 2 * kMiB, " ", 2 * kMiB));
  EXPECT_EQ(added[1], absl::StrCat("added 1 ", 6 * kMiB, " ", 2 * kMiB));
  peer.Send("export-added");
  KVD_ASSERT_OK_AND_ASSIGN(lines, peer.LinesUntil("exported"));
  handles = Handles(lines);
  ASSERT_EQ(handles.size(), 2u);
  for (const PeerHandle& h : handles) {
    EXPECT_EQ(h.offset, h.segment * 4 * kMiB + 2 * kMiB);
    EXPECT_EQ(h.sum, expected_sum(h)) << "segment " << h.segment;
  }

  // Shrink with wait: the reply comes only after the peer deregistered the released ranges.
  KVD_ASSERT_OK_AND_ASSIGN(PoolChange shrunk, engine->Shrink("kv", 300, /*wait=*/true));
  EXPECT_EQ(shrunk.pool.pending_release_bytes, 0u);
  KVD_ASSERT_OK_AND_ASSIGN(lines, peer.LinesUntil("deregistered"));
  EXPECT_THAT(lines, ::testing::Contains(absl::StrCat("released 0 ", 2 * kMiB, " ", 2 * kMiB)));
  EXPECT_THAT(lines, ::testing::Contains(absl::StrCat("released 1 ", 6 * kMiB, " ", 2 * kMiB)));
  EXPECT_EQ(lines.back(), "deregistered 2") << "the two grown ranges, not the first export";
}

std::unique_ptr<grpc::ClientContext> Ctx(const HandleSession& session) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("kvd-session", session.token());
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return ctx;
}

MATCHER_P2(GrpcIs, code, substring, "") {
  *result_listener << "status " << arg.error_code() << " \"" << arg.error_message() << "\"";
  return arg.error_code() == code && absl::StrContains(arg.error_message(), substring);
}

// The wire rules of ExportRanges and its leases, through the raw API.
TEST_F(ConnectorsTest, RangeLeasesAreCheckedLikeChunkLeases) {
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession a, HandleSession::Open(HandlesPathFor(daemon_.socket()), "a"));
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession b, HandleSession::Open(HandlesPathFor(daemon_.socket()), "b"));
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel("unix:" + daemon_.socket(), grpc::InsecureChannelCredentials()));
  using C = grpc::StatusCode;
  {
    v1::CreatePoolRequest q;
    q.set_name("kv");
    v1::PoolDims* d = q.mutable_dims();
    d->set_layers(2);
    d->set_capacity_blocks(2000);  // 2 segments of 8 MiB (padded)
    d->set_heads(2);
    d->set_block_tokens(16);
    d->set_channels(64);
    d->set_element_bytes(2);
    q.set_initial_blocks(800);  // one 4 MiB chunk per segment
    v1::Pool r;
    ASSERT_TRUE(stub->CreatePool(Ctx(a).get(), q, &r).ok());
  }
  v1::AttachRequest attach;
  attach.set_pool("kv");
  v1::AttachResponse attached;
  ASSERT_TRUE(stub->Attach(Ctx(a).get(), attach, &attached).ok());
  auto export_ranges = [&](const HandleSession& s, std::vector<std::pair<uint64_t, uint64_t>> ranges,
                           v1::ExportRangesResponse* out, const std::string& client_id = "") {
    v1::ExportRangesRequest q;
    q.set_client_id(client_id.empty() ? attached.client_id() : client_id);
    for (const auto& r : ranges) {
      v1::ByteRange* br = q.add_ranges();
      br->set_offset(r.first);
      br->set_bytes(r.second);
    }
    return stub->ExportRanges(Ctx(s).get(), q, out);
  };
  auto resize = [&](bool grow, uint64_t blocks) {
    v1::PoolUpdate u;
    if (grow) {
      v1::GrowRequest q;
      q.set_pool("kv");
      q.set_target_blocks(blocks);
      return stub->Grow(Ctx(a).get(), q, &u);
    }
    v1::ShrinkRequest q;
    q.set_pool("kv");
    q.set_target_blocks(blocks);
    return stub->Shrink(Ctx(a).get(), q, &u);
  };

  v1::ExportRangesResponse e;
  ASSERT_TRUE(export_ranges(a, {{2 * kMiB, 2 * kMiB}, {8 * kMiB, 4 * kMiB}}, &e).ok());
  ASSERT_EQ(e.handles_size(), 2);
  EXPECT_EQ(e.handle_type(), v1::HANDLE_TYPE_DMA_BUF);
  EXPECT_FALSE(e.ranges_span_chunks());
  EXPECT_EQ(e.handles(0).fd_offset(), 2 * kMiB) << "the second half of segment 0's one 4 MiB memfd";
  EXPECT_EQ(e.handles(1).segment(), 1u);
  EXPECT_EQ(e.handles(1).fd_offset(), 0u);
  EXPECT_EQ(e.lease().chunk_ids_size(), 0);
  EXPECT_THAT(b.Fetch(e.lease().token()).status(), StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("")))
      << "a lease of another session";
  {
    KVD_ASSERT_OK_AND_ASSIGN(auto fds, a.Fetch(e.lease().token()));
    ASSERT_EQ(fds.size(), 2u);
    EXPECT_EQ(fds[0].first, 0u);
    EXPECT_EQ(fds[1].first, 1u);
    for (const auto& f : fds) close(f.second);
  }
  EXPECT_THAT(a.Fetch(e.lease().token()).status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("")))
      << "a used lease";

  // A lease whose memory was released before it was redeemed (revoked by the shrink) yields nothing.
  ASSERT_TRUE(resize(true, 1500).ok());  // + one 2 MiB chunk per segment at [4 MiB, 6 MiB)
  ASSERT_TRUE(export_ranges(a, {{4 * kMiB, 2 * kMiB}}, &e).ok());
  ASSERT_TRUE(resize(false, 800).ok());
  EXPECT_THAT(a.Fetch(e.lease().token()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("released")));

  // Validation, each naming the field.
  EXPECT_THAT(export_ranges(a, {{4096, 2 * kMiB}}, &e), GrpcIs(C::INVALID_ARGUMENT, "ranges[0]"));
  EXPECT_THAT(export_ranges(a, {{0, 2 * kMiB}, {0, 0}}, &e), GrpcIs(C::INVALID_ARGUMENT, "ranges[1].bytes"));
  EXPECT_THAT(export_ranges(a, {{0, 6 * kMiB}}, &e), GrpcIs(C::INVALID_ARGUMENT, "committed prefix"))
      << "past the committed 4 MiB";
  EXPECT_THAT(export_ranges(a, {{3 * kMiB - 1, 2 * kMiB}}, &e), GrpcIs(C::INVALID_ARGUMENT, "ranges[0]"));
  EXPECT_THAT(export_ranges(a, {{64 * kMiB, 2 * kMiB}}, &e), GrpcIs(C::INVALID_ARGUMENT, "ranges[0]"));
  EXPECT_THAT(export_ranges(b, {}, &e), GrpcIs(C::PERMISSION_DENIED, "another session"));
  EXPECT_THAT(export_ranges(a, {}, &e, "c-unknown"), GrpcIs(C::NOT_FOUND, "client_id"));
  {
    v1::ExportRangesRequest q;
    v1::ExportRangesResponse r;
    EXPECT_THAT(stub->ExportRanges(Ctx(a).get(), q, &r), GrpcIs(C::INVALID_ARGUMENT, "client_id"));
    grpc::ClientContext no_session;
    q.set_client_id(attached.client_id());
    EXPECT_THAT(stub->ExportRanges(&no_session, q, &r), GrpcIs(C::UNAUTHENTICATED, "kvd-session"));
  }
  // Asleep: nothing to export.
  {
    v1::SleepRequest q;
    q.set_pool("kv");
    v1::PoolUpdates u;
    ASSERT_TRUE(stub->Sleep(Ctx(a).get(), q, &u).ok());
  }
  EXPECT_THAT(export_ranges(a, {}, &e), GrpcIs(C::FAILED_PRECONDITION, "sleeping"));
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
  EXPECT_TRUE(caps.dma_buf.supported) << "memfd ranges";
  EXPECT_THAT(d.handle_types, ::testing::Contains("dma_buf"));
}

}  // namespace
}  // namespace kvd
