#include "kvd/device.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "backends.h"
#include "kvd/status.h"

namespace kvd {

const char* BackendName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kHost:
      return "host";
    case BackendKind::kCuda:
      return "cuda";
    case BackendKind::kHip:
      return "hip";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const DeviceOptions& options) {
  const std::string& b = options.backend;
  if (b == "host") return OpenHostDevice(options);
  if (b == "cuda" || b == "auto") {
#ifdef KVD_WITH_CUDA
    absl::StatusOr<std::unique_ptr<Device>> cuda = OpenCudaDevice(options.index);
    // auto falls back to host only when there is no driver or device, not on a real failure.
    if (b == "cuda" || cuda.ok() || !absl::IsUnavailable(cuda.status())) return cuda;
#else
    if (b == "cuda") return absl::UnimplementedError("backend cuda: this kvd was built without CUDA support");
#endif
    return OpenHostDevice(options);
  }
  if (b == "hip") {
#ifdef KVD_WITH_HIP
    return OpenHipDevice(options.index);
#else
    return absl::UnimplementedError("backend hip: this kvd was built without HIP support");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("backend: unknown backend \"", b, "\" (accepted: auto, host, cuda, hip)"));
}

namespace {

// "CUDA", "HIP", "host": as operators name the backends in prose.
const char* Vendor(BackendKind kind) {
  switch (kind) {
    case BackendKind::kCuda:
      return "CUDA";
    case BackendKind::kHip:
      return "HIP";
    case BackendKind::kHost:
      return "host";
  }
  return "unknown";
}

// Which devices a GPU runtime lets this process see, when an environment variable narrows them.
std::string VisibilityNote(BackendKind kind) {
  std::vector<const char*> vars;
  if (kind == BackendKind::kCuda) vars = {"CUDA_VISIBLE_DEVICES"};
  if (kind == BackendKind::kHip) vars = {"ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"};
  std::string note;
  for (const char* var : vars) {
    if (const char* value = std::getenv(var); value != nullptr) absl::StrAppend(&note, "; ", var, "=", value);
  }
  if (!note.empty()) absl::StrAppend(&note, " limits which devices this process sees");
  return note;
}

// "0 GPU-…, 1 GPU-…".
std::string Listing(const std::vector<DeviceInfo>& devices) {
  return absl::StrJoin(devices, ", ",
                       [](std::string* out, const DeviceInfo& d) { absl::StrAppend(out, d.index, " ", d.uuid); });
}

// Host devices are "host-<boot id>-<N>" for every N: there is no list to match prefixes against.
absl::StatusOr<int> ResolveHostSelector(absl::string_view selector) {
  const std::string family = absl::StrCat("host-", HostBootId(), "-");
  for (const std::string& candidate : {std::string(selector), absl::StrCat("host-", selector)}) {
    if (std::optional<int> index = ParseHostDeviceUuid(candidate)) return *index;
    // Short of the index, a prefix matches every host device.
    if (absl::StartsWithIgnoreCase(family, candidate)) {
      return absl::InvalidArgumentError(absl::StrCat("device ", selector, ": ambiguous, every host device's UUID (",
                                                     family, "0, ", family,
                                                     "1, ...) starts with it; add the index: ", family, "<N>"));
    }
  }
  return absl::NotFoundError(absl::StrCat("device ", selector, ": no host device has this UUID; host devices are ",
                                          family, "<N> for any index N"));
}

}  // namespace

absl::StatusOr<std::vector<DeviceInfo>> ListDevices(const DeviceOptions& options) {
  const std::string& b = options.backend;
  if (b == "host") {
    DeviceOptions host = options;
    host.index = 0;
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, OpenHostDevice(host));
    KVD_ASSIGN_OR_RETURN(DeviceInfo info, device->Info());
    return std::vector<DeviceInfo>{info};
  }
  if (b == "cuda" || b == "auto") {
#ifdef KVD_WITH_CUDA
    absl::StatusOr<std::vector<DeviceInfo>> cuda = ListCudaDevices();
    // As OpenDevice: auto falls back to host only when there is no driver or device.
    if (b == "cuda" || cuda.ok() || !absl::IsUnavailable(cuda.status())) return cuda;
#else
    if (b == "cuda") return absl::UnimplementedError("backend cuda: this kvd was built without CUDA support");
#endif
    DeviceOptions host = options;
    host.backend = "host";
    return ListDevices(host);
  }
  if (b == "hip") {
#ifdef KVD_WITH_HIP
    return ListHipDevices();
#else
    return absl::UnimplementedError("backend hip: this kvd was built without HIP support");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("backend: unknown backend \"", b, "\" (accepted: auto, host, cuda, hip)"));
}

