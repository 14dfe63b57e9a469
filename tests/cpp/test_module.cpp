// The C++ module fastmha::MultiHeadAttention: parameter names, numbers, weights, modes and training.
#include <torch/torch.h>

#include <fastmha/module.h>
#include <fastmha/ops.h>
#include <fastmha/serialize.h>

#include <catch2/catch.hpp>
#include <filesystem>

#include "oracle.h"

TEST_CASE("parameters are named like the Python module", "[module]") {
  fastmha::MultiHeadAttention mha(fastmha::MultiHeadAttentionOptions(16, 4).dropout(0.1));
  std::vector<std::string> names;
  for (const auto& item : mha->named_parameters()) {
    names.push_back(item.key());
    CHECK(item.value().sizes() == torch::IntArrayRef({16, 16}));
  }
  CHECK(names == std::vector<std::string>{"w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"});
}

TEST_CASE("forward matches the oracle and keeps the weights", "[module]") {
  torch::manual_seed(2);
  fastmha::MultiHeadAttention mha(16, 4);
  mha->to(torch::kFloat64);
  auto x = torch::randn({2, 5, 16}, torch::kFloat64);
  auto mask = torch::tril(torch::ones({5, 5}));
  auto out = mha(x, x, x, mask);
  auto [ref_out, ref_weights] =
      oracle::block(x, x, x, mha->w_q->weight, mha->w_k->weight, mha->w_v->weight, mha->w_o->weight, 4, mask);
  CHECK(oracle::close(out, ref_out));
  CHECK(oracle::close(mha->attention_scores(), ref_weights));
  // The mask is optional (default argument, also through AnyModule / Sequential).
  CHECK(oracle::close(
      mha(x, x, x),
      oracle::block(x, x, x, mha->w_q->weight, mha->w_k->weight, mha->w_v->weight, mha->w_o->weight, 4).first));
}

TEST_CASE("need_weights=false keeps no weights", "[module]") {
  fastmha::MultiHeadAttention mha(fastmha::MultiHeadAttentionOptions(8, 2).need_weights(false));
  auto x = torch::randn({1, 3, 8});
  mha(x, x, x);
  CHECK_FALSE(mha->attention_scores().defined());
}

TEST_CASE("dropout only in training mode", "[module]") {
  fastmha::MultiHeadAttention mha(fastmha::MultiHeadAttentionOptions(8, 2).dropout(0.5));
  auto x = torch::randn({2, 16, 8});
  mha->eval();
  CHECK(torch::equal(mha(x, x, x), mha(x, x, x)));
  CHECK((mha->attention_scores() == 0).sum().item<int64_t>() == 0);
  mha->train();
  mha(x, x, x);
  const double dropped = (mha->attention_scores() == 0).to(torch::kFloat64).mean().item<double>();
  CHECK(dropped > 0.4);
  CHECK(dropped < 0.6);
}

TEST_CASE("the dropout submodule decides, as in Python", "[module]") {
  fastmha::MultiHeadAttention mha(fastmha::MultiHeadAttentionOptions(8, 2));
  mha->to(torch::kFloat64);
  auto x = torch::randn({2, 16, 8}, torch::kFloat64);
  mha->train();
  mha->dropout->options.p(0.5);  // after construction: forward reads the submodule
  mha(x, x, x);
  const double dropped = (mha->attention_scores() == 0).to(torch::kFloat64).mean().item<double>();
  CHECK(dropped > 0.4);
  CHECK(dropped < 0.6);
  std::ostringstream printed;
  mha->pretty_print(printed);
  CHECK(printed.str().find("dropout=0.5") != std::string::npos);
  mha->dropout->eval();  // its own mode, as nn.Dropout's in the Python block
  auto eval_out = mha(x, x, x);
  CHECK((mha->attention_scores() == 0).sum().item<int64_t>() == 0);
  CHECK(oracle::close(
      eval_out,
      oracle::block(x, x, x, mha->w_q->weight, mha->w_k->weight, mha->w_v->weight, mha->w_o->weight, 2).first));
  mha->dropout->train();
  mha->dropout->options.p(1.0);  // every weight dropped
  CHECK(torch::equal(mha(x, x, x), torch::zeros({2, 16, 8}, torch::kFloat64)));
  CHECK(torch::equal(mha->attention_scores(), torch::zeros({2, 2, 16, 16}, torch::kFloat64)));
  mha->dropout->options.p(1.5);
  CHECK_THROWS_WITH(mha(x, x, x), Catch::Contains("dropout must be in [0, 1], got 1.5"));
}

