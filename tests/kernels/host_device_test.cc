// Host-only behaviour of the host backend (kernels/host/host_device.h): its options, capacity
// accounting, bookkeeping checks and Linux specifics. What every backend must do is in
// device_conformance_test.cc.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvd/device.h"
#include "kvd/status.h"
#include "tests/testing/status_matchers.h"

namespace kvd {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

uint64_t PageSize() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

std::string BootId() {
  std::ifstream file("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(file, boot_id);
  return std::string(absl::StripAsciiWhitespace(boot_id));
}

absl::StatusOr<std::unique_ptr<Device>> OpenHostWith(uint64_t capacity, uint64_t granularity) {
  return OpenDevice(DeviceOptions{.backend = "host", .host_capacity = capacity, .host_granularity = granularity});
}

int CountOpenFds() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// The process's mappings that overlap [va, va + bytes): the device's own, whatever else the process
// maps meanwhile (a sanitizer's allocator maps as it goes).
int CountMappings(uint64_t va, uint64_t bytes) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) {
    uint64_t start = 0, end = 0;
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64, &start, &end) == 2 && start < va + bytes && end > va) ++n;
  }
  return n;
}

uint64_t MemAvailable() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    absl::string_view rest(line);
    if (!absl::ConsumePrefix(&rest, "MemAvailable:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, " kB");
    uint64_t kib = 0;
    if (absl::SimpleAtoi(rest, &kib)) return kib * kKiB;
  }
  return 0;
}

// True when nothing is mapped at [va, va + bytes): an mmap that must not replace anything succeeds.
bool AddressRangeIsFree(uint64_t va, uint64_t bytes) {
  void* p =
      mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) return false;
  munmap(p, bytes);
  return true;
}

// Every test runs at the default granularity and at a small one, so nothing depends on 2 MiB.
class HostDeviceTest : public ::testing::TestWithParam<uint64_t> {
 protected:
  // A host device with this instance's granularity and `capacity` (0: the machine's memory).
  static absl::StatusOr<std::unique_ptr<Device>> OpenHost(uint64_t capacity = 0) {
    return OpenHostWith(capacity, GetParam());
  }
};

TEST_P(HostDeviceTest, OpenRejectsAGranularityThatIsNotAPowerOfTwoMultipleOfThePage) {
  for (uint64_t granularity : {uint64_t{0}, 3 * kMiB, PageSize() / 2, 3 * PageSize(), 2 * kMiB + PageSize()}) {
    EXPECT_THAT(OpenHostWith(0, granularity),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("host_granularity")))
        << "granularity " << granularity;
  }
}

TEST_P(HostDeviceTest, GranularityIsConfigurableAndAlignsReservations) {
  for (uint64_t granularity : {PageSize(), 64 * kKiB, 2 * kMiB, kGiB}) {
    SCOPED_TRACE(absl::StrCat("granularity ", granularity));
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHostWith(0, granularity));
    EXPECT_EQ(device->granularity(), granularity);
    KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
    EXPECT_EQ(info.granularity, granularity);
    std::vector<uint64_t> vas;
    for (int i = 0; i < 4; ++i) {
      KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device->Reserve(granularity * (i + 1)));
      EXPECT_EQ(va % granularity, 0u);
      vas.push_back(va);
    }
    for (int i = 0; i < 4; ++i) EXPECT_THAT(device->Free(vas[i], granularity * (i + 1)), IsOk());
  }
}

TEST_P(HostDeviceTest, SizesAndAddressesMustBeMultiplesOfTheGranularity) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
  const uint64_t g = device->granularity();
  const auto invalid = StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("granularity"));
  EXPECT_THAT(device->Reserve(0), invalid);
  EXPECT_THAT(device->Reserve(g + PageSize()), invalid);
  EXPECT_THAT(device->Create(g / 2), invalid);
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device->Reserve(4 * g));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk chunk, device->Create(g));
  EXPECT_THAT(device->Map(va + PageSize(), chunk, Access::kReadWrite), invalid);
  EXPECT_THAT(device->Unmap(va, g + PageSize()), invalid);
  KVD_ASSERT_OK_AND_ASSIGN(int fd, device->Export(chunk));
  EXPECT_THAT(device->Import(fd, g - PageSize()), invalid);
  close(fd);
  EXPECT_THAT(device->Release(chunk), IsOk());
  EXPECT_THAT(device->Free(va, 4 * g), IsOk());
}

