// The HIP runtime (libamdhip64), loaded at run time: a table of typed function pointers filled by
// dlopen/dlsym, in the manner of NCCL's cudawrap.cc and PyTorch's c10/cuda/driver_api.h. Nothing in
// kvd links libamdhip64, so one kvd binary starts on machines without ROCm and reports UNAVAILABLE
// for the hip backend there.
//
// Ownership. The library is opened once per process, on first use, and never closed (the runtime's
// own atexit teardown must not race a dlclose). The table is immutable once loaded.
//
// Threads. LoadHipRuntime() is safe to call from any thread; the table's function pointers are the
// runtime's own entry points and carry the runtime's thread-safety guarantees.
//
// Errors. HipStatus() is the one place a hipError_t becomes an absl::Status (docs/backends.md,
// the errors paragraph at its top): hipErrorOutOfMemory -> RESOURCE_EXHAUSTED, hipErrorInvalidValue ->
// INVALID_ARGUMENT, hipErrorNoDevice / hipErrorInvalidDevice / hipErrorInsufficientDriver ->
// UNAVAILABLE, anything else INTERNAL; the message keeps the call, the error's name (from the
// runtime's hipGetErrorName) and its number.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "hip_abi.h"

namespace kvd::hip {

// X(name, return type, parameter list): every entry point kvd calls. All are required: a runtime
// that lacks one (HIP before 5.1 has no hipMem* VMM calls) is reported as UNAVAILABLE.
#define KVD_HIP_RUNTIME_FUNCTIONS(X)                                                                                   \
  X(hipInit, HipError, (unsigned int flags))                                                                           \
  X(hipRuntimeGetVersion, HipError, (int* runtime_version))                                                            \
  X(hipDriverGetVersion, HipError, (int* driver_version))                                                              \
  X(hipGetErrorName, const char*, (HipError error))                                                                    \
  X(hipGetDeviceCount, HipError, (int* count))                                                                         \
  X(hipGetDevice, HipError, (int* device))                                                                             \
  X(hipSetDevice, HipError, (int device))                                                                              \
  X(hipDeviceGet, HipError, (HipDeviceHandle * device, int ordinal))                                                   \
  X(hipDeviceGetName, HipError, (char* name, int len, HipDeviceHandle device))                                         \
  X(hipDeviceGetUuid, HipError, (HipUuid * uuid, HipDeviceHandle device))                                              \
  X(hipDeviceGetPCIBusId, HipError, (char* bus_id, int len, int device))                                               \
  X(hipHostRegister, HipError, (void* host, size_t bytes, unsigned int flags))                                         \
  X(hipHostUnregister, HipError, (void* host))                                                                         \
  X(hipDeviceTotalMem, HipError, (size_t * bytes, HipDeviceHandle device))                                             \
  X(hipDeviceCanAccessPeer, HipError, (int* can_access_peer, int device, int peer_device))                             \
  X(hipMemGetInfo, HipError, (size_t * free, size_t * total))                                                          \
  X(hipMemGetAllocationGranularity, HipError,                                                                          \
    (size_t * granularity, const HipMemAllocationProp* prop, HipMemAllocationGranularityFlags option))                 \
  X(hipMemAddressReserve, HipError, (void** ptr, size_t size, size_t alignment, void* addr, unsigned long long flags)) \
  X(hipMemAddressFree, HipError, (void* ptr, size_t size))                                                             \
  X(hipMemCreate, HipError,                                                                                            \
    (HipMemGenericAllocationHandle * handle, size_t size, const HipMemAllocationProp* prop, unsigned long long flags)) \
  X(hipMemRelease, HipError, (HipMemGenericAllocationHandle handle))                                                   \
  X(hipMemMap, HipError,                                                                                               \
    (void* ptr, size_t size, size_t offset, HipMemGenericAllocationHandle handle, unsigned long long flags))           \
  X(hipMemUnmap, HipError, (void* ptr, size_t size))                                                                   \
  X(hipMemSetAccess, HipError, (void* ptr, size_t size, const HipMemAccessDesc* desc, size_t count))                   \
  X(hipMemExportToShareableHandle, HipError,                                                                           \
    (void* shareable_handle, HipMemGenericAllocationHandle handle, HipMemAllocationHandleType type,                    \
     unsigned long long flags))                                                                                        \
  X(hipMemImportFromShareableHandle, HipError,                                                                         \
    (HipMemGenericAllocationHandle * handle, void* os_handle, HipMemAllocationHandleType type))                        \
  X(hipMemcpyHtoD, HipError, (HipDeviceptr dst, void* src, size_t bytes))                                              \
  X(hipMemcpyDtoH, HipError, (void* dst, HipDeviceptr src, size_t bytes))                                              \
  X(hipMemcpyDtoD, HipError, (HipDeviceptr dst, HipDeviceptr src, size_t bytes))                                       \
  X(hipMemcpyHtoDAsync, HipError, (HipDeviceptr dst, void* src, size_t bytes, HipStream stream))                       \
  X(hipMalloc, HipError, (void** ptr, size_t bytes))                                                                   \
  X(hipFree, HipError, (void* ptr))                                                                                    \
  X(hipStreamCreateWithFlags, HipError, (HipStream * stream, unsigned int flags))                                      \
  X(hipStreamDestroy, HipError, (HipStream stream))                                                                    \
  X(hipStreamSynchronize, HipError, (HipStream stream))                                                                \
  X(hipModuleLoadData, HipError, (HipModule * module, const void* image))                                              \
  X(hipModuleUnload, HipError, (HipModule module))                                                                     \
  X(hipModuleGetFunction, HipError, (HipFunction * function, HipModule module, const char* name))                      \
  X(hipModuleLaunchKernel, HipError,                                                                                   \
    (HipFunction f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z, unsigned int block_x,               \
     unsigned int block_y, unsigned int block_z, unsigned int shared_mem_bytes, HipStream stream,                      \
     void** kernel_params, void** extra))

struct HipRuntimeTable {
  // The soname (or path) that dlopen succeeded with, for messages.
  std::string library;
#define KVD_HIP_TABLE_MEMBER_(name, ret, params) ret(*name) params = nullptr;
  KVD_HIP_RUNTIME_FUNCTIONS(KVD_HIP_TABLE_MEMBER_)
#undef KVD_HIP_TABLE_MEMBER_
};

// The process's table, loaded on first call. UNAVAILABLE, naming every library tried and the
// loader's last error, when no libamdhip64 can be opened; UNAVAILABLE naming the library and the
// symbol when an entry point is missing. The outcome (success or failure) is remembered.
[[nodiscard]] absl::StatusOr<const HipRuntimeTable*> LoadHipRuntime();

// "hipErrorOutOfMemory", through the runtime's hipGetErrorName; "hipError <n>" when the runtime
// does not know the code.
std::string HipErrorName(const HipRuntimeTable& hip, HipError error);

// OK for kHipSuccess; otherwise the canonical status for `error` with the message
// "<call>: <name> (<number>)".
[[nodiscard]] absl::Status HipStatus(const HipRuntimeTable& hip, HipError error, absl::string_view call);

// "7.12.60310" from a HIP_VERSION-encoded number.
std::string FormatHipVersion(int version);

}  // namespace kvd::hip
