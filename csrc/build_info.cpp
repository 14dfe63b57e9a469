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

bool cpu_native_products(const std::string& dtype) {
  return (dtype == "bfloat16" && cpu::native_bfloat16_products()) ||
         (dtype == "float16" && cpu::native_float16_products());
}

}  // namespace fastmha
