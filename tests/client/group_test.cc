// End-to-end tests of engine groups (kvd/group.h) and peer access: two real kvd processes on the host
// backend stand for the daemons of GPU 0 and GPU 1 of one node (devices 0 and 1, sockets gpu0.sock and
// gpu1.sock in one directory). Each rank is an engine Client with a Mapping of its own pool; the Group
// is a separate coordinator, as kvctl would be.
//
// Every wait is bounded and waits for a condition; no test asserts on wall-clock time.
#include "kvd/group.h"

#include <cctype>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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
using ::kvd::testing::IsOkAndHolds;
using ::kvd::testing::KvdProcess;
using ::kvd::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr absl::Duration kWait = absl::Seconds(30);
constexpr uint64_t kMiB = uint64_t{1} << 20;

// L=2, H=2, N=16, C=1024, bf16: 64 KiB blocks in each of 2 segments (LBNHC), 32 blocks per 2 MiB chunk.
PoolOptions RankPool(const std::string& group, uint32_t rank, uint32_t size, uint64_t initial_blocks = 32) {
  PoolOptions o{
      .name = absl::StrCat(group, "-r", rank),
      .dims =
          {.layers = 2, .capacity_blocks = 512, .heads = 2, .block_tokens = 16, .channels = 1024, .element_bytes = 2},
      .initial_blocks = initial_blocks};
  o.layout.override_layout = "LBNHC";
  o.group = {.name = group, .rank = rank, .size = size};
  return o;
}

