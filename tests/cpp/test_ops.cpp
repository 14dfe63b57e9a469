// The functional C++ API (fastmha::attention, fastmha::multi_head_attention) against the ATen oracle,
// forward and backward.
#include <torch/torch.h>

#include <fastmha/ops.h>
#include <catch2/catch.hpp>

#include "oracle.h"

namespace {
auto f64() { return torch::TensorOptions().dtype(torch::kFloat64); }
}  // namespace

TEST_CASE("attention core matches the oracle with and without masks", "[ops]") {
  torch::manual_seed(0);
  auto q = torch::randn({2, 3, 5, 4}, f64());
  auto k = torch::randn({2, 3, 7, 4}, f64());
  auto v = torch::randn({2, 3, 7, 6}, f64());
  std::vector<std::optional<at::Tensor>> masks = {std::nullopt, torch::rand({2, 1, 1, 7}) > 0.3,
                                                  torch::tril(torch::ones({5, 7}, torch::kInt32)),
                                                  (torch::rand({2, 1, 5, 7}) > 0.5).to(torch::kFloat32)};
  for (const auto& mask : masks) {
    auto [out, weights] = fastmha::attention(q, k, v, mask);
    auto [ref_out, ref_weights] = oracle::attention(q, k, v, mask);
    CHECK(oracle::close(out, ref_out));
    CHECK(oracle::close(weights, ref_weights));
  }
}

TEST_CASE("a fully masked row gives uniform weights, not NaN", "[ops]") {
  auto q = torch::randn({1, 1, 2, 4});
  auto k = torch::randn({1, 1, 5, 4});
  auto v = torch::randn({1, 1, 5, 3});
  auto mask = torch::ones({2, 5}, torch::kBool);
  mask[1].fill_(false);
  auto [out, weights] = fastmha::attention(q, k, v, mask);
  CHECK(torch::allclose(weights[0][0][1], torch::full({5}, 0.2)));
  CHECK(torch::allclose(out[0][0][1], v[0][0].mean(0), 1e-5, 1e-6));
}

TEST_CASE("need_weights=false returns an empty weights tensor", "[ops]") {
  auto q = torch::randn({1, 2, 3, 4});
  auto [out, weights] = fastmha::attention(q, q, q, std::nullopt, 0.0, false);
  CHECK(weights.numel() == 0);
  CHECK(out.sizes() == q.sizes());
}

TEST_CASE("multi_head_attention matches the oracle block, forward and backward", "[ops]") {
  torch::manual_seed(1);
  const int64_t d_model = 12, heads = 3;
  auto x = torch::randn({2, 5, d_model}, f64().requires_grad(true));
  auto kv = torch::randn({2, 6, d_model}, f64().requires_grad(true));
  std::vector<at::Tensor> w;
  for (int i = 0; i < 4; ++i) w.push_back(torch::randn({d_model, d_model}, f64().requires_grad(true)));
  auto mask = torch::rand({2, 1, 1, 6}) > 0.2;

  auto [out, weights] = fastmha::multi_head_attention(x, kv, kv, w[0], w[1], w[2], w[3], heads, mask);
  auto [ref_out, ref_weights] = oracle::block(x, kv, kv, w[0], w[1], w[2], w[3], heads, mask);
  REQUIRE(oracle::close(out, ref_out));
  REQUIRE(oracle::close(weights, ref_weights));

  auto grad_out = torch::randn_like(out);
  std::vector<at::Tensor> inputs = {x, kv, w[0], w[1], w[2], w[3]};
  auto grads = torch::autograd::grad({out}, inputs, {grad_out});
  auto ref_grads = torch::autograd::grad({ref_out}, inputs, {grad_out});
  for (size_t i = 0; i < grads.size(); ++i) {
    INFO("gradient " << i);
    CHECK(oracle::close(grads[i], ref_grads[i]));
  }
}

