// End-to-end tests of libkvd (client/include/kvd/client.h) against a real kvd child process on the host
// backend, on sockets in a fresh temporary directory. Two Clients in this process stand for an engine
// and a connector: each has its own handle-channel session, attachment, follower thread and mapping of
// the pool's memfds, so bytes written through one Mapping are read through the other.
//
// Every wait is bounded (kWait) and waits for a condition; no test asserts on wall-clock time.
#include "kvd/client.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/phase_marks.h"
#include "gmock/gmock.h"
#include "google/protobuf/message.h"
#include "gtest/gtest.h"
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

constexpr absl::Duration kWait = absl::Seconds(30);

// A kvd on the host backend in its own temporary directory (tests/testing/kvd_process.h).
class Daemon : public ::kvd::testing::KvdProcess {
 public:
  absl::Status Start(std::vector<std::string> extra = {}) { return KvdProcess::Start(KVD_BINARY, 0, std::move(extra)); }
};

// What a Mapping's callbacks reported, waited on with a bound.
struct Events {
  absl::Mutex mu;
  int grows ABSL_GUARDED_BY(mu) = 0;
  int releases ABSL_GUARDED_BY(mu) = 0;
  int lost ABSL_GUARDED_BY(mu) = 0;
  int pauses ABSL_GUARDED_BY(mu) = 0;
  int resumes ABSL_GUARDED_BY(mu) = 0;
  bool applied ABSL_GUARDED_BY(mu) = false;  // the last on_resume's argument
  uint64_t last_blocks ABSL_GUARDED_BY(mu) = 0;
  absl::Status why ABSL_GUARDED_BY(mu);

  // `pausable`: with on_pause and on_resume, which count their calls.
  AttachOptions Options(std::string name, bool pausable = false) {
    AttachOptions o;
    o.client_name = std::move(name);
    if (pausable) {
      o.on_pause = [this](const std::vector<ByteRange>&) {
        absl::MutexLock lock(&mu);
        ++pauses;
      };
      o.on_resume = [this](bool was_applied) {
        absl::MutexLock lock(&mu);
        ++resumes;
        applied = was_applied;
      };
    }
    o.on_grow = [this](uint64_t blocks) {
      absl::MutexLock lock(&mu);
      ++grows;
      last_blocks = blocks;
    };
    o.on_release = [this](uint64_t blocks) {
      absl::MutexLock lock(&mu);
      ++releases;
      last_blocks = blocks;
    };
    o.on_lost = [this](const absl::Status& s) {
      absl::MutexLock lock(&mu);
      ++lost;
      why = s;
    };
    return o;
  }

  // Waits until `counter` reaches `n`; false after kWait.
  bool WaitFor(int Events::*counter, int n) {
    absl::MutexLock lock(&mu);
    auto done = [this, counter, n]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return this->*counter >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&done), kWait);
  }
};

// A follower held in its on_grow: `events`' options whose on_grow counts, then waits until LetGo(). Call LetGo
// (a Cleanup declared after the Mapping) before the Mapping is destroyed: its follower may wait here.
class GrowHold {
 public:
  AttachOptions Options(Events& events, std::string name, bool pausable) {
    AttachOptions o = events.Options(std::move(name), pausable);
    o.on_grow = [this, &events](uint64_t blocks) {
      {
        absl::MutexLock lock(&events.mu);
        ++events.grows;
        events.last_blocks = blocks;
      }
      absl::MutexLock lock(&mu_);
      auto go = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return !held_; };
      mu_.Await(absl::Condition(&go));
    };
    return o;
  }
  void LetGo() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }

 private:
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = true;
};

// Pausable Mappings whose pause hook returns only once the test lets pause number n of that Mapping go
// (Open(n)). Open every pause (a Cleanup declared after the Mappings) before they are destroyed: their
// followers may wait here.
class PauseGate {
 public:
  // `events`' pausable options, its on_pause held at the gate.
  AttachOptions Options(Events& events, std::string name) {
    AttachOptions o = events.Options(std::move(name), /*pausable=*/true);
    o.on_pause = [this, &events](const std::vector<ByteRange>&) {
      int n = 0;
      {
        absl::MutexLock lock(&events.mu);
        n = ++events.pauses;
      }
      absl::MutexLock lock(&mu_);
      auto open = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return let_go_ >= n; };
      mu_.Await(absl::Condition(&open));
    };
    return o;
  }
  void Open(int n) {
    absl::MutexLock lock(&mu_);
    let_go_ = n;
  }

 private:
  absl::Mutex mu_;
  int let_go_ ABSL_GUARDED_BY(mu_) = 0;
};

// 2 layers x 2 heads x 16 tokens x 64 channels x 2 bytes: 4 KiB per layer and block, so 512 blocks
// are one 2 MiB chunk per segment.
PoolOptions SmallPool(const std::string& name, uint64_t initial_blocks = 512) {
  PoolOptions o;
  o.name = name;
  o.dims = PoolDims{
      .layers = 2, .capacity_blocks = 2048, .heads = 2, .block_tokens = 16, .channels = 64, .element_bytes = 2};
  o.initial_blocks = initial_blocks;
  return o;
}

int OpenFds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// The address of element (l, b, h, n, c) through a layer view.
unsigned char* At(const LayerView& v, uint64_t b, uint64_t h, uint64_t n, uint64_t c) {
  return static_cast<unsigned char*>(v.data) + b * v.stride_b + h * v.stride_h + n * v.stride_n + c * v.stride_c;
}

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status s = daemon_.Start();
    ASSERT_TRUE(s.ok()) << s;
  }
  void TearDown() override {
    if (HasFailure()) std::cerr << "---- kvd log ----\n" << daemon_.log() << "-----------------\n";
  }

  absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& name) {
    return Client::Connect({.socket = daemon_.socket(), .client_name = name});
  }

  Daemon daemon_;
};

TEST_F(ClientTest, DeviceInfoAndPools) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, c->DeviceInfo());
  EXPECT_EQ(d.backend, "host");
  EXPECT_EQ(d.granularity_bytes, uint64_t{2} << 20);
  EXPECT_EQ(d.budget_bytes, uint64_t{512} << 20);
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, c->CreatePool(SmallPool("kv")));
  EXPECT_EQ(p.state, PoolState::kAwake);
  EXPECT_EQ(p.committed_blocks, 512u);
  EXPECT_EQ(p.geometry.segments, 2u);
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolInfo> pools, c->ListPools());
  ASSERT_EQ(pools.size(), 1u);
  EXPECT_EQ(pools[0].name, "kv");
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus after, c->DeviceInfo());
  EXPECT_EQ(after.committed_bytes, uint64_t{4} << 20);
  EXPECT_EQ(after.pool_count, 1u);
}

// A closed Mapping unmaps first and then detaches saying so (DetachRequest.released): it holds nothing
// afterwards, so a later shrink's memory is free at once although the closing process keeps its session.
TEST_F(ClientTest, AClosedMappingHoldsNothingAfterwards) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> owner, Connect("owner"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  ASSERT_THAT(owner->CreatePool(SmallPool("kv")).status(), IsOk());
  {
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> m, engine->Attach("kv"));
    ASSERT_FALSE(m->chunks().empty());
  }
  KVD_ASSERT_OK_AND_ASSIGN(PoolChange shrunk, owner->Shrink("kv", 0, /*wait=*/true));
  EXPECT_EQ(shrunk.pool.pending_release_bytes, 0u);
  EXPECT_EQ(shrunk.release_id, 0u);  // nobody left to wait for
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, owner->DeviceInfo());
  EXPECT_EQ(d.committed_bytes, 0u);
}

// Pool metadata: a compare-and-set blob; the pool's view shows its version and size.
TEST_F(ClientTest, PoolMetadataIsACompareAndSet) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Connect("engine"));
  ASSERT_THAT(c->CreatePool(SmallPool("kv")).status(), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(PoolMetadata empty, c->GetPoolMetadata("kv"));
  EXPECT_EQ(empty.pool, "kv");
  EXPECT_EQ(empty.version, 0u);
  EXPECT_TRUE(empty.data.empty());
  KVD_ASSERT_OK_AND_ASSIGN(PoolMetadata set, c->SetPoolMetadata("kv", 0, std::string("block\0table", 11)));
  EXPECT_EQ(set.version, 1u);
  EXPECT_GT(set.updated_at, absl::UnixEpoch());
  EXPECT_THAT(c->SetPoolMetadata("kv", 0, "stale").status(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("at version 1, not 0")));
  KVD_ASSERT_OK_AND_ASSIGN(PoolMetadata read, c->GetPoolMetadata("kv"));
  EXPECT_EQ(read.data, std::string("block\0table", 11));
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, c->GetPool("kv"));
  EXPECT_EQ(p.metadata_version, 1u);
  EXPECT_EQ(p.metadata_bytes, 11u);
  EXPECT_THAT(c->GetPoolMetadata("nope").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
}

