// The weights-kept path's row kernels: the scores come from cuBLAS (Acc, contiguous (B, H, Lq, Lk)) and the
// kernels apply scale, mask and softmax (with the dropout multipliers) and write the weights; the backward
// recomputes P from the saved log-sum-exp and forms dS = P (dW Z - rowsum(dW Z P)). Rows of up to
// kMaxRegisterKeys keys are held in registers by a group of warps (one warp for up to 512 keys), so each
// score is read from memory once and a row needs no block barrier; longer rows take one thread block each and
// read their scores once per pass.
#pragma once

#include <cstdint>

#include "ops/cuda/flash/kernel_common.h"

namespace fastmha::cuda_kernels {

// op over the whole block: shuffles within each warp, then the warps' results through `scratch` (kWarps
// values), two barriers in all; every thread gets the result.
template <typename Ctx, typename Acc, typename Op>
FASTMHA_DEVICE Acc block_reduce(const Ctx& ctx, Acc* scratch, Acc value, Op op) {
  value = ctx.warp_all_reduce(value, op);
  if (ctx.lane() == 0) {
    scratch[ctx.warp()] = value;
  }
  ctx.sync();
  Acc result = scratch[0];
  for (int w = 1; w < Ctx::kWarps; ++w) {
    result = op(result, scratch[w]);
  }
  ctx.sync();  // scratch is reused by the next reduction
  return result;
}

// A row's masked, scaled scores and their softmax statistics (max and sum of exp).
template <typename Acc>
struct ScoreRow {
  const Acc* scores;
  MaskView mask;
  int64_t i;
  Acc scale;
  FASTMHA_DEVICE Acc operator()(int j) const { return mask.masked(i, j) ? Acc(kMaskedScore) : scores[j] * scale; }
};

template <typename T, typename Acc, typename Ctx>
FASTMHA_DEVICE void softmax_statistics(const Ctx& ctx, const SoftmaxRowsParams<T, Acc>& p, Acc* scratch,
                                       const ScoreRow<Acc>& score, Acc* max_out, Acc* sum_out) {
  Acc m = -Acc(INFINITY);
  for (int j = ctx.thread(); j < p.len_k; j += Ctx::kThreads) {
    const Acc s = score(j);
    m = s > m ? s : m;
  }
  m = block_reduce(ctx, scratch, m, MaxOp{});
  Acc sum = 0;
  for (int j = ctx.thread(); j < p.len_k; j += Ctx::kThreads) {
    sum += exp_acc(score(j) - m);
  }
  *max_out = m;
  *sum_out = block_reduce(ctx, scratch, sum, SumOp{});
}

template <typename T, typename Acc>
FASTMHA_DEVICE ScoreRow<Acc> score_row(const SoftmaxRowsParams<T, Acc>& p, int64_t row) {
  return {p.scores + row * p.len_k, MaskView::of(p, row / p.len_q), row % p.len_q, p.scale};
}

// The dropout multipliers of keys j0..j0+3 of a row (ones without dropout): four consecutive keys share
// Philox blocks.
template <typename T, typename Acc>
FASTMHA_DEVICE void run_multipliers(const SoftmaxRowsParams<T, Acc>& p, DropoutStream stream, int64_t row, int j0,
                                    Acc keep[4]) {
  FASTMHA_UNROLL
  for (int e = 0; e < 4; ++e) {
    keep[e] = Acc(1);
  }
  if (p.dropout_p > 0.0f) {
    dropout_multipliers4(stream.seed, stream.offset, static_cast<uint64_t>(row) * p.len_k + j0, p.dropout_p,
                         p.dropout_scale, keep);
  }
}

// Walks a row four keys at a time with their multipliers.
template <typename T, typename Acc, typename Ctx, typename Visit>
FASTMHA_DEVICE void for_each_key_with_dropout(const Ctx& ctx, const SoftmaxRowsParams<T, Acc>& p, int64_t row,
                                              Visit visit) {
  const DropoutStream stream = dropout_stream(p);
  for (int j0 = 4 * ctx.thread(); j0 < p.len_k; j0 += 4 * Ctx::kThreads) {
    Acc keep[4];
    run_multipliers(p, stream, row, j0, keep);
    for (int t = 0; t < 4 && j0 + t < p.len_k; ++t) {
      visit(j0 + t, keep[t]);
    }
  }
}

template <typename T, typename Acc, typename Ctx>
FASTMHA_DEVICE void softmax_forward_row(const Ctx& ctx, const SoftmaxRowsParams<T, Acc>& p, Acc* scratch, int64_t row) {
  const auto score = score_row(p, row);
  Acc m, sum;
  softmax_statistics(ctx, p, scratch, score, &m, &sum);
  const Acc inverse = Acc(1) / sum;
  T* weights = p.weights + row * p.len_k;
  for_each_key_with_dropout(ctx, p, row,
                            [&](int j, Acc keep) { weights[j] = T(exp_acc(score(j) - m) * inverse * keep); });
  if (ctx.thread() == 0) {
    p.lse[row] = m + log_acc(sum);
  }
}

template <typename T, typename Acc, typename Ctx>
FASTMHA_DEVICE void softmax_backward_row(const Ctx& ctx, const SoftmaxRowsParams<T, Acc>& p, Acc* scratch,
                                         int64_t row) {
  const auto score = score_row(p, row);
  // P from the forward's log-sum-exp; a row masked everywhere is uniform (its fp32 lse is too coarse).
  const Acc lse = p.saved_lse[row];
  const bool uniform = masked_everywhere(lse);
  auto prob = [&](int j) { return uniform ? Acc(1) / Acc(p.len_k) : exp_acc(score(j) - lse); };
  const Acc* grad_weights = p.grad_weights + row * p.len_k;
  Acc dot = 0;  // sum_j dP_j P_j with dP = dW Z
  for_each_key_with_dropout(ctx, p, row, [&](int j, Acc keep) { dot += grad_weights[j] * keep * prob(j); });
  dot = block_reduce(ctx, scratch, dot, SumOp{});
  T* weights = p.weights + row * p.len_k;
  T* grad_scores = p.grad_scores + row * p.len_k;
  for_each_key_with_dropout(ctx, p, row, [&](int j, Acc keep) {
    const Acc prob_j = prob(j);
    weights[j] = T(prob_j * keep);
    grad_scores[j] = score.mask.masked(score.i, j) ? T(0.0f) : T(prob_j * (grad_weights[j] * keep - dot) * p.scale);
  });
}

// Rows held in registers: Warps warps per row, each thread holding Chunks runs of four consecutive keys (keys
// 4 (t + c * kThreadsPerRow) .. + 3 for thread t of the row and run c), so that a warp's loads of a run are
// contiguous and four consecutive keys share their Philox blocks.
template <int Warps, int Chunks>
struct RegisterRows {
  static_assert(Warps >= 1 && Chunks >= 1 && 4 * Chunks <= 32, "register rows: a 32-bit mask per thread");
  static constexpr int kWarps = Warps;
  static constexpr int kChunks = Chunks;
  static constexpr int kThreadsPerRow = 32 * Warps;
  static constexpr int kCapacity = 4 * Chunks * kThreadsPerRow;  // keys
};

// The shapes the row kernels are compiled for, by key count (8 warps a block): one warp per row up to 512 keys,
// two up to 1024 (the same registers), eight with twice the runs up to kMaxRegisterKeys.
using RegisterRowsPerWarp = RegisterRows<1, 4>;
using RegisterRowsPerPair = RegisterRows<2, 4>;
using RegisterRowsPerBlock = RegisterRows<8, 8>;
constexpr int kMaxRegisterKeys = RegisterRowsPerBlock::kCapacity;

// Calls f(Shape{}) with the register-row shape of a row of len_k keys and returns true, or returns false when the
// row does not fit in registers (host side).
template <typename F>
bool with_register_rows(int64_t len_k, F f) {
  if (len_k <= RegisterRowsPerWarp::kCapacity) {
    f(RegisterRowsPerWarp{});
  } else if (len_k <= RegisterRowsPerPair::kCapacity) {
    f(RegisterRowsPerPair{});
  } else if (len_k <= kMaxRegisterKeys) {
    f(RegisterRowsPerBlock{});
  } else {
    return false;
  }
  return true;
}

// Four consecutive elements as one access (a 16-byte load of fp32, an 8-byte store of a half type).
template <typename A>
struct alignas(4 * sizeof(A)) Run4 {
  A v[4];
};

// The first `valid` (0..4) of the four elements at src; one vector load when all four are valid and `vector`
// (the address is a multiple of the run's size).
template <typename A>
FASTMHA_DEVICE void load_run(const A* src, int valid, bool vector, A out[4]) {
  if (vector && valid == 4) {
    const Run4<A> run = *reinterpret_cast<const Run4<A>*>(src);
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      out[e] = run.v[e];
    }
    return;
  }
  FASTMHA_UNROLL
  for (int e = 0; e < 4; ++e) {
    out[e] = e < valid ? src[e] : A(0);
  }
}

