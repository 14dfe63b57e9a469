// The functional C++ API: typed calls through the dispatcher to the ops registered as torch.ops.fastmha.*.
// Gradients flow through them (the Autograd kernels live in the library), so C++ programs can train.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace fastmha {

// The attention core on split heads: query (batch, h, Lq, d_k), key (batch, h, Lk, d_k),
// value (batch, h, Lk, d_v). scores = query @ key^T / sqrt(d_k); positions where mask == 0 get -1e9;
// softmax over keys; dropout with probability dropout_p on the weights; returns (weights @ value, weights).
// mask: any dtype, any shape that broadcasts to (batch, h, Lq, Lk). weights is an empty tensor when
// need_weights is false. is_causal: query i attends only keys j <= i (top-left aligned when Lq != Lk),
// exactly as if mask were also tril(ones(Lq, Lk)), but without materializing it.
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                             const std::optional<at::Tensor>& mask = std::nullopt,
                                             double dropout_p = 0.0, bool need_weights = true, bool is_causal = false);

// The whole multi-head attention block on batch-first inputs: query (batch, Lq, d_model), key and value
// (batch, Lk, d_model); bias-free projection weights of shape (d_model, d_model) as in nn.Linear.
// Returns (output (batch, Lq, d_model), weights (batch, num_heads, Lq, Lk) or an empty tensor).
std::tuple<at::Tensor, at::Tensor> multi_head_attention(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& value, const at::Tensor& w_q,
                                                        const at::Tensor& w_k, const at::Tensor& w_v,
                                                        const at::Tensor& w_o, int64_t num_heads,
                                                        const std::optional<at::Tensor>& mask = std::nullopt,
                                                        double dropout_p = 0.0, bool need_weights = true,
                                                        bool is_causal = false);

// Incremental decoding (a decoder's self-attention): x (batch, T_new, d_model) are new positions; the caches
// (batch, num_heads, T_past, d_k) hold the earlier positions' projected keys and values (none on the first
// step). New position i attends keys up to its own (causal, aligned to the end of the cache) and where mask
// (broadcastable to (batch, num_heads, T_new, T_past + T_new)) is not 0. Returns (output (batch, T_new,
// d_model), key_cache, value_cache) with the new positions appended.
std::tuple<at::Tensor, at::Tensor, at::Tensor> multi_head_attention_step(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
    int64_t num_heads, const std::optional<at::Tensor>& key_cache = std::nullopt,
    const std::optional<at::Tensor>& value_cache = std::nullopt, const std::optional<at::Tensor>& mask = std::nullopt,
    double dropout_p = 0.0);

}  // namespace fastmha
