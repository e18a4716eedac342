// Arbitration on the real kvd (issue 23; docs/api.md, "Policy, waiting and reclaim"): engines of several
// priorities on one "GPU" that is full — the host backend with 512 MiB of its 1 GiB used by "other
// processes" (--host-used-by-others) and 64 MiB of headroom, so kvd can back 448 MiB although its budget
// is 900 MiB. Each engine is a libkvd Client of its own (a session) with a pausable Mapping of its pool;
// it writes a pattern into its live blocks (every fifth block) and checks them byte for byte, following
// the moves of its compaction shrinks. An engine answers a RECLAIM event by giving back (ShrinkForReclaim
// with its live blocks), by declining, or not at all; one runs in a child process that the test kills
// in the middle of a reclaim (`arbitration_test --engine SOCKET POOL`).
//
// What is checked is behaviour: that no commit ever passes what the device can back (the daemon's
// committed bytes, sampled throughout, and the driver never refusing memory: kvd_driver_out_of_memory_total
// and the host backend's own refusal never in the log), who is served first, who is asked, what the policy
// does, and that live bytes are intact. Every wait is bounded; no test asserts on wall-clock time.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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

extern char** environ;

namespace kvd {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr absl::Duration kWait = absl::Seconds(30);
// What kvd may commit on the "full" device: 1 GiB less 512 MiB of others less 64 MiB of headroom.
constexpr uint64_t kRoom = 448 * kMiB;
// 2 layers (2 segments) of 32 KiB per block: 64 KiB a block, 64 blocks a 2 MiB granule per segment.
constexpr uint64_t kBlockBytes = 64 * 1024;
constexpr uint64_t kBlocksPerMiB = kMiB / kBlockBytes;

PoolDims Dims() {
  return {.layers = 2, .capacity_blocks = 8192, .heads = 8, .block_tokens = 16, .channels = 128, .element_bytes = 2};
}

// A TCP port nobody listens on now, for --metrics-address.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// GET /metrics: the body ("" when it cannot be read).
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string text;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[65536];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) text.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  const size_t body = text.find("\r\n\r\n");
  return body == std::string::npos ? "" : text.substr(body + 4);
}

// The value of the first series of `metric` whose labels contain `labels` ("" for any); -1 when absent.
double Metric(const std::string& body, absl::string_view metric, absl::string_view labels = "") {
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (!absl::StartsWith(line, metric) || line.size() <= metric.size()) continue;
    const char next = line[metric.size()];
    if (next != ' ' && next != '{') continue;
    if (!labels.empty() && !absl::StrContains(line, labels)) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return -1;
}

// One engine: a Client (a session of its own), its pool and a pausable Mapping of it. It writes a
// pattern into its live blocks and checks them; a block table maps each live block (by the id the engine
// first wrote it at) to where it lives now, following the moves of its compaction shrinks.
class Engine {
 public:
  // kIgnore: no reclaim hook at all; kStall: a hook that returns at once without giving anything back.
  enum class Answer { kGive, kDecline, kStall, kIgnore };

