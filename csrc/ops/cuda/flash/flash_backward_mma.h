// The register-resident flash backward for float16 and bfloat16 (sm_80 and newer), weights not kept. A thread
// block of 4 warps owns 64 keys of one head, each warp 16 of them, and walks the query blocks. Each warp works
// on the transposed problem, keys as rows, so that its results stay in mma fragments:
//   S^T = K Q^T,  P^T = exp(scale S^T - lse) (uniform for rows masked everywhere),  dP^T = V dO^T,
//   dS^T = P^T (dP^T Z - delta) scale (0 where masked),  dV += (P^T Z) dO,  dK += dS^T Q,
// with Z the dropout multipliers. dK and dV accumulate in registers for the whole walk. dQ += dS K needs dS with
// queries as rows: the warps put dS^T in shared memory, each warp multiplies a quarter of dQ's columns and adds
// them into the fp32 dQ buffer with atomics. The numbers are the WMMA backward's (flash_backward.h).
#pragma once

#include "ops/cuda/flash/mma_fragments.h"

namespace fastmha::cuda_kernels {

template <int DP>
struct MmaBackwardTiles {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCols = 16 * kWarps;  // keys of a block
  static constexpr int kRows = 32;           // queries of a step (registers: S^T, dP^T grow with it)
  static constexpr int kLd = DP + 8;         // K, V, Q, dO rows (16 bytes of padding: no bank conflicts)
  static constexpr int kLdS = kRows + 8;     // dS^T rows
  static constexpr int kKeyTile = kCols * kLd, kQueryTile = kRows * kLd;  // elements
  static constexpr size_t kSharedBytes =
      (2 * size_t(kKeyTile) + 2 * size_t(kQueryTile) + size_t(kCols) * kLdS) * 2 + 2 * kRows * sizeof(float);
  static_assert(DP % 64 == 0 && kSharedBytes <= kSharedBudget, "mma backward tiles: dQ gives each warp 16k columns");
};

// K, V, Q, dO, dS^T (T), then lse and delta of the query step (float).
template <int DP, typename T>
struct MmaBackwardShared {
  using Tiles = MmaBackwardTiles<DP>;
  T* k;
  FASTMHA_DEVICE T* v() const { return k + Tiles::kKeyTile; }
  FASTMHA_DEVICE T* q() const { return k + 2 * Tiles::kKeyTile; }
  FASTMHA_DEVICE T* grad_out() const { return q() + Tiles::kQueryTile; }
  FASTMHA_DEVICE T* ds() const { return grad_out() + Tiles::kQueryTile; }
  FASTMHA_DEVICE float* lse() const { return reinterpret_cast<float*>(ds() + Tiles::kCols * Tiles::kLdS); }
  FASTMHA_DEVICE float* delta() const { return lse() + Tiles::kRows; }
};

// The per-warp accumulators of its 16 keys: dK and dV in the C layout (rows are keys).
template <int DP>
struct MmaBackwardState {
  float grad_k[DP / 8][4];
  float grad_v[DP / 8][4];
};

// Query step q0 against the block's keys k0.. (K and V in shared memory); `reads_mask` as from stage_query_step.
template <typename T, int DP, typename Ctx>
FASTMHA_DEVICE void mma_backward_query_step(const Ctx& ctx, const AttentionParams<T, float>& p,
                                            const MmaBackwardShared<DP, T>& sh, MmaBackwardState<DP>& st, int64_t bh,
                                            int q0, int k0, const MaskView& mask, bool reads_mask,
                                            DropoutStream stream) {
  using Tiles = MmaBackwardTiles<DP>;
  constexpr int BM = Tiles::kRows, LD = Tiles::kLd;
  constexpr int kTilesN = BM / 8;  // 8-query tiles of a warp's 16 keys
  const T* q = head_rows(p.q, p.q_stride, bh, p.heads);
  const T* grad_out = p.grad_out + bh * static_cast<int64_t>(p.len_q) * p.d_v;
  load_tile_async<BM, DP, LD>(ctx, sh.q(), q, p.q_stride.row, q0, p.len_q, p.d_k);
  load_tile_async<BM, DP, LD>(ctx, sh.grad_out(), grad_out, p.d_v, q0, p.len_q, p.d_v);
  ctx.copy_commit();
  ctx.template copy_wait<0>();
  ctx.sync();  // Q, dO, lse and delta of this step (and K, V on the first) are in place

  const int lane = ctx.lane(), warp = ctx.warp();
  const int t2 = 2 * (lane % 4);
  const int key_row0 = warp * 16 + lane / 4;  // the lane's first key in the block; the second is 8 further on
  float s[kTilesN][4], grad_p[kTilesN][4];
  FASTMHA_UNROLL
  for (int nt = 0; nt < kTilesN; ++nt) {
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = grad_p[nt][e] = 0.0f;
    }
  }
  // S^T = K Q^T and dP^T = V dO^T: A from the warp's K and V rows, B from the Q and dO rows.
  FASTMHA_UNROLL
  for (int kk = 0; kk < DP / 16; ++kk) {
    uint32_t a_k[4], a_v[4];
    load_a(ctx, a_k, sh.k, LD, warp * 16, kk * 16);
    load_a(ctx, a_v, sh.v(), LD, warp * 16, kk * 16);
    FASTMHA_UNROLL
    for (int np = 0; np < BM / 16; ++np) {
      uint32_t b[4];
      load_b_pair(ctx, b, sh.q(), LD, np * 16, kk * 16);
      mma_pair<T>(ctx, s[2 * np], s[2 * np + 1], a_k, b);
      load_b_pair(ctx, b, sh.grad_out(), LD, np * 16, kk * 16);
      mma_pair<T>(ctx, grad_p[2 * np], grad_p[2 * np + 1], a_v, b);
    }
  }

