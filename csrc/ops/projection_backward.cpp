#include "ops/projection_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/heads.h"
#include "ops/readable_on_cpu.h"
#include "ops/widened_products.h"

namespace fastmha {
namespace {

// The rows r of g (n x d_out) whose products must run: g's row is not all zero, or x's row (n x d_in) is not all
// finite. A nonzero row usually ends its scan at its first element, so dense gradients cost a read per row.
template <typename T>
std::vector<int64_t> rows_to_compute(const at::Tensor& g, const at::Tensor& x) {
  using Acc = at::opmath_type<T>;  // a zero test at T's own precision (a tiny double is not zero)
  const int64_t n = g.size(0), d_out = g.size(1), d_in = x.size(1);
  const T* g_data = g.const_data_ptr<T>();
  const T* x_data = x.const_data_ptr<T>();
  const int64_t g_row = g.stride(0), g_col = g.stride(1), x_row = x.stride(0), x_col = x.stride(1);
  std::vector<char> needed(n);
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bool zero = true;
      for (int64_t j = 0; j < d_out && zero; ++j) zero = static_cast<Acc>(g_data[r * g_row + j * g_col]) == Acc(0);
      bool finite = true;
      for (int64_t j = 0; j < d_in && zero && finite; ++j) {
        finite = std::isfinite(static_cast<double>(x_data[r * x_row + j * x_col]));
      }
      needed[r] = !(zero && finite);
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
