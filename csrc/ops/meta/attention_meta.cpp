// Meta kernels: shapes and dtypes only, with the same input checks, so torch.compile, torch.export and
// opcheck can trace the ops (sizes stay symbolic for dynamic shapes).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "ops/attention_ops.h"
#include "ops/checks.h"
#include "ops/heads.h"

namespace fastmha {
namespace {

detail::AttentionForwardResult attention_forward_meta(const at::Tensor& query, const at::Tensor& key,
                                                      const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                      double dropout_p, bool need_weights, bool is_causal) {
  check_attention_inputs(query, key, value, mask, dropout_p);
  const auto batch = query.sym_size(0), heads = query.sym_size(1), len_q = query.sym_size(2);
  const auto len_k = key.sym_size(2), d_v = value.sym_size(3);
  auto output = empty_heads({batch, heads, len_q, d_v}, heads_interleaved(query), query.options());
  auto weights =
      need_weights ? at::empty_symint({batch, heads, len_q, len_k}, query.options()) : at::empty({0}, query.options());
  auto logsumexp =
      at::empty_symint({batch, heads, len_q}, query.options().dtype(at::toOpMathType(query.scalar_type())));
  auto rng_state = at::empty({2}, query.options().dtype(at::kLong));
  return {output, weights, logsumexp, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
    const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& weights) {
  check_backward_inputs(grad_output, query, key, value, mask, output, logsumexp, rng_state, dropout_p);
  check_kept_weights(weights, query, key);
  check_grad_weights(grad_weights, query, key);
  auto like = [](const at::Tensor& t) { return empty_heads(t.sym_sizes(), heads_interleaved(t), t.options()); };
  return {like(query), like(key), like(value)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastmha, Meta, m) {
  m.impl("_attention_forward", &attention_forward_meta);
  m.impl("_attention_backward", &attention_backward_meta);
}

}  // namespace fastmha