template <typename A>
FASTMHA_DEVICE void store_run(A* dst, int valid, bool vector, const A in[4]) {
  if (vector && valid == 4) {
    Run4<A> run;
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      run.v[e] = in[e];
    }
    *reinterpret_cast<Run4<A>*>(dst) = run;
    return;
  }
  FASTMHA_UNROLL
  for (int e = 0; e < 4; ++e) {
    if (e < valid) {
      dst[e] = in[e];
    }
  }
}

// op over the Warps warps of a row: shuffles, then (several warps) the warps' results through `scratch`
// (Ctx::kWarps values) between two barriers of the block, which every thread of the block reaches.
template <int Warps, typename Ctx, typename Acc, typename Op>
FASTMHA_DEVICE Acc row_group_reduce(const Ctx& ctx, Acc* scratch, Acc value, Op op) {
  value = ctx.warp_all_reduce(value, op);
  if constexpr (Warps > 1) {
    if (ctx.lane() == 0) {
      scratch[ctx.warp()] = value;
    }
    ctx.sync();
    const int first = ctx.warp() / Warps * Warps;
    value = scratch[first];
    for (int w = 1; w < Warps; ++w) {
      value = op(value, scratch[first + w]);
    }
    ctx.sync();  // scratch is reused by the next reduction
  }
  return value;
}

