// Moving between the block's (batch, L, d_model) layout and the attention core's (batch, h, L, d_k) heads.
// Symbolic sizes keep torch.compile's dynamic shapes.
#pragma once

#include <ATen/ATen.h>

namespace fastmha {

// (batch, L, d_model) -> (batch, h, L, d_k), a view.
inline at::Tensor split_heads(const at::Tensor& x, int64_t num_heads) {
  return x.view_symint({x.sym_size(0), x.sym_size(1), num_heads, x.sym_size(2) / num_heads}).transpose(1, 2);
}

// (batch, h, L, d_k) -> (batch, L, h * d_k), a new contiguous tensor.
inline at::Tensor merge_heads(const at::Tensor& x) {
  return x.transpose(1, 2).reshape_symint({x.sym_size(0), x.sym_size(2), x.sym_size(1) * x.sym_size(3)}).contiguous();
}

// (batch, L, d) -> (batch * L, d): one row per token, a view where the strides allow.
inline at::Tensor flatten_rows(const at::Tensor& x) {
  return x.reshape_symint({x.sym_size(0) * x.sym_size(1), x.sym_size(2)});
}

}  // namespace fastmha
