// Operand fragments of mma.sync.m16n8k16 (PTX ISA layouts) loaded from shared-memory tiles with ldmatrix.x4,
// for the mma kernels (flash_forward_mma.h, flash_backward_mma.h). Tiles are row-major with `ld` elements per row
// (16-byte aligned rows); g = lane / 4 and c = 2 (lane % 4) below.
//  - A (16 x 16, m x k): register r holds row g + 8 (r % 2), columns c + 8 (r / 2) and + 1.
//  - B (16 x 8, k x n): register r holds rows c + 8 r and + 1 of column g; the loads give two 8-column tiles.
//  - C (16 x 8, fp32): element e is row g + 8 (e / 2), column c + e % 2.
#pragma once

#include <cstdint>

#include "ops/cuda/flash/block_gemm.h"

namespace fastmha::cuda_kernels {

// A = tile[m0.., k0..] (rows are m). Lane l names row m0 + l % 16, columns k0 + 8 (l / 16) on.
template <typename Ctx, typename T>
FASTMHA_DEVICE void load_a(const Ctx& ctx, uint32_t (&a)[4], const T* tile, int ld, int m0, int k0) {
  const int lane = ctx.lane();
  ctx.template ldmatrix_x4<false>(a, tile + (m0 + lane % 16) * ld + k0 + 8 * (lane / 16));
}

// A = tile[k0.., m0..]^T (rows are k). Lane l names row k0 + l % 8 + 8 (l / 16), columns m0 + 8 ((l / 8) % 2) on.
template <typename Ctx, typename T>
FASTMHA_DEVICE void load_a_transposed(const Ctx& ctx, uint32_t (&a)[4], const T* tile, int ld, int m0, int k0) {
  const int lane = ctx.lane();
  ctx.template ldmatrix_x4<true>(a, tile + (k0 + lane % 8 + 8 * (lane / 16)) * ld + m0 + 8 * ((lane / 8) % 2));
}

// B = tile[n0.., k0..]^T (rows are n), n0..n0+15: b[0], b[1] for columns n0..+7 and b[2], b[3] for n0+8..+15.
// Lane l names row n0 + l % 8 + 8 (l / 16), columns k0 + 8 ((l / 8) % 2) on.
template <typename Ctx, typename T>
FASTMHA_DEVICE void load_b_pair(const Ctx& ctx, uint32_t (&b)[4], const T* tile, int ld, int n0, int k0) {
  const int lane = ctx.lane();
  ctx.template ldmatrix_x4<false>(b, tile + (n0 + lane % 8 + 8 * (lane / 16)) * ld + k0 + 8 * ((lane / 8) % 2));
}

// B = tile[k0.., n0..] (rows are k), as load_b_pair. Lane l names row k0 + l % 8 + 8 ((l / 8) % 2), columns
// n0 + 8 (l / 16) on.
template <typename Ctx, typename T>
FASTMHA_DEVICE void load_b_pair_transposed(const Ctx& ctx, uint32_t (&b)[4], const T* tile, int ld, int n0, int k0) {
  const int lane = ctx.lane();
  ctx.template ldmatrix_x4<true>(b, tile + (k0 + lane % 8 + 8 * ((lane / 8) % 2)) * ld + n0 + 8 * (lane / 16));
}

// c0 += A B[:, 0:8] and c1 += A B[:, 8:16] with b from one of the load_b_pair loaders.
template <typename T, typename Ctx>
FASTMHA_DEVICE void mma_pair(const Ctx& ctx, float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                             const uint32_t (&b)[4]) {
  ctx.template mma_m16n8k16<T>(c0, a, b[0], b[1]);
  ctx.template mma_m16n8k16<T>(c1, a, b[2], b[3]);
}

// The 32-bit mma operand holding two adjacent elements (the first in the low half), rounded to nearest even.
template <typename T>
FASTMHA_DEVICE uint32_t pack_pair(float first, float second) {
  const T lo(first), hi(second);
  return static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
}

// C tile nt of a 16-row block (elements c[0..3], 8 columns) into the A operand of k-step nt / 2: the C layout of
// two 8-column tiles is the A layout of one 16-column step, the even tile its low half and the odd one its high.
template <typename T>
FASTMHA_DEVICE void pack_c_into_a(uint32_t (&a)[4], int nt, const float (&c)[4]) {
  a[2 * (nt % 2)] = pack_pair<T>(c[0], c[1]);
  a[2 * (nt % 2) + 1] = pack_pair<T>(c[2], c[3]);
}

// Starts copying rows [first, first + ROWS) of a (count, cols) matrix into tile[ROWS][LD] with cp.async,
// zeros past `count` and `cols`; rows that are not whole, aligned 16-byte chunks are copied directly instead.
template <int ROWS, int DP, int LD, typename Ctx, typename T>
FASTMHA_DEVICE void load_tile_async(const Ctx& ctx, T* tile, const T* src, int64_t stride, int first, int count,
                                    int cols) {
  constexpr int kChunk = 8;  // elements in 16 bytes
  if (cols % kChunk != 0 || stride % kChunk != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    load_tile<ROWS, DP, LD>(ctx, tile, src, stride, first, count, cols);
    return;
  }
  constexpr int kChunks = DP / kChunk;
  for (int idx = ctx.thread(); idx < ROWS * kChunks; idx += Ctx::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * kChunk;
    const int row = first + r;
    if (row < count && c < cols) {
      ctx.copy_async16(tile + r * LD + c, src + row * stride + c);
    } else {
      *reinterpret_cast<Chunk16*>(tile + r * LD + c) = Chunk16{0, 0, 0, 0};
    }
  }
}

}  // namespace fastmha::cuda_kernels
