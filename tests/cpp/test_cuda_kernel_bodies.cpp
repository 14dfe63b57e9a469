// The CUDA kernel bodies, run on the CPU through emulated_threads.h against a float64 oracle written from
// the formulas: the flash forward and backward, and the weights-kept row kernels, for every dtype and padded
// head size, with odd lengths, strided inputs, broadcast masks (fully masked rows included), causal and
// dropout. This machine has no GPU; the same bodies run on one through ops/cuda/device_threads.cuh.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/csrc/autograd/autograd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "emulated_threads.h"
#include "ops/broadcast_mask.h"
#include "ops/cuda/flash/flash_backward.h"
#include "ops/cuda/flash/flash_backward_mma.h"
#include "ops/cuda/flash/flash_forward.h"
#include "ops/cuda/flash/flash_forward_mma.h"
#include "ops/cuda/flash/softmax_rows.h"
#include "ops/cuda/kernel_params_builder.h"
#include "ops/philox.h"

namespace {

using namespace fastmha::cuda_kernels;
using fastmha::testing::run_blocks;

constexpr int kFlashThreads = 128;  // as on the GPU: the forward gives each query row its own thread
// The row kernels take any whole number of warps; two (the GPU uses eight) keep the test quick.
constexpr int kRowThreads = 64;

// The masks of the cases. The last four make whole tiles of scores fully masked (which the flash kernels skip),
// fully kept (which they compute without reading the mask) and mixed, at tile edges and through broadcast strides.
enum class MaskKind {
  kNone,
  kRandom,     // (Lq, Lk) random with a row masked everywhere, times a padding mask (B, 1, 1, Lk)
  kPadding,    // (B, 1, 1, Lk) int64: the first 64 keys of batch 0 (a tile edge), keys 31.. of batch 1 (left padding)
  kDecoder,    // (B, 1, Lq, Lk): that padding and the causal triangle, as a padded decoder's mask
  kQueryRows,  // (B, 1, Lq, 1): whole query rows masked (rows masked everywhere, whole query blocks of them)
  kBlocks,     // (Lq, Lk): keys 64..135 hidden from all, keys 150.. from queries 0..39, row 3 masked everywhere
};

struct Case {
  int64_t batch = 2, heads = 2, len_q = 70, len_k = 45, d_k = 16, d_v = 16;
  MaskKind mask = MaskKind::kNone;
  bool causal = false;
  double dropout_p = 0.0;
  // NaN in V at (1, 1, key 100) and inf in K at (0, 1, key 130): keys that kPadding or is_causal hide, whose zero
  // weights and score gradients still meet them in the math (NaN outputs and dQ in those heads). Heads of
  // different batches, so that a flag read at the wrong head shows.
  bool poison = false;
  bool forward_only = false;  // the backward's rule for rows with lse near -1e9 does not cover every such row
};

at::Tensor make_mask(const Case& c) {
  using at::indexing::Slice;
  switch (c.mask) {
    case MaskKind::kNone:
      return {};
    case MaskKind::kRandom: {
      auto rows = (at::rand({c.len_q, c.len_k}) > 0.3).to(at::kFloat);
      if (c.len_q > 3) {
        rows[3].zero_();
      }
      auto padding = at::ones({c.batch, 1, 1, c.len_k});
      padding.index_put_({1, Slice(), Slice(), Slice(c.len_k - 7)}, 0);
      return rows * padding;
    }
    case MaskKind::kPadding:
    case MaskKind::kDecoder: {
      auto padding = at::zeros({c.batch, 1, 1, c.len_k}, at::kLong);
      padding.index_put_({0, Slice(), Slice(), Slice(0, 64)}, 1);
      padding.index_put_({c.batch - 1, Slice(), Slice(), Slice(31)}, 1);
      if (c.mask == MaskKind::kPadding) {
        return padding;
      }
      return padding * at::ones({c.len_q, c.len_k}, at::kLong).tril();
    }
    case MaskKind::kQueryRows: {
      auto rows = at::ones({c.batch, 1, c.len_q, 1}, at::kBool);
      rows.index_put_({0, 0, Slice(5, 10)}, false);
      rows.index_put_({c.batch - 1, 0, Slice(40)}, false);
      return rows;
    }
    case MaskKind::kBlocks: {
      auto blocks = at::ones({c.len_q, c.len_k}, at::kFloat);
      blocks.index_put_({Slice(), Slice(64, 136)}, 0);
      blocks.index_put_({Slice(0, 40), Slice(150)}, 0);
      blocks[3].zero_();
      return blocks;
    }
  }
  return {};
}

struct Inputs {
  at::Tensor q, k, v, mask, grad_out, grad_weights, rng_state;
};

// q, k, v as strided views of (B, L, H, d) storage, the layout the block's head split produces.
Inputs make_inputs(const Case& c, at::ScalarType dtype) {
  auto options = at::TensorOptions().dtype(dtype);
  auto heads_view = [&](int64_t len, int64_t d) {
    return at::randn({c.batch, len, c.heads, d}, options).transpose(1, 2);
  };
  Inputs in;
  in.q = heads_view(c.len_q, c.d_k);
  in.k = heads_view(c.len_k, c.d_k);
  in.v = heads_view(c.len_k, c.d_v);
  in.mask = make_mask(c);
  if (c.poison) {
    in.v.select(0, 1).select(0, 1)[100].fill_(std::numeric_limits<double>::quiet_NaN());
    in.k.select(0, 0).select(0, 1)[130].fill_(std::numeric_limits<double>::infinity());
  }
  in.grad_out = at::randn({c.batch, c.heads, c.len_q, c.d_v}, options);
  in.grad_weights = at::randn({c.batch, c.heads, c.len_q, c.len_k}, options);
  in.rng_state = at::tensor({int64_t{20261129}, int64_t{8}}, at::kLong);
  return in;
}

// The dropout multipliers of the contiguous (B, H, Lq, Lk) scores: the randomness is part of the contract.
at::Tensor multipliers(const Case& c, const at::Tensor& rng_state) {
  auto out = at::empty({c.batch, c.heads, c.len_q, c.len_k}, at::kDouble);
  auto* data = out.data_ptr<double>();
  const auto* state = rng_state.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < out.numel(); ++n) {
    data[n] = fastmha::philox::keep_scale<double>(state[0], state[1], n, static_cast<float>(c.dropout_p),
                                                  1.0 / (1.0 - c.dropout_p));
  }
  return out;
}

