// The whole block (projections, head split, attention core, head merge, output projection): schemas, typed
// dispatcher calls, and its kernels. The block is GEMMs around the attention core, so one device-generic
// implementation serves every backend: the projections go to the backend's BLAS, the core to its own kernel.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <mutex>
#include <vector>

#include <fastmha/ops.h>

#include "ops/attention_ops.h"
#include "ops/broadcast_mask.h"
#include "ops/checks.h"
#include "ops/heads.h"
#include "ops/projection_backward.h"
#include "ops/unseen_keys.h"
#include "ops/widened_products.h"

namespace fastmha {

std::tuple<at::Tensor, at::Tensor> multi_head_attention(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& value, const at::Tensor& w_q,
                                                        const at::Tensor& w_k, const at::Tensor& w_v,
                                                        const at::Tensor& w_o, int64_t num_heads,
                                                        const std::optional<at::Tensor>& mask, double dropout_p,
                                                        bool need_weights, bool is_causal) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastmha::multi_head_attention", "")
                       .typed<decltype(multi_head_attention)>();
  return op.call(query, key, value, w_q, w_k, w_v, w_o, num_heads, mask, dropout_p, need_weights, is_causal);
}

namespace detail {

MultiHeadAttentionForwardResult multi_head_attention_forward(const at::Tensor& query, const at::Tensor& key,
                                                             const at::Tensor& value, const at::Tensor& w_q,
                                                             const at::Tensor& w_k, const at::Tensor& w_v,
                                                             const at::Tensor& w_o, int64_t num_heads,
                                                             const std::optional<at::Tensor>& mask, double dropout_p,
                                                             bool need_weights, bool is_causal) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastmha::_multi_head_attention_forward", "")
                       .typed<decltype(multi_head_attention_forward)>();
  return op.call(query, key, value, w_q, w_k, w_v, w_o, num_heads, mask, dropout_p, need_weights, is_causal);
}

MultiHeadAttentionBackwardResult multi_head_attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v,
    const at::Tensor& w_o, const at::Tensor& query_proj, const at::Tensor& key_proj, const at::Tensor& value_proj,
    const at::Tensor& context, const at::Tensor& logsumexp, const at::Tensor& rng_state, int64_t num_heads,
    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal, const std::optional<at::Tensor>& weights,
    const std::optional<at::Tensor>& grad_query_proj, const std::optional<at::Tensor>& grad_key_proj,
    const std::optional<at::Tensor>& grad_value_proj, int64_t shared_inputs) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastmha::_multi_head_attention_backward", "")
                       .typed<decltype(multi_head_attention_backward)>();
  return op.call(grad_output, grad_weights, query, key, value, w_q, w_k, w_v, w_o, query_proj, key_proj, value_proj,
                 context, logsumexp, rng_state, num_heads, mask, dropout_p, is_causal, weights, grad_query_proj,
                 grad_key_proj, grad_value_proj, shared_inputs);
}

}  // namespace detail

namespace {

detail::MultiHeadAttentionForwardResult multi_head_attention_forward_kernel(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& w_q,
    const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o, int64_t num_heads,
    const std::optional<at::Tensor>& user_mask, double dropout_p, bool need_weights, bool is_causal) {
  check_block_inputs(query, key, value, w_q, w_k, w_v, w_o, num_heads, user_mask, dropout_p);
  // Read by split_key_rows and by one or two attention calls: converted to bool once.
  const std::optional<at::Tensor> mask = as_bool_mask(user_mask, query);
  at::Tensor query_proj, key_proj, value_proj;
  auto attend = [&] {
    return detail::attention_forward(split_heads(query_proj, num_heads), split_heads(key_proj, num_heads),
                                     split_heads(value_proj, num_heads), mask, dropout_p, need_weights, is_causal);
  };
  // Keys that no query sees are projected only when the attention turns out to give them some weight.
  std::optional<detail::AttentionForwardResult> core;
  if (const auto rows = split_key_rows(mask, key, value, is_causal);
      rows.has_value() && projections_surely_finite(key, w_k, value, w_v, rows->unseen)) {
    query_proj = widened_linear(query, w_q);
    // A second run draws the same dropout as the first: the CPU generator is put back as it was.
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    at::Tensor generator_state;
    if (dropout_p > 0) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator_state = generator.get_state();
    }
    key_proj = project_rows(key, w_k, rows->seen);
    value_proj = project_rows(value, w_v, rows->seen);
    core = attend();
    if (!unseen_keys_weigh_zero(std::get<2>(*core), key.size(1))) {
      // The seen rows keep their bits: every call with this mask projects them alike.
      project_rows_into(key_proj, key, w_k, rows->unseen);
      project_rows_into(value_proj, value, w_v, rows->unseen);
      if (dropout_p > 0) {
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(generator_state);
      }
      core = attend();
    }
  } else {
    {
      WidenedInputs inputs({query, key, value});  // gone before the attention
      query_proj = widened_linear(query, w_q, inputs);
      key_proj = widened_linear(key, w_k, inputs);
      value_proj = widened_linear(value, w_v, inputs);
    }
    core = attend();
  }
  auto [heads_out, weights, logsumexp, rng_state] = *core;
  auto context = merge_heads(heads_out);
  auto output = widened_linear(context, w_o);
  return {output, weights, query_proj, key_proj, value_proj, context, logsumexp, rng_state};
}

