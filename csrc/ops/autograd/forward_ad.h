// Forward-mode AD (dual tensors: torch.autograd.forward_ad, and what builds on it). The ops' C++ autograd
// Functions have no forward derivative, so a call with a tangent on any differentiable input computes with the ATen
// implementation's differentiable ops instead (ops/aten/), which carry the tangents and a graph for reverse mode.
// The numbers are the kernels' (the -1e9 rule, uniform fully masked rows, scores in fp32 for half types), and
// dropout draws the kernels' stream on the same device, at the composite's time and memory (Lq x Lk per head).
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <optional>
#include <tuple>

namespace fastmha::detail {

// Whether a tangent (forward gradient) rides on any of `tensors` (undefined ones skipped: pass every tensor input,
// the mask too, as the Function would refuse a tangent on any), all on devices this build has kernels for: others
// keep the Function's path and its errors.
bool takes_forward_ad(std::initializer_list<at::Tensor> tensors);

// The attention core's (output, weights or empty) from differentiable ATen ops.
std::tuple<at::Tensor, at::Tensor> attention_with_tangents(const at::Tensor& query, const at::Tensor& key,
                                                           const at::Tensor& value,
                                                           const std::optional<at::Tensor>& mask, double dropout_p,
                                                           bool need_weights, bool is_causal);

// The block's (output, weights or empty) likewise: the projections as products, the core as above.
std::tuple<at::Tensor, at::Tensor> block_with_tangents(const at::Tensor& query, const at::Tensor& key,
                                                       const at::Tensor& value, const at::Tensor& w_q,
                                                       const at::Tensor& w_k, const at::Tensor& w_v,
                                                       const at::Tensor& w_o, int64_t num_heads,
                                                       const std::optional<at::Tensor>& mask, double dropout_p,
                                                       bool need_weights, bool is_causal);

}  // namespace fastmha::detail
