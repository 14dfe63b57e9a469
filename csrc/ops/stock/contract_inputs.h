// What torch's fused attention kernels are given instead of the user's query and mask, so that they compute
// fastmha's contract (see stock_attention.h), and the conversions of the log-sum-exp and the query's gradient
// between the kernel's meaning and the op's.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastmha::stock {

// How the bias is laid out for the kernel that reads it.
enum class BiasLayout {
  // In the mask's own broadcast shape (zero strides included): torch's CPU flash kernel reads any strides. Rows
  // with no visible key are looked for on the host.
  kBroadcast,
  // In the score shape (B, H, Lq, Lk) through broadcast strides, its last dimension dense and every other stride
  // 0 or a multiple of kBiasRowAlign elements (what the memory-efficient CUDA kernel loads). Rows with no visible
  // key are handled without reading a value back to the host (no device sync, CUDA graphs can capture it).
  kRowAligned,
};

inline constexpr int64_t kBiasRowAlign = 16;

struct ContractInputs {
  at::Tensor query;                // the user's, with the rows that see no key zeroed
  std::optional<at::Tensor> bias;  // 0 / -inf in the query's dtype; none without a mask
  bool is_causal = false;          // passed to the kernel: causality is folded into the bias when there is a mask
  // bool (..., Lq or 1, 1): the rows with no visible key; undefined when there are none. kRowAligned always
  // defines it for a masked call (it is not known on the host whether any row is dead).
  at::Tensor dead_rows;
};

// Uninitialized bias rows of `len_k` values as kRowAligned lays them out, one row per index of `row_sizes` (B, H,
// Lq, each 1 where rows are shared): padded to kBiasRowAlign values. Expanded to the score shape they are the
// kernel's bias; SDPA's choice is asked about the same layout.
at::Tensor empty_row_aligned_bias_rows(at::IntArrayRef row_sizes, const at::Tensor& query, int64_t len_k);

ContractInputs contract_inputs(const at::Tensor& query, const at::Tensor& key, const std::optional<at::Tensor>& mask,
                               bool is_causal, BiasLayout layout);

// The op's log-sum-exp (that of the masked, -1e9, scaled scores) from the stock kernel's, and back.
at::Tensor to_contract_lse(const at::Tensor& stock_lse, const ContractInputs& inputs, int64_t len_k);
at::Tensor to_stock_lse(const at::Tensor& lse, const ContractInputs& inputs, int64_t len_k);

// The query gradient of the op from the kernel's: 0 in the rows with no visible key, whose scores are the
// constant -1e9 whatever the query.
at::Tensor to_contract_grad_query(const at::Tensor& grad_query, const ContractInputs& inputs);

}  // namespace fastmha::stock
