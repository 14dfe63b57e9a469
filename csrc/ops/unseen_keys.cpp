#include "ops/unseen_keys.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "ops/broadcast_mask.h"
#include "ops/float_bits.h"
#include "ops/heads.h"
#include "ops/masked_score.h"
#include "ops/readable_on_cpu.h"
#include "ops/widened_products.h"

namespace fastmha {

namespace {

// Ors a mask row (nonzero attends) into `seen`; whether the row sees some key.
bool or_row(const uint8_t* __restrict row, int64_t stride, int64_t len_k, uint8_t* __restrict seen) {
  uint8_t any = 0;
  if (stride == 1) {
    for (int64_t j = 0; j < len_k; ++j) {
      const uint8_t attends = row[j] != 0;
      seen[j] |= attends;
      any |= attends;
    }
  } else {
    for (int64_t j = 0; j < len_k; ++j) {
      const uint8_t attends = row[j * stride] != 0;
      seen[j] |= attends;
      any |= attends;
    }
  }
  return any != 0;
}

// For each of the mask's batch entries (1 or batch): whether some query row of some head sees each key, or all keys
// where a row sees none (the -1e9 rule spreads its weight over every key). One pass over a bool mask's distinct
// elements (B', H', Lq', Lk), rows of unit stride vectorized: the ATen ops for the same (ne, any, logical_not,
// logical_or, nonzero, about a dozen calls) cost more than the small projections they save in a decoding step.
std::vector<std::vector<uint8_t>> seen_keys(const at::Tensor& visible, int64_t len_k) {
  TORCH_INTERNAL_ASSERT(visible.size(3) == len_k, "seen_keys: a mask of ", visible.size(3), " keys for ", len_k);
  const auto* data = reinterpret_cast<const uint8_t*>(visible.const_data_ptr<bool>());
  std::vector<std::vector<uint8_t>> seen(static_cast<size_t>(visible.size(0)));
  for (int64_t b = 0; b < visible.size(0); ++b) {
    auto& keys = seen[static_cast<size_t>(b)];
    keys.assign(static_cast<size_t>(len_k), 0);
    bool blind = false;
    for (int64_t h = 0; h < visible.size(1) && !blind; ++h) {
      for (int64_t i = 0; i < visible.size(2) && !blind; ++i) {
        const uint8_t* row = data + b * visible.stride(0) + h * visible.stride(1) + i * visible.stride(2);
        blind = !or_row(row, visible.stride(3), len_k, keys.data());
      }
    }
    if (blind) {
      keys.assign(static_cast<size_t>(len_k), 1);
    }
  }
  return seen;
}

}  // namespace

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
  const at::Tensor visible = distinct_elements((m.scalar_type() == at::kBool ? m : m.ne(0)).view(sizes));
  if (visible.size(3) != len_k) {
    return std::nullopt;  // the same value at every key (an expanded key dimension): each row sees all or none
  }
  const auto seen = seen_keys(visible, len_k);
  TORCH_INTERNAL_ASSERT(seen.size() == 1 || static_cast<int64_t>(seen.size()) == batch,
                        "split_key_rows: a mask batch of ", seen.size(), " for ", batch, " keys' batch entries");
  std::vector<int64_t> seen_rows, unseen_rows;
  seen_rows.reserve(static_cast<size_t>(batch * len_k));
  for (int64_t b = 0; b < batch; ++b) {
    const auto& keys = seen[seen.size() == 1 ? 0 : static_cast<size_t>(b)];
    for (int64_t j = 0; j < len_k; ++j) {
      (keys[static_cast<size_t>(j)] != 0 ? seen_rows : unseen_rows).push_back(b * len_k + j);
    }
  }
  if (static_cast<int64_t>(seen_rows.size()) * 4 > batch * len_k * 3) {
    return std::nullopt;
  }
  const auto as_tensor = [](const std::vector<int64_t>& rows) {
    return at::tensor(at::ArrayRef<int64_t>(rows), at::TensorOptions().dtype(at::kLong));
  };
  return KeyRows{as_tensor(seen_rows), as_tensor(unseen_rows)};
}

