// The backends' factories, private to kernels/: OpenDevice (device.cc) dispatches to them.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvd/device.h"

namespace kvd {

[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> OpenHostDevice(const DeviceOptions& options);
// What follows "host-" in every host device's UUID ("host-<boot id>-<index>"): the kernel's boot id,
// else the host name; read once.
const std::string& HostBootId();
// N for "host-<HostBootId()>-<N>" (case-insensitive), else nullopt.
std::optional<int> ParseHostDeviceUuid(absl::string_view uuid);

// The devices the driver enumerates, without creating a context (device.h, ListDevices); UNAVAILABLE
// when there is no driver or no device, as the Open functions.
#ifdef KVD_WITH_CUDA
[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int index);
[[nodiscard]] absl::StatusOr<std::vector<DeviceInfo>> ListCudaDevices();
#endif
#ifdef KVD_WITH_HIP
[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> OpenHipDevice(int index);
[[nodiscard]] absl::StatusOr<std::vector<DeviceInfo>> ListHipDevices();
#endif

}  // namespace kvd
