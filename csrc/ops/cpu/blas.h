// Row-major GEMM on raw pointers through the Fortran BLAS (MKL or OpenBLAS) that libtorch_cpu carries and
// exports. Called inside at::parallel_for tasks, where the BLAS runs single-threaded on the task's block.
#pragma once

#include <cstdint>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace fastmha::cpu {

// C (m x n, row stride ldc) = alpha * op(A) * op(B) + beta * C, all row-major; op(X) = X^T when trans_x.
// A row-major matrix is the transposed column-major one, so this is the column-major C^T = op(B)^T op(A)^T.
template <typename T>
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                 const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) {
    return;
  }
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  // BLAS wants leading dimensions >= 1 even for empty operands.
  const int la = static_cast<int>(ldb > 0 ? ldb : 1), lb = static_cast<int>(lda > 0 ? lda : 1);
  const int lc = static_cast<int>(ldc);
  if constexpr (sizeof(T) == sizeof(float)) {
    sgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, b, &la, a, &lb, &beta, c, &lc);
  } else {
    dgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, b, &la, a, &lb, &beta, c, &lc);
  }
}

}  // namespace fastmha::cpu