  // Creates pool `name` with `policy` and `blocks` committed (grown in steps of 1024 blocks, so that its
  // chunks end every 64 MiB), attaches it and writes every fifth block below `live_below` (0: all).
  static std::unique_ptr<Engine> Open(const std::string& socket, const std::string& name, PoolPolicy policy,
                                      uint64_t blocks, Answer answer, uint64_t live_below = 0) {
    auto e = std::unique_ptr<Engine>(new Engine(name, answer));
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket = socket, .client_name = name, .timeout = absl::Seconds(60)});
    EXPECT_THAT(client.status(), IsOk());
    if (!client.ok()) return nullptr;
    e->client_ = *std::move(client);
    absl::StatusOr<PoolInfo> pool = e->client_->CreatePool({.name = name, .dims = Dims(), .policy = policy});
    EXPECT_THAT(pool.status(), IsOk());
    if (!pool.ok()) return nullptr;
    AttachOptions o;
    o.client_name = name;
    o.on_pause = [raw = e.get()](const std::vector<ByteRange>&) {
      absl::MutexLock lock(&raw->mu_);
      raw->paused_ = true;  // the test thread touches the pool only while this is false
    };
    o.on_resume = [raw = e.get()](bool) {
      absl::MutexLock lock(&raw->mu_);
      raw->paused_ = false;
    };
    if (answer != Answer::kIgnore) {
      o.on_reclaim = [raw = e.get()](const ReclaimRequest& r) { return raw->OnReclaim(r); };
    }
    absl::StatusOr<std::unique_ptr<Mapping>> mapping = e->client_->Attach(name, o);
    EXPECT_THAT(mapping.status(), IsOk());
    if (!mapping.ok()) return nullptr;
    e->mapping_ = *std::move(mapping);
    for (uint64_t at = 1024; at < blocks + 1024; at += 1024) {
      const absl::Status grown = e->client_->Grow(name, std::min(at, blocks)).status();
      EXPECT_THAT(grown, IsOk());
      if (!grown.ok()) return nullptr;
    }
    e->Write(live_below == 0 ? blocks : live_below);
    return e;
  }

  const std::string& name() const { return name_; }
  Client& client() { return *client_; }
  uint64_t committed_blocks() { return client_->GetPool(name_)->committed_blocks; }
  int reclaims() {
    absl::MutexLock lock(&mu_);
    return reclaims_;
  }
  void set_answer(Answer answer) { answer_ = answer; }

  // Every live block holds what was written into it, wherever it lives now. Empty: all of them do.
  std::string Check() {
    absl::MutexLock lock(&mu_);
    // Not paused, and every reclaim hook done (a waiter may be served a moment before the hook's shrink
    // returns and its moves are known).
    auto settled = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !paused_ && answered_ == reclaims_; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&settled), kWait)) return "the engine stayed paused or answering";
    for (const auto& [first, now] : where_) {
      for (uint64_t l = 0; l < Dims().layers; ++l) {
        const uint32_t* words = Words(l, now);
        for (uint64_t i = 0; i < kWordsPerLayer; ++i) {
          if (words[i] != Pattern(first, l, i)) {
            return absl::StrCat(name_, ": block ", first, " (now at ", now, "), layer ", l, ", word ", i, " is ",
                                words[i], ", not ", Pattern(first, l, i));
          }
        }
      }
    }
    return "";
  }

  // The live blocks' current ids.
  std::vector<uint64_t> Live() {
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> out;
    for (const auto& [first, now] : where_) out.push_back(now);
    return out;
  }

 private:
  static constexpr uint64_t kWordsPerLayer = 8 * 16 * 128 * 2 / 4;

  Engine(std::string name, Answer answer) : name_(std::move(name)), answer_(answer) {}

  uint32_t Pattern(uint64_t block, uint64_t layer, uint64_t i) const {
    return static_cast<uint32_t>(std::hash<std::string>()(name_)) ^ static_cast<uint32_t>(block * 2654435761u) ^
           static_cast<uint32_t>(layer * 40503 + i);
  }
  uint32_t* Words(uint64_t layer, uint64_t block) const {
    const LayerView v = mapping_->layer(layer);
    return reinterpret_cast<uint32_t*>(static_cast<char*>(v.data) + block * v.stride_b);
  }
  void Write(uint64_t below) {
    absl::MutexLock lock(&mu_);
    for (uint64_t b = 0; b < below; b += 5) {
      for (uint64_t l = 0; l < Dims().layers; ++l) {
        uint32_t* words = Words(l, b);
        for (uint64_t i = 0; i < kWordsPerLayer; ++i) words[i] = Pattern(b, l, i);
      }
      where_[b] = b;
    }
  }

  // On a thread of its own (AttachOptions::on_reclaim): give back with the live blocks, or decline.
  absl::Status OnReclaim(const ReclaimRequest& request) {
    std::vector<uint64_t> live;
    {
      absl::MutexLock lock(&mu_);
      ++reclaims_;
      if (answer_ != Answer::kGive) {
        ++answered_;
        // kStall says nothing: the deadline decides.
        return answer_ == Answer::kDecline ? absl::FailedPreconditionError("busy serving") : absl::OkStatus();
      }
      for (const auto& [first, now] : where_) live.push_back(now);
    }
    absl::StatusOr<PoolChange> change = client_->ShrinkForReclaim(request, live);
    absl::MutexLock lock(&mu_);
    ++answered_;
    if (!change.ok()) return change.status();
    std::map<uint64_t, uint64_t> moved;
    if (change->reshape.has_value()) {
      for (const BlockMove& m : change->reshape->moved_blocks) moved[m.src] = m.dst;
    }
    for (auto& [first, now] : where_) {
      if (auto it = moved.find(now); it != moved.end()) now = it->second;
    }
    return absl::OkStatus();
  }

  const std::string name_;
  std::atomic<Answer> answer_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Mapping> mapping_;
  absl::Mutex mu_;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint64_t, uint64_t> where_ ABSL_GUARDED_BY(mu_);  // first id -> id now
  int reclaims_ ABSL_GUARDED_BY(mu_) = 0;
  int answered_ ABSL_GUARDED_BY(mu_) = 0;  // hooks that returned
};

