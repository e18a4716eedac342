// The slice of the HIP runtime's C ABI that kvd calls, declared here rather than taken from
// <hip/hip_runtime_api.h>.
//
// Why not the vendor header. The header is usable from g++ (with -D__HIP_PLATFORM_AMD__), but it
// describes the ROCm release installed on the *build* machine, while the library kvd dlopens is the
// one on the *run* machine, and the two disagree where it matters: ROCm 5.2's header (Debian 12's
// libamdhip64-dev) lays out hipMemAllocationProp as {compressionType, location, requestedHandleType,
// type, usage, win32HandleMetaData}; ROCm 5.5 and later (every runtime kvd supports; see
// kMinVmmRuntimeVersion) use CUDA's layout {type, requestedHandleType, location, win32HandleMetaData,
// allocFlags}. Passing one layout to the other runtime makes hipMemCreate read garbage. So kvd names
// the ABI it speaks, once, here: the enum values and struct layouts of ROCm >= 5.5, which ROCm 6
// and 7 keep (7.x only adds a union alias `requestedHandleTypes` for the second field). hip_abi_check.cc compares every
// value and layout below with the vendor header when one is installed (the hipMemAllocationProp layout only against
// headers >= 5.5).
//
// Names follow kvd's style (kHipErrorOutOfMemory for hipErrorOutOfMemory) so that this header can
// sit beside the vendor one in the same translation unit without clashing.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvd::hip {

// hipError_t. Only the codes kvd branches on; any other code is passed through as a number and
// named by the runtime's hipGetErrorName.
enum HipError : int {
  kHipSuccess = 0,
  kHipErrorInvalidValue = 1,
  kHipErrorOutOfMemory = 2,
  kHipErrorNotInitialized = 3,
  kHipErrorInsufficientDriver = 35,
  kHipErrorNoDevice = 100,
  kHipErrorInvalidDevice = 101,
  kHipErrorInvalidImage = 200,
  kHipErrorNoBinaryForGpu = 209,
  kHipErrorNotSupported = 801,
};

// HIP_VERSION encoding, as hipRuntimeGetVersion reports it: major * 10^7 + minor * 10^5 + patch.
inline constexpr int HipVersion(int major, int minor, int patch = 0) {
  return major * 10000000 + minor * 100000 + patch;
}
inline constexpr int HipVersionMajor(int version) { return version / 10000000; }
inline constexpr int HipVersionMinor(int version) { return (version / 100000) % 100; }
inline constexpr int HipVersionPatch(int version) { return version % 100000; }

// The first runtime whose hipMemAllocationProp has the layout below (see the file comment).
inline constexpr int kMinVmmRuntimeVersion = HipVersion(5, 5);

// Opaque handles: pointers to runtime-private structs.
struct HipStreamOpaque;
struct HipModuleOpaque;
struct HipFunctionOpaque;
struct HipMemGenericAllocationOpaque;
using HipStream = HipStreamOpaque*;                                    // hipStream_t
using HipModule = HipModuleOpaque*;                                    // hipModule_t
using HipFunction = HipFunctionOpaque*;                                // hipFunction_t
using HipMemGenericAllocationHandle = HipMemGenericAllocationOpaque*;  // hipMemGenericAllocationHandle_t
using HipDeviceHandle = int;                                           // hipDevice_t
using HipDeviceptr = void*;                                            // hipDeviceptr_t

// hipMemLocationType
enum HipMemLocationType : int { kHipMemLocationTypeInvalid = 0, kHipMemLocationTypeDevice = 1 };
// hipMemAccessFlags
enum HipMemAccessFlags : int {
  kHipMemAccessFlagsProtNone = 0,
  kHipMemAccessFlagsProtRead = 1,
  kHipMemAccessFlagsProtReadWrite = 3,
};
// hipMemAllocationType
enum HipMemAllocationType : int { kHipMemAllocationTypeInvalid = 0, kHipMemAllocationTypePinned = 1 };
// hipMemAllocationHandleType
enum HipMemAllocationHandleType : int {
  kHipMemHandleTypeNone = 0,
  kHipMemHandleTypePosixFileDescriptor = 1,
};
// hipMemAllocationGranularity_flags
enum HipMemAllocationGranularityFlags : int {
  kHipMemAllocationGranularityMinimum = 0,
  kHipMemAllocationGranularityRecommended = 1,
};

// hipMemLocation
struct HipMemLocation {
  HipMemLocationType type;
  int id;
};

// hipMemAccessDesc
struct HipMemAccessDesc {
  HipMemLocation location;
  HipMemAccessFlags flags;
};

// hipMemAllocationProp, ROCm >= 5.5 layout (CUDA's CUmemAllocationProp without reserved[4]).
struct HipMemAllocationProp {
  HipMemAllocationType type;
  HipMemAllocationHandleType requested_handle_type;
  HipMemLocation location;
  void* win32_handle_meta_data;
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
  } alloc_flags;
};
static_assert(sizeof(HipMemAllocationProp) == 32, "hipMemAllocationProp is 32 bytes on x86-64");
static_assert(offsetof(HipMemAllocationProp, location) == 8);
static_assert(offsetof(HipMemAllocationProp, win32_handle_meta_data) == 16);
static_assert(offsetof(HipMemAllocationProp, alloc_flags) == 24);

// hipUUID
struct HipUuid {
  char bytes[16];
};

// hipStreamNonBlocking
inline constexpr unsigned int kHipStreamNonBlocking = 0x01;

// HIP_LAUNCH_PARAM_BUFFER_POINTER / _SIZE / _END: the markers of hipModuleLaunchKernel's `extra`.
inline void* HipLaunchParamBufferPointer() { return reinterpret_cast<void*>(uintptr_t{0x01}); }
inline void* HipLaunchParamBufferSize() { return reinterpret_cast<void*>(uintptr_t{0x02}); }
inline void* HipLaunchParamEnd() { return reinterpret_cast<void*>(uintptr_t{0x03}); }

}  // namespace kvd::hip
