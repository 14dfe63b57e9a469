#include "ops/autograd/graph_backward.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <functional>
#include <utility>

#include "ops/aten/attention_aten.h"
#include "ops/dropout.h"
#include "ops/heads.h"

namespace fastmha::detail {
namespace {

using torch::autograd::variable_list;
using Outputs = std::pair<at::Tensor, at::Tensor>;  // (output, weights)

// The attention core (output, weights) in differentiable ATen ops, with the ops' numbers: scores in the
// accumulation dtype, -1e9 where masked, softmax, the forward's dropout multipliers.
Outputs attention_core(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& mask, const at::Tensor& rng_state, double dropout_p,
                       bool is_causal) {
  const auto acc = at::toOpMathType(query.scalar_type());
  auto weights = at::softmax(
      aten_impl::masked_scores(query.to(acc), key.to(acc), aten_impl::masked_positions(mask, is_causal, query, key)),
      -1);
  if (dropout_p > 0.0) {
    weights = weights * dropout_multipliers(weights.sizes(), dropout_p, weights.options(), rng_state);
  }
  return {at::matmul(weights, value.to(acc)).to(query.scalar_type()), weights.to(query.scalar_type())};
}

// The gradients of `forward`'s outputs at `inputs` against (grad_output, grad_weights), as a graph. Each input that
// asks a gradient enters through a view of its own, so a tensor passed as several arguments (self-attention's
// query, key and value) gets each argument's part, as the engine expects; the others get none (undefined).
variable_list grads_with_graph(const variable_list& inputs, const std::function<Outputs(const variable_list&)>& forward,
                               const at::Tensor& grad_output, const at::Tensor& grad_weights) {
  variable_list entries, asked;
  std::vector<size_t> asked_at;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].requires_grad()) {
      entries.push_back(inputs[i].view_as(inputs[i]));
      asked.push_back(entries.back());
      asked_at.push_back(i);
    } else {
      entries.push_back(inputs[i]);
    }
  }
  const auto [output, weights] = forward(entries);
  variable_list outputs, grads;
  if (grad_output.defined()) {
    outputs.push_back(output);
    grads.push_back(grad_output);
  }
  if (grad_weights.defined()) {
    outputs.push_back(weights);
    grads.push_back(grad_weights);
  }
  variable_list result(inputs.size());
  if (asked.empty() || outputs.empty()) {
    return result;
  }
  const auto found = torch::autograd::grad(outputs, asked, grads, /*retain_graph=*/true, /*create_graph=*/true,
                                           /*allow_unused=*/true);
  for (size_t j = 0; j < asked.size(); ++j) {
    result[asked_at[j]] = found[j];
  }
  return result;
}

}  // namespace

variable_list attention_grads_with_graph(const variable_list& inputs, const std::optional<at::Tensor>& mask,
                                         const at::Tensor& rng_state, double dropout_p, bool is_causal,
                                         const at::Tensor& grad_output, const at::Tensor& grad_weights) {
  return grads_with_graph(
      inputs,
      [&](const variable_list& x) { return attention_core(x[0], x[1], x[2], mask, rng_state, dropout_p, is_causal); },
      grad_output, grad_weights);
}

variable_list block_grads_with_graph(const variable_list& inputs, int64_t num_heads,
                                     const std::optional<at::Tensor>& mask, const at::Tensor& rng_state,
                                     double dropout_p, bool is_causal, const at::Tensor& grad_output,
                                     const at::Tensor& grad_weights) {
  const auto block = [&](const variable_list& x) -> Outputs {
    // x W^T of each input, as h heads of d_k.
    const auto heads = [&](const at::Tensor& input, const at::Tensor& w) {
      return split_heads(at::matmul(input, w.t()), num_heads);
    };
    const auto [context, weights] =
        attention_core(heads(x[0], x[3]), heads(x[1], x[4]), heads(x[2], x[5]), mask, rng_state, dropout_p, is_causal);
    return {at::matmul(merge_heads(context), x[6].t()), weights};
  };
  return grads_with_graph(inputs, block, grad_output, grad_weights);
}

}  // namespace fastmha::detail
