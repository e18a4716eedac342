// Compile-time proof that hip_abi.h matches the vendor's <hip/hip_runtime_api.h> wherever the two
// are meant to agree. Built only when CMake finds the vendor header; contributes no code.
//
// The hipMemAllocationProp layout is checked only against headers of HIP >= 5.5: older headers
// (Debian 12 ships ROCm 5.2) declare the pre-5.5 layout that kvd deliberately does not speak.
#include <hip/hip_runtime_api.h>

#include <cstddef>
#include <type_traits>

#include "hip_abi.h"

namespace kvd::hip {
namespace {

static_assert(kHipSuccess == static_cast<int>(hipSuccess));
static_assert(kHipErrorInvalidValue == static_cast<int>(hipErrorInvalidValue));
static_assert(kHipErrorOutOfMemory == static_cast<int>(hipErrorOutOfMemory));
static_assert(kHipErrorNotInitialized == static_cast<int>(hipErrorNotInitialized));
static_assert(kHipErrorInsufficientDriver == static_cast<int>(hipErrorInsufficientDriver));
static_assert(kHipErrorNoDevice == static_cast<int>(hipErrorNoDevice));
static_assert(kHipErrorInvalidDevice == static_cast<int>(hipErrorInvalidDevice));
static_assert(kHipErrorInvalidImage == static_cast<int>(hipErrorInvalidImage));
static_assert(kHipErrorNoBinaryForGpu == static_cast<int>(hipErrorNoBinaryForGpu));
static_assert(kHipErrorNotSupported == static_cast<int>(hipErrorNotSupported));
static_assert(sizeof(HipError) == sizeof(hipError_t));

static_assert(HipVersion(HIP_VERSION_MAJOR, HIP_VERSION_MINOR, HIP_VERSION_PATCH) == HIP_VERSION);

static_assert(kHipMemLocationTypeDevice == static_cast<int>(hipMemLocationTypeDevice));
static_assert(kHipMemAccessFlagsProtNone == static_cast<int>(hipMemAccessFlagsProtNone));
static_assert(kHipMemAccessFlagsProtRead == static_cast<int>(hipMemAccessFlagsProtRead));
static_assert(kHipMemAccessFlagsProtReadWrite == static_cast<int>(hipMemAccessFlagsProtReadWrite));
static_assert(kHipMemAllocationTypePinned == static_cast<int>(hipMemAllocationTypePinned));
static_assert(kHipMemHandleTypeNone == static_cast<int>(hipMemHandleTypeNone));
static_assert(kHipMemHandleTypePosixFileDescriptor == static_cast<int>(hipMemHandleTypePosixFileDescriptor));
static_assert(kHipMemAllocationGranularityMinimum == static_cast<int>(hipMemAllocationGranularityMinimum));
static_assert(kHipMemAllocationGranularityRecommended == static_cast<int>(hipMemAllocationGranularityRecommended));
static_assert(kHipStreamNonBlocking == hipStreamNonBlocking);

static_assert(sizeof(HipMemLocation) == sizeof(hipMemLocation));
static_assert(offsetof(HipMemLocation, type) == offsetof(hipMemLocation, type));
static_assert(offsetof(HipMemLocation, id) == offsetof(hipMemLocation, id));
static_assert(sizeof(HipMemAccessDesc) == sizeof(hipMemAccessDesc));
static_assert(offsetof(HipMemAccessDesc, location) == offsetof(hipMemAccessDesc, location));
static_assert(offsetof(HipMemAccessDesc, flags) == offsetof(hipMemAccessDesc, flags));
static_assert(sizeof(HipUuid) == sizeof(hipUUID));
static_assert(sizeof(HipDeviceHandle) == sizeof(hipDevice_t));
static_assert(sizeof(HipMemGenericAllocationHandle) == sizeof(hipMemGenericAllocationHandle_t));

#if HIP_VERSION >= 50500000
static_assert(sizeof(HipMemAllocationProp) == sizeof(hipMemAllocationProp));
static_assert(offsetof(HipMemAllocationProp, type) == offsetof(hipMemAllocationProp, type));
static_assert(offsetof(HipMemAllocationProp, requested_handle_type) ==
              offsetof(hipMemAllocationProp, requestedHandleType));
static_assert(offsetof(HipMemAllocationProp, location) == offsetof(hipMemAllocationProp, location));
static_assert(offsetof(HipMemAllocationProp, win32_handle_meta_data) ==
              offsetof(hipMemAllocationProp, win32HandleMetaData));
static_assert(offsetof(HipMemAllocationProp, alloc_flags) == offsetof(hipMemAllocationProp, allocFlags));
#endif

}  // namespace
}  // namespace kvd::hip
