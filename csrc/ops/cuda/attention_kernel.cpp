// CUDA kernels of the attention core. ops/kernel_choice.cpp decides which runs a call: torch's fused SDPA
// kernels behind the contract layer (ops/stock/) for unmasked calls without kept weights or dropout (masked ones
// too with FASTMHA_CUDA_MASKED=sdpa); fastmha's own kernels for kept weights (cuBLAS scores + one fused
// scale/mask/softmax/dropout kernel per row), and its flash kernels (no Lq x Lk buffer) for the rest in half
// types, or for all the rest with FASTMHA_CUDA_KERNELS=own; the ATen composite otherwise.
// Every launch runs on the inputs' device and its current stream.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <type_traits>

#include "ops/aten/attention_aten.h"
#include "ops/broadcast_mask.h"
#include "ops/checks.h"
#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/kernel_params_builder.h"
#include "ops/cuda/scores_gemm.h"
#include "ops/cuda/torch_philox_state.h"
#include "ops/heads.h"
#include "ops/kernel_choice.h"
#include "ops/stock/stock_attention.h"

namespace fastmha {
namespace {

using cuda_kernels::flash_params;
using cuda_kernels::rows_params;
using cuda_kernels::unit_stride_rows;

constexpr int kMaxDevices = 64;

// What the kernel choice needs to know about a GPU, found once per device.
CudaDeviceFacts device_facts(const at::Device& device) {
  static std::once_flag found[kMaxDevices];
  static CudaDeviceFacts facts[kMaxDevices];
  const auto index = device.index();
  TORCH_CHECK(index >= 0 && index < kMaxDevices, "fastmha: CUDA device index ", index, " out of range");
  std::call_once(found[index], [&] {
    const auto* properties = at::cuda::getDeviceProperties(index);
    facts[index].own_kernels_fit = properties->sharedMemPerBlockOptin >= cuda_kernels::kSharedBudget;
    c10::cuda::CUDAGuard guard(device);
    facts[index].has_kernel_image = cuda_kernels::kernel_image_available();
    facts[index].device_name = std::string(properties->name) + " (sm_" + std::to_string(properties->major) +
                               std::to_string(properties->minor) + ")";
  });
  return facts[index];
}

const bool facts_registered = [] {
  set_cuda_facts_provider(&device_facts);
  return true;
}();

// The mma kernels exist for the half types only; the kernel choice asks for them in those alone.
template <typename T, typename Acc>
void launch_mma_forward(const cuda_kernels::AttentionParams<T, Acc>& p, int row_tiles, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>) {
    cuda_kernels::launch_flash_forward_mma(p, row_tiles, stream);
  } else {
    TORCH_CHECK(false, "fastmha: the CUDA mma forward takes float16 and bfloat16 only");
  }
}
template <typename T, typename Acc>
void launch_mma_backward(const cuda_kernels::AttentionParams<T, Acc>& p, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>) {
    cuda_kernels::launch_flash_backward_mma(p, stream);
  } else {
    TORCH_CHECK(false, "fastmha: the CUDA mma backward takes float16 and bfloat16 only");
  }
}