absl::StatusOr<int> ResolveDeviceSelector(const DeviceOptions& options, absl::string_view selector) {
  if (selector.empty()) {
    return absl::InvalidArgumentError("device \"\": empty; give an index (0, 1, ...) or a device UUID (prefix)");
  }
  KVD_ASSIGN_OR_RETURN(std::vector<DeviceInfo> devices, ListDevices(options));
  const BackendKind kind = devices.empty() ? BackendKind::kHost : devices.front().backend;

  if (std::all_of(selector.begin(), selector.end(), absl::ascii_isdigit)) {
    int index = 0;
    if (!absl::SimpleAtoi(selector, &index)) {
      return absl::InvalidArgumentError(absl::StrCat("device ", selector, ": not a device index"));
    }
    if (kind == BackendKind::kHost) return index;
    if (std::none_of(devices.begin(), devices.end(), [&](const DeviceInfo& d) { return d.index == index; })) {
      return absl::NotFoundError(absl::StrCat("device ", selector, ": this node has ", devices.size(), " ",
                                              Vendor(kind), " device", devices.size() == 1 ? "" : "s", " (",
                                              Listing(devices), ")", VisibilityNote(kind)));
    }
    return index;
  }
  if (kind == BackendKind::kHost) return ResolveHostSelector(selector);

  // A UUID or a prefix of one, with or without the "GPU-" every GPU UUID starts with.
  const auto matches = [&](const DeviceInfo& d, bool exact) {
    absl::string_view uuid = d.uuid;
    for (int pass = 0; pass < 2; ++pass) {
      if (exact ? absl::EqualsIgnoreCase(uuid, selector) : absl::StartsWithIgnoreCase(uuid, selector)) return true;
      if (!absl::ConsumePrefix(&uuid, "GPU-")) break;
    }
    return false;
  };
  for (const DeviceInfo& d : devices) {
    if (matches(d, /*exact=*/true)) return d.index;
  }
  std::vector<DeviceInfo> found;
  for (const DeviceInfo& d : devices) {
    if (matches(d, /*exact=*/false)) found.push_back(d);
  }
  if (found.size() == 1) return found.front().index;
  if (found.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "device ", selector, ": no ", Vendor(kind),
        " device visible to this process has this UUID (visible: ", Listing(devices), ")", VisibilityNote(kind)));
  }
  return absl::InvalidArgumentError(absl::StrCat("device ", selector, ": ambiguous, it starts the UUIDs of ",
                                                 Listing(found), "; give more of the UUID"));
}

DeviceCapabilities Device::Capabilities() const {
  DeviceCapabilities caps;
  caps.posix_fd = {true, "chunks export to FDs (Export)"};
  caps.fabric = {false, "this backend has no fabric handles"};
  caps.dma_buf = {false, "UNIMPLEMENTED: this backend has no range export"};
  caps.gpu_direct_rdma = {false, "this backend has no GPUDirect RDMA"};
  return caps;
}

absl::StatusOr<int> Device::ExportRange(uint64_t va, uint64_t bytes) {
  return absl::UnimplementedError(absl::StrCat("ExportRange(", bytes, " bytes at 0x", absl::Hex(va), "): the ",
                                               BackendName(kind()), " backend has no range export"));
}

absl::StatusOr<std::string> Device::ExportFabricHandle(const Chunk& chunk) {
  return absl::UnimplementedError(absl::StrCat("ExportFabricHandle(chunk of ", chunk.bytes, " bytes): the ",
                                               BackendName(kind()), " backend has no fabric handles"));
}

absl::Status Device::RegisterHost(void* host, uint64_t bytes) {
  if (host == nullptr || bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterHost(", bytes, " bytes): a null or empty range"));
  }
  return absl::OkStatus();  // host memory needs no registration with a host backend
}

absl::Status Device::UnregisterHost(void* host) {
  if (host == nullptr) return absl::InvalidArgumentError("UnregisterHost: host is null");
  return absl::OkStatus();
}

int Device::NumaNode() const { return -1; }

int PciNumaNode(absl::string_view bus_id) {
  std::ifstream in(absl::StrCat("/sys/bus/pci/devices/", absl::AsciiStrToLower(bus_id), "/numa_node"));
  int node = -1;
  if (!(in >> node)) return -1;
  return node < 0 ? -1 : node;
}

absl::Status ValidateBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] >= span.blocks) {
      return absl::InvalidArgumentError(absl::StrCat("block_ids[", i, "]: block ", blocks[i],
                                                     " is not committed (committed blocks: ", span.blocks, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateCopies(const BlockSpan& span, absl::Span<const BlockCopy> copies) {
  std::unordered_set<uint64_t> dsts;
  for (size_t i = 0; i < copies.size(); ++i) {
    for (uint64_t id : {copies[i].src, copies[i].dst}) {
      if (id >= span.blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("copies[", i, "]: block ", id, " is not committed (committed blocks: ", span.blocks, ")"));
      }
    }
    if (!dsts.insert(copies[i].dst).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("copies[", i, "].dst: block ", copies[i].dst, " is written twice"));
    }
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    if (dsts.contains(copies[i].src)) {
      return absl::InvalidArgumentError(
          absl::StrCat("copies[", i, "].src: block ", copies[i].src, " is also a destination of this call"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvd
