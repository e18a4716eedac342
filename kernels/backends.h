// The backends' factories, private to kernels/: OpenDevice (device.cc) dispatches to them.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kvd/device.h"

namespace kvd {

[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> OpenHostDevice(const DeviceOptions& options);
#ifdef KVD_WITH_CUDA
[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int index);
#endif
#ifdef KVD_WITH_HIP
[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> OpenHipDevice(int index);
#endif

}  // namespace kvd
