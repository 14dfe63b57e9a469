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
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

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

// The sums of eight vectors of partial dot products, acc[u] into out[u]. On AVX-512 (float) the vectors are folded
// together, two at a time, into one vector of the eight sums: three instructions a dot, against about nine for a
// reduction of its own.
template <typename T>
inline void sum_each(const at::vec::Vectorized<T> (&acc)[8], T (&out)[8]) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    // Per 128-bit lane: [d0 d1 d0 d1] partials, then [d0 d1 d2 d3] (and d4..d7 alike).
    const auto pairs = [](__m512 x, __m512 y) {
      return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    };
    const auto quads = [](__m512 x, __m512 y) {
      return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
    };
    const __m512 low = quads(pairs(acc[0], acc[1]), pairs(acc[2], acc[3]));
    const __m512 high = quads(pairs(acc[4], acc[5]), pairs(acc[6], acc[7]));
    // Lanes [L0 L1 H0 H1] + [L2 L3 H2 H3], then its lanes (0 + 1, 2 + 3): the sums of low's lanes and high's.
    const __m512 halves = _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x44), _mm512_shuffle_f32x4(low, high, 0xEE));
    const __m512 both =
        _mm512_add_ps(_mm512_shuffle_f32x4(halves, halves, 0x88), _mm512_shuffle_f32x4(halves, halves, 0xDD));
    const __m256 sums = _mm512_castps512_ps256(both);
    _mm256_storeu_ps(out, sums);
    return;
  }
#endif
  using Vec = at::vec::Vectorized<T>;
  for (int u = 0; u < 8; ++u) out[u] = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, acc[u]);
}

// c[i, j] = alpha * a[i, :] . b[j, :] + beta * c[i, j]: the scores of a few query rows (a decoding step) against
// up to thousands of keys. The compiler does not vectorize a scalar sum (it may not reorder it), so the dots
// run on vector accumulators along the shared index, eight rows of b at a time (enough independent sums to hide
// the multiply-adds' latency), and are summed together at the end (sum_each).
template <typename T>
inline void small_dots(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
                       T beta, T* c, int64_t ldc) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t kRows = 8;
  const int64_t k_vec = k - k % Vec::size();
  for (int64_t i = 0; i < m; ++i) {
    const T* a_row = a + i * lda;
    T* c_row = c + i * ldc;
    for (int64_t j0 = 0; j0 < n; j0 += kRows) {
      const int64_t rows = std::min(kRows, n - j0);
      const T* b_rows[kRows];
      for (int64_t u = 0; u < kRows; ++u) b_rows[u] = b + (j0 + std::min(u, rows - 1)) * ldb;  // repeats the last
      Vec acc[kRows];
      for (int64_t u = 0; u < kRows; ++u) acc[u] = Vec(T(0));
      for (int64_t p = 0; p < k_vec; p += Vec::size()) {
        const Vec x = Vec::loadu(a_row + p);
        for (int64_t u = 0; u < kRows; ++u) acc[u] = at::vec::fmadd(x, Vec::loadu(b_rows[u] + p), acc[u]);
      }
      T dots[kRows];
      sum_each<T>(acc, dots);
      for (int64_t u = 0; u < rows; ++u) {
        T dot = dots[u];
        for (int64_t p = k_vec; p < k; ++p) dot += a_row[p] * b_rows[u][p];
        T& out = c_row[j0 + u];
        out = alpha * dot + (beta == T(0) ? T(0) : beta * out);
      }
    }
  }
}

// The most vectors of a row of c that small_rows keeps in registers: its two sets of sums take 16 of AVX-512's 32
// vector registers, 8 of AVX2's 16.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kRowVectors = 8;
#else
constexpr int64_t kRowVectors = 4;
#endif

