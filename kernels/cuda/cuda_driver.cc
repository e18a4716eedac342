#include "cuda/cuda_driver.h"

#include <cudaTypedefs.h>
#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

// See Note [Vendor runtimes are loaded, never linked] in docs/architecture.md.
absl::StatusOr<CudaDriver> Load() {
  // RTLD_NODELETE: the table outlives every CudaDevice, up to static destruction at exit.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (lib == nullptr) {
    const char* why = dlerror();
    return absl::UnavailableError(absl::StrCat("no CUDA driver: dlopen(libcuda.so.1): ", why ? why : "not found"));
  }
  // The only entry point found by name; cuGetProcAddress_v2 exists in drivers of CUDA 12.0 and later.
  auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    return absl::UnavailableError(
        "no CUDA driver: libcuda.so.1 has no cuGetProcAddress_v2 (the driver predates CUDA 12.0; kvd needs 12.0+)");
  }
  CudaDriver driver;
  struct Entry {
    const char* name;
    void** slot;
  };
  const Entry entries[] = {
#define KVD_CUDA_DRIVER_ENTRY_(name) {#name, reinterpret_cast<void**>(&driver.name##_)},
      KVD_CUDA_DRIVER_ENTRY_POINTS(KVD_CUDA_DRIVER_ENTRY_)
#undef KVD_CUDA_DRIVER_ENTRY_
  };
  for (const Entry& e : entries) {
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    const CUresult r = get_proc(e.name, e.slot, kCudaAbiVersion, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
    if (r != CUDA_SUCCESS || found != CU_GET_PROC_ADDRESS_SUCCESS || *e.slot == nullptr) {
      return absl::UnavailableError(absl::StrCat("no CUDA driver: cuGetProcAddress(", e.name, ", ", kCudaAbiVersion,
                                                 "): CUresult ", static_cast<int>(r), ", query result ",
                                                 static_cast<int>(found)));
    }
  }
  return driver;
}

}  // namespace

absl::StatusOr<const CudaDriver*> LoadCudaDriver() {
  // Loaded once, thread-safely; never destroyed, so no CudaDevice outlives its table.
  static const absl::StatusOr<CudaDriver>* const loaded = new absl::StatusOr<CudaDriver>(Load());
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

absl::StatusCode CudaStatusCode(CUresult result) {
  switch (result) {
    case CUDA_SUCCESS:
      return absl::StatusCode::kOk;
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_INVALID_VALUE:
      return absl::StatusCode::kInvalidArgument;
    // No usable driver or device: `--backend=auto` falls back to the host backend on these.
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

std::string CudaErrorName(const CudaDriver& driver, CUresult result) {
  const char* name = nullptr;
  if (driver.cuGetErrorName_ == nullptr || driver.cuGetErrorName_(result, &name) != CUDA_SUCCESS || name == nullptr) {
    return absl::StrCat("CUresult ", static_cast<int>(result));
  }
  return absl::StrCat(name, " (", static_cast<int>(result), ")");
}

absl::Status CudaStatus(const CudaDriver& driver, CUresult result, absl::string_view call) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  return absl::Status(CudaStatusCode(result), absl::StrCat(call, ": ", CudaErrorName(driver, result)));
}

}  // namespace kvd