  // Elementwise: element e of tile nt is key k0 + key_row0 + 8 (e / 2), query q0 + 8 nt + t2 + e % 2.
  uint32_t weights[BM / 16][4], grad_s[BM / 16][4];  // P^T Z and dS^T as A operands (rows keys, k queries)
  T* ds_tile = sh.ds();
  FASTMHA_UNROLL
  for (int nt = 0; nt < kTilesN; ++nt) {
    float w[4], ds[4];
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int r = 8 * nt + t2 + e % 2;
      const int i = q0 + r, key = k0 + key_row0 + 8 * (e / 2);
      w[e] = ds[e] = 0.0f;
      if (i < p.len_q && key < p.len_k) {
        const float lse = sh.lse()[r];
        const bool masked = mask.masked(i, key, reads_mask);
        float prob;
        if (masked_everywhere(lse)) {
          prob = 1.0f / static_cast<float>(p.len_k);
        } else {
          prob = exp_acc((masked ? kMaskedScore : s[nt][e] * p.scale) - lse);
        }
        float keep = 1.0f;
        if (p.dropout_p > 0.0f) {
          keep =
              philox::keep_scale(stream.seed, stream.offset, (static_cast<uint64_t>(bh) * p.len_q + i) * p.len_k + key,
                                 p.dropout_p, p.dropout_scale);
        }
        w[e] = prob * keep;
        ds[e] = masked ? 0.0f : prob * (grad_p[nt][e] * keep - sh.delta()[r]) * p.scale;
      }
    }
    pack_c_into_a<T>(weights[nt / 2], nt, w);
    pack_c_into_a<T>(grad_s[nt / 2], nt, ds);
    // dS^T in shared memory for dQ: rows are keys.
    FASTMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<uint32_t*>(ds_tile + (key_row0 + 8 * h) * Tiles::kLdS + 8 * nt + t2) =
          pack_pair<T>(ds[2 * h], ds[2 * h + 1]);
    }
  }

  // dV += (P^T Z) dO and dK += dS^T Q: B from the dO and Q rows, transposed (rows are the k dimension).
  FASTMHA_UNROLL
  for (int kk = 0; kk < BM / 16; ++kk) {
    FASTMHA_UNROLL
    for (int np = 0; np < DP / 16; ++np) {
      uint32_t b[4];
      load_b_pair_transposed(ctx, b, sh.grad_out(), LD, np * 16, kk * 16);
      mma_pair<T>(ctx, st.grad_v[2 * np], st.grad_v[2 * np + 1], weights[kk], b);
      load_b_pair_transposed(ctx, b, sh.q(), LD, np * 16, kk * 16);
      mma_pair<T>(ctx, st.grad_k[2 * np], st.grad_k[2 * np + 1], grad_s[kk], b);
    }
  }
  ctx.sync();  // every warp's dS^T is in place

  // dQ[q0.., warp's quarter of the columns] += dS K: A = (dS^T)^T, B = K rows (the k dimension is keys).
  constexpr int kQuarter = DP / 4, kTilesD = kQuarter / 8;
  float* grad_q = p.grad_q_acc + bh * static_cast<int64_t>(p.len_q) * p.d_k;
  FASTMHA_UNROLL
  for (int mt = 0; mt < BM / 16; ++mt) {
    float acc[kTilesD][4];
    FASTMHA_UNROLL
    for (int dt = 0; dt < kTilesD; ++dt) {
      acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    }
    FASTMHA_UNROLL
    for (int kk = 0; kk < Tiles::kCols / 16; ++kk) {
      uint32_t a[4];
      load_a_transposed(ctx, a, ds_tile, Tiles::kLdS, mt * 16, kk * 16);
      FASTMHA_UNROLL
      for (int np = 0; np < kTilesD / 2; ++np) {
        uint32_t b[4];
        load_b_pair_transposed(ctx, b, sh.k, LD, warp * kQuarter + np * 16, kk * 16);
        mma_pair<T>(ctx, acc[2 * np], acc[2 * np + 1], a, b);
      }
    }
    FASTMHA_UNROLL
    for (int dt = 0; dt < kTilesD; ++dt) {
      FASTMHA_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int i = q0 + mt * 16 + lane / 4 + 8 * (e / 2), c = warp * kQuarter + 8 * dt + t2 + e % 2;
        if (i < p.len_q && c < p.d_k) {
          ctx.atomic_add(grad_q + static_cast<int64_t>(i) * p.d_k + c, acc[dt][e]);
        }
      }
    }
  }
  ctx.sync();  // the next step reloads Q, dO, lse, delta and dS^T
}

