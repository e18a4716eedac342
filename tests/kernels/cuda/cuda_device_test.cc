// The CUDA backend's smoke test: open and Info, the memory lifecycle, export/import, the block
// kernels against a CPU reference (odd geometries included) and out-of-memory. Every test skips where
// OpenDevice("cuda") is UNAVAILABLE (no driver or no GPU). The cross-backend behaviour is covered by
// device_conformance_test.cc.
#include "cuda/cuda_device.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <ostream>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
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
using ::testing::StartsWith;

// A reservation with one chunk mapped over all of it, given back on destruction.
class MappedChunk {
 public:
  static absl::StatusOr<std::unique_ptr<MappedChunk>> Make(Device* device, uint64_t bytes) {
    KVD_ASSIGN_OR_RETURN(uint64_t va, device->Reserve(bytes));
    auto mapped = std::unique_ptr<MappedChunk>(new MappedChunk(device, va, bytes));
    KVD_ASSIGN_OR_RETURN(mapped->chunk_, device->Create(bytes));
    mapped->created_ = true;
    KVD_RETURN_IF_ERROR(device->Map(va, mapped->chunk_, Access::kReadWrite));
    mapped->mapped_ = true;
    return mapped;
  }
  ~MappedChunk() {
    if (mapped_) {
      EXPECT_THAT(device_->Unmap(va_, bytes_), IsOk());
    }
    if (created_) {
      EXPECT_THAT(device_->Release(chunk_), IsOk());
    }
    EXPECT_THAT(device_->Free(va_, bytes_), IsOk());
  }
  uint64_t va() const { return va_; }
  uint64_t bytes() const { return bytes_; }
  const Chunk& chunk() const { return chunk_; }

 private:
  MappedChunk(Device* device, uint64_t va, uint64_t bytes) : device_(device), va_(va), bytes_(bytes) {}
  Device* device_;
  uint64_t va_;
  uint64_t bytes_;
  Chunk chunk_;
  bool created_ = false;
  bool mapped_ = false;
};

std::vector<uint8_t> RandomBytes(uint64_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t word = rng();
    std::memcpy(out.data() + i, &word, std::min<uint64_t>(8, n - i));
  }
  return out;
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DeviceOptions options;
    options.backend = "cuda";
    absl::StatusOr<std::unique_ptr<Device>> device = OpenDevice(options);
    if (absl::IsUnavailable(device.status())) GTEST_SKIP() << "no CUDA: " << device.status();
    ASSERT_THAT(device, IsOk());
    device_ = *std::move(device);
    cuda_ = dynamic_cast<CudaDevice*>(device_.get());
    ASSERT_NE(cuda_, nullptr);
    granularity_ = device_->granularity();
  }

  std::unique_ptr<Device> device_;
  CudaDevice* cuda_ = nullptr;
  uint64_t granularity_ = 0;
};

TEST_F(CudaDeviceTest, OpensAndReportsInfo) {
  EXPECT_EQ(device_->kind(), BackendKind::kCuda);
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device_->Info());
  std::cout << "device: " << info.name << " " << info.uuid << " driver " << info.driver_version << ", "
            << info.free_bytes << " of " << info.total_bytes << " bytes free, granularity " << info.granularity
            << ", fabric " << (info.fabric_handles ? "yes" : "no") << "\n";
  EXPECT_EQ(info.backend, BackendKind::kCuda);
  EXPECT_FALSE(info.name.empty());
  EXPECT_THAT(info.uuid, StartsWith("GPU-"));
  EXPECT_EQ(info.uuid.size(), 40u);  // GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
  EXPECT_FALSE(info.driver_version.empty());
  EXPECT_GT(info.total_bytes, 0u);
  EXPECT_LE(info.free_bytes, info.total_bytes);
  EXPECT_EQ(info.granularity, granularity_);
  EXPECT_GT(granularity_, 0u);
  EXPECT_EQ(granularity_ & (granularity_ - 1), 0u);
  EXPECT_EQ(info.fabric_handles, cuda_->fabric_handles());
}

