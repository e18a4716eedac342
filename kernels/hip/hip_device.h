// The hip backend (docs/backends.md, "hip"): kvd::Device over HIP's virtual memory management calls
// (hipMemAddressReserve / hipMemCreate / hipMemMap / hipMemSetAccess / hipMemExportToShareableHandle
// / hipMemImportFromShareableHandle), with the block kernels of ../block_kernels.cuh (shared with CUDA). The runtime is
// loaded at run time through hip_runtime_table.h; nothing links libamdhip64.
//
// Opening. OpenHipDevice(index) (backends.h) returns UNAVAILABLE when no libamdhip64 can be loaded,
// when it lacks the VMM entry points, or when the runtime finds no device / no device `index`;
// FAILED_PRECONDITION when the runtime is older than 5.5 (its hipMemAllocationProp has another
// layout, see hip_abi.h) or the device does not support virtual memory management;
// INVALID_ARGUMENT for a negative index.
//
// ROCm traps handled here.
//  * Granularity. ROCm has reported a 4 KiB allocation granularity (newer runtimes force 2 MiB).
//    granularity() is max(reported, 2 MiB) (2 MiB rounded up to a multiple of the reported value),
//    so every chunk and every mapping is at least 2 MiB, as on CUDA: page-table and handle cost is
//    per mapping.
//  * Growth on old runtimes. HIP runtimes before 7.12 mis-handle hipMemSetAccess when a reservation
//    holds several allocations. The rule, exactly: on a runtime whose hipRuntimeGetVersion is below
//    7.12 (HIP_VERSION 71200000), Map() returns FAILED_PRECONDITION, naming the detected and the
//    required version, when the reservation containing `va` (the range returned by one Reserve() of
//    this Device) already holds a mapping made by this Device. A first mapping into a reservation
//    that holds none is allowed, and unmapping every chunk of a reservation makes it empty again, so
//    sleep/wake of a single-mapping reservation works. Pools therefore cannot grow in place there.
//  * Access order. hipMemSetAccess gets the peer entries first and the local device's entry last,
//    so that the local device's access is the one the runtime applies last.
//  * Current device. HIP's calls act on the calling thread's current device. Every method makes
//    this device current for the duration of the call and restores the caller's previous device,
//    so an engine thread that shares the process keeps its own device.
//
// Checks. Misuse is an error with device.h's contract codes ("Misuse"), never a GPU fault: the
// device's VaBook (va_book.h) tracks its reservations, mappings and chunk handles and checks every
// call (Map, Unmap, Free, Release, Export, copies and block operations) before the runtime sees it.
// hipMemUnmap is called once per mapping.
//
// Block operations run on one non-blocking stream of this device, one call at a time, and return
// after hipStreamSynchronize. If the embedded kernels have no code object for this GPU, the memory
// calls still work and the block operations return FAILED_PRECONDITION naming the built targets.
//
// Destruction releases the chunk handles the caller never released (mappings keep their memory).
//
// Threads. Every method is safe to call concurrently. The book serialises Free/Map/Unmap around their
// runtime calls and holds them off while copies and block operations touch memory (va_book.h); block
// operations also serialise on kernel_mu_.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "block_kernels.h"
#include "hip_abi.h"
#include "hip_runtime_table.h"
#include "kvd/device.h"
#include "va_book.h"

namespace kvd::hip {

// The runtime that first handles SetAccess over several allocations of one reservation.
inline constexpr int kMultiMappingRuntimeVersion = HipVersion(7, 12);
// Every chunk and mapping is at least this large, whatever the runtime reports.
inline constexpr uint64_t kMinGranularity = uint64_t{2} << 20;

// Every HIP device this process sees, without making any current (device.h, ListDevices).
[[nodiscard]] absl::StatusOr<std::vector<DeviceInfo>> ListVisibleDevices();

class HipDevice final : public Device {
 public:
  // See the file comment for the errors.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HipDevice>> Open(int index);
  ~HipDevice() override;

  HipDevice(const HipDevice&) = delete;
  HipDevice& operator=(const HipDevice&) = delete;

  BackendKind kind() const override { return BackendKind::kHip; }
  uint64_t granularity() const override { return granularity_; }
  // hipRuntimeGetVersion, HIP_VERSION-encoded.
  int runtime_version() const { return runtime_version_; }
  bool multi_mapping_supported() const { return runtime_version_ >= kMultiMappingRuntimeVersion; }

  [[nodiscard]] absl::StatusOr<DeviceInfo> Info() override;

