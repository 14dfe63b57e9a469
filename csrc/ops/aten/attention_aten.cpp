#include "ops/aten/attention_aten.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cmath>

#include "ops/heads.h"
#include "ops/masked_score.h"

namespace fastmha::aten_impl {
namespace {

at::ScalarType accumulation_type(at::ScalarType t) { return at::toOpMathType(t); }

at::Tensor no_rng_state(const at::Tensor& query) { return at::zeros({2}, query.options().dtype(at::kLong)); }

}  // namespace

std::optional<at::Tensor> masked_positions(const std::optional<at::Tensor>& mask, bool is_causal,
                                           const at::Tensor& query, const at::Tensor& key) {
  std::optional<at::Tensor> masked;
  if (mask.has_value()) {
    masked = mask->eq(0);
  }
  if (is_causal) {
    auto above = at::ones({query.size(-2), key.size(-2)}, query.options().dtype(at::kBool)).triu(1);
    masked = masked.has_value() ? at::logical_or(*masked, above) : above;
  }
  return masked;
}

at::Tensor masked_scores(const at::Tensor& query_acc, const at::Tensor& key_acc,
                         const std::optional<at::Tensor>& masked) {
  auto scores = at::matmul(query_acc, key_acc.transpose(-2, -1));
  scores.div_(std::sqrt(static_cast<double>(query_acc.size(-1))));
  if (masked.has_value()) {
    scores.masked_fill_(*masked, kMaskedScore);
  }
  return scores;
}

detail::AttentionForwardResult attention_forward(const at::Tensor& query, const at::Tensor& key,
                                                 const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                 double dropout_p, bool need_weights, bool is_causal,
                                                 const DropoutKernels& dropout, bool need_logsumexp) {
  const auto acc = accumulation_type(query.scalar_type());
  const auto value_acc = value.to(acc);
  auto scores = masked_scores(query.to(acc), key.to(acc), masked_positions(mask, is_causal, query, key));
  auto logsumexp = need_logsumexp ? at::logsumexp(scores, -1) : at::Tensor();
  auto probs = at::softmax(scores, -1);
  at::Tensor rng_state;
  if (dropout_p > 0.0) {
    auto [multipliers, state] = dropout.draw(probs.sizes(), dropout_p, probs.options());
    // In place where no autograd records it (the kernels' calls); a recorded softmax saves its output.
    probs =
        probs.requires_grad() || probs._fw_grad(/*level=*/0).defined() ? probs * multipliers : probs.mul_(multipliers);
    rng_state = state;
  } else {
    rng_state = no_rng_state(query);
  }
  auto output = in_layout_of(at::matmul(probs, value_acc).to(query.scalar_type()), query);
  auto weights = need_weights ? probs.to(query.scalar_type()) : at::empty({0}, query.options());
  return {output, weights, logsumexp, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
    const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p, bool is_causal,
    const DropoutKernels& dropout, at::Tensor* applied_weights) {
  const auto acc = accumulation_type(query.scalar_type());
  const auto query_acc = query.to(acc);
  const auto key_acc = key.to(acc);
  const auto masked = masked_positions(mask, is_causal, query, key);
  // The softmax again (not exp(S - lse): in fp32, lse = -1e9 + log(Lk) of a fully masked row is too coarse).
  auto probs = at::softmax(masked_scores(query_acc, key_acc, masked), -1);
  at::Tensor multipliers;
  if (dropout_p > 0.0) {
    multipliers = dropout.replay(probs.sizes(), dropout_p, probs.options(), rng_state);
  }
  // The output's and the kept weights' gradients, either undefined (not both). Out of place where a batched
  // gradient (is_grads_batched) may meet an unbatched one, and where grad_weights itself would be written.
  at::Tensor grad_value, grad_applied;
  if (grad_output.defined()) {
    const auto grad_output_acc = grad_output.to(acc);
    const auto applied = multipliers.defined() ? probs * multipliers : probs;
    grad_value = at::matmul(applied.transpose(-2, -1), grad_output_acc);
    grad_applied = at::matmul(grad_output_acc, value.to(acc).transpose(-2, -1));
    if (applied_weights != nullptr) {
      *applied_weights = applied;
    }
  }
  if (grad_weights.has_value() && grad_weights->defined()) {
    grad_applied = grad_applied.defined() ? grad_applied + grad_weights->to(acc) : grad_weights->to(acc);
  }
  TORCH_INTERNAL_ASSERT(grad_applied.defined(), "fastmha: a backward without output or weights gradient");
  const auto grad_probs = multipliers.defined() ? grad_applied * multipliers : grad_applied;
  // softmax backward: dS = P * (dP - sum_j dP * P)
  auto grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, /*keepdim=*/true));
  if (masked.has_value()) {
    grad_scores.masked_fill_(*masked, 0.0);  // masked scores were overwritten: no gradient
  }
  grad_scores.div_(std::sqrt(static_cast<double>(query.size(-1))));
  auto grad_query = at::matmul(grad_scores, key_acc).to(query.scalar_type());
  auto grad_key = at::matmul(grad_scores.transpose(-2, -1), query_acc).to(key.scalar_type());
  return {in_layout_of(grad_query, query), in_layout_of(grad_key, key),
          grad_value.defined() ? in_layout_of(grad_value.to(value.scalar_type()), value) : at::Tensor()};
}

}  // namespace fastmha::aten_impl
