#include "ops/projection_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/cpu/brgemm_matmul.h"
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

// Whether every element of the 2-d `t` is finite, a row at a time (ATen's isfinite(t).all() makes three temporaries
// of t's size).
bool all_rows_finite(const at::Tensor& t) {
  bool finite = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "all_rows_finite", [&] {
    const scalar_t* data = t.const_data_ptr<scalar_t>();
    for (int64_t r = 0; r < t.size(0) && finite; ++r) {
      finite = all_finite(data + r * t.stride(0), t.stride(1), t.size(1));
    }
  });
  return finite;
}

// The rows r whose products must run: a row of some g in `gs` (each n x d_out) is not all zero, or x's row
// (n x d_in) is not all finite. A nonzero row usually ends its scan at its first step, so dense gradients cost a
// step (64 elements) per row.
template <typename T>
std::vector<int64_t> rows_to_compute(const std::vector<at::Tensor>& gs, const at::Tensor& x) {
  const int64_t n = x.size(0), d_in = x.size(1);
  const T* x_data = x.const_data_ptr<T>();
  const int64_t x_row = x.stride(0), x_col = x.stride(1);
  // Each g's pointer and strides read once, not per row inside the loop.
  struct Rows {
    const T* data;
    int64_t row, col, d_out;
  };
  std::vector<Rows> g_rows;
  for (const auto& g : gs) g_rows.push_back({g.const_data_ptr<T>(), g.stride(0), g.stride(1), g.size(1)});
  std::vector<char> needed(n);
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bool zero = std::all_of(g_rows.begin(), g_rows.end(),
                                    [&](const Rows& g) { return all_zero(g.data + r * g.row, g.col, g.d_out); });
      needed[r] = !(zero && all_finite(x_data + r * x_row, x_col, d_in));
    }
  });
  std::vector<int64_t> indices;
  for (int64_t r = 0; r < n; ++r) {
    if (needed[r]) indices.push_back(r);
  }
  return indices;
}

// The 2-d g itself where its rows or its columns are dense, otherwise g made dense: an expanded gradient (a loss such
// as out.sum() hands every row one stride-0 gradient) is copied once for both of its products, as torch's GEMM would
// copy it for each, and dense its products may run on brgemm (brgemm_matmul.h).
at::Tensor dense_rows_or_columns(const at::Tensor& g) {
  if (g.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return g;
  }
  const bool rows = g.stride(1) == 1 && g.stride(0) >= g.size(1);
  const bool columns = g.stride(0) == 1 && g.stride(1) >= g.size(0);
  return rows || columns ? g : g.contiguous();
}

// (sum_i g_i W_i, [g_i^T x]) for rows g_i (n x d_out) and x (n x d_in), x's rows from `x_rows()`, asked for after
// the first product (its temporaries gone) so that no copy outlives the products. Later products add into the
// first's result as they run (no pass of their own); with `widen`, each g_i widened once for both its products
// and the sum kept in fp32 until the end. float32 products run on oneDNN's brgemm where brgemm_matmul.h says.
template <typename XRows>
std::pair<at::Tensor, std::vector<at::Tensor>> row_products(const std::vector<at::Tensor>& gs, XRows x_rows,
                                                            const std::vector<at::Tensor>& weights, bool widen) {
  const auto dtype = gs.front().scalar_type();
  const auto wide = [&](const at::Tensor& t) { return widen ? t.to(at::kFloat) : t; };
  at::Tensor grad_x, rows;
  std::vector<at::Tensor> grad_ws;
  for (size_t i = 0; i < gs.size(); ++i) {
    const at::Tensor g = dense_rows_or_columns(wide(gs[i]));
    if (i == 0) {
      grad_x = cpu::float_matmul(g, wide(weights[i]));
      rows = wide(x_rows());
    } else {
      cpu::float_addmm_(grad_x, g, wide(weights[i]));
    }
    grad_ws.push_back(cpu::float_matmul(g.t(), rows).to(dtype));
  }
  return {grad_x.to(dtype), grad_ws};
}

}  // namespace

std::pair<at::Tensor, std::vector<at::Tensor>> projections_backward(const std::vector<at::Tensor>& grad_ys,
                                                                    const at::Tensor& x,
                                                                    const std::vector<at::Tensor>& weights,
                                                                    WidenedInputs& inputs) {
  TORCH_INTERNAL_ASSERT(!grad_ys.empty() && grad_ys.size() == weights.size());
  std::vector<at::Tensor> gs;
  for (const auto& grad_y : grad_ys) gs.push_back(flatten_rows(grad_y));
  const at::Tensor x_rows = flatten_rows(x);
  bool widen = true, readable = readable_on_cpu(x_rows), finite_weights = true;
  for (size_t i = 0; i < gs.size(); ++i) {
    widen = widen && widens_product_of(gs[i], x) && widens_product_of(gs[i], weights[i]);
    readable = readable && readable_on_cpu(gs[i]) && readable_on_cpu(weights[i]) &&
               gs[i].scalar_type() == x_rows.scalar_type();
  }
  auto whole_products = [&]() -> std::pair<at::Tensor, std::vector<at::Tensor>> {
    auto [grad_x, grad_ws] = row_products(
        gs, [&] { return widen ? flatten_rows(inputs.get(x)) : x_rows; }, weights, widen);
    return {grad_x.view_symint(x.sym_sizes()), grad_ws};
  };
  if (!readable) {
    return whole_products();
  }
  std::vector<int64_t> needed;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_rows.scalar_type(), "projection_backward",
                                  [&] { needed = rows_to_compute<scalar_t>(gs, x_rows); });
  const int64_t n = x_rows.size(0);
  // Gathering the rows costs a pass over them; with few zero rows the whole products are faster.
  if (static_cast<int64_t>(needed.size()) * 4 > n * 3) {
    return whole_products();
  }
  // A zero row of dy times an infinite or NaN weight is NaN in the math: the whole product gives it.
  for (const auto& weight : weights) {
    finite_weights = finite_weights && all_rows_finite(weight);
  }
  if (!finite_weights) {
    return whole_products();
  }
  const at::Tensor index = at::tensor(needed, at::TensorOptions().dtype(at::kLong));
  std::vector<at::Tensor> gs_needed;
  for (const auto& g : gs) gs_needed.push_back(g.index_select(0, index));
  at::Tensor grad_x = at::zeros({n, weights.front().size(1)}, x.options());
  auto [grad_x_needed, grad_ws] = row_products(
      gs_needed, [&] { return x_rows.index_select(0, index); }, weights, widen);
  grad_x.index_copy_(0, index, grad_x_needed);
  return {grad_x.view(x.sizes()), grad_ws};
}

std::pair<at::Tensor, at::Tensor> projection_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                      const at::Tensor& weight, WidenedInputs& inputs) {
  auto [grad_x, grad_ws] = projections_backward({grad_y}, x, {weight}, inputs);
  return {grad_x, grad_ws.front()};
}

std::pair<at::Tensor, at::Tensor> projection_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                      const at::Tensor& weight) {
  WidenedInputs no_shared_inputs({});
  return projection_backward(grad_y, x, weight, no_shared_inputs);
}

}  // namespace fastmha