  [[nodiscard]] absl::StatusOr<uint64_t> Reserve(uint64_t bytes) override;
  [[nodiscard]] absl::Status Free(uint64_t va, uint64_t bytes) override;

  [[nodiscard]] absl::StatusOr<Chunk> Create(uint64_t bytes) override;
  [[nodiscard]] absl::Status Release(const Chunk& chunk) override;

  [[nodiscard]] absl::Status Map(uint64_t va, const Chunk& chunk, Access access) override;
  [[nodiscard]] absl::Status Unmap(uint64_t va, uint64_t bytes) override;

  [[nodiscard]] absl::StatusOr<int> Export(const Chunk& chunk) override;
  [[nodiscard]] absl::StatusOr<Chunk> Import(int fd, uint64_t bytes) override;

  [[nodiscard]] absl::Status CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) override;
  [[nodiscard]] absl::Status CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) override;
  [[nodiscard]] absl::Status CopyRange(uint64_t dst_va, uint64_t src_va, uint64_t bytes) override;

  [[nodiscard]] absl::Status ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) override;
  [[nodiscard]] absl::Status CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) override;
  [[nodiscard]] absl::Status PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks,
                                        uint64_t dst) override;
  [[nodiscard]] absl::Status UnpackBlocks(const BlockSpan& span, uint64_t src,
                                          absl::Span<const uint64_t> blocks) override;

  // The owner is this device (by UUID), or a HIP device of this process for which
  // hipDeviceCanAccessPeer(this device, owner) is 1; Map's hipMemSetAccess for this device is then the
  // grant. NOT_FOUND (naming ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES) when no visible device has the
  // UUID; FAILED_PRECONDITION for a non-HIP UUID or a pair without peer access.
  [[nodiscard]] absl::Status CheckPeerAccess(absl::string_view owner_uuid) override;
  DeviceCapabilities Capabilities() const override;
  // hipHostRegister(Portable) / hipHostUnregister; NumaNode from hipDeviceGetPCIBusId and sysfs.
  [[nodiscard]] absl::Status RegisterHost(void* host, uint64_t bytes) override;
  [[nodiscard]] absl::Status UnregisterHost(void* host) override;
  int NumaNode() const override;

 private:
  HipDevice(const HipRuntimeTable& hip, int index, int runtime_version, int driver_version);

  // Name, UUID, granularity, stream and kernels; called once by Open().
  [[nodiscard]] absl::Status Init();
  [[nodiscard]] absl::Status LoadKernels();
  // `call` failed with `error`: the translated status, prefixed with this device.
  [[nodiscard]] absl::Status Error(HipError error, absl::string_view call) const;
  // Records a chunk the runtime just handed out (one more reference), or releases it again if the
  // book refuses it.
  [[nodiscard]] absl::StatusOr<Chunk> Record(const Chunk& chunk, ChunkOrigin origin);
  // One block operation (Note [Block runs] in block_kernels.h): `ids` holds `id_words` uint64 words for
  // `items` items; `packed` is the packed buffer of pack/unpack (else 0). The book checks the memory.
  [[nodiscard]] absl::Status RunBlocks(const char* call, BlockOp op, const BlockSpan& span, const uint64_t* ids,
                                       uint64_t id_words, uint64_t items, uint64_t packed);
  // Stages `words` in device memory, launches `kernel` with `params` on stream_ and waits for it.
  [[nodiscard]] absl::Status LaunchLocked(HipFunction kernel, const char* kernel_name, const char* call,
                                          BlockRunParams params, absl::Span<const uint64_t> words)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(kernel_mu_);

  const HipRuntimeTable& hip_;
  const int index_;
  const int runtime_version_;
  const int driver_version_;
  HipDeviceHandle device_ = 0;
  uint64_t granularity_ = 0;
  std::string name_;
  std::string uuid_;

  // Reservations, mappings and live chunk handles, and every misuse check of the contract. Made by
  // Init() once the granularity is known; its locks come before kernel_mu_.
  std::unique_ptr<VaBook> book_;

  absl::Mutex kernel_mu_;
  HipStream stream_ = nullptr;  // created in Init, before any other thread sees the device; then only read
  HipModule module_ = nullptr;
  // Why the block kernels cannot run here (no code object for this GPU); OK when they can.
  absl::Status kernels_status_;
  HipFunction aligned_ = nullptr;
  HipFunction unaligned_ = nullptr;
  void* scratch_ ABSL_GUARDED_BY(kernel_mu_) = nullptr;  // device memory for staged block ids
  uint64_t scratch_bytes_ ABSL_GUARDED_BY(kernel_mu_) = 0;
};

}  // namespace kvd::hip