TEST_P(HostDeviceTest, InfoDescribesTheHostMemory) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost(64 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
  EXPECT_EQ(info.backend, BackendKind::kHost);
  EXPECT_EQ(device->kind(), BackendKind::kHost);
  EXPECT_EQ(info.name, "host memory (memfd)");
  EXPECT_EQ(info.index, 0);
  EXPECT_EQ(info.uuid, absl::StrCat("host-", BootId(), "-0"));
  EXPECT_TRUE(info.driver_version.empty());
  EXPECT_EQ(info.total_bytes, 64 * kMiB) << "the configured capacity";
  EXPECT_EQ(info.free_bytes, 64 * kMiB) << "nothing committed, and the machine has more than 64 MiB available";
  EXPECT_EQ(info.granularity, GetParam());
  EXPECT_FALSE(info.fabric_handles);

  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> other, OpenDevice(DeviceOptions{.backend = "host"}));
  EXPECT_EQ(other->granularity(), 2 * kMiB) << "the default granularity, like the GPUs'";
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo other_info, other->Info());
  EXPECT_EQ(other_info.uuid, info.uuid) << "stable for the whole boot";
  EXPECT_EQ(other_info.total_bytes, static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * PageSize())
      << "capacity 0 is the machine's physical memory";
  EXPECT_LE(other_info.free_bytes, MemAvailable() + 256 * kMiB) << "free never exceeds what the kernel has";
}

TEST_P(HostDeviceTest, CapacityCountsCreatedChunksUntilTheyAreReleased) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost(8 * kMiB));
  auto free_bytes = [&]() -> uint64_t {
    absl::StatusOr<DeviceInfo> info = device->Info();
    return info.ok() ? info->free_bytes : ~uint64_t{0};
  };
  KVD_ASSERT_OK_AND_ASSIGN(Chunk a, device->Create(4 * kMiB));
  EXPECT_EQ(free_bytes(), 4 * kMiB);
  KVD_ASSERT_OK_AND_ASSIGN(Chunk b, device->Create(4 * kMiB));
  EXPECT_EQ(free_bytes(), 0u);
  EXPECT_THAT(device->Create(2 * kMiB),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr(absl::StrCat(2 * kMiB, " bytes asked, 0 bytes free of the host capacity of ", 8 * kMiB,
                                              " bytes"))));
  EXPECT_EQ(free_bytes(), 0u) << "a refused Create takes nothing";
  ASSERT_THAT(device->Release(a), IsOk());
  EXPECT_EQ(free_bytes(), 4 * kMiB);
  KVD_ASSERT_OK_AND_ASSIGN(Chunk c, device->Create(2 * kMiB));
  EXPECT_EQ(free_bytes(), 2 * kMiB);
  EXPECT_THAT(device->Release(b), IsOk());
  EXPECT_THAT(device->Release(c), IsOk());
  EXPECT_EQ(free_bytes(), 8 * kMiB);
}

