#include "cuda/cuda_device.h"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "backends.h"
#include "block_launch.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"

namespace kvd {

// The fatbin of block_kernels.cu, embedded by embed_binary.cmake (block_kernels_fatbin.cc).
extern const unsigned char kBlockKernelsFatbin[];
extern const size_t kBlockKernelsFatbinSize;

namespace {

// 8 blocks of 256 threads fill a Hopper SM (2048 resident threads); more would only queue.
constexpr uint64_t kBlocksPerMultiprocessor = 8;
constexpr uint64_t kMinScratchBytes = uint64_t{64} << 10;

std::string Hex(uint64_t value) { return absl::StrCat("0x", absl::Hex(value)); }

std::string Range(uint64_t va, uint64_t bytes) { return absl::StrCat("[", Hex(va), ", +", bytes, ")"); }

CUmemAllocationProp AllocationProp(int ordinal, CUmemAllocationHandleType types, bool rdma = false) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = types;
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  return prop;
}

// cuInit, then the number of devices: UNAVAILABLE ("no CUDA device" / "no usable CUDA driver") when
// there is none.
absl::StatusOr<int> InitAndCount(const CudaDriver& d) {
  if (const CUresult r = d.cuInit_(0); r != CUDA_SUCCESS) {
    absl::Status s = CudaStatus(d, r, "cuInit");
    if (!absl::IsUnavailable(s)) return s;
    return absl::UnavailableError(
        absl::StrCat(r == CUDA_ERROR_NO_DEVICE ? "no CUDA device: " : "no usable CUDA driver: ", s.message()));
  }
  int count = 0;
  KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceGetCount_(&count), "cuDeviceGetCount"));
  if (count == 0) return absl::UnavailableError("no CUDA device: cuDeviceGetCount found none");
  return count;
}

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it.
absl::StatusOr<std::string> DeviceUuid(const CudaDriver& d, CUdevice device) {
  CUuuid uuid{};
  KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceGetUuid_(&uuid, device), "cuDeviceGetUuid"));
  const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
                         u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

absl::StatusOr<std::string> DeviceName(const CudaDriver& d, CUdevice device) {
  char name[256] = {};
  KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceGetName_(name, sizeof(name) - 1, device), "cuDeviceGetName"));
  return std::string(name);
}

absl::StatusOr<std::string> DriverVersion(const CudaDriver& d) {
  int version = 0;
  KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDriverGetVersion_(&version), "cuDriverGetVersion"));
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

}  // namespace

absl::StatusOr<std::vector<DeviceInfo>> ListCudaDevices() {
  KVD_ASSIGN_OR_RETURN(const CudaDriver* loaded, LoadCudaDriver());
  const CudaDriver& d = *loaded;
  KVD_ASSIGN_OR_RETURN(const int count, InitAndCount(d));
  KVD_ASSIGN_OR_RETURN(const std::string driver_version, DriverVersion(d));
  std::vector<DeviceInfo> out;
  for (int i = 0; i < count; ++i) {
    DeviceInfo info;
    info.backend = BackendKind::kCuda;
    info.index = i;
    info.driver_version = driver_version;
    CUdevice device = 0;
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceGet_(&device, i), "cuDeviceGet"));
    KVD_ASSIGN_OR_RETURN(info.name, DeviceName(d, device));
    KVD_ASSIGN_OR_RETURN(info.uuid, DeviceUuid(d, device));
    size_t total = 0;
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceTotalMem_(&total, device), "cuDeviceTotalMem"));
    info.total_bytes = total;
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int index) {
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<CudaDevice> device, CudaDevice::Open(index));
  return std::unique_ptr<Device>(std::move(device));
}

