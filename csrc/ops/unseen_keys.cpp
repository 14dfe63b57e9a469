#include "ops/unseen_keys.h"

#include <ATen/Dispatch.h>

#include <cmath>
#include <limits>
#include <vector>

#include "ops/heads.h"
#include "ops/masked_score.h"
#include "ops/readable_on_cpu.h"
#include "ops/widened_products.h"

namespace fastmha {

std::optional<KeyRows> split_key_rows(const std::optional<at::Tensor>& mask, const at::Tensor& key,
                                      const at::Tensor& value, bool is_causal) {
  if (!mask.has_value() || is_causal || !readable_on_cpu(*mask) || !readable_on_cpu(key) || !readable_on_cpu(value)) {
    return std::nullopt;
  }
  const at::Tensor& m = *mask;
  const int64_t batch = key.size(0), len_k = key.size(1);
  if (m.dim() == 0 || m.size(-1) == 1 || batch * len_k == 0) {
    return std::nullopt;
  }
  std::vector<int64_t> sizes(4 - m.dim(), 1);
  sizes.insert(sizes.end(), m.sizes().begin(), m.sizes().end());
  // As the kernels read masks: nonzero (NaN too) attends. The block passes it as bool already.
  const at::Tensor visible = (m.scalar_type() == at::kBool ? m : m.ne(0)).view(sizes);
  // A query row that sees no key spreads its weight over all keys (the -1e9 rule): all keys of its batch
  // element count as seen.
  const at::Tensor blind = visible.any(3).logical_not().flatten(1).any(1);
  // (1 or batch, Lk): whether any head's query sees the key.
  const at::Tensor seen = visible.any(2).any(1).logical_or(blind.unsqueeze(1)).expand({batch, len_k}).reshape(-1);
  at::Tensor rows = at::nonzero(seen).squeeze(1);
  if (rows.size(0) * 4 > batch * len_k * 3) {
    return std::nullopt;
  }
  return KeyRows{rows, at::nonzero(seen.logical_not()).squeeze(1)};
}

void project_rows_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rows) {
  out.view({-1, weight.size(0)}).index_copy_(0, rows, widened_linear(flatten_rows(x).index_select(0, rows), weight));
}

at::Tensor project_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rows) {
  at::Tensor out = at::zeros({x.size(0), x.size(1), weight.size(0)}, x.options());
  project_rows_into(out, x, weight, rows);
  return out;
}

bool projection_surely_finite(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rows) {
  if (rows.numel() == 0) {
    return true;
  }
  double largest = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "projection_surely_finite",
                                  [&] { largest = static_cast<double>(std::numeric_limits<scalar_t>::max()); });
  const double x_max = flatten_rows(x).index_select(0, rows).abs().amax().item<double>();
  // The row sums in the weight's dtype (half types accumulate in float; a sum in double converted the whole weight
  // first, 70-150 us for 512 x 512): rounded by at most 2^-8 of themselves, well inside the factor of 2 below, and a
  // half-type sum that overflows is infinite, which only declines.
  const double w_row_sum = at::sum(weight.abs(), {1}).amax().item<double>();
  return x_max * w_row_sum < largest / 2;  // false for NaN and infinity
}

bool unseen_keys_weigh_zero(const at::Tensor& logsumexp, int64_t len_k) {
  if (logsumexp.numel() == 0) {
    return true;
  }
  // exp underflows to exactly 0 below about -104 in float (the kernels' accumulation type for every dtype but
  // double) and -745 in double.
  const double underflow = logsumexp.scalar_type() == at::kDouble ? 750.0 : 110.0;
  const double least = logsumexp.min().item<double>();
  return least > kMaskedScore + std::log(static_cast<double>(len_k)) + underflow;
}

}  // namespace fastmha
