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
#include "kvd/status.h"

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

CUmemAllocationProp AllocationProp(int ordinal, CUmemAllocationHandleType types) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = types;
  return prop;
}

// *out = a + b * c, or false on overflow.
bool MulAdd(uint64_t a, uint64_t b, uint64_t c, uint64_t* out) {
  uint64_t product = 0;
  return !__builtin_mul_overflow(b, c, &product) && !__builtin_add_overflow(a, product, out);
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
  if (fabric != 0) {
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
        if (d.cuMemExportToShareableHandle_(&handle, probe, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_SUCCESS) {
          dev->fabric_handles_ = true;
          dev->handle_types_ = both;
          dev->granularity_ = probe_bytes;
        }
      }
    }
  }

  KVD_RETURN_IF_ERROR(
      CudaStatus(d, d.cuStreamCreate_(&dev->stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate(block kernels)"));
  // The kernels are not needed to manage memory: a load failure is kept and reported by block ops.
  dev->kernels_status_ = [&]() -> absl::Status {
    if (kBlockKernelsFatbinSize == 0) return absl::InternalError("the block kernels' fatbin is empty");
    KVD_RETURN_IF_ERROR(
        CudaStatus(d, d.cuModuleLoadData_(&dev->module_, kBlockKernelsFatbin), "cuModuleLoadData(block kernels)"));
    for (auto [function, symbol] : {std::pair{&dev->aligned_kernel_, kBlockKernelAligned},
                                    std::pair{&dev->unaligned_kernel_, kBlockKernelUnaligned}}) {
      KVD_RETURN_IF_ERROR(CudaStatusLazy(d, d.cuModuleGetFunction_(function, dev->module_, symbol),
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
    absl::MutexLock lock(&mu_);
    absl::MutexLock block_lock(&block_mu_);
    for (const auto& [handle, count] : chunks_) {
      for (int i = 0; i < count; ++i) (void)driver_.cuMemRelease_(handle);
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

absl::Status CudaDevice::CheckAligned(const char* call, const char* what, uint64_t value, bool allow_zero) const {
  if ((value == 0 && !allow_zero) || value % granularity_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", what, " ", value, " is not a ",
                                                   allow_zero ? "" : "positive ", "multiple of the granularity (",
                                                   granularity_, " bytes)"));
  }
  return absl::OkStatus();
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

CudaDevice::Reservation* CudaDevice::FindReservation(uint64_t va, uint64_t bytes) {
  auto it = reservations_.upper_bound(va);
  if (it == reservations_.begin()) return nullptr;
  --it;
  const uint64_t offset = va - it->first;
  if (offset > it->second.bytes || bytes > it->second.bytes - offset) return nullptr;
  return &it->second;
}

absl::Status CudaDevice::CheckMapped(const char* call, uint64_t va, uint64_t bytes, bool write) {
  if (bytes == 0) return absl::OkStatus();
  uint64_t end = 0;
  if (__builtin_add_overflow(va, bytes, &end)) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", Range(va, bytes), " wraps around the address space"));
  }
  const Reservation* reservation = FindReservation(va, bytes);
  if (reservation == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", Range(va, bytes), " is not inside a reservation of this device"));
  }
  auto it = reservation->mappings.upper_bound(va);
  if (it != reservation->mappings.begin()) --it;
  for (uint64_t at = va; at < end; ++it) {
    if (it == reservation->mappings.end() || it->first > at || it->first + it->second.bytes <= at) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": ", Range(va, bytes), " is not mapped by this device at ", Hex(at)));
    }
    if (write && it->second.access != Access::kReadWrite) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": ", Range(va, bytes), " writes the read-only mapping at ", Hex(it->first)));
    }
    at = it->first + it->second.bytes;
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::CheckSpanMapped(const char* call, const BlockSpan& span, bool write) {
  uint64_t run_bytes = 0;
  if (__builtin_mul_overflow(span.blocks, span.block_bytes, &run_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": span: blocks * block_bytes overflows"));
  }
  for (uint64_t s = 0; s < span.segments; ++s) {
    uint64_t start = 0;
    if (!MulAdd(span.base, s, span.segment_stride, &start)) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": span: segment ", s, " lies past the address space"));
    }
    KVD_RETURN_IF_ERROR(CheckMapped(call, start, run_bytes, write));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CudaDevice::Reserve(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(CheckAligned("Reserve", "bytes", bytes, false));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  CUdeviceptr va = 0;
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemAddressReserve_(&va, bytes, granularity_, 0, 0),
                                     [&] { return absl::StrCat("cuMemAddressReserve(", bytes, " bytes)"); }));
  absl::MutexLock lock(&mu_);
  reservations_[va] = Reservation{bytes, {}};
  return va;
}

