// Autograd for the whole block, in C++ so TorchScript and C++ callers can train. The forward saves the
// projections, the merged context, the log-sum-exp and the dropout rng_state; nothing of size Lq x Lk but the
// weights the call kept, where the backward reads them (weights_serve_backward). With create_graph=True the
// gradients are built from ATen ops instead, so that they can be differentiated again (graph_backward.h).
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>

#include "ops/attention_ops.h"
#include "ops/autograd/forward_ad.h"
#include "ops/autograd/graph_backward.h"
#include "ops/broadcast_mask.h"
#include "ops/checks.h"
#include "ops/heads.h"
#include "ops/kernel_choice.h"

namespace fastmha {
namespace {

// Gradients of inputs that were one tensor (`shared`, shared_inputs_of), added into the first one's: the others
// have no edge of their own.
void fold_shared_gradients(torch::autograd::variable_list& grads, int64_t shared) {
  const auto first = detail::first_of_shared(shared);
  for (size_t i = first.size(); i-- > 1;) {
    if (first[i] == i) continue;
    if (grads[i].defined()) {
      grads[first[i]] = grads[first[i]].defined() ? grads[first[i]] + grads[i] : grads[i];
    }
    grads[i] = at::Tensor();
  }
}

class MultiHeadAttentionFunction : public torch::autograd::Function<MultiHeadAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& query,
                                                const std::optional<at::Tensor>& key_input,
                                                const std::optional<at::Tensor>& value_input, const at::Tensor& w_q,
                                                const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
                                                int64_t num_heads, const std::optional<at::Tensor>& user_mask,
                                                double dropout_p, bool need_weights, bool is_causal, int64_t shared) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // A key or value that is an earlier input (`shared`) comes as nullopt: one tensor has one edge, which its summed
    // gradient takes.
    const auto first = detail::first_of_shared(shared);
    const at::Tensor& key = first[1] == 0 ? query : *key_input;
    const at::Tensor& value = first[2] == 0 ? query : first[2] == 1 ? key : *value_input;
    // The forward and the backward read the same mask: a small one is converted to bool once, for both.
    const std::optional<at::Tensor> mask = mask_to_save(user_mask, query);
    auto [output, weights, query_proj, key_proj, value_proj, context, logsumexp, rng_state] =
        detail::multi_head_attention_forward(query, key, value, w_q, w_k, w_v, w_o, num_heads, mask, dropout_p,
                                             need_weights, is_causal);
    // Asked of the attention core's call, on the heads of the projections, when the weights were kept.
    const auto weights_serve = [&] {
      const auto q = split_heads(query_proj, num_heads), k = split_heads(key_proj, num_heads);
      const auto v = split_heads(value_proj, num_heads);
      return weights_serve_backward({q, k, v, mask, dropout_p, need_weights, is_causal});
    };
    const bool save_weights = need_weights && weights.defined() && weights_serve();
    // A tensor passed as several inputs is saved once (saved-tensor hooks pack it once).
    ctx->save_for_backward({query, first[1] == 1 ? key : at::Tensor(), first[2] == 2 ? value : at::Tensor(), w_q, w_k,
                            w_v, w_o, query_proj, key_proj, value_proj, context, logsumexp, rng_state,
                            mask.value_or(at::Tensor()), save_weights ? weights : at::Tensor()});
    ctx->saved_data["num_heads"] = num_heads;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["shared_inputs"] = shared;
    // Kept weights that the loss never reads get no gradient: no (batch, h, Lq, Lk) tensor of zeros is made,
    // filled and read back in the backward.
    ctx->set_materialize_grads(false);
    // The projections are outputs too, which the caller drops: gradients built on them for a second
    // differentiation (create_graph=True) come back to this node, which adds them to the attention's before its
    // projection products, run once for both. Without kept weights the Function has no weights output: its caller
    // makes the empty weights tensor. Marking that tensor non-differentiable instead would leave the node unusable
    // under compiled autograd.
    TORCH_INTERNAL_ASSERT(!query_proj.is_same(key_proj) && !key_proj.is_same(value_proj) &&
                          !query_proj.is_same(value_proj));
    if (!need_weights) {
      return {output, query_proj, key_proj, value_proj};
    }
    return {output, query_proj, key_proj, value_proj, weights};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    grads.resize(5);  // (output, query_proj, key_proj, value_proj, weights); no weights output without kept weights
    const auto &grad_output = grads[0], &grad_weights = grads[4];
    const auto &grad_query_proj = grads[1], &grad_key_proj = grads[2], &grad_value_proj = grads[3];
    auto s = ctx->get_saved_variables();
    const int64_t shared = ctx->saved_data["shared_inputs"].toInt();
    const auto first = detail::first_of_shared(shared);
    s[1] = s[first[1]];  // the inputs saved once
    s[2] = s[first[2]];
    const auto mask = detail::optional_if_defined(s[13]);
    // With create_graph=True: gradients that can be differentiated again. Also where a second-order gradient
    // reaches the projections alone: their products' gradients, no attention backward.
    if (at::GradMode::is_enabled() || (!grad_output.defined() && !grad_weights.defined())) {
      // needs_input_grad counts the tensors the Function took: a key or value that repeats an input is not one.
      std::array<bool, 7> asked{};
      for (size_t i = 0, edge = 0; i < asked.size(); ++i) {
        asked[i] = i < first.size() && first[i] != i ? asked[first[i]] : ctx->needs_input_grad(edge++);
      }
      auto g = detail::block_grads_with_graph(
          {s[0], s[1], s[2], s[3], s[4], s[5], s[6]}, {s[7], s[8], s[9]},
          {grad_query_proj, grad_key_proj, grad_value_proj}, asked, ctx->saved_data["num_heads"].toInt(), mask, s[12],
          ctx->saved_data["dropout_p"].toDouble(), ctx->saved_data["is_causal"].toBool(), grad_output, grad_weights);
      g.resize(13);  // num_heads, mask, dropout_p, need_weights, is_causal, shared: no gradient
      fold_shared_gradients(g, shared);
      return g;
    }
    // The op sums the gradients of inputs that were one tensor in its products; a value whose gradient is dropped
    // below is not added in.
    const bool output_reaches_loss = grad_output.defined();
    const bool value_without_gradient = !output_reaches_loss && !grad_value_proj.defined();
    // When only the kept weights reach the loss, the output takes no part in the gradients, nor does the value
    // projection in the core's: zeros stand for them, the merged context (the core's output) and the output's
    // gradient (the context's shape and dtype: w_o is d_model x d_model), so that a non-finite value makes no
    // 0 * inf = NaN in the core's dO V^T or D = dO . O. (A gradient that reached the value projection by another
    // path is added to its gradient after the core's.)
    const auto zero_context = output_reaches_loss ? at::Tensor() : at::zeros_like(s[10]);
    auto [grad_query, grad_key, grad_value, grad_w_q, grad_w_k, grad_w_v, grad_w_o] =
        detail::multi_head_attention_backward(
            output_reaches_loss ? grad_output : zero_context, detail::optional_if_defined(grad_weights), s[0], s[1],
            s[2], s[3], s[4], s[5], s[6], s[7], s[8], output_reaches_loss ? s[9] : at::zeros_like(s[9]),
            output_reaches_loss ? s[10] : zero_context, s[11], s[12], ctx->saved_data["num_heads"].toInt(), mask,
            ctx->saved_data["dropout_p"].toDouble(), ctx->saved_data["is_causal"].toBool(),
            detail::optional_if_defined(s[14]), detail::optional_if_defined(grad_query_proj),
            detail::optional_if_defined(grad_key_proj), detail::optional_if_defined(grad_value_proj),
            value_without_gradient ? shared & detail::kKeyIsQuery : shared);
    if (!output_reaches_loss) {
      // Only the kept weights reach the loss: w_o, and the value and w_v unless their projection has a gradient of
      // its own, get no gradient (None, as in the textbook block), not zeros that an optimizer's decay and
      // momentum would act on.
      grad_w_o = at::Tensor();
    }
    if (value_without_gradient) {
      grad_value = grad_w_v = at::Tensor();
    }
    torch::autograd::variable_list grads_out = {grad_query, grad_key, grad_value, grad_w_q,
                                                grad_w_k,   grad_w_v, grad_w_o};
    for (size_t i = 1; i < 3; ++i) {
      if (first[i] != i) grads_out[i] = at::Tensor();  // summed into its first input's by the op, or dropped above
    }
    grads_out.resize(13);  // num_heads, mask, dropout_p, need_weights, is_causal, shared: no gradient
    return grads_out;
  }
};