TEST_F(CudaDeviceTest, AutoPicksCudaWhenPresent) {
  DeviceOptions options;
  options.backend = "auto";
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, OpenDevice(options));
  EXPECT_EQ(device->kind(), BackendKind::kCuda);
}

TEST_F(CudaDeviceTest, ListsDevicesAndSelectsThemByUuid) {
  KVD_ASSERT_OK_AND_ASSIGN(const DeviceInfo self, device_->Info());
  for (const char* backend : {"cuda", "auto"}) {
    SCOPED_TRACE(backend);
    KVD_ASSERT_OK_AND_ASSIGN(const std::vector<DeviceInfo> devices, ListDevices({.backend = backend}));
    ASSERT_FALSE(devices.empty());
    std::cout << "--backend=" << backend << ":";
    for (const DeviceInfo& d : devices) std::cout << " [" << d.index << " " << d.uuid << " " << d.name << "]";
    std::cout << "\n";
    for (size_t i = 0; i < devices.size(); ++i) {
      const DeviceInfo& d = devices[i];
      EXPECT_EQ(d.backend, BackendKind::kCuda);
      EXPECT_EQ(d.index, static_cast<int>(i));
      EXPECT_THAT(d.uuid, StartsWith("GPU-"));
      EXPECT_EQ(d.uuid.size(), 40u);
      EXPECT_EQ(d.driver_version, self.driver_version);
      EXPECT_GT(d.total_bytes, 0u);
      // Every visible device is selected by its UUID, by a prefix without "GPU-", and by its index.
      for (const std::string& selector : {d.uuid, d.uuid.substr(4, 13), absl::StrCat(i)}) {
        absl::StatusOr<int> index = ResolveDeviceSelector({.backend = backend}, selector);
        ASSERT_THAT(index, IsOk()) << selector;
        EXPECT_EQ(*index, d.index) << selector;
      }
    }
    EXPECT_EQ(devices[0].uuid, self.uuid);
    EXPECT_EQ(devices[0].name, self.name);
    EXPECT_EQ(devices[0].total_bytes, self.total_bytes) << "cuDeviceTotalMem and cuMemGetInfo agree";
    const std::string past = absl::StrCat(devices.size());
    EXPECT_THAT(ResolveDeviceSelector({.backend = backend}, past),
                StatusIs(absl::StatusCode::kNotFound,
                         AllOf(HasSubstr(absl::StrCat("device ", past, ": this node has ", devices.size(), " CUDA")),
                               HasSubstr(self.uuid))));
    EXPECT_THAT(ResolveDeviceSelector({.backend = backend}, "GPU-zzzz"),
                StatusIs(absl::StatusCode::kNotFound, AllOf(HasSubstr("device GPU-zzzz"), HasSubstr(self.uuid))));
    if (devices.size() > 1) {
      EXPECT_THAT(ResolveDeviceSelector({.backend = backend}, "GPU-"),
                  StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("ambiguous"), HasSubstr(self.uuid))))
          << "\"GPU-\" starts every UUID";
    }
  }
}

