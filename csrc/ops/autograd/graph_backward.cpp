#include "ops/autograd/graph_backward.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <tuple>

#include "ops/aten/attention_aten.h"
#include "ops/dropout.h"
#include "ops/heads.h"

namespace fastmha::detail {
namespace {

using torch::autograd::variable_list;

const DropoutKernels kReplay{nullptr, &replayed_multipliers};

// The core's (query, key, value) gradients from the ATen implementation's formulas: differentiable ATen ops, out of
// place wherever autograd saves a tensor. No value gradient without an output gradient; none at all without either.
// applied_weights: as in aten_impl::attention_backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> core_grads(const at::Tensor& query, const at::Tensor& key,
                                                          const at::Tensor& value,
                                                          const std::optional<at::Tensor>& mask,
                                                          const at::Tensor& rng_state, double dropout_p, bool is_causal,
                                                          const at::Tensor& grad_output, const at::Tensor& grad_weights,
                                                          at::Tensor* applied_weights = nullptr) {
  if (!grad_output.defined() && !grad_weights.defined()) {
    return {};
  }
  const auto grad_w = grad_weights.defined() ? std::optional<at::Tensor>(grad_weights) : std::nullopt;
  return aten_impl::attention_backward(grad_output, grad_w, query, key, value, mask, /*output=*/at::Tensor(),
                                       /*logsumexp=*/at::Tensor(), rng_state, dropout_p, is_causal, kReplay,
                                       applied_weights);
}

// x W^T's gradients (x: batch, L, d_in) for its gradient g: (dx, dW), each only where asked (else undefined).
std::pair<at::Tensor, at::Tensor> projection_grads(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& grad, bool x_asked, bool weight_asked) {
  return {x_asked ? at::matmul(grad, weight) : at::Tensor(),
          weight_asked ? flatten_rows(grad).t().mm(flatten_rows(x)) : at::Tensor()};
}

}  // namespace

variable_list attention_grads_with_graph(const variable_list& inputs, const std::optional<at::Tensor>& mask,
                                         const at::Tensor& rng_state, double dropout_p, bool is_causal,
                                         const at::Tensor& grad_output, const at::Tensor& grad_weights) {
  // The ATen ops in the kernels' dtypes: an autocast region around the backward must not recast them.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto [grad_query, grad_key, grad_value] =
      core_grads(inputs[0], inputs[1], inputs[2], mask, rng_state, dropout_p, is_causal, grad_output, grad_weights);
  return {grad_query, grad_key, grad_value};
}

variable_list block_grads_with_graph(const variable_list& inputs, const variable_list& projections,
                                     const variable_list& grad_projections, const std::array<bool, 7>& asked,
                                     int64_t num_heads, const std::optional<at::Tensor>& mask,
                                     const at::Tensor& rng_state, double dropout_p, bool is_causal,
                                     const at::Tensor& grad_output, const at::Tensor& grad_weights) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto& w_o = inputs[6];
  // The projections are the node's own outputs: a second differentiation reaches them as functions of the inputs
  // and weights. Rows of unseen keys, which the forward left at zero (ops/unseen_keys.h), weigh exactly 0 there as
  // in the forward.
  const auto q = split_heads(projections[0], num_heads), k = split_heads(projections[1], num_heads);
  const auto v = split_heads(projections[2], num_heads);
  // Without an output gradient only the weights have one: nothing flows through w_o.
  const auto grad_context = grad_output.defined() ? split_heads(at::matmul(grad_output, w_o), num_heads) : at::Tensor();
  // The weights after dropout, as the forward applied them: w_o's gradient needs the context they give.
  at::Tensor applied;
  const auto [grad_q, grad_k, grad_v] =
      core_grads(q, k, v, mask, rng_state, dropout_p, is_causal, grad_context, grad_weights, &applied);
  variable_list grads(7);
  const std::array<at::Tensor, 3> grad_heads{grad_q, grad_k, grad_v};
  for (size_t i = 0; i < grad_heads.size(); ++i) {
    // x_proj = x W^T for x in (query, key, value), its gradient from the attention and from other paths
    const auto& other = grad_projections[i];
    const auto merged = grad_heads[i].defined() ? merge_heads(grad_heads[i]) : at::Tensor();
    const auto grad = merged.defined() && other.defined() ? merged + other : merged.defined() ? merged : other;
    if (grad.defined()) {
      std::tie(grads[i], grads[i + 3]) = projection_grads(inputs[i], inputs[i + 3], grad, asked[i], asked[i + 3]);
    }
  }
  if (grad_output.defined() && asked[6]) {  // the context w_o multiplied, from the weights the core recomputed
    const auto context = merge_heads(at::matmul(applied, v.to(applied.scalar_type())).to(v.scalar_type()));
    grads[6] = flatten_rows(grad_output).t().mm(flatten_rows(context));
  }
  return grads;
}

}  // namespace fastmha::detail