// on_reply hands over every OK reply as its kvd.v1 message (what kvctl --json prints), and no failed one.
TEST_F(ClientTest, OnReplySeesEveryReplyMessage) {
  std::vector<std::string> seen;
  KVD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<Client> c,
      Client::Connect(
          {.socket = daemon_.socket(), .client_name = "tool", .on_reply = [&](const google::protobuf::Message& m) {
             seen.push_back(m.GetDescriptor()->full_name());
           }}));
  ASSERT_THAT(c->DeviceInfo().status(), IsOk());
  ASSERT_THAT(c->CreatePool(SmallPool("kv")).status(), IsOk());
  ASSERT_THAT(c->Grow("kv", 1024).status(), IsOk());
  EXPECT_FALSE(c->GetPool("missing").ok());
  ASSERT_THAT(c->Sleep("kv", /*wait=*/false).status(), IsOk());
  ASSERT_THAT(c->DeletePool("kv", /*force=*/false).status(), IsOk());
  EXPECT_THAT(seen, ::testing::ElementsAre("kvd.v1.DeviceInfo", "kvd.v1.Pool", "kvd.v1.PoolUpdate",
                                           "kvd.v1.PoolUpdates", "kvd.v1.DeletePoolResponse"));
}

TEST_F(ClientTest, TwoClientsShareBytesThroughLayerViews) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, engine->CreatePool(SmallPool("kv")));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, connector->Attach("kv"));
  EXPECT_NE(a->base(), b->base());  // two reservations of one address space
  EXPECT_EQ(a->committed_blocks(), 512u);
  EXPECT_EQ(a->state(), Mapping::State::kAwake);
  EXPECT_EQ(a->chunks().size(), 2u);

  const Geometry& g = a->geometry();
  EXPECT_EQ(g.layout, p.geometry.layout);
  for (uint64_t l = 0; l < g.dims.layers; ++l) {
    LayerView va = a->layer(l);
    LayerView vb = b->layer(l);
    // The view is the geometry's formula.
    EXPECT_EQ(va.data, static_cast<unsigned char*>(a->base()) + g.offset + l * g.stride_l);
    EXPECT_EQ(va.stride_b, g.stride_b);
    EXPECT_EQ(va.stride_h, g.stride_h);
    EXPECT_EQ(va.stride_n, g.stride_n);
    EXPECT_EQ(va.stride_c, g.stride_c);
    EXPECT_EQ(va.dims.heads, 2u);
    // Write element (l, b, h, n, c) through A's view for a few elements, read it through B's.
    for (uint64_t blk : {uint64_t{0}, uint64_t{7}, uint64_t{511}}) {
      for (uint64_t h = 0; h < 2; ++h) {
        *At(va, blk, h, 15, 63) = static_cast<unsigned char>(l * 100 + blk + h);
      }
    }
    for (uint64_t blk : {uint64_t{0}, uint64_t{7}, uint64_t{511}}) {
      for (uint64_t h = 0; h < 2; ++h) {
        EXPECT_EQ(*At(vb, blk, h, 15, 63), static_cast<unsigned char>(l * 100 + blk + h)) << l << " " << blk;
      }
    }
  }
  // Elements of distinct (l, b, h, n, c) never alias: the last byte of every layer of the last block
  // lies inside the reservation.
  EXPECT_LT(g.offset + (g.dims.layers - 1) * g.stride_l + (g.dims.capacity_blocks - 1) * g.stride_b +
                (g.dims.heads - 1) * g.stride_h + (g.dims.block_tokens - 1) * g.stride_n +
                (g.dims.channels - 1) * g.stride_c + g.dims.element_bytes,
            g.reserved_bytes + 1);
  EXPECT_EQ(a->layer(g.dims.layers).data, nullptr);

  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo seen, engine->GetPool("kv"));
  EXPECT_EQ(seen.clients.size(), 2u);
}

TEST_F(ClientTest, GrowMapsForTheGrowerAndTheFollower) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  Events ea, eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine")));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, connector->Attach("kv", eb.Options("connector")));

  KVD_ASSERT_OK_AND_ASSIGN(PoolChange grown, engine->Grow("kv", 1024));
  EXPECT_EQ(grown.pool.committed_blocks, 1024u);
  EXPECT_EQ(grown.added.size(), 2u);
  // The grower mapped its new chunks before Grow returned: block 1000 is usable at once.
  EXPECT_EQ(a->committed_blocks(), 1024u);
  EXPECT_EQ(a->chunks().size(), 4u);
  LayerView va = a->layer(1);
  *At(va, 1000, 1, 3, 5) = 0xab;

  // The other client's follower maps the chunks and then calls on_grow.
  ASSERT_TRUE(eb.WaitFor(&Events::grows, 1));
  {
    absl::MutexLock lock(&eb.mu);
    EXPECT_EQ(eb.last_blocks, 1024u);
  }
  EXPECT_EQ(b->committed_blocks(), 1024u);
  EXPECT_EQ(b->chunks().size(), 4u);
  EXPECT_EQ(*At(b->layer(1), 1000, 1, 3, 5), 0xab);
  *At(b->layer(0), 900, 0, 0, 0) = 0x5a;
  EXPECT_EQ(*At(a->layer(0), 900, 0, 0, 0), 0x5a);
  absl::MutexLock lock(&ea.mu);
  EXPECT_EQ(ea.grows, 0);  // the grower's lease came in the reply, not as an event
}

TEST_F(ClientTest, ShrinkWaitsForTheFollowersAcknowledgements) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  Events ea, eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine")));
  // Pausable: another session's shrink pauses it first (docs/api.md, "Releases and running engines").
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b,
                           connector->Attach("kv", eb.Options("connector", /*pausable=*/true)));
  ASSERT_THAT(engine->Grow("kv", 1024).status(), IsOk());
  ASSERT_TRUE(eb.WaitFor(&Events::grows, 1));

  KVD_ASSERT_OK_AND_ASSIGN(PoolChange shrunk, engine->Shrink("kv", 512, /*wait=*/true));
  EXPECT_NE(shrunk.release_id, 0u);
  EXPECT_EQ(shrunk.released_chunk_ids.size(), 2u);
  EXPECT_EQ(shrunk.pool.committed_blocks, 512u);
  EXPECT_EQ(shrunk.pool.pending_release_bytes, 0u);  // both followers unmapped and acknowledged
  ASSERT_TRUE(ea.WaitFor(&Events::releases, 1));
  ASSERT_TRUE(eb.WaitFor(&Events::releases, 1));
  EXPECT_EQ(a->committed_blocks(), 512u);
  EXPECT_EQ(b->committed_blocks(), 512u);
  EXPECT_EQ(b->chunks().size(), 2u);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, engine->DeviceInfo());
  EXPECT_EQ(d.committed_bytes, uint64_t{4} << 20);
}