class ArbitrationTest : public ::testing::Test {
 protected:
  void StartKvd(std::vector<std::string> extra = {}) {
    port_ = FreePort();
    std::vector<std::string> flags = {"--host-capacity=1GiB",    "--host-used-by-others=512MiB",
                                      "--budget=900MiB",         "--device-headroom=64MiB",
                                      "--reclaim-timeout=5s",    absl::StrCat("--metrics-address=127.0.0.1:", port_),
                                      "--state-dir=${dir}/state"};
    // `extra` replaces a default of the same flag.
    for (const std::string& e : extra) {
      const std::string name = e.substr(0, e.find('=') + 1);
      std::erase_if(flags, [&](const std::string& f) { return absl::StartsWith(f, name); });
    }
    flags.insert(flags.end(), extra.begin(), extra.end());
    ASSERT_THAT(kvd_.Start(KVD_BINARY, 0, flags), IsOk());
    absl::StatusOr<std::unique_ptr<Client>> op = Client::Connect({.socket = kvd_.socket(), .client_name = "operator"});
    ASSERT_THAT(op.status(), IsOk());
    operator_ = *std::move(op);
    // The pools' committed bytes, sampled until the test ends: never past what the device can back. (Bytes
    // released and not yet unmapped by every client stay in the budget but not in a pool; the host backend
    // counts them free at once, a GPU's driver once the last mapping goes.)
    sampler_ = std::thread([this] {
      while (!stop_.load()) {
        if (absl::StatusOr<std::vector<PoolInfo>> pools = operator_->ListPools(); pools.ok()) {
          uint64_t total = 0;
          for (const PoolInfo& p : *pools) total += p.committed_bytes;
          uint64_t seen = max_committed_.load();
          while (total > seen && !max_committed_.compare_exchange_weak(seen, total)) {
          }
        }
        absl::SleepFor(absl::Milliseconds(5));
      }
    });
  }

  void TearDown() override {
    stop_ = true;
    if (sampler_.joinable()) sampler_.join();
    if (kvd_.pid() > 0) {
      EXPECT_LE(max_committed_.load(), kRoom) << "kvd committed more than the device can back";
      const std::string metrics = Scrape(port_);
      EXPECT_EQ(Metric(metrics, "kvd_driver_out_of_memory_total"), 0) << metrics;
      EXPECT_THAT(kvd_.log(), Not(HasSubstr("free of the host capacity"))) << "the device refused a creation";
    }
  }

  // Grows `engine`'s pool by `blocks`, waiting at most `wait_for`, on a thread; the result in `*out`.
  std::thread GrowLater(Engine& engine, uint64_t target, absl::Duration wait_for, absl::StatusOr<PoolChange>* out,
                        std::atomic<bool>* done) {
    return std::thread([&engine, target, wait_for, out, done] {
      *out = engine.client().Grow(engine.name(), target, WaitOptions{.wait = true, .wait_for = wait_for});
      done->store(true);
    });
  }

