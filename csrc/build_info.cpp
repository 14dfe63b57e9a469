#include <fastmha/build_info.h>

#include <c10/core/Device.h>

#include <optional>

#include "ops/cpu/cpu_capability.h"
#include "ops/widened_products.h"

namespace fastmha {
namespace {

std::optional<c10::ScalarType> half_type_named(const std::string& name) {
  if (name == "bfloat16") return c10::kBFloat16;
  if (name == "float16") return c10::kHalf;
  return std::nullopt;
}

}  // namespace

BuildInfo build_info() {
#ifdef FASTMHA_WITH_CUDA
  return {FASTMHA_VERSION, TORCH_BUILD_VERSION, true, FASTMHA_CUDA_VERSION, FASTMHA_CUDA_ARCHS};
#else
  return {FASTMHA_VERSION, TORCH_BUILD_VERSION, false, "", ""};
#endif
}

std::string cpu_capability() { return cpu::capability_name(); }

bool cpu_native_products(const std::string& dtype) {
  const auto type = half_type_named(dtype);
  return type.has_value() && cpu::native_products(*type);
}

bool cpu_widens_products(const std::string& dtype, int64_t rows) {
  const auto type = half_type_named(dtype);
  return type.has_value() && widens_products(*type, c10::Device(c10::kCPU), rows);
}

}  // namespace fastmha
