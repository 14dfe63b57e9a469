#include "ops/autograd/forward_ad.h"

#include <ATen/ATen.h>

#include "ops/aten/attention_aten.h"
#include "ops/checks.h"
#include "ops/dropout.h"
#include "ops/heads.h"

namespace fastmha::detail {

namespace {

// The devices this build has kernels for: others keep the Function's path, whose dispatch names the device.
bool has_kernels_for(const at::Tensor& t) {
#ifdef FASTMHA_WITH_CUDA
  if (t.is_cuda()) {
    return true;
  }
#endif
  return t.is_cpu();
}

}  // namespace

bool takes_forward_ad(std::initializer_list<at::Tensor> tensors) {
  bool tangent = false, supported = true;
  for (const auto& t : tensors) {
    if (t.defined()) {
      tangent = tangent || t._fw_grad(/*level=*/0).defined();
      supported = supported && has_kernels_for(t);
    }
  }
  return tangent && supported;
}

std::tuple<at::Tensor, at::Tensor> attention_with_tangents(const at::Tensor& query, const at::Tensor& key,
                                                           const at::Tensor& value,
                                                           const std::optional<at::Tensor>& mask, double dropout_p,
                                                           bool need_weights, bool is_causal) {
  check_attention_inputs(query, key, value, mask, dropout_p);
#ifdef FASTMHA_WITH_CUDA
  if (query.is_cuda()) {
    check_cuda_dropout_runs(query, dropout_p);
  }
#endif
  auto [output, weights, logsumexp, rng_state] =
      aten_impl::attention_forward(query, key, value, mask, dropout_p, need_weights, is_causal,
                                   dropout_kernels_for(query.device()), /*need_logsumexp=*/false);
  return {output, weights};
}

std::tuple<at::Tensor, at::Tensor> block_with_tangents(const at::Tensor& query, const at::Tensor& key,
                                                       const at::Tensor& value, const at::Tensor& w_q,
                                                       const at::Tensor& w_k, const at::Tensor& w_v,
                                                       const at::Tensor& w_o, int64_t num_heads,
                                                       const std::optional<at::Tensor>& mask, double dropout_p,
                                                       bool need_weights, bool is_causal) {
  check_block_inputs(query, key, value, w_q, w_k, w_v, w_o, num_heads, mask, dropout_p);
  const auto heads = [&](const at::Tensor& x, const at::Tensor& w) {
    return split_heads(at::matmul(x, w.t()), num_heads);
  };
  auto [heads_out, weights] = attention_with_tangents(heads(query, w_q), heads(key, w_k), heads(value, w_v), mask,
                                                      dropout_p, need_weights, is_causal);
  return {at::matmul(merge_heads(heads_out), w_o.t()), weights};
}

}  // namespace fastmha::detail
