// Autograd for the attention core, in C++ so TorchScript and C++ callers can train. The forward saves the
// per-row log-sum-exp and the dropout rng_state; the backward op recomputes the weights from them, or, where they
// serve it (weights_serve_backward), reads the weights the call kept. With create_graph=True the gradients are
// built from ATen ops instead, so that they can be differentiated again (graph_backward.h).
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/attention_ops.h"
#include "ops/autograd/forward_ad.h"
#include "ops/autograd/graph_backward.h"
#include "ops/broadcast_mask.h"
#include "ops/checks.h"
#include "ops/kernel_choice.h"

namespace fastmha {
namespace {

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& query,
                                                const at::Tensor& key, const at::Tensor& value,
                                                const std::optional<at::Tensor>& user_mask, double dropout_p,
                                                bool need_weights, bool is_causal) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // The forward and the backward read the same mask: a small one is converted to bool once, for both.
    const std::optional<at::Tensor> mask = mask_to_save(user_mask, query);
    auto [output, weights, logsumexp, rng_state] =
        detail::attention_forward(query, key, value, mask, dropout_p, need_weights, is_causal);
    const AttentionCall call{query, key, value, mask, dropout_p, need_weights, is_causal};
    const bool save_weights = weights.defined() && weights_serve_backward(call);
    ctx->save_for_backward({query, key, value, mask.value_or(at::Tensor()), output, logsumexp, rng_state,
                            save_weights ? weights : at::Tensor()});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    // Kept weights that the loss never reads get no gradient: no (batch, h, Lq, Lk) tensor of zeros is made,
    // filled and read back in the backward.
    ctx->set_materialize_grads(false);
    // Without kept weights the Function has the output alone: its caller makes the empty weights tensor. Marking
    // that tensor non-differentiable instead would leave the node unusable under compiled autograd.
    if (!need_weights) {
      return {output};
    }
    return {output, weights};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    grads.resize(2);  // a call without kept weights has the output alone
    const auto saved = ctx->get_saved_variables();
    const auto mask = detail::optional_if_defined(saved[3]);
    if (at::GradMode::is_enabled()) {  // create_graph=True: gradients that can be differentiated again
      auto g = detail::attention_grads_with_graph({saved[0], saved[1], saved[2]}, mask, saved[6],
                                                  ctx->saved_data["dropout_p"].toDouble(),
                                                  ctx->saved_data["is_causal"].toBool(), grads[0], grads[1]);
      return {g[0], g[1], g[2], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto grad_weights = detail::optional_if_defined(grads[1]);
    // When only the kept weights reach the loss, the output and the value take no part in the gradients: zeros
    // stand for them (and for the output's gradient), so that a non-finite value makes no 0 * inf = NaN in
    // dO V^T or in D = dO . O.
    const bool output_reaches_loss = grads[0].defined();
    const auto grad_output = output_reaches_loss ? grads[0] : at::zeros_like(saved[4]);
    const auto value = output_reaches_loss ? saved[2] : at::zeros_like(saved[2]);
    const auto output = output_reaches_loss ? saved[4] : grad_output;
    auto [grad_query, grad_key, grad_value] =
        detail::attention_backward(grad_output, grad_weights, saved[0], saved[1], value, mask, output, saved[5],
                                   saved[6], ctx->saved_data["dropout_p"].toDouble(),
                                   ctx->saved_data["is_causal"].toBool(), detail::optional_if_defined(saved[7]));
    if (!output_reaches_loss) {
      grad_value = at::Tensor();  // only the kept weights reach the loss: no gradient (None), not zeros
    }
    return {grad_query, grad_key, grad_value, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_autograd(const at::Tensor& query, const at::Tensor& key,
                                                      const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                      double dropout_p, bool need_weights, bool is_causal) {
  check_dense_attention_args(query, key, value, mask);
  // Dual tensors (forward-mode AD): the Function has no forward derivative.
  if (detail::takes_forward_ad({query, key, value, mask.value_or(at::Tensor())})) {
    return detail::attention_with_tangents(query, key, value, mask, dropout_p, need_weights, is_causal);
  }
  const bool any_requires_grad = query.requires_grad() || key.requires_grad() || value.requires_grad() ||
                                 (mask.has_value() && mask->requires_grad());  // (the mask gets none, but a node)
  if (!at::GradMode::is_enabled() || !any_requires_grad) {
    // Nothing to differentiate: the forward alone, without a Function's context and saved tensors (their cost
    // shows on short calls).
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [output, weights, logsumexp, rng_state] =
        detail::attention_forward(query, key, value, mask_to_save(mask, query), dropout_p, need_weights, is_causal);
    return {output, need_weights ? weights : at::empty({0}, query.options())};
  }
  auto outputs = AttentionFunction::apply(query, key, value, mask, dropout_p, need_weights, is_causal);
  return {outputs[0], need_weights ? outputs[1] : at::empty({0}, query.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastmha, Autograd, m) { m.impl("attention", &attention_autograd); }

}  // namespace fastmha
