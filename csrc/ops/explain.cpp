// fastmha::_explain: which kernels the forward and the backward of a call of the attention core would run on,
// and why (ops/kernel_choice.h).
// Python wraps it as fastmha.explain(...).
#include <torch/library.h>

#include <string>

#include "ops/checks.h"
#include "ops/kernel_choice.h"

namespace fastmha {
namespace {

std::string explain(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const std::optional<at::Tensor>& mask, double dropout_p, bool need_weights, bool is_causal) {
  check_attention_inputs(query, key, value, mask, dropout_p);
  const AttentionCall call{query, key, value, mask, dropout_p, need_weights, is_causal, Pass::kForward};
  const auto forward = choose_kernel(call);
  // The backward as autograd runs it when the loss does not read the kept weights (the drop-in's case): they carry
  // no gradient then, and they are handed to the backward where they serve it.
  AttentionCall backward_call = call;
  backward_call.pass = Pass::kBackward;
  backward_call.need_weights = false;
  backward_call.weights_at_hand = weights_serve_backward(call);
  const auto backward = choose_kernel(backward_call);
  return "forward " + std::string(kernel_name(forward.kernel)) + ": " + forward.reason + "\nbackward " +
         kernel_name(backward.kernel) + ": " + backward.reason;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastmha, m) {
  m.def(
      "_explain(Tensor query, Tensor key, Tensor value, Tensor? mask=None, float dropout_p=0.0, "
      "bool need_weights=True, bool is_causal=False) -> str",
      &explain);
}

}  // namespace fastmha