CudaDevice::CudaDevice(const CudaDriver& driver, int ordinal) : driver_(driver), ordinal_(ordinal) {}

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Open(int index) {
  KVD_ASSIGN_OR_RETURN(const CudaDriver* loaded, LoadCudaDriver());
  const CudaDriver& d = *loaded;
  KVD_ASSIGN_OR_RETURN(const int count, InitAndCount(d));
  if (index < 0 || index >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device index ", index, ": this machine has ", count, " CUDA device(s), 0..", count - 1));
  }

  // The destructor releases whatever was acquired so far, so every early return below rolls back.
  std::unique_ptr<CudaDevice> dev(new CudaDevice(d, index));
  KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceGet_(&dev->device_, index), "cuDeviceGet"));
  KVD_RETURN_IF_ERROR(CudaStatusLazy(d, d.cuDevicePrimaryCtxRetain_(&dev->context_, dev->device_),
                                     [&] { return absl::StrCat("cuDevicePrimaryCtxRetain(device ", index, ")"); }));
  KVD_RETURN_IF_ERROR(dev->MakeCurrent());

  auto attribute = [&](CUdevice_attribute attr, const char* name) -> absl::StatusOr<int> {
    int value = 0;
    KVD_RETURN_IF_ERROR(CudaStatusLazy(d, d.cuDeviceGetAttribute_(&value, attr, dev->device_),
                                       [&] { return absl::StrCat("cuDeviceGetAttribute(", name, ")"); }));
    return value;
  };
  KVD_ASSIGN_OR_RETURN(const int vmm, attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                                "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"));
  KVD_ASSIGN_OR_RETURN(const int posix_fd, attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                                     "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"));
  if (vmm == 0 || posix_fd == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA device ", index, " does not support virtual memory management with POSIX FD handles, which kvd needs"));
  }
  KVD_ASSIGN_OR_RETURN(const int fabric,
                       attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, "HANDLE_TYPE_FABRIC_SUPPORTED"));
  KVD_ASSIGN_OR_RETURN(dev->multiprocessors_,
                       attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "MULTIPROCESSOR_COUNT"));

  KVD_ASSIGN_OR_RETURN(dev->name_, DeviceName(d, dev->device_));
  KVD_ASSIGN_OR_RETURN(dev->uuid_, DeviceUuid(d, dev->device_));
  KVD_ASSIGN_OR_RETURN(dev->driver_version_, DriverVersion(d));

  auto granularity = [&](CUmemAllocationHandleType types) -> absl::StatusOr<uint64_t> {
    const CUmemAllocationProp prop = AllocationProp(index, types);
    size_t bytes = 0;
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuMemGetAllocationGranularity_(&bytes, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                                   "cuMemGetAllocationGranularity"));
    return bytes;
  };
  KVD_ASSIGN_OR_RETURN(dev->granularity_, granularity(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));

  // Fabric: the attribute says the GPU can; whether this node can (IMEX channel, permissions) shows
  // only by trying, so create and export one granule. Any failure means POSIX FD handles only.
  dev->caps_.posix_fd = {true, "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR), once per chunk"};
  dev->caps_.fabric = {false, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0"};
  if (fabric != 0) {
    dev->caps_.fabric.detail = "the attribute is 1 but the probe could not create a fabric-exportable granule";
    const auto both =
        static_cast<CUmemAllocationHandleType>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC);
    absl::StatusOr<uint64_t> fabric_granularity = granularity(both);
    if (fabric_granularity.ok()) {
      const uint64_t probe_bytes = std::max(dev->granularity_, *fabric_granularity);
      const CUmemAllocationProp prop = AllocationProp(index, both);
      CUmemGenericAllocationHandle probe = 0;
      if (d.cuMemCreate_(&probe, probe_bytes, &prop, 0) == CUDA_SUCCESS) {
        absl::Cleanup release = [&] { (void)d.cuMemRelease_(probe); };
        CUmemFabricHandle handle{};
        if (const CUresult r = d.cuMemExportToShareableHandle_(&handle, probe, CU_MEM_HANDLE_TYPE_FABRIC, 0);
            r == CUDA_SUCCESS) {
          dev->fabric_handles_ = true;
          dev->handle_types_ = both;
          dev->granularity_ = probe_bytes;
          dev->caps_.fabric = {true, "probe: cuMemExportToShareableHandle(FABRIC) of a granule succeeded"};
        } else {
          dev->caps_.fabric.detail = absl::StrCat(
              "the attribute is 1 but the probe's cuMemExportToShareableHandle(FABRIC) failed: ", CudaErrorName(d, r),
              " (no IMEX channel?)");
        }
      }
    }
  }

  // The granularity is final now (the fabric probe may have raised it).
  dev->book_ = std::make_unique<VaBook>(dev->granularity_);

  KVD_ASSIGN_OR_RETURN(const int dma_buf, attribute(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, "DMA_BUF_SUPPORTED"));
  KVD_ASSIGN_OR_RETURN(const int rdma_vmm, attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                                     "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"));
  dev->rdma_flag_ = rdma_vmm != 0;
  dev->ProbeRangeExport(dma_buf != 0);
  if (rdma_vmm == 0) {
    dev->caps_.gpu_direct_rdma = {false, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 0"};
  } else if (!dev->caps_.dma_buf.supported) {
    dev->caps_.gpu_direct_rdma = {
        false, "the attribute is 1 but no DMA-BUF of the RDMA-flagged chunks: " + dev->caps_.dma_buf.detail};
  } else {
    dev->caps_.gpu_direct_rdma = {true,
                                  "chunks are created gpuDirectRDMACapable and their DMA-BUF export was probed; "
                                  "no NIC registration was tried (none is needed to state this)"};
  }
  KVD_RETURN_IF_ERROR(dev->ProbePeers());

  KVD_RETURN_IF_ERROR(
      CudaStatus(d, d.cuStreamCreate_(&dev->stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate(block kernels)"));
  // The kernels are not needed to manage memory: a load failure is kept and reported by block ops.
  dev->kernels_status_ = [&]() -> absl::Status {
    if (kBlockKernelsFatbinSize == 0) return absl::InternalError("the block kernels' fatbin is empty");
    KVD_RETURN_IF_ERROR(
        CudaStatus(d, d.cuModuleLoadData_(&dev->module_, kBlockKernelsFatbin), "cuModuleLoadData(block kernels)"));
    for (const auto& kernel : {std::pair{&dev->aligned_kernel_, kBlockKernelAligned},
                               std::pair{&dev->unaligned_kernel_, kBlockKernelUnaligned}}) {
      // Not a structured binding: clang before 16 cannot capture one in the lambda below.
      const char* symbol = kernel.second;
      KVD_RETURN_IF_ERROR(CudaStatusLazy(d, d.cuModuleGetFunction_(kernel.first, dev->module_, symbol),
                                         [&] { return absl::StrCat("cuModuleGetFunction(", symbol, ")"); }));
    }
    return absl::OkStatus();
  }();
  return dev;
}

CudaDevice::~CudaDevice() {
  if (context_ == nullptr) return;
  // At process exit the driver may already be gone (CUDA_ERROR_DEINITIALIZED): nothing to give back then.
  if (driver_.cuCtxSetCurrent_(context_) == CUDA_SUCCESS) {
    absl::MutexLock block_lock(&block_mu_);
    if (book_ != nullptr) {
      // One cuMemRelease per Create/Import result the caller never released.
      for (const LiveChunk& live : book_->LiveChunks()) {
        for (int i = 0; i < live.references; ++i) (void)driver_.cuMemRelease_(live.chunk.handle);
      }
    }
    if (scratch_ != 0) (void)driver_.cuMemFree_(scratch_);
    if (stream_ != nullptr) (void)driver_.cuStreamDestroy_(stream_);
    if (module_ != nullptr) (void)driver_.cuModuleUnload_(module_);
  }
  (void)driver_.cuDevicePrimaryCtxRelease_(device_);
  (void)driver_.cuCtxSetCurrent_(nullptr);
}

absl::Status CudaDevice::MakeCurrent() const {
  return CudaStatus(driver_, driver_.cuCtxSetCurrent_(context_), "cuCtxSetCurrent");
}

absl::StatusOr<DeviceInfo> CudaDevice::Info() {
  KVD_RETURN_IF_ERROR(MakeCurrent());
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  KVD_RETURN_IF_ERROR(CudaStatus(driver_, driver_.cuMemGetInfo_(&free_bytes, &total_bytes), "cuMemGetInfo"));
  DeviceInfo info;
  info.backend = BackendKind::kCuda;
  info.index = ordinal_;
  info.name = name_;
  info.uuid = uuid_;
  info.driver_version = driver_version_;
  info.total_bytes = total_bytes;
  info.free_bytes = free_bytes;
  info.granularity = granularity_;
  info.fabric_handles = fabric_handles_;
  return info;
}

absl::Status CudaDevice::CheckPeerAccess(absl::string_view owner_uuid) {
  if (owner_uuid.empty()) return absl::InvalidArgumentError("CheckPeerAccess: owner_uuid is empty");
  if (absl::EqualsIgnoreCase(owner_uuid, uuid_)) return absl::OkStatus();
  const std::string self = absl::StrCat("CheckPeerAccess: CUDA device ", ordinal_, " (", uuid_, ")");
  if (!absl::StartsWithIgnoreCase(owner_uuid, "GPU-")) {
    return absl::FailedPreconditionError(absl::StrCat(self, " cannot import memory of device ", owner_uuid,
                                                      ": it belongs to another backend (CUDA UUIDs start with GPU-)"));
  }
  int count = 0;
  KVD_RETURN_IF_ERROR(CudaStatus(driver_, driver_.cuDeviceGetCount_(&count), "cuDeviceGetCount"));
  std::vector<std::string> visible;
  for (int i = 0; i < count; ++i) {
    CUdevice peer = 0;
    KVD_RETURN_IF_ERROR(CudaStatus(driver_, driver_.cuDeviceGet_(&peer, i), "cuDeviceGet"));
    KVD_ASSIGN_OR_RETURN(std::string uuid, DeviceUuid(driver_, peer));
    if (!absl::EqualsIgnoreCase(owner_uuid, uuid)) {
      visible.push_back(absl::StrCat(i, " ", uuid));
      continue;
    }
    // Whether this device can access memory that lives on `peer`: the importer is this device.
    int can_access = 0;
    KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuDeviceCanAccessPeer_(&can_access, device_, peer), [&] {
      return absl::StrCat("cuDeviceCanAccessPeer(device ", ordinal_, ", peer ", i, ")");
    }));
    if (can_access == 0) {
      return absl::FailedPreconditionError(absl::StrCat(self, " has no peer access to CUDA device ", i, " (", uuid,
                                                        ") that owns the memory (cuDeviceCanAccessPeer = 0)"));
    }
    return absl::OkStatus();
  }
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  return absl::NotFoundError(
      absl::StrCat(self, ": the owner ", owner_uuid, " is not among the CUDA devices this process sees (",
                   absl::StrJoin(visible, ", "), "); an importer must see both devices: check CUDA_VISIBLE_DEVICES",
                   env != nullptr ? absl::StrCat(" (now \"", env, "\")") : std::string(" (unset)")));
}

absl::StatusOr<uint64_t> CudaDevice::Reserve(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(book_->CheckSize("Reserve", "bytes", bytes));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  CUdeviceptr va = 0;
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemAddressReserve_(&va, bytes, granularity_, 0, 0),
                                     [&] { return absl::StrCat("cuMemAddressReserve(", bytes, " bytes)"); }));
  absl::Cleanup unreserve = [&] { (void)driver_.cuMemAddressFree_(va, bytes); };
  KVD_RETURN_IF_ERROR(book_->AddReservation(va, bytes));
  std::move(unreserve).Cancel();
  return va;
}

