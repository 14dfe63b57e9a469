#include "ops/projection_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/float_bits.h"
#include "ops/heads.h"
#include "ops/readable_on_cpu.h"
#include "ops/widened_products.h"

namespace fastmha {
namespace {

// Rows are scanned in steps of kScanStep elements through their bits (float_bits.h): a step's OR or maximum
// vectorizes, where an element-wise early exit did not (a bfloat16 scan of the textbook model's 2800 x 512 gradient
// rows, 93% of them zero, and their input rows took about 7 ms a projection); a row still ends its scan at the
// first step that decides it.
constexpr int64_t kScanStep = 64;

// Folds the magnitudes of row[j * stride], j < n, a step at a time (`fold` from 0 over each step's elements) and
// returns at the first step whose result `stops`: whether one did.
template <typename T, typename Fold, typename Stops>
bool some_step(const T* row, int64_t stride, int64_t n, Fold fold, Stops stops) {
  for (int64_t j0 = 0; j0 < n; j0 += kScanStep) {
    const int64_t end = std::min(n, j0 + kScanStep);
    typename FloatBits<T>::type folded = 0;
    if (stride == 1) {
      for (int64_t j = j0; j < end; ++j) folded = fold(folded, magnitude_bits(row[j]));
    } else {
      for (int64_t j = j0; j < end; ++j) folded = fold(folded, magnitude_bits(row[j * stride]));
    }
    if (stops(folded)) return true;
  }
  return false;
}

// Whether row[j * stride], j < n, are all zero (of either sign; a tiny denormal is not).
template <typename T>
bool all_zero(const T* row, int64_t stride, int64_t n) {
  using B = typename FloatBits<T>::type;
  return !some_step(
      row, stride, n, [](B a, B m) -> B { return a | m; }, [](B a) { return a != 0; });
}

// Whether row[j * stride], j < n, are all finite.
template <typename T>
bool all_finite(const T* row, int64_t stride, int64_t n) {
  using B = typename FloatBits<T>::type;
  return !some_step(
      row, stride, n, [](B a, B m) { return std::max(a, m); }, [](B a) { return a >= FloatBits<T>::kInfinity; });
}

// The rows r of g (n x d_out) whose products must run: g's row is not all zero, or x's row (n x d_in) is not all
// finite. A nonzero row usually ends its scan at its first step, so dense gradients cost a step (64 elements) per
// row.
template <typename T>
std::vector<int64_t> rows_to_compute(const at::Tensor& g, const at::Tensor& x) {
  const int64_t n = g.size(0), d_out = g.size(1), d_in = x.size(1);
  const T* g_data = g.const_data_ptr<T>();
  const T* x_data = x.const_data_ptr<T>();
  const int64_t g_row = g.stride(0), g_col = g.stride(1), x_row = x.stride(0), x_col = x.stride(1);
  std::vector<char> needed(n);
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      needed[r] = !(all_zero(g_data + r * g_row, g_col, d_out) && all_finite(x_data + r * x_row, x_col, d_in));
    }
  });
  std::vector<int64_t> indices;
  for (int64_t r = 0; r < n; ++r) {
    if (needed[r]) indices.push_back(r);
  }
  return indices;
}

// (g W, g^T x) for rows g (n x d_out) and x (n x d_in), x's rows from `x_rows()`, asked for after the first product
// (its temporaries gone) so that no copy outlives its product; with `widen`, g widened once for both.
template <typename XRows>
std::pair<at::Tensor, at::Tensor> row_products(const at::Tensor& g, XRows x_rows, const at::Tensor& weight,
                                               bool widen) {
  if (!widen) {
    at::Tensor grad_x = at::matmul(g, weight);
    return {grad_x, at::matmul(g.t(), x_rows())};
  }
  const auto dtype = g.scalar_type();
  const at::Tensor wide_g = g.to(at::kFloat);
  at::Tensor grad_x = at::matmul(wide_g, weight.to(at::kFloat)).to(dtype);
  at::Tensor grad_w = at::matmul(wide_g.t(), x_rows().to(at::kFloat)).to(dtype);
  return {grad_x, grad_w};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> projection_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                      const at::Tensor& weight, WidenedInputs& inputs) {
  const at::Tensor g = flatten_rows(grad_y), x_rows = flatten_rows(x);
  const bool widen = widens_product_of(g, x) && widens_product_of(g, weight);
  auto whole_products = [&]() -> std::pair<at::Tensor, at::Tensor> {
    auto [grad_x, grad_w] = row_products(
        g, [&] { return widen ? flatten_rows(inputs.get(x)) : x_rows; }, weight, widen);
    return {grad_x.view_symint(x.sym_sizes()), grad_w};
  };
  if (!readable_on_cpu(g) || !readable_on_cpu(x_rows) || !readable_on_cpu(weight) ||
      g.scalar_type() != x_rows.scalar_type()) {
    return whole_products();
  }
  std::vector<int64_t> needed;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "projection_backward",
                                  [&] { needed = rows_to_compute<scalar_t>(g, x_rows); });
  const int64_t n = g.size(0);
  // Gathering the rows costs a pass over them; with few zero rows the whole products are faster. A zero row of
  // dy times an infinite or NaN weight is NaN in the math: the whole product gives it.
  if (static_cast<int64_t>(needed.size()) * 4 > n * 3 || !at::isfinite(weight).all().item<bool>()) {
    return whole_products();
  }
  const at::Tensor index = at::tensor(needed, at::TensorOptions().dtype(at::kLong));
  const at::Tensor g_needed = g.index_select(0, index);
  at::Tensor grad_x = at::zeros({n, weight.size(1)}, x.options());
  auto [grad_x_needed, grad_w] = row_products(
      g_needed, [&] { return x_rows.index_select(0, index); }, weight, widen);
  grad_x.index_copy_(0, index, grad_x_needed);
  return {grad_x.view(x.sizes()), grad_w};
}

std::pair<at::Tensor, at::Tensor> projection_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                      const at::Tensor& weight) {
  WidenedInputs no_shared_inputs({});
  return projection_backward(grad_y, x, weight, no_shared_inputs);
}

}  // namespace fastmha