std::tuple<at::Tensor, at::Tensor> multi_head_attention_autograd(const at::Tensor& query, const at::Tensor& key,
                                                                 const at::Tensor& value, const at::Tensor& w_q,
                                                                 const at::Tensor& w_k, const at::Tensor& w_v,
                                                                 const at::Tensor& w_o, int64_t num_heads,
                                                                 const std::optional<at::Tensor>& mask,
                                                                 double dropout_p, bool need_weights, bool is_causal) {
  check_dense_block_args(query, key, value, w_q, w_k, w_v, w_o, mask);
  // Dual tensors (forward-mode AD): see forward_ad.h.
  if (detail::takes_forward_ad({query, key, value, w_q, w_k, w_v, w_o, mask.value_or(at::Tensor())})) {
    return detail::block_with_tangents(query, key, value, w_q, w_k, w_v, w_o, num_heads, mask, dropout_p, need_weights,
                                       is_causal);
  }
  // One tensor passed as several inputs (self-attention's x, cross-attention's memory) is one input of the Function:
  // its backward sums the tensor's gradients in its products instead of returning several for autograd to add.
  const int64_t shared = detail::shared_inputs_of(query, key, value);
  const auto first = detail::first_of_shared(shared);
  auto outputs =
      MultiHeadAttentionFunction::apply(query, first[1] == 1 ? std::optional<at::Tensor>(key) : std::nullopt,
                                        first[2] == 2 ? std::optional<at::Tensor>(value) : std::nullopt, w_q, w_k, w_v,
                                        w_o, num_heads, mask, dropout_p, need_weights, is_causal, shared);
  return {outputs[0], need_weights ? outputs[4] : at::empty({0}, query.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastmha, Autograd, m) { m.impl("multi_head_attention", &multi_head_attention_autograd); }

}  // namespace fastmha