// Waits until fn() holds; false after kWait.
template <typename F>
bool WaitFor(F fn) {
  const absl::Time deadline = absl::Now() + kWait;
  while (!fn()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

class GroupTest : public ::testing::Test {
 protected:
  // Two daemons sharing one socket directory; `budget1` limits GPU 1's.
  void StartNode(const std::string& budget1 = "512MiB") {
    ASSERT_THAT(daemon0_.Start(KVD_BINARY, 0), IsOk());
    ASSERT_THAT(daemon1_.Start(KVD_BINARY, 1, {"--budget=" + budget1}, daemon0_.dir()), IsOk());
  }
  void SetUp() override { StartNode(); }

  std::unique_ptr<Client> Connect(const KvdProcess& d, const std::string& name) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect({.socket = d.socket(), .client_name = name});
    EXPECT_THAT(c, IsOk());
    return c.ok() ? *std::move(c) : nullptr;
  }

  // Rank r of group `name` (size 2): an engine Client on daemon r with its pool created and mapped.
  struct Rank {
    std::unique_ptr<Client> client;
    std::unique_ptr<Mapping> mapping;
  };
  Rank MakeRank(const std::string& name, uint32_t r, uint32_t size = 2) {
    Rank rank;
    rank.client = Connect(r == 0 ? daemon0_ : daemon1_, absl::StrCat("engine-rank", r));
    EXPECT_THAT(rank.client->CreatePool(RankPool(name, r, size)), IsOk());
    // Pausable: the Group's shrinks and sleeps come from another session (docs/api.md, "Releases and
    // running engines"); the engine touches nothing here, so its hook has nothing to stop.
    AttachOptions options;
    options.on_pause = [](const std::vector<ByteRange>&) {};
    absl::StatusOr<std::unique_ptr<Mapping>> m = rank.client->Attach(absl::StrCat(name, "-r", r), options);
    EXPECT_THAT(m, IsOk());
    if (m.ok()) rank.mapping = *std::move(m);
    return rank;
  }

  std::vector<std::string> Sockets() const { return {daemon0_.socket(), daemon1_.socket()}; }

  KvdProcess daemon0_, daemon1_;
};

TEST_F(GroupTest, GrowSleepAndWakeMoveEveryRankAndEveryRankFollows) {
  Rank r0 = MakeRank("llama", 0), r1 = MakeRank("llama", 1);
  // Found by name in the node's socket directory, ranks in order.
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<std::string> sockets, NodeSockets(daemon0_.dir()));
  EXPECT_EQ(sockets, Sockets());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Group> group, Group::Open("llama", sockets));
  ASSERT_THAT(group->ranks(), SizeIs(2));
  EXPECT_EQ(group->ranks()[1].pool.name, "llama-r1");
  EXPECT_EQ(group->ranks()[1].socket, daemon1_.socket());

  KVD_ASSERT_OK_AND_ASSIGN(GroupChange grown, group->Grow(256));
  ASSERT_THAT(grown.ranks, SizeIs(2));
  EXPECT_EQ(grown.prepared_bytes, 2 * 2 * 14 * kMiB);  // each rank: 2 segments from 2 to 16 MiB
  for (const PoolChange& c : grown.ranks) EXPECT_EQ(c.pool.committed_blocks, 256u);
  // Each engine's follower maps its rank's new chunks; write into a new block of each.
  for (Rank* r : {&r0, &r1}) {
    ASSERT_TRUE(WaitFor([&] { return r->mapping->committed_blocks() == 256 && r->mapping->chunks().size() == 4; }));
    std::memset(static_cast<char*>(r->mapping->layer(1).data) + 200 * r->mapping->geometry().stride_b, 0x5a, 4096);
  }

  KVD_ASSERT_OK_AND_ASSIGN(GroupChange slept, group->Sleep(/*wait=*/true));
  for (const PoolChange& c : slept.ranks) {
    EXPECT_EQ(c.pool.state, PoolState::kSleeping);
    EXPECT_EQ(c.pool.pending_release_bytes, 0u);  // every follower acknowledged
  }
  for (Rank* r : {&r0, &r1}) EXPECT_EQ(r->mapping->state(), Mapping::State::kSleeping);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d1, r1.client->DeviceInfo());
  EXPECT_EQ(d1.committed_bytes, 0u);

  KVD_ASSERT_OK_AND_ASSIGN(GroupChange woken, group->Wake());
  for (const PoolChange& c : woken.ranks) {
    EXPECT_EQ(c.pool.state, PoolState::kAwake);
    EXPECT_EQ(c.pool.committed_blocks, 256u);
    EXPECT_THAT(c.pool.chunks, SizeIs(2));  // one chunk per segment again
  }
  for (Rank* r : {&r0, &r1}) {
    ASSERT_TRUE(
        WaitFor([&] { return r->mapping->state() == Mapping::State::kAwake && r->mapping->chunks().size() == 2; }));
  }

  ASSERT_THAT(group->Grow(384), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(GroupChange shrunk, group->Shrink(256, /*wait=*/true));
  for (const PoolChange& c : shrunk.ranks) {
    EXPECT_EQ(c.pool.committed_blocks, 256u);
    EXPECT_EQ(c.released_chunk_ids.size(), 2u);
  }
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<GroupRank> now, group->Refresh());
  for (const GroupRank& r : now) EXPECT_TRUE(r.pool.transaction.empty());
}

// GPU 1's daemon may commit 16 MiB only.
class GroupTightBudgetTest : public GroupTest {
 protected:
  void SetUp() override { StartNode("16MiB"); }
};

TEST_F(GroupTightBudgetTest, ARankThatCannotGrowLeavesEveryRankAsItWas) {
  Rank r0 = MakeRank("llama", 0), r1 = MakeRank("llama", 1);
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo before0, r0.client->GetPool("llama-r0"));
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus device0, r0.client->DeviceInfo());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Group> group, Group::Open("llama", Sockets()));

  // 256 blocks need 32 MiB a rank: GPU 0 prepares them, GPU 1's budget of 16 MiB cannot.
  EXPECT_THAT(group->Grow(256),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("group llama: grow to 256 blocks failed on rank 1"), HasSubstr("budget"),
                             HasSubstr("no rank changed"), HasSubstr("rolled back: 0"))));
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo after0, r0.client->GetPool("llama-r0"));
  EXPECT_EQ(after0.committed_blocks, before0.committed_blocks);
  EXPECT_EQ(after0.generation, before0.generation);  // rank 0's clients never saw the memory
  EXPECT_TRUE(after0.transaction.empty());
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus device0_after, r0.client->DeviceInfo());
  EXPECT_EQ(device0_after.committed_bytes, device0.committed_bytes);
  EXPECT_EQ(r0.mapping->committed_blocks(), 32u);

  // What fits everywhere still works, and both ranks move.
  KVD_ASSERT_OK_AND_ASSIGN(GroupChange grown, group->Grow(96));
  for (const PoolChange& c : grown.ranks) EXPECT_EQ(c.pool.committed_blocks, 96u);
}

