// Gradients that can be differentiated again, for a backward run with create_graph=True (gradient penalties,
// Hessian-vector products, meta-learning). The fused backward kernels build no graph, so there the forward is
// recomputed with differentiable ATen ops, from the saved inputs and the forward's dropout stream, and autograd
// differentiates it: the same gradients, at the cost of the composite's time and memory (Lq x Lk per head).
#pragma once

#include <torch/autograd.h>

#include <optional>

namespace fastmha::detail {

// The attention core's (query, key, value) gradients for output and weights gradients (either undefined).
torch::autograd::variable_list attention_grads_with_graph(const torch::autograd::variable_list& inputs,
                                                          const std::optional<at::Tensor>& mask,
                                                          const at::Tensor& rng_state, double dropout_p, bool is_causal,
                                                          const at::Tensor& grad_output,
                                                          const at::Tensor& grad_weights);

// The block's (query, key, value, w_q, w_k, w_v, w_o) gradients, likewise.
torch::autograd::variable_list block_grads_with_graph(const torch::autograd::variable_list& inputs, int64_t num_heads,
                                                      const std::optional<at::Tensor>& mask,
                                                      const at::Tensor& rng_state, double dropout_p, bool is_causal,
                                                      const at::Tensor& grad_output, const at::Tensor& grad_weights);

}  // namespace fastmha::detail