absl::Status CudaDevice::Free(uint64_t va, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second.bytes != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("Free: ", Range(va, bytes), " is not a reservation of this device"));
  }
  if (!it->second.mappings.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("Free: the reservation ", Range(va, bytes), " still has ",
                                                      it->second.mappings.size(), " mapping(s); unmap them first"));
  }
  KVD_RETURN_IF_ERROR(MakeCurrent());
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemAddressFree_(va, bytes),
                                     [&] { return absl::StrCat("cuMemAddressFree(", Range(va, bytes), ")"); }));
  reservations_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<Chunk> CudaDevice::Create(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(CheckAligned("Create", "bytes", bytes, false));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  const CUmemAllocationProp prop = AllocationProp(ordinal_, handle_types_);
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
  absl::MutexLock lock(&mu_);
  ++chunks_[handle];
  return Chunk{handle, bytes};
}

absl::Status CudaDevice::Release(const Chunk& chunk) {
  {
    absl::MutexLock lock(&mu_);
    auto it = chunks_.find(chunk.handle);
    if (it == chunks_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Release: ", Hex(chunk.handle), " is not a live chunk of this device"));
    }
    if (--it->second == 0) chunks_.erase(it);
  }
  // Freeing the memory can take a while; block operations need not wait for it.
  absl::Status s = MakeCurrent();
  if (s.ok()) {
    s = CudaStatusLazy(driver_, driver_.cuMemRelease_(chunk.handle),
                       [&] { return absl::StrCat("cuMemRelease(chunk of ", chunk.bytes, " bytes)"); });
  }
  if (!s.ok()) {
    absl::MutexLock lock(&mu_);
    ++chunks_[chunk.handle];
  }
  return s;
}

absl::Status CudaDevice::Map(uint64_t va, const Chunk& chunk, Access access) {
  KVD_RETURN_IF_ERROR(CheckAligned("Map", "va", va, false));
  KVD_RETURN_IF_ERROR(CheckAligned("Map", "chunk.bytes", chunk.bytes, false));
  absl::MutexLock lock(&mu_);
  if (!chunks_.contains(chunk.handle)) {
    return absl::InvalidArgumentError(absl::StrCat("Map: ", Hex(chunk.handle), " is not a live chunk of this device"));
  }
  Reservation* reservation = FindReservation(va, chunk.bytes);
  if (reservation == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Map: ", Range(va, chunk.bytes), " is not inside a reservation of this device"));
  }
  auto next = reservation->mappings.lower_bound(va);
  if (next != reservation->mappings.end() && next->first < va + chunk.bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("Map: ", Range(va, chunk.bytes), " overlaps the mapping at ", Hex(next->first)));
  }
  if (next != reservation->mappings.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > va) {
      return absl::FailedPreconditionError(
          absl::StrCat("Map: ", Range(va, chunk.bytes), " overlaps the mapping at ", Hex(prev->first)));
    }
  }
  KVD_RETURN_IF_ERROR(MakeCurrent());
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemMap_(va, chunk.bytes, 0, chunk.handle, 0),
                                     [&] { return absl::StrCat("cuMemMap(", Range(va, chunk.bytes), ")"); }));
  absl::Cleanup unmap = [&] { (void)driver_.cuMemUnmap_(va, chunk.bytes); };
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = ordinal_;
  desc.flags = access == Access::kRead ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemSetAccess_(va, chunk.bytes, &desc, 1), [&] {
    return absl::StrCat("cuMemSetAccess(", Range(va, chunk.bytes), ", ", access == Access::kRead ? "READ" : "READWRITE",
                        ")");
  }));
  std::move(unmap).Cancel();
  reservation->mappings.emplace(va, Mapping{chunk.bytes, access});
  return absl::OkStatus();
}