detail::AttentionForwardResult attention_forward_kernel(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                        double dropout_p, bool need_weights, bool is_causal) {
  check_attention_inputs(query, key, value, mask, dropout_p);
  c10::cuda::CUDAGuard guard(query.device());
  const AttentionCall call{query, key, value, mask, dropout_p, need_weights, is_causal};
  const auto choice = choose_kernel_logged(call);
  const auto kernel = choice.kernel;
  if (kernel == AttentionKernel::kStockCuda) {
    stock::TorchPhilox drawn;
    auto result = stock::attention_forward(query, key, value, mask, is_causal, choice.sdpa_backend, dropout_p,
                                           dropout_p > 0 ? &drawn : nullptr);
    if (dropout_p > 0) {
      std::get<3>(result) = rng_state_of(drawn, query.device());
    }
    return result;
  }
  if (kernel == AttentionKernel::kAten) {
    check_cuda_dropout_runs(query, dropout_p);
    return aten_impl::attention_forward(query, key, value, mask, dropout_p, need_weights, is_causal,
                                        cuda_dropout_kernels());
  }
  const auto dtype = query.scalar_type();
  const auto acc_options = query.options().dtype(at::toOpMathType(dtype));
  const int64_t batch = query.size(0), heads = query.size(1), len_q = query.size(2), len_k = key.size(2);
  const auto q = unit_stride_rows(query), k = unit_stride_rows(key), v = unit_stride_rows(value);
  const auto mask_view = broadcast_mask(mask, query, key);
  const auto rng_state =
      dropout_p > 0 ? draw_cuda_rng_state(query.device()) : at::zeros({2}, query.options().dtype(at::kLong));
  auto logsumexp = at::empty({batch, heads, len_q}, acc_options);
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (!need_weights) {
    auto output = at::empty({batch, heads, len_q, value.size(3)}, query.options());
    // Skipped tiles leave out hidden keys' zero weights times their values.
    const auto skip_flags = mask_view.defined() || is_causal ? cuda_kernels::finite_heads({v}) : at::Tensor();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fastmha_cuda_flash_forward", [&] {
      using Acc = at::opmath_type<scalar_t>;
      auto p = flash_params<scalar_t, Acc>(q, k, v, mask_view, dropout_p, is_causal, rng_state);
      p.finite_heads = skip_flags.defined() ? skip_flags.const_data_ptr<bool>() : nullptr;
      p.out = output.data_ptr<scalar_t>();
      p.lse = logsumexp.data_ptr<Acc>();
      if (choice.mma_row_tiles > 0) {
        launch_mma_forward(p, choice.mma_row_tiles, stream);
      } else {
        cuda_kernels::launch_flash_forward(p, stream);
      }
    });
    return {in_layout_of(output, query), at::empty({0}, query.options()), logsumexp, rng_state};
  }
  const auto scores = cuda_kernels::scores_gemm(q, k);
  auto weights = at::empty({batch, heads, len_q, len_k}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fastmha_cuda_softmax_forward", [&] {
    using Acc = at::opmath_type<scalar_t>;
    auto p = rows_params<scalar_t, Acc>(q, k, scores, mask_view, dropout_p, is_causal, rng_state);
    p.weights = weights.data_ptr<scalar_t>();
    p.lse = logsumexp.data_ptr<Acc>();
    cuda_kernels::launch_softmax_forward(p, stream);
  });
  return {in_layout_of(at::matmul(weights, v), query), weights, logsumexp, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward(const at::Tensor& grad_output, const at::Tensor& query,
                                                              const at::Tensor& key, const at::Tensor& value,
                                                              const at::Tensor& mask_view, const at::Tensor& output,
                                                              const at::Tensor& logsumexp, const at::Tensor& rng_state,
                                                              double dropout_p, bool is_causal, bool mma) {
  const auto dtype = query.scalar_type();
  const auto acc = at::toOpMathType(dtype);
  const auto q = unit_stride_rows(query), k = unit_stride_rows(key), v = unit_stride_rows(value);
  const auto grad_out = grad_output.to(dtype).contiguous();
  // delta_i = sum_c dO_ic O_ic = sum_j dP_ij P_ij: the softmax backward's row term, dropout included.
  const auto delta = (grad_out.to(acc) * output.to(acc)).sum(-1).contiguous();
  const auto lse = logsumexp.to(acc).contiguous();
  auto grad_q_acc = at::zeros(query.sizes(), query.options().dtype(acc));
  auto grad_k = at::empty(key.sizes(), key.options());
  auto grad_v = at::empty(value.sizes(), value.options());
  // Skipped tiles leave out zero score gradients times Q and K, and zero weights times dO.
  const auto skip_flags =
      mask_view.defined() || is_causal ? cuda_kernels::finite_heads({q, k, grad_out}) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fastmha_cuda_flash_backward", [&] {
    using Acc = at::opmath_type<scalar_t>;
    auto p = flash_params<scalar_t, Acc>(q, k, v, mask_view, dropout_p, is_causal, rng_state);
    p.finite_heads = skip_flags.defined() ? skip_flags.const_data_ptr<bool>() : nullptr;
    p.saved_lse = lse.const_data_ptr<Acc>();
    p.grad_out = grad_out.const_data_ptr<scalar_t>();
    p.delta = delta.const_data_ptr<Acc>();
    p.grad_q_acc = grad_q_acc.data_ptr<Acc>();
    p.grad_k = grad_k.data_ptr<scalar_t>();
    p.grad_v = grad_v.data_ptr<scalar_t>();
    if (mma) {
      launch_mma_backward(p, at::cuda::getCurrentCUDAStream());
    } else {
      cuda_kernels::launch_flash_backward(p, at::cuda::getCurrentCUDAStream());
    }
  });
  return {in_layout_of(grad_q_acc.to(dtype), query), in_layout_of(grad_k, key), in_layout_of(grad_v, value)};
}