TEST_P(HostDeviceTest, ImportsDoNotCountAgainstTheCapacity) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost(4 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk created, device->Create(4 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(int fd, device->Export(created));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk imported, device->Import(fd, 4 * kMiB));
  close(fd);
  EXPECT_NE(imported.handle, created.handle);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
  EXPECT_EQ(info.free_bytes, 0u) << "the same memory is counted once, by its Create";
  ASSERT_THAT(device->Release(imported), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(info, device->Info());
  EXPECT_EQ(info.free_bytes, 0u) << "releasing an import gives back nothing it did not take";
  ASSERT_THAT(device->Release(created), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(info, device->Info());
  EXPECT_EQ(info.free_bytes, 4 * kMiB);
}

TEST_P(HostDeviceTest, ImportsOfMemoryAnotherDeviceCreatedCountLikeItsOwn) {
  // As a restarted daemon's pools (their memfds made by its predecessor) and chunks clients give back.
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> maker, OpenHost(8 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost(8 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk created, maker->Create(4 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(int fd, maker->Export(created));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk imported, device->Import(fd, 4 * kMiB));
  close(fd);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
  EXPECT_EQ(info.free_bytes, 4 * kMiB) << "the memory this device's process holds now";
  ASSERT_THAT(device->Release(imported), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(info, device->Info());
  EXPECT_EQ(info.free_bytes, 8 * kMiB);
  ASSERT_THAT(maker->Release(created), IsOk());
}

TEST_P(HostDeviceTest, BytesUsedByOthersAreNeverFree) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenDevice(DeviceOptions{.backend = "host",
                                                                                    .host_capacity = 8 * kMiB,
                                                                                    .host_granularity = GetParam(),
                                                                                    .host_used_by_others = 4 * kMiB}));
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
  EXPECT_EQ(info.total_bytes, 8 * kMiB);
  EXPECT_EQ(info.free_bytes, 4 * kMiB);
  EXPECT_THAT(device->Create(8 * kMiB),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("(4194304 used by others)")));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk c, device->Create(4 * kMiB));
  EXPECT_THAT(device->Release(c), IsOk());
  EXPECT_THAT(
      OpenDevice(DeviceOptions{.backend = "host", .host_capacity = 8 * kMiB, .host_used_by_others = 8 * kMiB}).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("host_used_by_others")));
}

TEST_P(HostDeviceTest, CreateRefusesMoreThanTheMachineHasAvailable) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost(uint64_t{1} << 50));  // 1 PiB
  const uint64_t g = device->granularity();
  const uint64_t asked = (2 * MemAvailable() + g) / g * g;
  const int fds = CountOpenFds();
  EXPECT_THAT(device->Create(asked),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr(absl::StrCat(asked, " bytes asked"))));
  EXPECT_EQ(CountOpenFds(), fds);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
  EXPECT_LT(info.free_bytes, asked) << "free is bounded by MemAvailable, not only by the capacity";
}

TEST_P(HostDeviceTest, CreateThatFailsLateGivesItsCapacityBack) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost(8 * kMiB));
  // No FD left for memfd_create: Create fails after it has claimed its bytes of the capacity.
  rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  const int lowest_free = dup(STDIN_FILENO);  // the FD number the next open would get
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  rlimit tight = saved;
  tight.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &tight), 0);
  absl::StatusOr<Chunk> chunk = device->Create(4 * kMiB);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_THAT(chunk, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("memfd_create")));
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
  EXPECT_EQ(info.free_bytes, 8 * kMiB);
  KVD_ASSERT_OK_AND_ASSIGN(Chunk whole, device->Create(8 * kMiB));
  EXPECT_THAT(device->Release(whole), IsOk());
}

TEST_P(HostDeviceTest, ChunksAreMemfdsWhosePagesAreAllocatedAtCreate) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
  KVD_ASSERT_OK_AND_ASSIGN(Chunk chunk, device->Create(8 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(int fd, device->Export(chunk));
  EXPECT_NE(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0) << "exported FDs do not leak into exec'd children";
  struct stat st;
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 8 * kMiB);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 8 * kMiB) << "every page allocated before first touch";
  std::error_code error;
  const std::string target = std::filesystem::read_symlink(absl::StrCat("/proc/self/fd/", fd), error).string();
  EXPECT_THAT(target, StartsWith("/memfd:kvd-chunk"));
  close(fd);
  EXPECT_THAT(device->Release(chunk), IsOk());
}

