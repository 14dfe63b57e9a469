// In a build without the CUDA kernels, CUDA tensors get one clear sentence instead of the dispatcher's list
// of every backend the op lacks.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fastmha {
namespace {

void built_without_cuda(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  TORCH_CHECK(false, "fastmha was built without CUDA kernels, so ", op.schema().name(),
              " cannot run on a CUDA tensor. Rebuild it where the CUDA toolkit (nvcc) is installed: "
              "pip install --no-build-isolation --force-reinstall fastmha (or .) from source");
}

}  // namespace

TORCH_LIBRARY_IMPL(fastmha, CUDA, m) {
  for (const char* op : {"_attention_forward", "_attention_backward"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&built_without_cuda>());
  }
}

}  // namespace fastmha