TEST_CASE("a gradient penalty through multi_head_attention matches the oracle block's (double backward)", "[ops]") {
  torch::manual_seed(2);
  const int64_t d_model = 8, heads = 2;
  auto x = torch::randn({2, 5, d_model}, f64().requires_grad(true));
  std::vector<at::Tensor> w;
  for (int i = 0; i < 4; ++i) w.push_back(torch::randn({d_model, d_model}, f64().requires_grad(true)));
  auto mask = torch::rand({2, 1, 1, 5}) > 0.3;
  mask.index_put_({torch::indexing::Slice(), 0, 0, 0}, true);  // a visible key in every row
  const std::vector<at::Tensor> inputs = {x, w[0], w[1], w[2], w[3]};
  const auto penalty_grads = [&](const at::Tensor& out) {
    auto first = torch::autograd::grad({out.square().sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    return torch::autograd::grad({first[0].square().sum()}, inputs);
  };
  auto grads = penalty_grads(std::get<0>(fastmha::multi_head_attention(x, x, x, w[0], w[1], w[2], w[3], heads, mask)));
  auto ref_grads = penalty_grads(oracle::block(x, x, x, w[0], w[1], w[2], w[3], heads, mask).first);
  for (size_t i = 0; i < grads.size(); ++i) {
    INFO("gradient " << i);
    CHECK(oracle::close(grads[i], ref_grads[i]));
  }
}

TEST_CASE("bad inputs raise errors naming the argument", "[ops]") {
  auto x = torch::randn({2, 3, 8});
  auto w = torch::randn({8, 8});
  CHECK_THROWS_WITH(fastmha::multi_head_attention(x, x, x, w, w, w, w, 3),
                    Catch::Contains("d_model must be divisible by num_heads, got d_model 8 and num_heads 3"));
  CHECK_THROWS_WITH(fastmha::multi_head_attention(x[0], x, x, w, w, w, w, 2),
                    Catch::Contains("query must be 3-D (batch, Lq, d_model), got shape [3, 8]"));
  CHECK_THROWS_WITH(fastmha::multi_head_attention(x, x, x, w, w, w, w, 2, std::nullopt, 1.5),
                    Catch::Contains("dropout_p must be in [0, 1), got 1.5"));
  CHECK_THROWS_WITH(fastmha::attention(x, x, x), Catch::Contains("query must be 4-D"));
}

TEST_CASE("decoding steps match the causal block, and caches are named", "[ops]") {
  torch::manual_seed(5);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto x = torch::randn({2, 5, 8}, opts);
  auto w_q = torch::randn({8, 8}, opts), w_k = torch::randn({8, 8}, opts), w_v = torch::randn({8, 8}, opts),
       w_o = torch::randn({8, 8}, opts);
  // Two positions, then three more on the returned caches.
  auto [first, keys, values] = fastmha::multi_head_attention_step(x.slice(1, 0, 2), w_q, w_k, w_v, w_o, 2);
  auto [rest, all_keys, all_values] =
      fastmha::multi_head_attention_step(x.slice(1, 2, 5), w_q, w_k, w_v, w_o, 2, keys, values);
  CHECK(all_keys.sizes() == torch::IntArrayRef({2, 2, 5, 4}));
  auto causal = torch::tril(torch::ones({5, 5}));
  auto expected = oracle::block(x, x, x, w_q, w_k, w_v, w_o, 2, causal).first;
  CHECK(oracle::close(torch::cat({first, rest}, 1), expected));
  // A C++ caller's undefined tensor where Python passes None.
  CHECK_THROWS_WITH(fastmha::multi_head_attention_step(x, w_q, w_k, w_v, w_o, 2, torch::Tensor(), torch::Tensor()),
                    Catch::Contains("key_cache must be a tensor, got None (an undefined tensor)"));
  CHECK_THROWS_WITH(fastmha::multi_head_attention_step(x, w_q, w_k, w_v, w_o, 2, keys, torch::Tensor()),
                    Catch::Contains("value_cache must be a tensor, got None (an undefined tensor)"));
  CHECK_THROWS_WITH(fastmha::multi_head_attention_step(x, w_q, w_k, w_v, w_o, 2, keys),
                    Catch::Contains("key_cache and value_cache must be given together"));
  CHECK_THROWS_WITH(
      fastmha::multi_head_attention_step(x, w_q, w_k, w_v, w_o, 2, std::nullopt, std::nullopt, torch::Tensor()),
      Catch::Contains("mask must be a tensor, got None (an undefined tensor)"));
}
