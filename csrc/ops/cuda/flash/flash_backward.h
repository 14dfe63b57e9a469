// The FlashAttention-2 style backward (no Lq x Lk buffer): one thread block owns BN keys of one head and
// keeps their dK and dV in shared memory while it walks the query blocks. Each step recomputes P from the
// saved log-sum-exp, regenerates the dropout multipliers Z, and forms
//   dV += (P Z)^T dO,   dS = P (dO V^T Z - delta) (0 where masked),   dK += dS^T Q,   dQ += dS K (atomics),
// with delta = rowsum(dO * O) and the 1/sqrt(d_k) scale folded into dS.
#pragma once

#include "ops/cuda/flash/block_gemm.h"
#include "ops/cuda/flash/flash_forward.h"

namespace fastmha::cuda_kernels {

template <typename T, typename Acc, int DP>
struct BackwardTiles {
  static constexpr int kLd = DP + operand_pad<T>();         // q, k, v, dO tiles
  static constexpr int kLdAcc = DP + accumulator_pad<T>();  // dK, dV, dQ accumulators
  static constexpr size_t bytes(int bn, int bm) {
    const size_t scores = size_t(bm) * (bn + accumulator_pad<T>()) * sizeof(Acc);
    const size_t dq = size_t(bm) * kLdAcc * sizeof(Acc);  // shares the scores' memory
    return 2 * align128(size_t(bm) * kLd * sizeof(T)) + 2 * align128(size_t(bn) * kLd * sizeof(T)) +
           align128(scores > dq ? scores : dq) + align128(scores) +
           2 * align128(size_t(bm) * (bn + operand_pad<T>()) * sizeof(T)) +
           2 * align128(size_t(bn) * kLdAcc * sizeof(Acc)) + 2 * align128(bm * sizeof(Acc));
  }
  // The widest key block that fits with the smallest query block, then the tallest query block beside it.
  static constexpr int kCols = largest_fitting([](int bn) { return bytes(bn, smallest_tile<T>()); });
  static constexpr int kRows = largest_fitting([](int bm) { return bytes(kCols, bm); });
  static constexpr int kLdS = kCols + accumulator_pad<T>();
  static constexpr int kLdP = kCols + operand_pad<T>();
  static constexpr size_t kSharedBytes = bytes(kCols, kRows);
  static_assert(kSharedBytes <= kSharedBudget, "backward tiles do not fit in shared memory");
};

template <typename T, typename Acc, int DP>
struct BackwardShared {
  using Tiles = BackwardTiles<T, Acc, DP>;
  T *q, *grad_out, *k, *v;
  Acc* s;       // scores; after the elementwise step the same memory holds dS K for dQ
  Acc* grad_p;  // dO V^T
  T *w, *ds;    // P Z and dS, operands of the products
  Acc *grad_k, *grad_v;
  Acc *lse, *delta;

