#include "ops/stock/stock_attention.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/heads.h"
#include "ops/stock/contract_inputs.h"

namespace fastmha::stock {
namespace {

// The stock kernels index the head dimension as if its stride were 1 and return garbage otherwise (torch's
// SDPA checks this before it picks them); any other stride is fine.
at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

double softmax_scale(const at::Tensor& query) { return 1.0 / std::sqrt(static_cast<double>(query.size(3))); }

// The memory-efficient kernel's log-sum-exp has rows padded to a multiple of 32.
constexpr int64_t kEfficientLseAlign = 32;

// The memory-efficient backward gets the output and its gradient in the (B, Lq, H, d) memory its forward writes,
// as torch's own SDPA hands them over: its kernel may take the output's row stride from the shapes.
at::Tensor efficient_layout(const at::Tensor& t) { return t.transpose(1, 2).contiguous().transpose(1, 2); }

// fastmha's call of the memory-efficient backward returned wrong query gradients in half types for a masked call
// with 300 queries and a single key (torch 2.11, H200), where torch's own SDPA call of it was right. The output's
// layout is the suspect (efficient_layout above); until a GPU run proves the kernel there, calls with fewer keys
// than its key tile are left to fastmha's kernels.
constexpr int64_t kEfficientMinKeys = 64;

// t (B, H, L, d) copied, if need be, into the memory order of query's strides: the layout cuDNN's forward gives
// its output, which its backward expects of the output and the output's gradient.
at::Tensor in_fill_order_of(const at::Tensor& t, const at::Tensor& query) {
  std::vector<int64_t> fill_order{0, 1, 2, 3};  // innermost first
  std::stable_sort(fill_order.begin(), fill_order.end(),
                   [&](int64_t a, int64_t b) { return query.stride(a) < query.stride(b); });
  std::vector<int64_t> strides(4);
  int64_t stride = 1;
  for (const auto dim : fill_order) {
    strides[dim] = stride;
    stride *= t.size(dim);
  }
  if (t.strides() == at::IntArrayRef(strides)) {
    return t;
  }
  return at::empty_strided(t.sizes(), strides, t.options()).copy_(t);
}

CudaBackendUsable& backend_usable() {
  static CudaBackendUsable usable = nullptr;
  return usable;
}

// The query given to the kernel has a unit last stride; a CUDA kernel (the memory-efficient one: the only one the
// layer passes a bias) reads its bias row-aligned.
ContractInputs contract_inputs_for(const at::Tensor& query, const at::Tensor& key,
                                   const std::optional<at::Tensor>& mask, bool is_causal,
                                   std::optional<CudaBackend> cuda) {
  TORCH_INTERNAL_ASSERT(!mask.has_value() || !cuda.has_value() || *cuda == CudaBackend::kEfficient,
                        "the layer passes a bias to the memory-efficient CUDA kernel only");
  return contract_inputs(unit_last_stride(query), key, mask, is_causal,
                         cuda.has_value() ? BiasLayout::kRowAligned : BiasLayout::kBroadcast);
}

// cuDNN's log-sum-exp is (B, H, Lq, 1); the op's is (B, H, Lq).
at::Tensor op_lse_shape(const at::Tensor& lse, const at::Tensor& query) {
  return lse.reshape({query.size(0), query.size(1), query.size(2)});
}

}  // namespace

void set_cuda_backend_usable(CudaBackendUsable usable) { backend_usable() = usable; }

std::optional<CudaBackend> cuda_backend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& mask, bool is_causal, double dropout_p,
                                        bool training, bool take_masks, bool take_dropout, std::string* why) {
  const auto refuse = [&](std::string reason) -> std::optional<CudaBackend> {
    if (why != nullptr) {
      *why = std::move(reason);
    }
    return std::nullopt;
  };
  if (dropout_p > 0 && !take_dropout) {
    return refuse(
        "dropout: torch's CUDA kernels draw other masks than fastmha's, taken only with "
        "FASTMHA_CUDA_DROPOUT=sdpa (unproven on a GPU)");
  }
  if (mask.has_value() && !take_masks && dropout_p == 0) {
    return refuse(
        "a mask: the layer hands torch's CUDA kernels a bias only with FASTMHA_CUDA_MASKED=sdpa (unproven on a GPU)");
  }
  // torch's choice has rules for training only (backwards some GPUs cannot run); it reads them off the inputs'
  // requires_grad under grad mode, which is off below autograd.
  c10::AutoGradMode grad_mode(training);
  // (An inference tensor cannot be marked; a backward is never taken of one through autograd.)
  const auto as_trained = [&](const at::Tensor& t) {
    return training && !t.requires_grad() && !t.is_inference() ? t.detach().requires_grad_(true) : t;
  };
  const auto q = as_trained(query), k = as_trained(key), v = as_trained(value);
  // A masked call passes the kernel a bias laid out as contract_inputs lays it out (causality folded in); this
  // stand-in has its dtype and strides, which is all that SDPA's rules read of it.
  std::optional<at::Tensor> bias_like;
  if (mask.has_value()) {
    bias_like = empty_row_aligned_bias_rows({1, 1, 1}, query, key.size(2))
                    .expand({query.size(0), query.size(1), query.size(2), key.size(2)});
  }
  const bool causal_flag = is_causal && !mask.has_value();
  int64_t choice = 0;
  try {
    choice = at::_fused_sdp_choice(q, k, v, bias_like, dropout_p, causal_flag, softmax_scale(query));
  } catch (const c10::Error& error) {  // no kernel SDPA may run (its math kernel disabled too)
    return refuse(std::string("SDPA finds no kernel it may run: ") + error.what_without_backtrace());
  }
  const auto usable = [&](CudaBackend backend) {
    const auto provider = backend_usable();
    return provider != nullptr && provider(backend, q, k, v, bias_like, dropout_p, causal_flag);
  };
  std::optional<CudaBackend> pick;
  if (mask.has_value() || dropout_p > 0) {
    // With a bias the layer calls the memory-efficient kernel only: flash takes none, and cuDNN's has not been
    // checked against the contract (torch 2.10 ran some cuDNN calls as if their bias were absent). With dropout
    // too: one kernel whose draw the backward replays, masked or not.
    if (choice == static_cast<int64_t>(CudaBackend::kEfficient) || usable(CudaBackend::kEfficient)) {
      pick = CudaBackend::kEfficient;
    }
  } else if (choice == static_cast<int64_t>(CudaBackend::kFlash) ||
             choice == static_cast<int64_t>(CudaBackend::kEfficient)) {
    pick = static_cast<CudaBackend>(choice);
  } else if (choice == static_cast<int64_t>(CudaBackend::kCudnn)) {
    if (!is_causal || query.size(2) == key.size(2)) {
      pick = CudaBackend::kCudnn;
    } else if (usable(CudaBackend::kFlash)) {
      pick = CudaBackend::kFlash;
    } else if (usable(CudaBackend::kEfficient)) {
      pick = CudaBackend::kEfficient;
    }
  }
  if (pick == CudaBackend::kEfficient && key.size(2) < kEfficientMinKeys) {
    return refuse("fewer than " + std::to_string(kEfficientMinKeys) +
                  " keys: the layer does not use the memory-efficient kernel there");
  }
  if (!pick.has_value()) {
    return refuse("SDPA would run backend " + std::to_string(choice) + ", which the layer does not wrap " +
                  (mask.has_value() || dropout_p > 0 ? "with a mask or dropout" : "here") +
                  ", and no other fused kernel takes the call");
  }
  return pick;
}

