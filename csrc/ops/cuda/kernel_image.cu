// Whether this library holds code the current GPU can run: SASS for its arch, or PTX it can compile. Every
// .cu file of the library is compiled for the same archs, so one kernel answers for all of them.
#include <cuda_runtime_api.h>

#include "ops/cuda/attention_kernels.h"

namespace fastmha::cuda_kernels {
namespace {

__global__ void probe_kernel() {}

}  // namespace

bool kernel_image_available() {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, probe_kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it, or the next launch check would report it
    return false;
  }
  return true;
}

}  // namespace fastmha::cuda_kernels