absl::Status CudaDevice::Unmap(uint64_t va, uint64_t bytes) {
  KVD_RETURN_IF_ERROR(CheckAligned("Unmap", "va", va, false));
  KVD_RETURN_IF_ERROR(CheckAligned("Unmap", "bytes", bytes, false));
  absl::MutexLock lock(&mu_);
  Reservation* reservation = FindReservation(va, bytes);
  if (reservation == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unmap: ", Range(va, bytes), " is not inside a reservation of this device"));
  }
  auto first = reservation->mappings.lower_bound(va);
  if (first != reservation->mappings.begin()) {
    const auto prev = std::prev(first);
    if (prev->first + prev->second.bytes > va) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unmap: ", Range(va, bytes), " cuts the mapping ", Range(prev->first, prev->second.bytes)));
    }
  }
  auto last = first;
  for (; last != reservation->mappings.end() && last->first < va + bytes; ++last) {
    if (last->first + last->second.bytes > va + bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unmap: ", Range(va, bytes), " cuts the mapping ", Range(last->first, last->second.bytes)));
    }
  }
  KVD_RETURN_IF_ERROR(MakeCurrent());
  // One cuMemUnmap per mapping: the driver cannot unmap part of one, and need not see the holes.
  while (first != last) {
    KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemUnmap_(first->first, first->second.bytes), [&] {
      return absl::StrCat("cuMemUnmap(", Range(first->first, first->second.bytes), ")");
    }));
    first = reservation->mappings.erase(first);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaDevice::Export(const Chunk& chunk) {
  absl::ReaderMutexLock lock(&mu_);  // keeps a concurrent Release of this chunk out
  if (!chunks_.contains(chunk.handle)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Export: ", Hex(chunk.handle), " is not a live chunk of this device"));
  }
  KVD_RETURN_IF_ERROR(MakeCurrent());
  int fd = -1;
  KVD_RETURN_IF_ERROR(CudaStatusLazy(
      driver_, driver_.cuMemExportToShareableHandle_(&fd, chunk.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      [&] { return absl::StrCat("cuMemExportToShareableHandle(POSIX FD, chunk of ", chunk.bytes, " bytes)"); }));
  return fd;
}

absl::StatusOr<Chunk> CudaDevice::Import(int fd, uint64_t bytes) {
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("Import: fd ", fd, " is not a file descriptor"));
  KVD_RETURN_IF_ERROR(CheckAligned("Import", "bytes", bytes, false));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  CUmemGenericAllocationHandle handle = 0;
  KVD_RETURN_IF_ERROR(CudaStatusLazy(
      driver_,
      driver_.cuMemImportFromShareableHandle_(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      [&] { return absl::StrCat("cuMemImportFromShareableHandle(POSIX FD ", fd, ")"); }));
  absl::MutexLock lock(&mu_);
  ++chunks_[handle];
  return Chunk{handle, bytes};
}

absl::StatusOr<FabricHandle> CudaDevice::ExportFabric(const Chunk& chunk) {
  if (!fabric_handles_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ExportFabric: CUDA device ", ordinal_, " has no fabric handles (POSIX FD only)"));
  }
  absl::ReaderMutexLock lock(&mu_);
  if (!chunks_.contains(chunk.handle)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExportFabric: ", Hex(chunk.handle), " is not a live chunk of this device"));
  }
  KVD_RETURN_IF_ERROR(MakeCurrent());
  CUmemFabricHandle handle{};
  KVD_RETURN_IF_ERROR(CudaStatusLazy(
      driver_, driver_.cuMemExportToShareableHandle_(&handle, chunk.handle, CU_MEM_HANDLE_TYPE_FABRIC, 0),
      [&] { return absl::StrCat("cuMemExportToShareableHandle(FABRIC, chunk of ", chunk.bytes, " bytes)"); }));
  FabricHandle out;
  static_assert(sizeof(handle.data) == sizeof(out.bytes));
  std::memcpy(out.bytes.data(), handle.data, sizeof(handle.data));
  return out;
}

absl::StatusOr<Chunk> CudaDevice::ImportFabric(const FabricHandle& fabric, uint64_t bytes) {
  if (!fabric_handles_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ImportFabric: CUDA device ", ordinal_, " has no fabric handles (POSIX FD only)"));
  }
  KVD_RETURN_IF_ERROR(CheckAligned("ImportFabric", "bytes", bytes, false));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  CUmemFabricHandle in{};
  std::memcpy(in.data, fabric.bytes.data(), sizeof(in.data));
  CUmemGenericAllocationHandle handle = 0;
  KVD_RETURN_IF_ERROR(CudaStatus(driver_,
                                 driver_.cuMemImportFromShareableHandle_(&handle, &in, CU_MEM_HANDLE_TYPE_FABRIC),
                                 "cuMemImportFromShareableHandle(FABRIC)"));
  absl::MutexLock lock(&mu_);
  ++chunks_[handle];
  return Chunk{handle, bytes};
}

absl::Status CudaDevice::CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("CopyToHost: dst is null");
  absl::ReaderMutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(CheckMapped("CopyToHost", src_va, bytes, false));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  return CudaStatusLazy(driver_, driver_.cuMemcpyDtoH_(dst, src_va, bytes),
                        [&] { return absl::StrCat("cuMemcpyDtoH(", Range(src_va, bytes), ")"); });
}