// The backward's tensors from its forward, before any product reads them: the forward's own checks, then each
// gradient and saved projection in the query's dtype and on its device, of the shape the forward gave it (the
// attention core's backward checks the weights, their gradient, logsumexp and rng_state).
void check_block_backward_inputs(const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, const at::Tensor& w_q, const at::Tensor& w_k,
                                 const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& query_proj,
                                 const at::Tensor& key_proj, const at::Tensor& value_proj, const at::Tensor& context,
                                 int64_t num_heads, const std::optional<at::Tensor>& mask, double dropout_p,
                                 const std::optional<at::Tensor>& grad_query_proj,
                                 const std::optional<at::Tensor>& grad_key_proj,
                                 const std::optional<at::Tensor>& grad_value_proj) {
  check_block_inputs(query, key, value, w_q, w_k, w_v, w_o, num_heads, mask, dropout_p);
  const std::vector<c10::SymInt> query_rows = {query.sym_size(0), query.sym_size(1), w_q.sym_size(0)};
  const std::vector<c10::SymInt> key_rows = {query.sym_size(0), key.sym_size(1), w_q.sym_size(0)};
  const auto check = [&](const at::Tensor& t, const char* name, bool on_query) {
    check_shaped_like_query(t, name, query, on_query ? query_rows : key_rows,
                            on_query ? "shape (batch, Lq, d_model)" : "shape (batch, Lk, d_model)");
  };
  check(grad_output, "grad_output", true);
  check(query_proj, "query_proj", true);
  check(key_proj, "key_proj", false);
  check(value_proj, "value_proj", false);
  check(context, "context", true);
  if (grad_query_proj.has_value()) check(*grad_query_proj, "grad_query_proj", true);
  if (grad_key_proj.has_value()) check(*grad_key_proj, "grad_key_proj", false);
  if (grad_value_proj.has_value()) check(*grad_value_proj, "grad_value_proj", false);
}

detail::MultiHeadAttentionBackwardResult multi_head_attention_backward_kernel(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v,
    const at::Tensor& w_o, const at::Tensor& query_proj, const at::Tensor& key_proj, const at::Tensor& value_proj,
    const at::Tensor& context, const at::Tensor& logsumexp, const at::Tensor& rng_state, int64_t num_heads,
    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal, const std::optional<at::Tensor>& weights,
    const std::optional<at::Tensor>& grad_query_proj, const std::optional<at::Tensor>& grad_key_proj,
    const std::optional<at::Tensor>& grad_value_proj, int64_t shared_inputs) {
  check_block_backward_inputs(grad_output, query, key, value, w_q, w_k, w_v, w_o, query_proj, key_proj, value_proj,
                              context, num_heads, mask, dropout_p, grad_query_proj, grad_key_proj, grad_value_proj);
  TORCH_CHECK(shared_inputs >= 0 && shared_inputs <= 7,
              "fastmha: shared_inputs must be a sum of the bits 1, 2 and 4 (0 to 7), got ", shared_inputs);
  const std::array<at::Tensor, 3> xs = {query, key, value};
  const auto first = detail::first_of_shared(shared_inputs);
  for (size_t i = 1; i < xs.size(); ++i) {
    const auto& x = xs[i];
    const auto& shared = xs[first[i]];
    TORCH_CHECK(first[i] == i || (x.sym_sizes() == shared.sym_sizes() && x.dtype() == shared.dtype() &&
                                  x.device() == shared.device()),
                "fastmha: shared_inputs names ", i == 1 ? "key" : "value", " (", x.sym_sizes(), ", ", x.dtype(), ", ",
                x.device(), ") as one tensor with ", first[i] == 0 ? "query" : "key", " (", shared.sym_sizes(), ", ",
                shared.dtype(), ", ", shared.device(), ")");
  }
  // output = context @ w_o^T
  auto [grad_context, grad_w_o] = projection_backward(grad_output, context, w_o);
  auto [grad_q_heads, grad_k_heads, grad_v_heads] =
      detail::attention_backward(split_heads(grad_context, num_heads), grad_weights, split_heads(query_proj, num_heads),
                                 split_heads(key_proj, num_heads), split_heads(value_proj, num_heads), mask,
                                 split_heads(context, num_heads), logsumexp, rng_state, dropout_p, is_causal, weights);
  // x_proj = x @ w_x^T for x in (query, key, value); a gradient that reached x_proj by another path joins the
  // attention's before the products, which then run once for both.
  const auto grad_proj = [&](const at::Tensor& heads, const std::optional<at::Tensor>& other) {
    return other.has_value() ? merge_heads(heads) + *other : merge_heads(heads);
  };
  const std::array<at::Tensor, 3> w = {w_q, w_k, w_v};
  const std::array<at::Tensor, 3> grad_y = {grad_proj(grad_q_heads, grad_query_proj),
                                            grad_proj(grad_k_heads, grad_key_proj),
                                            grad_proj(grad_v_heads, grad_value_proj)};
  std::array<at::Tensor, 3> grad_x, grad_w;
  WidenedInputs inputs({query, key, value});
  for (size_t i = 0; i < xs.size(); ++i) {
    if (first[i] != i) {
      grad_x[i] = at::empty({0}, xs[i].options());  // summed into its first input's
      continue;
    }
    std::vector<at::Tensor> grads, projection_weights;
    for (size_t j = i; j < xs.size(); ++j) {
      if (first[j] == i) {
        grads.push_back(grad_y[j]);
        projection_weights.push_back(w[j]);
      }
    }
    auto [grad, grad_ws] = projections_backward(grads, xs[i], projection_weights, inputs);
    grad_x[i] = grad;
    for (size_t j = i, k = 0; j < xs.size(); ++j) {
      if (first[j] == i) grad_w[j] = grad_ws[k++];
    }
  }
  return {grad_x[0], grad_x[1], grad_x[2], grad_w[0], grad_w[1], grad_w[2], grad_w_o};
}

