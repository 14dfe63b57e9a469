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

// The forward's dropout multipliers through the dispatcher (fastmha::_dropout_multipliers), so that a graph tracer
// records them, on the device the weights are on.
at::Tensor replayed_multipliers(at::IntArrayRef sizes, double p, const at::TensorOptions& options,
                                const at::Tensor& rng_state) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastmha::_dropout_multipliers", "")
                             .typed<at::Tensor(c10::SymIntArrayRef, double, at::ScalarType, const at::Tensor&)>();
  return op.call(c10::fromIntArrayRefSlow(sizes), p, options.dtype().toScalarType(), rng_state.to(options.device()));
}

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

// x W^T as a node of the graph, with the value the forward computed (its saved projection) instead of a GEMM: the
// gradients built for a second differentiation need the projections as functions of x and W, not their numbers
// again. The backward is the product's, in differentiable ATen ops as the rest of this graph. Rows of
// unseen keys, which the forward left at zero (ops/unseen_keys.h), weigh exactly 0 there as in the forward.
class SavedProjection : public torch::autograd::Function<SavedProjection> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& projection) {
    ctx->save_for_backward({x, weight});
    return projection;  // an input returned as is: autograd makes it a view with this node's gradient
  }

  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad_x, grad_weight] =
        projection_grads(saved[0], saved[1], grads[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {grad_x, grad_weight, at::Tensor()};
  }
};

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
                                     const std::array<bool, 7>& asked, int64_t num_heads,
                                     const std::optional<at::Tensor>& mask, const at::Tensor& rng_state,
                                     double dropout_p, bool is_causal, const at::Tensor& grad_output,
                                     const at::Tensor& grad_weights) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto &query = inputs[0], &key = inputs[1], &value = inputs[2];
  const auto &w_q = inputs[3], &w_k = inputs[4], &w_v = inputs[5], &w_o = inputs[6];
  const auto heads = [&](const at::Tensor& x, const at::Tensor& w, const at::Tensor& projection) {
    return split_heads(SavedProjection::apply(x, w, projection), num_heads);
  };
  const auto q = heads(query, w_q, projections[0]), k = heads(key, w_k, projections[1]);
  const auto v = heads(value, w_v, projections[2]);
  // Without an output gradient only the weights have one: nothing flows through w_o, the value or w_v.
  const auto grad_context = grad_output.defined() ? split_heads(at::matmul(grad_output, w_o), num_heads) : at::Tensor();
  // The weights after dropout, as the forward applied them: w_o's gradient needs the context they give.
  at::Tensor applied;
  const auto [grad_q, grad_k, grad_v] =
      core_grads(q, k, v, mask, rng_state, dropout_p, is_causal, grad_context, grad_weights, &applied);
  variable_list grads(7);
  if (!grad_q.defined()) {
    return grads;
  }
  std::tie(grads[0], grads[3]) = projection_grads(query, w_q, merge_heads(grad_q), asked[0], asked[3]);
  std::tie(grads[1], grads[4]) = projection_grads(key, w_k, merge_heads(grad_k), asked[1], asked[4]);
  if (grad_output.defined()) {
    std::tie(grads[2], grads[5]) = projection_grads(value, w_v, merge_heads(grad_v), asked[2], asked[5]);
    if (asked[6]) {  // the context w_o multiplied, from the weights the core's gradients recomputed
      const auto context = merge_heads(at::matmul(applied, v.to(applied.scalar_type())).to(v.scalar_type()));
      grads[6] = flatten_rows(grad_output).t().mm(flatten_rows(context));
    }
  }
  return grads;
}

}  // namespace fastmha::detail
