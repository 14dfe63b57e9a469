// The attention core written with ATen ops (GEMMs + softmax), device-generic: the CPU and CUDA kernels
// call it with their device's dropout kernels. Scores, softmax and gradients are computed in fp32 for half
// types (float64 stays float64), so the -1e9 fill stays finite and fully masked rows stay uniform.
#pragma once

#include "ops/attention_ops.h"
#include "ops/dropout.h"

namespace fastmha::aten_impl {

// Where the scores are overwritten with -1e9: mask == 0, and above the diagonal when causal (top-left).
std::optional<at::Tensor> masked_positions(const std::optional<at::Tensor>& mask, bool is_causal,
                                           const at::Tensor& query, const at::Tensor& key);

// scores = query @ key^T / sqrt(d_k), then the masked positions -> -1e9, in the inputs' (accumulation) dtype.
// Differentiable: the in-place steps act on the product, which autograd does not save.
at::Tensor masked_scores(const at::Tensor& query_acc, const at::Tensor& key_acc,
                         const std::optional<at::Tensor>& masked);

// The forward's (output, weights or empty, logsumexp, rng_state). A caller with no backward of its own (forward-mode
// AD differentiates the ops themselves) passes need_logsumexp=false and gets an undefined logsumexp: one pass over
// the scores, and its tangent, fewer.
detail::AttentionForwardResult attention_forward(const at::Tensor& query, const at::Tensor& key,
                                                 const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                 double dropout_p, bool need_weights, bool is_causal,
                                                 const DropoutKernels& dropout, bool need_logsumexp = true);

// The gradients from differentiable ATen ops (a backward with create_graph=True calls it under grad mode).
// grad_output may be undefined where grad_weights is not: the value's gradient is then undefined too. Where
// applied_weights is given and grad_output defined, it receives the recomputed weights after dropout (in the
// accumulation dtype), so that a caller needing the output again does not recompute them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
    const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p, bool is_causal,
    const DropoutKernels& dropout, at::Tensor* applied_weights = nullptr);

}  // namespace fastmha::aten_impl