struct Reference {
  at::Tensor out, weights, lse, grad_q, grad_k, grad_v;
};

// A @ B^T over the last two dims as an elementwise product and a sum, so the oracle does not depend on the BLAS
// (or its code path for this CPU) that at::matmul would pick.
at::Tensor products(const at::Tensor& a, const at::Tensor& b) { return (a.unsqueeze(-2) * b.unsqueeze(-3)).sum(-1); }

// Formulas in float64 with autograd: scores = q k^T / sqrt(d_k); masked -> -1e9; softmax; dropout; @ v.
Reference reference(const Case& c, const Inputs& in, bool with_grad_weights) {
  auto q = in.q.to(at::kDouble).detach().requires_grad_(true);
  auto k = in.k.to(at::kDouble).detach().requires_grad_(true);
  auto v = in.v.to(at::kDouble).detach().requires_grad_(true);
  auto scores = products(q, k) / std::sqrt(static_cast<double>(c.d_k));
  auto masked = at::zeros({c.len_q, c.len_k}, at::kBool);
  if (c.causal) {
    masked = at::ones({c.len_q, c.len_k}, at::kBool).triu(1);
  }
  if (in.mask.defined()) {
    masked = at::logical_or(masked, in.mask == 0);
  }
  scores = scores.masked_fill(masked, -1e9);
  auto weights = at::softmax(scores, -1);
  if (c.dropout_p > 0) {
    weights = weights * multipliers(c, in.rng_state);
  }
  auto out = products(weights, v.transpose(-2, -1));
  auto loss = (out * in.grad_out.to(at::kDouble)).sum();
  if (with_grad_weights) {
    loss = loss + (weights * in.grad_weights.to(at::kDouble)).sum();
  }
  auto grads = torch::autograd::grad({loss}, {q, k, v});
  return {out.detach(), weights.detach(), at::logsumexp(scores, -1).detach(), grads[0], grads[1], grads[2]};
}