  // Waits until `pool` has a grow waiting for memory.
  bool Waiting(const std::string& pool) {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      if (absl::StatusOr<PoolInfo> p = operator_->GetPool(pool); p.ok() && !p->waiting.empty()) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }

  ::kvd::testing::KvdProcess kvd_;
  int port_ = 0;
  std::unique_ptr<Client> operator_;
  std::thread sampler_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> max_committed_{0};
};

TEST_F(ArbitrationTest, AWaitingGrowOfHigherPriorityHasAnIdleLowerPoolReclaimedAndItsLiveBytesKept) {
  StartKvd();
  // a fills 384 of the 448 MiB; b asks for 128 and waits: a gives back 64 MiB with a compaction shrink.
  std::unique_ptr<Engine> a =
      Engine::Open(kvd_.socket(), "a", {.priority = 0}, 384 * kBlocksPerMiB, Engine::Answer::kGive);
  std::unique_ptr<Engine> b = Engine::Open(kvd_.socket(), "b", {.priority = 10}, 0, Engine::Answer::kGive);
  ASSERT_TRUE(a && b);
  // Without waiting the device is short, and says so (not the budget: it has 900 MiB).
  EXPECT_THAT(b->client().Grow("b", 128 * kBlocksPerMiB).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("the device can back only")));
  absl::StatusOr<PoolChange> grown =
      b->client().Grow("b", 128 * kBlocksPerMiB, WaitOptions{.wait = true, .wait_for = absl::Seconds(20)});
  ASSERT_THAT(grown.status(), IsOk());
  EXPECT_EQ(grown->pool.committed_blocks, 128 * kBlocksPerMiB);
  EXPECT_EQ(a->reclaims(), 1);
  EXPECT_LE(a->committed_blocks(), 320 * kBlocksPerMiB);
  EXPECT_EQ(a->Check(), "");
  const PoolInfo pa = *operator_->GetPool("a");
  EXPECT_THAT(pa.reclaim.last_outcome, HasSubstr("gave"));
  const std::string metrics = Scrape(port_);
  EXPECT_EQ(Metric(metrics, "kvd_reclaims_total", "outcome=\"gave\""), 1) << metrics;
  EXPECT_GE(Metric(metrics, "kvd_reclaim_given_bytes_total"), 64.0 * kMiB);
}

TEST_F(ArbitrationTest, WaitersAreServedByPriorityAsMemoryComesFree) {
  StartKvd();
  // x (priority 9: nobody may reclaim from it) fills the device; l (1) waits, then h (5) waits.
  // Its live blocks lie below what it keeps after the two shrinks of 1024 blocks below.
  std::unique_ptr<Engine> x = Engine::Open(kvd_.socket(), "x", {.priority = 9}, kRoom / kBlockBytes,
                                           Engine::Answer::kGive, /*live_below=*/kRoom / kBlockBytes - 2048);
  std::unique_ptr<Engine> l = Engine::Open(kvd_.socket(), "l", {.priority = 1}, 0, Engine::Answer::kGive);
  std::unique_ptr<Engine> h = Engine::Open(kvd_.socket(), "h", {.priority = 5}, 0, Engine::Answer::kGive);
  ASSERT_TRUE(x && l && h);
  absl::StatusOr<PoolChange> l_grown, h_grown;
  std::atomic<bool> l_done{false}, h_done{false};
  std::thread lt = GrowLater(*l, 1024, absl::Seconds(25), &l_grown, &l_done);
  ASSERT_TRUE(Waiting("l"));
  std::thread ht = GrowLater(*h, 1024, absl::Seconds(25), &h_grown, &h_done);
  ASSERT_TRUE(Waiting("h"));
  EXPECT_EQ(operator_->GetPool("h")->waiting.at(0).position, 1u);
  EXPECT_EQ(operator_->GetPool("l")->waiting.at(0).position, 2u);
  EXPECT_EQ(operator_->DeviceInfo()->waiting_requests, 2u);
  // x gives 64 MiB back (a whole chunk): the later, higher-priority waiter gets it.
  ASSERT_THAT(x->client().Shrink("x", kRoom / kBlockBytes - 1024, true).status(), IsOk());
  ht.join();
  ASSERT_THAT(h_grown.status(), IsOk());
  EXPECT_FALSE(l_done.load()) << "l waited first but has the lower priority";
  EXPECT_FALSE(operator_->GetPool("l")->waiting.empty());
  ASSERT_THAT(x->client().Shrink("x", kRoom / kBlockBytes - 2048, true).status(), IsOk());
  lt.join();
  EXPECT_THAT(l_grown.status(), IsOk());
  EXPECT_EQ(x->Check(), "");
  EXPECT_EQ(x->reclaims(), 0) << "a pool of higher priority is never asked";
  EXPECT_GT(Metric(Scrape(port_), "kvd_memory_pressure_seconds_total"), 0);
}

