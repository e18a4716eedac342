#include "hip_device.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/memory/memory.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backends.h"
#include "block_kernels.h"
#include "block_launch.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"

namespace kvd::hip {

// The code-object bundle built from block_kernels.hip, and the targets it holds (comma-separated);
// defined in the generated block_kernels_bundle.cc (embed_binary.cmake).
extern const unsigned char kBlockKernelsBundle[];
extern const size_t kBlockKernelsBundleSize;
extern const char kBlockKernelsBundleArchitectures[];

namespace {

// Work-groups per block-kernel launch at most; they stride over the runs.
constexpr uint64_t kMaxGrid = 16384;
// The smallest device buffer for staged block ids (8 KiB ids).
constexpr uint64_t kMinScratchBytes = 64 << 10;

// Makes `device` the calling thread's current HIP device and gives the previous one back on
// destruction, so that a caller sharing the process (an engine thread) keeps its own device.
class ScopedCurrentDevice {
 public:
  ScopedCurrentDevice(const HipRuntimeTable& hip, int device) : hip_(hip) {
    int previous = 0;
    if (HipError e = hip_.hipGetDevice(&previous); e != kHipSuccess) {
      status_ = HipStatus(hip_, e, "hipGetDevice");
      return;
    }
    if (previous == device) return;
    if (HipError e = hip_.hipSetDevice(device); e != kHipSuccess) {
      status_ = HipStatus(hip_, e, "hipSetDevice");
      return;
    }
    previous_ = previous;
  }
  ~ScopedCurrentDevice() {
    if (previous_ >= 0) (void)hip_.hipSetDevice(previous_);
  }
  ScopedCurrentDevice(const ScopedCurrentDevice&) = delete;
  ScopedCurrentDevice& operator=(const ScopedCurrentDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  const HipRuntimeTable& hip_;
  int previous_ = -1;
  absl::Status status_;
};

std::string Hex(uint64_t value) { return absl::StrCat("0x", absl::Hex(value)); }

void* Ptr(uint64_t va) { return reinterpret_cast<void*>(static_cast<uintptr_t>(va)); }

// A UUID as operators see it: ROCm fills hipUUID with the 16 ASCII characters of the GPU's unique
// id (rocm-smi shows it after "GPU-"); anything else is printed like a CUDA UUID.
std::string FormatUuid(const HipUuid& uuid) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  if (std::all_of(b, b + 16, [](unsigned char c) { return c == 0; })) return "";
  size_t len = 0;
  while (len < 16 && b[len] != 0) ++len;
  if (std::all_of(b, b + len, [](unsigned char c) { return c > 0x20 && c < 0x7f; }) &&
      std::all_of(b + len, b + 16, [](unsigned char c) { return c == 0; })) {
    return absl::StrCat("GPU-", std::string(reinterpret_cast<const char*>(b), len));
  }
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    absl::StrAppend(&out, absl::Hex(static_cast<unsigned int>(b[i]), absl::kZeroPad2));
  }
  return out;
}

}  // namespace

namespace {

// "hip (libamdhip64.so.7): " before every message about the runtime as a whole.
std::string Where(const HipRuntimeTable& hip) { return absl::StrCat("hip (", hip.library, "): "); }

// hipInit, then the number of devices. What an operator sees on a machine without a usable GPU is
// UNAVAILABLE saying so first, then the raw error.
absl::StatusOr<int> InitAndCount(const HipRuntimeTable& hip) {
  const auto no_gpu = [&hip](absl::Status s) {
    if (!absl::IsUnavailable(s)) return absl::Status(s.code(), absl::StrCat(Where(hip), s.message()));
    return absl::UnavailableError(absl::StrCat(Where(hip), "no usable AMD GPU (", s.message(),
                                               "); is the amdgpu driver loaded and /dev/kfd accessible?"));
  };
  if (HipError e = hip.hipInit(0); e != kHipSuccess) return no_gpu(HipStatus(hip, e, "hipInit"));
  int count = 0;
  if (HipError e = hip.hipGetDeviceCount(&count); e != kHipSuccess) {
    return no_gpu(HipStatus(hip, e, "hipGetDeviceCount"));
  }
  if (count == 0)
    return absl::UnavailableError(absl::StrCat(Where(hip), "no HIP device: hipGetDeviceCount found none"));
  return count;
}

// The UUID of device `ordinal`, "" when the runtime has none (hipDeviceGetUuid was "beta" for long).
std::string DeviceUuid(const HipRuntimeTable& hip, int ordinal) {
  HipDeviceHandle device = 0;
  HipUuid uuid{};
  if (hip.hipDeviceGet(&device, ordinal) != kHipSuccess || hip.hipDeviceGetUuid(&uuid, device) != kHipSuccess) {
    return "";
  }
  return FormatUuid(uuid);
}

}  // namespace

