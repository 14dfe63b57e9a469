// Dot products of one row with a few rows picked out of a matrix: the scores of the keys that dropout removed, which
// the kept-weights backward recomputes (a tenth of the keys at dropout 0.1). Included only by the per-capability kernel
// files: the code lives in the CPU_CAPABILITY namespace (see blas.h).
#pragma once

#ifndef CPU_CAPABILITY
#error "ops/cpu/gathered_dots.h is for the files compiled once per CPU capability"
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

namespace fastmha::cpu::CPU_CAPABILITY {

// The most rows one call of gathered_dots takes.
constexpr int kGatheredRows = 16;

#if defined(CPU_CAPABILITY_AVX512)
// The 16 sums of the lanes of sums[0..15], in that order, in one vector: pairs of vectors are folded into one, their
// halves added, until each lane holds one whole sum (45 instructions for 16 sums, where one horizontal sum alone
// takes about 8).
inline __m512 sums_of_lanes(const __m512* sums) {
  // 16 -> 8: each 128-bit lane holds 4 partial sums of two vectors, interleaved.
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(sums[2 * i], sums[2 * i + 1]),
                             _mm512_unpackhi_ps(sums[2 * i], sums[2 * i + 1]));
  }
  // 8 -> 4: each 128-bit lane holds the partial sums of four vectors, in order.
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // 4 -> 2 -> 1: 128-bit lanes of two vectors regrouped (even lanes, odd lanes) and added.
  const auto fold = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0b10001000), _mm512_shuffle_f32x4(a, b, 0b11011101));
  };
  return fold(fold(quads[0], quads[1]), fold(quads[2], quads[3]));
}
#endif

// out[i] = sum over c < d of x[c] * rows[index[i] * ld + c], for i < count (at most kGatheredRows); rows are
// contiguous. With AVX-512, 16 rows at once, each its own chain of fused multiply-adds, summed across lanes
// together.
template <typename T>
inline void gathered_dots(const T* x, const T* rows, int64_t ld, const int32_t* index, int count, int64_t d, T* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    const float* row[kGatheredRows];
    for (int i = 0; i < kGatheredRows; ++i) row[i] = rows + index[i < count ? i : 0] * ld;  // unused ones repeat one
    __m512 sums[kGatheredRows];
    for (auto& sum : sums) sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 lanes = d - c >= 16 ? __mmask16(0xffff) : __mmask16((1u << (d - c)) - 1);
      const __m512 xs = _mm512_maskz_loadu_ps(lanes, x + c);
      for (int i = 0; i < kGatheredRows; ++i) {
        sums[i] = _mm512_fmadd_ps(xs, _mm512_maskz_loadu_ps(lanes, row[i] + c), sums[i]);
      }
    }
    _mm512_mask_storeu_ps(out, __mmask16((1u << count) - 1), sums_of_lanes(sums));
    return;
  }
#endif
  using Vec = at::vec::Vectorized<T>;
  for (int i = 0; i < count; ++i) {
    out[i] = at::vec::map2_reduce_all<T>([](Vec a, Vec b) { return a * b; }, [](Vec a, Vec b) { return a + b; }, x,
                                         rows + index[i] * ld, d);
  }
}

// The positions j < n where x[j] == 0 (of either sign), in order, into out (room for n: AVX-512 stores whole
// vectors of 16 at the count so far, which is at most j, for j + 16 <= n); returns how many. Branch-free: a tenth of
// random positions (dropout) makes a loop over each one's bit mispredict about once a vector.
template <typename T>
inline int64_t zero_positions(const T* x, int64_t n, int32_t* out) {
  int64_t count = 0, j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; j + 16 <= n; j += 16) {
      const __mmask16 zero = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), _mm512_setzero_ps(), _CMP_EQ_OQ);
      // Compressed in a register, then stored whole: the compressing store to memory is slow on some processors.
      _mm512_storeu_si512(out + count, _mm512_maskz_compress_epi32(zero, index));
      count += __builtin_popcount(zero);
      index = _mm512_add_epi32(index, step);
    }
  }
#endif
  for (; j < n; ++j) {
    out[count] = static_cast<int32_t>(j);
    count += x[j] == T(0) ? 1 : 0;
  }
  return count;
}

}  // namespace fastmha::cpu::CPU_CAPABILITY
