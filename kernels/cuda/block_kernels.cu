// The CUDA build of the block kernels: the kernels themselves are written once, for nvcc and hipcc,
// in ../block_kernels.cuh. nvcc --fatbin compiles this file (kernels/cuda/CMakeLists.txt).
#include "block_kernels.cuh"