absl::Status CudaDevice::Free(uint64_t va, uint64_t bytes) {
  return book_->Free(va, bytes, [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(MakeCurrent());
    return CudaStatusLazy(driver_, driver_.cuMemAddressFree_(va, bytes),
                          [&] { return absl::StrCat("cuMemAddressFree(", Range(va, bytes), ")"); });
  });
}

absl::StatusOr<Chunk> CudaDevice::Create(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(book_->CheckSize("Create", "bytes", bytes));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  const CUmemAllocationProp prop = AllocationProp(ordinal_, handle_types_, rdma_flag_);
  CUmemGenericAllocationHandle handle = 0;
  if (const CUresult r = driver_.cuMemCreate_(&handle, bytes, &prop, 0); r != CUDA_SUCCESS) {
    absl::Status s = CudaStatusLazy(driver_, r, [&] { return absl::StrCat("cuMemCreate(", bytes, " bytes)"); });
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (r == CUDA_ERROR_OUT_OF_MEMORY && driver_.cuMemGetInfo_(&free_bytes, &total_bytes) == CUDA_SUCCESS) {
      s = absl::ResourceExhaustedError(
          absl::StrCat(s.message(), "; the device has ", free_bytes, " of ", total_bytes, " bytes free"));
    }
    return s;
  }
  return Record(Chunk{handle, bytes}, ChunkOrigin::kCreated);
}