TEST_P(HostDeviceTest, FailedCallsLeakNoFileDescriptors) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost(4 * kMiB));
  const int before = CountOpenFds();
  for (int i = 0; i < 10; ++i) {
    EXPECT_THAT(device->Create(8 * kMiB), StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  }
  EXPECT_THAT(device->Import(-1, 2 * kMiB), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  const int not_memfd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(not_memfd, 0);
  EXPECT_THAT(device->Import(not_memfd, 2 * kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a memfd")));
  close(not_memfd);
  KVD_ASSERT_OK_AND_ASSIGN(Chunk chunk, device->Create(2 * kMiB));
  KVD_ASSERT_OK_AND_ASSIGN(int fd, device->Export(chunk));
  EXPECT_THAT(device->Import(fd, 4 * kMiB), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fewer than")));
  close(fd);
  ASSERT_THAT(device->Release(chunk), IsOk());
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_P(HostDeviceTest, UnmapKeepsTheReservationAndFreeGivesItBack) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
  const uint64_t g = device->granularity();
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device->Reserve(2 * g));
  EXPECT_FALSE(AddressRangeIsFree(va, 2 * g)) << "reserved";
  KVD_ASSERT_OK_AND_ASSIGN(Chunk chunk, device->Create(g));
  for (int round = 0; round < 3; ++round) {
    ASSERT_THAT(device->Map(va + g, chunk, Access::kReadWrite), IsOk());
    const uint8_t value = 0x40 + round;
    ASSERT_THAT(device->CopyFromHost(va + g, &value, 1), IsOk());
    ASSERT_THAT(device->Unmap(va + g, g), IsOk());
    EXPECT_FALSE(AddressRangeIsFree(va + g, g)) << "still reserved after Unmap (round " << round << ")";
    uint8_t sink = 0;
    EXPECT_THAT(device->CopyToHost(&sink, va + g, 1),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not mapped")));
  }
  ASSERT_THAT(device->Map(va, chunk, Access::kReadWrite), IsOk());
  uint8_t back = 0;
  ASSERT_THAT(device->CopyToHost(&back, va, 1), IsOk());
  EXPECT_EQ(back, 0x42) << "the chunk kept its bytes across unmaps";
  ASSERT_THAT(device->Unmap(va, g), IsOk());
  ASSERT_THAT(device->Release(chunk), IsOk());
  ASSERT_THAT(device->Free(va, 2 * g), IsOk());
  EXPECT_TRUE(AddressRangeIsFree(va, 2 * g)) << "Free returned the address space";
}

TEST_P(HostDeviceTest, EachChunkIsOneMapping) {
  // vm.max_map_count is 65530 by default: a mapping per page would exhaust it.
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
  const uint64_t g = device->granularity();
  constexpr int kChunks = 16;
  const uint64_t bytes = 2 * kChunks * g;
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device->Reserve(bytes));
  EXPECT_EQ(CountMappings(va, bytes), 1) << "the reservation is one mapping";
  std::vector<Chunk> chunks;
  for (int i = 0; i < kChunks; ++i) {
    KVD_ASSERT_OK_AND_ASSIGN(Chunk chunk, device->Create(2 * g));
    ASSERT_THAT(device->Map(va + 2 * i * g, chunk, Access::kReadWrite), IsOk());
    chunks.push_back(chunk);
  }
  EXPECT_EQ(CountMappings(va, bytes), kChunks);
  ASSERT_THAT(device->Unmap(va, bytes), IsOk());
  EXPECT_EQ(CountMappings(va, bytes), 1) << "unmapped ranges merge back into one reservation";
  for (const Chunk& chunk : chunks) EXPECT_THAT(device->Release(chunk), IsOk());
  EXPECT_THAT(device->Free(va, bytes), IsOk());
}

TEST_P(HostDeviceTest, MappingsCannotOverlapOrBeCutAndBlockFree) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
  const uint64_t g = device->granularity();
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device->Reserve(4 * g));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk a, device->Create(2 * g));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk b, device->Create(2 * g));
  ASSERT_THAT(device->Map(va + g, a, Access::kReadWrite), IsOk());
  EXPECT_THAT(device->Map(va, b, Access::kReadWrite),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("overlaps")));
  EXPECT_THAT(device->Map(va + 2 * g, b, Access::kReadWrite),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("overlaps")));
  EXPECT_THAT(device->Unmap(va + g, g), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuts")));
  EXPECT_THAT(device->Unmap(va, 2 * g), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuts")));
  EXPECT_THAT(device->Free(va, 4 * g), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unmap them first")));
  EXPECT_THAT(device->Free(va, 2 * g), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a reservation")));
  EXPECT_THAT(device->Unmap(va, 4 * g), IsOk()) << "a range covering whole mappings and unmapped space";
  EXPECT_THAT(device->Release(a), IsOk());
  EXPECT_THAT(device->Release(b), IsOk());
  EXPECT_THAT(device->Free(va, 4 * g), IsOk());
}

TEST_P(HostDeviceTest, ReadOnlyMappingsRefuseWrites) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
  const uint64_t g = device->granularity();
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device->Reserve(g));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk chunk, device->Create(g));
  ASSERT_THAT(device->Map(va, chunk, Access::kRead), IsOk());
  std::vector<uint8_t> buffer(g, 1);
  EXPECT_THAT(device->CopyToHost(buffer.data(), va, g), IsOk());
  EXPECT_EQ(buffer, std::vector<uint8_t>(g, 0));
  EXPECT_THAT(device->CopyFromHost(va, buffer.data(), g),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("read-only")));
  const BlockSpan span{.base = va, .segments = 1, .segment_stride = g, .block_bytes = 4096, .blocks = 4};
  EXPECT_THAT(device->ZeroBlocks(span, std::vector<uint64_t>{0}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("read-only")));
  EXPECT_THAT(device->Unmap(va, g), IsOk());
  EXPECT_THAT(device->Release(chunk), IsOk());
  EXPECT_THAT(device->Free(va, g), IsOk());
}