absl::StatusOr<std::vector<DeviceInfo>> ListVisibleDevices() {
  KVD_ASSIGN_OR_RETURN(const HipRuntimeTable* hip, LoadHipRuntime());
  KVD_ASSIGN_OR_RETURN(const int count, InitAndCount(*hip));
  int runtime_version = 0;
  (void)hip->hipRuntimeGetVersion(&runtime_version);
  std::vector<DeviceInfo> out;
  for (int i = 0; i < count; ++i) {
    DeviceInfo info;
    info.backend = BackendKind::kHip;
    info.index = i;
    info.driver_version = absl::StrCat("HIP runtime ", FormatHipVersion(runtime_version));
    HipDeviceHandle device = 0;
    if (HipError e = hip->hipDeviceGet(&device, i); e != kHipSuccess) return HipStatus(*hip, e, "hipDeviceGet");
    std::array<char, 256> name{};
    if (HipError e = hip->hipDeviceGetName(name.data(), static_cast<int>(name.size() - 1), device); e != kHipSuccess) {
      return HipStatus(*hip, e, "hipDeviceGetName");
    }
    info.name = name.data();
    info.uuid = DeviceUuid(*hip, i);
    size_t total = 0;
    if (HipError e = hip->hipDeviceTotalMem(&total, device); e != kHipSuccess) {
      return HipStatus(*hip, e, "hipDeviceTotalMem");
    }
    info.total_bytes = total;
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<HipDevice>> HipDevice::Open(int index) {
  if (index < 0) return absl::InvalidArgumentError(absl::StrCat("hip: device index ", index, " must be >= 0"));
  KVD_ASSIGN_OR_RETURN(const HipRuntimeTable* hip, LoadHipRuntime());
  const std::string where = Where(*hip);
  KVD_ASSIGN_OR_RETURN(const int count, InitAndCount(*hip));
  if (index >= count) {
    return absl::UnavailableError(absl::StrCat(where, "no HIP device ", index, " (the runtime sees ", count, " device",
                                               count == 1 ? "" : "s", ")"));
  }
  int runtime_version = 0;
  if (HipError e = hip->hipRuntimeGetVersion(&runtime_version); e != kHipSuccess) {
    absl::Status s = HipStatus(*hip, e, "hipRuntimeGetVersion");
    return absl::Status(s.code(), absl::StrCat(where, s.message()));
  }
  // Checked before any call that takes a hipMemAllocationProp: older runtimes read another layout.
  if (runtime_version < kMinVmmRuntimeVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, "HIP runtime ", FormatHipVersion(runtime_version), " is older than ",
                     FormatHipVersion(kMinVmmRuntimeVersion),
                     ", the first whose virtual memory ABI (hipMemAllocationProp) kvd speaks; install ROCm >= 7.12 "
                     "(growth needs it anyway) or choose another backend"));
  }
  int driver_version = 0;
  // Informational only (DeviceInfo::driver_version); a failure leaves 0.
  (void)hip->hipDriverGetVersion(&driver_version);

  std::unique_ptr<HipDevice> device = absl::WrapUnique(new HipDevice(*hip, index, runtime_version, driver_version));
  // On failure the destructor releases whatever Init() had made.
  KVD_RETURN_IF_ERROR(device->Init());
  return device;
}

HipDevice::HipDevice(const HipRuntimeTable& hip, int index, int runtime_version, int driver_version)
    : hip_(hip), index_(index), runtime_version_(runtime_version), driver_version_(driver_version) {}

HipDevice::~HipDevice() {
  ScopedCurrentDevice current(hip_, index_);
  if (book_ != nullptr) {
    // One hipMemRelease per Create/Import result the caller never released (mappings keep their memory).
    for (const LiveChunk& live : book_->LiveChunks()) {
      for (int i = 0; i < live.references; ++i) {
        (void)hip_.hipMemRelease(reinterpret_cast<HipMemGenericAllocationHandle>(live.chunk.handle));
      }
    }
  }
  absl::MutexLock lock(&kernel_mu_);
  if (scratch_ != nullptr) (void)hip_.hipFree(scratch_);
  if (module_ != nullptr) (void)hip_.hipModuleUnload(module_);
  if (stream_ != nullptr) (void)hip_.hipStreamDestroy(stream_);
}