// The bound on |kernel - float64 oracle| relative to max(1, max |want|), from the dtype's epsilon and the
// longest reduction n (a key row, or a head vector).
//  - float/double: the kernels accumulate in their own dtype. A sum of n rounded terms of random sign errs
//    like sqrt(n) * eps (the probabilistic bound; the worst case n * eps is never approached by random
//    data), and a result passes through a chain of a few such steps (product, exp and sum, division or log,
//    then the gradient's two products): 8 * sqrt(n) * eps covers it.
//  - float16/bfloat16: accumulation is fp32, so the error is the rounding to the dtype: the operands P and
//    dS are rounded once each, and the result once more (eps / 2 each, relative): 4 * eps covers it.
double tolerance(at::ScalarType dtype, int64_t n) {
  switch (dtype) {
    case at::kDouble:
      return 8.0 * std::sqrt(static_cast<double>(n)) * std::numeric_limits<double>::epsilon();
    case at::kFloat:
      return 8.0 * std::sqrt(static_cast<double>(n)) * std::numeric_limits<float>::epsilon();
    case at::kHalf:
      return 4.0 * static_cast<double>(std::numeric_limits<c10::Half>::epsilon());
    default:
      return 4.0 * static_cast<double>(std::numeric_limits<c10::BFloat16>::epsilon());
  }
}

// The longest sum in any result: over keys (outputs, softmax), queries (dK, dV) or a head vector (scores).
int64_t longest_reduction(const Case& c) { return std::max({c.len_q, c.len_k, c.d_k, c.d_v}); }

// NaN where want has NaN, and elsewhere max |got - want| relative to max(1, max |want|).
void require_close(const at::Tensor& got, const at::Tensor& want, at::ScalarType dtype, int64_t n,
                   const std::string& what) {
  REQUIRE(got.sizes() == want.sizes());
  const auto nan = want.isnan();
  const bool same_nans = at::equal(got.isnan(), nan);
  INFO(what << ": NaN where the oracle has NaN");
  CHECK(same_nans);
  const auto g = got.to(at::kDouble).masked_select(nan.logical_not()),
             w = want.to(at::kDouble).masked_select(nan.logical_not());
  if (w.numel() == 0) {
    return;
  }
  const double scale = std::max(1.0, w.abs().max().item<double>());
  const double error = (g - w).abs().max().item<double>() / scale;
  INFO(what << ": relative error " << error);
  CHECK(error <= tolerance(dtype, n));
}

at::Tensor mask_view_of(const Inputs& in) {
  return fastmha::broadcast_mask(in.mask.defined() ? std::optional(in.mask) : std::nullopt, in.q, in.k);
}

// A forward's output and log-sum-exp against the oracle.
void require_forward_close(const Case& c, const at::Tensor& out, const at::Tensor& lse, const Reference& want,
                           at::ScalarType dtype, const std::string& what) {
  const int64_t longest = longest_reduction(c);
  require_close(out, want.out, dtype, longest, what + " output");
  // A fully masked row's lse is -1e9 + log(Lk): compare the others, and those only by the masked test.
  const auto live = want.lse > -1e8;
  require_close(lse.to(at::kDouble).masked_select(live), want.lse.masked_select(live), dtype, longest, what + " lse");
  const bool dead_rows_low = at::all(lse.to(at::kDouble).masked_select(live.logical_not()) < -1e8).item<bool>();
  CHECK(dead_rows_low);
}

// The backward's inputs (from a forward's output and lse) and outputs, wired into p.
struct BackwardTensors {
  at::Tensor grad_out, delta, grad_q, grad_k, grad_v;
};
template <typename T, typename Acc>
BackwardTensors prepare_backward(const Case& c, const Inputs& in, const at::Tensor& out, const at::Tensor& lse,
                                 at::ScalarType dtype, AttentionParams<T, Acc>& p) {
  const auto acc = at::toOpMathType(dtype);
  BackwardTensors t;
  t.grad_out = in.grad_out.contiguous();
  t.delta = (t.grad_out.to(acc) * out.to(acc)).sum(-1).contiguous();
  t.grad_q = at::zeros({c.batch, c.heads, c.len_q, c.d_k}, acc);
  t.grad_k = at::empty({c.batch, c.heads, c.len_k, c.d_k}, dtype);
  t.grad_v = at::empty({c.batch, c.heads, c.len_k, c.d_v}, dtype);
  p.saved_lse = lse.template const_data_ptr<Acc>();
  p.grad_out = t.grad_out.template const_data_ptr<T>();
  p.delta = t.delta.template const_data_ptr<Acc>();
  p.grad_q_acc = t.grad_q.template data_ptr<Acc>();
  p.grad_k = t.grad_k.template data_ptr<T>();
  p.grad_v = t.grad_v.template data_ptr<T>();
  return t;
}