void project_rows_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rows) {
  out.view({-1, weight.size(0)})
      .index_copy_(0, rows, widened_linear_of_varying_rows(flatten_rows(x).index_select(0, rows), weight));
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
  // Signed lanes: magnitudes leave the top bit clear, and the baseline ISA (SSE2) has a signed 16-bit max
  // (bfloat16, float16) but no unsigned one.
  using S = std::make_signed_t<typename FloatBits<T>::type>;
  const auto magnitude = [](T v) { return static_cast<S>(magnitude_bits(v)); };
  S lane[kLanes] = {};
  for (int64_t i = 0; i < count; ++i) {
    const T* row = x + rows[i] * row_stride;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        lane[l] = std::max(lane[l], magnitude(row[j + l]));
      }
    }
    for (; j < n; ++j) {
      lane[0] = std::max(lane[0], magnitude(row[j]));
    }
  }
  const auto largest = static_cast<typename FloatBits<T>::type>(*std::max_element(lane, lane + kLanes));
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

// Rows of unit stride, as the passes read them (the block's inputs and weights have them; others are copied).
at::Tensor unit_rows(const at::Tensor& t) { return t.stride(1) == 1 ? t : t.contiguous(); }

// largest_magnitude over the given rows of x (batch, L, d_in), the rows split between the threads.
double largest_magnitude_of_rows(const at::Tensor& x, const at::Tensor& row_index) {
  const at::Tensor x_rows = unit_rows(flatten_rows(x));
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(row_index.numel() == 0 || (row_index.min().item<int64_t>() >= 0 &&
                                                              row_index.max().item<int64_t>() < x_rows.size(0)),
                                   "largest_magnitude_of_rows: row indices out of range");
  const int64_t* rows = row_index.const_data_ptr<int64_t>();
  double largest = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "largest_magnitude_of_rows", [&] {
    const scalar_t* data = x_rows.const_data_ptr<scalar_t>();
    largest = at::parallel_reduce(
        0, row_index.numel(), 64, 0.0,
        [&](int64_t begin, int64_t end, double ident) {
          return std::max(ident, largest_magnitude(data, x_rows.stride(0), x_rows.size(1), rows + begin, end - begin));
        },
        [](double a, double b) { return std::max(a, b); });
  });
  return largest;
}

bool product_surely_finite(double x_max, const at::Tensor& weight) {
  const at::Tensor w = unit_rows(weight);
  bool finite = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "product_surely_finite", [&] {
    const double w_row_sum = largest_row_sum(w.const_data_ptr<scalar_t>(), w.size(0), w.stride(0), w.size(1));
    const double largest = static_cast<double>(std::numeric_limits<scalar_t>::max());
    finite = x_max * w_row_sum < largest / 2;  // false for infinity
  });
  return finite;
}

}  // namespace

bool projections_surely_finite(const at::Tensor& key, const at::Tensor& w_k, const at::Tensor& value,
                               const at::Tensor& w_v, const at::Tensor& rows) {
  if (rows.numel() == 0) {
    return true;
  }
  if (w_k.scalar_type() != key.scalar_type() || w_v.scalar_type() != value.scalar_type()) {
    return false;  // not a call the block makes: no bound, every row is projected
  }
  const at::Tensor row_index = rows.to(at::kLong).contiguous();
  const double key_max = largest_magnitude_of_rows(key, row_index);
  if (!product_surely_finite(key_max, w_k)) {
    return false;
  }
  // Self-attention's and cross-attention's key and value are one tensor: its rows are read once.
  const double value_max = value.is_same(key) ? key_max : largest_magnitude_of_rows(value, row_index);
  return product_surely_finite(value_max, w_v);
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
