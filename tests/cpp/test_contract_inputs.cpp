// The contract layer's inputs (ops/stock/contract_inputs.h) in both bias layouts, run through torch's CPU flash
// kernel (which reads any bias strides) and its backward, against the float64 oracle: the row-aligned layout is the
// one the memory-efficient CUDA kernel is given, so its logic is proven here without a GPU. Masks of several
// dtypes and broadcast shapes, rows with no visible key, causality folded into the bias, key counts off the
// alignment.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ops/stock/contract_inputs.h"
#include "oracle.h"

namespace {

using fastmha::stock::BiasLayout;
using fastmha::stock::ContractInputs;

struct Case {
  std::string name;
  at::Tensor mask;
  bool is_causal;
};

// Batch 2, 3 heads, 20 queries, 37 keys (not a multiple of the row alignment).
constexpr int64_t kBatch = 2, kHeads = 3, kQueries = 20, kKeys = 37;

std::vector<Case> cases() {
  torch::manual_seed(7);
  std::vector<Case> all;
  auto padding = torch::ones({kBatch, 1, 1, kKeys}, torch::kInt32);
  padding.index_put_({1, 0, 0, torch::indexing::Slice(9, torch::indexing::None)}, 0);  // 28 of 37 keys padded
  all.push_back({"padding (B, 1, 1, Lk) int", padding, false});
  auto holes = torch::rand({kBatch, 1, kQueries, kKeys}) > 0.4;
  holes.index_put_({0, 0, 1}, false);  // a row with no visible key
  holes.index_put_({1, 0, 5}, false);
  all.push_back({"random (B, 1, Lq, Lk) bool with dead rows", holes, false});
  auto everywhere = torch::zeros({kBatch, 1, 1, kKeys}, torch::kFloat32);
  everywhere.index_put_({0}, 1.0);  // batch 1 sees no key at all
  all.push_back({"a batch with no visible key (float)", everywhere, false});
  auto per_row = (torch::rand({kQueries, 1}) > 0.3).to(torch::kFloat64);  // broadcast over the keys
  all.push_back({"(Lq, 1) float broadcast over keys", per_row, false});
  auto late_keys = torch::zeros({kBatch, 1, 1, kKeys}, torch::kBool);
  late_keys.index_put_({torch::indexing::Slice(), 0, 0, torch::indexing::Slice(4, torch::indexing::None)}, true);
  all.push_back({"causal and keys 0-3 hidden: rows 0-3 dead", late_keys, true});
  all.push_back({"causal with random holes", torch::rand({kQueries, kKeys}) > 0.5, true});
  return all;
}

at::Tensor visible_in_math(const Case& c) {
  auto visible = c.mask != 0;
  if (c.is_causal) {
    visible = visible.logical_and(torch::ones({kQueries, kKeys}, torch::kBool).tril());
  }
  return visible;
}

// The CPU flash kernel given the contract's inputs; output, the op's log-sum-exp and the three gradients.
struct Run {
  at::Tensor output, lse, grad_q, grad_k, grad_v;
};

Run run_stock(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& grad_out, const Case& c,
              BiasLayout layout) {
  const ContractInputs p = fastmha::stock::contract_inputs(q, k, c.mask, c.is_causal, layout);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  auto [output, stock_lse] =
      at::_scaled_dot_product_flash_attention_for_cpu(p.query, k, v, 0.0, p.is_causal, p.bias, scale);
  Run run;
  run.output = output;
  run.lse = fastmha::stock::to_contract_lse(stock_lse, p, kKeys);
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      grad_out, p.query, k, v, output, fastmha::stock::to_stock_lse(run.lse, p, kKeys), 0.0, p.is_causal, p.bias,
      scale);
  run.grad_q = fastmha::stock::to_contract_grad_query(gq, p);
  run.grad_k = gk;
  run.grad_v = gv;
  return run;
}

}  // namespace

