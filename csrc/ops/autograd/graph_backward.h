// Gradients that can be differentiated again, for a backward run with create_graph=True (gradient penalties,
// Hessian-vector products, meta-learning). The fused backward kernels build no graph, so there the gradients are
// computed with the ATen implementation's formulas (differentiable ATen ops), from the saved inputs and the
// forward's dropout multipliers: the same gradients, at the cost of the composite's time and memory (Lq x Lk per
// head). No reentrant autograd call, so compiled autograd and graph tracers can run them.
#pragma once

#include <torch/autograd.h>

#include <array>
#include <optional>

namespace fastmha::detail {

// The attention core's (query, key, value) gradients for output and weights gradients (either undefined). Where
// only the weights have a gradient, the value gets none (undefined), as from the fused backward.
torch::autograd::variable_list attention_grads_with_graph(const torch::autograd::variable_list& inputs,
                                                          const std::optional<at::Tensor>& mask,
                                                          const at::Tensor& rng_state, double dropout_p, bool is_causal,
                                                          const at::Tensor& grad_output,
                                                          const at::Tensor& grad_weights);

// The block's (query, key, value, w_q, w_k, w_v, w_o) gradients, likewise, each only where `asked` (the others
// undefined). Where only the weights have a gradient, w_o gets none, and the value and w_v none unless the value's
// projection has one. `projections`: the forward's (query, key, value) projections, outputs of the block's node,
// which stand in for recomputing them; `grad_projections`: their gradients (or undefined), added to the
// attention's.
torch::autograd::variable_list block_grads_with_graph(const torch::autograd::variable_list& inputs,
                                                      const torch::autograd::variable_list& projections,
                                                      const torch::autograd::variable_list& grad_projections,
                                                      const std::array<bool, 7>& asked, int64_t num_heads,
                                                      const std::optional<at::Tensor>& mask,
                                                      const at::Tensor& rng_state, double dropout_p, bool is_causal,
                                                      const at::Tensor& grad_output, const at::Tensor& grad_weights);

}  // namespace fastmha::detail
