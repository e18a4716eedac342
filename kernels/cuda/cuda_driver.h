// The CUDA driver API, loaded at run time: a table of typed function pointers (Note [Loading the CUDA
// driver]). kvd never links libcuda, so one binary starts on a machine without an NVIDIA driver and
// falls back to the host backend; every CUDA call of kvd goes through this table.
//
// Ownership and threads. LoadCudaDriver() loads libcuda.so.1 once per process; the table it returns
// is immutable and lives until the process exits (the library is never unloaded). Any thread may
// call through it concurrently, as the driver itself allows.
//
// Errors. CudaStatus() is the one place a CUresult becomes an absl::Status; it keeps the call and the
// raw CUresult name and number in the message: "cuMemCreate(1073741824 bytes): CUDA_ERROR_OUT_OF_MEMORY (2)".
//
// Note [Loading the CUDA driver]
// Only one symbol is looked up with dlsym: cuGetProcAddress_v2 (drivers of CUDA 12.0 and later). Every
// other entry point is resolved through it with an explicit ABI version (kCudaAbiVersion). The version
// is what makes this safe: a name such as "cuMemGetInfo" or "cuStreamDestroy" has several versions in
// libcuda with different semantics or signatures, and cuGetProcAddress returns the one that was
// current in that CUDA release, whatever driver is installed. The member types come from the
// declarations in this toolkit's cuda.h (decltype), so each entry below must be one whose cuda.h
// signature is the one of CUDA 12.0; when cuda.h changes a signature (as CUDA 13 did for cuCtxCreate
// and cuMemAdvise), pin that entry to a typedef from <cudaTypedefs.h> instead. The pattern follows
// NCCL's cudawrap.cc and PyTorch's c10/cuda/driver_api.h, without their process-aborting checks.
#pragma once

#include <cuda.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvd {

// The CUDA release whose ABI every entry point of the table is resolved at.
inline constexpr int kCudaAbiVersion = 12000;

// X(name): every driver entry point kvd uses. Add one here and it is loaded, checked and typed.
#define KVD_CUDA_DRIVER_ENTRY_POINTS(X) \
  X(cuGetErrorName)                     \
  X(cuGetErrorString)                   \
  X(cuInit)                             \
  X(cuDriverGetVersion)                 \
  X(cuDeviceGet)                        \
  X(cuDeviceGetCount)                   \
  X(cuDeviceGetName)                    \
  X(cuDeviceGetUuid)                    \
  X(cuDeviceGetPCIBusId)                \
  X(cuDeviceGetAttribute)               \
  X(cuDeviceTotalMem)                   \
  X(cuDeviceCanAccessPeer)              \
  X(cuDevicePrimaryCtxRetain)           \
  X(cuDevicePrimaryCtxRelease)          \
  X(cuCtxSetCurrent)                    \
  X(cuCtxSynchronize)                   \
  X(cuMemGetInfo)                       \
  X(cuMemGetAllocationGranularity)      \
  X(cuMemAddressReserve)                \
  X(cuMemAddressFree)                   \
  X(cuMemCreate)                        \
  X(cuMemRelease)                       \
  X(cuMemMap)                           \
  X(cuMemUnmap)                         \
  X(cuMemSetAccess)                     \
  X(cuMemExportToShareableHandle)       \
  X(cuMemImportFromShareableHandle)     \
  X(cuMemGetHandleForAddressRange)      \
  X(cuMemAlloc)                         \
  X(cuMemFree)                          \
  X(cuMemHostRegister)                  \
  X(cuMemHostUnregister)                \
  X(cuMemcpyHtoD)                       \
  X(cuMemcpyDtoH)                       \
  X(cuMemcpyHtoDAsync)                  \
  X(cuMemcpyDtoHAsync)                  \
  X(cuMemcpyDtoD)                       \
  X(cuMemsetD8)                         \
  X(cuStreamCreate)                     \
  X(cuStreamDestroy)                    \
  X(cuStreamSynchronize)                \
  X(cuModuleLoadData)                   \
  X(cuModuleUnload)                     \
  X(cuModuleGetFunction)                \
  X(cuLaunchKernel)

// The table. Member `cuFoo_` has the type of cuda.h's cuFoo (which cuda.h may #define to cuFoo_v2:
// the member then has the _v2 signature, and the _v2 entry point is what kCudaAbiVersion resolves).
struct CudaDriver {
#define KVD_CUDA_DRIVER_MEMBER_(name) decltype(&name) name##_ = nullptr;
  KVD_CUDA_DRIVER_ENTRY_POINTS(KVD_CUDA_DRIVER_MEMBER_)
#undef KVD_CUDA_DRIVER_MEMBER_
};

// The process's driver table, loaded on the first call. UNAVAILABLE ("no CUDA driver: …") when
// libcuda.so.1 cannot be loaded, is older than CUDA 12.0, or lacks an entry point. The outcome is
// cached: later calls return the same table or the same error. Does not call cuInit.
[[nodiscard]] absl::StatusOr<const CudaDriver*> LoadCudaDriver();

// The canonical code kvd uses for a CUresult: out of memory -> RESOURCE_EXHAUSTED, invalid value ->
// INVALID_ARGUMENT, no driver or device -> UNAVAILABLE, anything else -> INTERNAL.
absl::StatusCode CudaStatusCode(CUresult result);

// "CUDA_ERROR_OUT_OF_MEMORY (2)" (or "CUresult 12345" for a code the driver does not name).
std::string CudaErrorName(const CudaDriver& driver, CUresult result);

// OK for CUDA_SUCCESS; else "<call>: <CudaErrorName>" with CudaStatusCode(result).
[[nodiscard]] absl::Status CudaStatus(const CudaDriver& driver, CUresult result, absl::string_view call);

// As CudaStatus, but `describe()` (returning the call's description) runs only on failure: the hot
// paths (create, map, access, export, import; once per chunk) build no string when they succeed.
template <typename Describe>
[[nodiscard]] absl::Status CudaStatusLazy(const CudaDriver& driver, CUresult result, Describe describe) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  return CudaStatus(driver, result, describe());
}

}  // namespace kvd