absl::StatusOr<Chunk> CudaDevice::Record(const Chunk& chunk, ChunkOrigin origin) {
  if (absl::Status s = book_->AddChunk(chunk, origin); !s.ok()) {
    (void)driver_.cuMemRelease_(chunk.handle);  // the driver's reference this call took
    return s;
  }
  return chunk;
}

absl::Status CudaDevice::Release(const Chunk& chunk) {
  // The book runs this without its locks: freeing the memory can take a while, and block operations
  // need not wait for it. It takes the reference back if the driver refuses.
  return book_->Release(chunk, [&](ChunkOrigin) -> absl::Status {
    KVD_RETURN_IF_ERROR(MakeCurrent());
    return CudaStatusLazy(driver_, driver_.cuMemRelease_(chunk.handle),
                          [&] { return absl::StrCat("cuMemRelease(chunk of ", chunk.bytes, " bytes)"); });
  });
}

absl::Status CudaDevice::Map(uint64_t va, const Chunk& chunk, Access access) {
  return book_->Map(va, chunk, access, [&](const MapSite&) -> absl::Status {
    KVD_RETURN_IF_ERROR(MakeCurrent());
    KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemMap_(va, chunk.bytes, 0, chunk.handle, 0),
                                       [&] { return absl::StrCat("cuMemMap(", Range(va, chunk.bytes), ")"); }));
    absl::Cleanup unmap = [&] { (void)driver_.cuMemUnmap_(va, chunk.bytes); };
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal_;
    desc.flags = access == Access::kRead ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemSetAccess_(va, chunk.bytes, &desc, 1), [&] {
      return absl::StrCat("cuMemSetAccess(", Range(va, chunk.bytes), ", ",
                          access == Access::kRead ? "READ" : "READWRITE", ")");
    }));
    std::move(unmap).Cancel();
    return absl::OkStatus();
  });
}