TEST_F(CudaDeviceTest, PeerAccessToItselfIsOkAndToAnUnseenUuidIsNotFound) {
  KVD_ASSERT_OK_AND_ASSIGN(const DeviceInfo self, device_->Info());
  EXPECT_THAT(device_->CheckPeerAccess(self.uuid), IsOk());
  EXPECT_THAT(device_->CheckPeerAccess(absl::AsciiStrToUpper(self.uuid)), IsOk()) << "case-insensitive";
  const std::string bogus = "GPU-00000000-0000-0000-0000-000000000000";
  EXPECT_THAT(device_->CheckPeerAccess(bogus),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr(bogus), HasSubstr(self.uuid), HasSubstr("CUDA_VISIBLE_DEVICES"))));
  EXPECT_THAT(device_->CheckPeerAccess("host-abc-0"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another backend")));
  // Every other visible device: OK or FAILED_PRECONDITION as cuDeviceCanAccessPeer says; never NOT_FOUND.
  KVD_ASSERT_OK_AND_ASSIGN(const std::vector<DeviceInfo> devices, ListDevices({.backend = "cuda"}));
  for (const DeviceInfo& d : devices) {
    const absl::Status s = device_->CheckPeerAccess(d.uuid);
    std::cout << "peer access from " << self.uuid << " to " << d.uuid << ": " << s << "\n";
    EXPECT_TRUE(s.ok() || absl::IsFailedPrecondition(s)) << s;
  }
}

TEST_F(CudaDeviceTest, WritesAndReadsBack) {
  KVD_ASSERT_OK_AND_ASSIGN(auto mapped, MappedChunk::Make(device_.get(), 2 * granularity_));
  const std::vector<uint8_t> pattern = RandomBytes(mapped->bytes(), 1);
  ASSERT_THAT(device_->CopyFromHost(mapped->va(), pattern.data(), pattern.size()), IsOk());
  std::vector<uint8_t> back(pattern.size());
  ASSERT_THAT(device_->CopyToHost(back.data(), mapped->va(), back.size()), IsOk());
  EXPECT_TRUE(back == pattern);
}

TEST_F(CudaDeviceTest, ImportedChunkSeesTheSameBytesAtASecondAddress) {
  KVD_ASSERT_OK_AND_ASSIGN(auto mapped, MappedChunk::Make(device_.get(), 2 * granularity_));
  const uint64_t bytes = mapped->bytes();
  const std::vector<uint8_t> pattern = RandomBytes(bytes, 2);
  ASSERT_THAT(device_->CopyFromHost(mapped->va(), pattern.data(), bytes), IsOk());

  KVD_ASSERT_OK_AND_ASSIGN(int fd, device_->Export(mapped->chunk()));
  absl::StatusOr<Chunk> imported = device_->Import(fd, bytes);
  close(fd);  // the imported handle keeps the memory
  ASSERT_THAT(imported, IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va2, device_->Reserve(bytes));
  ASSERT_NE(va2, mapped->va());
  ASSERT_THAT(device_->Map(va2, *imported, Access::kReadWrite), IsOk());

  std::vector<uint8_t> back(bytes);
  ASSERT_THAT(device_->CopyToHost(back.data(), va2, bytes), IsOk());
  EXPECT_TRUE(back == pattern);
  // And the other way round: a write through the second mapping shows at the first.
  const std::vector<uint8_t> other = RandomBytes(bytes, 3);
  ASSERT_THAT(device_->CopyFromHost(va2, other.data(), bytes), IsOk());
  ASSERT_THAT(device_->CopyToHost(back.data(), mapped->va(), bytes), IsOk());
  EXPECT_TRUE(back == other);

  EXPECT_THAT(device_->Unmap(va2, bytes), IsOk());
  EXPECT_THAT(device_->Release(*imported), IsOk());
  EXPECT_THAT(device_->Free(va2, bytes), IsOk());
}

TEST_F(CudaDeviceTest, FabricHandleImportsWhereSupported) {
  if (!cuda_->fabric_handles()) GTEST_SKIP() << "this device or node has no fabric handles";
  KVD_ASSERT_OK_AND_ASSIGN(auto mapped, MappedChunk::Make(device_.get(), granularity_));
  const std::vector<uint8_t> pattern = RandomBytes(granularity_, 4);
  ASSERT_THAT(device_->CopyFromHost(mapped->va(), pattern.data(), granularity_), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(FabricHandle handle, cuda_->ExportFabric(mapped->chunk()));
  KVD_ASSERT_OK_AND_ASSIGN(Chunk imported, cuda_->ImportFabric(handle, granularity_));
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va2, device_->Reserve(granularity_));
  ASSERT_THAT(device_->Map(va2, imported, Access::kRead), IsOk());
  std::vector<uint8_t> back(granularity_);
  ASSERT_THAT(device_->CopyToHost(back.data(), va2, granularity_), IsOk());
  EXPECT_TRUE(back == pattern);
  EXPECT_THAT(device_->CopyFromHost(va2, pattern.data(), 16),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("read-only")));
  EXPECT_THAT(device_->Unmap(va2, granularity_), IsOk());
  EXPECT_THAT(device_->Release(imported), IsOk());
  EXPECT_THAT(device_->Free(va2, granularity_), IsOk());
}