absl::Status HipDevice::Error(HipError error, absl::string_view call) const {
  absl::Status s = HipStatus(hip_, error, call);
  return absl::Status(s.code(), absl::StrCat("hip device ", index_, ": ", s.message()));
}

namespace {

HipMemAllocationProp AllocationProp(int index) {
  HipMemAllocationProp prop{};
  prop.type = kHipMemAllocationTypePinned;
  prop.requested_handle_type = kHipMemHandleTypePosixFileDescriptor;
  prop.location.type = kHipMemLocationTypeDevice;
  prop.location.id = index;
  return prop;
}

}  // namespace

absl::Status HipDevice::Init() {
  ScopedCurrentDevice current(hip_, index_);
  KVD_RETURN_IF_ERROR(current.status());

  if (HipError e = hip_.hipDeviceGet(&device_, index_); e != kHipSuccess) return Error(e, "hipDeviceGet");
  std::array<char, 256> name{};
  if (HipError e = hip_.hipDeviceGetName(name.data(), static_cast<int>(name.size() - 1), device_); e != kHipSuccess) {
    return Error(e, "hipDeviceGetName");
  }
  name_ = name.data();
  // hipDeviceGetUuid is informational and was "beta" for a long time: without it the UUID stays empty.
  uuid_ = DeviceUuid(hip_, index_);

  const HipMemAllocationProp prop = AllocationProp(index_);
  size_t reported = 0;
  if (HipError e = hip_.hipMemGetAllocationGranularity(&reported, &prop, kHipMemAllocationGranularityMinimum);
      e != kHipSuccess) {
    if (e == kHipErrorNotSupported) {
      return absl::FailedPreconditionError(absl::StrCat(
          "hip device ", index_, " (", name_,
          "): virtual memory management is not supported: ", Error(e, "hipMemGetAllocationGranularity").message()));
    }
    return Error(e, "hipMemGetAllocationGranularity");
  }
  // ROCm has reported 4 KiB here; chunks and mappings that small multiply page-table and handle
  // cost, so kvd never goes below 2 MiB (rounded up to the reported unit).
  const uint64_t unit = std::max<uint64_t>(reported, 1);
  granularity_ = unit >= kMinGranularity ? unit : (kMinGranularity + unit - 1) / unit * unit;
  book_ = std::make_unique<VaBook>(granularity_);

  if (HipError e = hip_.hipStreamCreateWithFlags(&stream_, kHipStreamNonBlocking); e != kHipSuccess) {
    stream_ = nullptr;
    return Error(e, "hipStreamCreateWithFlags");
  }
  return LoadKernels();
}

