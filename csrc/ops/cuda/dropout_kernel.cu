// CUDA dropout randomness. The (seed, offset) come from ATen's default CUDA generator as a PhiloxCudaState,
// unpacked on the device so the launch is safe under CUDA graph capture, into an int64[2] rng_state that the
// fused kernels and the backward read. Multipliers for the ATen path are regenerated from it.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/cuda/PhiloxUtils.cuh>

#include <mutex>

#include "ops/dropout.h"
#include "ops/philox.h"

namespace fastmha {
namespace {

constexpr int kThreads = 256;

// Unpacks the generator's state on the device (a graph replay sees the offset of its own run) and records it.
__global__ void record_rng_state_kernel(at::PhiloxCudaState philox_state, int64_t* rng_state) {
  const auto [seed, offset] = at::cuda::philox::unpack(philox_state);
  rng_state[0] = static_cast<int64_t>(seed);
  rng_state[1] = static_cast<int64_t>(offset);
}

template <typename scalar_t>
__global__ void replay_multipliers_kernel(scalar_t* out, int64_t n, float p, scalar_t scale, const int64_t* rng_state) {
  const auto seed = static_cast<uint64_t>(rng_state[0]);
  const auto offset = static_cast<uint64_t>(rng_state[1]);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = philox::keep_scale<scalar_t>(seed, offset, static_cast<uint64_t>(i), p, scale);
  }
}

unsigned int grid_for(int64_t n) {
  const int64_t max_blocks = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, max_blocks)));
}

at::Tensor replay(at::IntArrayRef sizes, double p, const at::TensorOptions& options, const at::Tensor& rng_state) {
  c10::cuda::CUDAGuard guard(options.device());
  auto out = at::empty(sizes, options);
  auto state = rng_state.to(options.device(), at::kLong).contiguous();
  const int64_t n = out.numel();
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "fastmha_cuda_dropout_replay", [&] {
    replay_multipliers_kernel<scalar_t><<<grid_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        out.data_ptr<scalar_t>(), n, static_cast<float>(p), static_cast<scalar_t>(1.0 / (1.0 - p)),
        state.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> draw(at::IntArrayRef sizes, double p, const at::TensorOptions& options) {
  auto rng_state = draw_cuda_rng_state(options.device());
  return {replay(sizes, p, options, rng_state), rng_state};
}

}  // namespace

at::Tensor draw_cuda_rng_state(const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  auto rng_state = at::empty({2}, at::TensorOptions().device(device).dtype(at::kLong));
  at::PhiloxCudaState philox_state;
  {
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(device.index()));
    std::lock_guard<std::mutex> lock(gen->mutex_);
    // Each element uses its own counter under one offset; the offset only has to move past this call.
    philox_state = gen->philox_cuda_state(4);
  }
  record_rng_state_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(philox_state, rng_state.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return rng_state;
}

DropoutKernels cuda_dropout_kernels() { return {&draw, &replay}; }

}  // namespace fastmha
