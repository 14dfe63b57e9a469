#include "ops/cuda/scores_gemm.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>

namespace fastmha::cuda_kernels {

at::Tensor scores_gemm(const at::Tensor& a, const at::Tensor& b) {
  const auto dtype = a.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return at::matmul(a, b.transpose(-2, -1)).contiguous();
  }
  const auto ac = a.contiguous(), bc = b.contiguous();
  const int64_t batch = a.size(0) * a.size(1), m = a.size(2), n = b.size(2), k = a.size(3);
  auto out = at::empty({a.size(0), a.size(1), m, n}, a.options().dtype(at::kFloat));
  if (out.numel() == 0) {
    return out;
  }
  if (k == 0) {
    return out.zero_();
  }
  TORCH_CHECK(batch <= INT_MAX && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX,
              "fastmha: score matrix sizes exceed cuBLAS's int range: batch ", batch, ", ", m, " x ", n, " x ", k);
  const cudaDataType_t type = dtype == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  const float alpha = 1.0f, beta = 0.0f;
  // cuBLAS is column-major: row-major out (m x n) = a b^T is out^T (n x m) = b a^T, where b's rows read as a
  // (k x n) column-major matrix (so op = T) and a's as (k x m) (op = N).
  TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
      at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
      static_cast<int>(k), &alpha, bc.const_data_ptr(), type, static_cast<int>(k), n * k, ac.const_data_ptr(), type,
      static_cast<int>(k), m * k, &beta, out.data_ptr(), CUDA_R_32F, static_cast<int>(n), m * n,
      static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return out;
}

}  // namespace fastmha::cuda_kernels
