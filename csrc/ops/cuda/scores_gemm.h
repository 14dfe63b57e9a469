// Batched a @ b^T with the product in the accumulation dtype: fp32 scores from float16/bfloat16 operands
// (cuBLAS, tensor cores, fp32 accumulation and output), so the weights-kept path's softmax reads unrounded
// scores. float and double go through at::matmul (which honours torch's TF32 setting for float).
#pragma once

#include <ATen/core/Tensor.h>

namespace fastmha::cuda_kernels {

// a (B, H, M, K), b (B, H, N, K), same dtype and device -> (B, H, M, N) contiguous in the accumulation dtype.
at::Tensor scores_gemm(const at::Tensor& a, const at::Tensor& b);

}  // namespace fastmha::cuda_kernels
