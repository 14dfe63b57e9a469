#include "ops/stock/stock_attention.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "ops/broadcast_mask.h"
#include "ops/heads.h"
#include "ops/masked_score.h"

namespace fastmha::stock {
namespace {

// The stock kernels index the head dimension as if its stride were 1 and return garbage otherwise (torch's
// SDPA checks this before it picks them); any other stride is fine.
at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// What the stock kernel is given instead of the user's query and mask (see the header).
struct Prepared {
  at::Tensor query;
  std::optional<at::Tensor> bias;  // 0 / -inf in the query's dtype, broadcastable to (B, H, Lq, Lk)
  bool is_causal = false;          // passed to the stock kernel
  at::Tensor dead_rows;            // bool (..., Lq or 1, 1): rows with no visible key; undefined when none
};

at::Tensor as_4d(const at::Tensor& mask) {
  auto sizes = mask.sizes().vec();
  while (sizes.size() < 4) {
    sizes.insert(sizes.begin(), 1);
  }
  return mask.reshape(sizes);
}

Prepared prepare(const at::Tensor& query, const at::Tensor& key, const std::optional<at::Tensor>& mask,
                 bool is_causal) {
  Prepared p;
  p.query = unit_last_stride(query);
  if (!mask.has_value()) {
    p.is_causal = is_causal;
    return p;
  }
  const int64_t len_q = query.size(2), len_k = key.size(2);
  // Worked out on the mask's distinct elements and expanded at the end: an expanded mask stays a view (torch's
  // kernels read the bias through its strides).
  const auto mask_sizes = as_4d(*mask).sizes().vec();
  auto visible = as_4d(distinct_elements(*mask).ne(0).to(query.device()));
  if (is_causal) {
    visible = visible.logical_and(at::ones({len_q, len_k}, visible.options()).tril());
  }
  const auto dead = visible.any(-1, /*keepdim=*/true).logical_not();
  // On the CPU a row with no visible key is rare and cheap to look for. On CUDA the look would synchronise
  // the stream (and cannot run under graph capture), so the transformation always runs there.
  if (!query.is_cpu() || dead.any().item<bool>()) {
    visible = visible.logical_or(dead);
    p.query = p.query.masked_fill(dead, 0);
    p.dead_rows = dead;
  }
  const auto options = query.options();
  p.bias = at::where(visible, at::scalar_tensor(0.0, options),
                     at::scalar_tensor(-std::numeric_limits<double>::infinity(), options))
               .expand(at::infer_size(mask_sizes, visible.sizes()));
  return p;
}

// The saved log-sum-exp is the op's, whichever kernel ran: that of the masked (-1e9) scaled scores. It differs
// from the stock kernel's own only in the rows with no visible key (-1e9 + log Lk there, log Lk for the
// stock kernel with the row's query zeroed), so a backward can take the forward of either kernel. And in the rows
// with a +inf score, whose weights are all NaN in the math (inf - inf): the stock kernels report +inf there, the op
// NaN, so that a backward recomputing P = exp(S - lse) gets NaN across the row, not only at that key.
at::Tensor dead_rows_of_lse(const Prepared& p) { return p.dead_rows.squeeze(-1); }

at::Tensor to_contract_lse(const at::Tensor& stock_lse, const Prepared& p, const at::Tensor& key) {
  const at::Tensor lse = stock_lse.masked_fill(stock_lse == std::numeric_limits<double>::infinity(),
                                               std::numeric_limits<double>::quiet_NaN());
  if (!p.dead_rows.defined()) {
    return lse;
  }
  const double log_keys = std::log(static_cast<double>(key.size(2)));
  return lse.masked_fill(dead_rows_of_lse(p), kMaskedScore + log_keys);
}

at::Tensor to_stock_lse(const at::Tensor& lse, const Prepared& p, const at::Tensor& key) {
  if (!p.dead_rows.defined()) {
    return lse;
  }
  return lse.masked_fill(dead_rows_of_lse(p), std::log(static_cast<double>(key.size(2))));
}

double softmax_scale(const at::Tensor& query) { return 1.0 / std::sqrt(static_cast<double>(query.size(3))); }

// The memory-efficient kernel wants the bias rows 16-element aligned and the full score shape (broadcast
// through zero strides, as SDPA passes it).
at::Tensor efficient_bias(const at::Tensor& bias, const at::Tensor& query, const at::Tensor& key) {
  const int64_t len_k = key.size(2);
  auto b = bias.expand({bias.size(0), bias.size(1), bias.size(2), len_k});
  const int64_t pad = (16 - len_k % 16) % 16;
  b = pad > 0 ? at::constant_pad_nd(b, {0, pad}).slice(-1, 0, len_k) : b.contiguous();
  return b.expand({query.size(0), query.size(1), query.size(2), len_k});
}

// The memory-efficient kernel's log-sum-exp has rows padded to a multiple of 32.
constexpr int64_t kEfficientLseAlign = 32;

// The memory-efficient backward gets the output and its gradient in the (B, Lq, H, d) memory its forward writes,
// as torch's own SDPA hands them over: its kernel may take the output's row stride from the shapes.
at::Tensor efficient_layout(const at::Tensor& t) { return t.transpose(1, 2).contiguous().transpose(1, 2); }

// fastmha's call of the memory-efficient backward returned wrong query gradients in half types for a masked call
// with 300 queries and a single key (torch 2.11, H200), where torch's own SDPA call of it was right. The output's
// layout is the suspect (efficient_layout above); until a GPU run proves the kernel there, calls with fewer keys
// than its key tile run the ATen composite, whose Lq x Lk scores are then no larger than the output.
constexpr int64_t kEfficientMinKeys = 64;

CudaBackendUsable& backend_usable() {
  static CudaBackendUsable usable = nullptr;
  return usable;
}

// cuDNN's log-sum-exp is (B, H, Lq, 1); the op's is (B, H, Lq).
at::Tensor op_lse_shape(const at::Tensor& lse, const at::Tensor& query) {
  return lse.reshape({query.size(0), query.size(1), query.size(2)});
}

}  // namespace

void set_cuda_backend_usable(CudaBackendUsable usable) { backend_usable() = usable; }

std::optional<CudaBackend> cuda_backend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& mask, bool is_causal, std::string* why) {
  // SDPA's own choice for tensors like the ones the layer passes (a bias of the query's dtype and the
  // score shape stands in for the real one; the choice reads only its metadata).
  std::optional<at::Tensor> bias_like;
  if (mask.has_value()) {
    bias_like =
        at::empty({1, 1, 1, 1}, query.options()).expand({query.size(0), query.size(1), query.size(2), key.size(2)});
  }
  const bool causal_flag = is_causal && !mask.has_value();
  const int64_t choice = at::_fused_sdp_choice(query, key, value, bias_like, 0.0, causal_flag, softmax_scale(query));
  const auto usable = [&](CudaBackend backend) {
    const auto provider = backend_usable();
    return provider != nullptr && provider(backend, query, key, value, bias_like, causal_flag);
  };
  std::optional<CudaBackend> pick;
  if (choice == static_cast<int64_t>(CudaBackend::kFlash) || choice == static_cast<int64_t>(CudaBackend::kEfficient)) {
    pick = static_cast<CudaBackend>(choice);
  } else if (choice == static_cast<int64_t>(CudaBackend::kCudnn)) {
    if (!mask.has_value() && (!is_causal || query.size(2) == key.size(2))) {
      pick = CudaBackend::kCudnn;
    } else if (usable(CudaBackend::kFlash)) {
      pick = CudaBackend::kFlash;
    } else if (usable(CudaBackend::kEfficient)) {
      pick = CudaBackend::kEfficient;
    }
  }
  if (pick == CudaBackend::kEfficient && key.size(2) < kEfficientMinKeys) {
    if (why != nullptr) {
      *why = "fewer than " + std::to_string(kEfficientMinKeys) +
             " keys: the memory-efficient kernel is not used there, and the ATen composite's scores are small";
    }
    return std::nullopt;
  }
  if (!pick.has_value() && why != nullptr) {
    *why = "SDPA would run backend " + std::to_string(choice) + " for this call, which the layer does not wrap " +
           (mask.has_value() ? "with a mask" : "here") + ", and no other fused kernel takes it";
  }
  return pick;
}

