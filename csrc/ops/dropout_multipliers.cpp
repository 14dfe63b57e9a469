// The dropout multipliers of a call, again, from its rng_state: the same numbers as the CPU kernels' fused row
// pass and the CUDA kernels draw (ops/philox.h), as a tensor.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "ops/dropout.h"
#include "ops/philox.h"

namespace fastmha {
namespace {

at::Tensor cpu_dropout_multipliers(at::IntArrayRef sizes, double p, const at::TensorOptions& options,
                                   const at::Tensor& rng_state) {
  auto multipliers = at::empty(sizes, options);
  const auto state = rng_state.to(at::kCPU, at::kLong).contiguous();
  const auto seed = static_cast<uint64_t>(state.const_data_ptr<int64_t>()[0]);
  const auto offset = static_cast<uint64_t>(state.const_data_ptr<int64_t>()[1]);
  AT_DISPATCH_FLOATING_TYPES(multipliers.scalar_type(), "fastmha_dropout_multipliers", [&] {
    auto* out = multipliers.data_ptr<scalar_t>();
    const auto scale = static_cast<scalar_t>(1.0 / (1.0 - p));
    at::parallel_for(0, multipliers.numel(), int64_t{1} << 14, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        out[i] = philox::keep_scale<scalar_t>(seed, offset, static_cast<uint64_t>(i), static_cast<float>(p), scale);
      }
    });
  });
  return multipliers;
}

}  // namespace

at::Tensor dropout_multipliers(at::IntArrayRef sizes, double p, const at::TensorOptions& options,
                               const at::Tensor& rng_state) {
#ifdef FASTMHA_WITH_CUDA
  if (options.device().is_cuda()) {
    return cuda_dropout_kernels().replay(sizes, p, options, rng_state);
  }
#endif
  TORCH_CHECK(options.device().is_cpu(), "fastmha: no dropout multipliers for device ", options.device());
  return cpu_dropout_multipliers(sizes, p, options, rng_state);
}

}  // namespace fastmha