void require_gradients_close(const Case& c, const BackwardTensors& got, const Reference& want, at::ScalarType dtype,
                             const std::string& what) {
  const int64_t longest = longest_reduction(c);
  require_close(got.grad_q, want.grad_q, dtype, longest, what + " grad_q");
  require_close(got.grad_k, want.grad_k, dtype, longest, what + " grad_k");
  require_close(got.grad_v, want.grad_v, dtype, longest, what + " grad_v");
}

// The WMMA/FMA forward and backward, and in half types with head sizes up to 128 the mma backward on the same
// forward.
template <typename T, typename Acc, int DP>
void check_flash(const Case& c, const Inputs& in, at::ScalarType dtype) {
  const auto mask_view = mask_view_of(in);  // p points into it
  auto p = flash_params<T, Acc>(in.q, in.k, in.v, mask_view, c.dropout_p, c.causal, in.rng_state);
  const auto forward_flags = finite_heads({in.v});  // as the CUDA ops compute them
  p.finite_heads = forward_flags.const_data_ptr<bool>();
  const auto acc = at::toOpMathType(dtype);
  auto out = at::empty({c.batch, c.heads, c.len_q, c.d_v}, dtype);
  auto lse = at::empty({c.batch, c.heads, c.len_q}, acc);
  p.out = out.template data_ptr<T>();
  p.lse = lse.template data_ptr<Acc>();
  using Forward = ForwardTiles<T, Acc, DP>;
  const int query_blocks = (c.len_q + Forward::kRows - 1) / Forward::kRows;
  run_blocks<kFlashThreads>(p.batch_heads * query_blocks, Forward::kSharedBytes, [&](auto ctx, char* smem, int64_t b) {
    flash_forward_block<T, Acc, DP>(ctx, p, smem, b / query_blocks, static_cast<int>(b % query_blocks));
  });
  const auto want = reference(c, in, /*with_grad_weights=*/false);
  require_forward_close(c, out, lse, want, dtype, "flash");
  if (c.forward_only) {
    return;
  }

  const auto grads = prepare_backward(c, in, out, lse, dtype, p);
  const at::Tensor backward_flags = finite_heads({in.q, in.k, grads.grad_out});
  p.finite_heads = backward_flags.const_data_ptr<bool>();
  using Backward = BackwardTiles<T, Acc, DP>;
  const int key_blocks = (c.len_k + Backward::kCols - 1) / Backward::kCols;
  run_blocks<kFlashThreads>(p.batch_heads * key_blocks, Backward::kSharedBytes, [&](auto ctx, char* smem, int64_t b) {
    flash_backward_block<T, Acc, DP>(ctx, p, smem, b / key_blocks, static_cast<int>(b % key_blocks));
  });
  require_gradients_close(c, grads, want, dtype, "flash");
  if constexpr (uses_tensor_cores<T>() && DP <= kMaxMmaHeadDim) {  // the mma backward on the same forward
    const auto mma_grads = prepare_backward(c, in, out, lse, dtype, p);
    using Mma = MmaBackwardTiles<DP>;
    const int mma_key_blocks = (c.len_k + Mma::kCols - 1) / Mma::kCols;
    run_blocks<Mma::kThreads>(p.batch_heads * mma_key_blocks, Mma::kSharedBytes, [&](auto ctx, char* smem, int64_t b) {
      flash_backward_mma_block<T, DP>(ctx, p, smem, b / mma_key_blocks, static_cast<int>(b % mma_key_blocks));
    });
    require_gradients_close(c, mma_grads, want, dtype, "mma backward");
  }
}

