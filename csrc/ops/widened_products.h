// The block's projection products in bfloat16/float16 on a CPU without native products for that type.
//
// There torch's half-type GEMMs run several times slower than fp32 sgemm (a bfloat16 (4096 x 512) x (512 x 512)
// product: 146 ms, against 33 ms widened to fp32 and rounded back, on Zen 3), so the operands are widened to
// fp32, multiplied, and the product rounded once: fp32 accumulation, as torch's own half-type GEMMs accumulate.
// Elsewhere (other dtypes, other devices, CPUs with AVX512-BF16, AMX or AVX512-FP16, and float16 under float32
// matmul precision "medium") these are torch's ops.
#pragma once

#include <ATen/ATen.h>

namespace fastmha {

// Whether products of `dtype` on `device` are widened to fp32 (see above).
bool widens_products(at::ScalarType dtype, const at::Device& device);

// x W^T, as at::linear.
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight);
// a b, as at::matmul.
at::Tensor widened_matmul(const at::Tensor& a, const at::Tensor& b);

}  // namespace fastmha