TEST_F(GroupTest, ACommitThatFailsPutsTheCommittedRanksBack) {
  Rank r0 = MakeRank("llama", 0), r1 = MakeRank("llama", 1);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus device0, r0.client->DeviceInfo());
  GroupOptions options;
  // GPU 1's daemon dies between the phases: rank 0 commits, rank 1 cannot.
  options.before_commit = [this] {
    daemon1_.Kill();
    return absl::OkStatus();
  };
  options.connect.timeout = absl::Seconds(5);
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Group> group, Group::Open("llama", Sockets(), options));
  EXPECT_THAT(group->Grow(256), StatusIs(absl::StatusCode::kAborted,
                                         AllOf(HasSubstr("commit failed on rank 1"), HasSubstr("put back: 0"))));
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo after0, r0.client->GetPool("llama-r0"));
  EXPECT_EQ(after0.committed_blocks, 32u);
  EXPECT_TRUE(after0.transaction.empty());
  // The engine's follower mapped the committed chunks and then released them again.
  ASSERT_TRUE(WaitFor([&] { return r0.mapping->committed_blocks() == 32 && r0.mapping->chunks().size() == 2; }));
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<DeviceStatus> d = r0.client->DeviceInfo();
    return d.ok() && d->committed_bytes == device0.committed_bytes;
  }));
}

TEST_F(GroupTest, ACoordinatorThatFailsBeforeTheCommitAbortsEveryRank) {
  Rank r0 = MakeRank("llama", 0), r1 = MakeRank("llama", 1);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus device0, r0.client->DeviceInfo());
  GroupOptions options;
  options.before_commit = [] { return absl::CancelledError("the coordinator gives up"); };
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Group> group, Group::Open("llama", Sockets(), options));
  EXPECT_THAT(group->Grow(128),
              StatusIs(absl::StatusCode::kCancelled,
                       AllOf(HasSubstr("group llama: grow to 128 blocks: before the commit: the coordinator gives up"),
                             HasSubstr("no rank changed (prepared ranks rolled back: 0, 1)"))));
  for (Rank* r : {&r0, &r1}) {
    KVD_ASSERT_OK_AND_ASSIGN(PoolInfo after, r->client->GetPool(r->mapping->pool()));
    EXPECT_EQ(after.committed_blocks, 32u);
    EXPECT_TRUE(after.transaction.empty());
  }
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus device0_after, r0.client->DeviceInfo());
  EXPECT_EQ(device0_after.committed_bytes, device0.committed_bytes);
  EXPECT_EQ(r0.mapping->committed_blocks(), 32u);
}

TEST_F(GroupTest, FindSocketFindsTheKvdOfADeviceByItsUuid) {
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d1, Connect(daemon1_, "probe")->DeviceInfo());
  EXPECT_THAT(FindSocket(d1.uuid, daemon0_.dir()), IsOkAndHolds(daemon1_.socket()));
  // A unique prefix: everything but the index digit is shared, so take the whole UUID in upper case.
  std::string upper = d1.uuid;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_THAT(FindSocket(upper, daemon0_.dir()), IsOkAndHolds(daemon1_.socket()));
  EXPECT_THAT(FindSocket(d1.uuid.substr(0, d1.uuid.size() - 2), daemon0_.dir()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("matches several daemons")));
  EXPECT_THAT(FindSocket("GPU-0000", daemon0_.dir()),
              StatusIs(absl::StatusCode::kNotFound, AllOf(HasSubstr("no kvd serves it"), HasSubstr(d1.uuid))));
  EXPECT_THAT(FindSocket("GPU-0000", daemon0_.dir() + "/none"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("socket directory")));
}

