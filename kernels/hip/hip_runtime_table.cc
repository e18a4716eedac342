#include "hip_runtime_table.h"

#include <dlfcn.h>

#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvd::hip {
namespace {

// The unversioned name first (it is whatever the machine's ROCm installs as the development link),
// then the sonames of the releases that ship hipMem* (ROCm 7, 6, 5), then ROCm's default prefix for
// machines whose loader path does not include it.
constexpr std::array<const char*, 5> kLibraryNames = {
    "libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "/opt/rocm/lib/libamdhip64.so",
};

// See Note [Vendor runtimes are loaded, never linked] in docs/architecture.md.
absl::StatusOr<HipRuntimeTable> Load() {
  void* library = nullptr;
  const char* opened = nullptr;
  std::string last_error = "no error reported";
  for (const char* name : kLibraryNames) {
    // RTLD_LOCAL: the runtime's symbols must not satisfy anyone else's undefined references.
    library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (library != nullptr) {
      opened = name;
      break;
    }
    if (const char* error = dlerror(); error != nullptr) last_error = error;
  }
  if (library == nullptr) {
    return absl::UnavailableError(absl::StrCat("hip: no HIP runtime found (tried ", absl::StrJoin(kLibraryNames, ", "),
                                               "; last error: ", last_error,
                                               "); install ROCm or choose another backend"));
  }

  HipRuntimeTable table;
  table.library = opened;
  // dlsym returns void*; the table's members carry the real signatures (hip_abi.h).
#define KVD_HIP_LOAD_SYMBOL_(name, ret, params)                                                                \
  table.name = reinterpret_cast<ret(*) params>(dlsym(library, #name));                                         \
  if (table.name == nullptr) {                                                                                 \
    return absl::UnavailableError(absl::StrCat("hip: ", opened, " has no ", #name,                             \
                                               " (a HIP runtime with virtual memory management, ROCm >= 5.5, " \
                                               "is required)"));                                               \
  }
  KVD_HIP_RUNTIME_FUNCTIONS(KVD_HIP_LOAD_SYMBOL_)
#undef KVD_HIP_LOAD_SYMBOL_
  // The library stays open for the life of the process, whether or not every symbol was found: a
  // half-initialised runtime is cheaper to leave mapped than to tear down.
  return table;
}

}  // namespace

absl::StatusOr<const HipRuntimeTable*> LoadHipRuntime() {
  static const absl::StatusOr<HipRuntimeTable>* const loaded = new absl::StatusOr<HipRuntimeTable>(Load());
  if (!loaded->ok()) return loaded->status();
  return &loaded->value();
}

std::string HipErrorName(const HipRuntimeTable& hip, HipError error) {
  const char* name = hip.hipGetErrorName != nullptr ? hip.hipGetErrorName(error) : nullptr;
  // Unknown codes come back as nullptr or as the runtime's generic "hipErrorUnknown".
  if (name == nullptr || *name == '\0') return absl::StrCat("hipError ", static_cast<int>(error));
  return name;
}

absl::Status HipStatus(const HipRuntimeTable& hip, HipError error, absl::string_view call) {
  if (error == kHipSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(call, ": ", HipErrorName(hip, error), " (", static_cast<int>(error), ")");
  switch (error) {
    case kHipErrorOutOfMemory:
      return absl::ResourceExhaustedError(message);
    case kHipErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    case kHipErrorNoDevice:
    case kHipErrorInvalidDevice:
    // The kernel driver (amdgpu/KFD) is missing or older than the runtime: no usable device either.
    case kHipErrorInsufficientDriver:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

std::string FormatHipVersion(int version) {
  return absl::StrCat(HipVersionMajor(version), ".", HipVersionMinor(version), ".", HipVersionPatch(version));
}

}  // namespace kvd::hip