// The register-resident forward (half types, head sizes up to 128, 1 or 2 row tiles per warp).
template <typename T, int DP, int RowTiles>
void check_flash_mma(const Case& c, const Inputs& in, at::ScalarType dtype) {
  const auto mask_view = mask_view_of(in);  // p points into it
  auto p = flash_params<T, float>(in.q, in.k, in.v, mask_view, c.dropout_p, c.causal, in.rng_state);
  const auto flags = finite_heads({in.v});
  p.finite_heads = flags.const_data_ptr<bool>();
  auto out = at::empty({c.batch, c.heads, c.len_q, c.d_v}, dtype);
  auto lse = at::empty({c.batch, c.heads, c.len_q}, at::kFloat);
  p.out = out.template data_ptr<T>();
  p.lse = lse.template data_ptr<float>();
  using Tiles = MmaForwardTiles<DP, RowTiles>;
  const int query_blocks = (c.len_q + Tiles::kRows - 1) / Tiles::kRows;
  run_blocks<Tiles::kThreads>(p.batch_heads * query_blocks, Tiles::kSharedBytes, [&](auto ctx, char* smem, int64_t b) {
    flash_forward_mma_block<T, DP, RowTiles>(ctx, p, smem, b / query_blocks, static_cast<int>(b % query_blocks));
  });
  require_forward_close(c, out, lse, reference(c, in, /*with_grad_weights=*/false), dtype, "mma forward");
}

// The weights-kept row kernels on the case: forward(p) and backward(p) run them over every row of p.
template <typename T, typename Acc, typename Forward, typename Backward>
void check_softmax_rows_with(const Case& c, const Inputs& in, at::ScalarType dtype, const std::string& what,
                             Forward forward, Backward backward) {
  const int64_t longest = longest_reduction(c);
  const auto acc = at::toOpMathType(dtype);
  const auto mask_view = mask_view_of(in);
  // The scores as cuBLAS gives them: the product of the dtype's values, in the accumulation dtype.
  const auto scores = at::matmul(in.q.to(acc), in.k.to(acc).transpose(-2, -1)).contiguous();
  auto p = rows_params<T, Acc>(in.q, in.k, scores, mask_view, c.dropout_p, c.causal, in.rng_state);
  auto weights = at::empty(scores.sizes(), dtype);
  auto lse = at::empty({c.batch, c.heads, c.len_q}, acc);
  p.weights = weights.template data_ptr<T>();
  p.lse = lse.template data_ptr<Acc>();
  forward(p);
  const auto want = reference(c, in, /*with_grad_weights=*/true);
  require_close(weights, want.weights, dtype, longest, what + " weights");
  const auto live = want.lse > -1e8;
  require_close(lse.to(at::kDouble).masked_select(live), want.lse.masked_select(live), dtype, longest, what + " lse");

  const auto grad_weights =
      (at::matmul(in.grad_out.to(acc), in.v.to(acc).transpose(-2, -1)) + in.grad_weights.to(acc)).contiguous();
  auto grad_scores = at::empty(scores.sizes(), dtype);
  p.saved_lse = lse.template const_data_ptr<Acc>();
  p.grad_weights = grad_weights.template const_data_ptr<Acc>();
  p.grad_scores = grad_scores.template data_ptr<T>();
  weights.fill_(-7);  // the backward writes them again
  backward(p);
  require_close(weights, want.weights, dtype, longest, what + " backward weights");
  const auto ds = grad_scores.to(at::kDouble);
  require_close(products(ds, in.k.to(at::kDouble).transpose(-2, -1)), want.grad_q, dtype, longest, what + " grad_q");
  require_close(products(ds.transpose(-2, -1), in.q.to(at::kDouble).transpose(-2, -1)), want.grad_k, dtype, longest,
                what + " grad_k");
}

