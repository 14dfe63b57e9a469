#include "ops/cpu/onednn_linear.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>

#include <optional>
#include <vector>

#include "ops/cpu/float_gemm.h"

namespace fastmha::cpu {
namespace {

// torch's oneDNN linear; absent from builds without oneDNN.
const std::optional<c10::OperatorHandle>& linear_op() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  std::vector<c10::IValue> stack{
      x, weight, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  linear_op()->callBoxed(&stack);
  return stack.front().toTensor();
}

// Whether autograd would record a product of t: torch's oneDNN op has no derivative, so such a product (a
// composite op's, the decoding step's, under grad mode or forward-mode AD) takes at::linear.
bool recorded(const at::Tensor& t) {
  return (at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined();
}

// Whether CPU autocast would cast a product here: torch's oneDNN op has no autocast rule, so such a product (a
// composite op's, the decoding step's; the block's op casts its inputs before its kernel) takes at::linear.
bool autocast_on() { return at::autocast::is_autocast_enabled(at::kCPU); }

// Whether float_linear runs x W^T on oneDNN (onednn_linear.h).
bool linear_on_onednn(const at::Tensor& x, const at::Tensor& weight) {
  if (!plain_cpu(x) || !plain_cpu(weight) || x.dim() < 2 || weight.dim() != 2 || x.size(-1) != weight.size(1) ||
      weight.size(0) == 0 || x.size(-1) == 0) {
    return false;
  }
  return linear_op().has_value() && onednn_takes_product(x, weight, x.numel() / x.size(-1));
}

}  // namespace

// Under torch.compile a fake tensor can reach a kernel with plain CPU keys and no data: hence the data check.
bool plain_cpu(const at::Tensor& t) {
  static const c10::DispatchKeySet plain({c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                                          c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU});
  return t.defined() && !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && t.layout() == at::kStrided &&
         plain.isSupersetOf(t.key_set()) && t.has_storage() && t.storage().data() != nullptr;
}

bool onednn_takes_product(const at::Tensor& a, const at::Tensor& b, int64_t rows) {
  if (!plain_cpu(a) || !plain_cpu(b) || recorded(a) || recorded(b) || autocast_on() || a.scalar_type() != at::kFloat ||
      b.scalar_type() != at::kFloat || rows < kFewestOnednnRows) {
    return false;
  }
  return choose_float_products(float_gemm_mode()).on_brgemm;
}

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight) {
  return linear_on_onednn(x, weight) ? onednn_linear(x, weight) : at::linear(x, weight);
}

}  // namespace fastmha::cpu
