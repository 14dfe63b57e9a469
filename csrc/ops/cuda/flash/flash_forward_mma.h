// The register-resident flash forward for float16 and bfloat16 (sm_80 and newer), weights not kept. A thread
// block of 4 warps owns 16 x RowTiles query rows per warp of one head. Scores, probabilities and the output
// accumulator stay in registers in the fragment layout of mma.sync.m16n8k16 (PTX ISA), so the softmax of a row
// is a reduction over the 4 lanes that hold it; only Q, K and V pass through shared memory, K and V in blocks
// of kCols keys, double-buffered and loaded with cp.async while the previous block computes. Two shapes:
// RowTiles 1 keeps a warp's Q fragments in registers; RowTiles 2 (FlashAttention-2's shape) reads them from
// shared memory at each key block but feeds each K and V fragment to twice the rows. The numbers are the other
// kernels': masked scores are -1e9, rows with no visible key uniform over all keys, and the dropout multipliers
// those of the same Philox indices.
#pragma once

#include "ops/cuda/flash/mma_fragments.h"

namespace fastmha::cuda_kernels {

template <int DP, int RowTiles>
struct MmaForwardTiles {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kWarpRows = 16 * RowTiles;
  static constexpr int kRows = kWarpRows * kWarps;                  // query rows of a block
  static constexpr int kCols = RowTiles == 2 && DP > 64 ? 32 : 64;  // keys of a block (registers: O grows with DP)
  static constexpr bool kQInRegisters = RowTiles == 1;
  // 16 bytes of padding per row: the 8 rows an ldmatrix reads start on different banks.
  static constexpr int kLd = DP + 8;
  static constexpr size_t kQBytes = size_t(kRows) * kLd * 2;
  static constexpr size_t kKeyBytes = size_t(kCols) * kLd * 2;
  static constexpr size_t kSharedBytes = kQBytes + 4 * kKeyBytes;  // Q, two K and two V buffers
  static_assert((RowTiles == 1 || RowTiles == 2) && DP % 16 == 0 && kSharedBytes <= kSharedBudget, "mma forward tiles");
};

// The per-warp state of the forward: its Q fragments (RowTiles 1), the output accumulator, and for each of the
// lane's rows (row tile mt, g = lane / 4 and g + 8) the running max and the lane's share of the running sum.
template <int DP, int RowTiles>
struct MmaForwardState {
  uint32_t q[RowTiles == 1 ? DP / 16 : 1][4];
  float o[RowTiles][DP / 8][4];
  float m[RowTiles][2], l[RowTiles][2];
};

// Q, then K buffers 0 and 1, then V buffers 0 and 1. Offsets are computed rather than kept in arrays, which
// a run-time buffer index would put in local memory.
template <int DP, int RowTiles, typename T>
struct MmaForwardShared {
  using Tiles = MmaForwardTiles<DP, RowTiles>;
  T* q;
  FASTMHA_DEVICE T* k(int buffer) const { return q + Tiles::kRows * Tiles::kLd + buffer * Tiles::kCols * Tiles::kLd; }
  FASTMHA_DEVICE T* v(int buffer) const { return k(2 + buffer); }
};

// The key blocks of query block q0 of head bh in [0, last) whose tile has a visible score (`visible` true), or
// those without (false): S = Q K^T, the online softmax, O += P V. Waits for all of its copies before it returns
// (the Q tile's too, committed before the first call); `load_q` (RowTiles 1) says the Q fragments are still to
// be read from shared memory, which the first computed block does.
template <typename T, int DP, int RowTiles, typename Ctx>
FASTMHA_DEVICE void mma_forward_key_blocks(const Ctx& ctx, const AttentionParams<T, float>& p,
                                           const MmaForwardShared<DP, RowTiles, T>& sh,
                                           MmaForwardState<DP, RowTiles>& st, int64_t bh, int q0, int last,
                                           bool visible, bool& load_q, const MaskView& mask, DropoutStream stream) {
  using Tiles = MmaForwardTiles<DP, RowTiles>;
  constexpr int BM = Tiles::kRows, BN = Tiles::kCols, LD = Tiles::kLd;
  constexpr int kTilesN = BN / 8;  // 8-key score tiles per row tile
  const T* k = head_rows(p.k, p.k_stride, bh, p.heads);
  const T* v = head_rows(p.v, p.v_stride, bh, p.heads);
  const int lane = ctx.lane();
  const int t2 = 2 * (lane % 4);
  // The lane's first row in the block (of row tile 0; the others are 16 mt and 8 further on).
  const int row0 = ctx.warp() * Tiles::kWarpRows + lane / 4;
  const bool dropout = p.dropout_p > 0.0f;
  // The next block from `from` on that this call computes, and whether its scores read the mask tensor (a flag,
  // not a second view: registers are scarce here).
  auto next_block = [&](int from, bool& reads_mask) {
    for (int nb = from; nb < last; ++nb) {
      const TileView tile = classify_tile(ctx, mask, q0, BM, nb * BN, BN, p.len_q, p.len_k);
      if (tile.any_visible == visible) {
        reads_mask = !(visible && tile.mask_keeps_all);
        return nb;
      }
    }
    return last;
  };

  bool reads_mask = true;
  int nb = next_block(0, reads_mask);
  ctx.sync();  // the previous call's products are done with the K and V buffers
  if (nb < last) {
    load_tile_async<BN, DP, LD>(ctx, sh.k(0), k, p.k_stride.row, nb * BN, p.len_k, p.d_k);
    ctx.copy_commit();
  }
  for (int buffer = 0; nb < last; buffer = 1 - buffer) {
    const int k0 = nb * BN;
    const T* k_tile = sh.k(buffer);
    const T* v_tile = sh.v(buffer);
    load_tile_async<BN, DP, LD>(ctx, sh.v(buffer), v, p.v_stride.row, k0, p.len_k, p.d_v);
    ctx.copy_commit();
    // The block after this one, found here while the copies fly and before the scores take the registers.
    bool next_reads_mask = true;
    const int next = next_block(nb + 1, next_reads_mask);
    ctx.template copy_wait<1>();  // this thread's K (and Q) copies have landed
    ctx.sync();                   // and everyone's
    if constexpr (Tiles::kQInRegisters) {
      if (load_q) {
        FASTMHA_UNROLL
        for (int kk = 0; kk < DP / 16; ++kk) {
          load_a(ctx, st.q[kk], sh.q, LD, ctx.warp() * Tiles::kWarpRows, kk * 16);
        }
        load_q = false;
      }
    }
    float s[RowTiles][kTilesN][4];
    FASTMHA_UNROLL
    for (int mt = 0; mt < RowTiles; ++mt) {
      FASTMHA_UNROLL
      for (int nt = 0; nt < kTilesN; ++nt) {
        s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
      }
    }
    FASTMHA_UNROLL
    for (int kk = 0; kk < DP / 16; ++kk) {
      uint32_t a[RowTiles][4];
      FASTMHA_UNROLL
      for (int mt = 0; mt < RowTiles; ++mt) {
        if constexpr (Tiles::kQInRegisters) {
          FASTMHA_UNROLL
          for (int r = 0; r < 4; ++r) {
            a[mt][r] = st.q[kk][r];
          }
        } else {
          load_a(ctx, a[mt], sh.q, LD, ctx.warp() * Tiles::kWarpRows + mt * 16, kk * 16);
        }
      }
      FASTMHA_UNROLL
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        load_b_pair(ctx, b, k_tile, LD, np * 16, kk * 16);
        FASTMHA_UNROLL
        for (int mt = 0; mt < RowTiles; ++mt) {
          mma_pair<T>(ctx, s[mt][2 * np], s[mt][2 * np + 1], a[mt], b);
        }
      }
    }
    const bool prefetch = next < last;
    if (prefetch) {  // its buffer was last read before this block's barrier
      load_tile_async<BN, DP, LD>(ctx, sh.k(1 - buffer), k, p.k_stride.row, next * BN, p.len_k, p.d_k);
      ctx.copy_commit();
    }

    // The online softmax: element e of tile (mt, nt) is row row0 + 16 mt + 8 (e / 2), key k0 + 8 nt + t2 + e % 2.
    uint32_t prob[RowTiles][BN / 16][4];  // P Z as A fragments of the P V product
    FASTMHA_UNROLL
    for (int mt = 0; mt < RowTiles; ++mt) {
      float block_max[2] = {-INFINITY, -INFINITY};
      FASTMHA_UNROLL
      for (int nt = 0; nt < kTilesN; ++nt) {
        FASTMHA_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int i = q0 + row0 + 16 * mt + 8 * (e / 2), j = k0 + 8 * nt + t2 + e % 2;
          float x = -INFINITY;  // keys past Lk do not exist
          if (j < p.len_k) {
            x = i < p.len_q && mask.masked(i, j, reads_mask) ? kMaskedScore : s[mt][nt][e] * p.scale;
          }
          s[mt][nt][e] = x;
          block_max[e / 2] = x > block_max[e / 2] ? x : block_max[e / 2];
        }
      }
      float alpha[2];
      FASTMHA_UNROLL
      for (int h = 0; h < 2; ++h) {
        const float m_new = MaxOp{}(st.m[mt][h], ctx.quad_all_reduce(block_max[h], MaxOp{}));
        alpha[h] = exp_acc(st.m[mt][h] - m_new);  // 0 on the first block (m = -inf)
        st.m[mt][h] = m_new;
        st.l[mt][h] *= alpha[h];
      }
      FASTMHA_UNROLL
      for (int nt = 0; nt < kTilesN; ++nt) {
        float e[4];
        FASTMHA_UNROLL
        for (int h = 0; h < 2; ++h) {
          e[2 * h] = exp_acc(s[mt][nt][2 * h] - st.m[mt][h]);
          e[2 * h + 1] = exp_acc(s[mt][nt][2 * h + 1] - st.m[mt][h]);
          st.l[mt][h] += e[2 * h] + e[2 * h + 1];
          const int i = q0 + row0 + 16 * mt + 8 * h;
          if (dropout && i < p.len_q) {
            float keep[2];
            const uint64_t index = (static_cast<uint64_t>(bh) * p.len_q + i) * p.len_k + k0 + 8 * nt + t2;
            dropout_multipliers2(stream.seed, stream.offset, index, p.dropout_p, p.dropout_scale, keep);
            e[2 * h] *= keep[0];
            e[2 * h + 1] *= keep[1];
          }
        }
        pack_c_into_a<T>(prob[mt][nt / 2], nt, e);
      }
      FASTMHA_UNROLL
      for (int dt = 0; dt < DP / 8; ++dt) {
        st.o[mt][dt][0] *= alpha[0];
        st.o[mt][dt][1] *= alpha[0];
        st.o[mt][dt][2] *= alpha[1];
        st.o[mt][dt][3] *= alpha[1];
      }
    }

