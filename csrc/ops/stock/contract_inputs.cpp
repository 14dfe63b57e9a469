#include "ops/stock/contract_inputs.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cmath>
#include <limits>

#include "ops/broadcast_mask.h"
#include "ops/masked_score.h"

namespace fastmha::stock {
namespace {

at::Tensor as_4d(const at::Tensor& mask) {
  auto sizes = mask.sizes().vec();
  while (sizes.size() < 4) {
    sizes.insert(sizes.begin(), 1);
  }
  return mask.reshape(sizes);
}

at::Tensor zero_or_minus_inf(const at::Tensor& visible, const at::TensorOptions& options) {
  return at::where(visible, at::scalar_tensor(0.0, options),
                   at::scalar_tensor(-std::numeric_limits<double>::infinity(), options));
}

at::Tensor dead_rows_of_lse(const ContractInputs& inputs) { return inputs.dead_rows.squeeze(-1); }

// A host log-sum-exp (B, H, Lq) of any strides as a contiguous copy with +inf as NaN, in one pass: the kernel
// writes it (B, Lq, H), and the ATen ops for the same (compare, fill, copy) cost more than the forward itself on
// small calls.
at::Tensor contiguous_without_inf(const at::Tensor& lse) {
  at::Tensor out = at::empty(lse.sizes(), lse.options());
  AT_DISPATCH_FLOATING_TYPES(lse.scalar_type(), "fastmha_contract_lse", [&] {
    const scalar_t* from = lse.const_data_ptr<scalar_t>();
    scalar_t* to = out.mutable_data_ptr<scalar_t>();
    const int64_t heads = lse.size(1), rows = lse.size(2);
    for (int64_t b = 0; b < lse.size(0); ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* row = from + b * lse.stride(0) + h * lse.stride(1);
        scalar_t* dst = to + (b * heads + h) * rows;
        for (int64_t i = 0; i < rows; ++i) {
          const scalar_t x = row[i * lse.stride(2)];
          dst[i] = x == std::numeric_limits<scalar_t>::infinity() ? std::numeric_limits<scalar_t>::quiet_NaN() : x;
        }
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor empty_row_aligned_bias_rows(at::IntArrayRef row_sizes, const at::Tensor& query, int64_t len_k) {
  TORCH_INTERNAL_ASSERT(row_sizes.size() == 3, "bias rows are indexed by (B, H, Lq)");
  const int64_t padded = (len_k + kBiasRowAlign - 1) / kBiasRowAlign * kBiasRowAlign;
  return at::empty({row_sizes[0], row_sizes[1], row_sizes[2], padded}, query.options()).narrow(3, 0, len_k);
}

ContractInputs contract_inputs(const at::Tensor& query, const at::Tensor& key, const std::optional<at::Tensor>& mask,
                               bool is_causal, BiasLayout layout) {
  ContractInputs p;
  p.query = query;
  if (!mask.has_value()) {
    p.is_causal = is_causal;
    return p;
  }
  const int64_t len_q = query.size(2), len_k = key.size(2);
  // Worked out on the mask's distinct elements and expanded at the end: an expanded mask stays a view (torch's
  // kernels read the bias through its strides).
  const auto mask_sizes = as_4d(*mask).sizes().vec();
  // A bool mask on the CPU is taken as it is (the CPU kernels convert other dtypes once per call); elsewhere .ne(0)
  // also turns bool bytes other than 0 and 1 into 1 for the device's kernels.
  const auto distinct = distinct_elements(*mask);
  const bool as_is = distinct.scalar_type() == at::kBool && distinct.is_cpu() && query.is_cpu();
  auto visible = as_4d((as_is ? distinct : distinct.ne(0)).to(query.device()));
  if (is_causal) {
    visible = visible.logical_and(at::ones({len_q, len_k}, visible.options()).tril());
  }
  const auto dead = visible.any(-1, /*keepdim=*/true).logical_not();
  // A row with no visible key is uniform over all keys: its bias row is opened and its query row zeroed, so all
  // its scores are 0. On the host (kBroadcast, the CPU) such rows are rare and cheap to look for; on a device the
  // look would wait for it, so the rows are opened and zeroed by the mask alone.
  if (layout == BiasLayout::kRowAligned || dead.any().item<bool>()) {
    visible = visible.logical_or(dead);
    p.query = query.masked_fill(dead, 0);
    p.dead_rows = dead;
  }
  if (layout == BiasLayout::kRowAligned) {
    // One row of len_k values per distinct mask row, expanded to the score shape.
    auto rows = empty_row_aligned_bias_rows(visible.sizes().slice(0, 3), query, len_k);
    rows.copy_(zero_or_minus_inf(visible, query.options()).expand(rows.sizes()));
    p.bias = rows.expand({query.size(0), query.size(1), len_q, len_k});
  } else {
    p.bias = zero_or_minus_inf(visible, query.options()).expand(at::infer_size(mask_sizes, visible.sizes()));
  }
  return p;
}

// The saved log-sum-exp is the op's, whichever kernel ran: that of the masked (-1e9) scaled scores. It differs
// from the stock kernel's own only in the rows with no visible key (-1e9 + log Lk there, log Lk for the
// stock kernel with the row's query zeroed), so a backward can take the forward of either kernel. And in the rows
// with a +inf score, whose weights are all NaN in the math (inf - inf): the stock kernels report +inf there, the op
// NaN, so that a backward recomputing P = exp(S - lse) gets NaN across the row, not only at that key.
at::Tensor to_contract_lse(const at::Tensor& stock_lse, const ContractInputs& inputs, int64_t len_k) {
  if (stock_lse.is_cpu() && stock_lse.dim() == 3 && !inputs.dead_rows.defined()) {
    return contiguous_without_inf(stock_lse);
  }
  const at::Tensor lse = stock_lse.masked_fill(stock_lse == std::numeric_limits<double>::infinity(),
                                               std::numeric_limits<double>::quiet_NaN());
  if (!inputs.dead_rows.defined()) {
    return lse;
  }
  return lse.masked_fill(dead_rows_of_lse(inputs), kMaskedScore + std::log(static_cast<double>(len_k)));
}

at::Tensor to_stock_lse(const at::Tensor& lse, const ContractInputs& inputs, int64_t len_k) {
  if (!inputs.dead_rows.defined()) {
    return lse;
  }
  return lse.masked_fill(dead_rows_of_lse(inputs), std::log(static_cast<double>(len_k)));
}

at::Tensor to_contract_grad_query(const at::Tensor& grad_query, const ContractInputs& inputs) {
  return inputs.dead_rows.defined() ? grad_query.masked_fill(inputs.dead_rows, 0) : grad_query;
}

}  // namespace fastmha::stock