absl::Status CudaDevice::CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (src == nullptr) return absl::InvalidArgumentError("CopyFromHost: src is null");
  absl::ReaderMutexLock lock(&mu_);
  KVD_RETURN_IF_ERROR(CheckMapped("CopyFromHost", dst_va, bytes, true));
  KVD_RETURN_IF_ERROR(MakeCurrent());
  return CudaStatusLazy(driver_, driver_.cuMemcpyHtoD_(dst_va, src, bytes),
                        [&] { return absl::StrCat("cuMemcpyHtoD(", Range(dst_va, bytes), ")"); });
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

  // The aligned kernel when every address and size the kernel touches is a multiple of 16.
  uint64_t bits = span.base | span.block_bytes | packed;
  if (span.segments > 1) bits |= span.segment_stride;
  const bool aligned = (bits & 15) == 0;
  const CUfunction kernel = aligned ? aligned_kernel_ : unaligned_kernel_;
  const char* kernel_name = aligned ? kBlockKernelAligned : kBlockKernelUnaligned;
  constexpr uint64_t kTileUnits = uint64_t{kBlockKernelThreads} * kBlockKernelUnroll;

  BlockRunParams params{};
  params.base = span.base;
  params.segment_stride = span.segment_stride;
  params.block_bytes = span.block_bytes;
  params.segments = span.segments;
  params.packed = packed;
  // At least one tile per run: the unaligned kernel's first tile also moves the head and tail bytes.
  params.tiles_per_run = std::max<uint64_t>(1, (span.block_bytes / 16 + kTileUnits - 1) / kTileUnits);
  params.op = op;
  if (__builtin_mul_overflow(runs, params.tiles_per_run, &params.total_tiles)) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": too many tiles"));
  }

  absl::ReaderMutexLock lock(&mu_);  // a concurrent Unmap waits until the kernel is done
  KVD_RETURN_IF_ERROR(CheckSpanMapped(call, span, /*write=*/op != BlockOp::kPack));
  if (packs) KVD_RETURN_IF_ERROR(CheckMapped(call, packed, packed_bytes, /*write=*/op == BlockOp::kPack));

  absl::MutexLock block_lock(&block_mu_);
  KVD_RETURN_IF_ERROR(MakeCurrent());
  const uint64_t id_bytes = id_words * sizeof(uint64_t);
  KVD_RETURN_IF_ERROR(EnsureScratch(id_bytes));
  params.ids = scratch_;
  KVD_RETURN_IF_ERROR(CudaStatusLazy(driver_, driver_.cuMemcpyHtoDAsync_(scratch_, ids, id_bytes, stream_), [&] {
    return absl::StrCat("cuMemcpyHtoDAsync(", id_bytes, " bytes of block ids)");
  }));
  // Whatever happens next, the stream is idle again before `ids` and the scratch buffer are reused.
  absl::Cleanup drain = [&] { (void)driver_.cuStreamSynchronize_(stream_); };
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
