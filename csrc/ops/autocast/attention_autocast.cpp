// Autocast: under torch.autocast the public ops run in the autocast dtype (float16/bfloat16), like the
// matmuls around them; the kernels still accumulate scores, softmax and gradients in fp32. The mask keeps
// its dtype (only its zeros matter).
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <fastmha/ops.h>

namespace fastmha {
namespace {

template <c10::DeviceType device, c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor> attention_autocast(const at::Tensor& query, const at::Tensor& key_,
                                                      const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                      double dropout_p, bool need_weights, bool is_causal) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  const auto dtype = at::autocast::get_autocast_dtype(device);
  auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(dtype, t, device); };
  return attention(cast(query), cast(key_), cast(value), mask, dropout_p, need_weights, is_causal);
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
  return multi_head_attention(cast(query), cast(key_), cast(value), cast(w_q), cast(w_k), cast(w_v), cast(w_o),
                              num_heads, mask, dropout_p, need_weights, is_causal);
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