absl::Status HipDevice::LoadKernels() {
  HipError e = hip_.hipModuleLoadData(&module_, kBlockKernelsBundle);
  if (e == kHipErrorNoBinaryForGpu || e == kHipErrorInvalidImage) {
    // The memory calls work without the kernels; only the block operations report this.
    module_ = nullptr;
    kernels_status_ = absl::FailedPreconditionError(
        absl::StrCat("hip device ", index_, " (", name_, "): the embedded block kernels (", kBlockKernelsBundleSize,
                     " bytes, built for ", kBlockKernelsBundleArchitectures,
                     ") cannot run on this GPU: ", HipStatus(hip_, e, "hipModuleLoadData").message(),
                     "; rebuild kvd with -DKVD_HIP_ARCHITECTURES set to this GPU's gfx target"));
    return absl::OkStatus();
  }
  if (e != kHipSuccess) {
    module_ = nullptr;
    return Error(e, "hipModuleLoadData");
  }
  const std::array<std::pair<HipFunction*, const char*>, 2> kernels = {{
      {&aligned_, kBlockKernelAligned},
      {&unaligned_, kBlockKernelUnaligned},
  }};
  for (const auto& [function, name] : kernels) {
    if (HipError ge = hip_.hipModuleGetFunction(function, module_, name); ge != kHipSuccess) {
      return Error(ge, absl::StrCat("hipModuleGetFunction(", name, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceInfo> HipDevice::Info() {
  ScopedCurrentDevice current(hip_, index_);
  KVD_RETURN_IF_ERROR(current.status());
  size_t free = 0;
  size_t total = 0;
  if (HipError e = hip_.hipMemGetInfo(&free, &total); e != kHipSuccess) return Error(e, "hipMemGetInfo");
  DeviceInfo info;
  info.backend = BackendKind::kHip;
  info.index = index_;
  info.name = name_;
  info.uuid = uuid_;
  info.driver_version = absl::StrCat("HIP runtime ", FormatHipVersion(runtime_version_), ", driver ", driver_version_);
  info.total_bytes = total;
  info.free_bytes = free;
  info.granularity = granularity_;
  info.fabric_handles = false;  // HIP has no fabric handle type.
  return info;
}

absl::Status HipDevice::CheckPeerAccess(absl::string_view owner_uuid) {
  if (owner_uuid.empty()) return absl::InvalidArgumentError("CheckPeerAccess: owner_uuid is empty");
  if (!uuid_.empty() && absl::EqualsIgnoreCase(owner_uuid, uuid_)) return absl::OkStatus();
  const std::string self = absl::StrCat("CheckPeerAccess: HIP device ", index_, " (", uuid_, ")");
  if (!absl::StartsWithIgnoreCase(owner_uuid, "GPU-")) {
    return absl::FailedPreconditionError(absl::StrCat(self, " cannot import memory of device ", owner_uuid,
                                                      ": it belongs to another backend (HIP UUIDs start with GPU-)"));
  }
  int count = 0;
  if (HipError e = hip_.hipGetDeviceCount(&count); e != kHipSuccess) return Error(e, "hipGetDeviceCount");
  std::vector<std::string> visible;
  for (int i = 0; i < count; ++i) {
    const std::string uuid = DeviceUuid(hip_, i);
    if (uuid.empty() || !absl::EqualsIgnoreCase(owner_uuid, uuid)) {
      visible.push_back(absl::StrCat(i, " ", uuid.empty() ? "(no UUID)" : uuid));
      continue;
    }
    if (i == index_) return absl::OkStatus();
    // Whether this device (the importer) can access memory that lives on device i.
    int can_access = 0;
    if (HipError e = hip_.hipDeviceCanAccessPeer(&can_access, index_, i); e != kHipSuccess) {
      return Error(e, absl::StrCat("hipDeviceCanAccessPeer(", index_, ", ", i, ")"));
    }
    if (can_access == 0) {
      return absl::FailedPreconditionError(absl::StrCat(self, " has no peer access to HIP device ", i, " (", uuid,
                                                        ") that owns the memory (hipDeviceCanAccessPeer = 0)"));
    }
    return absl::OkStatus();
  }
  std::string env;
  for (const char* var : {"ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"}) {
    const char* value = std::getenv(var);
    absl::StrAppend(&env, env.empty() ? " (" : ", ", var,
                    value != nullptr ? absl::StrCat("=\"", value, "\"") : " unset");
  }
  return absl::NotFoundError(absl::StrCat(self, ": the owner ", owner_uuid,
                                          " is not among the HIP devices this process sees (",
                                          absl::StrJoin(visible, ", "),
                                          "); an importer must see both devices: check ROCR_VISIBLE_DEVICES and "
                                          "HIP_VISIBLE_DEVICES",
                                          env, ")"));
}

absl::StatusOr<uint64_t> HipDevice::Reserve(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(book_->CheckSize("Reserve", "bytes", bytes));
  ScopedCurrentDevice current(hip_, index_);
  KVD_RETURN_IF_ERROR(current.status());
  void* ptr = nullptr;
  if (HipError e = hip_.hipMemAddressReserve(&ptr, bytes, granularity_, nullptr, 0); e != kHipSuccess) {
    return Error(e, absl::StrCat("hipMemAddressReserve(", bytes, " bytes)"));
  }
  absl::Cleanup unreserve = [&] { (void)hip_.hipMemAddressFree(ptr, bytes); };
  const uint64_t va = reinterpret_cast<uintptr_t>(ptr);
  KVD_RETURN_IF_ERROR(book_->AddReservation(va, bytes));
  std::move(unreserve).Cancel();
  return va;
}

absl::Status HipDevice::Free(uint64_t va, uint64_t bytes) {
  return book_->Free(va, bytes, [&]() -> absl::Status {
    ScopedCurrentDevice current(hip_, index_);
    KVD_RETURN_IF_ERROR(current.status());
    if (HipError e = hip_.hipMemAddressFree(Ptr(va), bytes); e != kHipSuccess) return Error(e, "hipMemAddressFree");
    return absl::OkStatus();
  });
}

absl::StatusOr<Chunk> HipDevice::Create(uint64_t bytes) {
  KVD_RETURN_IF_ERROR(book_->CheckSize("Create", "bytes", bytes));
  ScopedCurrentDevice current(hip_, index_);
  KVD_RETURN_IF_ERROR(current.status());
  const HipMemAllocationProp prop = AllocationProp(index_);
  HipMemGenericAllocationHandle handle = nullptr;
  const HipError e = hip_.hipMemCreate(&handle, bytes, &prop, 0);
  if (e == kHipErrorOutOfMemory) {
    size_t free = 0;
    size_t total = 0;
    std::string have = "free memory unknown";
    if (hip_.hipMemGetInfo(&free, &total) == kHipSuccess) {
      have = absl::StrCat("the device reports ", free, " of ", total, " bytes free");
    }
    return absl::ResourceExhaustedError(
        absl::StrCat(Error(e, "hipMemCreate").message(), ": asked for ", bytes, " bytes, ", have));
  }
  if (e != kHipSuccess) return Error(e, absl::StrCat("hipMemCreate(", bytes, " bytes)"));
  return Record(Chunk{.handle = reinterpret_cast<uintptr_t>(handle), .bytes = bytes}, ChunkOrigin::kCreated);
}

absl::StatusOr<Chunk> HipDevice::Record(const Chunk& chunk, ChunkOrigin origin) {
  if (absl::Status s = book_->AddChunk(chunk, origin); !s.ok()) {
    // The runtime's reference this call took.
    (void)hip_.hipMemRelease(reinterpret_cast<HipMemGenericAllocationHandle>(chunk.handle));
    return s;
  }
  return chunk;
}

absl::Status HipDevice::Release(const Chunk& chunk) {
  // Runs without the book's locks; the book takes the reference back if the runtime refuses.
  return book_->Release(chunk, [&](ChunkOrigin) -> absl::Status {
    ScopedCurrentDevice current(hip_, index_);
    KVD_RETURN_IF_ERROR(current.status());
    if (HipError e = hip_.hipMemRelease(reinterpret_cast<HipMemGenericAllocationHandle>(chunk.handle));
        e != kHipSuccess) {
      return Error(e, "hipMemRelease");
    }
    return absl::OkStatus();
  });
}

absl::Status HipDevice::Map(uint64_t va, const Chunk& chunk, Access access) {
  return book_->Map(va, chunk, access, [&](const MapSite& site) -> absl::Status {
    // The growth gate; hip_device.h states the exact rule.
    if (site.mappings > 0 && !multi_mapping_supported()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "hip device ", index_, ": Map at ", Hex(va), " refused: the reservation at ", Hex(site.reservation_va),
          " already holds ", site.mappings, " mapping(s), and the detected HIP runtime ",
          FormatHipVersion(runtime_version_),
          " mis-handles hipMemSetAccess over several allocations in one reservation; growing a pool in place needs "
          "HIP runtime >= ",
          HipVersionMajor(kMultiMappingRuntimeVersion), ".", HipVersionMinor(kMultiMappingRuntimeVersion),
          " (upgrade ROCm)"));
    }
    ScopedCurrentDevice current(hip_, index_);
    KVD_RETURN_IF_ERROR(current.status());
    const auto handle = reinterpret_cast<HipMemGenericAllocationHandle>(chunk.handle);
    if (HipError e = hip_.hipMemMap(Ptr(va), chunk.bytes, 0, handle, 0); e != kHipSuccess) {
      return Error(e, "hipMemMap");
    }
    absl::Cleanup unmap = [&] { (void)hip_.hipMemUnmap(Ptr(va), chunk.bytes); };
    // Peer entries (none today) go before the local device's, which must come last: the runtime
    // applies the entries in order and the local device's access is the one that has to hold.
    const std::array<HipMemAccessDesc, 1> desc = {{
        {.location = {.type = kHipMemLocationTypeDevice, .id = index_},
         .flags = access == Access::kRead ? kHipMemAccessFlagsProtRead : kHipMemAccessFlagsProtReadWrite},
    }};
    if (HipError e = hip_.hipMemSetAccess(Ptr(va), chunk.bytes, desc.data(), desc.size()); e != kHipSuccess) {
      return Error(e, "hipMemSetAccess");
    }
    std::move(unmap).Cancel();
    return absl::OkStatus();
  });
}

absl::Status HipDevice::Unmap(uint64_t va, uint64_t bytes) {
  // One call per mapping, as the runtime tracks them (hipMemUnmap cannot split an allocation); the
  // book forgets each mapping once its call succeeded.
  return book_->Unmap(va, bytes, [&](uint64_t mapping, uint64_t mapping_bytes) -> absl::Status {
    ScopedCurrentDevice current(hip_, index_);
    KVD_RETURN_IF_ERROR(current.status());
    if (HipError e = hip_.hipMemUnmap(Ptr(mapping), mapping_bytes); e != kHipSuccess) {
      return Error(e, absl::StrCat("hipMemUnmap(", Hex(mapping), ")"));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<int> HipDevice::Export(const Chunk& chunk) {
  UniqueFd fd;
  // The book keeps a concurrent Release of this chunk out.
  KVD_RETURN_IF_ERROR(book_->WithLiveChunk("Export", chunk, [&]() -> absl::Status {
    ScopedCurrentDevice current(hip_, index_);
    KVD_RETURN_IF_ERROR(current.status());
    int raw = -1;
    if (HipError e =
            hip_.hipMemExportToShareableHandle(&raw, reinterpret_cast<HipMemGenericAllocationHandle>(chunk.handle),
                                               kHipMemHandleTypePosixFileDescriptor, 0);
        e != kHipSuccess) {
      return Error(e, "hipMemExportToShareableHandle");
    }
    fd.reset(raw);
    if (!fd) {
      return absl::InternalError(
          absl::StrCat("hip device ", index_, ": hipMemExportToShareableHandle succeeded but returned fd ", raw));
    }
    return absl::OkStatus();
  }));
  return fd.release();
}

absl::StatusOr<Chunk> HipDevice::Import(int fd, uint64_t bytes) {
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("hip device ", index_, ": Import: fd ", fd, " is invalid"));
  }
  KVD_RETURN_IF_ERROR(book_->CheckSize("Import", "bytes", bytes));
  // The runtime takes the FD as a pointer-sized value and rejects a null one, so FD 0 travels as a
  // duplicate; the duplicate is closed once imported, like every FD the caller hands us stays theirs.
  int os_fd = fd;
  UniqueFd duplicate;
  if (fd == 0) {
    duplicate.reset(fcntl(fd, F_DUPFD_CLOEXEC, 1));
    if (!duplicate)
      return ErrnoStatus(errno, absl::StrCat("hip device ", index_, ": Import: fcntl(F_DUPFD_CLOEXEC, fd 0)"));
    os_fd = duplicate.get();
  }

  ScopedCurrentDevice current(hip_, index_);
  KVD_RETURN_IF_ERROR(current.status());
  HipMemGenericAllocationHandle handle = nullptr;
  if (HipError e = hip_.hipMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(os_fd)),
                                                        kHipMemHandleTypePosixFileDescriptor);
      e != kHipSuccess) {
    return Error(e, "hipMemImportFromShareableHandle");
  }
  return Record(Chunk{.handle = reinterpret_cast<uintptr_t>(handle), .bytes = bytes}, ChunkOrigin::kImported);
}

absl::Status HipDevice::RegisterHost(void* host, uint64_t bytes) {
  KVD_RETURN_IF_ERROR(Device::RegisterHost(host, bytes));
  ScopedCurrentDevice current(hip_, index_);
  KVD_RETURN_IF_ERROR(current.status());
  constexpr unsigned int kHipHostRegisterPortable = 0x1;
  if (HipError e = hip_.hipHostRegister(host, bytes, kHipHostRegisterPortable); e != kHipSuccess) {
    return Error(e, "hipHostRegister");
  }
  return absl::OkStatus();
}

absl::Status HipDevice::UnregisterHost(void* host) {
  KVD_RETURN_IF_ERROR(Device::UnregisterHost(host));
  ScopedCurrentDevice current(hip_, index_);
  KVD_RETURN_IF_ERROR(current.status());
  if (HipError e = hip_.hipHostUnregister(host); e != kHipSuccess) return Error(e, "hipHostUnregister");
  return absl::OkStatus();
}

int HipDevice::NumaNode() const {
  char bus_id[32] = {};
  if (hip_.hipDeviceGetPCIBusId(bus_id, sizeof(bus_id), index_) != kHipSuccess) return -1;
  return PciNumaNode(bus_id);
}

absl::Status HipDevice::CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("hip device ", index_, ": CopyToHost: dst is null"));
  }
  return book_->UseRange("CopyToHost", src_va, bytes, /*write=*/false, [&]() -> absl::Status {
    ScopedCurrentDevice current(hip_, index_);
    KVD_RETURN_IF_ERROR(current.status());
    if (HipError e = hip_.hipMemcpyDtoH(dst, Ptr(src_va), bytes); e != kHipSuccess) return Error(e, "hipMemcpyDtoH");
    return absl::OkStatus();
  });
}