TEST_F(ClientTest, SleepAndWake) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  Events ea, eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine")));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b,
                           connector->Attach("kv", eb.Options("connector", /*pausable=*/true)));
  *At(a->layer(0), 3, 0, 0, 0) = 0x77;

  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolChange> slept, engine->Sleep("kv", /*wait=*/true));
  ASSERT_EQ(slept.size(), 1u);
  EXPECT_EQ(slept[0].pool.state, PoolState::kSleeping);
  EXPECT_EQ(slept[0].pool.wake_blocks, 512u);
  EXPECT_EQ(slept[0].pool.pending_release_bytes, 0u);
  ASSERT_TRUE(ea.WaitFor(&Events::releases, 1));
  ASSERT_TRUE(eb.WaitFor(&Events::releases, 1));
  EXPECT_EQ(a->state(), Mapping::State::kSleeping);
  EXPECT_EQ(b->state(), Mapping::State::kSleeping);
  EXPECT_TRUE(a->chunks().empty());
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, engine->DeviceInfo());
  EXPECT_EQ(d.committed_bytes, 0u);

  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolChange> woken, engine->Wake(""));  // every sleeping pool
  ASSERT_EQ(woken.size(), 1u);
  EXPECT_EQ(woken[0].pool.state, PoolState::kAwake);
  EXPECT_EQ(a->state(), Mapping::State::kAwake);  // mapped before Wake returned
  EXPECT_EQ(a->chunks().size(), 2u);
  EXPECT_EQ(*At(a->layer(0), 3, 0, 0, 0), 0);  // woken memory reads back as zero
  ASSERT_TRUE(eb.WaitFor(&Events::grows, 1));
  EXPECT_EQ(b->state(), Mapping::State::kAwake);
  *At(a->layer(1), 511, 1, 15, 63) = 0x42;
  EXPECT_EQ(*At(b->layer(1), 511, 1, 15, 63), 0x42);
}

// The memfds (chunk FDs, host backend) this process holds open now.
int OpenMemfds() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    n += absl::StartsWith(std::filesystem::read_symlink(entry.path(), error).string(), "/memfd:");
  }
  return n;
}

std::atomic<int> memfds_at_acknowledgement{-1};

// An acknowledged release is memory the daemon may commit again at once (a GPU frees it only once every
// process released its handle), so a paused Mapping gives the replaced chunks' handles and FDs back before it
// acknowledges, not after.
TEST_F(ClientTest, APausedMappingGivesTheReleasedChunksBackBeforeItAcknowledges) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  const int before = OpenMemfds();
  Events eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b,
                           connector->Attach("kv", eb.Options("connector", /*pausable=*/true)));
  ASSERT_EQ(OpenMemfds(), before + 2) << "one FD per chunk mapped";
  internal::SetPhaseHook([](const char* phase) {
    if (std::strcmp(phase, "release.acknowledging") == 0) memfds_at_acknowledgement = OpenMemfds();
  });
  absl::Cleanup unhook = [] { internal::SetPhaseHook(nullptr); };
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<PoolChange> slept, engine->Sleep("kv", /*wait=*/true));
  ASSERT_EQ(slept.size(), 1u);
  EXPECT_EQ(slept[0].pool.pending_release_bytes, 0u);
  EXPECT_EQ(memfds_at_acknowledgement.load(), before) << "the chunks' FDs were still open at the acknowledgement";
  EXPECT_EQ(b->state(), Mapping::State::kSleeping);
}

TEST_F(ClientTest, DeleteWithForceLosesTheMapping) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  Events eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, connector->Attach("kv", eb.Options("connector")));
  EXPECT_THAT(engine->DeletePool("kv", /*force=*/false).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("")));
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t released, engine->DeletePool("kv", /*force=*/true));
  EXPECT_EQ(released, uint64_t{4} << 20);
  ASSERT_TRUE(eb.WaitFor(&Events::lost, 1));
  EXPECT_EQ(b->state(), Mapping::State::kLost);
  {
    absl::MutexLock lock(&eb.mu);
    EXPECT_THAT(eb.why, StatusIs(absl::StatusCode::kNotFound, HasSubstr("deleted by force")));
  }
  // Not pausable: the forced delete leaves it its chunks (its engine may still be reading them), counted
  // until it is destroyed.
  EXPECT_EQ(b->chunks().size(), 2u);
  *At(b->layer(0), 3, 0, 0, 0) = 0x42;
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus held, engine->DeviceInfo());
  EXPECT_EQ(held.committed_bytes, uint64_t{4} << 20);
  b.reset();
  absl::StatusOr<DeviceStatus> d;
  for (int i = 0; i < 200; ++i) {
    d = engine->DeviceInfo();
    if (!d.ok() || d->committed_bytes == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_THAT(d.status(), IsOk());
  EXPECT_EQ(d->committed_bytes, 0u);
}

// A forced delete that overtakes another session's grow: the follower's fetch of the grow's lease finds the
// pool gone. A Mapping that is not pausable must not unmap on that failure (its engine may still be reading):
// it keeps its chunks until it is closed, as on the forced delete itself.
TEST_F(ClientTest, AForcedDeleteThatOvertakesAGrowLeavesANonPausableMappingItsChunks) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv", 512)).status(), IsOk());
  Events eb;
  GrowHold hold;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b,
                           connector->Attach("kv", hold.Options(eb, "connector", /*pausable=*/false)));
  absl::Cleanup unblock = [&] { hold.LetGo(); };  // the follower must be able to stop
  ASSERT_THAT(engine->Grow("kv", 1024).status(), IsOk());
  ASSERT_TRUE(eb.WaitFor(&Events::grows, 1));  // held: the next grow's event waits in the stream
  const size_t mapped = b->chunks().size();
  ASSERT_THAT(engine->Grow("kv", 1536).status(), IsOk());
  ASSERT_THAT(engine->DeletePool("kv", /*force=*/true).status(), IsOk());
  hold.LetGo();  // the follower now fetches the second grow's lease, of a deleted pool
  ASSERT_TRUE(eb.WaitFor(&Events::lost, 1));
  EXPECT_EQ(b->state(), Mapping::State::kLost);
  {
    absl::MutexLock lock(&eb.mu);
    EXPECT_THAT(eb.why, StatusIs(absl::StatusCode::kNotFound, HasSubstr("mapping chunks added to pool kv")));
  }
  EXPECT_EQ(b->chunks().size(), mapped) << "the chunks it mapped stay mapped until it is closed";
  *At(b->layer(0), 3, 0, 0, 0) = 0x42;
}

TEST_F(ClientTest, DeleteWithForcePausesAPausableMappingFirstAndItUnmaps) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  Events eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b,
                           connector->Attach("kv", eb.Options("connector", /*pausable=*/true)));
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t released, engine->DeletePool("kv", /*force=*/true));
  EXPECT_EQ(released, uint64_t{4} << 20);
  ASSERT_TRUE(eb.WaitFor(&Events::lost, 1));
  EXPECT_EQ(b->state(), Mapping::State::kLost);
  EXPECT_TRUE(b->chunks().empty());
  absl::MutexLock lock(&eb.mu);
  EXPECT_EQ(eb.pauses, 1);  // paused before anything went away, and never resumed
  EXPECT_EQ(eb.resumes, 0);
  EXPECT_THAT(eb.why, StatusIs(absl::StatusCode::kNotFound, HasSubstr("deleted")));
}

TEST_F(ClientTest, OneMappingPerPoolPerClient) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv"));
  EXPECT_THAT(engine->Attach("kv").status(), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("kv")));
  a.reset();  // detaches
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, engine->GetPool("kv"));
  EXPECT_TRUE(p.clients.empty());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> again, engine->Attach("kv"));
  EXPECT_EQ(again->committed_blocks(), 512u);
}

// A Mapping keeps one FD per mapped chunk (to hand it back after a daemon restart), closes it when the
// chunk is unmapped, and a destroyed Mapping leaves no FD behind.
TEST_F(ClientTest, AMappingKeepsOneFdPerMappedChunk) {
  auto memfds = [] {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      n += std::filesystem::read_symlink(e.path(), ec).string().rfind("/memfd:", 0) == 0;
    }
    return n;
  };
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  ASSERT_EQ(memfds(), 0u);
  {
    // One memfd FD per chunk on the host backend: the device layer's imported chunk (a dup of the memfd),
    // which the Mapping exports again when it hands the chunk back after a restart.
    constexpr size_t kPerChunk = 1;
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> m, engine->Attach("kv"));
    EXPECT_EQ(memfds(), kPerChunk * m->chunks().size());
    ASSERT_THAT(engine->Grow("kv", 2048).status(), IsOk());
    EXPECT_EQ(m->chunks().size(), 4u);
    EXPECT_EQ(memfds(), kPerChunk * 4);
    ASSERT_THAT(engine->Sleep("kv", /*wait=*/true).status(), IsOk());
    EXPECT_EQ(memfds(), 0u);
    ASSERT_THAT(engine->Wake("kv").status(), IsOk());
    EXPECT_EQ(memfds(), kPerChunk * m->chunks().size());
  }
  EXPECT_EQ(memfds(), 0u);
}

