#include "ops/widened_products.h"

#include <ATen/Context.h>

#include <algorithm>

#include "ops/cpu/cpu_capability.h"
#include "ops/cpu/onednn_linear.h"

namespace fastmha {
namespace {

bool widened(const at::Tensor& x, const at::Tensor& weight) {
  if (!widens_product_of(x, weight)) {  // other calls build no symbolic row count
    return false;
  }
  c10::SymInt rows = 1;  // x's rows: all its dimensions but the last
  for (int64_t i = 0; i + 1 < x.dim(); ++i) rows *= x.sym_size(i);
  return widens_products(x.scalar_type(), x.device(), rows);
}

// Whether torch's CPU matmuls may round fp32 operands to bfloat16: float32 matmul precision "medium" (the legacy
// setting), or bf16 for oneDNN's matmuls in the per-backend settings, after which the legacy getter raises.
bool fp32_matmul_may_round_to_bfloat16() {
  try {
    return at::globalContext().float32MatmulPrecision() == at::Float32MatmulPrecision::MEDIUM;
  } catch (const c10::Error&) {
    return at::globalContext().float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL) ==
           at::Float32Precision::BF16;
  }
}

// x W^T, widened where widened() says so, and on oneDNN where cpu::float_linear puts it if `may_take_onednn`.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, WidenedInputs& inputs, bool may_take_onednn) {
  const auto product = [&](const at::Tensor& a, const at::Tensor& b) {
    return may_take_onednn ? cpu::float_linear(a, b) : at::linear(a, b);
  };
  if (!widened(x, weight)) {
    return product(x, weight);
  }
  return product(inputs.get(x), weight.to(at::kFloat)).to(x.scalar_type());
}

}  // namespace

bool widens_products(at::ScalarType dtype, const at::Device& device) {
  if (!device.is_cpu()) {
    return false;
  }
  // Where torch may round fp32 operands to bfloat16, float16 values would not survive (bfloat16 values do).
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && !cpu::native_products(dtype) &&
         !(dtype == at::kHalf && fp32_matmul_may_round_to_bfloat16());
}

bool widens_products(at::ScalarType dtype, const at::Device& device, const c10::SymInt& rows) {
  // Asked last, so that only widened types meet it: under torch.compile's symbolic sizes the row count guards the
  // graph (the decoding step's graph takes the path eager takes); a size known only from data takes the widened
  // path.
  return widens_products(dtype, device) && !TORCH_GUARD_OR_FALSE(rows.sym_lt(kFewestWidenedRows));
}

bool widens_product_of(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && widens_products(a.scalar_type(), a.device());
}

WidenedInputs::WidenedInputs(const std::vector<at::Tensor>& inputs) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto same = [&](const at::Tensor& t) { return t.is_same(inputs[i]); };
    if (std::any_of(inputs.begin() + i + 1, inputs.end(), same) &&
        std::none_of(repeated_.begin(), repeated_.end(), same)) {
      repeated_.push_back(inputs[i]);
    }
  }
}

at::Tensor WidenedInputs::get(const at::Tensor& t) {
  if (!widens_products(t.scalar_type(), t.device())) {
    return t;
  }
  for (const auto& [input, copy] : copies_) {
    if (input.is_same(t)) return copy;
  }
  at::Tensor copy = t.to(at::kFloat);
  if (std::any_of(repeated_.begin(), repeated_.end(), [&](const at::Tensor& r) { return r.is_same(t); })) {
    copies_.emplace_back(t, copy);
  }
  return copy;
}

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight) {
  WidenedInputs none({});
  return widened_linear(x, weight, none);
}

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight, WidenedInputs& inputs) {
  return linear(x, weight, inputs, /*may_take_onednn=*/true);
}

at::Tensor widened_linear_of_varying_rows(const at::Tensor& x, const at::Tensor& weight) {
  WidenedInputs none({});
  return linear(x, weight, none, /*may_take_onednn=*/false);
}

}  // namespace fastmha