absl::Status HipDevice::CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("hip device ", index_, ": CopyFromHost: src is null"));
  }
  return book_->UseRange("CopyFromHost", dst_va, bytes, /*write=*/true, [&]() -> absl::Status {
    ScopedCurrentDevice current(hip_, index_);
    KVD_RETURN_IF_ERROR(current.status());
    // hipMemcpyHtoD's source is `void*` in older headers; the runtime only reads it.
    if (HipError e = hip_.hipMemcpyHtoD(Ptr(dst_va), const_cast<void*>(src), bytes); e != kHipSuccess) {
      return Error(e, "hipMemcpyHtoD");
    }
    // As on CUDA, a copy from pageable memory may return before the DMA lands: wait for it before the
    // book lets an Unmap of the range proceed.
    if (HipError e = hip_.hipStreamSynchronize(nullptr); e != kHipSuccess) {
      return Error(e, "hipStreamSynchronize after hipMemcpyHtoD");
    }
    return absl::OkStatus();
  });
}

absl::Status HipDevice::CopyRange(uint64_t dst_va, uint64_t src_va, uint64_t bytes) {
  return book_->UseCopy("CopyRange", dst_va, src_va, bytes, [&]() -> absl::Status {
    ScopedCurrentDevice current(hip_, index_);
    KVD_RETURN_IF_ERROR(current.status());
    if (HipError e = hip_.hipMemcpyDtoD(Ptr(dst_va), Ptr(src_va), bytes); e != kHipSuccess) {
      return Error(e, "hipMemcpyDtoD");
    }
    // Device-to-device copies may return before they finish: wait before the book lets an Unmap through.
    if (HipError e = hip_.hipStreamSynchronize(nullptr); e != kHipSuccess) {
      return Error(e, "hipStreamSynchronize after hipMemcpyDtoD");
    }
    return absl::OkStatus();
  });
}

