// The flash-style forward (weights not kept): one thread block owns BM query rows of one head, streams
// the keys and values in blocks of BN through shared memory and keeps an online softmax (running max m,
// running sum l, rescaled output O) in Acc, so no Lq x Lk buffer exists. Masked scores are -1e9 exactly as
// in the document, so a fully masked row ends up uniform over all keys.
#pragma once

#include "ops/cuda/flash/block_gemm.h"

namespace fastmha::cuda_kernels {

// Tensor-core tiles are multiples of 16; the FMA path goes down to 8 (double with d up to 256).
template <typename T>
constexpr int smallest_tile() {
  return uses_tensor_cores<T>() ? 16 : 8;
}

// The largest tile side of 64, 32, 16, 8 whose shared memory (bytes_for(side)) fits the budget.
template <typename Bytes>
constexpr int largest_fitting(Bytes bytes_for) {
  for (int side = 64; side > 8; side /= 2) {
    if (bytes_for(side) <= kSharedBudget) {
      return side;
    }
  }
  return 8;
}

template <typename T, typename Acc, int DP>
struct ForwardTiles {
  static constexpr int kLd = DP + operand_pad<T>();  // q, k, v tiles
  static constexpr size_t bytes(int bm, int bn) {
    return align128(size_t(bm) * kLd * sizeof(T)) + 2 * align128(size_t(bn) * kLd * sizeof(T)) +
           align128(size_t(bm) * (bn + accumulator_pad<T>()) * sizeof(Acc)) +
           align128(size_t(bm) * (bn + operand_pad<T>()) * sizeof(T)) +
           align128(size_t(bm) * (DP + accumulator_pad<T>()) * sizeof(Acc)) + 3 * align128(bm * sizeof(Acc));
  }
  // The tallest query block that fits (it cuts the K/V traffic), then the widest key block beside it.
  static constexpr int kRows = largest_fitting([](int bm) { return bytes(bm, smallest_tile<T>()); });
  static constexpr int kCols = largest_fitting([](int bn) { return bytes(kRows, bn); });
  static constexpr int kLdS = kCols + accumulator_pad<T>();
  static constexpr int kLdP = kCols + operand_pad<T>();
  static constexpr int kLdO = DP + accumulator_pad<T>();
  static constexpr size_t kSharedBytes = bytes(kRows, kCols);
  static_assert(kSharedBytes <= kSharedBudget, "forward tiles do not fit in shared memory");
};

template <typename T, typename Acc, int DP>
struct ForwardShared {
  using Tiles = ForwardTiles<T, Acc, DP>;
  T *q, *k, *v;
  Acc* s;  // scores of the current key block, then their masked, scaled values
  T* p;    // exp(s - m) times the dropout multipliers, the operand of P @ V
  Acc* o;  // unnormalised output
  Acc *m, *l, *alpha;

