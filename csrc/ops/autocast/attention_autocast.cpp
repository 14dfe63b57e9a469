// Autocast: under torch.autocast the public ops run in the autocast dtype (float16/bfloat16), like the
// matmuls around them; the kernels still accumulate scores, softmax and gradients in fp32. The mask keeps
// its dtype (only its zeros matter).
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <fastmha/ops.h>

#include <array>

#include "ops/attention_ops.h"

namespace fastmha {
namespace {

// query, key and value in `dtype`, one copy of a tensor passed as several of them: self-attention's x stays one
// tensor (one cast, and one autograd input of the block, whose backward sums its gradients).
template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_inputs(at::ScalarType dtype, const at::Tensor& query,
                                                           const at::Tensor& key, const at::Tensor& value) {
  const std::array<const at::Tensor*, 3> inputs{&query, &key, &value};
  const auto first = detail::first_of_shared(detail::shared_inputs_of(query, key, value));
  std::array<at::Tensor, 3> cast;
  for (size_t i = 0; i < 3; ++i) {
    cast[i] = first[i] == i ? at::autocast::cached_cast(dtype, *inputs[i], device) : cast[first[i]];
  }
  return {cast[0], cast[1], cast[2]};
}

template <c10::DeviceType device, c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor> attention_autocast(const at::Tensor& query, const at::Tensor& key_,
                                                      const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                      double dropout_p, bool need_weights, bool is_causal) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  const auto dtype = at::autocast::get_autocast_dtype(device);
  const auto [q, k, v] = cast_inputs<device>(dtype, query, key_, value);
  return attention(q, k, v, mask, dropout_p, need_weights, is_causal);
}

template <c10::DeviceType device, c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor> multi_head_attention_autocast(const at::Tensor& query, const at::Tensor& key_,
                                                                 const at::Tensor& value, const at::Tensor& w_q,
                                                                 const at::Tensor& w_k, const at::Tensor& w_v,
                                                                 const at::Tensor& w_o, int64_t num_heads,
                                                                 const std::optional<at::Tensor>& mask,
                                                                 double dropout_p, bool need_weights, bool is_causal) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  const auto dtype = at::autocast::get_autocast_dtype(device);
  auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(dtype, t, device); };
  const auto [q, k, v] = cast_inputs<device>(dtype, query, key_, value);
  return multi_head_attention(q, k, v, cast(w_q), cast(w_k), cast(w_v), cast(w_o), num_heads, mask, dropout_p,
                              need_weights, is_causal);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastmha, AutocastCPU, m) {
  m.impl("attention", &attention_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
  m.impl("multi_head_attention", &multi_head_attention_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

TORCH_LIBRARY_IMPL(fastmha, AutocastCUDA, m) {
  m.impl("attention", &attention_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
  m.impl("multi_head_attention", &multi_head_attention_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

}  // namespace fastmha
