// Compiled with AVX-512 (F, BW) enabled and without contracting a multiply and an add into one rounding, so that
// store_panel rounds as the scalar loop does. Called only where the processor has those instructions.
#include "ops/cpu/half_packing_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "ops/cpu/half_gemm.h"

namespace fastmha::cpu::avx512 {
namespace {

constexpr int64_t kGroup = 16;  // keys per gather: one 32-bit word of each

__mmask16 first16(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(count, 0)) - 1);
}

__mmask32 first32(int64_t count) {
  return count >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << std::max<int64_t>(count, 0)) - 1);
}

// The words (src[j][e], src[j][e + 1]) of `count` (at most 16) rows from `rows` on, zeros in the other lanes.
__m512i gather_pairs(const uint16_t* rows, const __m512i& offsets, int64_t count, int64_t e) {
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), first16(count), offsets, rows + e, 2);
}

// A row of up to 32 elements from c0 on, zeros past d (and everywhere for a row past the operand).
__m512i load_row_part(const uint16_t* row, int64_t c0, int64_t d) {
  const __mmask32 lanes = row == nullptr ? __mmask32{0} : first32(d - c0);
  return lanes == 0 ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi16(lanes, row + c0);
}

}  // namespace

bool packs(int64_t ld, int64_t d) {
  return d >= 2 && ld >= 0 && ld * (kGroup - 1) + d <= std::numeric_limits<int32_t>::max();
}

void pack_transposed(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst) {
  const int64_t depth = padded_depth(d);
  const int64_t columns = (n + kPanel - 1) / kPanel * kPanel;
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(ld)));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j0 = 0; j0 < columns; j0 += kGroup) {
    const int64_t count = std::min(kGroup, n - j0);          // keys of this group; none past n
    const uint16_t* rows = count > 0 ? src + j0 * ld : src;  // no pointer past the operand
    uint16_t* panel = dst + j0 / kPanel * depth * kPanel + (vnni ? 2 : 1) * (j0 % kPanel);
    // Elements e and e + 1 of the group's keys, or e - 1 and e for the last element of an odd row (the element
    // past the row is not read), with the one wanted in the low half.
    const auto pair_from = [&](int64_t e) {
      if (count <= 0 || e >= d) {
        return zero;
      }
      if (e + 1 < d) {
        return gather_pairs(rows, offsets, count, e);
      }
      return _mm512_srli_epi32(gather_pairs(rows, offsets, count, e - 1), 16);
    };
    for (int64_t e = 0; e < depth; e += 2) {
      const __m512i pair = pair_from(e);
      if (vnni) {  // a pair of elements of a key is one word of the packed row pair
        _mm512_storeu_si512(panel + e * kPanel, pair);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + e * kPanel), _mm512_cvtepi32_epi16(pair));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + (e + 1) * kPanel),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
      }
    }
  }
}

void pack_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst) {
  const int64_t depth = padded_depth(n);
  const int64_t columns = (d + kPanel - 1) / kPanel * kPanel;
  // Lanes 2i and 2i + 1 of a VNNI row pair: element i of the first row, then of the second (of the low or high
  // 16 elements of 32).
  alignas(64) int16_t low_order[32], high_order[32];
  for (int i = 0; i < 16; ++i) {
    low_order[2 * i] = static_cast<int16_t>(i);
    low_order[2 * i + 1] = static_cast<int16_t>(32 + i);
    high_order[2 * i] = static_cast<int16_t>(16 + i);
    high_order[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i low = _mm512_load_si512(low_order), high = _mm512_load_si512(high_order);
  const int64_t step = vnni ? 2 : 1;
  for (int64_t r = 0; r < depth; r += step) {
    const uint16_t* first = r < n ? src + r * ld : nullptr;
    const uint16_t* second = vnni && r + 1 < n ? src + (r + 1) * ld : nullptr;
    for (int64_t c0 = 0; c0 < columns; c0 += 32) {
      uint16_t* out = dst + c0 / kPanel * depth * kPanel + r * kPanel + (vnni ? 2 : 1) * (c0 % kPanel);
      const __m512i a = load_row_part(first, c0, d);
      if (vnni) {
        const __m512i b = load_row_part(second, c0, d);
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, low, b));
        _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(a, high, b));
      } else {
        _mm512_storeu_si512(out, a);
      }
    }
  }
}

void store_panel(const float* panel, int64_t m, int64_t width, float* c, int64_t ldc, bool add, float alpha) {
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t r = 0; r < m; ++r) {
    const float* from = panel + r * kPanel;
    float* to = c + r * ldc;
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 lanes = first16(width - j);
      __m512 value = _mm512_mul_ps(scale, _mm512_maskz_loadu_ps(lanes, from + j));
      if (add) {
        value = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, to + j), value);
      }
      _mm512_mask_storeu_ps(to + j, lanes, value);
    }
  }
}

}  // namespace fastmha::cpu::avx512