// A call to a daemon that does not answer (stopped with SIGSTOP) ends at its deadline instead of hanging,
// and the Client works again once the daemon does.
TEST_F(ClientTest, CallsToAHungDaemonEndAtTheirDeadline) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine,
                           Client::Connect({.socket = daemon_.socket(), .timeout = absl::Milliseconds(300)}));
  ASSERT_THAT(engine->ListPools().status(), IsOk());
  ASSERT_EQ(kill(daemon_.pid(), SIGSTOP), 0);
  auto stopped = [pid = daemon_.pid()] {  // the state field of /proc/PID/stat, after "(comm)"
    std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = stat.rfind(") ");
    return at != std::string::npos && at + 2 < stat.size() && stat[at + 2] == 'T';
  };
  for (int i = 0; i < 1000 && !stopped(); ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_TRUE(stopped());
  absl::Status hung = engine->ListPools().status();
  ASSERT_EQ(kill(daemon_.pid(), SIGCONT), 0);
  EXPECT_THAT(hung, StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_)) << hung;
  // Its answer to the abandoned call and the next one may take longer than 300 ms on a loaded machine.
  absl::Status again = engine->ListPools().status();
  for (int i = 0; i < 100 && absl::IsDeadlineExceeded(again); ++i) again = engine->ListPools().status();
  EXPECT_THAT(again, IsOk());
}

// A destroyed Mapping leaves no FD behind.
TEST_F(ClientTest, MappingsLeaveNoFileDescriptorsBehind) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  {  // warm both clients' channels and devices up
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv"));
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, connector->Attach("kv"));
  }
  const int baseline = OpenFds();
  for (int round = 0; round < 3; ++round) {
    Events eb;
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv"));
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b,
                             connector->Attach("kv", eb.Options("connector", /*pausable=*/true)));
    ASSERT_THAT(engine->Grow("kv", 2048).status(), IsOk());
    ASSERT_TRUE(eb.WaitFor(&Events::grows, 1));
    ASSERT_THAT(engine->Shrink("kv", 512, /*wait=*/true).status(), IsOk());
    ASSERT_TRUE(eb.WaitFor(&Events::releases, 1));
  }
  EXPECT_EQ(OpenFds(), baseline);
}

std::vector<uint64_t> Ids(const std::vector<ChunkInfo>& chunks) {
  std::vector<uint64_t> ids;
  for (const ChunkInfo& c : chunks) ids.push_back(c.id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Resizes from two threads of two Clients while a third reads: afterwards every Mapping maps exactly the
// daemon's chunk table.
TEST_F(ClientTest, ConcurrentResizesKeepMappingsInStep) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  // Each Mapping is paused for the other Client's shrinks (docs/api.md, "Releases and running engines").
  Events ea, eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine", true)));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, connector->Attach("kv", eb.Options("connector", true)));
  auto resize = [](Client* c, uint64_t big) {
    for (int i = 0; i < 10; ++i) {
      // Either client may find the pool already at (or past) the size it asks for: INVALID_ARGUMENT.
      absl::Status g = c->Grow("kv", big).status();
      EXPECT_TRUE(g.ok() || g.code() == absl::StatusCode::kInvalidArgument) << g;
      absl::Status s = c->Shrink("kv", 512, /*wait=*/true).status();
      EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kInvalidArgument) << s;
    }
  };
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done.load()) {
      EXPECT_LE(a->chunks().size(), 8u);
      EXPECT_LE(b->committed_blocks(), 2048u);
      EXPECT_THAT(engine->GetPool("kv").status(), IsOk());
    }
  });
  std::thread t1(resize, engine.get(), 1024);
  std::thread t2(resize, connector.get(), 2048);
  t1.join();
  t2.join();
  done = true;
  reader.join();

  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, engine->GetPool("kv"));
  const std::vector<uint64_t> want = Ids(p.chunks);
  EXPECT_EQ(p.committed_blocks, 512u);
  // The last release events may still be on their way to a follower: wait for the condition.
  const absl::Time deadline = absl::Now() + kWait;
  while ((Ids(a->chunks()) != want || Ids(b->chunks()) != want) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Ids(a->chunks()), want);
  EXPECT_EQ(Ids(b->chunks()), want);
  EXPECT_EQ(a->committed_blocks(), 512u);
  EXPECT_EQ(b->committed_blocks(), 512u);
  EXPECT_EQ(p.pending_release_bytes, 0u);
  *At(a->layer(1), 511, 1, 15, 63) = 9;
  EXPECT_EQ(*At(b->layer(1), 511, 1, 15, 63), 9);
}

// docs/api.md, "Pushed handles": an engine at its open-file limit cannot take the FDs pushed with its Attach. The
// Attach fails with DATA_LOSS naming the limit, detaches the client it made and keeps none of the FDs, and
// the session goes on: the next Attach, with room, maps.
TEST_F(ClientTest, AnAttachThatCannotTakeItsPushedHandlesFailsDetachedAndKeepsNoFd) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  for (uint64_t blocks = 1024; blocks <= 2048; blocks += 512) ASSERT_THAT(engine->Grow("kv", blocks).status(), IsOk());
  {  // warm the client's channel and device up
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> warm, engine->Attach("kv"));
    ASSERT_EQ(warm->chunks().size(), 8u);
  }
  const int baseline = OpenFds();
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit tight = saved;
  tight.rlim_cur = static_cast<rlim_t>(baseline + 3);  // room for 3 of the 8 FDs pushed
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &tight), 0);
  absl::StatusOr<std::unique_ptr<Mapping>> refused = engine->Attach("kv");
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_THAT(refused.status(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("RLIMIT_NOFILE")));
  EXPECT_EQ(OpenFds(), baseline);
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo pool, engine->GetPool("kv"));
  EXPECT_THAT(pool.clients, ::testing::IsEmpty());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> m, engine->Attach("kv"));
  EXPECT_EQ(m->chunks().size(), 8u);
}

TEST_F(ClientTest, MappingOutlivesItsClient) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv"));
  engine.reset();
  *At(a->layer(0), 1, 1, 1, 1) = 1;
  EXPECT_EQ(a->state(), Mapping::State::kAwake);
}

TEST_F(ClientTest, DaemonErrorsKeepTheirCodeAndMessage) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> c, Connect("engine"));
  PoolOptions bad = SmallPool("kv");
  bad.dims.heads = 0;
  EXPECT_THAT(c->CreatePool(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dims.heads")));
  EXPECT_THAT(c->GetPool("nope").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  ASSERT_THAT(c->CreatePool(SmallPool("kv")).status(), IsOk());
  EXPECT_THAT(c->CreatePool(SmallPool("kv")).status(), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("kv")));
  EXPECT_THAT(c->Grow("kv", 4096).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("capacity")));
  EXPECT_THAT(c->Shrink("kv", 600, false).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")));
  EXPECT_THAT(c->Attach("nope").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(Client::Connect({.socket = "/nonexistent/kvd/gpu0.sock"}).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("")));
}

// A daemon that stops for good (--drain-on-stop) takes the memory with it.
TEST_F(ClientTest, DaemonStoppingLosesTheMapping) {
  Daemon draining;
  ASSERT_THAT(draining.Start({"--drain-on-stop"}), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine,
                           Client::Connect({.socket = draining.socket(), .client_name = "engine"}));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  Events ea;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine")));
  draining.Terminate();
  ASSERT_TRUE(ea.WaitFor(&Events::lost, 1));
  EXPECT_EQ(a->state(), Mapping::State::kLost);
  EXPECT_TRUE(a->chunks().empty());
  EXPECT_EQ(a->committed_blocks(), 0u);
  absl::MutexLock lock(&ea.mu);
  EXPECT_THAT(ea.why, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("stopping")));
}