TEST_F(ArbitrationTest, EnginesOfSeveralPrioritiesGrowingAtOnceNeverOvercommitAndKeepTheirBytes) {
  StartKvd({"--reclaim-timeout=2s"});
  std::vector<std::unique_ptr<Engine>> engines;
  for (uint32_t p = 0; p < 4; ++p) {
    engines.push_back(Engine::Open(kvd_.socket(), absl::StrCat("e", p), {.priority = p}, 256, Engine::Answer::kGive));
    ASSERT_TRUE(engines.back());
  }
  // Each grows by 16 MiB at a time, waiting up to 2 s, until one of its grows fails.
  std::vector<std::thread> growers;
  std::vector<absl::Status> last(engines.size());
  for (size_t i = 0; i < engines.size(); ++i) {
    growers.emplace_back([&, i] {
      Engine& e = *engines[i];
      for (int step = 0; step < 24; ++step) {
        const uint64_t target = e.committed_blocks() + 256;
        absl::Status s =
            e.client().Grow(e.name(), target, WaitOptions{.wait = true, .wait_for = absl::Seconds(2)}).status();
        if (!s.ok()) {
          last[i] = s;
          return;
        }
      }
    });
  }
  for (std::thread& t : growers) t.join();
  uint64_t total = 0;
  int saturated = 0;
  for (size_t i = 0; i < engines.size(); ++i) {
    // Stopped by a grow that found no memory (RESOURCE_EXHAUSTED saying so), or by its last step.
    if (!last[i].ok()) {
      EXPECT_THAT(last[i], StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_)) << engines[i]->name();
      ++saturated;
    }
    EXPECT_EQ(engines[i]->Check(), "");
    total += engines[i]->committed_blocks() * kBlockBytes;
  }
  EXPECT_GT(saturated, 0) << "together they asked for more than the device has";
  EXPECT_LE(total, kRoom);
  // The highest priority took from the lowest: the lowest holds no more than the highest.
  EXPECT_LE(engines[0]->committed_blocks(), engines[3]->committed_blocks());
  EXPECT_GT(Metric(Scrape(port_), "kvd_reclaims_total", "outcome=\"gave\""), 0);
}

TEST_F(ArbitrationTest, APoolAtItsMinimumIsNeverAsked) {
  StartKvd();
  std::unique_ptr<Engine> a = Engine::Open(kvd_.socket(), "a", {.priority = 0, .min_bytes = 384 * kMiB},
                                           384 * kBlocksPerMiB, Engine::Answer::kGive);
  std::unique_ptr<Engine> b = Engine::Open(kvd_.socket(), "b", {.priority = 10}, 0, Engine::Answer::kGive);
  ASSERT_TRUE(a && b);
  const absl::Status s =
      b->client().Grow("b", 128 * kBlocksPerMiB, WaitOptions{.wait = true, .wait_for = absl::Seconds(2)}).status();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kResourceExhausted,
                          HasSubstr("no pool of lower priority held more than its policy.min_bytes")));
  EXPECT_EQ(a->reclaims(), 0);
  EXPECT_EQ(a->committed_blocks(), 384 * kBlocksPerMiB);
  EXPECT_EQ(a->Check(), "");
}

