// Block-wide building blocks of the tiled kernels: copying a tile into shared memory and multiplying shared
// tiles. Half types use the tensor cores through the context's 16x16 warp product (WMMA on the GPU); float
// and double use plain FMAs on 4x4 register tiles, accumulating in their own dtype.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/cuda/flash/kernel_common.h"

namespace fastmha::cuda_kernels {

template <typename T>
constexpr bool uses_tensor_cores() {
  return sizeof(T) == 2;
}

constexpr size_t align128(size_t bytes) { return (bytes + 127) / 128 * 128; }

// Shared-memory row strides (in elements). WMMA wants rows of multiples of 16 bytes (8 halves, 4 floats);
// the FMA path wants odd strides so column walks hit distinct banks.
template <typename T>
constexpr int operand_pad() {
  return uses_tensor_cores<T>() ? 8 : 1;
}
template <typename T>
constexpr int accumulator_pad() {
  return uses_tensor_cores<T>() ? 4 : 1;
}

// 16 bytes moved as one (a 128-bit load/store on the GPU).
#if defined(__CUDACC__)
using Chunk16 = uint4;
#else
struct alignas(16) Chunk16 {
  uint32_t x, y, z, w;
};
#endif

// Copies rows [first, first + ROWS) of a (count, cols) matrix with row stride `stride` into tile[ROWS][LD],
// zero-filling rows past `count` and columns past `cols` up to DP, so the padding adds nothing to products.
// Half-type tiles move in 16-byte chunks when the source rows allow it (aligned, whole chunks).
template <int ROWS, int DP, int LD, typename Ctx, typename T>
FASTMHA_DEVICE void load_tile(const Ctx& ctx, T* tile, const T* src, int64_t stride, int first, int count, int cols) {
  if constexpr (uses_tensor_cores<T>()) {
    constexpr int kChunk = 16 / sizeof(T);
    static_assert(DP % kChunk == 0 && (LD * sizeof(T)) % 16 == 0, "tile rows are whole chunks");
    if (cols % kChunk == 0 && stride % kChunk == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
      constexpr int kChunks = DP / kChunk;
      for (int idx = ctx.thread(); idx < ROWS * kChunks; idx += Ctx::kThreads) {
        const int r = idx / kChunks, c = (idx % kChunks) * kChunk;
        const int row = first + r;
        Chunk16 value{0, 0, 0, 0};
        if (row < count && c < cols) {
          value = *reinterpret_cast<const Chunk16*>(src + row * stride + c);
        }
        *reinterpret_cast<Chunk16*>(tile + r * LD + c) = value;
      }
      return;
    }
  }
  for (int idx = ctx.thread(); idx < ROWS * DP; idx += Ctx::kThreads) {
    const int r = idx / DP, c = idx % DP;
    const int row = first + r;
    tile[r * LD + c] = (row < count && c < cols) ? src[row * stride + c] : T(0.0f);
  }
}

// c[M][N] (+)= A[M][K] * B[K][N] over shared tiles. A(i, k) = a[i * lda + k], or a[k * lda + i] when ACol;
// B(k, j) = b[k * ldb + j], or b[j * ldb + k] when BCol.
template <bool ACol, bool BCol, bool Accumulate, int M, int N, int K, typename Ctx, typename In, typename Acc>
FASTMHA_DEVICE void block_gemm(const Ctx& ctx, const In* a, int lda, const In* b, int ldb, Acc* c, int ldc) {
  if constexpr (uses_tensor_cores<In>()) {
    static_assert(M % 16 == 0 && N % 16 == 0 && K % 16 == 0, "tensor-core tiles are 16x16x16");
    constexpr int tiles_n = N / 16, tiles = (M / 16) * tiles_n;
    for (int t = ctx.warp(); t < tiles; t += Ctx::kWarps) {
      const int ti = t / tiles_n, tj = t % tiles_n;
      const In* a_tile = ACol ? a + ti * 16 : a + ti * 16 * lda;
      const In* b_tile = BCol ? b + tj * 16 * ldb : b + tj * 16;
      ctx.template mma16<ACol, BCol, Accumulate>(a_tile, lda, b_tile, ldb, c + ti * 16 * ldc + tj * 16, ldc, K);
    }
  } else {
    // Each thread accumulates a 4x4 register tile (rows and columns strided across threads, so a warp's
    // lanes read consecutive columns): 8 shared loads per 16 FMAs instead of 2 per 1.
    constexpr int TM = 4, TN = 4;
    static_assert(M % TM == 0 && N % TN == 0, "register tiles are 4x4");
    constexpr int kRowSteps = M / TM, kColSteps = N / TN;
    for (int t = ctx.thread(); t < kRowSteps * kColSteps; t += Ctx::kThreads) {
      const int i0 = t / kColSteps, j0 = t % kColSteps;
      Acc acc[TM][TN];
      for (int ii = 0; ii < TM; ++ii) {
        for (int jj = 0; jj < TN; ++jj) {
          acc[ii][jj] = Accumulate ? c[(i0 + ii * kRowSteps) * ldc + j0 + jj * kColSteps] : Acc(0);
        }
      }
      for (int k = 0; k < K; ++k) {
        Acc av[TM], bv[TN];
        for (int ii = 0; ii < TM; ++ii) {
          const int i = i0 + ii * kRowSteps;
          av[ii] = Acc(ACol ? a[k * lda + i] : a[i * lda + k]);
        }
        for (int jj = 0; jj < TN; ++jj) {
          const int j = j0 + jj * kColSteps;
          bv[jj] = Acc(BCol ? b[j * ldb + k] : b[k * ldb + j]);
        }
        for (int ii = 0; ii < TM; ++ii) {
          for (int jj = 0; jj < TN; ++jj) {
            acc[ii][jj] += av[ii] * bv[jj];
          }
        }
      }
      for (int ii = 0; ii < TM; ++ii) {
        for (int jj = 0; jj < TN; ++jj) {
          c[(i0 + ii * kRowSteps) * ldc + j0 + jj * kColSteps] = acc[ii][jj];
        }
      }
    }
  }
}

// Hands out 128-byte aligned pieces of a kernel's dynamic shared memory.
struct SharedCarver {
  char* next;
  template <typename T>
  FASTMHA_DEVICE T* take(size_t count) {
    T* ptr = reinterpret_cast<T*>(next);
    next += align128(count * sizeof(T));
    return ptr;
  }
};

}  // namespace fastmha::cuda_kernels
