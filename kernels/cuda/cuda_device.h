// The CUDA backend (docs/backends.md, "cuda"): device memory through CUDA virtual memory management, with
// the driver API loaded at run time (cuda_driver.h), so nothing here links libcuda:
//
//   Reserve  cuMemAddressReserve (aligned to the granularity); Free: cuMemAddressFree.
//   Create   cuMemCreate, pinned device memory exportable as a POSIX FD, and also as a fabric handle
//            where the device supports it (probed once at open); Release: cuMemRelease.
//   Map      cuMemMap + cuMemSetAccess for this device's own ordinal (the mapping is undone if
//            SetAccess fails), also for chunks imported from another GPU: that access descriptor is
//            the peer-access grant (CheckPeerAccess says whether the pair supports it); Unmap: cuMemUnmap.
//   Export   cuMemExportToShareableHandle(POSIX FD); Import: cuMemImportFromShareableHandle.
//   Blocks   the kernels of block_kernels.cu, embedded as a fatbin, on a stream this device owns;
//            each operation waits for its kernel before returning.
//
// Context. The device retains the primary context of its GPU (released by the destructor) and makes
// it current on the calling thread in every public method, so any thread may call any method, and
// code of the same process that uses the runtime API (which also uses the primary context) sees the
// same memory.
//
// Checks. Misuse is an error with device.h's contract codes ("Misuse"), never a GPU fault (which
// would poison the context for the whole process): the device's VaBook (va_book.h) tracks its
// reservations, mappings and chunk handles and checks every call before the driver sees it.
//
// Threads. Every method is safe to call concurrently. The book serialises Free/Map/Unmap around their
// driver calls and holds them off while copies and block operations touch memory (va_book.h); Create
// and Import call the driver without its locks. Block operations also serialise on the stream.
//
// Errors. CUresults become absl::Status through CudaStatus (cuda_driver.h), keeping the call and the
// raw CUresult name and number. If the embedded kernels cannot be loaded (e.g. a driver older than
// the toolkit that built them and a GPU without matching SASS), the device still opens and manages
// memory; the block operations then return that load error.
#pragma once

#include <cuda.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "block_kernels.h"
#include "cuda/cuda_driver.h"
#include "kvd/device.h"
#include "va_book.h"

namespace kvd {

// A fabric handle (CU_MEM_HANDLE_TYPE_FABRIC): 64 opaque bytes that may travel in any message (a
// gRPC reply, say); it can be imported on any node of the same NVLink/IMEX domain.
struct FabricHandle {
  std::array<uint8_t, 64> bytes{};
};

class CudaDevice final : public Device {
 public:
  // Opens CUDA device `index` (an ordinal as the driver enumerates it, after CUDA_VISIBLE_DEVICES).
  // UNAVAILABLE ("no CUDA driver" / "no CUDA device") when libcuda.so.1 is missing or cuInit finds no
  // device; INVALID_ARGUMENT when `index` is not one of the devices present.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CudaDevice>> Open(int index);

  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;
  // Releases the chunk handles the caller never released (mappings keep their memory), the stream,
  // the kernels' module and the primary context. Reservations and mappings are left to the caller.
  ~CudaDevice() override;

  BackendKind kind() const override { return BackendKind::kCuda; }
  uint64_t granularity() const override { return granularity_; }
  // Name, "GPU-…" UUID, driver version ("13.0") and cuMemGetInfo's total and free bytes.
  [[nodiscard]] absl::StatusOr<DeviceInfo> Info() override;

  [[nodiscard]] absl::StatusOr<uint64_t> Reserve(uint64_t bytes) override;
  // `va` and `bytes` must be exactly a live reservation (INVALID_ARGUMENT) with no mappings left
  // (FAILED_PRECONDITION).
  [[nodiscard]] absl::Status Free(uint64_t va, uint64_t bytes) override;

  // RESOURCE_EXHAUSTED naming the bytes asked and the bytes free when the GPU is out of memory.
  [[nodiscard]] absl::StatusOr<Chunk> Create(uint64_t bytes) override;
  [[nodiscard]] absl::Status Release(const Chunk& chunk) override;

  // INVALID_ARGUMENT unless [va, va + chunk.bytes) lies inside a live reservation of this device;
  // FAILED_PRECONDITION if part of it is already mapped.
  [[nodiscard]] absl::Status Map(uint64_t va, const Chunk& chunk, Access access) override;
  // Every mapping the range touches must lie entirely inside it (INVALID_ARGUMENT otherwise); unmapped
  // parts are left as they are.
  [[nodiscard]] absl::Status Unmap(uint64_t va, uint64_t bytes) override;

  [[nodiscard]] absl::StatusOr<int> Export(const Chunk& chunk) override;
  [[nodiscard]] absl::StatusOr<Chunk> Import(int fd, uint64_t bytes) override;

