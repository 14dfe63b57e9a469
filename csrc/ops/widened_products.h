// The block's projection products in bfloat16/float16 on a CPU without native products for that type.
//
// There torch's half-type GEMMs run several times slower than fp32 sgemm (a bfloat16 (4096 x 512) x (512 x 512)
// product: 146 ms, against 33 ms widened to fp32 and rounded back, on Zen 3), so the operands are widened to
// fp32, multiplied, and the product rounded once: fp32 accumulation, as torch's own half-type GEMMs accumulate.
// Forward products of a few rows stay torch's (kFewestWidenedRows). Elsewhere (other dtypes, other devices, CPUs with
// AVX512-BF16, AMX or AVX512-FP16, and float16 under float32 matmul precision "medium") these are torch's ops.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace fastmha {

// Whether products of `dtype` on `device` are widened to fp32 (see above).
bool widens_products(at::ScalarType dtype, const at::Device& device);

// A product x W^T of fewer rows of x stays torch's in the half type: widening passes over the whole weight, the
// product only rows x its size (the decoding step's one token). On Zen 3 (512 x 512 bfloat16 weights) torch's
// product took 44 us for one row against 91 us widened, 151 against 164 for four, 233 against 141 for six.
constexpr int64_t kFewestWidenedRows = 6;

// Whether a forward product x W^T of `rows` rows of x is widened: widens_products, from kFewestWidenedRows rows on.
bool widens_products(at::ScalarType dtype, const at::Device& device, const c10::SymInt& rows);

// Whether a product of a and b is widened, whatever its rows: both of one type whose products widens_products widens
// on a's device.
bool widens_product_of(const at::Tensor& a, const at::Tensor& b);

// The fp32 copies of one call's inputs, each made once. Widening reads and writes the whole tensor (about 2 ms
// for (4, 1024, 512) on Zen 3), and self-attention passes one tensor as query, key and value, which the forward
// and the backward each multiply by three weights.
class WidenedInputs {
 public:
  // `inputs` are the tensors the call will widen: one passed more than once keeps its copy for the object's life,
  // any other is widened on each request (no copy outlives its product).
  explicit WidenedInputs(const std::vector<at::Tensor>& inputs);
  // `t` as widened products take it: its fp32 copy where widens_products says so, otherwise `t`.
  at::Tensor get(const at::Tensor& t);

 private:
  std::vector<at::Tensor> repeated_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;  // (input, its fp32 copy)
};

// x W^T, as at::linear; widened from kFewestWidenedRows rows of x on.
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight);
// The same with x's copy from `inputs`.
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight, WidenedInputs& inputs);
// x W^T for a row count that changes from call to call (the keys of a padded batch that some query sees): as
// widened_linear, but never on oneDNN, which would compile a kernel for each new count (cpu/onednn_linear.h).
at::Tensor widened_linear_of_varying_rows(const at::Tensor& x, const at::Tensor& weight);

}  // namespace fastmha