absl::Status CudaDevice::Unmap(uint64_t va, uint64_t bytes) {
  // The book calls this once per mapping: the driver cannot unmap part of one, and need not see the holes.
  return book_->Unmap(va, bytes, [&](uint64_t mapping, uint64_t mapping_bytes) -> absl::Status {
    KVD_RETURN_IF_ERROR(MakeCurrent());
    return CudaStatusLazy(driver_, driver_.cuMemUnmap_(mapping, mapping_bytes),
                          [&] { return absl::StrCat("cuMemUnmap(", Range(mapping, mapping_bytes), ")"); });
  });
}

absl::StatusOr<int> CudaDevice::Export(const Chunk& chunk) {
  UniqueFd fd;
  // The book keeps a concurrent Release of this chunk out.
  KVD_RETURN_IF_ERROR(book_->WithLiveChunk("Export", chunk, [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(MakeCurrent());
    int raw = -1;
    KVD_RETURN_IF_ERROR(CudaStatusLazy(
        driver_, driver_.cuMemExportToShareableHandle_(&raw, chunk.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        [&] { return absl::StrCat("cuMemExportToShareableHandle(POSIX FD, chunk of ", chunk.bytes, " bytes)"); }));
    fd.reset(raw);
    if (!fd) return absl::InternalError("cuMemExportToShareableHandle(POSIX FD) succeeded but returned no FD");
    return absl::OkStatus();
  }));
  return fd.release();
}

void CudaDevice::ProbeRangeExport(bool attribute) {
  if (!attribute) {
    caps_.dma_buf = {false, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0"};
    return;
  }
  // Two chunks as Create makes them, mapped side by side as a pool's grows map them; one DMA-BUF over
  // both is what a connector registers.
  const CudaDriver& d = driver_;
  const uint64_t g = granularity_;
  absl::Status probe = [&]() -> absl::Status {
    CUdeviceptr va = 0;
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuMemAddressReserve_(&va, 2 * g, g, 0, 0), "cuMemAddressReserve"));
    absl::Cleanup free_va = [&] { (void)d.cuMemAddressFree_(va, 2 * g); };
    const CUmemAllocationProp prop = AllocationProp(ordinal_, handle_types_, rdma_flag_);
    CUmemGenericAllocationHandle chunks[2] = {0, 0};
    absl::Cleanup release = [&] {
      for (CUmemGenericAllocationHandle h : chunks) {
        if (h != 0) (void)d.cuMemRelease_(h);
      }
    };
    int mapped = 0;
    absl::Cleanup unmap = [&] {
      for (int i = 0; i < mapped; ++i) (void)d.cuMemUnmap_(va + i * g, g);
    };
    for (int i = 0; i < 2; ++i) {
      KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuMemCreate_(&chunks[i], g, &prop, 0),
                                     rdma_flag_ ? "cuMemCreate(gpuDirectRDMACapable)" : "cuMemCreate"));
      KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuMemMap_(va + i * g, g, 0, chunks[i], 0), "cuMemMap"));
      ++mapped;
    }
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal_;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuMemSetAccess_(va, 2 * g, &desc, 1), "cuMemSetAccess"));
    int raw = -1;
    KVD_RETURN_IF_ERROR(
        CudaStatus(d, d.cuMemGetHandleForAddressRange_(&raw, va, 2 * g, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
                   "cuMemGetHandleForAddressRange(DMA_BUF_FD, two chunks)"));
    UniqueFd fd(raw);
    if (!fd) return absl::InternalError("cuMemGetHandleForAddressRange succeeded but returned no FD");
    return absl::OkStatus();
  }();
  if (probe.ok()) {
    caps_.dma_buf = {true, "probe: cuMemGetHandleForAddressRange(DMA_BUF_FD) over two mapped chunks gave one FD"};
    caps_.range_spans_chunks = true;
  } else {
    caps_.dma_buf = {false, absl::StrCat("the attribute is 1 but the probe failed: ", probe.message())};
  }
}