// With a gradient on the weights themselves: dW = dO V^T + grad_weights row by row, then GEMMs in the dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> weights_backward(
    const at::Tensor& grad_output, const at::Tensor& grad_weights, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& mask_view, const at::Tensor& logsumexp, const at::Tensor& rng_state,
    double dropout_p, bool is_causal) {
  const auto dtype = query.scalar_type();
  const auto lse = logsumexp.to(at::toOpMathType(dtype)).contiguous();
  const auto q = unit_stride_rows(query), k = unit_stride_rows(key), v = unit_stride_rows(value);
  const auto grad_out = grad_output.to(dtype);
  const auto scores = cuda_kernels::scores_gemm(q, k);
  auto grad_w = cuda_kernels::scores_gemm(grad_out, v);
  grad_w.add_(grad_weights);
  auto weights = at::empty(scores.sizes(), query.options());
  auto grad_scores = at::empty(scores.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fastmha_cuda_softmax_backward", [&] {
    using Acc = at::opmath_type<scalar_t>;
    auto p = rows_params<scalar_t, Acc>(q, k, scores, mask_view, dropout_p, is_causal, rng_state);
    p.saved_lse = lse.const_data_ptr<Acc>();
    p.grad_weights = grad_w.const_data_ptr<Acc>();
    p.weights = weights.data_ptr<scalar_t>();
    p.grad_scores = grad_scores.data_ptr<scalar_t>();
    cuda_kernels::launch_softmax_backward(p, at::cuda::getCurrentCUDAStream());
  });
  return {in_layout_of(at::matmul(grad_scores, k), query),
          in_layout_of(at::matmul(grad_scores.transpose(-2, -1), q), key),
          in_layout_of(at::matmul(weights.transpose(-2, -1), grad_out), value)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_kernel(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
    const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& weights) {
  check_backward_inputs(grad_output, query, key, value, mask, output, logsumexp, rng_state, dropout_p);
  // The CUDA backward recomputes the weights; kept ones are only checked.
  check_kept_weights(weights, query, key);
  check_grad_weights(grad_weights, query, key);
  c10::cuda::CUDAGuard guard(query.device());
  AttentionCall call{query, key, value, mask, dropout_p, weights_kept(grad_weights), is_causal, Pass::kBackward};
  // With the switch on, the forward may have drawn either stream (kept weights, torch's enabled kernels and the
  // switch decide): the backward looks which, at one wait for the GPU, and replays that one.
  at::Tensor host_state;
  if (dropout_p > 0 && cuda_dropout_on_sdpa()) {
    call.drawn = dropout_draw_of(rng_state, &host_state);
    TORCH_CHECK(call.drawn != DropoutDraw::kUnknown,
                "fastmha: with FASTMHA_CUDA_DROPOUT=sdpa a backward with dropout looks on the host which stream its "
                "forward drew, which a CUDA graph capture forbids; capture such backwards without the switch");
  }
  const auto choice = choose_kernel_logged(call);
  const auto kernel = choice.kernel;
  if (kernel == AttentionKernel::kStockCuda) {
    const auto drawn = dropout_p > 0 ? torch_philox_of(rng_state, host_state) : stock::TorchPhilox{};
    return stock::attention_backward(grad_output, query, key, value, mask, output, logsumexp, is_causal,
                                     choice.sdpa_backend, dropout_p, dropout_p > 0 ? &drawn : nullptr);
  }
  if (kernel == AttentionKernel::kAten) {
    check_cuda_dropout_runs(query, dropout_p);
    return aten_impl::attention_backward(grad_output, grad_weights, query, key, value, mask, output, logsumexp,
                                         rng_state, dropout_p, is_causal, cuda_dropout_kernels());
  }
  const auto mask_view = broadcast_mask(mask, query, key);
  const auto state = rng_state.to(query.device(), at::kLong).contiguous();
  if (weights_kept(grad_weights)) {
    return weights_backward(grad_output, *grad_weights, query, key, value, mask_view, logsumexp, state, dropout_p,
                            is_causal);
  }
  return flash_backward(grad_output, query, key, value, mask_view, output, logsumexp, state, dropout_p, is_causal,
                        choice.mma_backward);
}

}  // namespace

void check_cuda_dropout_runs(const at::Tensor& query, double dropout_p) {
  if (dropout_p > 0) {
    const auto facts = device_facts(query.device());
    TORCH_CHECK(facts.has_kernel_image, "fastmha: dropout on ", facts.device_name,
                " needs fastmha's CUDA code for that GPU, and this build holds code for CUDA archs ",
                FASTMHA_CUDA_ARCHS, " only; rebuild with TORCH_CUDA_ARCH_LIST including its arch");
  }
}

TORCH_LIBRARY_IMPL(fastmha, CUDA, m) {
  m.impl("_attention_forward", &attention_forward_kernel);
  m.impl("_attention_backward", &attention_backward_kernel);
}

}  // namespace fastmha
