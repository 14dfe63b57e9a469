#include "ops/cpu/float_transpose_avx512.h"

#include <immintrin.h>

namespace fastmha::cpu::avx512 {

void transpose_16x16(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  // Four rounds of two-input shuffles, each halving the distance between an element and its place: pairs of
  // rows interleave single elements, then pairs, then 128-bit lanes across four rows, then across eight.
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ld_dst, r[i]);
}

}  // namespace fastmha::cpu::avx512