absl::Status CudaDevice::ProbePeers() {
  int count = 0;
  KVD_RETURN_IF_ERROR(CudaStatus(driver_, driver_.cuDeviceGetCount_(&count), "cuDeviceGetCount"));
  for (int i = 0; i < count; ++i) {
    if (i == ordinal_) continue;
    CUdevice peer = 0;
    KVD_RETURN_IF_ERROR(CudaStatus(driver_, driver_.cuDeviceGet_(&peer, i), "cuDeviceGet"));
    PeerCapability p;
    p.index = i;
    KVD_ASSIGN_OR_RETURN(p.uuid, DeviceUuid(driver_, peer));
    int can = 0;
    KVD_RETURN_IF_ERROR(
        CudaStatus(driver_, driver_.cuDeviceCanAccessPeer_(&can, peer, device_), "cuDeviceCanAccessPeer"));
    p.access = can != 0;
    p.detail = absl::StrCat("cuDeviceCanAccessPeer(device ", i, ", device ", ordinal_, ") = ", can);
    caps_.peers.push_back(std::move(p));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaDevice::ExportRange(uint64_t va, uint64_t bytes) {
  if (!caps_.dma_buf.supported) {
    return absl::UnimplementedError(
        absl::StrCat("ExportRange: CUDA device ", ordinal_, " has no DMA-BUF range export: ", caps_.dma_buf.detail));
  }
  KVD_RETURN_IF_ERROR(book_->CheckSize("ExportRange", "bytes", bytes));
  if (va % granularity_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExportRange: va ", Hex(va), " is not a multiple of the granularity ", granularity_));
  }
  UniqueFd fd;
  KVD_RETURN_IF_ERROR(book_->UseRange("ExportRange", va, bytes, /*write=*/false, [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(MakeCurrent());
    int raw = -1;
    KVD_RETURN_IF_ERROR(CudaStatusLazy(
        driver_, driver_.cuMemGetHandleForAddressRange_(&raw, va, bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
        [&] { return absl::StrCat("cuMemGetHandleForAddressRange(DMA_BUF_FD, ", Range(va, bytes), ")"); }));
    fd.reset(raw);
    if (!fd) return absl::InternalError("cuMemGetHandleForAddressRange succeeded but returned no FD");
    return absl::OkStatus();
  }));
  return fd.release();
}

absl::StatusOr<Chunk> CudaDevice::Import(int fd, uint64_t bytes) {
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("Import: fd ", fd, " is not a file descriptor"));
  KVD_RETURN_IF_ERROR(book_->CheckSize("Import", "bytes", bytes));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  CUmemGenericAllocationHandle handle = 0;
  KVD_RETURN_IF_ERROR(CudaStatusLazy(
      driver_,
      driver_.cuMemImportFromShareableHandle_(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      [&] { return absl::StrCat("cuMemImportFromShareableHandle(POSIX FD ", fd, ")"); }));
  return Record(Chunk{handle, bytes}, ChunkOrigin::kImported);
}

absl::StatusOr<FabricHandle> CudaDevice::ExportFabric(const Chunk& chunk) {
  if (!fabric_handles_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ExportFabric: CUDA device ", ordinal_, " has no fabric handles (POSIX FD only)"));
  }
  FabricHandle out;
  KVD_RETURN_IF_ERROR(book_->WithLiveChunk("ExportFabric", chunk, [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(MakeCurrent());
    CUmemFabricHandle handle{};
    KVD_RETURN_IF_ERROR(CudaStatusLazy(
        driver_, driver_.cuMemExportToShareableHandle_(&handle, chunk.handle, CU_MEM_HANDLE_TYPE_FABRIC, 0),
        [&] { return absl::StrCat("cuMemExportToShareableHandle(FABRIC, chunk of ", chunk.bytes, " bytes)"); }));
    static_assert(sizeof(handle.data) == sizeof(out.bytes));
    std::memcpy(out.bytes.data(), handle.data, sizeof(handle.data));
    return absl::OkStatus();
  }));
  return out;
}

absl::StatusOr<std::string> CudaDevice::ExportFabricHandle(const Chunk& chunk) {
  KVD_ASSIGN_OR_RETURN(const FabricHandle handle, ExportFabric(chunk));
  return std::string(reinterpret_cast<const char*>(handle.bytes.data()), handle.bytes.size());
}

absl::StatusOr<Chunk> CudaDevice::ImportFabric(const FabricHandle& fabric, uint64_t bytes) {
  if (!fabric_handles_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ImportFabric: CUDA device ", ordinal_, " has no fabric handles (POSIX FD only)"));
  }
  KVD_RETURN_IF_ERROR(book_->CheckSize("ImportFabric", "bytes", bytes));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  CUmemFabricHandle in{};
  std::memcpy(in.data, fabric.bytes.data(), sizeof(in.data));
  CUmemGenericAllocationHandle handle = 0;
  KVD_RETURN_IF_ERROR(CudaStatus(driver_,
                                 driver_.cuMemImportFromShareableHandle_(&handle, &in, CU_MEM_HANDLE_TYPE_FABRIC),
                                 "cuMemImportFromShareableHandle(FABRIC)"));
  return Record(Chunk{handle, bytes}, ChunkOrigin::kImported);
}

// Each CopyToHost/CopyFromHost issues its copy on a stream of its
// own and waits for that stream only, so that the host tier's copy threads (docs/architecture.md, Note [The
// host tier]) overlap on the copy engines; a blocking copy on the legacy stream, or a cuCtxSynchronize, would
// serialise them. The wait also covers a copy from pageable memory, which returns once the source is staged:
// the range is written before the book lets an Unmap of it proceed (an unmap under a landing DMA faults the
// context, seen on an H200).
template <typename Issue>
absl::Status CudaDevice::OnOwnStream(const char* what, Issue issue) {
  KVD_RETURN_IF_ERROR(MakeCurrent());
  CUstream stream = nullptr;
  KVD_RETURN_IF_ERROR(CudaStatus(driver_, driver_.cuStreamCreate_(&stream, CU_STREAM_NON_BLOCKING),
                                 absl::StrCat("cuStreamCreate(", what, ")")));
  absl::Status status = issue(stream);
  const CUresult synced = driver_.cuStreamSynchronize_(stream);
  if (status.ok()) status = CudaStatus(driver_, synced, absl::StrCat("cuStreamSynchronize(", what, ")"));
  (void)driver_.cuStreamDestroy_(stream);
  return status;
}

absl::Status CudaDevice::CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("CopyToHost: dst is null");
  return book_->UseRange("CopyToHost", src_va, bytes, /*write=*/false, [&]() -> absl::Status {
    return OnOwnStream("cuMemcpyDtoHAsync", [&](CUstream stream) {
      return CudaStatusLazy(driver_, driver_.cuMemcpyDtoHAsync_(dst, src_va, bytes, stream),
                            [&] { return absl::StrCat("cuMemcpyDtoHAsync(", Range(src_va, bytes), ")"); });
    });
  });
}

absl::Status CudaDevice::RegisterHost(void* host, uint64_t bytes) {
  KVD_RETURN_IF_ERROR(Device::RegisterHost(host, bytes));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  return CudaStatusLazy(driver_, driver_.cuMemHostRegister_(host, bytes, CU_MEMHOSTREGISTER_PORTABLE),
                        [&] { return absl::StrCat("cuMemHostRegister(", bytes, " bytes)"); });
}

absl::Status CudaDevice::UnregisterHost(void* host) {
  KVD_RETURN_IF_ERROR(Device::UnregisterHost(host));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  return CudaStatus(driver_, driver_.cuMemHostUnregister_(host), "cuMemHostUnregister");
}

int CudaDevice::NumaNode() const {
  char bus_id[32] = {};
  if (driver_.cuDeviceGetPCIBusId_(bus_id, sizeof(bus_id), device_) != CUDA_SUCCESS) return -1;
  return PciNumaNode(bus_id);
}

absl::Status CudaDevice::CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (src == nullptr) return absl::InvalidArgumentError("CopyFromHost: src is null");
  return book_->UseRange("CopyFromHost", dst_va, bytes, /*write=*/true, [&]() -> absl::Status {
    return OnOwnStream("cuMemcpyHtoDAsync", [&](CUstream stream) {
      return CudaStatusLazy(driver_, driver_.cuMemcpyHtoDAsync_(dst_va, src, bytes, stream),
                            [&] { return absl::StrCat("cuMemcpyHtoDAsync(", Range(dst_va, bytes), ")"); });
    });
  });
}

absl::Status CudaDevice::CopyRange(uint64_t dst_va, uint64_t src_va, uint64_t bytes) {
  return book_->UseCopy("CopyRange", dst_va, src_va, bytes, [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(MakeCurrent());
    KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemcpyDtoD_(dst_va, src_va, bytes), [&] {
      return absl::StrCat("cuMemcpyDtoD(", Range(dst_va, bytes), " <- ", Range(src_va, bytes), ")");
    }));
    // Device-to-device copies are asynchronous to the host: wait, so that the book lets an Unmap of either
    // range proceed only after the copy.
    return CudaStatus(driver_, driver_.cuCtxSynchronize_(), "cuCtxSynchronize after cuMemcpyDtoD");
  });
}

