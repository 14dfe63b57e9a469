// Writing one row of kept attention weights: the span's scores times 1/sum, exact zeros at the keys outside
// it. Included by each per-ISA compile of the kernels (CPU_CAPABILITY).
//
// A large weights tensor is written once and not read again by the kernel. With `streaming`, whole 32-byte
// blocks go out as non-temporal stores (AVX2): the cache does not first load each line it is about to
// overwrite, which halves the memory traffic of the write, and the kernel's working set stays in cache. The
// caller issues a store fence before other threads read the weights.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ops/cpu/widened_rows.h"

namespace fastmha::cpu {
namespace CPU_CAPABILITY {

#if defined(__AVX2__)
struct StreamFloat {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load_aligned(const float* p) { return _mm256_load_ps(p); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static void stream(float* p, Reg v) { _mm256_stream_ps(p, v); }
};

struct StreamDouble {
  using Reg = __m256d;
  static constexpr int kLanes = 4;
  static Reg set1(double x) { return _mm256_set1_pd(x); }
  static Reg zero() { return _mm256_setzero_pd(); }
  static Reg load(const double* p) { return _mm256_loadu_pd(p); }
  static Reg load_aligned(const double* p) { return _mm256_load_pd(p); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_pd(a, b); }
  static void stream(double* p, Reg v) { _mm256_stream_pd(p, v); }
};

template <typename T, typename S>
void stream_weights_row(T* dst, const T* s, int64_t lo, int64_t hi, int64_t ld, T scale) {
  const auto value = [&](int64_t j) { return j >= lo && j < hi ? s[j - lo] * scale : T(0); };
  int64_t j = 0;
  for (; j < ld && reinterpret_cast<uintptr_t>(dst + j) % 32 != 0; ++j) {
    dst[j] = value(j);
  }
  const auto factor = S::set1(scale);
  for (; j + S::kLanes <= ld; j += S::kLanes) {
    typename S::Reg v;
    if (j >= lo && j + S::kLanes <= hi) {
      v = S::mul(S::load(s + (j - lo)), factor);
    } else if (j + S::kLanes <= lo || j >= hi) {
      v = S::zero();
    } else {  // a block across an edge of the span
      alignas(32) T block[S::kLanes];
      for (int i = 0; i < S::kLanes; ++i) block[i] = value(j + i);
      v = S::load_aligned(block);
    }
    S::stream(dst + j, v);
  }
  for (; j < ld; ++j) {
    dst[j] = value(j);
  }
}

inline void stream_weights_row(float* dst, const float* s, int64_t lo, int64_t hi, int64_t ld, float scale) {
  stream_weights_row<float, StreamFloat>(dst, s, lo, hi, ld, scale);
}
inline void stream_weights_row(double* dst, const double* s, int64_t lo, int64_t hi, int64_t ld, double scale) {
  stream_weights_row<double, StreamDouble>(dst, s, lo, hi, ld, scale);
}
#endif

// dst[0, ld): s[j - lo] * scale for j in [lo, hi), 0 elsewhere.
template <typename T>
void write_weights_row(T* dst, const T* s, int64_t lo, int64_t hi, int64_t ld, T scale, bool streaming) {
#if defined(__AVX2__)
  if (streaming) {
    stream_weights_row(dst, s, lo, hi, ld, scale);
    return;
  }
#endif
  std::fill(dst, dst + lo, T(0));
  at::vec::map([scale](at::vec::Vectorized<T> v) { return v * at::vec::Vectorized<T>(scale); }, dst + lo, s, hi - lo);
  std::fill(dst + hi, dst + ld, T(0));
}

// dst[0, n) = src[0, n), whole 32-byte blocks of dst as non-temporal stores (AVX2).
inline void stream_half_row(uint16_t* dst, const uint16_t* src, int64_t n) {
  int64_t j = 0;
#if defined(__AVX2__)
  for (; j < n && reinterpret_cast<uintptr_t>(dst + j) % 32 != 0; ++j) dst[j] = src[j];
  for (; j + 16 <= n; j += 16) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
  }
#endif
  std::memcpy(dst + j, src + j, static_cast<size_t>(n - j) * sizeof(uint16_t));
}

// One row of kept weights in the half type `kind`: the float row write_weights_row gives, each value rounded once
// (the bits that rounding the float weights would give; a NaN may get another NaN's bits). row (ld floats) and
// bits (ld values, for streaming) are scratch.
inline void write_half_weights_row(HalfKind kind, uint16_t* dst, const float* s, int64_t lo, int64_t hi, int64_t ld,
                                   float scale, bool streaming, float* row, uint16_t* bits) {
  write_weights_row(row, s, lo, hi, ld, scale, false);
  if (!streaming) {
    round_to_half(kind, row, dst, ld);
    return;
  }
  round_to_half(kind, row, bits, ld);
  stream_half_row(dst, bits, ld);
}

// Orders this thread's non-temporal stores before what follows (the end of the parallel region).
inline void fence_streamed_stores() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

}  // namespace CPU_CAPABILITY
}  // namespace fastmha::cpu
