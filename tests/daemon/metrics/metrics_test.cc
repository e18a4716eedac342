// Tests daemon/metrics/metrics.cc: Serve's address handling and what a scrape of /metrics contains,
// on a PoolManager over the real host backend. (The real kvd is tested by kvd_metrics_test.py.)
#include "daemon/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/core/memory_state_store.h"
#include "daemon/core/pool_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvd/device.h"
#include "tests/testing/fault_store.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// The body of GET /metrics on 127.0.0.1:`port` (HTTP/1.0: the server closes when done).
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "socket failed";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return response;
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> host =
        OpenDevice({.backend = "host", .host_capacity = 256 * kMiB, .host_granularity = 2 * kMiB});
    ASSERT_TRUE(host.ok()) << host.status();
    device_ = *std::move(host);
    manager_ = std::make_unique<PoolManager>(device_.get(), ManagerOptions{.budget_bytes = 128 * kMiB});
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<PoolManager> manager_;
};

TEST_F(MetricsTest, AddressWithoutPortIsInvalidAndNamesTheFlag) {
  absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Serve("localhost", manager_.get(), {"1", "host"});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("--metrics-address"));
}

TEST_F(MetricsTest, TakenPortIsUnavailableAndNamesTheFlag) {
  absl::StatusOr<std::unique_ptr<Metrics>> first = Metrics::Serve("127.0.0.1:0", manager_.get(), {"1", "host"});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_GT((*first)->port(), 0);
  absl::StatusOr<std::unique_ptr<Metrics>> second =
      Metrics::Serve(absl::StrCat("127.0.0.1:", (*first)->port()), manager_.get(), {"1", "host"});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("--metrics-address"));
}

TEST_F(MetricsTest, ScrapeHasCountersHistogramsAndDeviceGaugesButNoPoolsWhenThereAreNone) {
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device_->Info());
  absl::StatusOr<std::unique_ptr<Metrics>> m =
      Metrics::Serve("127.0.0.1:0", manager_.get(), {"9.9.9", "host", "0", info.uuid});
  ASSERT_TRUE(m.ok()) << m.status();
  (*m)->CountRpc("Grow", absl::StatusCode::kResourceExhausted);
  (*m)->CountRpc("Grow", absl::StatusCode::kResourceExhausted);
  (*m)->ObserveOperation(Operation::kShrink, absl::Milliseconds(3), /*ok=*/false);

  const std::string body = Scrape((*m)->port());
  EXPECT_THAT(body, HasSubstr("200 OK"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_rpc_requests_total{device="0",code="RESOURCE_EXHAUSTED",method="Grow"} 2)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_operations_total{device="0",op="shrink",result="error"} 1)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_operations_total{device="0",op="grow",result="ok"} 0)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_operation_duration_seconds_count{device="0",op="shrink"} 1)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_operation_duration_seconds_bucket{device="0",op="shrink",le="0.005"} 1)"));
  EXPECT_THAT(body, HasSubstr(absl::StrCat(R"(kvd_build_info{version="9.9.9",backend="host",device="0",uuid=")",
                                           info.uuid, R"("} 1)")));
  EXPECT_THAT(body, HasSubstr(absl::StrCat(R"(kvd_device_budget_bytes{device="0",backend="host",uuid=")", info.uuid,
                                           R"("} 134217728)")));
  // A manager without saved state is epoch 1.
  EXPECT_THAT(body,
              HasSubstr(absl::StrCat(R"(kvd_daemon_epoch{device="0",backend="host",uuid=")", info.uuid, R"("} 1)")));
  EXPECT_THAT(body, HasSubstr("kvd_daemon_start_time_seconds{"));
  // The saved state (an in-memory store here) is current, and no write of it failed.
  EXPECT_THAT(body, HasSubstr(R"(kvd_state_degraded{device="0"} 0)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_state_save_failures_total{device="0"} 0)"));
  EXPECT_THAT(body, Not(HasSubstr("kvd_pool_committed_bytes{")));
}

TEST_F(MetricsTest, APoolHeldByAGroupTransactionAndItsGroupAreScraped) {
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device_->Info());
  absl::StatusOr<std::unique_ptr<Metrics>> m =
      Metrics::Serve("127.0.0.1:0", manager_.get(), {"9.9.9", "host", "0", info.uuid});
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string session = *manager_->OpenSession(1000, 4242, "coordinator");
  KVD_ASSERT_OK_AND_ASSIGN(Caller caller, manager_->Authenticate(session));
  PoolSpec spec{
      .name = "llama-r1",
      .dims = {.layers = 2, .capacity_blocks = 64, .heads = 1, .block_tokens = 16, .channels = 64, .element_bytes = 2},
      .group = {.name = "llama", .rank = 1, .size = 2}};
  ASSERT_TRUE(manager_->CreatePool(caller, spec).ok());
  spec.name = "solo";
  spec.group = {};
  ASSERT_TRUE(manager_->CreatePool(caller, spec).ok());
  KVD_ASSERT_OK_AND_ASSIGN(PreparedOp held,
                           manager_->Prepare(caller, "llama-r1", GroupOp::kGrow, 32, absl::Minutes(1)));

  std::string body = Scrape((*m)->port());
  EXPECT_THAT(body, HasSubstr(R"(kvd_pool_held{device="0",pool="llama-r1"} 1)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_pool_held{device="0",pool="solo"} 0)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_pool_group_info{device="0",pool="llama-r1",group="llama",rank="1",size="2"} 1)"));
  EXPECT_THAT(body, Not(HasSubstr(R"(kvd_pool_group_info{device="0",pool="solo")")));

  ASSERT_TRUE(manager_->Abort(caller, held.transaction).ok());
  body = Scrape((*m)->port());
  EXPECT_THAT(body, HasSubstr(R"(kvd_pool_held{device="0",pool="llama-r1"} 0)"));
}

// A pool record that could not be written: kvd_state_degraded is 1 until the pool is saved again; the
// failure stays counted.
TEST_F(MetricsTest, AFailedSaveShowsAsDegradedUntilThePoolIsSavedAgain) {
  MemoryStateStore memory;
  testing::FaultStore faulty(&memory);
  manager_ = std::make_unique<PoolManager>(device_.get(), ManagerOptions{.budget_bytes = 128 * kMiB, .store = &faulty});
  absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Serve("127.0.0.1:0", manager_.get(), {"9.9.9", "host", "0"});
  ASSERT_TRUE(m.ok()) << m.status();
  const Caller root = *manager_->Authenticate(*manager_->OpenSession(0, 1, "root"));
  PoolSpec spec{
      .name = "p",
      .dims =
          {.layers = 2, .capacity_blocks = 64, .heads = 2, .block_tokens = 16, .channels = 1024, .element_bytes = 2},
      .initial_blocks = 32};
  faulty.FailNth(testing::FaultStore::Op::kSave, 1, absl::ResourceExhaustedError("write: No space left on device"));
  ASSERT_TRUE(manager_->CreatePool(root, spec).ok());
  std::string body = Scrape((*m)->port());
  EXPECT_THAT(body, HasSubstr(R"(kvd_state_degraded{device="0"} 1)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_state_save_failures_total{device="0"} 1)"));
  ASSERT_TRUE(manager_->Grow(root, "p", 64).ok());
  body = Scrape((*m)->port());
  EXPECT_THAT(body, HasSubstr(R"(kvd_state_degraded{device="0"} 0)"));
  EXPECT_THAT(body, HasSubstr(R"(kvd_state_save_failures_total{device="0"} 1)"));
  m->reset();
  manager_.reset();
}

}  // namespace
}  // namespace kvd::daemon
