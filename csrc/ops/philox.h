// Counter-based dropout randomness (Philox4x32-10, Salmon et al. 2011), shared by CPU and CUDA code.
// A keep/drop decision is a pure function of (seed, offset, element index): the backward regenerates the
// forward's mask instead of storing it, and the result does not depend on thread count or launch shape.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FASTMHA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTMHA_HOST_DEVICE inline
#endif

namespace fastmha::philox {

FASTMHA_HOST_DEVICE uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

// Philox4x32-10 block at counter (counter, offset) under key seed: four independent 32-bit words.
struct Block {
  uint32_t word[4];
};

// The 128-bit Philox counter of block `counter` of a call's stream, laid out as curand and PyTorch's own CUDA
// kernels lay theirs out: the low 64 bits are the stream position (offset / 4, offsets count 32-bit words)
// and the high 64 bits the subsequence, here the block index. Each call reserves its own offset from the
// generator, so its (position, subsequence) pairs are ones no other torch op of that generator draws.
FASTMHA_HOST_DEVICE void counter_words(uint64_t offset, uint64_t counter, uint32_t c[4]) {
  const uint64_t position = offset >> 2;
  c[0] = static_cast<uint32_t>(position);
  c[1] = static_cast<uint32_t>(position >> 32);
  c[2] = static_cast<uint32_t>(counter);
  c[3] = static_cast<uint32_t>(counter >> 32);
}

FASTMHA_HOST_DEVICE Block random4(uint64_t seed, uint64_t offset, uint64_t counter) {
  uint32_t c[4];
  counter_words(offset, counter, c);
  uint32_t c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// Word i (0..3) of a block, by selects: a GPU keeps an array indexed at run time in local memory.
FASTMHA_HOST_DEVICE uint32_t word_at(const Block& block, int i) {
  return i == 0 ? block.word[0] : i == 1 ? block.word[1] : i == 2 ? block.word[2] : block.word[3];
}

// Uniform in [0, 1) with 24 bits (exact in float) from one 32-bit word.
FASTMHA_HOST_DEVICE float to_uniform(uint32_t word) { return static_cast<float>(word >> 8) * (1.0f / 16777216.0f); }

// The multiplier dropout applies to the element whose word this is: 0 (dropped, probability p) or `scale`
// (1 / (1 - p)).
template <typename T>
FASTMHA_HOST_DEVICE T keep_of(uint32_t word, float p, T scale) {
  return to_uniform(word) >= p ? scale : T(0);
}

// The multiplier dropout applies to element `index`, from word index % 4 of the block at counter index / 4.
// Kernels that walk elements in order compute each block once and use its four words.
template <typename T>
FASTMHA_HOST_DEVICE T keep_scale(uint64_t seed, uint64_t offset, uint64_t index, float p, T scale) {
  return keep_of(word_at(random4(seed, offset, index >> 2), static_cast<int>(index & 3)), p, scale);
}

}  // namespace fastmha::philox