TEST_CASE("invalid options are rejected", "[module]") {
  CHECK_THROWS_WITH(fastmha::MultiHeadAttention(10, 3), Catch::Contains("d_model must be divisible by heads"));
  CHECK_THROWS_WITH(fastmha::MultiHeadAttention(fastmha::MultiHeadAttentionOptions(8, 2).dropout(1.5)),
                    Catch::Contains("dropout must be in [0, 1], got 1.5"));
  CHECK_THROWS_WITH(fastmha::MultiHeadAttention(fastmha::MultiHeadAttentionOptions(8, 2).dropout(-0.1)),
                    Catch::Contains("dropout must be in [0, 1], got -0.1"));
  CHECK_THROWS_WITH(fastmha::MultiHeadAttention(0, 1), Catch::Contains("d_model must be positive"));
}

TEST_CASE("clone gives independent parameters", "[module]") {
  fastmha::MultiHeadAttention mha(8, 2);
  auto copy = std::dynamic_pointer_cast<fastmha::MultiHeadAttentionImpl>(mha->clone());
  REQUIRE(copy);
  torch::NoGradGuard no_grad;
  copy->w_q->weight.add_(1.0);
  CHECK_FALSE(torch::equal(copy->w_q->weight, mha->w_q->weight));
}

TEST_CASE("a tiny model trains in C++ through the Autograd kernel", "[module]") {
  torch::manual_seed(3);
  fastmha::MultiHeadAttention mha(8, 2);
  torch::nn::Linear head(8, 1);
  std::vector<torch::Tensor> params = mha->parameters();
  for (auto& p : head->parameters()) params.push_back(p);
  torch::optim::Adam optimizer(params, torch::optim::AdamOptions(1e-2));
  auto x = torch::randn({8, 4, 8});
  auto target = x.sum({1, 2}).unsqueeze(1) * 0.05;
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    optimizer.zero_grad();
    auto loss = (head(mha(x, x, x).mean(1)) - target).pow(2).mean();
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  CHECK(last < 0.5 * first);
}

TEST_CASE("padded batches: unseen keys and zero gradient rows match autograd through the oracle", "[module]") {
  // Sentences of 2 and 3 keys out of 8 (most keys unseen: the block leaves their projections out) and of 3 and 2
  // queries out of 6 (the loss ignores the rest: zero rows of the output's gradient).
  torch::manual_seed(4);
  const auto options = torch::TensorOptions().dtype(torch::kFloat64);
  const auto q = torch::randn({2, 6, 8}, options), k = torch::randn({2, 8, 8}, options);
  const auto v = torch::randn({2, 8, 8}, options);
  const auto mask = (torch::arange(8).unsqueeze(0) < torch::tensor({2, 3}).unsqueeze(1)).view({2, 1, 1, 8});
  const auto kept = (torch::arange(6).unsqueeze(0) < torch::tensor({3, 2}).unsqueeze(1)).unsqueeze(2);
  const auto loss_weights = torch::randn({2, 6, 8}, options) * kept;
  std::vector<torch::Tensor> weights;
  for (int i = 0; i < 4; ++i) weights.push_back(torch::randn({8, 8}, options) * 0.3);
  auto gradients = [&](bool reference) {
    std::vector<torch::Tensor> leaves;
    for (const auto& t : {q, k, v, weights[0], weights[1], weights[2], weights[3]}) {
      leaves.push_back(t.clone().requires_grad_(true));
    }
    const auto& l = leaves;
    const auto out =
        reference ? oracle::block(l[0], l[1], l[2], l[3], l[4], l[5], l[6], 2, mask).first
                  : std::get<0>(fastmha::multi_head_attention(l[0], l[1], l[2], l[3], l[4], l[5], l[6], 2, mask));
    (out * loss_weights).sum().backward();
    std::vector<torch::Tensor> grads;
    for (const auto& leaf : leaves) grads.push_back(leaf.grad());
    return grads;
  };
  const auto got = gradients(false), want = gradients(true);
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("gradient " << i);
    CHECK(oracle::close(got[i], want[i]));
  }
  CHECK((got[1].slice(1, 3) == 0).all().item<bool>());  // keys 3.. are unseen in both sentences
}