    if (prefetch) {
      ctx.template copy_wait<1>();  // V of this block; the next K may stay in flight
    } else {
      ctx.template copy_wait<0>();
    }
    ctx.sync();
    FASTMHA_UNROLL
    for (int kk = 0; kk < BN / 16; ++kk) {
      FASTMHA_UNROLL
      for (int np = 0; np < DP / 16; ++np) {
        uint32_t b[4];
        load_b_pair_transposed(ctx, b, v_tile, LD, np * 16, kk * 16);
        FASTMHA_UNROLL
        for (int mt = 0; mt < RowTiles; ++mt) {
          mma_pair<T>(ctx, st.o[mt][2 * np], st.o[mt][2 * np + 1], prob[mt][kk], b);
        }
      }
    }
    nb = next;
    reads_mask = next_reads_mask;
  }
  ctx.template copy_wait<0>();  // none is pending after a block; this covers a call with no block
}

// The whole forward of query block `m_block` of head `bh` (= b * heads + h).
template <typename T, int DP, int RowTiles, typename Ctx>
FASTMHA_DEVICE void flash_forward_mma_block(const Ctx& ctx, const AttentionParams<T, float>& p, char* smem, int64_t bh,
                                            int m_block) {
  using Tiles = MmaForwardTiles<DP, RowTiles>;
  static_assert(Ctx::kThreads == Tiles::kThreads, "4 warps");
  constexpr int BM = Tiles::kRows, BN = Tiles::kCols;
  const MmaForwardShared<DP, RowTiles, T> sh{reinterpret_cast<T*>(smem)};
  const int q0 = m_block * BM;
  MmaForwardState<DP, RowTiles> st;
  FASTMHA_UNROLL
  for (int mt = 0; mt < RowTiles; ++mt) {
    FASTMHA_UNROLL
    for (int dt = 0; dt < DP / 8; ++dt) {
      st.o[mt][dt][0] = st.o[mt][dt][1] = st.o[mt][dt][2] = st.o[mt][dt][3] = 0.0f;
    }
    st.m[mt][0] = st.m[mt][1] = -INFINITY;
    st.l[mt][0] = st.l[mt][1] = 0.0f;
  }
  const T* q = head_rows(p.q, p.q_stride, bh, p.heads);
  load_tile_async<BM, DP, Tiles::kLd>(ctx, sh.q, q, p.q_stride.row, q0, p.len_q, p.d_k);
  ctx.copy_commit();  // waited for with the first computed block's K, in whichever pass that is
  const auto stream = dropout_stream(p);
  const MaskView mask = flash_mask_view(p, bh);
  const int key_blocks = (p.len_k + BN - 1) / BN;
  // Key blocks in which no row of this block sees a key (masked, or past the causal diagonal) are skipped: they
  // would add exp(-1e9 - m) = 0 to every row that sees some key.
  bool load_q = true;
  mma_forward_key_blocks<T, DP, RowTiles>(ctx, p, sh, st, bh, q0, visible_key_blocks(p, mask, q0, BM, BN), true, load_q,
                                          mask, stream);
  const int lane = ctx.lane();
  const int row0 = ctx.warp() * Tiles::kWarpRows + lane / 4;
  if (p.mask != nullptr || p.is_causal) {
    // A row masked everywhere (in the blocks it saw, so in all) is uniform over *all* keys: let it see the
    // skipped blocks too.
    bool dead = false;
    FASTMHA_UNROLL
    for (int mt = 0; mt < RowTiles; ++mt) {
      FASTMHA_UNROLL
      for (int h = 0; h < 2; ++h) {
        dead = dead || (q0 + row0 + 16 * mt + 8 * h < p.len_q && st.m[mt][h] < kMaskedScore / 2);
      }
    }
    if (ctx.sync_or(dead)) {
      mma_forward_key_blocks<T, DP, RowTiles>(ctx, p, sh, st, bh, q0, key_blocks, false, load_q, mask, stream);
    }
  }
  const int t2 = 2 * (lane % 4);
  FASTMHA_UNROLL
  for (int mt = 0; mt < RowTiles; ++mt) {
    FASTMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float l = ctx.quad_all_reduce(st.l[mt][h], SumOp{});
      const float inverse = 1.0f / l;
      const int i = q0 + row0 + 16 * mt + 8 * h;
      if (i >= p.len_q) {
        continue;
      }
      T* out = p.out + (bh * p.len_q + i) * static_cast<int64_t>(p.d_v);
      FASTMHA_UNROLL
      for (int dt = 0; dt < DP / 8; ++dt) {
        FASTMHA_UNROLL
        for (int e = 0; e < 2; ++e) {
          const int c = 8 * dt + t2 + e;
          if (c < p.d_v) {
            out[c] = T(st.o[mt][dt][2 * h + e] * inverse);
          }
        }
      }
      if (lane % 4 == 0) {
        p.lse[bh * p.len_q + i] = st.m[mt][h] + log_acc(l);
      }
    }
  }
}

}  // namespace fastmha::cuda_kernels
