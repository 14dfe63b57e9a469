#include "ops/widened_products.h"

#include <ATen/Context.h>

#include "ops/cpu/cpu_capability.h"

namespace fastmha {

bool widens_products(at::ScalarType dtype, const at::Device& device) {
  if (!device.is_cpu()) {
    return false;
  }
  // Under float32 matmul precision "medium" torch may round fp32 operands to bfloat16, which float16 values do
  // not survive (bfloat16 values do).
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && !cpu::native_products(dtype) &&
         !(dtype == at::kHalf && at::globalContext().float32MatmulPrecision() == at::Float32MatmulPrecision::MEDIUM);
}

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight) {
  if (!widens_products(x.scalar_type(), x.device()) || weight.scalar_type() != x.scalar_type()) {
    return at::linear(x, weight);
  }
  return at::linear(x.to(at::kFloat), weight.to(at::kFloat)).to(x.scalar_type());
}

at::Tensor widened_matmul(const at::Tensor& a, const at::Tensor& b) {
  if (!widens_products(a.scalar_type(), a.device()) || b.scalar_type() != a.scalar_type()) {
    return at::matmul(a, b);
  }
  return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
}

}  // namespace fastmha