// c[i, :] = alpha * a[i, :] b + beta * c[i, :] for rows of c of `vectors` whole vectors (at most kRowVectors): a row
// of P times the values of a decoding step. Each row's sums stay in registers over the whole shared index, two
// sets of them for alternate steps (independent multiply-adds), where a loop over c's memory would load and store
// the row at every step.
template <typename T, int64_t kVectors>
inline void small_rows(int64_t m, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                       int64_t ldc) {
  using Vec = at::vec::Vectorized<T>;
  for (int64_t i = 0; i < m; ++i) {
    const T* a_row = a + i * lda;
    Vec even[kVectors], odd[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) even[v] = odd[v] = Vec(T(0));
    int64_t p = 0;
    for (; p + 2 <= k; p += 2) {
      const Vec x = Vec(alpha * a_row[p]), y = Vec(alpha * a_row[p + 1]);
      const T* b0 = b + p * ldb;
      const T* b1 = b0 + ldb;
      for (int64_t v = 0; v < kVectors; ++v) {
        even[v] = at::vec::fmadd(x, Vec::loadu(b0 + v * Vec::size()), even[v]);
        odd[v] = at::vec::fmadd(y, Vec::loadu(b1 + v * Vec::size()), odd[v]);
      }
    }
    if (p < k) {
      const Vec x = Vec(alpha * a_row[p]);
      for (int64_t v = 0; v < kVectors; ++v)
        even[v] = at::vec::fmadd(x, Vec::loadu(b + p * ldb + v * Vec::size()), even[v]);
    }
    T* row = c + i * ldc;
    for (int64_t v = 0; v < kVectors; ++v) {
      Vec sum = even[v] + odd[v];
      if (beta != T(0)) {
        sum = at::vec::fmadd(Vec(beta), Vec::loadu(row + v * Vec::size()), sum);
      }
      sum.store(row + v * Vec::size());
    }
  }
}

// The vectors of a row of n elements when small_rows takes it (1, 2, 4 or kRowVectors whole vectors), else 0.
template <typename T>
inline int64_t row_vectors(int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  const int64_t vectors = n / Vec::size();
  const bool taken = n % Vec::size() == 0 && (vectors == 1 || vectors == 2 || vectors == 4 || vectors == kRowVectors);
  return taken ? vectors : 0;
}

// small_rows for rows of c that it takes (row_vectors): false (nothing written) for other widths.
template <typename T>
inline bool small_rows_if_whole(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
                                int64_t ldb, T beta, T* c, int64_t ldc) {
  const int64_t vectors = row_vectors<T>(n);
  if (vectors == 1) {
    small_rows<T, 1>(m, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (vectors == 2) {
    small_rows<T, 2>(m, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (vectors == 4) {
    small_rows<T, 4>(m, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (vectors == kRowVectors) {
    small_rows<T, kRowVectors>(m, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  return vectors != 0;
}

// Whether gemm() multiplies a single row on the vector loops (small_dots, small_rows) whatever its size: on
// AVX-512, where it was measured, for scores (b transposed) at any width and for P V rows that small_rows takes.
template <typename T>
inline bool single_row_on_vector_loops(bool trans_b, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  return trans_b || row_vectors<T>(n) != 0;
#else
  (void)trans_b;
  (void)n;
  return false;
#endif
}

// The same contract as gemm() below, as loops the compiler vectorizes (each loop order keeps the innermost
// index contiguous) and the dots above.
template <typename T>
inline void small_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                       const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (!trans_a && trans_b) {
    return small_dots(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  if (!trans_a && !trans_b && small_rows_if_whole(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) {
    return;
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
  // A single row (a decoding step's query) is a matrix-vector product, which the vector loops ran faster than the
  // BLAS's GEMM (a forward over 512 keys with d_k 128 on an Intel Xeon); with 2-16 rows they lost to it.
  if (m == 1 && !trans_a && single_row_on_vector_loops<T>(trans_b, n)) {
    if (trans_b) {
      return small_dots(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
    small_rows_if_whole(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // The BLAS takes int sizes and leading dimensions: a larger one would be truncated into a wrong product.
  TORCH_CHECK(std::max({m, n, k, lda, ldb, ldc}) <= std::numeric_limits<int>::max(),
              "fastmha: a CPU product's sizes or row strides exceed the BLAS's int range: m=", m, ", n=", n, ", k=", k,
              ", row strides ", lda, ", ", ldb, ", ", ldc);
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