absl::Status HipDevice::RunBlocks(const char* call, BlockOp op, const BlockSpan& span, const uint64_t* ids,
                                  uint64_t id_words, uint64_t items, uint64_t packed) {
  if (items == 0 || span.segments == 0 || span.block_bytes == 0) return absl::OkStatus();
  KVD_RETURN_IF_ERROR(kernels_status_);
  uint64_t runs = 0;
  if (__builtin_mul_overflow(items, span.segments, &runs)) {
    return absl::InvalidArgumentError(absl::StrCat("hip device ", index_, ": ", call, ": ", items, " blocks x ",
                                                   span.segments, " segments overflows"));
  }
  const bool packs = op == BlockOp::kPack || op == BlockOp::kUnpack;

  absl::StatusOr<BlockLaunch> launch = PlanBlockLaunch(call, op, span, runs, packed);
  if (!launch.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("hip device ", index_, ": ", launch.status().message()));
  }
  const bool aligned = launch->aligned;
  const BlockRunParams params = launch->params;

  // The book holds off a concurrent Unmap until the kernel is done.
  return book_->UseBlocks(call, span, /*span_write=*/op != BlockOp::kPack, packed, packs ? items : 0,
                          /*packed_write=*/op == BlockOp::kPack, [&]() -> absl::Status {
                            absl::MutexLock lock(&kernel_mu_);
                            return LaunchLocked(aligned ? aligned_ : unaligned_,
                                                aligned ? kBlockKernelAligned : kBlockKernelUnaligned, call, params,
                                                absl::MakeConstSpan(ids, id_words));
                          });
}

