// CPU dropout multipliers from Philox, one counter per element, computed in parallel.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <mutex>

#include "ops/dropout.h"
#include "ops/philox.h"

namespace fastmha {
namespace {

constexpr int64_t kGrain = 16384;

at::Tensor fill_multipliers(at::IntArrayRef sizes, double p, const at::TensorOptions& options, uint64_t seed,
                            uint64_t offset) {
  auto out = at::empty(sizes, options);
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "fastmha_cpu_dropout", [&] {
    scalar_t* data = out.data_ptr<scalar_t>();
    const auto scale = static_cast<scalar_t>(1.0 / (1.0 - p));
    const auto p_float = static_cast<float>(p);
    at::parallel_for(0, out.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        data[i] = philox::keep_scale<scalar_t>(seed, offset, static_cast<uint64_t>(i), p_float, scale);
      }
    });
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> draw(at::IntArrayRef sizes, double p, const at::TensorOptions& options) {
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    seed = gen->random64();
  }
  const uint64_t offset = 0;
  auto rng_state = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  rng_state.data_ptr<int64_t>()[0] = static_cast<int64_t>(seed);
  rng_state.data_ptr<int64_t>()[1] = static_cast<int64_t>(offset);
  return {fill_multipliers(sizes, p, options, seed, offset), rng_state};
}

at::Tensor replay(at::IntArrayRef sizes, double p, const at::TensorOptions& options, const at::Tensor& rng_state) {
  auto state = rng_state.to(at::kCPU).contiguous();
  const int64_t* values = state.data_ptr<int64_t>();
  return fill_multipliers(sizes, p, options, static_cast<uint64_t>(values[0]), static_cast<uint64_t>(values[1]));
}

}  // namespace

DropoutKernels cpu_dropout_kernels() { return {&draw, &replay}; }

}  // namespace fastmha