TEST_F(GroupTest, OpenRefusesAGroupThatIsNotWhole) {
  Rank r0 = MakeRank("llama", 0);
  EXPECT_THAT(Group::Open("llama", Sockets()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank 1 of 2 not found")));
  EXPECT_THAT(Group::Open("mistral", Sockets()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("group mistral: no pool of it")));
  std::unique_ptr<Client> c1 = Connect(daemon1_, "engine-rank1");
  PoolOptions twin = RankPool("llama", 0, 2);
  twin.name = "llama-twin";
  ASSERT_THAT(c1->CreatePool(twin), IsOk());
  EXPECT_THAT(Group::Open("llama", Sockets()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank 0 appears twice")));
  ASSERT_THAT(c1->DeletePool("llama-twin", false), IsOk());
  ASSERT_THAT(c1->CreatePool(RankPool("llama", 1, 3)), IsOk());
  EXPECT_THAT(Group::Open("llama", Sockets()), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("says 3")));
  EXPECT_THAT(Group::Open("llama", {daemon0_.dir() + "/gpu7.sock"}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("gpu7.sock")));
}

TEST_F(GroupTest, ADaemonThatDoesNotAnswerIsPassedOverButNamed) {
  Rank r0 = MakeRank("llama", 0), r1 = MakeRank("llama", 1);
  const std::string stale = daemon0_.dir() + "/gpu5.sock";  // a stopped kvd's leftover, say
  std::vector<std::string> sockets = Sockets();
  sockets.push_back(stale);
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Group> group, Group::Open("llama", sockets));
  EXPECT_THAT(group->ranks(), SizeIs(2));
  group.reset();
  daemon1_.Kill();
  EXPECT_THAT(Group::Open("llama", sockets),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("rank 1 of 2 not found on " + daemon0_.socket()),
                             HasSubstr("not answering: " + daemon1_.socket()), HasSubstr("gpu5.sock"))));
}

TEST_F(GroupTest, ACoordinatorThatDiesBetweenThePhasesLeavesNothingHeld) {
  Rank r0 = MakeRank("llama", 0), r1 = MakeRank("llama", 1);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus d0, r0.client->DeviceInfo());
  {
    std::unique_ptr<Client> coordinator = Connect(daemon0_, "coordinator");
    KVD_ASSERT_OK_AND_ASSIGN(PreparedChange p,
                             coordinator->Prepare("llama-r0", GroupOp::kGrow, 256, absl::Minutes(10)));
    EXPECT_GT(p.prepared_bytes, 0u);
    KVD_ASSERT_OK_AND_ASSIGN(PoolInfo held, r0.client->GetPool("llama-r0"));
    EXPECT_EQ(held.transaction, p.transaction);
    EXPECT_THAT(r0.client->Grow("llama-r0", 64), StatusIs(absl::StatusCode::kAborted, HasSubstr(p.transaction)));
    // Another session may neither commit nor abort it.
    EXPECT_THAT(r0.client->Commit(p.transaction, false), StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  }  // the coordinator's session closes: kvd aborts what it held
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<PoolInfo> p = r0.client->GetPool("llama-r0");
    absl::StatusOr<DeviceStatus> d = r0.client->DeviceInfo();
    return p.ok() && p->transaction.empty() && d.ok() && d->committed_bytes == d0.committed_bytes;
  }));
  EXPECT_THAT(r0.client->Grow("llama-r0", 64), IsOk());
}

