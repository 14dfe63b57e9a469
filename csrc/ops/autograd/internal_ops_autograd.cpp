// The internal forward/backward ops have no derivatives of their own (the public ops' Autograd kernels
// differentiate them). Registering torch's "not implemented" autograd kernel makes any attempt to
// differentiate through them fail loudly ("derivative for fastmha::_attention_backward is not implemented"),
// so a double backward (create_graph=True, then grad of grad) raises instead of silently returning zeros.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

namespace fastmha {

TORCH_LIBRARY_IMPL(fastmha, Autograd, m) {
  for (const char* op : {"_attention_forward", "_attention_backward", "_multi_head_attention_forward",
                         "_multi_head_attention_backward"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}

}  // namespace fastmha
