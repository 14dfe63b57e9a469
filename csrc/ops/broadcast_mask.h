// The user's mask as the fused kernels read it: bool (true = attend), broadcast to the scores (batch, h, Lq,
// Lk) through zero strides, so only the user's (often small) mask is converted, never the full score shape.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fastmha {

// `t` with the dimensions an expand() gave zero strides narrowed to size 1: its distinct elements, which broadcast
// back to it. `t` itself under symbolic sizes (a graph being traced).
inline at::Tensor distinct_elements(const at::Tensor& t) {
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return t;
  }
  at::Tensor distinct = t;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) {
      distinct = distinct.narrow(d, 0, 1);
    }
  }
  return distinct;
}

// `mask` as bool (nonzero, NaN too, attends), converting only its distinct elements: an expanded mask stays a
// view, not a copy at the expanded size.
inline at::Tensor to_bool_view(const at::Tensor& mask) {
  return distinct_elements(mask).to(at::kBool).expand_symint(mask.sym_sizes());
}

// The mask as bool (nonzero, NaN too, attends), converted once where several ops read it (the block's forward
// reads it for its unseen keys and in one or two attention calls): each would otherwise convert it again. Left as
// it is where it is no valid mask (a complex dtype, another device), for the checks to name.
inline std::optional<at::Tensor> as_bool_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query) {
  if (!mask.has_value() || !mask->defined() || mask->scalar_type() == at::kBool ||
      at::isComplexType(mask->scalar_type()) || mask->device() != query.device()) {
    return mask;
  }
  return to_bool_view(*mask);
}

// What an autograd function passes to its forward and saves for its backward: the mask as bool when that copy is
// small (1 MiB at most; the backward then reads it without converting it again), otherwise the user's mask itself,
// so that a large mask that many layers share is not copied once per layer.
inline std::optional<at::Tensor> mask_to_save(const std::optional<at::Tensor>& mask, const at::Tensor& query) {
  constexpr int64_t kMaxBoolElements = int64_t{1} << 20;
  if (!mask.has_value() || !mask->defined() || !TORCH_GUARD_OR_FALSE(mask->sym_numel().sym_le(kMaxBoolElements))) {
    return mask;
  }
  return as_bool_mask(mask, query);
}

inline at::Tensor broadcast_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query,
                                 const at::Tensor& key) {
  if (!mask.has_value()) {
    return {};
  }
  return to_bool_view(*mask).expand({query.size(0), query.size(1), query.size(2), key.size(2)});
}

// Points a kernel's parameters (fields `mask` and `mask_stride[4]`) at a view from broadcast_mask; an
// undefined view means no mask.
template <typename Params>
void set_mask_view(Params& p, const at::Tensor& mask_view) {
  p.mask = mask_view.defined() ? mask_view.const_data_ptr<bool>() : nullptr;
  for (int i = 0; i < 4; ++i) {
    p.mask_stride[i] = mask_view.defined() ? mask_view.stride(i) : 0;
  }
}

}  // namespace fastmha