TEST_F(GroupTest, MalformedGroupRequestsNameTheirField) {
  std::unique_ptr<Client> c = Connect(daemon0_, "bad");
  PoolOptions o = RankPool("llama", 2, 2);
  EXPECT_THAT(c->CreatePool(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group.rank")));
  o = RankPool("llama", 0, 2);
  o.group.name = "no/slash";
  EXPECT_THAT(c->CreatePool(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group.name")));
  o = RankPool("llama", 0, 2);
  o.peer_devices = {"GPU-ok", "bad uuid"};
  EXPECT_THAT(c->CreatePool(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("peer_devices[1]")));
  ASSERT_THAT(c->CreatePool(RankPool("llama", 0, 2)), IsOk());
  EXPECT_THAT(c->Prepare("llama-r0", GroupOp::kSleep, 5, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("target_blocks")));
  EXPECT_THAT(c->Prepare("llama-r0", GroupOp::kGrow, 64, absl::Hours(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ttl_ms")));
  EXPECT_THAT(c->Commit("", false), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("transaction")));
  EXPECT_THAT(c->Abort("t-unknown"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("transaction")));
  EXPECT_THAT(c->GrantPeerAccess("llama-r0", ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device_uuid")));
  // The daemon is still serving, and nothing is held.
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo p, c->GetPool("llama-r0"));
  EXPECT_TRUE(p.transaction.empty());
}

TEST_F(GroupTest, AProcessOnAnotherDeviceMapsAPoolOnlyOnceGranted) {
  Rank r0 = MakeRank("tp", 0);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus own, r0.client->DeviceInfo());
  std::unique_ptr<Client> peer_client = Connect(daemon0_, "rank1-reader");
  KVD_ASSERT_OK_AND_ASSIGN(DeviceStatus peer_device, Connect(daemon1_, "probe")->DeviceInfo());
  ASSERT_NE(peer_device.uuid, own.uuid);

  AttachOptions from_gpu1;
  from_gpu1.client_name = "rank1-reader";
  from_gpu1.device = "1";  // this process maps from device 1 of the same backend
  EXPECT_THAT(peer_client->Attach("tp-r0", from_gpu1),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       AllOf(HasSubstr(peer_device.uuid), HasSubstr(own.uuid), HasSubstr("kvctl grant"))));
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo granted, r0.client->GrantPeerAccess("tp-r0", peer_device.uuid));
  EXPECT_THAT(granted.peer_devices, ::testing::ElementsAre(peer_device.uuid));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Mapping> peer, peer_client->Attach("tp-r0", from_gpu1));

  // The neighbour reads what rank 0 wrote, and rank 0 reads what it wrote back.
  char* mine = static_cast<char*>(r0.mapping->layer(1).data) + 7 * r0.mapping->geometry().stride_b;
  char* theirs = static_cast<char*>(peer->layer(1).data) + 7 * peer->geometry().stride_b;
  std::memset(mine, 0x3c, 1024);
  EXPECT_EQ(theirs[0], 0x3c);
  EXPECT_EQ(theirs[1023], 0x3c);
  theirs[0] = 0x11;
  EXPECT_EQ(mine[0], 0x11);
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo described, r0.client->GetPool("tp-r0"));
  bool listed = false;
  for (const ClientInfo& c : described.clients) listed |= c.device_uuid == peer_device.uuid;
  EXPECT_TRUE(listed);
  // A grow reaches the peer mapping too.
  ASSERT_THAT(r0.client->Grow("tp-r0", 128), IsOk());
  ASSERT_TRUE(WaitFor([&] { return peer->committed_blocks() == 128; }));
  KVD_ASSERT_OK_AND_ASSIGN(PoolInfo revoked, r0.client->GrantPeerAccess("tp-r0", peer_device.uuid, true));
  EXPECT_TRUE(revoked.peer_devices.empty());
  EXPECT_THAT(peer_client->Attach("tp-r0", from_gpu1), StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
  EXPECT_THAT(Connect(daemon0_, "late")->Attach("tp-r0", from_gpu1),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
}

}  // namespace
}  // namespace kvd
