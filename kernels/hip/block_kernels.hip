// The HIP build of the block kernels: the kernels themselves are written once, for nvcc and hipcc,
// in ../block_kernels.cuh. hipcc --genco compiles this file into a code-object bundle
// (kernels/hip/CMakeLists.txt); hip_device.cc loads it with hipModuleLoadData.
#include <hip/hip_runtime.h>

#include "block_kernels.cuh"
