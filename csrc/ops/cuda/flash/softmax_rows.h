// The weights-kept path's row kernels: the scores come from cuBLAS (Acc, contiguous (B, H, Lq, Lk)) and one
// thread block per row applies scale, mask and softmax (with the dropout multipliers) in one pass of reads
// and one of writes; the backward recomputes P from the saved log-sum-exp and forms
// dS = P (dW Z - rowsum(dW Z P)).
#pragma once

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

// Walks a row four keys at a time (four consecutive keys share Philox blocks) with their multipliers.
template <typename T, typename Acc, typename Ctx, typename Visit>
FASTMHA_DEVICE void for_each_key_with_dropout(const Ctx& ctx, const SoftmaxRowsParams<T, Acc>& p, int64_t row,
                                              Visit visit) {
  const auto [seed, offset] = dropout_stream(p);
  for (int j0 = 4 * ctx.thread(); j0 < p.len_k; j0 += 4 * Ctx::kThreads) {
    Acc keep[4] = {1, 1, 1, 1};
    if (p.dropout_p > 0.0f) {
      dropout_multipliers4(seed, offset, static_cast<uint64_t>(row) * p.len_k + j0, p.dropout_p, p.dropout_scale, keep);
    }
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

}  // namespace fastmha::cuda_kernels