detail::AttentionForwardResult attention_forward(const at::Tensor& query, const at::Tensor& user_key,
                                                 const at::Tensor& user_value, const std::optional<at::Tensor>& mask,
                                                 bool is_causal, std::optional<CudaBackend> cuda) {
  TORCH_INTERNAL_ASSERT(query.is_cpu() || cuda.has_value(), "the stock CUDA path needs the chosen SDPA backend");
  const auto key = unit_last_stride(user_key), value = unit_last_stride(user_value);
  const auto p = prepare(query, key, mask, is_causal);
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
    TORCH_INTERNAL_ASSERT(!p.bias.has_value(), "the layer passes cuDNN no bias");
    auto result = at::_scaled_dot_product_cudnn_attention(p.query, key, value, std::nullopt,
                                                          /*compute_log_sumexp=*/true, 0.0, p.is_causal, false, scale);
    output = std::get<0>(result);
    logsumexp = op_lse_shape(std::get<1>(result), query);
  } else {
    const auto bias = p.bias.has_value() ? std::optional(efficient_bias(*p.bias, query, key)) : std::nullopt;
    auto result = at::_scaled_dot_product_efficient_attention(p.query, key, value, bias, true, 0.0, p.is_causal, scale);
    output = std::get<0>(result);
    logsumexp = std::get<1>(result).slice(-1, 0, query.size(2)).contiguous();
  }
  // The stock kernels write (B, Lq, H, ...) memory; the op's contract (and its Meta kernel) is the query's layout.
  return {in_layout_of(output, query), at::empty({0}, query.options()), to_contract_lse(logsumexp, p, key).contiguous(),
          at::zeros({2}, query.options().dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& user_key, const at::Tensor& user_value,
    const std::optional<at::Tensor>& mask, const at::Tensor& user_output, const at::Tensor& saved_logsumexp,
    bool is_causal, std::optional<CudaBackend> cuda) {
  TORCH_INTERNAL_ASSERT(query.is_cpu() || cuda.has_value(), "the stock CUDA path needs the chosen SDPA backend");
  const auto key = unit_last_stride(user_key), value = unit_last_stride(user_value);
  const auto output = unit_last_stride(user_output);
  const auto p = prepare(query, key, mask, is_causal);
  const double scale = softmax_scale(query);
  const auto grad_out = unit_last_stride(grad_output.to(query.scalar_type()));
  const auto logsumexp = to_stock_lse(saved_logsumexp, p, key);
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
      // cuDNN is handed the output's gradient in the output's own layout.
      const auto grad_like_out =
          grad_out.strides() == output.strides() ? grad_out : at::empty_like(output).copy_(grad_out);
      const auto lse = logsumexp.reshape({query.size(0), query.size(1), query.size(2), 1}).contiguous();
      std::tie(grad_q, grad_k, grad_v) = at::_scaled_dot_product_cudnn_attention_backward(
          grad_like_out, p.query, key, value, output, lse, unused_seed, unused_seed, at::Tensor(), at::Tensor(),
          at::Tensor(), query.size(2), key.size(2), 0.0, p.is_causal, scale);
    } else {
      const int64_t len_q = query.size(2);
      const int64_t padded = (len_q + kEfficientLseAlign - 1) / kEfficientLseAlign * kEfficientLseAlign;
      const auto lse = at::constant_pad_nd(logsumexp, {0, padded - len_q});
      const auto bias = p.bias.has_value() ? efficient_bias(*p.bias, query, key) : at::Tensor();
      auto grads = at::_scaled_dot_product_efficient_attention_backward(
          efficient_layout(grad_out), p.query, key, value, bias, efficient_layout(output), lse, unused_seed,
          unused_seed, 0.0, {true, true, true, false}, p.is_causal, scale);
      grad_q = std::get<0>(grads);
      grad_k = std::get<1>(grads);
      grad_v = std::get<2>(grads);
    }
  }
  if (p.dead_rows.defined()) {
    grad_q = grad_q.masked_fill(p.dead_rows, 0);
  }
  return {in_layout_of(grad_q, query), in_layout_of(grad_k, user_key), in_layout_of(grad_v, user_value)};
}

}  // namespace fastmha::stock