// KVD_SOCKET and KVD_KV_CACHE_LAYOUT are read from this process's environment.
TEST_F(ClientTest, EnvironmentSocketAndLayout) {
  ASSERT_EQ(setenv("KVD_SOCKET", daemon_.socket().c_str(), 1), 0);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect({.client_name = "env"});
  unsetenv("KVD_SOCKET");
  ASSERT_THAT(c.status(), IsOk());
  EXPECT_EQ((*c)->socket(), daemon_.socket());

  ASSERT_EQ(setenv("KVD_KV_CACHE_LAYOUT", "BLHNC", 1), 0);
  absl::StatusOr<ResolvedLayout> r = (*c)->ResolveLayout(LayoutRequest{});
  absl::StatusOr<PoolInfo> p = (*c)->CreatePool(SmallPool("kv"));
  unsetenv("KVD_KV_CACHE_LAYOUT");
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_EQ(r->resolution.layout, "BLHNC");
  EXPECT_EQ(r->resolution.rule, "client_env");
  EXPECT_FALSE(r->has_geometry);
  ASSERT_THAT(p.status(), IsOk());
  EXPECT_EQ(p->geometry.layout, "BLHNC");
  EXPECT_EQ(p->geometry.segments, 1u);

  // An explicit env_layout wins over the process's environment; a backend requirement over both.
  LayoutRequest req;
  req.env_layout_set = true;
  req.env_layout = "LHBNC";
  PoolDims dims = SmallPool("x").dims;
  KVD_ASSERT_OK_AND_ASSIGN(ResolvedLayout explicit_env, (*c)->ResolveLayout(req, &dims));
  EXPECT_EQ(explicit_env.resolution.layout, "LHBNC");
  EXPECT_TRUE(explicit_env.has_geometry);
  EXPECT_EQ(explicit_env.geometry.segments, 4u);  // L*H
  req.backend_requirements.push_back({"FLASH_ATTN", {"LBHNC", "LBNHC"}});
  KVD_ASSERT_OK_AND_ASSIGN(ResolvedLayout required, (*c)->ResolveLayout(req));
  EXPECT_EQ(required.resolution.layout, "LBNHC");
  EXPECT_EQ(required.resolution.rule, "default");
  EXPECT_THAT(required.resolution.allowed_layouts, ::testing::ElementsAre("LBHNC", "LBNHC"));
  ASSERT_EQ(required.resolution.warnings.size(), 1u);  // the env layout outside the allowed set
  EXPECT_THAT(required.resolution.warnings[0], HasSubstr("LHBNC"));
}

// ---------------------------------------------------------------------------------------------
// Pauses and reshaping (docs/api.md, "Pauses and reshaping"; docs/integrating.md, "Pauses").

// A byte of (layer, block, head) that no other triple shares within a test, never zero.
unsigned char PatternOf(uint64_t l, uint64_t b, uint64_t h) {
  return static_cast<unsigned char>((l * 67 + b * 13 + h * 5) % 251 + 1);
}

void WritePattern(const Mapping& m, const std::vector<uint64_t>& blocks) {
  for (uint64_t l = 0; l < m.geometry().dims.layers; ++l) {
    for (uint64_t b : blocks) {
      for (uint64_t h = 0; h < m.geometry().dims.heads; ++h) {
        *At(m.layer(l), b, h, 0, 0) = PatternOf(l, b, h);
        *At(m.layer(l), b, h, 15, 63) = PatternOf(l, b, h);
      }
    }
  }
}

// Every byte WritePattern wrote, through `m`; the first one that differs, if any.
std::string CheckPattern(const Mapping& m, const std::vector<uint64_t>& blocks) {
  for (uint64_t l = 0; l < m.geometry().dims.layers; ++l) {
    for (uint64_t b : blocks) {
      for (uint64_t h = 0; h < m.geometry().dims.heads; ++h) {
        for (unsigned char* at : {At(m.layer(l), b, h, 0, 0), At(m.layer(l), b, h, 15, 63)}) {
          if (*at != PatternOf(l, b, h)) {
            return absl::StrCat("layer ", l, " block ", b, " head ", h, ": read ", *at, ", wrote ", PatternOf(l, b, h));
          }
        }
      }
    }
  }
  return "";
}

std::string Str(const std::vector<ByteRange>& ranges) {
  std::string out;
  for (const ByteRange& r : ranges) absl::StrAppend(&out, "[", r.segment, " ", r.offset, " +", r.bytes, "]");
  return out;
}

// What a connector's callbacks (on_ranges_released, on_ranges_added) were given, call by call.
struct ConnectorCalls {
  absl::Mutex mu;
  std::vector<std::string> released ABSL_GUARDED_BY(mu);
  std::vector<std::string> added ABSL_GUARDED_BY(mu);

  void Add(AttachOptions& o) {
    o.on_ranges_released = [this](const std::vector<ByteRange>& r) {
      absl::MutexLock lock(&mu);
      released.push_back(Str(r));
    };
    o.on_ranges_added = [this](const std::vector<ByteRange>& r) {
      absl::MutexLock lock(&mu);
      added.push_back(Str(r));
    };
  }
};

// The memfd FDs open in this process (host backend: one per chunk a Mapping maps or has imported, see
// AMappingKeepsOneFdPerMappedChunk).
size_t Memfds() {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    n += std::filesystem::read_symlink(e.path(), ec).string().rfind("/memfd:", 0) == 0;
  }
  return n;
}

uint64_t MappedBytes(const Mapping& m) {
  uint64_t bytes = 0;
  for (const ChunkInfo& c : m.chunks()) bytes += c.bytes;
  return bytes;
}

// An exact shrink to a target inside a chunk: the straddling chunk of each segment is replaced by a
// smaller one holding the kept bytes while both Mappings pause, and both read every kept byte back
// from the new memory at the same addresses. The shrinking client's own Mapping has remapped when
// Shrink returns.
TEST_F(ClientTest, ExactShrinkInsideAChunkKeepsTheBytes) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv", 2048)).status(), IsOk());  // one 8 MiB chunk per segment
  Events ea, eb;
  ConnectorCalls cb;
  AttachOptions ob = eb.Options("connector", true);
  cb.Add(ob);
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine", true)));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, connector->Attach("kv", std::move(ob)));
  ASSERT_EQ(a->chunks().size(), 2u);
  void* const base_a = a->base();
  const std::vector<uint64_t> kept = {0, 1, 300, 511, 512, 599};
  WritePattern(*a, kept);
  WritePattern(*a, {600, 1023, 2047});

  // 600 blocks of 4 KiB per segment end inside the first 4 MiB: that is where each segment ends now
  // (1024 blocks).
  KVD_ASSERT_OK_AND_ASSIGN(PoolChange shrunk, engine->Shrink("kv", 600, ShrinkOptions{}));
  ASSERT_TRUE(shrunk.reshape.has_value());
  const Reshape& r = *shrunk.reshape;
  EXPECT_TRUE(r.target_reached);
  EXPECT_EQ(r.chunks_before, 2u);
  EXPECT_EQ(r.chunks_after, 2u);
  EXPECT_EQ(r.chunks_replaced, 2u);
  EXPECT_EQ(r.chunks_added, 2u);
  EXPECT_EQ(r.copied_bytes, uint64_t{8} << 20);  // the kept 4 MiB of each segment
  EXPECT_EQ(r.paused_clients, 2u);
  EXPECT_TRUE(r.detached_client_ids.empty());
  EXPECT_TRUE(r.moved_blocks.empty());
  EXPECT_EQ(shrunk.added.size(), 2u);
  EXPECT_EQ(shrunk.pool.committed_blocks, 1024u);  // 600 blocks rounded up to the 2 MiB granularity

  // The shrinker's Mapping: remapped before Shrink returned, at the same base.
  EXPECT_EQ(a->base(), base_a);
  EXPECT_EQ(MappedBytes(*a), uint64_t{8} << 20);
  for (const ChunkInfo& c : a->chunks()) EXPECT_EQ(c.bytes, uint64_t{4} << 20);
  EXPECT_EQ(CheckPattern(*a, kept), "");
  {
    absl::MutexLock lock(&ea.mu);
    EXPECT_EQ(ea.pauses, 1);
    EXPECT_EQ(ea.resumes, 1);
    EXPECT_TRUE(ea.applied);
  }
  // The other Mapping follows on its thread.
  ASSERT_TRUE(eb.WaitFor(&Events::resumes, 1));
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, engine->GetPool("kv"));
  const absl::Time deadline = absl::Now() + kWait;
  while (Ids(b->chunks()) != Ids(p.chunks) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(Ids(a->chunks()), Ids(p.chunks));
  EXPECT_EQ(Ids(b->chunks()), Ids(p.chunks));
  EXPECT_EQ(CheckPattern(*b, kept), "");
  {
    absl::MutexLock lock(&eb.mu);
    EXPECT_EQ(eb.pauses, 1);
    EXPECT_EQ(eb.resumes, 1);
    EXPECT_TRUE(eb.applied);
    EXPECT_EQ(eb.lost, 0);
  }
  // The connector deregistered the moving bytes before the pause and the released ones before they were
  // unmapped, and registers the new chunks once mapped.
  const uint64_t stride = b->geometry().segment_stride;
  const uint64_t MiB = uint64_t{1} << 20;
  {
    absl::MutexLock lock(&cb.mu);
    EXPECT_THAT(cb.released, ::testing::ElementsAre(Str({{0, 0, 4 * MiB}, {1, stride, 4 * MiB}}),
                                                    Str({{0, 4 * MiB, 4 * MiB}, {1, stride + 4 * MiB, 4 * MiB}})));
    EXPECT_THAT(cb.added, ::testing::ElementsAre(Str({{0, 0, 4 * MiB}, {1, stride, 4 * MiB}})));
  }
  // Written through one, read through the other: the two map the same new memory.
  *At(b->layer(1), 599, 1, 7, 7) = 0x3c;
  EXPECT_EQ(*At(a->layer(1), 599, 1, 7, 7), 0x3c);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, engine->DeviceInfo());
  EXPECT_EQ(d.committed_bytes, uint64_t{8} << 20);
}