  FASTMHA_DEVICE static ForwardShared carve(char* smem) {
    SharedCarver c{smem};
    ForwardShared s;
    s.q = c.take<T>(Tiles::kRows * Tiles::kLd);
    s.k = c.take<T>(Tiles::kCols * Tiles::kLd);
    s.v = c.take<T>(Tiles::kCols * Tiles::kLd);
    s.s = c.take<Acc>(Tiles::kRows * Tiles::kLdS);
    s.p = c.take<T>(Tiles::kRows * Tiles::kLdP);
    s.o = c.take<Acc>(Tiles::kRows * Tiles::kLdO);
    s.m = c.take<Acc>(Tiles::kRows);
    s.l = c.take<Acc>(Tiles::kRows);
    s.alpha = c.take<Acc>(Tiles::kRows);
    return s;
  }
};

// One key block: S = Q K^T, the online-softmax update of each row, O = alpha O + P V. `reads_mask` is false on a
// tile whose mask entries are all kept (only the causal cut applies there).
template <typename T, typename Acc, int DP, typename Ctx>
FASTMHA_DEVICE void forward_key_block(const Ctx& ctx, const AttentionParams<T, Acc>& p,
                                      const ForwardShared<T, Acc, DP>& sh, int64_t bh, int q0, int k0,
                                      const MaskView& mask, bool reads_mask, uint64_t seed, uint64_t offset) {
  using Tiles = ForwardTiles<T, Acc, DP>;
  constexpr int BM = Tiles::kRows, BN = Tiles::kCols;
  ctx.sync();  // the previous block's products are done with k, v and p
  const T* k = head_rows(p.k, p.k_stride, bh, p.heads);
  const T* v = head_rows(p.v, p.v_stride, bh, p.heads);
  load_tile<BN, DP, Tiles::kLd>(ctx, sh.k, k, p.k_stride.row, k0, p.len_k, p.d_k);
  load_tile<BN, DP, Tiles::kLd>(ctx, sh.v, v, p.v_stride.row, k0, p.len_k, p.d_v);
  ctx.sync();
  block_gemm<false, true, false, BM, BN, DP>(ctx, sh.q, Tiles::kLd, sh.k, Tiles::kLd, sh.s, Tiles::kLdS);
  ctx.sync();
  // The online-softmax update: each warp owns BM / kWarps rows, its lanes split a row's columns, and warp
  // reductions give the row's max and sum. A lane's columns are consecutive keys, so that with two of them
  // (BN = 64) they share their Philox block.
  constexpr int kRowsPerWarp = BM / Ctx::kWarps;
  constexpr int kColsPerLane = (BN + 31) / 32;
  static_assert(BM % Ctx::kWarps == 0 && kColsPerLane <= 2, "whole rows per warp, at most two columns per lane");
  const int lane = ctx.lane();
  const bool dropout = p.dropout_p > 0.0f;
  const int width = p.len_k - k0 < BN ? p.len_k - k0 : BN;
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int r = ctx.warp() * kRowsPerWarp + rr;
    const int i = q0 + r;
    const bool row_exists = i < p.len_q;  // padding rows compute on zeros and are never written
    const Acc* s = sh.s + r * Tiles::kLdS;
    T* prob = sh.p + r * Tiles::kLdP;
    Acc score[kColsPerLane];
    Acc local_max = -Acc(INFINITY);
    for (int c = 0; c < kColsPerLane; ++c) {
      const int j = kColsPerLane * lane + c;
      score[c] = -Acc(INFINITY);
      if (j < width) {
        score[c] = row_exists && mask.masked(i, k0 + j, reads_mask) ? Acc(kMaskedScore) : s[j] * p.scale;
        local_max = score[c] > local_max ? score[c] : local_max;
      }
    }
    const Acc m_old = sh.m[r];
    const Acc block_max = ctx.warp_all_reduce(local_max, MaxOp{});
    const Acc m_new = block_max > m_old ? block_max : m_old;
    Acc local_sum = 0;
    const uint64_t first = (static_cast<uint64_t>(bh) * p.len_q + i) * p.len_k + k0 + kColsPerLane * lane;
    Acc keep[2] = {1, 1};
    if (dropout && row_exists && kColsPerLane * lane < width) {
      if constexpr (kColsPerLane == 2) {
        dropout_multipliers2(seed, offset, first, p.dropout_p, p.dropout_scale, keep);
      } else {
        keep[0] = philox::keep_scale(seed, offset, first, p.dropout_p, p.dropout_scale);
      }
    }
    for (int c = 0; c < kColsPerLane; ++c) {
      const int j = kColsPerLane * lane + c;
      if (j < width) {
        const Acc e = exp_acc(score[c] - m_new);
        local_sum += e;
        prob[j] = T(e * keep[c]);
      } else if (j < BN) {
        prob[j] = T(0.0f);  // keys past Lk do not exist
      }
    }
    const Acc sum = ctx.warp_all_reduce(local_sum, SumOp{});
    ctx.warp_sync();  // every lane has read m_old before lane 0 replaces it
    if (lane == 0) {
      const Acc alpha = exp_acc(m_old - m_new);  // 0 on the first block (m_old = -inf)
      sh.alpha[r] = alpha;
      sh.m[r] = m_new;
      sh.l[r] = sh.l[r] * alpha + sum;
    }
  }
  ctx.sync();
  for (int idx = ctx.thread(); idx < BM * DP; idx += Ctx::kThreads) {
    sh.o[(idx / DP) * Tiles::kLdO + idx % DP] *= sh.alpha[idx / DP];
  }
  ctx.sync();
  block_gemm<false, false, true, BM, DP, BN>(ctx, sh.p, Tiles::kLdP, sh.v, Tiles::kLd, sh.o, Tiles::kLdO);
}