TEST_P(HostDeviceTest, CopiesAndBlockOperationsOnlyTouchMappedMemory) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
  const uint64_t g = device->granularity();
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device->Reserve(2 * g));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk chunk, device->Create(g));
  ASSERT_THAT(device->Map(va, chunk, Access::kReadWrite), IsOk());
  std::vector<uint8_t> buffer(2 * g);
  EXPECT_THAT(device->CopyToHost(buffer.data(), va, 2 * g),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not mapped")))
      << "runs off the mapping into reserved space";
  EXPECT_THAT(device->CopyFromHost(reinterpret_cast<uintptr_t>(buffer.data()), buffer.data(), 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not inside a reservation")))
      << "memory this device does not own";
  // Two segments, the second of them unmapped.
  const BlockSpan span{.base = va, .segments = 2, .segment_stride = g, .block_bytes = 4096, .blocks = 4};
  EXPECT_THAT(device->ZeroBlocks(span, std::vector<uint64_t>{0}),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(device->CopyBlocks(span, std::vector<BlockCopy>{{.src = 0, .dst = 1}}),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  const BlockSpan one{.base = va, .segments = 1, .segment_stride = g, .block_bytes = 4096, .blocks = 4};
  EXPECT_THAT(device->PackBlocks(one, std::vector<uint64_t>{0, 1}, va + g),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(device->UnpackBlocks(one, va + g - 4096, std::vector<uint64_t>{0, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  const BlockSpan overlapping{.base = va, .segments = 2, .segment_stride = 4096, .block_bytes = 4096, .blocks = 4};
  EXPECT_THAT(device->ZeroBlocks(overlapping, std::vector<uint64_t>{0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("segment_stride")));
  EXPECT_THAT(device->Unmap(va, g), IsOk());
  EXPECT_THAT(device->Release(chunk), IsOk());
  EXPECT_THAT(device->Free(va, 2 * g), IsOk());
}

TEST_P(HostDeviceTest, OnlyLiveChunksOfThisDeviceAreAccepted) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> other, OpenHost());
  const uint64_t g = device->granularity();
  KVD_ASSERT_OK_AND_ASSIGN(Chunk theirs, other->Create(g));
  EXPECT_THAT(device->Release(theirs), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")));
  EXPECT_THAT(device->Export(theirs), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")));
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device->Reserve(g));
  EXPECT_THAT(device->Map(va, theirs, Access::kReadWrite),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")));
  EXPECT_THAT(device->Free(va + g, g), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_))
      << "not a reservation of this device";

  KVD_ASSERT_OK_AND_ASSIGN(Chunk mine, device->Create(g));
  ASSERT_THAT(device->Release(mine), IsOk());
  EXPECT_THAT(device->Release(mine), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not live")))
      << "a second Release must not close someone else's FD";
  EXPECT_THAT(device->Export(mine), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(other->Release(theirs), IsOk());
  EXPECT_THAT(device->Free(va, g), IsOk());
}

TEST_P(HostDeviceTest, DestroyingTheDeviceClosesChunksNeverReleased) {
  const int before = CountOpenFds();
  {
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost());
    for (int i = 0; i < 4; ++i) {
      KVD_ASSERT_OK_AND_ASSIGN([[maybe_unused]] Chunk chunk, device->Create(device->granularity()));
    }
    EXPECT_EQ(CountOpenFds(), before + 4);
  }
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_P(HostDeviceTest, ConcurrentUseFromManyThreadsIsSafe) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenHost(64 * kMiB));
  const uint64_t g = device->granularity();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        const uint64_t bytes = (1 + (i + t) % 4) * g;
        absl::StatusOr<uint64_t> va = device->Reserve(bytes);
        absl::StatusOr<Chunk> chunk = device->Create(bytes);
        if (!va.ok() || !chunk.ok()) {
          ++failures;
          continue;
        }
        // The bookkeeping is under test, not the bandwidth: touch the chunk's last 8 KiB only.
        const uint64_t tail = *va + bytes - 8 * kKiB;
        const std::vector<uint8_t> data(8 * kKiB, static_cast<uint8_t>(t * 50 + i));
        std::vector<uint8_t> back(data.size());
        if (!device->Map(*va, *chunk, Access::kReadWrite).ok() ||
            !device->CopyFromHost(tail, data.data(), data.size()).ok() ||
            !device->CopyToHost(back.data(), tail, back.size()).ok() || back != data) {
          ++failures;
        }
        absl::StatusOr<int> fd = device->Export(*chunk);
        absl::StatusOr<Chunk> imported = fd.ok() ? device->Import(*fd, bytes) : fd.status();
        if (fd.ok()) close(*fd);
        if (!imported.ok() || !device->Release(*imported).ok() || !device->Unmap(*va, bytes).ok() ||
            !device->Release(*chunk).ok() || !device->Free(*va, bytes).ok()) {
          ++failures;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
  EXPECT_EQ(info.free_bytes, 64 * kMiB) << "every byte given back";
}

// ---------------------------------------------------------------------------------------------
// Device indices and selectors: the host backend stands in for a node's GPUs.

TEST(HostDeviceIndexTest, EachIndexIsADistinctDeviceWithItsOwnUuid) {
  ASSERT_FALSE(BootId().empty());
  std::set<std::string> uuids;
  for (int index : {0, 1, 7, 1000}) {
    KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenDevice({.backend = "host", .index = index}));
    KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device->Info());
    EXPECT_EQ(info.index, index);
    EXPECT_EQ(info.uuid, absl::StrCat("host-", BootId(), "-", index));
    uuids.insert(info.uuid);
  }
  EXPECT_EQ(uuids.size(), 4u);
  EXPECT_THAT(OpenDevice({.backend = "host", .index = -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("index")));
}

TEST(HostDeviceIndexTest, ListDevicesReportsIndexZeroWithItsMemory) {
  KVD_ASSERT_OK_AND_ASSIGN(std::vector<DeviceInfo> devices,
                           ListDevices({.backend = "host", .index = 5, .host_capacity = 64 * kMiB}));
  ASSERT_EQ(devices.size(), 1u);
  EXPECT_EQ(devices[0].backend, BackendKind::kHost);
  EXPECT_EQ(devices[0].index, 0) << "whatever options.index says";
  EXPECT_EQ(devices[0].uuid, absl::StrCat("host-", BootId(), "-0"));
  EXPECT_EQ(devices[0].name, "host memory (memfd)");
  EXPECT_EQ(devices[0].total_bytes, 64 * kMiB);
  EXPECT_EQ(devices[0].granularity, 2 * kMiB);
  EXPECT_THAT(ListDevices({.backend = "tpu"}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tpu")));
}

// The index `selector` resolves to on host, or the error as a string.
std::string Resolved(absl::string_view selector) {
  absl::StatusOr<int> index = ResolveDeviceSelector({.backend = "host"}, selector);
  return index.ok() ? absl::StrCat(*index) : index.status().ToString();
}

TEST(HostDeviceIndexTest, SelectorsNameIndicesAndUuids) {
  const std::string uuid1 = absl::StrCat("host-", BootId(), "-1");
  EXPECT_EQ(Resolved("0"), "0");
  EXPECT_EQ(Resolved("6"), "6") << "any index opens on host";
  EXPECT_EQ(Resolved(uuid1), "1");
  EXPECT_EQ(Resolved(absl::StrCat("host-", BootId(), "-12")), "12") << "host-<boot id>-1 is exact, not a prefix";
  EXPECT_EQ(Resolved(absl::AsciiStrToUpper(uuid1)), "1") << "case-insensitive";
  EXPECT_EQ(Resolved(absl::StrCat(BootId(), "-3")), "3") << "without host-";
}

TEST(HostDeviceIndexTest, BadSelectorsAreRefusedWithTheCandidates) {
  const DeviceOptions host{.backend = "host"};
  const std::string family = absl::StrCat("host-", BootId(), "-");
  EXPECT_THAT(ResolveDeviceSelector(host, ""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(ResolveDeviceSelector(host, "99999999999999999999"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device 99999999999999999999: not a device")));
  // Short of the index, a prefix is every host device's.
  for (const std::string& prefix :
       {std::string("host-"), absl::StrCat("host-", BootId().substr(0, 8)), family, BootId().substr(0, 8)}) {
    EXPECT_THAT(ResolveDeviceSelector(host, prefix),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(absl::StrCat("device ", prefix, ": ambiguous")), HasSubstr(family + "1"))))
        << prefix;
  }
  for (const std::string& unknown :
       {std::string("GPU-5f3a"), std::string("host-00000000-0000-0000-0000-000000000000-1"), absl::StrCat(family, "1x"),
        std::string("-1")}) {
    EXPECT_THAT(ResolveDeviceSelector(host, unknown),
                StatusIs(absl::StatusCode::kNotFound,
                         AllOf(HasSubstr(absl::StrCat("device ", unknown, ": no host device")), HasSubstr(family))))
        << unknown;
  }
}

TEST(HostDeviceIndexTest, PeerAccessCoversEveryHostDeviceOfThisBootOnly) {
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenDevice({.backend = "host", .index = 1}));
  const std::string family = absl::StrCat("host-", BootId(), "-");
  EXPECT_THAT(device->CheckPeerAccess(family + "0"), IsOk());
  EXPECT_THAT(device->CheckPeerAccess(family + "1"), IsOk()) << "itself";
  EXPECT_THAT(device->CheckPeerAccess(absl::AsciiStrToUpper(family + "42")), IsOk());
  EXPECT_THAT(device->CheckPeerAccess("host-00000000-0000-0000-0000-000000000000-0"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(family + "1"), HasSubstr("host-00000000-0000-0000-0000-000000000000-0"),
                             HasSubstr("another machine or boot"))));
  EXPECT_THAT(device->CheckPeerAccess("GPU-5f3a1b2c-0000-0000-0000-000000000000"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(family + "1"), HasSubstr("GPU-5f3a1b2c"), HasSubstr("another backend"))));
  EXPECT_THAT(device->CheckPeerAccess(family), Not(IsOk())) << "no index";
  EXPECT_THAT(device->CheckPeerAccess(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("owner_uuid")));
}

std::string GranularityName(const ::testing::TestParamInfo<uint64_t>& info) {
  return info.param % kMiB == 0 ? absl::StrCat("granularity_", info.param / kMiB, "MiB")
                                : absl::StrCat("granularity_", info.param / kKiB, "KiB");
}

INSTANTIATE_TEST_SUITE_P(host_device, HostDeviceTest, ::testing::Values(2 * kMiB, 64 * kKiB), GranularityName);

}  // namespace
}  // namespace kvd
