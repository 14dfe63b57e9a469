// Moving between the block's (batch, L, d_model) layout and the attention core's (batch, h, L, d_k) heads.
// Symbolic sizes keep torch.compile's dynamic shapes.
#pragma once

#include <ATen/ATen.h>

#include <array>

namespace fastmha {

// (batch, L, d_model) -> (batch, h, L, d_k), a view.
inline at::Tensor split_heads(const at::Tensor& x, int64_t num_heads) {
  return x.view_symint({x.sym_size(0), x.sym_size(1), num_heads, x.sym_size(2) / num_heads}).transpose(1, 2);
}

// The strides of a (batch, h, L, d) tensor in (batch, L, h, d) memory (`interleaved`) or contiguous, as at::empty
// gives them (a dim of size 0 counts as 1).
inline std::array<c10::SymInt, 4> heads_strides(c10::SymIntArrayRef sizes, bool interleaved) {
  const c10::SymInt one(1);
  const auto h = sizes[1].max(one), l = sizes[2].max(one), d = sizes[3].max(one);
  if (interleaved) {
    return {l * h * d, d, h * d, 1};
  }
  return {h * l * d, l * d, d, 1};
}

// Whether x's strides are `strides` wherever they matter (dims of size 1 have no stride that matters). Symbolic
// sizes that cannot be decided count as a mismatch, so no guard on them is needed.
inline bool has_strides(const at::Tensor& x, const std::array<c10::SymInt, 4>& strides) {
  for (int64_t i = 0; i < 4; ++i) {
    if (!TORCH_GUARD_OR_FALSE(x.sym_size(i).sym_eq(1)) && !TORCH_GUARD_OR_FALSE(x.sym_stride(i).sym_eq(strides[i]))) {
      return false;
    }
  }
  return true;
}

// Whether x (batch, h, L, d) lies in memory as (batch, L, h, d), the layout split_heads gives (its batch stride
// aside). The attention ops' outputs (and gradients) take the layout of the input they belong to: this one when
// the input has it, otherwise contiguous, so that merge_heads of a core output costs no copy.
inline bool heads_interleaved(const at::Tensor& x) {
  if (x.dim() != 4) {
    return false;
  }
  auto strides = heads_strides(x.sym_sizes(), true);
  strides[0] = x.sym_stride(0);
  return has_strides(x, strides);
}

// An empty (batch, h, L, d) tensor, in (batch, L, h, d) memory when `interleaved`, otherwise contiguous.
inline at::Tensor empty_heads(c10::SymIntArrayRef sizes, bool interleaved, const at::TensorOptions& options) {
  if (!interleaved) {
    return at::empty_symint(sizes, options);
  }
  return at::empty_symint({sizes[0], sizes[2], sizes[1], sizes[3]}, options).transpose(1, 2);
}

// t (batch, h, L, d) in the layout the ops give it for `input` (batch, h, L', d'), with the exact strides of
// empty_heads: a view of t when its memory has that layout already, otherwise a copy.
inline at::Tensor in_layout_of(const at::Tensor& t, const at::Tensor& input) {
  const bool interleaved = heads_interleaved(input);
  const auto strides = heads_strides(t.sym_sizes(), interleaved);
  if (has_strides(t, strides)) {
    return t.as_strided_symint(t.sym_sizes(), strides, t.sym_storage_offset());
  }
  // empty_heads's strides, by a clone rather than empty + copy_: a vmapped (batched) gradient keeps its batch.
  if (!interleaved) {
    return t.clone(at::MemoryFormat::Contiguous);
  }
  return t.transpose(1, 2).clone(at::MemoryFormat::Contiguous).transpose(1, 2);
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