// A Mapping whose pause hook does not return within the pause timeout: the change fails with
// DEADLINE_EXCEEDED naming it and nothing changed (every Mapping gets on_resume(false)); with
// detach_unresponsive it is detached instead (its Mapping is lost) and the change goes on.
TEST_F(ClientTest, AMappingThatDoesNotPauseInTime) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> slow, Connect("slow"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv", 2048)).status(), IsOk());
  Events ea, eb;
  PauseGate gate;  // the slow Mapping's
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine", true)));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, slow->Attach("kv", gate.Options(eb, "slow")));
  absl::Cleanup unblock = [&] { gate.Open(1000); };  // the follower must be able to stop
  WritePattern(*a, {0, 599, 1500});
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo before, engine->GetPool("kv"));
  const std::string slow_id = b->client_id();

  const PauseOptions pause{.timeout = absl::Seconds(1)};
  EXPECT_THAT(engine->Shrink("kv", 600, ShrinkOptions{.pause = pause}).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(slow_id)));
  gate.Open(1);
  ASSERT_TRUE(ea.WaitFor(&Events::resumes, 1));
  ASSERT_TRUE(eb.WaitFor(&Events::resumes, 1));
  for (Events* e : {&ea, &eb}) {
    absl::MutexLock lock(&e->mu);
    EXPECT_EQ(e->pauses, 1);
    EXPECT_FALSE(e->applied);
    EXPECT_EQ(e->lost, 0);
  }
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo after, engine->GetPool("kv"));
  EXPECT_EQ(Ids(after.chunks), Ids(before.chunks));
  EXPECT_EQ(after.committed_blocks, 2048u);
  EXPECT_EQ(Ids(a->chunks()), Ids(before.chunks));
  EXPECT_EQ(Ids(b->chunks()), Ids(before.chunks));
  EXPECT_EQ(CheckPattern(*b, {0, 599, 1500}), "");
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, engine->DeviceInfo());
  EXPECT_EQ(d.committed_bytes, uint64_t{16} << 20);              // the replacement chunks were given back
  EXPECT_EQ(Memfds(), a->chunks().size() + b->chunks().size());  // and dropped by both Mappings

  KVD_ASSERT_OK_AND_ASSIGN(
      PoolChange shrunk,
      engine->Shrink("kv", 600, ShrinkOptions{.pause = {.timeout = absl::Seconds(1), .detach_unresponsive = true}}));
  ASSERT_TRUE(shrunk.reshape.has_value());
  EXPECT_THAT(shrunk.reshape->detached_client_ids, ::testing::ElementsAre(slow_id));
  EXPECT_EQ(shrunk.reshape->paused_clients, 1u);
  EXPECT_TRUE(shrunk.reshape->target_reached);
  EXPECT_EQ(CheckPattern(*a, {0, 599}), "");
  gate.Open(2);
  ASSERT_TRUE(eb.WaitFor(&Events::lost, 1));
  EXPECT_EQ(b->state(), Mapping::State::kLost);
  EXPECT_TRUE(b->chunks().empty());
  EXPECT_EQ(Memfds(), a->chunks().size());  // lost mid-pause: the imported chunks went too
  {
    absl::MutexLock lock(&ea.mu);
    EXPECT_EQ(ea.pauses, 2);
    EXPECT_EQ(ea.resumes, 2);
    EXPECT_TRUE(ea.applied);
  }
}

// Compact of a pool grown 16 times (16 chunks per segment) leaves one chunk per segment, and both
// Mappings read every byte written before.
TEST_F(ClientTest, CompactOfAPoolGrownSixteenTimesKeepsEveryByte) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  PoolOptions o = SmallPool("kv", 512);
  o.dims.capacity_blocks = 8192;
  ASSERT_THAT(engine->CreatePool(o).status(), IsOk());
  Events ea, eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine", true)));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, connector->Attach("kv", eb.Options("connector", true)));
  std::vector<uint64_t> written;
  for (uint64_t i = 0; i < 16; ++i) {
    if (i > 0) {
      ASSERT_THAT(engine->Grow("kv", 512 * (i + 1)).status(), IsOk());
    }
    const std::vector<uint64_t> blocks = {512 * i, 512 * i + 255, 512 * i + 511};
    WritePattern(*a, blocks);
    written.insert(written.end(), blocks.begin(), blocks.end());
  }
  ASSERT_EQ(a->chunks().size(), 32u);
  ASSERT_TRUE(eb.WaitFor(&Events::grows, 15));
  const void* const base_b = b->base();

  KVD_ASSERT_OK_AND_ASSIGN(PoolChange compacted, engine->Compact("kv"));
  ASSERT_TRUE(compacted.reshape.has_value());
  const Reshape& r = *compacted.reshape;
  EXPECT_EQ(r.chunks_before, 32u);
  EXPECT_EQ(r.chunks_after, 2u);
  EXPECT_EQ(r.chunks_replaced, 32u);
  EXPECT_EQ(r.chunks_added, 2u);
  EXPECT_EQ(r.copied_bytes, uint64_t{64} << 20);
  EXPECT_EQ(r.paused_clients, 2u);
  EXPECT_EQ(compacted.pool.committed_blocks, 8192u);
  EXPECT_EQ(a->chunks().size(), 2u);  // remapped before Compact returned
  EXPECT_EQ(CheckPattern(*a, written), "");

  ASSERT_TRUE(eb.WaitFor(&Events::resumes, 1));
  EXPECT_EQ(b->base(), base_b);
  EXPECT_EQ(b->chunks().size(), 2u);
  EXPECT_EQ(b->committed_blocks(), 8192u);
  EXPECT_EQ(CheckPattern(*b, written), "");
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, engine->GetPool("kv"));
  EXPECT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(Ids(a->chunks()), Ids(p.chunks));
  EXPECT_EQ(Ids(b->chunks()), Ids(p.chunks));
  for (const ClientInfo& c : p.clients) EXPECT_TRUE(c.pausable) << c.client_id;
  for (Events* e : {&ea, &eb}) {
    absl::MutexLock lock(&e->mu);
    EXPECT_EQ(e->pauses, 1);
    EXPECT_EQ(e->resumes, 1);
    EXPECT_TRUE(e->applied);
    EXPECT_EQ(e->releases, 0);  // the pool kept its size
  }
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, engine->DeviceInfo());
  EXPECT_EQ(d.committed_bytes, uint64_t{64} << 20);  // the old chunks are gone
}