absl::Status HipDevice::LaunchLocked(HipFunction kernel, const char* kernel_name, const char* call,
                                     BlockRunParams params, absl::Span<const uint64_t> words) {
  ScopedCurrentDevice current(hip_, index_);
  KVD_RETURN_IF_ERROR(current.status());

  const uint64_t staged = words.size() * sizeof(uint64_t);
  if (scratch_bytes_ < staged) {
    if (scratch_ != nullptr) (void)hip_.hipFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    uint64_t capacity = kMinScratchBytes;
    while (capacity < staged) capacity *= 2;
    if (HipError e = hip_.hipMalloc(&scratch_, capacity); e != kHipSuccess) {
      scratch_ = nullptr;
      return Error(e, absl::StrCat("hipMalloc(", capacity, " bytes of block ids)"));
    }
    scratch_bytes_ = capacity;
  }
  // The host words outlive the copy: this call synchronises the stream before returning, on every path.
  absl::Cleanup drain = [this] { (void)hip_.hipStreamSynchronize(stream_); };
  if (HipError e = hip_.hipMemcpyHtoDAsync(scratch_, const_cast<uint64_t*>(words.data()), staged, stream_);
      e != kHipSuccess) {
    return Error(e, "hipMemcpyHtoDAsync");
  }
  params.ids = reinterpret_cast<uintptr_t>(scratch_);
  size_t params_size = sizeof(params);
  std::array<void*, 5> extra = {HipLaunchParamBufferPointer(), &params, HipLaunchParamBufferSize(), &params_size,
                                HipLaunchParamEnd()};
  const auto grid = static_cast<unsigned int>(std::min(params.total_tiles, kMaxGrid));
  if (HipError e =
          hip_.hipModuleLaunchKernel(kernel, grid, 1, 1, kBlockKernelThreads, 1, 1, 0, stream_, nullptr, extra.data());
      e != kHipSuccess) {
    return Error(e, absl::StrCat("hipModuleLaunchKernel(", kernel_name, ", ", call, ")"));
  }
  std::move(drain).Cancel();
  if (HipError e = hip_.hipStreamSynchronize(stream_); e != kHipSuccess) {
    return Error(e, absl::StrCat("hipStreamSynchronize(", kernel_name, ", ", call, ")"));
  }
  return absl::OkStatus();
}

