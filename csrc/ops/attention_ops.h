// Typed dispatcher calls for fastmha's internal ops (the forward/backward pairs that the Autograd kernels
// and the block's composite kernels call). The public ones are declared in <fastmha/ops.h>.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace fastmha::detail {

// A tensor that autograd saved or passed, undefined where there was none, as the ops' optional argument.
inline std::optional<at::Tensor> optional_if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// (output, weights or empty, logsumexp (batch, h, Lq) in the accumulation dtype, rng_state int64[2])
using AttentionForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

AttentionForwardResult attention_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                         const std::optional<at::Tensor>& mask, double dropout_p, bool need_weights,
                                         bool is_causal);

// `weights`: the forward's kept weights, which the CPU backward reads instead of recomputing them when they
// serve it (weights_serve_backward in kernel_choice.h), or nullopt.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
    const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& weights);

// (output, weights or empty, query_proj, key_proj, value_proj, context, logsumexp, rng_state)
using MultiHeadAttentionForwardResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

MultiHeadAttentionForwardResult multi_head_attention_forward(const at::Tensor& query, const at::Tensor& key,
                                                             const at::Tensor& value, const at::Tensor& w_q,
                                                             const at::Tensor& w_k, const at::Tensor& w_v,
                                                             const at::Tensor& w_o, int64_t num_heads,
                                                             const std::optional<at::Tensor>& mask, double dropout_p,
                                                             bool need_weights, bool is_causal);

// Which of the block's inputs are one tensor (self-attention's x, cross-attention's memory), as bits.
constexpr int64_t kKeyIsQuery = 1, kValueIsQuery = 2, kValueIsKey = 4;
inline int64_t shared_inputs_of(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  return (key.is_same(query) ? kKeyIsQuery : 0) | (value.is_same(query) ? kValueIsQuery : 0) |
         (value.is_same(key) ? kValueIsKey : 0);
}
// For each of query, key and value (0, 1, 2): the first input it repeats by `shared` bits, itself where none.
inline std::array<size_t, 3> first_of_shared(int64_t shared) {
  const size_t key = (shared & kKeyIsQuery) != 0 ? 0 : 1;
  const size_t value = (shared & kValueIsQuery) != 0 ? 0 : (shared & kValueIsKey) != 0 ? key : 2;
  return {0, key, value};
}

// (grad_query, grad_key, grad_value, grad_w_q, grad_w_k, grad_w_v, grad_w_o). `grad_*_proj`: gradients that
// reached the saved projections by another path (a second-order graph built on them), added to the attention's.
// `shared_inputs` says which inputs the caller passed as one tensor (shared_inputs_of): each such gradient is
// added into that of the first input it repeats, by the products themselves (projections_backward), and comes
// back empty (size 0).
using MultiHeadAttentionBackwardResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

MultiHeadAttentionBackwardResult multi_head_attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v,
    const at::Tensor& w_o, const at::Tensor& query_proj, const at::Tensor& key_proj, const at::Tensor& value_proj,
    const at::Tensor& context, const at::Tensor& logsumexp, const at::Tensor& rng_state, int64_t num_heads,
    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal, const std::optional<at::Tensor>& weights,
    const std::optional<at::Tensor>& grad_query_proj = std::nullopt,
    const std::optional<at::Tensor>& grad_key_proj = std::nullopt,
    const std::optional<at::Tensor>& grad_value_proj = std::nullopt, int64_t shared_inputs = 0);

}  // namespace fastmha::detail