// A compaction called off (one Mapping never acknowledges): the punctual Mapping keeps the old chunks at
// the same addresses, bytes and all, and lets the new ones it imported go. Then, in steps of at most 8
// chunks, each step paused once.
TEST_F(ClientTest, ACompactionCalledOffMapsTheOldChunksBackAndOneInStepsPausesOnceAStep) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> slow, Connect("slow"));
  PoolOptions o = SmallPool("kv", 512);
  o.dims.capacity_blocks = 4096;
  ASSERT_THAT(engine->CreatePool(o).status(), IsOk());
  for (uint64_t blocks = 1024; blocks <= 4096; blocks += 512) ASSERT_THAT(engine->Grow("kv", blocks).status(), IsOk());
  Events ea, eb;
  PauseGate gate;  // the slow Mapping's
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine", true)));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, slow->Attach("kv", gate.Options(eb, "slow")));
  absl::Cleanup unblock = [&] { gate.Open(1000); };  // the follower must be able to stop
  const std::vector<uint64_t> written = {0, 511, 512, 1500, 2047, 2048, 4095};
  WritePattern(*a, written);
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo before, engine->GetPool("kv"));
  ASSERT_EQ(before.chunks.size(), 16u);

  EXPECT_THAT(engine->Compact("kv", {.pause = {.timeout = absl::Seconds(1)}}).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(b->client_id())));
  ASSERT_TRUE(ea.WaitFor(&Events::resumes, 1));
  {
    absl::MutexLock lock(&ea.mu);
    EXPECT_FALSE(ea.applied);
    EXPECT_EQ(ea.lost, 0);
  }
  EXPECT_EQ(Ids(a->chunks()), Ids(before.chunks));
  EXPECT_EQ(CheckPattern(*a, written), "");
  unsigned char* const probe = At(a->layer(1), 4095, 1, 7, 7);
  const unsigned char was = *probe;
  *probe = static_cast<unsigned char>(~was);  // the old memory, still mapped: the slow Mapping sees it too
  gate.Open(1);
  ASSERT_TRUE(eb.WaitFor(&Events::resumes, 1));
  EXPECT_EQ(*At(b->layer(1), 4095, 1, 7, 7), static_cast<unsigned char>(~was));
  *At(b->layer(1), 4095, 1, 7, 7) = was;
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, engine->DeviceInfo());
  EXPECT_EQ(d.committed_bytes, uint64_t{32} << 20);              // the new chunks were given back
  EXPECT_EQ(Memfds(), a->chunks().size() + b->chunks().size());  // and let go by both Mappings

  gate.Open(1000);
  KVD_ASSERT_OK_AND_ASSIGN(PoolChange compacted, engine->Compact("kv", {.max_chunks_per_pause = 8}));
  ASSERT_TRUE(compacted.reshape.has_value());
  EXPECT_EQ(compacted.reshape->steps, 2u);
  EXPECT_LE(compacted.reshape->max_pause_us, compacted.reshape->pause_us);
  EXPECT_EQ(compacted.reshape->chunks_after, 2u);
  EXPECT_EQ(a->chunks().size(), 2u);
  EXPECT_EQ(CheckPattern(*a, written), "");
  ASSERT_TRUE(eb.WaitFor(&Events::resumes, 3));
  EXPECT_EQ(CheckPattern(*b, written), "");
  for (Events* e : {&ea, &eb}) {
    absl::MutexLock lock(&e->mu);
    EXPECT_EQ(e->pauses, 3);  // the one called off, then one a step
    EXPECT_TRUE(e->applied);
    EXPECT_EQ(e->lost, 0);
  }
}

// A compaction called off before a slow Mapping's follower even read its PAUSE (the follower is held in the
// on_grow of the event before): the PAUSE's lease then answers ABORTED, and the Mapping, told that the pause
// was called off, keeps every chunk and byte, never pauses the engine, takes the RESUME (not applied) that
// follows and follows the next grow (docs/api.md "Pauses and reshaping").
TEST_F(ClientTest, APauseCalledOffBeforeItsLeaseWasFetchedKeepsTheMapping) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> slow, Connect("slow"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> op, Connect("operator"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv", 512)).status(), IsOk());
  ASSERT_THAT(engine->Grow("kv", 1024).status(), IsOk());  // two chunks a segment: something to compact
  Events ea, eb;
  GrowHold hold;  // the slow Mapping's on_grow waits until let go
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine", true)));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, slow->Attach("kv", hold.Options(eb, "slow", true)));
  absl::Cleanup unblock = [&] { hold.LetGo(); };  // the follower must be able to stop
  std::vector<uint64_t> written = {0, 511, 512, 1023};
  WritePattern(*a, written);

  ASSERT_THAT(engine->Grow("kv", 1536).status(), IsOk());
  ASSERT_TRUE(eb.WaitFor(&Events::grows, 1));  // the slow follower is held before the compaction's PAUSE
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo before, op->GetPool("kv"));
  EXPECT_THAT(op->Compact("kv", {.pause = {.timeout = absl::Seconds(1)}}).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(b->client_id())));
  ASSERT_TRUE(ea.WaitFor(&Events::resumes, 1));
  hold.LetGo();  // the slow follower reads the PAUSE now: its lease's pause was called off

  ASSERT_THAT(engine->Grow("kv", 2048).status(), IsOk());
  const bool followed = eb.WaitFor(&Events::grows, 2);  // past the PAUSE and RESUME, in the stream's order
  {
    absl::MutexLock lock(&eb.mu);
    ASSERT_EQ(eb.lost, 0) << eb.why;
  }
  ASSERT_TRUE(followed);
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, op->GetPool("kv"));
  EXPECT_EQ(p.committed_blocks, 2048u);
  EXPECT_EQ(p.chunks.size(), before.chunks.size() + 2);  // the compaction changed nothing
  EXPECT_EQ(b->state(), Mapping::State::kAwake);
  EXPECT_EQ(Ids(b->chunks()), Ids(p.chunks));
  EXPECT_EQ(MappedBytes(*b), uint64_t{16} << 20);
  EXPECT_EQ(b->committed_blocks(), 2048u);
  EXPECT_EQ(CheckPattern(*b, written), "");
  WritePattern(*b, {1024, 2047});  // the grown blocks, through the slow Mapping, read through the engine's
  written.insert(written.end(), {1024, 2047});
  EXPECT_EQ(CheckPattern(*a, written), "");
  {
    absl::MutexLock lock(&eb.mu);
    EXPECT_EQ(eb.pauses, 0);  // never paused for a pause it learnt of only once called off
    EXPECT_EQ(eb.resumes, 0);
    EXPECT_EQ(eb.last_blocks, 2048u);
  }
  const Mapping::Counts counts = b->counts();
  EXPECT_EQ(counts.pauses, 0u);
  EXPECT_EQ(counts.resumes, 0u);
  {
    absl::MutexLock lock(&ea.mu);
    EXPECT_EQ(ea.pauses, 1);
    EXPECT_EQ(ea.resumes, 1);
    EXPECT_FALSE(ea.applied);
  }
  EXPECT_EQ(Memfds(), a->chunks().size() + b->chunks().size());  // no FD of the called-off pause's chunks
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d, engine->DeviceInfo());
  EXPECT_EQ(d.committed_bytes, uint64_t{16} << 20);  // its new chunks were given back
}

