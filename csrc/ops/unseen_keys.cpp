#include "ops/unseen_keys.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "ops/float_bits.h"
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

namespace {

// The bounds below run on every call of a block with unseen keys, in one pass each without temporaries: ATen's
// abs, index_select and a row sum made copies of x and W (about 230 us a call of a 512-wide bfloat16 block, more
// than its two skipped products save under autocast on AMX tiles). Magnitudes are compared through their bits
// (float_bits.h).

constexpr int64_t kLanes = 16;  // independent partial results the compiler keeps in vector registers

// The largest |x| over rows `rows` of the unit-stride rows x[r * row_stride + j], j < n; infinity if one is NaN or
// infinite.
template <typename T>
double largest_magnitude(const T* x, int64_t row_stride, int64_t n, const int64_t* rows, int64_t count) {
  using B = typename FloatBits<T>::type;
  B lane[kLanes] = {};
  for (int64_t i = 0; i < count; ++i) {
    const T* row = x + rows[i] * row_stride;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        lane[l] = std::max(lane[l], magnitude_bits(row[j + l]));
      }
    }
    for (; j < n; ++j) {
      lane[0] = std::max(lane[0], magnitude_bits(row[j]));
    }
  }
  const B largest = *std::max_element(lane, lane + kLanes);
  return largest >= FloatBits<T>::kInfinity ? std::numeric_limits<double>::infinity()
                                            : static_cast<double>(from_bits<T>(largest));
}

// The largest row sum of |w| over the unit-stride rows w[r * row_stride + j], j < n, accumulated in float (double
// for double): rounded by far less than the factor of 2 it is used with. NaN or infinity: infinity.
template <typename T>
double largest_row_sum(const T* w, int64_t rows, int64_t row_stride, int64_t n) {
  using Acc = at::opmath_type<T>;
  double largest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = w + r * row_stride;
    Acc lane[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        lane[l] += std::abs(static_cast<Acc>(row[j + l]));
      }
    }
    for (; j < n; ++j) {
      lane[0] += std::abs(static_cast<Acc>(row[j]));
    }
    const double sum = std::accumulate(lane, lane + kLanes, 0.0);
    if (!(sum <= std::numeric_limits<double>::max())) {
      return std::numeric_limits<double>::infinity();
    }
    largest = std::max(largest, sum);
  }
  return largest;
}

}  // namespace

bool projection_surely_finite(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rows) {
  if (rows.numel() == 0) {
    return true;
  }
  if (weight.scalar_type() != x.scalar_type()) {
    return false;  // not a call the block makes: no bound, every row is projected
  }
  // Rows of unit stride, as the passes read them (the block's inputs and weights have them; others are copied).
  const auto unit_rows = [](const at::Tensor& t) { return t.stride(1) == 1 ? t : t.contiguous(); };
  const at::Tensor x_rows = unit_rows(flatten_rows(x)), w = unit_rows(weight);
  const at::Tensor row_index = rows.to(at::kLong).contiguous();
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(row_index.numel() == 0 || (row_index.min().item<int64_t>() >= 0 &&
                                                              row_index.max().item<int64_t>() < x_rows.size(0)),
                                   "projection_surely_finite: row indices out of range");
  bool finite = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "projection_surely_finite", [&] {
    const double x_max = largest_magnitude(x_rows.const_data_ptr<scalar_t>(), x_rows.stride(0), x_rows.size(1),
                                           row_index.const_data_ptr<int64_t>(), row_index.numel());
    const double w_row_sum = largest_row_sum(w.const_data_ptr<scalar_t>(), w.size(0), w.stride(0), w.size(1));
    const double largest = static_cast<double>(std::numeric_limits<scalar_t>::max());
    finite = x_max * w_row_sum < largest / 2;  // false for infinity
  });
  return finite;
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