  // Synchronous cuMemcpyDtoH / cuMemcpyHtoD over memory this device has mapped.
  [[nodiscard]] absl::Status CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) override;
  [[nodiscard]] absl::Status CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) override;
  [[nodiscard]] absl::Status CopyRange(uint64_t dst_va, uint64_t src_va, uint64_t bytes) override;

  [[nodiscard]] absl::Status ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) override;
  [[nodiscard]] absl::Status CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) override;
  [[nodiscard]] absl::Status PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks,
                                        uint64_t dst) override;
  [[nodiscard]] absl::Status UnpackBlocks(const BlockSpan& span, uint64_t src,
                                          absl::Span<const uint64_t> blocks) override;

  // cuMemHostRegister(PORTABLE) / cuMemHostUnregister; NumaNode from cuDeviceGetPCIBusId and sysfs.
  [[nodiscard]] absl::Status RegisterHost(void* host, uint64_t bytes) override;
  [[nodiscard]] absl::Status UnregisterHost(void* host) override;
  int NumaNode() const override;

  // The owner is this device (by UUID), or a CUDA device of this process for which
  // cuDeviceCanAccessPeer(this device, owner) is 1. Map's cuMemSetAccess for this device's ordinal is
  // then the whole grant: with VMM no cuCtxEnablePeerAccess is needed. NOT_FOUND (naming
  // CUDA_VISIBLE_DEVICES) when no visible device has the UUID; FAILED_PRECONDITION for a non-CUDA UUID
  // or a pair without peer access.
  [[nodiscard]] absl::Status CheckPeerAccess(absl::string_view owner_uuid) override;

  // Probed at Open: fabric by exporting a granule (the attribute alone is not trusted), DMA-BUF by
  // cuMemGetHandleForAddressRange over a mapped range of two separately created chunks (with the
  // GPUDirect-RDMA flag where CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 1, as every
  // chunk then is), peers by cuDeviceCanAccessPeer.
  DeviceCapabilities Capabilities() const override { return caps_; }
  // cuMemGetHandleForAddressRange(DMA_BUF_FD): one DMA-BUF over a mapped range of any number of chunks.
  // UNIMPLEMENTED when the probe at Open failed (the capability's detail says why).
  [[nodiscard]] absl::StatusOr<int> ExportRange(uint64_t va, uint64_t bytes) override;
  // ExportFabric's bytes; FAILED_PRECONDITION without fabric handles, as ExportFabric.
  [[nodiscard]] absl::StatusOr<std::string> ExportFabricHandle(const Chunk& chunk) override;

  // CUDA only: fabric handles (multi-node NVLink). Chunks are created fabric-exportable only when
  // fabric_handles() is true; otherwise both calls are FAILED_PRECONDITION.
  bool fabric_handles() const { return fabric_handles_; }
  [[nodiscard]] absl::StatusOr<FabricHandle> ExportFabric(const Chunk& chunk);
  [[nodiscard]] absl::StatusOr<Chunk> ImportFabric(const FabricHandle& handle, uint64_t bytes);

  int ordinal() const { return ordinal_; }
  const CudaDriver& driver() const { return driver_; }
  // The retained primary context (valid while this device lives).
  CUcontext context() const { return context_; }
  // The handle types Create requests (POSIX FD, plus fabric where supported).
  CUmemAllocationHandleType handle_types() const { return handle_types_; }

 private:
  CudaDevice(const CudaDriver& driver, int ordinal);

  // Makes the primary context current on this thread.
  absl::Status MakeCurrent() const;
  // Runs issue(stream) on a new non-blocking stream and waits for it (the comment above OnOwnStream in cuda_device.cc).
  template <typename Issue>
  absl::Status OnOwnStream(const char* what, Issue issue);
  // Open's probes (Capabilities()): a failed DMA-BUF probe is recorded, not returned.
  void ProbeRangeExport(bool attribute);
  absl::Status ProbePeers();
  // Records a chunk the driver just handed out (one more reference), or releases it again if the book
  // refuses it.
  absl::StatusOr<Chunk> Record(const Chunk& chunk, ChunkOrigin origin);
  // Runs one block operation (Note [Block runs]): `ids` holds `id_words` uint64 words for `items`
  // items; `packed` is the packed buffer of pack/unpack (else 0). Checks the memory first.
  absl::Status RunBlocks(const char* call, BlockOp op, const BlockSpan& span, const uint64_t* ids, uint64_t id_words,
                         uint64_t items, uint64_t packed);
  // Stages the ids, launches `kernel` with `params` on stream_ and waits for it.
  absl::Status LaunchLocked(const char* call, CUfunction kernel, const char* kernel_name, BlockRunParams params,
                            const uint64_t* ids, uint64_t id_words) ABSL_EXCLUSIVE_LOCKS_REQUIRED(block_mu_);
  // Grows the device-side scratch buffer for block ids to at least `bytes`.
  absl::Status EnsureScratch(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(block_mu_);

  const CudaDriver& driver_;
  const int ordinal_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  uint64_t granularity_ = 0;
  CUmemAllocationHandleType handle_types_ = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  bool fabric_handles_ = false;
  bool rdma_flag_ = false;  // chunks are created with allocFlags.gpuDirectRDMACapable
  DeviceCapabilities caps_;
  int multiprocessors_ = 1;
  std::string name_;
  std::string uuid_;
  std::string driver_version_;

  // The block kernels (Note [Block runs]): loaded at open; kernels_status_ is their load error, if any.
  CUmodule module_ = nullptr;
  CUfunction aligned_kernel_ = nullptr;
  CUfunction unaligned_kernel_ = nullptr;
  absl::Status kernels_status_;

  // Reservations, mappings and live chunk handles with their reference counts (an import of memory
  // this process already holds may return a handle it has seen), and every misuse check of the
  // contract. Made once the granularity is known; its locks come before block_mu_.
  std::unique_ptr<VaBook> book_;

  absl::Mutex block_mu_;
  CUstream stream_ ABSL_GUARDED_BY(block_mu_) = nullptr;
  CUdeviceptr scratch_ ABSL_GUARDED_BY(block_mu_) = 0;
  uint64_t scratch_bytes_ ABSL_GUARDED_BY(block_mu_) = 0;
};

}  // namespace kvd