absl::Status CudaDevice::ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  return RunBlocks("ZeroBlocks", BlockOp::kZero, span, blocks.data(), blocks.size(), blocks.size(), 0);
}

absl::Status CudaDevice::CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) {
  KVD_RETURN_IF_ERROR(ValidateCopies(span, copies));
  // The kernel reads the pairs as uint64 words: src, dst.
  static_assert(sizeof(BlockCopy) == 2 * sizeof(uint64_t) && offsetof(BlockCopy, dst) == sizeof(uint64_t));
  std::vector<uint64_t> words(2 * copies.size());
  for (size_t i = 0; i < copies.size(); ++i) {
    words[2 * i] = copies[i].src;
    words[2 * i + 1] = copies[i].dst;
  }
  return RunBlocks("CopyBlocks", BlockOp::kCopy, span, words.data(), words.size(), copies.size(), 0);
}

absl::Status CudaDevice::PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks, uint64_t dst) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  return RunBlocks("PackBlocks", BlockOp::kPack, span, blocks.data(), blocks.size(), blocks.size(), dst);
}

absl::Status CudaDevice::UnpackBlocks(const BlockSpan& span, uint64_t src, absl::Span<const uint64_t> blocks) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  return RunBlocks("UnpackBlocks", BlockOp::kUnpack, span, blocks.data(), blocks.size(), blocks.size(), src);
}

