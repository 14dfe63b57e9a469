// Checks of CUDA runtime calls and kernel launches that need nothing from torch but its exception type, so
// the launch code runs unchanged against the stand-in runtime of the launch test.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#define FASTMHA_CUDA_CHECK(expr)                                                       \
  do {                                                                                 \
    const cudaError_t fastmha_status = (expr);                                         \
    TORCH_CHECK(fastmha_status == cudaSuccess, "fastmha: CUDA error in ", #expr, ": ", \
                cudaGetErrorString(fastmha_status));                                   \
  } while (0)

namespace fastmha::cuda_kernels {

// After a <<<...>>> launch: the launch's own error, if any (an asynchronous fault shows up later, elsewhere).
inline void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  TORCH_CHECK(status == cudaSuccess, "fastmha: launching ", what, " failed: ", cudaGetErrorString(status));
}

}  // namespace fastmha::cuda_kernels