// "<key>:\t<value>" of /proc/self/fdinfo/<fd>, or "" when the key is missing.
std::string FdInfo(int fd, const std::string& key) {
  std::ifstream in("/proc/self/fdinfo/" + std::to_string(fd));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::string(absl::StripAsciiWhitespace(line.substr(key.size() + 1)));
  }
  return "";
}

// The capability report states what the probes at Open found (printed for the GPU run's log), and the
// fabric capability agrees with the device's own fabric flag.
TEST_F(CudaDeviceTest, CapabilitiesAreProbed) {
  const DeviceCapabilities caps = device_->Capabilities();
  std::cout << "posix_fd " << caps.posix_fd.supported << " (" << caps.posix_fd.detail << ")\n"
            << "fabric " << caps.fabric.supported << " (" << caps.fabric.detail << ")\n"
            << "dma_buf " << caps.dma_buf.supported << " (" << caps.dma_buf.detail << ")\n"
            << "gpu_direct_rdma " << caps.gpu_direct_rdma.supported << " (" << caps.gpu_direct_rdma.detail << ")\n";
  for (const PeerCapability& p : caps.peers) {
    std::cout << "peer " << p.index << " " << p.uuid << " " << p.access << " (" << p.detail << ")\n";
  }
  EXPECT_TRUE(caps.posix_fd.supported);
  EXPECT_EQ(caps.fabric.supported, cuda_->fabric_handles());
  EXPECT_EQ(caps.range_spans_chunks, caps.dma_buf.supported);
  EXPECT_TRUE(!caps.gpu_direct_rdma.supported || caps.dma_buf.supported);
}