absl::Status HipDevice::ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  return RunBlocks("ZeroBlocks", BlockOp::kZero, span, blocks.data(), blocks.size(), blocks.size(), 0);
}

absl::Status HipDevice::CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) {
  KVD_RETURN_IF_ERROR(ValidateCopies(span, copies));
  // The kernel reads the pairs as uint64 words: src, dst.
  std::vector<uint64_t> words;
  words.reserve(2 * copies.size());
  for (const BlockCopy& c : copies) {
    words.push_back(c.src);
    words.push_back(c.dst);
  }
  return RunBlocks("CopyBlocks", BlockOp::kCopy, span, words.data(), words.size(), copies.size(), 0);
}

absl::Status HipDevice::PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks, uint64_t dst) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  return RunBlocks("PackBlocks", BlockOp::kPack, span, blocks.data(), blocks.size(), blocks.size(), dst);
}

absl::Status HipDevice::UnpackBlocks(const BlockSpan& span, uint64_t src, absl::Span<const uint64_t> blocks) {
  KVD_RETURN_IF_ERROR(ValidateBlocks(span, blocks));
  return RunBlocks("UnpackBlocks", BlockOp::kUnpack, span, blocks.data(), blocks.size(), blocks.size(), src);
}

}  // namespace kvd::hip

namespace kvd {

absl::StatusOr<std::unique_ptr<Device>> OpenHipDevice(int index) {
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<hip::HipDevice> device, hip::HipDevice::Open(index));
  return std::unique_ptr<Device>(std::move(device));
}

absl::StatusOr<std::vector<DeviceInfo>> ListHipDevices() { return hip::ListVisibleDevices(); }

DeviceCapabilities hip::HipDevice::Capabilities() const {
  DeviceCapabilities caps;
  caps.posix_fd = {true, "hipMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR), once per chunk"};
  caps.fabric = {false, "HIP has no fabric handle type"};
  caps.dma_buf = {false,
                  "UNIMPLEMENTED: kvd's HIP backend does not export ranges yet (hipMemGetHandleForAddressRange is "
                  "not in its runtime table)"};
  caps.gpu_direct_rdma = {false, "not probed on HIP"};
  return caps;
}

}  // namespace kvd