// A Mapping without on_pause attaches non-pausable: Compact and an exact shrink that must replace a
// chunk fail with FAILED_PRECONDITION naming it and change nothing; a whole-chunks shrink still
// releases what it can and says that it stopped above the target.
TEST_F(ClientTest, ANonPausableMappingIsNeverPaused) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, Connect("engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> connector, Connect("connector"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv")).status(), IsOk());
  ASSERT_THAT(engine->Grow("kv", 2048).status(), IsOk());  // chunks end at blocks 512 and 2048
  Events ea, eb;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine", true)));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, connector->Attach("kv", eb.Options("plain")));
  WritePattern(*a, {0, 511, 700});
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo before, engine->GetPool("kv"));
  ASSERT_EQ(before.clients.size(), 2u);
  for (const ClientInfo& c : before.clients) EXPECT_EQ(c.pausable, c.name == "engine") << c.name;

  const std::string plain = b->client_id();
  EXPECT_THAT(engine->Compact("kv").status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(plain)));
  EXPECT_THAT(engine->Shrink("kv", 1000, ShrinkOptions{}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(plain)));
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo after, engine->GetPool("kv"));
  EXPECT_EQ(Ids(after.chunks), Ids(before.chunks));
  EXPECT_EQ(after.committed_blocks, 2048u);

  KVD_ASSERT_OK_AND_ASSIGN(PoolChange shrunk,
                           engine->Shrink("kv", 1000, ShrinkOptions{.wait = true, .whole_chunks_only = true}));
  ASSERT_TRUE(shrunk.reshape.has_value());
  EXPECT_FALSE(shrunk.reshape->target_reached);
  EXPECT_EQ(shrunk.reshape->paused_clients, 0u);
  EXPECT_EQ(shrunk.reshape->chunks_replaced, 0u);
  EXPECT_EQ(shrunk.pool.committed_blocks, 2048u);  // the chunk straddling block 1000 stays
  EXPECT_EQ(CheckPattern(*a, {0, 511, 700}), "");
  for (Events* e : {&ea, &eb}) {
    absl::MutexLock lock(&e->mu);
    EXPECT_EQ(e->pauses, 0);
    EXPECT_EQ(e->resumes, 0);
    EXPECT_EQ(e->lost, 0);
  }
  // Once the non-pausable Mapping is gone, the exact shrink goes ahead.
  b.reset();
  KVD_ASSERT_OK_AND_ASSIGN(PoolChange exact, engine->Shrink("kv", 1000, ShrinkOptions{}));
  ASSERT_TRUE(exact.reshape.has_value());
  EXPECT_TRUE(exact.reshape->target_reached);
  EXPECT_EQ(exact.reshape->paused_clients, 1u);
  EXPECT_EQ(CheckPattern(*a, {0, 511, 700}), "");
}

// A Client whose on_reply runs `hook` once, for the first reply of type `message` after Arm(): on the
// calling thread, after the daemon answered and before the Client acts on the reply (the window between a
// Grow's or Wake's reply and the redemption of its lease).
class ReplyHook {
 public:
  absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& socket, const std::string& name) {
    return Client::Connect(
        {.socket = socket, .client_name = name, .on_reply = [this](const google::protobuf::Message& m) {
           std::function<void()> run;
           {
             absl::MutexLock lock(&mu_);
             if (!hook_ || m.GetDescriptor()->full_name() != message_) return;
             run = std::move(hook_);
             hook_ = nullptr;
           }
           run();
         }});
  }
  void Arm(std::string message, std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    message_ = std::move(message);
    hook_ = std::move(hook);
  }

 private:
  absl::Mutex mu_;
  std::string message_ ABSL_GUARDED_BY(mu_);
  std::function<void()> hook_ ABSL_GUARDED_BY(mu_);
};

// The race of docs/api.md "Leases and concurrent releases": the engine's Grow has its reply (and its lease
// of the new chunks, one a segment) when another session's compaction replaces the chunks of segment 0
// (its first step) and pauses the engine for segment 1 (its second), all before the lease is redeemed.
// The Grow maps what is still in the pool and succeeds; the compaction's RESUMEs map the rest: the engine
// ends with exactly the pool's chunks, every byte in place, and no FD of a chunk it does not map.
TEST_F(ClientTest, AGrowWhoseNewChunksACompactionReplacedBeforeTheLeaseWasRedeemedMapsWhatIsLive) {
  ReplyHook hook;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, hook.Connect(daemon_.socket(), "engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> op, Connect("operator"));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv", 512)).status(), IsOk());
  ASSERT_THAT(engine->Grow("kv", 1024).status(), IsOk());  // two chunks a segment
  Events ea;
  PauseGate gate;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", gate.Options(ea, "engine")));
  absl::StatusOr<PoolChange> compacted = absl::UnknownError("not run");
  bool second_step_paused = false;
  std::thread compactor;
  absl::Cleanup unblock = [&] {
    gate.Open(1000);
    if (compactor.joinable()) compactor.join();
  };
  std::vector<uint64_t> written = {0, 511, 512, 1023};
  WritePattern(*a, written);

  gate.Open(1);  // the first step's pause passes; the second one's waits at the gate
  hook.Arm("kvd.v1.PoolUpdate", [&] {
    compactor = std::thread([&] { compacted = op->Compact("kv", {.max_chunks_per_pause = 3}); });
    second_step_paused = ea.WaitFor(&Events::pauses, 2);
  });
  absl::StatusOr<PoolChange> grown = engine->Grow("kv", 1536);
  ASSERT_TRUE(second_step_paused);
  ASSERT_THAT(grown.status(), IsOk());
  EXPECT_EQ(grown->added.size(), 2u);
  gate.Open(2);
  compactor.join();
  ASSERT_THAT(compacted.status(), IsOk());
  ASSERT_TRUE(compacted->reshape.has_value());
  EXPECT_EQ(compacted->reshape->steps, 2u);
  EXPECT_EQ(compacted->reshape->chunks_after, 2u);

  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, op->GetPool("kv"));
  EXPECT_EQ(p.committed_blocks, 1536u);
  EXPECT_EQ(Ids(a->chunks()), Ids(p.chunks));  // remapped before Compact returned
  EXPECT_EQ(a->committed_blocks(), 1536u);
  EXPECT_EQ(a->state(), Mapping::State::kAwake);
  EXPECT_EQ(Memfds(), a->chunks().size());
  {
    absl::MutexLock lock(&ea.mu);
    EXPECT_EQ(ea.lost, 0) << ea.why;
    EXPECT_EQ(ea.pauses, 2);
    EXPECT_EQ(ea.resumes, 2);
  }
  EXPECT_EQ(CheckPattern(*a, written), "");
  WritePattern(*a, {1024, 1535});  // the grown blocks are the engine's
  written.insert(written.end(), {1024, 1535});
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, op->Attach("kv"));
  EXPECT_EQ(CheckPattern(*b, written), "");
  EXPECT_EQ(p.pending_release_bytes, 0u);
}

// The same race for a Wake: another session's shrink of whole chunks releases one of each segment's two
// new chunks between the Wake's reply and the redemption of its lease. The Wake maps the chunks still in
// the pool and succeeds; the engine's Mapping is awake at the size the shrink left.
TEST_F(ClientTest, AWakeWhoseNewChunksAShrinkReleasedBeforeTheLeaseWasRedeemedMapsWhatIsLive) {
  Daemon sized;
  ASSERT_THAT(sized.Start({"--max-chunk=2MiB"}), IsOk());
  absl::Cleanup log = [&] {
    if (HasFailure()) std::cerr << "---- kvd log (--max-chunk=2MiB) ----\n" << sized.log() << "-----------------\n";
  };
  ReplyHook hook;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> engine, hook.Connect(sized.socket(), "engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> op,
                           Client::Connect({.socket = sized.socket(), .client_name = "op"}));
  ASSERT_THAT(engine->CreatePool(SmallPool("kv", 1024)).status(), IsOk());
  Events ea;
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> a, engine->Attach("kv", ea.Options("engine", /*pausable=*/true)));
  ASSERT_THAT(engine->Sleep("kv", /*wait=*/true).status(), IsOk());
  ASSERT_EQ(a->state(), Mapping::State::kSleeping);

  absl::StatusOr<PoolChange> shrunk = absl::UnknownError("not run");
  hook.Arm("kvd.v1.PoolUpdates",
           [&] { shrunk = op->Shrink("kv", 512, ShrinkOptions{.wait = true, .whole_chunks_only = true}); });
  absl::StatusOr<std::vector<PoolChange>> woken = engine->Wake("kv");
  ASSERT_THAT(shrunk.status(), IsOk());
  EXPECT_EQ(shrunk->released_chunk_ids.size(), 2u);
  ASSERT_THAT(woken.status(), IsOk());
  ASSERT_EQ(woken->size(), 1u);
  EXPECT_EQ((*woken)[0].added.size(), 4u);

  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, op->GetPool("kv"));
  EXPECT_EQ(p.committed_blocks, 512u);
  EXPECT_EQ(Ids(a->chunks()), Ids(p.chunks));
  EXPECT_EQ(a->committed_blocks(), 512u);
  EXPECT_EQ(a->state(), Mapping::State::kAwake);
  EXPECT_EQ(Memfds(), a->chunks().size());
  {
    absl::MutexLock lock(&ea.mu);
    EXPECT_EQ(ea.lost, 0) << ea.why;
  }
  WritePattern(*a, {0, 511});
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> b, op->Attach("kv"));
  EXPECT_EQ(CheckPattern(*b, {0, 511}), "");
}

}  // namespace
}  // namespace kvd