// Rows held in registers with the shape Rows, in blocks of Threads threads (whole row groups per block).
template <typename Rows, int Threads, typename T, typename Acc>
void check_register_rows(const Case& c, const Inputs& in, at::ScalarType dtype, const std::string& what) {
  REQUIRE(c.len_k <= Rows::kCapacity);
  constexpr int kRowsPerBlock = Threads / Rows::kThreadsPerRow;
  const size_t scratch_bytes = Threads / 32 * sizeof(Acc);
  const auto blocks = [&](const auto& p) { return (p.rows + kRowsPerBlock - 1) / kRowsPerBlock; };
  check_softmax_rows_with<T, Acc>(
      c, in, dtype, what,
      [&](const auto& p) {
        run_blocks<Threads>(blocks(p), scratch_bytes, [&](auto ctx, char* smem, int64_t b) {
          softmax_forward_register_rows<Rows, T, Acc>(ctx, p, reinterpret_cast<Acc*>(smem), b);
        });
      },
      [&](const auto& p) {
        run_blocks<Threads>(blocks(p), scratch_bytes, [&](auto ctx, char* smem, int64_t b) {
          softmax_backward_register_rows<Rows, T, Acc>(ctx, p, reinterpret_cast<Acc*>(smem), b);
        });
      });
}

// A block per row, and rows in registers: one warp per row (the GPU's shape for up to 512 keys, two rows per
// block; and with 8 runs, three rows per block, where the last block has rows past the end: the cases have B H Lq
// of 4, 200 or 280 rows), and two warps per row (the GPU's shape up to 1024 keys: their reduction through shared
// memory). Runs of four are vector accesses when Lk % 4 == 0 (Lk 100 and 160 of the cases) and scalar ones
// otherwise (45, 130, 150).
template <typename T, typename Acc>
void check_softmax_rows(const Case& c, const Inputs& in, at::ScalarType dtype) {
  const size_t scratch_bytes = kRowThreads / 32 * sizeof(Acc);
  check_softmax_rows_with<T, Acc>(
      c, in, dtype, "softmax",
      [&](const auto& p) {
        run_blocks<kRowThreads>(p.rows, scratch_bytes, [&](auto ctx, char* smem, int64_t row) {
          softmax_forward_row<T, Acc>(ctx, p, reinterpret_cast<Acc*>(smem), row);
        });
      },
      [&](const auto& p) {
        run_blocks<kRowThreads>(p.rows, scratch_bytes, [&](auto ctx, char* smem, int64_t row) {
          softmax_backward_row<T, Acc>(ctx, p, reinterpret_cast<Acc*>(smem), row);
        });
      });
  check_register_rows<RegisterRowsPerWarp, kRowThreads, T, Acc>(c, in, dtype, "register rows (warp)");
  check_register_rows<RegisterRows<1, 8>, 96, T, Acc>(c, in, dtype, "register rows (warp, 8 runs, 3 a block)");
  check_register_rows<RegisterRowsPerPair, kRowThreads, T, Acc>(c, in, dtype, "register rows (2 warps)");
}

template <typename T, typename Acc>
void check_case(const Case& c, at::ScalarType dtype) {
  at::manual_seed(7);
  const auto in = make_inputs(c, dtype);
  with_padded_head_dim(std::max(c.d_k, c.d_v),
                       [&](auto dp) { check_flash<T, Acc, decltype(dp)::value>(c, in, dtype); });
  if (c.d_k == 16) {  // the row kernels do not depend on the head size
    check_softmax_rows<T, Acc>(c, in, dtype);
  }
}

// Option 0: plain; 1: a mask with a fully masked row and padding; 2: causal and that mask, with more keys than a
// query block sees (block skipping); 3: dropout; 4: a decoding step (one query, a long cache) with mask and dropout;
// 5: causal alone over 150 queries and keys (the backward skips the query blocks above a key block). Options 6 to 9
// have masks with whole tiles of one kind (see MaskKind), over several query and key blocks of one head: 6: padding,
// is_causal and dropout (rows before batch 1's first kept key see none); 7: a padded decoder's mask; 8: masked
// query rows with is_causal; 9: blocks hidden from some queries; 10: padding and is_causal with a NaN value and an
// infinite key among the hidden keys (Case::poison), whose heads must skip nothing.
constexpr int kOptions = 11;
Case case_of(int64_t d_k, int64_t d_v, int option) {
  Case c;
  c.d_k = d_k;
  c.d_v = d_v;
  constexpr MaskKind kinds[kOptions] = {MaskKind::kNone,      MaskKind::kRandom, MaskKind::kRandom,  MaskKind::kNone,
                                        MaskKind::kRandom,    MaskKind::kNone,   MaskKind::kPadding, MaskKind::kDecoder,
                                        MaskKind::kQueryRows, MaskKind::kBlocks, MaskKind::kPadding};
  c.mask = kinds[option];
  c.causal = option == 2 || option == 5 || option == 6 || option == 8 || option == 10;
  c.dropout_p = option == 3 || option == 4 ? 0.3 : option == 6 ? 0.2 : 0.0;
  if (option == 2) {
    c.len_k = 150;
  }
  if (option == 4) {
    c.len_q = 1;
    c.len_k = 130;
  }
  if (option == 5) {
    c.len_q = c.len_k = 150;
  }
  if (option >= 6 && option < 10) {  // one head: the masks do not depend on it
    c.heads = 1;
    c.len_q = 100;
    c.len_k = option == 8 ? 100 : 160;
  }
  if (option == 10) {
    c.len_q = 40;
    c.len_k = 160;
    c.poison = true;
  }
  return c;
}

