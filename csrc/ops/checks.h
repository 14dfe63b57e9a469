// Input checks shared by every backend's kernels (CPU, CUDA and Meta), so a bad call fails the same way
// eagerly, in TorchScript and while torch.compile traces. Each error names the argument and what it got.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastmha {

// query (batch, h, Lq, d_k), key (batch, h, Lk, d_k), value (batch, h, Lk, d_v).
void check_attention_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double dropout_p);

// The backward's kept weights: nullopt, or (batch, h, Lq, Lk) in the query's dtype, on its device.
void check_kept_weights(const std::optional<at::Tensor>& weights, const at::Tensor& query, const at::Tensor& key);

// query (batch, Lq, d_model), key and value (batch, Lk, d_model), weights (d_model, d_model).
void check_block_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& w_q,
                        const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o, int64_t num_heads,
                        const std::optional<at::Tensor>& mask, double dropout_p);

}  // namespace fastmha
