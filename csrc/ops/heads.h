// Moving between the block's (batch, L, d_model) layout and the attention core's (batch, h, L, d_k) heads.
// Symbolic sizes keep torch.compile's dynamic shapes.
#pragma once

#include <ATen/ATen.h>

namespace fastmha {

// (batch, L, d_model) -> (batch, h, L, d_k), a view.
inline at::Tensor split_heads(const at::Tensor& x, int64_t num_heads) {
  return x.view_symint({x.sym_size(0), x.sym_size(1), num_heads, x.sym_size(2) / num_heads}).transpose(1, 2);
}

// Whether x (batch, h, L, d) lies in memory as (batch, L, h, d), the layout split_heads gives. The attention ops'
// outputs (and gradients) take the layout of the input they belong to: contiguous, or this one when the input has it,
// so that merge_heads of a core output costs no copy.
inline bool heads_interleaved(const at::Tensor& x) {
  return x.dim() == 4 && x.sym_stride(3) == 1 && x.sym_stride(1) == x.sym_size(3) &&
         x.sym_stride(2) == x.sym_size(1) * x.sym_size(3);
}

// An empty (batch, h, L, d) tensor, in (batch, L, h, d) memory when `interleaved`, otherwise contiguous.
inline at::Tensor empty_heads(c10::SymIntArrayRef sizes, bool interleaved, const at::TensorOptions& options) {
  if (!interleaved) {
    return at::empty_symint(sizes, options);
  }
  return at::empty_symint({sizes[0], sizes[2], sizes[1], sizes[3]}, options).transpose(1, 2);
}

// t (batch, h, L, d) in the layout the ops give it for `input` (batch, h, L', d'): (batch, L, h, d) memory when
// heads_interleaved(input), otherwise contiguous. t itself when it has that layout already, otherwise a copy.
inline at::Tensor in_layout_of(const at::Tensor& t, const at::Tensor& input) {
  if (!heads_interleaved(input)) {
    return t.contiguous();
  }
  if (heads_interleaved(t) && t.sym_stride(0) == t.sym_size(1) * t.sym_size(2) * t.sym_size(3)) {
    return t;
  }
  auto out = empty_heads(t.sym_sizes(), true, t.options());
  out.copy_(t);
  return out;
}

// (batch, h, L, d_k) -> (batch, L, h * d_k), contiguous: a view of an interleaved tensor, otherwise a copy.
inline at::Tensor merge_heads(const at::Tensor& x) {
  return x.transpose(1, 2).reshape_symint({x.sym_size(0), x.sym_size(2), x.sym_size(1) * x.sym_size(3)}).contiguous();
}

// (batch, L, d) -> (batch * L, d): one row per token, a view where the strides allow.
inline at::Tensor flatten_rows(const at::Tensor& x) {
  return x.reshape_symint({x.sym_size(0) * x.sym_size(1), x.sym_size(2)});
}

}  // namespace fastmha