detail::AttentionForwardResult attention_forward(const at::Tensor& query, const at::Tensor& user_key,
                                                 const at::Tensor& user_value, const std::optional<at::Tensor>& mask,
                                                 bool is_causal, std::optional<CudaBackend> cuda, double dropout_p,
                                                 TorchPhilox* drawn) {
  TORCH_INTERNAL_ASSERT(query.is_cpu() || cuda.has_value(), "the stock CUDA path needs the chosen SDPA backend");
  TORCH_INTERNAL_ASSERT(dropout_p == 0 || (cuda == CudaBackend::kEfficient && drawn != nullptr),
                        "the layer runs dropout on the memory-efficient CUDA kernel only, and keeps its draw");
  const auto key = unit_last_stride(user_key), value = unit_last_stride(user_value);
  const auto p = contract_inputs_for(query, key, mask, is_causal, cuda);
  const double scale = softmax_scale(query);
  at::Tensor output, logsumexp;
  if (query.is_cpu()) {
    std::tie(output, logsumexp) =
        at::_scaled_dot_product_flash_attention_for_cpu(p.query, key, value, 0.0, p.is_causal, p.bias, scale);
  } else if (*cuda == CudaBackend::kFlash) {
    auto result = at::_scaled_dot_product_flash_attention(p.query, key, value, 0.0, p.is_causal, false, scale);
    output = std::get<0>(result);
    logsumexp = std::get<1>(result);
  } else if (*cuda == CudaBackend::kCudnn) {
    auto result = at::_scaled_dot_product_cudnn_attention(p.query, key, value, std::nullopt,
                                                          /*compute_log_sumexp=*/true, 0.0, p.is_causal, false, scale);
    output = std::get<0>(result);
    logsumexp = op_lse_shape(std::get<1>(result), query);
  } else {
    auto result =
        at::_scaled_dot_product_efficient_attention(p.query, key, value, p.bias, true, dropout_p, p.is_causal, scale);
    output = std::get<0>(result);
    if (drawn != nullptr) {
      *drawn = {std::get<2>(result), std::get<3>(result)};
    }
    logsumexp = std::get<1>(result).slice(-1, 0, query.size(2)).contiguous();
  }
  // The stock kernels write (B, Lq, H, ...) memory; the op's contract (and its Meta kernel) is the query's layout.
  return {in_layout_of(output, query), at::empty({0}, query.options()),
          to_contract_lse(logsumexp, p, key.size(2)).contiguous(), at::zeros({2}, query.options().dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& user_key, const at::Tensor& user_value,
    const std::optional<at::Tensor>& mask, const at::Tensor& user_output, const at::Tensor& saved_logsumexp,
    bool is_causal, std::optional<CudaBackend> cuda, double dropout_p, const TorchPhilox* drawn) {
  TORCH_INTERNAL_ASSERT(query.is_cpu() || cuda.has_value(), "the stock CUDA path needs the chosen SDPA backend");
  TORCH_INTERNAL_ASSERT(dropout_p == 0 || (cuda == CudaBackend::kEfficient && drawn != nullptr),
                        "the layer replays dropout on the memory-efficient CUDA kernel only, from its forward's draw");
  const auto key = unit_last_stride(user_key), value = unit_last_stride(user_value);
  const auto output = unit_last_stride(user_output);
  const auto p = contract_inputs_for(query, key, mask, is_causal, cuda);
  const double scale = softmax_scale(query);
  const auto grad_out = unit_last_stride(grad_output.to(query.scalar_type()));
  const auto logsumexp = to_stock_lse(saved_logsumexp, p, key.size(2));
  at::Tensor grad_q, grad_k, grad_v;
  if (query.is_cpu()) {
    std::tie(grad_q, grad_k, grad_v) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, p.query, key, value, output, logsumexp, 0.0, p.is_causal, p.bias, scale);
  } else {
    // Without dropout the kernels read no Philox state.
    const auto unused_seed = at::zeros({}, query.options().dtype(at::kLong));
    if (*cuda == CudaBackend::kFlash) {
      std::tie(grad_q, grad_k, grad_v) = at::_scaled_dot_product_flash_attention_backward(
          grad_out, p.query, key, value, output, logsumexp, at::Tensor(), at::Tensor(), query.size(2), key.size(2), 0.0,
          p.is_causal, unused_seed, unused_seed, scale);
    } else if (*cuda == CudaBackend::kCudnn) {
      const auto lse = logsumexp.reshape({query.size(0), query.size(1), query.size(2), 1}).contiguous();
      std::tie(grad_q, grad_k, grad_v) = at::_scaled_dot_product_cudnn_attention_backward(
          in_fill_order_of(grad_out, p.query), p.query, key, value, in_fill_order_of(output, p.query), lse, unused_seed,
          unused_seed, at::Tensor(), at::Tensor(), at::Tensor(), query.size(2), key.size(2), 0.0, p.is_causal, scale);
    } else {
      const int64_t len_q = query.size(2);
      const int64_t padded = (len_q + kEfficientLseAlign - 1) / kEfficientLseAlign * kEfficientLseAlign;
      const auto lse = at::constant_pad_nd(logsumexp, {0, padded - len_q});
      auto grads = at::_scaled_dot_product_efficient_attention_backward(
          efficient_layout(grad_out), p.query, key, value, p.bias.value_or(at::Tensor()), efficient_layout(output), lse,
          drawn != nullptr ? drawn->seed : unused_seed, drawn != nullptr ? drawn->offset : unused_seed, dropout_p,
          {true, true, true, false}, p.is_causal, scale);
      grad_q = std::get<0>(grads);
      grad_k = std::get<1>(grads);
      grad_v = std::get<2>(grads);
    }
  }
  grad_q = to_contract_grad_query(grad_q, p);
  return {in_layout_of(grad_q, query), in_layout_of(grad_k, user_key), in_layout_of(grad_v, user_value)};
}

}  // namespace fastmha::stock
