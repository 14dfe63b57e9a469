// Helpers of the CUDA kernel bodies that also compile as host C++ (for the emulated tests): math, the mask
// and causal test, the dropout draws. Kernel bodies take a thread context `ctx` (see device_threads.cuh and
// tests/cpp/emulated_threads.h) for their thread id, barriers, warp matrix products and atomics.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/flash/kernel_params.h"
#include "ops/masked_score.h"
#include "ops/philox.h"

#if defined(__CUDACC__)
#define FASTMHA_DEVICE __device__ __forceinline__
// Fully unrolls the next loop, so register arrays indexed by its counter stay in registers.
#define FASTMHA_UNROLL _Pragma("unroll")
#else
#define FASTMHA_DEVICE inline
#define FASTMHA_UNROLL
#endif

namespace fastmha::cuda_kernels {

// The flash kernels are compiled for head sizes padded to 64, 128 and 256.
constexpr int kMaxFlashHeadDim = 256;
// The mma forward (flash_forward_mma.h, half types) for head sizes padded to 64 and 128.
constexpr int kMaxMmaHeadDim = 128;

// Shared memory a flash kernel's tiles may take: fits sm_80 (163 KiB opt-in) and sm_90 (227 KiB). GPUs with
// less (sm_75 and older, sm_86/89 consumer parts: 99 KiB) take the ATen path.
constexpr size_t kSharedBudget = 160 * 1024;

// Calls f(std::integral_constant<int, DP>{}) with the padded head size DP that covers d (host side).
template <typename F>
void with_padded_head_dim(int d, F f) {
  if (d <= 64) {
    f(std::integral_constant<int, 64>{});
  } else if (d <= 128) {
    f(std::integral_constant<int, 128>{});
  } else {
    f(std::integral_constant<int, 256>{});
  }
}

// ops/masked_score.h in the accumulation type of the device code.
constexpr float kMaskedScore = static_cast<float>(fastmha::kMaskedScore);

// A row whose log-sum-exp is this low had every score masked: its softmax is uniform (1 / Lk). In fp32,
// lse = -1e9 + log(Lk) rounds to -1e9, so exp(s - lse) cannot recover it.
template <typename Acc>
FASTMHA_DEVICE bool masked_everywhere(Acc lse) {
  return lse < Acc(kMaskedScore / 2);
}

// Reductions for block_reduce and the context's warp_all_reduce.
struct MaxOp {
  template <typename A>
  FASTMHA_DEVICE A operator()(A x, A y) const {
    return x > y ? x : y;
  }
};
struct SumOp {
  template <typename A>
  FASTMHA_DEVICE A operator()(A x, A y) const {
    return x + y;
  }
};

#if defined(__CUDA_ARCH__)
FASTMHA_DEVICE float exp_acc(float x) { return __expf(x); }  // ex2.approx: ~2 ulp, exp(-inf) = 0
#else
FASTMHA_DEVICE float exp_acc(float x) { return expf(x); }
#endif
FASTMHA_DEVICE double exp_acc(double x) { return exp(x); }
FASTMHA_DEVICE float log_acc(float x) { return logf(x); }
FASTMHA_DEVICE double log_acc(double x) { return log(x); }

// The rows of head bh (= b * heads + h) of a strided (B, H, rows, features) tensor.
template <typename T>
FASTMHA_DEVICE const T* head_rows(const T* base, const RowStrides& stride, int64_t bh, int heads) {
  return base + (bh / heads) * stride.batch + (bh % heads) * stride.head;
}

// Where a score of head (b, h) is overwritten with -1e9: mask == 0, or above the diagonal when causal.
struct MaskView {
  const bool* base;  // the mask at (b, h), or nullptr
  int64_t row_stride, col_stride;
  bool is_causal;
  // Whether the flash kernels may skip tiles that no row sees (see flash_mask_view).
  bool skip_hidden = true;

