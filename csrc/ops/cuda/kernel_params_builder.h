// Kernel parameters from tensors, shared by the CUDA ops and the host emulation tests of the kernel bodies.
#pragma once

#include <ATen/ATen.h>

#include <climits>
#include <cmath>
#include <initializer_list>

#include "ops/broadcast_mask.h"
#include "ops/cuda/flash/kernel_params.h"

namespace fastmha::cuda_kernels {

// The kernels read rows with a unit stride in the last dim; any other strides are followed as they are.
inline at::Tensor unit_stride_rows(const at::Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); }

inline RowStrides row_strides(const at::Tensor& x) { return {x.stride(0), x.stride(1), x.stride(2)}; }

template <typename Params>
inline void set_common(Params& p, int64_t heads, int64_t len_q, int64_t len_k, int64_t d_k, const at::Tensor& mask_view,
                       double dropout_p, bool is_causal, const at::Tensor& rng_state) {
  TORCH_CHECK(len_q <= INT_MAX && len_k <= INT_MAX, "fastmha: sequence lengths above ", INT_MAX,
              " are not supported by the CUDA kernels, got Lq ", len_q, " and Lk ", len_k);
  p.heads = static_cast<int>(heads);
  p.len_q = static_cast<int>(len_q);
  p.len_k = static_cast<int>(len_k);
  set_mask_view(p, mask_view);
  p.scale = 1.0 / std::sqrt(static_cast<double>(d_k));
  p.is_causal = is_causal;
  p.dropout_p = static_cast<float>(dropout_p);
  p.dropout_scale = dropout_p > 0 ? 1.0 / (1.0 - dropout_p) : 1.0;
  p.rng_state = rng_state.const_data_ptr<int64_t>();
}

// Per head, (B * H) bool: whether every element of `tensors` (each (B, H, rows, features)) is finite there, for
// the flash kernels' tile skipping (AttentionParams::finite_heads). A sum in fp32 is non-finite where an
// element is; one that overflows on finite values only turns skipping off, which changes no result.
inline at::Tensor finite_heads(std::initializer_list<at::Tensor> tensors) {
  at::Tensor total;
  for (const auto& t : tensors) {
    const auto sums = t.sum({2, 3}, /*keepdim=*/false, at::kFloat);
    total = total.defined() ? total + sums : sums;
  }
  return at::isfinite(total).contiguous();
}

template <typename T, typename Acc>
AttentionParams<T, Acc> flash_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& mask_view, double dropout_p, bool is_causal,
                                     const at::Tensor& rng_state) {
  AttentionParams<T, Acc> p{};
  p.q = q.const_data_ptr<T>();
  p.k = k.const_data_ptr<T>();
  p.v = v.const_data_ptr<T>();
  p.q_stride = row_strides(q);
  p.k_stride = row_strides(k);
  p.v_stride = row_strides(v);
  p.batch_heads = q.size(0) * q.size(1);
  p.d_k = static_cast<int>(q.size(3));
  p.d_v = static_cast<int>(v.size(3));
  set_common(p, q.size(1), q.size(2), k.size(2), q.size(3), mask_view, dropout_p, is_causal, rng_state);
  return p;
}

template <typename T, typename Acc>
SoftmaxRowsParams<T, Acc> rows_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& scores,
                                      const at::Tensor& mask_view, double dropout_p, bool is_causal,
                                      const at::Tensor& rng_state) {
  SoftmaxRowsParams<T, Acc> p{};
  p.scores = scores.const_data_ptr<Acc>();
  p.rows = q.size(0) * q.size(1) * q.size(2);
  set_common(p, q.size(1), q.size(2), k.size(2), q.size(3), mask_view, dropout_p, is_causal, rng_state);
  return p;
}

}  // namespace fastmha::cuda_kernels
