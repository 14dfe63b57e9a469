// The attention core on split heads (the document's static `attention`): schemas and typed dispatcher calls.
// The library namespace is created here; other op files add to it with TORCH_LIBRARY_FRAGMENT.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <fastmha/ops.h>

#include "ops/attention_ops.h"
#include "ops/checks.h"

namespace fastmha {

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                             const std::optional<at::Tensor>& mask, double dropout_p, bool need_weights,
                                             bool is_causal) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastmha::attention", "").typed<decltype(attention)>();
  return op.call(query, key, value, mask, dropout_p, need_weights, is_causal);
}

namespace detail {

AttentionForwardResult attention_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                         const std::optional<at::Tensor>& mask, double dropout_p, bool need_weights,
                                         bool is_causal) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastmha::_attention_forward", "")
                       .typed<decltype(attention_forward)>();
  return op.call(query, key, value, mask, dropout_p, need_weights, is_causal);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
    const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& weights) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastmha::_attention_backward", "")
                       .typed<decltype(attention_backward)>();
  return op.call(grad_output, grad_weights, query, key, value, mask, output, logsumexp, rng_state, dropout_p, is_causal,
                 weights);
}

}  // namespace detail

namespace {

// Without autograd (inference mode, or below the Autograd key) the public op is its forward, trimmed.
std::tuple<at::Tensor, at::Tensor> attention_composite(const at::Tensor& query, const at::Tensor& key,
                                                       const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                       double dropout_p, bool need_weights, bool is_causal) {
  // Sparse or nested inputs reach this kernel in inference mode; the forward has no kernel for them.
  check_dense_attention_args(query, key, value, mask);
  auto result = detail::attention_forward(query, key, value, mask, dropout_p, need_weights, is_causal);
  return {std::get<0>(result), std::get<1>(result)};
}

}  // namespace

TORCH_LIBRARY(fastmha, m) {
  // Random when dropout_p > 0: the tag stops graph compilers from merging or reordering calls.
  const std::vector<at::Tag> random = {at::Tag::nondeterministic_seeded};
  m.def(
      "attention(Tensor query, Tensor key, Tensor value, Tensor? mask=None, float dropout_p=0.0, "
      "bool need_weights=True, bool is_causal=False) -> (Tensor output, Tensor weights)",
      random);
  m.def(
      "_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? mask, float dropout_p, "
      "bool need_weights, bool is_causal) -> (Tensor output, Tensor weights, Tensor logsumexp, Tensor rng_state)",
      random);
  m.def(
      "_attention_backward(Tensor grad_output, Tensor? grad_weights, Tensor query, Tensor key, Tensor value, "
      "Tensor? mask, Tensor output, Tensor logsumexp, Tensor rng_state, float dropout_p, bool is_causal, "
      "Tensor? weights=None) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // The dropout multipliers a forward applied, from its rng_state (on the device they are made on).
  m.def("_dropout_multipliers(SymInt[] sizes, float dropout_p, ScalarType dtype, Tensor rng_state) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastmha, CompositeExplicitAutograd, m) { m.impl("attention", &attention_composite); }
// Nested tensors (strided layout) have no kernel of their own: in inference mode they reach the composite one,
// which names them. Jagged ones go to their own Python handler first.
TORCH_LIBRARY_IMPL(fastmha, NestedTensorCPU, m) { m.impl("attention", &attention_composite); }
TORCH_LIBRARY_IMPL(fastmha, NestedTensorCUDA, m) { m.impl("attention", &attention_composite); }

}  // namespace fastmha
