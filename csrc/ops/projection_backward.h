// The gradients of the block's bias-free projections y = x W^T, skipping rows whose gradient is zero.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "ops/widened_products.h"

namespace fastmha {

// (d(x), dW) for y = x W^T: d(x) = dy W and dW = dy^T x, with x and dy of shape (batch, L, features) and W
// (out_features, in_features).
//
// Training on padded batches gives many rows of dy that are exactly zero: a loss that ignores padded targets
// sends no gradient to their positions, nor (through the attention) to keys that no query sees. Such a row adds
// nothing to dW and has a zero row of d(x), so on CPU the products run over the other rows only, when they are at
// most 3/4 of all. A zero row of dy still counts where the math gives NaN: when x's row or W holds an infinity or
// a NaN (0 * inf).
//
// Where the products are widened (ops/widened_products.h), dy (or its gathered rows) is widened once for both, and
// the whole products take x's copy from `inputs`.
std::pair<at::Tensor, at::Tensor> projection_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                      const at::Tensor& weight, WidenedInputs& inputs);
// The same for an x that no other product of the call takes.
std::pair<at::Tensor, at::Tensor> projection_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                      const at::Tensor& weight);
// The gradients of projections y_i = x W_i^T of one x (self-attention's query, key and value): the sum of their
// d(x)s, added up by the products themselves as they run (no pass of its own, in fp32 where they are widened), and
// each dW_i. Rows are skipped as above where every dy_i's row is zero.
std::pair<at::Tensor, std::vector<at::Tensor>> projections_backward(const std::vector<at::Tensor>& grad_ys,
                                                                    const at::Tensor& x,
                                                                    const std::vector<at::Tensor>& weights,
                                                                    WidenedInputs& inputs);

}  // namespace fastmha