TEST_F(ArbitrationTest, AnEngineThatDeclinesFailsTheWaiterNamingItUnlessItsPolicyShrinksIt) {
  StartKvd();
  // a's live blocks all lie below block 3072 (192 MiB); it declines every reclaim.
  std::unique_ptr<Engine> a = Engine::Open(kvd_.socket(), "a", {.priority = 0}, 384 * kBlocksPerMiB,
                                           Engine::Answer::kDecline, /*live_below=*/3072);
  std::unique_ptr<Engine> b = Engine::Open(kvd_.socket(), "b", {.priority = 10}, 0, Engine::Answer::kGive);
  ASSERT_TRUE(a && b);
  const absl::Status declined =
      b->client().Grow("b", 128 * kBlocksPerMiB, WaitOptions{.wait = true, .wait_for = absl::Seconds(3)}).status();
  EXPECT_THAT(declined, StatusIs(absl::StatusCode::kResourceExhausted,
                                 HasSubstr("pool a (priority 0) was asked for 64.0 MiB: declined (busy serving)")));
  EXPECT_EQ(a->committed_blocks(), 384 * kBlocksPerMiB) << "policy NONE: nothing done to a";
  // Its operator makes it shrink to what it reports in use.
  ASSERT_THAT(operator_->SetPoolPolicy("a", {.on_reclaim_timeout = ReclaimAction::kShrink}).status(), IsOk());
  ASSERT_THAT(a->client().ReportUsage("a", 615, 0, 3072), IsOk());
  ASSERT_THAT(
      b->client().Grow("b", 128 * kBlocksPerMiB, WaitOptions{.wait = true, .wait_for = absl::Seconds(20)}).status(),
      IsOk());
  EXPECT_EQ(a->committed_blocks(), 3072u);
  EXPECT_EQ(a->Check(), "");
  EXPECT_THAT(operator_->GetPool("a")->reclaim.last_outcome, HasSubstr("shrunk to the 3072 blocks"));
}

TEST_F(ArbitrationTest, AnEngineThatNeverAnswersIsShrunkAtItsDeadlineToWhatItReportedInUse) {
  StartKvd();
  std::unique_ptr<Engine> a = Engine::Open(
      kvd_.socket(), "a",
      {.priority = 0, .reclaim_timeout = absl::Milliseconds(500), .on_reclaim_timeout = ReclaimAction::kShrink},
      384 * kBlocksPerMiB, Engine::Answer::kIgnore, /*live_below=*/2048);
  std::unique_ptr<Engine> b = Engine::Open(kvd_.socket(), "b", {.priority = 10}, 0, Engine::Answer::kGive);
  ASSERT_TRUE(a && b);
  ASSERT_THAT(a->client().ReportUsage("a", 410, 0, 2048), IsOk());
  ASSERT_THAT(
      b->client().Grow("b", 192 * kBlocksPerMiB, WaitOptions{.wait = true, .wait_for = absl::Seconds(20)}).status(),
      IsOk());
  EXPECT_EQ(a->committed_blocks(), 2048u);
  EXPECT_EQ(a->Check(), "") << "kvd paused the engine before it shrank the pool";
  EXPECT_THAT(operator_->GetPool("a")->reclaim.last_outcome, HasSubstr("by its deadline"));
  EXPECT_EQ(Metric(Scrape(port_), "kvd_reclaims_total", "outcome=\"timed_out\""), 1);
}