// The whole backward of key block `n_block` of head `bh`.
template <typename T, int DP, typename Ctx>
FASTMHA_DEVICE void flash_backward_mma_block(const Ctx& ctx, const AttentionParams<T, float>& p, char* smem, int64_t bh,
                                             int n_block) {
  using Tiles = MmaBackwardTiles<DP>;
  static_assert(Ctx::kThreads == Tiles::kThreads, "4 warps");
  constexpr int BM = Tiles::kRows, BN = Tiles::kCols, LD = Tiles::kLd;
  const MmaBackwardShared<DP, T> sh{reinterpret_cast<T*>(smem)};
  const int k0 = n_block * BN;
  const T* k = head_rows(p.k, p.k_stride, bh, p.heads);
  const T* v = head_rows(p.v, p.v_stride, bh, p.heads);
  load_tile_async<BN, DP, LD>(ctx, sh.k, k, p.k_stride.row, k0, p.len_k, p.d_k);
  load_tile_async<BN, DP, LD>(ctx, sh.v(), v, p.v_stride.row, k0, p.len_k, p.d_v);
  ctx.copy_commit();  // waited for with the first step's Q and dO
  MmaBackwardState<DP> st;
  FASTMHA_UNROLL
  for (int dt = 0; dt < DP / 8; ++dt) {
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      st.grad_k[dt][e] = st.grad_v[dt][e] = 0.0f;
    }
  }
  const auto stream = dropout_stream(p);
  const MaskView mask = flash_mask_view(p, bh);
  const int query_steps = (p.len_q + BM - 1) / BM;
  // is_causal without a mask leaves no row masked everywhere: the steps of rows above this key block see none
  // of its keys and are not staged at all (where the head skips).
  const bool above_diagonal_skipped = p.is_causal && p.mask == nullptr && mask.skip_hidden;
  const int first_step = above_diagonal_skipped ? (k0 / BM < query_steps ? k0 / BM : query_steps) : 0;
  for (int mb = first_step; mb < query_steps; ++mb) {
    const int q0 = mb * BM;
    bool reads_mask = true;
    if (stage_query_step(ctx, p, bh, q0, BM, k0, BN, mask, reads_mask, sh.lse(), sh.delta())) {
      mma_backward_query_step<T, DP>(ctx, p, sh, st, bh, q0, k0, mask, reads_mask, stream);
    }
  }
  ctx.template copy_wait<0>();  // K and V, when no step ran
  const int lane = ctx.lane();
  const int key_row0 = ctx.warp() * 16 + lane / 4, t2 = 2 * (lane % 4);
  T* grad_k = p.grad_k + bh * static_cast<int64_t>(p.len_k) * p.d_k;
  T* grad_v = p.grad_v + bh * static_cast<int64_t>(p.len_k) * p.d_v;
  FASTMHA_UNROLL
  for (int dt = 0; dt < DP / 8; ++dt) {
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int key = k0 + key_row0 + 8 * (e / 2), c = 8 * dt + t2 + e % 2;
      if (key < p.len_k && c < p.d_k) {
        grad_k[static_cast<int64_t>(key) * p.d_k + c] = T(st.grad_k[dt][e]);
      }
      if (key < p.len_k && c < p.d_v) {
        grad_v[static_cast<int64_t>(key) * p.d_v + c] = T(st.grad_v[dt][e]);
      }
    }
  }
}

}  // namespace fastmha::cuda_kernels