// The whole forward of query block `m_block` of head `bh` (= b * heads + h).
template <typename T, typename Acc, int DP, typename Ctx>
FASTMHA_DEVICE void flash_forward_block(const Ctx& ctx, const AttentionParams<T, Acc>& p, char* smem, int64_t bh,
                                        int m_block) {
  using Tiles = ForwardTiles<T, Acc, DP>;
  constexpr int BM = Tiles::kRows, BN = Tiles::kCols;
  const auto sh = ForwardShared<T, Acc, DP>::carve(smem);
  const int q0 = m_block * BM;
  const T* q = head_rows(p.q, p.q_stride, bh, p.heads);
  load_tile<BM, DP, Tiles::kLd>(ctx, sh.q, q, p.q_stride.row, q0, p.len_q, p.d_k);
  for (int idx = ctx.thread(); idx < BM * Tiles::kLdO; idx += Ctx::kThreads) {
    sh.o[idx] = Acc(0);
  }
  for (int r = ctx.thread(); r < BM; r += Ctx::kThreads) {
    sh.m[r] = -Acc(INFINITY);
    sh.l[r] = Acc(0);
  }
  const auto [seed, offset] = dropout_stream(p);
  const MaskView mask = flash_mask_view(p, bh);
  const int key_blocks = (p.len_k + BN - 1) / BN;
  const int visible = visible_key_blocks(p, mask, q0, BM, BN);
  // Key blocks in which no row of this block sees a key (masked, or past the causal diagonal) are skipped: they
  // would add exp(-1e9 - m) = 0 to every row that sees some key.
  for (int nb = 0; nb < visible; ++nb) {
    const TileView tile = classify_tile(ctx, mask, q0, BM, nb * BN, BN, p.len_q, p.len_k);
    if (tile.any_visible) {
      forward_key_block<T, Acc, DP>(ctx, p, sh, bh, q0, nb * BN, mask, !tile.mask_keeps_all, seed, offset);
    }
  }
  if (p.mask != nullptr || p.is_causal) {  // else nothing was skipped
    // A row masked everywhere (in the blocks it saw, so in all) is uniform over *all* keys: let it see the
    // skipped blocks too.
    static_assert(BM <= Ctx::kThreads, "one thread per row asks");
    ctx.sync();
    const int r = ctx.thread();
    if (ctx.sync_or(r < BM && q0 + r < p.len_q && sh.m[r] < Acc(kMaskedScore / 2))) {
      for (int nb = 0; nb < key_blocks; ++nb) {
        if (nb >= visible || !classify_tile(ctx, mask, q0, BM, nb * BN, BN, p.len_q, p.len_k).any_visible) {
          forward_key_block<T, Acc, DP>(ctx, p, sh, bh, q0, nb * BN, mask, /*reads_mask=*/true, seed, offset);
        }
      }
    }
  }
  ctx.sync();
  T* out = p.out + bh * static_cast<int64_t>(p.len_q) * p.d_v;
  for (int idx = ctx.thread(); idx < BM * p.d_v; idx += Ctx::kThreads) {
    const int r = idx / p.d_v, c = idx % p.d_v;
    if (q0 + r < p.len_q) {
      out[static_cast<int64_t>(q0 + r) * p.d_v + c] = T(sh.o[r * Tiles::kLdO + c] / sh.l[r]);
    }
  }
  for (int r = ctx.thread(); r < BM; r += Ctx::kThreads) {
    if (q0 + r < p.len_q) {
      p.lse[bh * p.len_q + q0 + r] = sh.m[r] + log_acc(sh.l[r]);
    }
  }
}

}  // namespace fastmha::cuda_kernels