  FASTMHA_DEVICE static BackwardShared carve(char* smem) {
    constexpr int BM = Tiles::kRows, BN = Tiles::kCols;
    SharedCarver c{smem};
    BackwardShared s;
    s.q = c.take<T>(BM * Tiles::kLd);
    s.grad_out = c.take<T>(BM * Tiles::kLd);
    s.k = c.take<T>(BN * Tiles::kLd);
    s.v = c.take<T>(BN * Tiles::kLd);
    s.s = c.take<Acc>(BM * (Tiles::kLdS > Tiles::kLdAcc ? Tiles::kLdS : Tiles::kLdAcc));
    s.grad_p = c.take<Acc>(BM * Tiles::kLdS);
    s.w = c.take<T>(BM * Tiles::kLdP);
    s.ds = c.take<T>(BM * Tiles::kLdP);
    s.grad_k = c.take<Acc>(BN * Tiles::kLdAcc);
    s.grad_v = c.take<Acc>(BN * Tiles::kLdAcc);
    s.lse = c.take<Acc>(BM);
    s.delta = c.take<Acc>(BM);
    return s;
  }
};

// One query block against the block's keys; `reads_mask` as from stage_query_step.
template <typename T, typename Acc, int DP, typename Ctx>
FASTMHA_DEVICE void backward_query_block(const Ctx& ctx, const AttentionParams<T, Acc>& p,
                                         const BackwardShared<T, Acc, DP>& sh, int64_t bh, int q0, int k0,
                                         const MaskView& mask, bool reads_mask, uint64_t seed, uint64_t offset) {
  using Tiles = BackwardTiles<T, Acc, DP>;
  constexpr int BM = Tiles::kRows, BN = Tiles::kCols;
  const T* q = head_rows(p.q, p.q_stride, bh, p.heads);
  const T* grad_out = p.grad_out + bh * static_cast<int64_t>(p.len_q) * p.d_v;
  load_tile<BM, DP, Tiles::kLd>(ctx, sh.q, q, p.q_stride.row, q0, p.len_q, p.d_k);
  load_tile<BM, DP, Tiles::kLd>(ctx, sh.grad_out, grad_out, p.d_v, q0, p.len_q, p.d_v);
  ctx.sync();
  block_gemm<false, true, false, BM, BN, DP>(ctx, sh.q, Tiles::kLd, sh.k, Tiles::kLd, sh.s, Tiles::kLdS);
  block_gemm<false, true, false, BM, BN, DP>(ctx, sh.grad_out, Tiles::kLd, sh.v, Tiles::kLd, sh.grad_p, Tiles::kLdS);
  ctx.sync();
  // Elementwise, four consecutive keys per step (they share Philox blocks).
  for (int idx = ctx.thread(); idx < BM * (BN / 4); idx += Ctx::kThreads) {
    const int r = idx / (BN / 4), j0 = (idx % (BN / 4)) * 4;
    const int i = q0 + r;
    Acc keep[4] = {1, 1, 1, 1};
    const uint64_t first = (static_cast<uint64_t>(bh) * p.len_q + i) * p.len_k + k0 + j0;
    if (p.dropout_p > 0.0f && i < p.len_q && k0 + j0 < p.len_k) {
      dropout_multipliers4(seed, offset, first, p.dropout_p, p.dropout_scale, keep);
    }
    for (int t = 0; t < 4; ++t) {
      const int j = j0 + t, key = k0 + j;
      Acc w = 0, ds = 0;
      if (i < p.len_q && key < p.len_k) {
        const Acc lse = sh.lse[r];
        const bool masked = mask.masked(i, key, reads_mask);
        Acc prob;
        if (masked_everywhere(lse)) {
          prob = Acc(1) / Acc(p.len_k);
        } else {
          prob = exp_acc((masked ? Acc(kMaskedScore) : sh.s[r * Tiles::kLdS + j] * p.scale) - lse);
        }
        w = prob * keep[t];
        const Acc grad_prob = sh.grad_p[r * Tiles::kLdS + j] * keep[t];
        ds = masked ? Acc(0) : prob * (grad_prob - sh.delta[r]) * p.scale;
      }
      sh.w[r * Tiles::kLdP + j] = T(w);
      sh.ds[r * Tiles::kLdP + j] = T(ds);
    }
  }
  ctx.sync();
  block_gemm<true, false, true, BN, DP, BM>(ctx, sh.w, Tiles::kLdP, sh.grad_out, Tiles::kLd, sh.grad_v, Tiles::kLdAcc);
  block_gemm<true, false, true, BN, DP, BM>(ctx, sh.ds, Tiles::kLdP, sh.q, Tiles::kLd, sh.grad_k, Tiles::kLdAcc);
  Acc* grad_q_part = sh.s;  // the scores are no longer needed
  block_gemm<false, false, false, BM, DP, BN>(ctx, sh.ds, Tiles::kLdP, sh.k, Tiles::kLd, grad_q_part, Tiles::kLdAcc);
  ctx.sync();
  Acc* grad_q = p.grad_q_acc + bh * static_cast<int64_t>(p.len_q) * p.d_k;
  for (int idx = ctx.thread(); idx < BM * p.d_k; idx += Ctx::kThreads) {
    const int r = idx / p.d_k, c = idx % p.d_k;
    if (q0 + r < p.len_q) {
      ctx.atomic_add(grad_q + static_cast<int64_t>(q0 + r) * p.d_k + c, grad_q_part[r * Tiles::kLdAcc + c]);
    }
  }
  ctx.sync();  // the next query block reloads q, dO and the scores
}

// The whole backward of key block `n_block` of head `bh`.
template <typename T, typename Acc, int DP, typename Ctx>
FASTMHA_DEVICE void flash_backward_block(const Ctx& ctx, const AttentionParams<T, Acc>& p, char* smem, int64_t bh,
                                         int n_block) {
  using Tiles = BackwardTiles<T, Acc, DP>;
  constexpr int BM = Tiles::kRows, BN = Tiles::kCols;
  const auto sh = BackwardShared<T, Acc, DP>::carve(smem);
  const int k0 = n_block * BN;
  const T* k = head_rows(p.k, p.k_stride, bh, p.heads);
  const T* v = head_rows(p.v, p.v_stride, bh, p.heads);
  load_tile<BN, DP, Tiles::kLd>(ctx, sh.k, k, p.k_stride.row, k0, p.len_k, p.d_k);
  load_tile<BN, DP, Tiles::kLd>(ctx, sh.v, v, p.v_stride.row, k0, p.len_k, p.d_v);
  for (int idx = ctx.thread(); idx < BN * Tiles::kLdAcc; idx += Ctx::kThreads) {
    sh.grad_k[idx] = Acc(0);
    sh.grad_v[idx] = Acc(0);
  }
  const auto [seed, offset] = dropout_stream(p);
  const MaskView mask = flash_mask_view(p, bh);
  const int query_blocks = (p.len_q + BM - 1) / BM;
  for (int mb = 0; mb < query_blocks; ++mb) {
    const int q0 = mb * BM;
    ctx.sync();
    bool reads_mask = true;
    if (stage_query_step(ctx, p, bh, q0, BM, k0, BN, mask, reads_mask, sh.lse, sh.delta)) {
      backward_query_block<T, Acc, DP>(ctx, p, sh, bh, q0, k0, mask, reads_mask, seed, offset);
    }
  }
  ctx.sync();
  T* grad_k = p.grad_k + bh * static_cast<int64_t>(p.len_k) * p.d_k;
  T* grad_v = p.grad_v + bh * static_cast<int64_t>(p.len_k) * p.d_v;
  for (int idx = ctx.thread(); idx < BN * p.d_k; idx += Ctx::kThreads) {
    const int r = idx / p.d_k, c = idx % p.d_k;
    if (k0 + r < p.len_k) {
      grad_k[static_cast<int64_t>(k0 + r) * p.d_k + c] = T(sh.grad_k[r * Tiles::kLdAcc + c]);
    }
  }
  for (int idx = ctx.thread(); idx < BN * p.d_v; idx += Ctx::kThreads) {
    const int r = idx / p.d_v, c = idx % p.d_v;
    if (k0 + r < p.len_k) {
      grad_v[static_cast<int64_t>(k0 + r) * p.d_v + c] = T(sh.grad_v[r * Tiles::kLdAcc + c]);
    }
  }
}

}  // namespace fastmha::cuda_kernels
