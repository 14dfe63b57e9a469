// The internal forward/backward ops have no derivatives of their own (the public ops' Autograd kernels
// differentiate them; with create_graph=True they compute gradients from ATen ops instead, which can be
// differentiated again). Registering torch's "not implemented" autograd kernel makes any attempt to differentiate
// through the internal ops themselves fail loudly ("derivative for fastmha::_attention_backward is not
// implemented") instead of silently returning zeros.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

namespace fastmha {

TORCH_LIBRARY_IMPL(fastmha, Autograd, m) {
  for (const char* op : {"_attention_forward", "_attention_backward", "_multi_head_attention_forward",
                         "_multi_head_attention_backward", "_dropout_multipliers", "_projection"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}

}  // namespace fastmha