// Whether `data` (or nullptr) lies on a multiple of a run's size.
template <typename A>
FASTMHA_DEVICE bool run_aligned(const A* data) {
  return reinterpret_cast<uintptr_t>(data) % sizeof(Run4<A>) == 0;
}

// Where thread t of a row group stands: its row (live when below p.rows; a group past the last row takes part in
// the barriers only, with row 0 and no valid keys) and that row's scores, its first key, and whether runs of four
// are aligned for vector accesses.
template <typename Rows, typename T, typename Acc>
struct RegisterRowPlace {
  int64_t row;
  bool live, vector;
  int t;
  ScoreRow<Acc> score;
  template <typename Ctx>
  FASTMHA_DEVICE RegisterRowPlace(const Ctx& ctx, const SoftmaxRowsParams<T, Acc>& p, int64_t block) {
    static_assert(Ctx::kWarps % Rows::kWarps == 0, "whole row groups per block");
    row = block * (Ctx::kWarps / Rows::kWarps) + ctx.warp() / Rows::kWarps;
    live = row < p.rows;
    row = live ? row : 0;
    // Every row starts at a multiple of four elements, and the buffers (fresh allocations today) at a multiple of
    // the run's size: a misaligned vector access faults on a GPU.
    vector = p.len_k % 4 == 0 && run_aligned(p.scores) && run_aligned(p.grad_weights) && run_aligned(p.weights) &&
             run_aligned(p.grad_scores);
    t = ctx.thread() % Rows::kThreadsPerRow;
    score = score_row(p, row);
  }
  FASTMHA_DEVICE int first_key(int chunk) const { return 4 * (t + chunk * Rows::kThreadsPerRow); }
  // Keys of the run from `first` that exist (0 for a dead row).
  FASTMHA_DEVICE int valid(const SoftmaxRowsParams<T, Acc>& p, int first) const {
    const int left = p.len_k - first;
    return !live || left <= 0 ? 0 : left < 4 ? left : 4;
  }
};

// Calls f(c, j0, valid) for each run c of the thread that holds keys (j0 its first key, `valid` of them).
template <typename Rows, typename T, typename Acc, typename F>
FASTMHA_DEVICE void for_each_run(const RegisterRowPlace<Rows, T, Acc>& at, const SoftmaxRowsParams<T, Acc>& p, F f) {
  FASTMHA_UNROLL
  for (int c = 0; c < Rows::kChunks; ++c) {
    const int j0 = at.first_key(c), valid = at.valid(p, j0);
    if (valid > 0) {
      f(c, j0, valid);
    }
  }
}

// for_each_run, with the run's dropout multipliers: f(c, j0, valid, keep).
template <typename Rows, typename T, typename Acc, typename F>
FASTMHA_DEVICE void for_each_run_with_dropout(const RegisterRowPlace<Rows, T, Acc>& at,
                                              const SoftmaxRowsParams<T, Acc>& p, F f) {
  const DropoutStream stream = dropout_stream(p);
  for_each_run(at, p, [&](int c, int j0, int valid) {
    Acc keep[4];
    run_multipliers(p, stream, at.row, j0, keep);
    f(c, j0, valid, keep);
  });
}