// One DMA-BUF over four separately created chunks mapped side by side: its fdinfo names the NVIDIA
// exporter and the whole range's size.
TEST_F(CudaDeviceTest, RangeExportIsOneDmaBufOverSeveralChunks) {
  const DeviceCapabilities caps = device_->Capabilities();
  if (!caps.dma_buf.supported) GTEST_SKIP() << "no DMA-BUF range export: " << caps.dma_buf.detail;
  const uint64_t bytes = 4 * granularity_;
  KVD_ASSERT_OK_AND_ASSIGN(uint64_t va, device_->Reserve(bytes));
  std::vector<Chunk> chunks;
  for (int i = 0; i < 4; ++i) {
    KVD_ASSERT_OK_AND_ASSIGN(Chunk c, device_->Create(granularity_));
    ASSERT_THAT(device_->Map(va + i * granularity_, c, Access::kReadWrite), IsOk());
    chunks.push_back(c);
  }
  KVD_ASSERT_OK_AND_ASSIGN(int fd, device_->ExportRange(va, bytes));
  EXPECT_EQ(FdInfo(fd, "exp_name"), "nv_dmabuf");
  EXPECT_EQ(FdInfo(fd, "size"), std::to_string(bytes));
  close(fd);
  // A part of it, and the misuse rules of the contract.
  KVD_ASSERT_OK_AND_ASSIGN(fd, device_->ExportRange(va + granularity_, 2 * granularity_));
  EXPECT_EQ(FdInfo(fd, "size"), std::to_string(2 * granularity_));
  close(fd);
  EXPECT_THAT(device_->ExportRange(va + 4096, granularity_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ExportRange")));
  ASSERT_THAT(device_->Unmap(va + 3 * granularity_, granularity_), IsOk());
  EXPECT_THAT(device_->ExportRange(va, bytes).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ExportRange")));
  ASSERT_THAT(device_->Unmap(va, 3 * granularity_), IsOk());
  for (const Chunk& c : chunks) EXPECT_THAT(device_->Release(c), IsOk());
  EXPECT_THAT(device_->Free(va, bytes), IsOk());
}

TEST_F(CudaDeviceTest, OutOfMemoryIsResourceExhausted) {
  KVD_ASSERT_OK_AND_ASSIGN(DeviceInfo info, device_->Info());
  // More than the GPU has at all: out of memory whatever else is allocated.
  const uint64_t bytes = (info.total_bytes / granularity_ + 1) * granularity_;
  EXPECT_THAT(device_->Create(bytes),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr(absl::StrCat("cuMemCreate(", bytes, " bytes)")),
                             HasSubstr("CUDA_ERROR_OUT_OF_MEMORY (2)"), HasSubstr("bytes free"))));
}

TEST_F(CudaDeviceTest, RefusesMisuseWithoutTouchingTheGpu) {
  KVD_ASSERT_OK_AND_ASSIGN(auto mapped, MappedChunk::Make(device_.get(), 2 * granularity_));
  EXPECT_THAT(device_->Create(granularity_ + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("granularity")));
  EXPECT_THAT(device_->Map(mapped->va(), mapped->chunk(), Access::kReadWrite),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("overlaps")));
  EXPECT_THAT(device_->Free(mapped->va(), mapped->bytes()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("mapping")));
  uint8_t byte = 0;
  EXPECT_THAT(device_->CopyToHost(&byte, mapped->va() + mapped->bytes(), 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not inside a reservation")));
  BlockSpan span{mapped->va(), 1, 0, 4096, 2 * granularity_ / 4096 + 1};  // one block past the mapping
  EXPECT_THAT(device_->ZeroBlocks(span, {0}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ZeroBlocks")));
  span.blocks = 4;
  EXPECT_THAT(device_->ZeroBlocks(span, {4}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block 4")));
  EXPECT_THAT(device_->ZeroBlocks(span, {}), IsOk());
}

// A BlockSpan inside one mapped chunk: the span in the lower half, packed blocks in the upper half.
struct Geometry {
  uint64_t base_offset;
  uint64_t segments;
  uint64_t segment_stride;
  uint64_t block_bytes;
  uint64_t blocks;
  uint64_t packed_offset;  // inside the upper half
};

std::ostream& operator<<(std::ostream& os, const Geometry& g) {
  return os << "base+" << g.base_offset << " segments=" << g.segments << " stride=" << g.segment_stride
            << " block_bytes=" << g.block_bytes << " blocks=" << g.blocks << " packed+" << g.packed_offset;
}

class CudaBlockOpsTest : public CudaDeviceTest, public ::testing::WithParamInterface<Geometry> {};

// The CPU reference of device.h's BlockSpan contract, over a host image of the chunk at `va`.
class Reference {
 public:
  Reference(std::vector<uint8_t>* image, uint64_t va, const BlockSpan& span) : image_(*image), va_(va), span_(span) {}
  uint8_t* Block(uint64_t segment, uint64_t id) {
    return image_.data() + (span_.base - va_) + segment * span_.segment_stride + id * span_.block_bytes;
  }
  uint8_t* Packed(uint64_t address) { return image_.data() + (address - va_); }
  void Zero(const std::vector<uint64_t>& ids) {
    for (uint64_t id : ids)
      for (uint64_t s = 0; s < span_.segments; ++s) std::memset(Block(s, id), 0, span_.block_bytes);
  }
  void Copy(const std::vector<BlockCopy>& copies) {
    for (const BlockCopy& c : copies)
      for (uint64_t s = 0; s < span_.segments; ++s) std::memcpy(Block(s, c.dst), Block(s, c.src), span_.block_bytes);
  }
  void Pack(const std::vector<uint64_t>& ids, uint64_t dst) {
    for (size_t i = 0; i < ids.size(); ++i)
      for (uint64_t s = 0; s < span_.segments; ++s)
        std::memcpy(Packed(dst) + (i * span_.segments + s) * span_.block_bytes, Block(s, ids[i]), span_.block_bytes);
  }
  void Unpack(uint64_t src, const std::vector<uint64_t>& ids) {
    for (size_t i = 0; i < ids.size(); ++i)
      for (uint64_t s = 0; s < span_.segments; ++s)
        std::memcpy(Block(s, ids[i]), Packed(src) + (i * span_.segments + s) * span_.block_bytes, span_.block_bytes);
  }

 private:
  std::vector<uint8_t>& image_;
  uint64_t va_;
  BlockSpan span_;
};

TEST_P(CudaBlockOpsTest, MatchesTheCpuReference) {
  const Geometry& g = GetParam();
  const uint64_t bytes = 16ull << 20;
  const uint64_t half = bytes / 2;
  ASSERT_LE(g.base_offset + (g.segments - 1) * g.segment_stride + g.blocks * g.block_bytes, half);
  ASSERT_LE(g.packed_offset + 3 * g.segments * g.block_bytes, half);
  KVD_ASSERT_OK_AND_ASSIGN(auto mapped, MappedChunk::Make(device_.get(), bytes));
  const uint64_t va = mapped->va();
  const BlockSpan span{va + g.base_offset, g.segments, g.segment_stride, g.block_bytes, g.blocks};
  const uint64_t packed = va + half + g.packed_offset;

  std::vector<uint8_t> image = RandomBytes(bytes, 5);
  ASSERT_THAT(device_->CopyFromHost(va, image.data(), bytes), IsOk());
  Reference ref(&image, va, span);
  std::vector<uint8_t> back(bytes);
  auto expect_same = [&](const char* op) {
    ASSERT_THAT(device_->CopyToHost(back.data(), va, bytes), IsOk());
    const auto diff = std::mismatch(back.begin(), back.end(), image.begin());
    EXPECT_TRUE(diff.first == back.end()) << op << ": first difference at chunk offset " << (diff.first - back.begin());
  };

  const uint64_t last = g.blocks - 1;
  const std::vector<uint64_t> zero_ids = {1, last, 5};
  ASSERT_THAT(device_->ZeroBlocks(span, zero_ids), IsOk());
  ref.Zero(zero_ids);
  expect_same("ZeroBlocks");

  const std::vector<BlockCopy> copies = {{0, 2}, {3, 1}, {last, 4}, {6, 5}};
  ASSERT_THAT(device_->CopyBlocks(span, copies), IsOk());
  ref.Copy(copies);
  expect_same("CopyBlocks");

  const std::vector<uint64_t> pack_ids = {last, 0, 6};
  ASSERT_THAT(device_->PackBlocks(span, pack_ids, packed), IsOk());
  ref.Pack(pack_ids, packed);
  expect_same("PackBlocks");

  // Unpack other bytes than were packed: overwrite the packed area first.
  const std::vector<uint8_t> fresh = RandomBytes(3 * span.packed_block_bytes(), 6);
  ASSERT_THAT(device_->CopyFromHost(packed, fresh.data(), fresh.size()), IsOk());
  std::memcpy(ref.Packed(packed), fresh.data(), fresh.size());
  const std::vector<uint64_t> unpack_ids = {2, last - 1, 7};
  ASSERT_THAT(device_->UnpackBlocks(span, packed, unpack_ids), IsOk());
  ref.Unpack(packed, unpack_ids);
  expect_same("UnpackBlocks");
}

INSTANTIATE_TEST_SUITE_P(Geometries, CudaBlockOpsTest,
                         ::testing::Values(
                             // The aligned kernel: every address and size a multiple of 16.
                             Geometry{0, 3, 64 << 10, 4096, 12, 0}, Geometry{0, 1, 0, 256 << 10, 12, 0},
                             Geometry{16, 80, 40960, 16, 2500, 16},
                             // The unaligned kernel: odd sizes and strides, sources and destinations
                             // misaligned differently (funnel shifts), or the same way (plain loads),
                             // multi-tile runs, runs shorter than 16 bytes (head and tail only).
                             Geometry{7, 3, 50001, 1003, 40, 3}, Geometry{2, 5, 20002, 998, 16, 6},
                             Geometry{4, 4, 100004, 2052, 40, 4}, Geometry{8, 2, (1 << 20) + 8, 65544, 12, 8},
                             Geometry{8, 3, 64 << 10, 4096, 12, 8}, Geometry{3, 2, (1 << 20) + 1, 65537, 12, 5},
                             Geometry{3, 4, 1000, 5, 100, 1}, Geometry{1, 3, 4000, 17, 200, 2}));

}  // namespace
}  // namespace kvd