template <typename T, typename Acc>
void check_dtype(at::ScalarType dtype) {
  const std::pair<int64_t, int64_t> dims[] = {{16, 16}, {100, 72}, {200, 256}};
  for (const auto& [d_k, d_v] : dims) {
    // The masks with whole tiles of one kind at one head size: the tiles' classification does not depend on it.
    for (int option = 0; option < (d_k == 16 ? kOptions : 6); ++option) {
      const Case c = case_of(d_k, d_v, option);
      INFO("dtype " << dtype << " d_k " << d_k << " d_v " << d_v << " option " << option);
      check_case<T, Acc>(c, dtype);
    }
  }
}

// The mma forwards (16 and 32 rows per warp) over the same cases, head sizes up to 128 (16 is padded to 64: zero
// columns), with option 5 a case of several query and key blocks without a mask (the K/V double buffers taking
// turns).
template <typename T>
void check_mma_dtype(at::ScalarType dtype) {
  const std::pair<int64_t, int64_t> dims[] = {{16, 16}, {100, 72}, {128, 128}};
  for (const auto& [d_k, d_v] : dims) {
    for (int option = 0; option < (d_k == 100 ? kOptions : 6); ++option) {
      Case c = case_of(d_k, d_v, option == 5 ? 0 : option);
      if (option == 5) {
        c.batch = 1;
        c.len_q = 130;
        c.len_k = 200;
      }
      INFO("dtype " << dtype << " d_k " << d_k << " d_v " << d_v << " option " << option);
      at::manual_seed(7);
      const auto in = make_inputs(c, dtype);
      if (std::max(d_k, d_v) <= 64) {
        check_flash_mma<T, 64, 1>(c, in, dtype);
        check_flash_mma<T, 64, 2>(c, in, dtype);
      } else {
        check_flash_mma<T, 128, 1>(c, in, dtype);
        check_flash_mma<T, 128, 2>(c, in, dtype);
      }
    }
  }
}

}  // namespace

// Each dtype runs under the three thread orders of the emulator (see emulated_threads.h).
#define FASTMHA_KERNEL_BODY_TESTS(T, Acc, dtype, name)                                             \
  TEST_CASE("CUDA kernel bodies (emulated on the CPU) match the oracle: " name, "[cuda-bodies]") { \
    using fastmha::testing::Schedule;                                                              \
    for (const auto schedule : {Schedule::kForward, Schedule::kReverse, Schedule::kShuffled}) {    \
      INFO("thread order " << static_cast<int>(schedule));                                         \
      fastmha::testing::ScheduleScope scope(schedule);                                             \
      check_dtype<T, Acc>(dtype);                                                                  \
    }                                                                                              \
  }

FASTMHA_KERNEL_BODY_TESTS(double, double, at::kDouble, "float64")
FASTMHA_KERNEL_BODY_TESTS(float, float, at::kFloat, "float32")
FASTMHA_KERNEL_BODY_TESTS(c10::Half, float, at::kHalf, "float16")
FASTMHA_KERNEL_BODY_TESTS(c10::BFloat16, float, at::kBFloat16, "bfloat16")