// The forward of softmax_forward_row on rows held in registers (block `block` of rows).
template <typename Rows, typename T, typename Acc, typename Ctx>
FASTMHA_DEVICE void softmax_forward_register_rows(const Ctx& ctx, const SoftmaxRowsParams<T, Acc>& p, Acc* scratch,
                                                  int64_t block) {
  const RegisterRowPlace<Rows, T, Acc> at(ctx, p, block);
  Acc s[Rows::kChunks][4];
  Acc m = -Acc(INFINITY);
  FASTMHA_UNROLL
  for (int c = 0; c < Rows::kChunks; ++c) {
    const int j0 = at.first_key(c), valid = at.valid(p, j0);
    load_run(at.score.scores + j0, valid, at.vector, s[c]);
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      if (e < valid) {
        s[c][e] = at.score.mask.masked(at.score.i, j0 + e) ? Acc(kMaskedScore) : s[c][e] * at.score.scale;
        m = MaxOp{}(s[c][e], m);
      }
    }
  }
  m = row_group_reduce<Rows::kWarps>(ctx, scratch, m, MaxOp{});
  Acc sum = 0;
  FASTMHA_UNROLL
  for (int c = 0; c < Rows::kChunks; ++c) {
    const int valid = at.valid(p, at.first_key(c));
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      if (e < valid) {
        s[c][e] = exp_acc(s[c][e] - m);
        sum += s[c][e];
      }
    }
  }
  sum = row_group_reduce<Rows::kWarps>(ctx, scratch, sum, SumOp{});
  const Acc inverse = Acc(1) / sum;
  T* weights = p.weights + at.row * p.len_k;
  for_each_run_with_dropout(at, p, [&](int c, int j0, int valid, const Acc keep[4]) {
    T w[4];
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      w[e] = T(s[c][e] * inverse * keep[e]);
    }
    store_run(weights + j0, valid, at.vector, w);
  });
  if (at.live && at.t == 0) {
    p.lse[at.row] = m + log_acc(sum);
  }
}

// The backward of softmax_backward_row on rows held in registers: P and dP = dW Z stay in registers between
// the row's reduction and the writes of dS, and the dropout multipliers are drawn once.
template <typename Rows, typename T, typename Acc, typename Ctx>
FASTMHA_DEVICE void softmax_backward_register_rows(const Ctx& ctx, const SoftmaxRowsParams<T, Acc>& p, Acc* scratch,
                                                   int64_t block) {
  const RegisterRowPlace<Rows, T, Acc> at(ctx, p, block);
  // A row masked everywhere is uniform (its fp32 lse is too coarse to recover it).
  const Acc lse = at.live ? p.saved_lse[at.row] : Acc(0);
  const bool uniform = masked_everywhere(lse);
  const Acc* grad_weights = p.grad_weights + at.row * p.len_k;
  T* weights = p.weights + at.row * p.len_k;
  Acc prob[Rows::kChunks][4], grad_p[Rows::kChunks][4];
  uint32_t masked_bits = 0;  // bit 4 c + e: key e of run c is masked
  Acc dot = 0;               // sum_j dP_j P_j
  for_each_run_with_dropout(at, p, [&](int c, int j0, int valid, const Acc keep[4]) {
    load_run(at.score.scores + j0, valid, at.vector, prob[c]);
    load_run(grad_weights + j0, valid, at.vector, grad_p[c]);
    T w[4];
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const bool masked = e < valid && at.score.mask.masked(at.score.i, j0 + e);
      masked_bits |= masked ? 1u << (4 * c + e) : 0u;
      const Acc s = masked ? Acc(kMaskedScore) : prob[c][e] * at.score.scale;
      prob[c][e] = uniform ? Acc(1) / Acc(p.len_k) : exp_acc(s - lse);
      grad_p[c][e] *= keep[e];
      if (e < valid) {
        dot += grad_p[c][e] * prob[c][e];
      }
      w[e] = T(prob[c][e] * keep[e]);
    }
    store_run(weights + j0, valid, at.vector, w);
  });
  dot = row_group_reduce<Rows::kWarps>(ctx, scratch, dot, SumOp{});
  T* grad_scores = p.grad_scores + at.row * p.len_k;
  for_each_run(at, p, [&](int c, int j0, int valid) {
    T ds[4];
    FASTMHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const bool masked = (masked_bits >> (4 * c + e)) & 1u;
      ds[e] = masked ? T(0.0f) : T(prob[c][e] * (grad_p[c][e] - dot) * p.scale);
    }
    store_run(grad_scores + j0, valid, at.vector, ds);
  });
}

}  // namespace fastmha::cuda_kernels
