// Consecutive Philox4x32-10 blocks, a batch at a time, for the CPU kernels' dropout and its replay by
// fastmha::_dropout_multipliers: the same words as philox::random4 (ops/philox.h), which the kernels' per-element
// draws must match bit for bit. Included by each per-ISA compile of the kernels (CPU_CAPABILITY): the rounds run on
// two independent vector chains, which hides the latency of the 32 x 32 -> 64-bit multiplies: 8 lanes each with
// AVX2 (about 4x the throughput of the compiler's code for the plain loop on Zen 3), 16 with AVX-512 (twice the
// blocks per batch, and a lane's high and low product words picked in one shuffle each); otherwise, and where a
// batch's counters carry into their high word, one philox::random4 per block.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ops/philox.h"

namespace fastmha::cpu {
namespace CPU_CAPABILITY {

#if defined(__AVX512F__)
// 16 lanes, a block each.
struct PhiloxLanes {
  using Reg = __m512i;
  static constexpr int kLanes = 16;
  static Reg set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static Reg lane_plus(uint32_t x) {
    return _mm512_add_epi32(set1(x), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static Reg xor3(Reg a, Reg b, Reg c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
  // Low and high halves of the 32 x 32 -> 64-bit products of each lane of a with k: the even lanes' products, then
  // the odd lanes' (their words moved down), each half put back in its lane by one masked word swap.
  static void mulhilo(Reg a, Reg k, Reg* lo, Reg* hi) {
    const Reg even = _mm512_mul_epu32(a, k);
    const Reg odd = _mm512_mul_epu32(_mm512_shuffle_epi32(a, _MM_PERM_CDAB), k);
    *lo = _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
    *hi = _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
  }
  // Words by counter (c[w]: word w of the lanes' blocks) to block-major order at out: a 4 x 16 transpose.
  static void store_blocks(const Reg (&c)[4], uint32_t* out) {
    const Reg t0 = _mm512_unpacklo_epi32(c[0], c[1]), t1 = _mm512_unpackhi_epi32(c[0], c[1]);
    const Reg t2 = _mm512_unpacklo_epi32(c[2], c[3]), t3 = _mm512_unpackhi_epi32(c[2], c[3]);
    // Blocks (0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15), one per 128-bit lane.
    const Reg b0 = _mm512_unpacklo_epi64(t0, t2), b1 = _mm512_unpackhi_epi64(t0, t2);
    const Reg b2 = _mm512_unpacklo_epi64(t1, t3), b3 = _mm512_unpackhi_epi64(t1, t3);
    // Blocks (0, 8, 1, 9), (4, 12, 5, 13), (2, 10, 3, 11), (6, 14, 7, 15), then in order.
    const Reg u0 = _mm512_shuffle_i32x4(b0, b1, _MM_SHUFFLE(2, 0, 2, 0));
    const Reg u1 = _mm512_shuffle_i32x4(b0, b1, _MM_SHUFFLE(3, 1, 3, 1));
    const Reg u2 = _mm512_shuffle_i32x4(b2, b3, _MM_SHUFFLE(2, 0, 2, 0));
    const Reg u3 = _mm512_shuffle_i32x4(b2, b3, _MM_SHUFFLE(3, 1, 3, 1));
    _mm512_storeu_si512(out, _mm512_shuffle_i32x4(u0, u2, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(u1, u3, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(u0, u2, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(u1, u3, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#elif defined(__AVX2__)
// 8 lanes, a block each.
struct PhiloxLanes {
  using Reg = __m256i;
  static constexpr int kLanes = 8;
  static Reg set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static Reg lane_plus(uint32_t x) { return _mm256_add_epi32(set1(x), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static Reg xor3(Reg a, Reg b, Reg c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  // Low and high halves of the 32 x 32 -> 64-bit products of each lane of a with k.
  static void mulhilo(Reg a, Reg k, Reg* lo, Reg* hi) {
    const Reg even = _mm256_mul_epu32(a, k);                        // lanes 0, 2, 4, 6
    const Reg odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), k);  // lanes 1, 3, 5, 7
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  }
  // Words by counter (c[w]: word w of the lanes' blocks) to block-major order at out: a 4 x 8 transpose.
  static void store_blocks(const Reg (&c)[4], uint32_t* out) {
    const Reg t0 = _mm256_unpacklo_epi32(c[0], c[1]), t1 = _mm256_unpackhi_epi32(c[0], c[1]);
    const Reg t2 = _mm256_unpacklo_epi32(c[2], c[3]), t3 = _mm256_unpackhi_epi32(c[2], c[3]);
    // Blocks (0, 4), (1, 5), (2, 6), (3, 7), one per 128-bit half.
    const Reg b04 = _mm256_unpacklo_epi64(t0, t2), b15 = _mm256_unpackhi_epi64(t0, t2);
    const Reg b26 = _mm256_unpacklo_epi64(t1, t3), b37 = _mm256_unpackhi_epi64(t1, t3);
    auto* v = reinterpret_cast<Reg*>(out);
    _mm256_storeu_si256(v + 0, _mm256_permute2x128_si256(b04, b15, 0x20));
    _mm256_storeu_si256(v + 1, _mm256_permute2x128_si256(b26, b37, 0x20));
    _mm256_storeu_si256(v + 2, _mm256_permute2x128_si256(b04, b15, 0x31));
    _mm256_storeu_si256(v + 3, _mm256_permute2x128_si256(b26, b37, 0x31));
  }
};
#endif

#if defined(__AVX2__)
constexpr int64_t kPhiloxBatch = 2 * PhiloxLanes::kLanes;  // two chains
#else
constexpr int64_t kPhiloxBatch = 16;
#endif

// Blocks first_block .. first_block + kPhiloxBatch - 1 into words[0 .. 4 * kPhiloxBatch), block-major (word w of
// block b at 4 * b + w).
inline void philox_batch(uint64_t seed, uint64_t offset, uint64_t first_block, uint32_t* words) {
#if defined(__AVX2__)
  // The lanes' counters differ in their low word only unless the batch crosses a multiple of 2^32.
  if (static_cast<uint32_t>(first_block) <= UINT32_MAX - (kPhiloxBatch - 1)) {
    using L = PhiloxLanes;
    constexpr int kChains = kPhiloxBatch / L::kLanes;
    uint32_t base[4];
    philox::counter_words(offset, first_block, base);
    const L::Reg mul0 = L::set1(0xD2511F53u), mul1 = L::set1(0xCD9E8D57u);
    L::Reg c[kChains][4];  // chain, word
    for (int chain = 0; chain < kChains; ++chain) {
      c[chain][0] = L::set1(base[0]);
      c[chain][1] = L::set1(base[1]);
      c[chain][2] = L::lane_plus(base[2] + static_cast<uint32_t>(L::kLanes * chain));
      c[chain][3] = L::set1(base[3]);
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      const L::Reg key0 = L::set1(k0), key1 = L::set1(k1);
      for (auto& w : c) {
        L::Reg lo0, hi0, lo1, hi1;
        L::mulhilo(w[0], mul0, &lo0, &hi0);
        L::mulhilo(w[2], mul1, &lo1, &hi1);
        w[0] = L::xor3(hi1, w[1], key0);
        w[2] = L::xor3(hi0, w[3], key1);
        w[1] = lo1;
        w[3] = lo0;
      }
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    for (int chain = 0; chain < kChains; ++chain) L::store_blocks(c[chain], words + chain * L::kLanes * 4);
    return;
  }
#endif
  for (int64_t l = 0; l < kPhiloxBatch; ++l) {
    const philox::Block block = philox::random4(seed, offset, first_block + static_cast<uint64_t>(l));
    std::copy(block.word, block.word + 4, words + l * 4);
  }
}

// Multipliers (0 or `scale`) of elements first .. first + n - 1 of the stream (seed, offset): the same numbers as
// philox::keep_scale, element i drawing word i % 4 of block i / 4. `words` is scratch, resized as needed.
template <typename T>
void fill_multipliers(uint64_t seed, uint64_t offset, float p, T scale, uint64_t first, int64_t n,
                      std::vector<uint32_t>& words, T* out) {
  if (n <= 0) {
    return;
  }
  const uint64_t first_block = first >> 2, last_block = (first + static_cast<uint64_t>(n) - 1) >> 2;
  const int64_t blocks = static_cast<int64_t>(last_block - first_block + 1);
  words.resize(static_cast<size_t>((blocks + kPhiloxBatch) * 4));
  for (int64_t b0 = 0; b0 < blocks; b0 += kPhiloxBatch) {
    philox_batch(seed, offset, first_block + static_cast<uint64_t>(b0), words.data() + b0 * 4);
  }
  const uint32_t* w = words.data() + (first & 3);
  for (int64_t j = 0; j < n; ++j) {
    out[j] = philox::keep_of(w[j], p, scale);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fastmha::cpu