TEST_CASE("the contract's inputs in both bias layouts give the oracle's outputs, log-sum-exp and gradients",
          "[contract-inputs]") {
  torch::manual_seed(3);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const auto q = torch::randn({kBatch, kHeads, kQueries, 16}, f64);
  const auto k = torch::randn({kBatch, kHeads, kKeys, 16}, f64);
  const auto v = torch::randn({kBatch, kHeads, kKeys, 16}, f64);
  const auto grad_out = torch::randn({kBatch, kHeads, kQueries, 16}, f64);
  for (const auto& c : cases()) {
    const auto visible = visible_in_math(c);
    const auto q_ref = q.clone().requires_grad_(true), k_ref = k.clone().requires_grad_(true);
    const auto v_ref = v.clone().requires_grad_(true);
    const auto [out_ref, weights_ref] = oracle::attention(q_ref, k_ref, v_ref, visible);
    const auto grads_ref = torch::autograd::grad({(out_ref * grad_out).sum()}, {q_ref, k_ref, v_ref});
    const auto scores = at::matmul(q, k.transpose(-2, -1)) / 4.0;
    const auto lse_ref = at::where(visible, scores, at::full_like(scores, -1e9)).logsumexp(-1);
    for (const auto layout : {BiasLayout::kBroadcast, BiasLayout::kRowAligned}) {
      INFO(c.name << (layout == BiasLayout::kRowAligned ? ", row-aligned" : ", broadcast"));
      const auto q_before = q.clone();
      const auto run = run_stock(q, k, v, grad_out, c, layout);
      CHECK(torch::equal(q, q_before));  // the user's query is not written
      CHECK(oracle::close(run.output, out_ref, 1e-9, 1e-10));
      CHECK(oracle::close(run.lse, lse_ref, 1e-9, 1e-6));  // -1e9 + log Lk in dead rows
      CHECK(oracle::close(run.grad_q, grads_ref[0], 1e-9, 1e-10));
      CHECK(oracle::close(run.grad_k, grads_ref[1], 1e-9, 1e-10));
      CHECK(oracle::close(run.grad_v, grads_ref[2], 1e-9, 1e-10));
    }
  }
}

TEST_CASE("the rows SDPA's choice is asked about have the layout of the kernel's bias", "[contract-inputs]") {
  // torch's rules refuse a bias whose last stride is not 1, so a stand-in expanded from one value would never be
  // chosen for the memory-efficient kernel.
  const auto q = torch::randn({kBatch, kHeads, kQueries, 8});
  for (const int64_t keys : {1, 16, 37, 64}) {
    const auto rows = fastmha::stock::empty_row_aligned_bias_rows({1, 1, 1}, q, keys);
    const auto stand_in = rows.expand({kBatch, kHeads, kQueries, keys});
    CHECK(stand_in.stride(3) == 1);
    CHECK(rows.stride(2) % fastmha::stock::kBiasRowAlign == 0);
    CHECK(stand_in.sizes() == at::IntArrayRef({kBatch, kHeads, kQueries, keys}));
  }
}

TEST_CASE("the row-aligned bias has the score shape, a dense last dimension and aligned rows", "[contract-inputs]") {
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16, torch::kFloat64}) {
    const auto q = torch::randn({kBatch, kHeads, kQueries, 8}).to(dtype);
    const auto k = torch::randn({kBatch, kHeads, kKeys, 8}).to(dtype);
    for (const auto& c : cases()) {
      INFO(c.name << " in " << dtype);
      const auto p = fastmha::stock::contract_inputs(q, k, c.mask, c.is_causal, BiasLayout::kRowAligned);
      REQUIRE(p.bias.has_value());
      const auto& bias = *p.bias;
      CHECK(bias.scalar_type() == dtype);
      CHECK(bias.sizes() == at::IntArrayRef({kBatch, kHeads, kQueries, kKeys}));
      CHECK(bias.stride(3) == 1);
      for (int64_t d = 0; d < 3; ++d) {
        CHECK(bias.stride(d) % fastmha::stock::kBiasRowAlign == 0);
      }
      CHECK(reinterpret_cast<uintptr_t>(bias.data_ptr()) % 16 == 0);
      CHECK_FALSE(p.is_causal);      // folded into the bias
      CHECK(p.dead_rows.defined());  // known without reading the mask back
      // Each row of the bias is 0 where the key is visible and -inf elsewhere, or 0 everywhere in a dead row.
      auto visible = visible_in_math(c).expand({kBatch, kHeads, kQueries, kKeys});
      const auto dead = visible.any(-1, true).logical_not();
      const auto want = at::where(visible.logical_or(dead), 0.0, -std::numeric_limits<double>::infinity());
      CHECK(torch::equal(bias.to(torch::kFloat64), want.to(torch::kFloat64)));
      CHECK(torch::equal(p.dead_rows.expand({kBatch, kHeads, kQueries, 1}), dead));
    }
  }
}
