#include "kvd/device.h"

#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "backends.h"

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
