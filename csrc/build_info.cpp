#include <fastmha/build_info.h>

namespace fastmha {

BuildInfo build_info() {
#ifdef FASTMHA_WITH_CUDA
  return {FASTMHA_VERSION, TORCH_BUILD_VERSION, true, FASTMHA_CUDA_VERSION, FASTMHA_CUDA_ARCHS};
#else
  return {FASTMHA_VERSION, TORCH_BUILD_VERSION, false, "", ""};
#endif
}

}  // namespace fastmha