TEST_CASE("is_causal matches an explicit lower-triangular mask", "[module]") {
  torch::manual_seed(4);
  fastmha::MultiHeadAttention mha(fastmha::MultiHeadAttentionOptions(16, 4).is_causal(true));
  mha->to(torch::kFloat64);
  auto x = torch::randn({2, 7, 16}, torch::kFloat64);
  auto out = mha(x, x, x);
  auto [ref_out, ref_weights] = oracle::block(x, x, x, mha->w_q->weight, mha->w_k->weight, mha->w_v->weight,
                                              mha->w_o->weight, 4, torch::tril(torch::ones({7, 7})));
  CHECK(oracle::close(out, ref_out));
  CHECK(oracle::close(mha->attention_scores(), ref_weights));
  std::ostringstream printed;
  mha->pretty_print(printed);
  CHECK(printed.str() ==
        "fastmha::MultiHeadAttention(d_model=16, heads=4, dropout=0, need_weights=true, is_causal=true)");
}

TEST_CASE("state dicts round-trip through a file in torch.save's format", "[module]") {
  fastmha::MultiHeadAttention source(16, 4), target(16, 4);
  const auto path = std::filesystem::temp_directory_path() / "fastmha_cpp_state_dict.pt";
  fastmha::save_state_dict(*source, path.string());
  fastmha::load_state_dict(*target, path.string());
  for (const auto& name : {"w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"}) {
    CHECK(torch::equal(source->named_parameters()[name], target->named_parameters()[name]));
  }
  fastmha::MultiHeadAttention other(8, 2);
  CHECK_THROWS_WITH(fastmha::load_state_dict(*other, path.string()),
                    Catch::Contains("'w_q.weight' has shape [16, 16]") && Catch::Contains("but [8, 8] in the module"));
  std::filesystem::remove(path);
}

TEST_CASE("forward_step decodes as forward does with a causal mask", "[module]") {
  torch::manual_seed(11);
  fastmha::MultiHeadAttention mha(fastmha::MultiHeadAttentionOptions(16, 4).dropout(0.3));
  mha->to(torch::kFloat64);
  mha->eval();
  auto x = torch::randn({2, 6, 16}, torch::kFloat64);
  auto padding = torch::ones({2, 1, 1, 6}, torch::kLong);
  padding.index_put_({1, 0, 0, 2}, 0);  // the second sequence hides its third position (no row sees no key)
  auto expected = mha(x, x, x, torch::tril(torch::ones({6, 6}, torch::kLong)) * padding);
  auto before = mha->attention_scores();
  // One position, then two, then three, each step given the mask's columns up to its last position.
  std::optional<std::pair<at::Tensor, at::Tensor>> cache;
  std::vector<at::Tensor> outputs;
  for (const auto& [from, to] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 3}, {3, 6}}) {
    auto [out, next] = mha->forward_step(x.slice(1, from, to), cache, padding.slice(3, 0, to));
    CHECK(next.first.sizes() == torch::IntArrayRef({2, 4, to, 4}));
    outputs.push_back(out);
    cache = next;
  }
  CHECK(oracle::close(torch::cat(outputs, 1), expected));
  CHECK(mha->attention_scores().is_same(before));  // left as it was
  const auto eval_step = mha->forward_step(x).first;
  // In training mode the dropout submodule's p reaches the step op: the same draw as the op given that p.
  mha->train();
  torch::manual_seed(5);
  const auto dropped = mha->forward_step(x).first;
  torch::manual_seed(5);
  const auto direct = std::get<0>(fastmha::multi_head_attention_step(x, mha->w_q->weight, mha->w_k->weight,
                                                                     mha->w_v->weight, mha->w_o->weight, 4,
                                                                     std::nullopt, std::nullopt, std::nullopt, 0.3));
  CHECK(torch::equal(dropped, direct));
  CHECK(!oracle::close(dropped, eval_step));
  // The submodule's own mode decides, also while the module trains.
  mha->dropout->eval();
  CHECK(torch::equal(mha->forward_step(x).first, eval_step));
  // p = 1 drops every weight.
  mha->dropout->train();
  mha->dropout->options.p(1.0);
  CHECK(torch::equal(mha->forward_step(x).first, torch::zeros({2, 6, 16}, torch::kFloat64)));
}
