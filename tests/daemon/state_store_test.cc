// The pool record files of --state-dir (daemon/state/state_store.h): what SavePool writes is the PoolRecord
// that a whole-message serialization (as kvd wrote it before records were streamed chunk by chunk) holds,
// and a record in that older byte layout restores unchanged.
#include "daemon/state/state_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/time/time.h"
#include "daemon/codec/codec.h"
#include "google/protobuf/util/message_differencer.h"
#include "kvd/state.pb.h"

namespace kvd::daemon {
namespace {

// A record with every field set, as kvd's ToRecord filled a PoolRecord before SavePool streamed the chunks:
// all of them in the message, serialized in field order.
state::PoolRecord WholeRecord() {
  state::PoolRecord r;
  r.set_format(1);
  r.set_name("llama");
  v1::PoolDims* dims = r.mutable_dims();
  dims->set_layers(2);
  dims->set_capacity_blocks(64);
  dims->set_heads(8);
  dims->set_block_tokens(16);
  dims->set_channels(128);
  dims->set_element_bytes(2);
  *r.mutable_layout() = ToProto(LayoutResolution{});
  r.set_granularity_bytes(2 << 20);
  r.set_owner_uid(1000);
  r.add_allowed_uids(1001);
  r.add_allowed_uids(1002);
  r.mutable_group()->set_name("tp");
  r.mutable_group()->set_rank(1);
  r.mutable_group()->set_size(2);
  r.add_peer_devices("GPU-peer");
  r.set_created_at_unix_ms(1'700'000'000'123);
  r.set_state(v1::POOL_STATE_SLEEPING);
  r.set_prefix_bytes(8 << 20);
  r.set_wake_blocks(48);
  r.set_generation(7);
  for (uint64_t i = 0; i < 300; ++i) {  // more than one byte of length and of id
    v1::Chunk* c = r.add_chunks();
    c->set_id(1000 + i);
    c->set_segment(i % 2);
    c->set_offset((i % 2) * (64 << 20) + (i / 2) * (2 << 20));
    c->set_bytes(2 << 20);
    if (i == 3) c->set_fabric_handle(std::string(64, '\x7f'));
  }
  r.set_pending_release_bytes(4 << 20);
  *r.mutable_metadata() = ToProto("llama", PoolMetadata{.version = 3,
                                                        .data = std::string("engine\0state", 12),
                                                        .updated_at = absl::FromUnixMillis(1'700'000'000'456)});
  *r.mutable_policy() = ToProto(PoolPolicy{.priority = 5,
                                           .min_bytes = 2 << 20,
                                           .max_bytes = 1 << 30,
                                           .reclaim_timeout = absl::Seconds(3),
                                           .on_timeout = ReclaimAction::kShrink});
  r.set_policy_operator_bounds(true);
  state::KeptRecord* k = r.mutable_kept();
  k->set_tier_offset(4 << 20);
  k->set_extent_bytes(8 << 20);
  k->set_bytes(6 << 20);
  state::KeptRecord::Run* run = k->add_runs();
  run->set_pool_offset(0);
  run->set_bytes(4 << 20);
  run = k->add_runs();
  run->set_pool_offset(64 << 20);
  run->set_bytes(2 << 20);
  k->set_live_blocks(12);
  return r;
}

state::PoolRecord Parsed(const std::string& bytes) {
  state::PoolRecord r;
  EXPECT_TRUE(r.ParseFromString(bytes));
  return r;
}

void ExpectSameRecord(const state::PoolRecord& got, const state::PoolRecord& want) {
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differ.Compare(got, want)) << diff;
}

TEST(PoolRecordTest, ARecordInTheWholeMessageLayoutRestoresAndIsWrittenBackAsTheSameRecord) {
  const state::PoolRecord whole = WholeRecord();
  const std::string old_bytes = whole.SerializeAsString();
  absl::StatusOr<SavedPool> pool = ParsePoolRecord(old_bytes);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(pool->name, "llama");
  ASSERT_EQ(pool->chunks.size(), 300u);
  EXPECT_EQ(pool->chunks[299].id, 1299u);
  ASSERT_NE(pool->chunks[3].fabric_handle, nullptr);
  EXPECT_EQ(*pool->chunks[3].fabric_handle, std::string(64, '\x7f'));
  EXPECT_EQ(pool->chunks[4].fabric_handle, nullptr);
  ASSERT_TRUE(pool->kept.has_value());
  EXPECT_EQ(pool->kept->runs.size(), 2u);
  EXPECT_EQ(pool->policy.priority, 5u);
  EXPECT_TRUE(pool->policy.operator_bounds);
  EXPECT_EQ(pool->metadata.data, std::string("engine\0state", 12));

  const std::string new_bytes = SerializePoolRecord(*pool);
  ExpectSameRecord(Parsed(new_bytes), whole);
  // The chunks come last now: other bytes, the same message (and the same size).
  EXPECT_NE(new_bytes, old_bytes);
  EXPECT_EQ(new_bytes.size(), old_bytes.size());
}

TEST(PoolRecordTest, APoolWithoutChunksOrKeptContentsIsTheSameRecordToo) {
  state::PoolRecord whole = WholeRecord();
  whole.clear_chunks();
  whole.clear_kept();
  whole.set_state(v1::POOL_STATE_AWAKE);
  absl::StatusOr<SavedPool> pool = ParsePoolRecord(whole.SerializeAsString());
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_TRUE(pool->chunks.empty());
  ExpectSameRecord(Parsed(SerializePoolRecord(*pool)), whole);
}

TEST(PoolRecordTest, BytesThatAreNotARecordAreDataLoss) {
  EXPECT_TRUE(absl::IsDataLoss(ParsePoolRecord("\xff\xff\xff").status()));
  state::PoolRecord newer = WholeRecord();
  newer.set_format(2);
  EXPECT_TRUE(absl::IsFailedPrecondition(ParsePoolRecord(newer.SerializeAsString()).status()));
}

// A state directory whose record a kvd wrote in the whole-message layout: the next daemon's store reads it
// unchanged, and its own save of the pool is that record again.
TEST(FileStateStoreTest, AStateDirectoryWrittenInTheOldLayoutOpensUnchangedAndSavesBackTheSameRecord) {
  char tmpl[] = "/tmp/kvd-state-store-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::filesystem::path dir = tmpl;
  std::filesystem::create_directories(dir / "pools");
  const state::PoolRecord whole = WholeRecord();
  {
    std::FILE* f = std::fopen((dir / "pools" / "llama").c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const std::string bytes = whole.SerializeAsString();
    ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    std::fclose(f);
  }
  unsetenv("LISTEN_FDS");
  const DeviceInfo device{.backend = BackendKind::kHost, .uuid = "host-test-0", .granularity = 2 << 20};
  SavedState saved;
  absl::StatusOr<std::unique_ptr<FileStateStore>> store = FileStateStore::Open({.dir = dir}, device, &saved);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(saved.problems.empty());
  ASSERT_EQ(saved.pools.size(), 1u);
  ExpectSameRecord(Parsed(SerializePoolRecord(saved.pools[0])), whole);

  ASSERT_TRUE((*store)->SavePool(saved.pools[0]).ok());
  std::FILE* f = std::fopen((dir / "pools" / "llama").c_str(), "rb");
  ASSERT_NE(f, nullptr);
  std::string written(1 << 16, '\0');
  written.resize(std::fread(written.data(), 1, written.size(), f));
  std::fclose(f);
  ExpectSameRecord(Parsed(written), whole);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvd::daemon
