// Whether torch's own SDPA rules let one of its fused CUDA kernels run a call, for the contract layer
// (ops/stock/) when SDPA picks a kernel that the layer does not wrap for that call. The rules live in
// libtorch_cuda, so this file is built with the CUDA kernels only.
#include <ATen/Context.h>
#include <ATen/native/transformers/cuda/sdp_utils.h>

#include "ops/stock/stock_attention.h"

namespace fastmha::stock {
namespace {

bool usable(CudaBackend backend, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
            const std::optional<at::Tensor>& bias, double dropout_p, bool is_causal) {
  sdp::sdp_params params;
  params.query = query;
  params.key = key;
  params.value = value;
  params.attn_mask = bias;
  params.dropout = dropout_p;
  params.is_causal = is_causal;
  params.enable_gqa = false;
  const auto& context = at::globalContext();
  switch (backend) {
    case CudaBackend::kFlash:
      return context.userEnabledFlashSDP() && sdp::can_use_flash_attention(params, /*debug=*/false);
    case CudaBackend::kEfficient:
      return context.userEnabledMemEfficientSDP() && sdp::can_use_mem_efficient_attention(params, /*debug=*/false);
    case CudaBackend::kCudnn:
      return context.userEnabledCuDNNSDP() && sdp::can_use_cudnn_attention(params, /*debug=*/false);
  }
  return false;
}

const bool usable_registered = [] {
  set_cuda_backend_usable(&usable);
  return true;
}();

}  // namespace
}  // namespace fastmha::stock