absl::Status CudaDevice::EnsureScratch(uint64_t bytes) {
  if (bytes <= scratch_bytes_) return absl::OkStatus();
  const uint64_t want = std::max({bytes, kMinScratchBytes, 2 * scratch_bytes_});
  if (scratch_ != 0) {
    // The stream is idle: every block operation waits for it before returning.
    (void)driver_.cuMemFree_(scratch_);
    scratch_ = 0;
    scratch_bytes_ = 0;
  }
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemAlloc_(&scratch_, want),
                                     [&] { return absl::StrCat("cuMemAlloc(", want, " bytes, block ids)"); }));
  scratch_bytes_ = want;
  return absl::OkStatus();
}

absl::Status CudaDevice::RunBlocks(const char* call, BlockOp op, const BlockSpan& span, const uint64_t* ids,
                                   uint64_t id_words, uint64_t items, uint64_t packed) {
  if (items == 0 || span.segments == 0 || span.block_bytes == 0) return absl::OkStatus();
  KVD_RETURN_IF_ERROR(kernels_status_);
  uint64_t runs = 0;
  uint64_t packed_bytes = 0;
  if (__builtin_mul_overflow(items, span.segments, &runs) ||
      __builtin_mul_overflow(runs, span.block_bytes, &packed_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", items, " blocks of ", span.segments, " x ",
                                                   span.block_bytes, " bytes overflow 64 bits"));
  }
  const bool packs = op == BlockOp::kPack || op == BlockOp::kUnpack;
  if (packs && packed == 0) return absl::InvalidArgumentError(absl::StrCat(call, ": the packed buffer is null"));

  KVD_ASSIGN_OR_RETURN(const BlockLaunch launch, PlanBlockLaunch(call, op, span, runs, packed));
  const CUfunction kernel = launch.aligned ? aligned_kernel_ : unaligned_kernel_;
  const char* kernel_name = launch.aligned ? kBlockKernelAligned : kBlockKernelUnaligned;
  const BlockRunParams params = launch.params;

  // The book holds off a concurrent Unmap until the kernel is done.
  return book_->UseBlocks(call, span, /*span_write=*/op != BlockOp::kPack, packed, packs ? items : 0,
                          /*packed_write=*/op == BlockOp::kPack, [&]() -> absl::Status {
                            absl::MutexLock block_lock(&block_mu_);
                            return LaunchLocked(call, kernel, kernel_name, params, ids, id_words);
                          });
}

absl::Status CudaDevice::LaunchLocked(const char* call, CUfunction kernel, const char* kernel_name,
                                      BlockRunParams params, const uint64_t* ids, uint64_t id_words) {
  KVD_RETURN_IF_ERROR(MakeCurrent());
  const uint64_t id_bytes = id_words * sizeof(uint64_t);
  KVD_RETURN_IF_ERROR(EnsureScratch(id_bytes));
  params.ids = scratch_;
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemcpyHtoDAsync_(scratch_, ids, id_bytes, stream_), [&] {
    return absl::StrCat("cuMemcpyHtoDAsync(", id_bytes, " bytes of block ids)");
  }));
  // Whatever happens next, the stream is idle again before `ids` and the scratch buffer are reused.
  // (A copy of the stream: the analysis cannot see that the lambda runs under block_mu_.)
  absl::Cleanup drain = [this, stream = stream_] { (void)driver_.cuStreamSynchronize_(stream); };
  const uint64_t grid =
      std::min(params.total_tiles, static_cast<uint64_t>(multiprocessors_) * kBlocksPerMultiprocessor);
  void* args[] = {&params};
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_,
                                     driver_.cuLaunchKernel_(kernel, static_cast<unsigned>(grid), 1, 1,
                                                             kBlockKernelThreads, 1, 1, 0, stream_, args, nullptr),
                                     [&] { return absl::StrCat("cuLaunchKernel(", kernel_name, ", ", call, ")"); }));
  std::move(drain).Cancel();
  return CudaStatusLazy(driver_, driver_.cuStreamSynchronize_(stream_),
                        [&] { return absl::StrCat("cuStreamSynchronize(", kernel_name, ", ", call, ")"); });
}

}  // namespace kvd