std::tuple<at::Tensor, at::Tensor> multi_head_attention_composite(const at::Tensor& query, const at::Tensor& key,
                                                                  const at::Tensor& value, const at::Tensor& w_q,
                                                                  const at::Tensor& w_k, const at::Tensor& w_v,
                                                                  const at::Tensor& w_o, int64_t num_heads,
                                                                  const std::optional<at::Tensor>& mask,
                                                                  double dropout_p, bool need_weights, bool is_causal) {
  check_dense_block_args(query, key, value, w_q, w_k, w_v, w_o, mask);
  auto result = detail::multi_head_attention_forward(query, key, value, w_q, w_k, w_v, w_o, num_heads, mask, dropout_p,
                                                     need_weights, is_causal);
  return {std::get<0>(result), std::get<1>(result)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastmha, m) {
  const std::vector<at::Tag> random = {at::Tag::nondeterministic_seeded};
  m.def(
      "multi_head_attention(Tensor query, Tensor key, Tensor value, Tensor w_q, Tensor w_k, Tensor w_v, "
      "Tensor w_o, int num_heads, Tensor? mask=None, float dropout_p=0.0, bool need_weights=True, "
      "bool is_causal=False) "
      "-> (Tensor output, Tensor weights)",
      random);
  m.def(
      "_multi_head_attention_forward(Tensor query, Tensor key, Tensor value, Tensor w_q, Tensor w_k, "
      "Tensor w_v, Tensor w_o, int num_heads, Tensor? mask, float dropout_p, bool need_weights, bool is_causal) "
      "-> (Tensor output, Tensor weights, Tensor query_proj, Tensor key_proj, Tensor value_proj, "
      "Tensor context, Tensor logsumexp, Tensor rng_state)",
      random);
  m.def(
      "_multi_head_attention_backward(Tensor grad_output, Tensor? grad_weights, Tensor query, Tensor key, "
      "Tensor value, Tensor w_q, Tensor w_k, Tensor w_v, Tensor w_o, Tensor query_proj, Tensor key_proj, "
      "Tensor value_proj, Tensor context, Tensor logsumexp, Tensor rng_state, int num_heads, Tensor? mask, "
      "float dropout_p, bool is_causal, Tensor? weights=None, Tensor? grad_query_proj=None, "
      "Tensor? grad_key_proj=None, Tensor? grad_value_proj=None, int shared_inputs=0) -> "
      "(Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_w_q, Tensor grad_w_k, Tensor grad_w_v, "
      "Tensor grad_w_o)");
  // For the block's reuse of key and value projections kept from an earlier call (python/fastmha/modules.py),
  // which computes the query and output projections as the block's op does, to the bit.
  m.def("_unseen_keys_weigh_zero(Tensor logsumexp, int len_k) -> bool");
  m.def("_projection(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastmha, CompositeExplicitAutograd, m) {
  m.impl("multi_head_attention", &multi_head_attention_composite);
  m.impl("_unseen_keys_weigh_zero", &unseen_keys_weigh_zero);
  m.impl("_projection", [](const at::Tensor& x, const at::Tensor& weight) { return widened_linear(x, weight); });
  m.impl("_multi_head_attention_forward", &multi_head_attention_forward_kernel);
  m.impl("_multi_head_attention_backward", &multi_head_attention_backward_kernel);
}

// Nested tensors (strided layout) have no kernel of their own: in inference mode they reach the composite one,
// which names them. Jagged ones go to their own Python handler first.
TORCH_LIBRARY_IMPL(fastmha, NestedTensorCPU, m) { m.impl("multi_head_attention", &multi_head_attention_composite); }
TORCH_LIBRARY_IMPL(fastmha, NestedTensorCUDA, m) { m.impl("multi_head_attention", &multi_head_attention_composite); }

}  // namespace fastmha