TEST_F(ArbitrationTest, AnEngineKilledInTheMiddleOfAReclaimLeavesItsPoolToItsPolicy) {
  StartKvd();
  std::unique_ptr<Engine> b = Engine::Open(kvd_.socket(), "b", {.priority = 10}, 0, Engine::Answer::kGive);
  ASSERT_TRUE(b);
  // Pool a, filled and reported by the operator, then attached by an engine in a child process whose reclaim
  // hook never returns; its reclaim timeout is long, so only its death can end the reclaim early.
  ASSERT_THAT(
      operator_
          ->CreatePool({.name = "a",
                        .dims = Dims(),
                        .initial_blocks = 384 * kBlocksPerMiB,
                        .policy = {.reclaim_timeout = absl::Seconds(60), .on_reclaim_timeout = ReclaimAction::kShrink}})
          .status(),
      IsOk());
  ASSERT_THAT(operator_->ReportUsage("a", 100, 0, 1024), IsOk());
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  std::string self = "/proc/self/exe", flag = "--engine", socket = kvd_.socket(), pool = "a";
  char* argv[] = {self.data(), flag.data(), socket.data(), pool.data(), nullptr};
  pid_t child = -1;
  ASSERT_EQ(posix_spawn(&child, argv[0], &actions, nullptr, argv, environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  std::string said;
  char buf[256];
  while (!absl::StrContains(said, "attached\n")) {
    const ssize_t n = read(out[0], buf, sizeof(buf));
    ASSERT_GT(n, 0) << said;
    said.append(buf, static_cast<size_t>(n));
  }
  absl::StatusOr<PoolChange> grown;
  std::atomic<bool> done{false};
  std::thread t = GrowLater(*b, 128 * kBlocksPerMiB, absl::Seconds(25), &grown, &done);
  while (!absl::StrContains(said, "reclaim ")) {
    const ssize_t n = read(out[0], buf, sizeof(buf));
    ASSERT_GT(n, 0) << said;
    said.append(buf, static_cast<size_t>(n));
  }
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  close(out[0]);
  t.join();
  ASSERT_THAT(grown.status(), IsOk());
  EXPECT_EQ(operator_->GetPool("a")->committed_blocks, 1024u);
  EXPECT_THAT(operator_->GetPool("a")->reclaim.last_outcome, HasSubstr("no client attached to answer"));
}

TEST_F(ArbitrationTest, ARestartEndsTheWaitingGrowsAndKeepsThePolicies) {
  StartKvd();
  std::unique_ptr<Engine> a =
      Engine::Open(kvd_.socket(), "a", {.priority = 2, .min_bytes = 64 * kMiB, .reclaim_timeout = absl::Seconds(30)},
                   384 * kBlocksPerMiB, Engine::Answer::kGive);
  std::unique_ptr<Engine> b = Engine::Open(kvd_.socket(), "b", {.priority = 10}, 0, Engine::Answer::kGive);
  ASSERT_TRUE(a && b);
  a->set_answer(Engine::Answer::kStall);  // until the restart: b keeps waiting
  absl::StatusOr<PoolChange> grown;
  std::atomic<bool> done{false};
  std::thread t = GrowLater(*b, 128 * kBlocksPerMiB, absl::Seconds(25), &grown, &done);
  ASSERT_TRUE(Waiting("b"));
  kvd_.Terminate();
  t.join();
  EXPECT_THAT(grown.status(), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  ASSERT_THAT(kvd_.Restart(), IsOk());
  // The engines follow the restarted daemon (a's attached again, so that it hears the reclaim rather than
  // its policy applying for want of a client); the policies came back with the pools.
  absl::StatusOr<PoolInfo> pa;
  const absl::Time deadline = absl::Now() + kWait;
  do {
    absl::SleepFor(absl::Milliseconds(20));
    pa = b->client().GetPool("a");
  } while ((!pa.ok() || pa->state != PoolState::kAwake || pa->client_count == 0) && absl::Now() < deadline);
  ASSERT_THAT(pa.status(), IsOk());
  ASSERT_EQ(pa->client_count, 1u);
  EXPECT_EQ(pa->policy.priority, 2u);
  EXPECT_EQ(pa->policy.min_bytes, 64 * kMiB);
  EXPECT_EQ(pa->policy.reclaim_timeout, absl::Seconds(30));
  a->set_answer(Engine::Answer::kGive);
  EXPECT_THAT(
      b->client().Grow("b", 128 * kBlocksPerMiB, WaitOptions{.wait = true, .wait_for = absl::Seconds(20)}).status(),
      IsOk());
  EXPECT_EQ(a->Check(), "");
}

TEST_F(ArbitrationTest, AClientAttachingWhileAReclaimIsUnderWayIsAskedToo) {
  StartKvd();
  // a's first client has no reclaim hook; a second client, attaching once the reclaim is under way (an
  // engine coming back to its pool), is asked for what is still wanted and gives it back long before the
  // deadline. Its live blocks sit below what it keeps, so nothing moves.
  std::unique_ptr<Engine> a = Engine::Open(kvd_.socket(), "a", {.priority = 2, .reclaim_timeout = absl::Seconds(60)},
                                           384 * kBlocksPerMiB, Engine::Answer::kIgnore, /*live_below=*/2048);
  std::unique_ptr<Engine> b = Engine::Open(kvd_.socket(), "b", {.priority = 10}, 0, Engine::Answer::kGive);
  ASSERT_TRUE(a && b);
  absl::StatusOr<PoolChange> grown;
  std::atomic<bool> done{false};
  std::thread t = GrowLater(*b, 128 * kBlocksPerMiB, absl::Seconds(30), &grown, &done);
  absl::Cleanup join = [&t] { t.join(); };
  uint64_t reclaim_id = 0;
  for (const absl::Time deadline = absl::Now() + kWait; reclaim_id == 0 && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(5));
    if (absl::StatusOr<PoolInfo> p = operator_->GetPool("a"); p.ok()) reclaim_id = p->reclaim.reclaim_id;
  }
  ASSERT_NE(reclaim_id, 0u) << "a was never asked";
  absl::StatusOr<std::unique_ptr<Client>> late = Client::Connect({.socket = kvd_.socket(), .client_name = "late"});
  ASSERT_THAT(late.status(), IsOk());
  Client& client = **late;
  std::atomic<int> asked{0};
  std::atomic<uint64_t> asked_id{0};
  AttachOptions o;
  o.on_pause = [](const std::vector<ByteRange>&) {};
  o.on_resume = [](bool) {};
  o.on_reclaim = [&](const ReclaimRequest& r) {
    ++asked;
    asked_id = r.reclaim_id;
    return client.ShrinkForReclaim(r, a->Live()).status();
  };
  absl::StatusOr<std::unique_ptr<Mapping>> m = client.Attach("a", o);
  ASSERT_THAT(m.status(), IsOk());
  std::move(join).Invoke();
  ASSERT_THAT(grown.status(), IsOk());
  EXPECT_EQ(asked.load(), 1);
  EXPECT_EQ(asked_id.load(), reclaim_id);
  EXPECT_THAT(operator_->GetPool("a")->reclaim.last_outcome, HasSubstr("gave"));
  EXPECT_EQ(a->Check(), "");
  m->reset();
}

// `arbitration_test --engine SOCKET POOL`: attaches POOL, says "attached", and on a RECLAIM says
// "reclaim <id>" and never answers (the test kills it there).
int EngineMain(const std::string& socket, const std::string& pool) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect({.socket = socket, .client_name = "doomed"});
  if (!client.ok()) return 1;
  AttachOptions o;
  o.on_pause = [](const std::vector<ByteRange>&) {};
  o.on_resume = [](bool) {};
  o.on_reclaim = [](const ReclaimRequest& r) {
    std::printf("reclaim %lu\n", r.reclaim_id);
    std::fflush(stdout);
    for (;;) pause();
    return absl::OkStatus();
  };
  absl::StatusOr<std::unique_ptr<Mapping>> m = (*client)->Attach(pool, o);
  if (!m.ok()) return 1;
  std::printf("attached\n");
  std::fflush(stdout);
  for (;;) pause();
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--engine") return kvd::EngineMain(argv[2], argv[3]);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
