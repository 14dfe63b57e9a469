// Row-major GEMM on raw pointers through the Fortran BLAS (MKL or OpenBLAS) that libtorch_cpu carries and
// exports, and small products as vector loops. Called inside at::parallel_for tasks, where the BLAS runs
// single-threaded on the task's block. Included only by the per-capability kernel files: the loops live in the
// CPU_CAPABILITY namespace, so that each file keeps its own ISA's copy (an inline function outside it would be
// one copy for all, whichever object the linker met first).
#pragma once

#ifndef CPU_CAPABILITY
#error "ops/cpu/blas.h is for the files compiled once per CPU capability"
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace fastmha::cpu::CPU_CAPABILITY {

// Below this many multiply-adds a plain loop beats the BLAS call's fixed cost (short sequences run thousands
// of tiny per-head products).
constexpr int64_t kSmallGemm = 32 * 32 * 32;

// c[i, j] = alpha * a[i, :] . b[j, :] + beta * c[i, j]: the scores of a few query rows (a decoding step) against
// up to thousands of keys. The compiler does not vectorize a scalar sum (it may not reorder it), so the dots
// run on vector accumulators along the shared index, four rows of b at a time to overlap their latencies.
template <typename T>
inline void small_dots(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
                       T beta, T* c, int64_t ldc) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t kRows = 4;
  const int64_t k_vec = k - k % Vec::size();
  const auto sum = [](const Vec& x) { return at::vec::vec_reduce_all<T>([](Vec& u, Vec& v) { return u + v; }, x); };
  for (int64_t i = 0; i < m; ++i) {
    const T* a_row = a + i * lda;
    T* c_row = c + i * ldc;
    for (int64_t j0 = 0; j0 < n; j0 += kRows) {
      const int64_t rows = std::min(kRows, n - j0);
      const T* b_rows[kRows];
      for (int64_t u = 0; u < kRows; ++u) b_rows[u] = b + (j0 + std::min(u, rows - 1)) * ldb;  // repeats the last
      Vec acc[kRows] = {Vec(T(0)), Vec(T(0)), Vec(T(0)), Vec(T(0))};
      for (int64_t p = 0; p < k_vec; p += Vec::size()) {
        const Vec x = Vec::loadu(a_row + p);
        for (int64_t u = 0; u < kRows; ++u) acc[u] = at::vec::fmadd(x, Vec::loadu(b_rows[u] + p), acc[u]);
      }
      for (int64_t u = 0; u < rows; ++u) {
        T dot = sum(acc[u]);
        for (int64_t p = k_vec; p < k; ++p) dot += a_row[p] * b_rows[u][p];
        T& out = c_row[j0 + u];
        out = alpha * dot + (beta == T(0) ? T(0) : beta * out);
      }
    }
  }
}

// The same contract as gemm() below, as loops the compiler vectorizes (each loop order keeps the innermost
// index contiguous) and the dots above.
template <typename T>
inline void small_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                       const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (!trans_a && trans_b) {
    return small_dots(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  for (int64_t i = 0; i < m; ++i) {
    T* row = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) row[j] = beta == T(0) ? T(0) : beta * row[j];
  }
  if (!trans_a && !trans_b) {  // c[i, :] += alpha * a[i, p] * b[p, :]
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t p = 0; p < k; ++p) {
        const T x = alpha * a[i * lda + p];
        for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += x * b[p * ldb + j];
      }
    }
  } else if (trans_a && !trans_b) {  // c[i, :] += alpha * a[p, i] * b[p, :]
    for (int64_t p = 0; p < k; ++p) {
      for (int64_t i = 0; i < m; ++i) {
        const T x = alpha * a[p * lda + i];
        for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += x * b[p * ldb + j];
      }
    }
  } else {  // both transposed: c[i, j] += alpha * a[p, i] * b[j, p]
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        T acc = 0;
        for (int64_t p = 0; p < k; ++p) acc += a[p * lda + i] * b[j * ldb + p];
        c[i * ldc + j] += alpha * acc;
      }
    }
  }
}

// C (m x n, row stride ldc) = alpha * op(A) * op(B) + beta * C, all row-major; op(X) = X^T when trans_x.
// A row-major matrix is the transposed column-major one, so this is the column-major C^T = op(B)^T op(A)^T.
template <typename T>
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                 const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) {
    return;
  }
  if (m * n * k <= kSmallGemm) {
    return small_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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

}  // namespace fastmha::cpu::CPU_CAPABILITY