#define FASTMHA_MMA_BODY_TESTS(T, dtype, name)                                                          \
  TEST_CASE("CUDA mma forward body (emulated on the CPU) matches the oracle: " name, "[cuda-bodies]") { \
    using fastmha::testing::Schedule;                                                                   \
    for (const auto schedule : {Schedule::kForward, Schedule::kReverse, Schedule::kShuffled}) {         \
      INFO("thread order " << static_cast<int>(schedule));                                              \
      fastmha::testing::ScheduleScope scope(schedule);                                                  \
      check_mma_dtype<T>(dtype);                                                                        \
    }                                                                                                   \
  }

FASTMHA_MMA_BODY_TESTS(c10::Half, at::kHalf, "float16")
FASTMHA_MMA_BODY_TESTS(c10::BFloat16, at::kBFloat16, "bfloat16")

// A decoding step under is_causal whose one visible score lies far below -1e9 (q = 16384, k_0 = -16384): the
// math spreads its weight over the keys the diagonal hides, so the forward must compute the key blocks it skips.
template <typename T, typename Acc>
void check_far_below_masked(at::ScalarType dtype) {
  Case c;
  c.batch = c.heads = c.len_q = 1;
  c.len_k = 60;  // within the first query block's diagonal reach, more than one key block of 32
  c.d_k = c.d_v = 100;
  c.causal = true;
  c.forward_only = true;
  at::manual_seed(7);
  auto in = make_inputs(c, dtype);
  in.q.fill_(16384);
  in.k.select(2, 0).fill_(-16384);
  check_flash<T, Acc, 128>(c, in, dtype);
  if constexpr (uses_tensor_cores<T>()) {
    check_flash_mma<T, 128, 1>(c, in, dtype);
    check_flash_mma<T, 128, 2>(c, in, dtype);
  }
}

TEST_CASE("CUDA flash forwards (emulated) spread a row scored far below -1e9 over the hidden keys", "[cuda-bodies]") {
  check_far_below_masked<float, float>(at::kFloat);
  check_far_below_masked<c10::BFloat16, float>(at::kBFloat16);
}

TEST_CASE("The weights-kept row kernels hold every row of up to 8192 keys in registers, the shortest shape that fits",
          "[cuda-bodies]") {
  const int64_t lengths[] = {1, 511, 512, 513, 1024, 1025, 8192};
  for (const auto len_k : lengths) {
    int64_t capacity = 0;
    REQUIRE(with_register_rows(len_k, [&](auto rows) { capacity = decltype(rows)::kCapacity; }));
    INFO("Lk " << len_k << " capacity " << capacity);
    CHECK(capacity >= len_k);
    // No smaller shape would have held the row.
    const int64_t smaller = capacity == kMaxRegisterKeys                 ? RegisterRowsPerPair::kCapacity
                            : capacity == RegisterRowsPerPair::kCapacity ? RegisterRowsPerWarp::kCapacity
                                                                         : 0;
    CHECK(len_k > smaller);
  }
  CHECK_FALSE(with_register_rows(8193, [](auto) {}));
  CHECK(kMaxRegisterKeys == 8192);
}

namespace {
struct OneThread {  // the part of a thread context that a row group's place reads
  static constexpr int kWarps = 1;
  int warp() const { return 0; }
  int thread() const { return 0; }
};
}  // namespace

TEST_CASE("Register rows take vector accesses only where every row and buffer starts on a run's size",
          "[cuda-bodies]") {
  alignas(64) static float scores[16];
  alignas(64) static c10::Half weights[16];
  SoftmaxRowsParams<c10::Half, float> p{};
  p.rows = p.heads = p.len_q = 1;
  p.len_k = 8;
  p.scores = scores;
  p.weights = weights;
  const auto vector = [&] { return RegisterRowPlace<RegisterRowsPerWarp, c10::Half, float>(OneThread{}, p, 0).vector; };
  CHECK(vector());
  p.len_k = 6;  // rows start between runs
  CHECK_FALSE(vector());
  p.len_k = 8;
  p.weights = weights + 1;
  CHECK_FALSE(vector());
  p.weights = weights + 4;  // 8 bytes: a run of four halves
  CHECK(vector());
  p.scores = scores + 2;
  CHECK_FALSE(vector());
  p.scores = scores;
  p.grad_scores = weights + 2;
  CHECK_FALSE(vector());
}