  template <typename Params>
  FASTMHA_DEVICE static MaskView of(const Params& p, int64_t bh) {
    const int64_t b = bh / p.heads, h = bh % p.heads;
    MaskView view{nullptr, p.mask_stride[2], p.mask_stride[3], p.is_causal};
    if (p.mask != nullptr) {
      view.base = p.mask + b * p.mask_stride[0] + h * p.mask_stride[1];
    }
    return view;
  }

  FASTMHA_DEVICE bool masked(int64_t i, int64_t j) const {
    return (is_causal && j > i) || (base != nullptr && !base[i * row_stride + j * col_stride]);
  }
  // masked(), reading the tensor only when `read_tensor` (false on a tile whose mask entries are all kept).
  FASTMHA_DEVICE bool masked(int64_t i, int64_t j, bool read_tensor) const {
    return read_tensor ? masked(i, j) : is_causal && j > i;
  }
};

// The flash kernels' view of head bh. A skipped tile leaves out products whose factors are a weight or score
// gradient of exactly 0 and the other tiles' inputs (V in the forward; Q, K and dO in the backward): the math
// gives NaN where those hold a NaN or an infinity (0 * inf), so heads where they do skip nothing.
template <typename T, typename Acc>
FASTMHA_DEVICE MaskView flash_mask_view(const AttentionParams<T, Acc>& p, int64_t bh) {
  MaskView view = MaskView::of(p, bh);
  view.skip_hidden = p.finite_heads == nullptr || p.finite_heads[bh];
  return view;
}

// How a tile of scores (query rows [i0, i0 + rows), keys [j0, j0 + cols), cut to Lq x Lk) meets the mask:
// whether any score is visible (kept by the mask tensor and not past the causal diagonal), and whether the
// mask tensor keeps every score of the tile (its products then need not read the tensor).
struct TileView {
  bool any_visible, mask_keeps_all;
};

// Classifies one tile; without skip_hidden every tile counts as visible. Every thread of the block calls it
// alike: it reads the mask tensor (no shared memory) and ends with two barriers when there is a tensor, none
// otherwise. A broadcast dimension (stride 0) is read once: the last row for a row shared by all queries (under
// is_causal it sees the most keys), the first key for a column shared by all keys (the least hidden by the
// diagonal).
template <typename Ctx>
FASTMHA_DEVICE TileView classify_tile(const Ctx& ctx, const MaskView& mask, int i0, int rows, int j0, int cols,
                                      int len_q, int len_k) {
  rows = i0 + rows < len_q ? rows : len_q - i0;
  cols = j0 + cols < len_k ? cols : len_k - j0;
  const int last_row = i0 + rows - 1;
  if (rows <= 0 || cols <= 0) {
    return {false, false};
  }
  if (mask.is_causal && j0 > last_row) {
    return {!mask.skip_hidden, false};
  }
  if (mask.base == nullptr) {
    return {true, true};
  }
  const int scan_rows = mask.row_stride == 0 ? 1 : rows;
  const int scan_cols = mask.col_stride == 0 ? 1 : cols;
  const int first_row = mask.row_stride == 0 ? last_row : i0;
  bool visible = false, dropped = false;
  // A thread stops once it has seen both kinds: the tile is then mixed whatever the rest holds.
  for (int idx = ctx.thread(); idx < scan_rows * scan_cols && !(visible && dropped); idx += Ctx::kThreads) {
    const int64_t i = first_row + idx / scan_cols, j = j0 + idx % scan_cols;
    const bool kept = mask.base[i * mask.row_stride + j * mask.col_stride];
    dropped = dropped || !kept;
    visible = visible || (kept && !(mask.is_causal && j > i));
  }
  const bool any_visible = ctx.sync_or(visible) || !mask.skip_hidden;
  return {any_visible, !ctx.sync_or(dropped)};
}

// The key blocks (of `cols` keys) that query rows [q0, q0 + rows) compute: all of them, or with is_causal those up
// to the last row's diagonal (keys past it are masked for every row of the block) where the view skips.
template <typename Params>
FASTMHA_DEVICE int visible_key_blocks(const Params& p, const MaskView& mask, int q0, int rows, int cols) {
  const int last_key = p.is_causal && mask.skip_hidden && q0 + rows < p.len_k ? q0 + rows : p.len_k;
  return (last_key + cols - 1) / cols;
}

// A backward's query step: copies the lse and delta of query rows [q0, q0 + rows) of head bh into shared memory
// (zeros past Lq) and says whether the step must run against the key block [k0, k0 + cols): when some score of
// the tile is visible, or some row is masked everywhere (uniform over all keys, so it still feeds dV). A
// skipped tile adds exactly 0: exp(-1e9 - lse) underflows for every other row, and dS is 0 where masked.
// `reads_mask` says whether the step must read the mask tensor (see TileView). Every thread of the block calls
// it: its barrier also publishes lse and delta.
template <typename Ctx, typename Params, typename Acc>
FASTMHA_DEVICE bool stage_query_step(const Ctx& ctx, const Params& p, int64_t bh, int q0, int rows, int k0, int cols,
                                     const MaskView& mask, bool& reads_mask, Acc* lse_out, Acc* delta_out) {
  const Acc* lse = p.saved_lse + bh * p.len_q;
  const Acc* delta = p.delta + bh * p.len_q;
  bool uniform_row = false;
  for (int r = ctx.thread(); r < rows; r += Ctx::kThreads) {
    const bool exists = q0 + r < p.len_q;
    lse_out[r] = exists ? lse[q0 + r] : Acc(0);
    delta_out[r] = exists ? delta[q0 + r] : Acc(0);
    uniform_row = uniform_row || (exists && masked_everywhere(lse_out[r]));
  }
  const bool any_uniform_row = ctx.sync_or(uniform_row);
  const TileView tile = classify_tile(ctx, mask, q0, rows, k0, cols, p.len_q, p.len_k);
  reads_mask = !tile.mask_keeps_all;
  return tile.any_visible || any_uniform_row;
}

// The Philox (seed, offset) of the call's dropout, read from its device copy (rng_state); zeros without dropout.
struct DropoutStream {
  uint64_t seed, offset;
};
template <typename Params>
FASTMHA_DEVICE DropoutStream dropout_stream(const Params& p) {
  if (p.dropout_p > 0.0f) {
    return {static_cast<uint64_t>(p.rng_state[0]), static_cast<uint64_t>(p.rng_state[1])};
  }
  return {0, 0};
}

// Dropout multipliers (0 or 1/(1-p)) of the four scores at flat indices first..first+3 of the contiguous
// (B, H, Lq, Lk) score layout, from at most two Philox blocks (each block gives four consecutive indices).
template <typename Acc>
FASTMHA_DEVICE void dropout_multipliers4(uint64_t seed, uint64_t offset, uint64_t first, float p, Acc scale,
                                         Acc out[4]) {
  const uint64_t counter = first >> 2;
  const philox::Block lo = philox::random4(seed, offset, counter);
  philox::Block hi = lo;
  if ((first & 3) != 0) {
    hi = philox::random4(seed, offset, counter + 1);
  }
  FASTMHA_UNROLL
  for (int t = 0; t < 4; ++t) {
    const uint64_t index = first + t;
    const int at = static_cast<int>(index & 3);
    const uint32_t word = (index >> 2) == counter ? philox::word_at(lo, at) : philox::word_at(hi, at);
    out[t] = philox::keep_of(word, p, scale);
  }
}

// Dropout multipliers of the scores at flat indices first and first + 1 (one Philox block, or two across a
// block boundary).
template <typename Acc>
FASTMHA_DEVICE void dropout_multipliers2(uint64_t seed, uint64_t offset, uint64_t first, float p, Acc scale,
                                         Acc out[2]) {
  const philox::Block lo = philox::random4(seed, offset, first >> 2);
  const int at = static_cast<int>(first & 3);
  const uint32_t word0 = philox::word_at(lo, at);
  const uint32_t word1 =
      at == 3 ? philox::random4(seed, offset, (first >> 2) + 1).word[0] : philox::word_at(lo, at + 1);
  out[0] = philox::keep_of(word0, p, scale);
  out[1] = philox::keep_of(word1, p, scale);
}

}  // namespace fastmha::cuda_kernels
