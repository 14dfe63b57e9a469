#include <fastmha/build_info.h>

#include "ops/cpu/cpu_capability.h"

namespace fastmha {

BuildInfo build_info() {
#ifdef FASTMHA_WITH_CUDA
  return {FASTMHA_VERSION, TORCH_BUILD_VERSION, true, FASTMHA_CUDA_VERSION, FASTMHA_CUDA_ARCHS};
#else
  return {FASTMHA_VERSION, TORCH_BUILD_VERSION, false, "", ""};
#endif
}

std::string cpu_capability() { return cpu::capability_name(); }

}  // namespace fastmha
