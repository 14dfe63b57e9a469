// CUDA kernels of the attention core (for now the ATen implementation with our CUDA dropout kernel; fused
// kernels replace it). Every launch happens on the inputs' device and its current stream.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/aten/attention_aten.h"
#include "ops/checks.h"

namespace fastmha {
namespace {

detail::AttentionForwardResult attention_forward_kernel(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                        double dropout_p, bool need_weights, bool is_causal) {
  check_attention_inputs(query, key, value, mask, dropout_p);
  c10::cuda::CUDAGuard guard(query.device());
  return aten_impl::attention_forward(query, key, value, mask, dropout_p, need_weights, is_causal,
                                      cuda_dropout_kernels());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_kernel(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
    const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p, bool is_causal) {
  c10::cuda::CUDAGuard guard(query.device());
  return aten_impl::attention_backward(grad_output, grad_weights, query, key, value, mask, output, logsumexp, rng_state,
                                       dropout_p, is_causal, cuda_dropout_kernels());
}

}  // namespace

TORCH_LIBRARY_IMPL(fastmha, CUDA, m) {
  m.impl("_attention_forward", &attention_forward_kernel);
  m.impl("_attention_backward", &attention_backward_kernel);
}

}  // namespace fastmha
