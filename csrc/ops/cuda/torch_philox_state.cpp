#include "ops/cuda/torch_philox_state.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>

namespace fastmha {
namespace {

constexpr int64_t kTorchDrawTag = 1;  // in the offset: see the header

bool capturing() { return at::cuda::currentStreamCaptureStatus() != at::cuda::CaptureStatus::None; }

// torch's backward reads the draw through int64 pointers; where only the tag is read any integer type serves (the
// backward ops themselves take int64 alone).
void check_rng_state(const at::Tensor& rng_state, bool int64_only) {
  TORCH_CHECK(rng_state.numel() == 2 && (!int64_only || rng_state.scalar_type() == at::kLong),
              "fastmha: rng_state must hold 2 int64 values (seed, offset), got ", rng_state.sizes(), " ",
              rng_state.scalar_type());
}

// (seed, offset) on the host: waits for the work queued before it on the stream.
at::Tensor on_host(const at::Tensor& rng_state) { return rng_state.to(at::kCPU, at::kLong).contiguous().reshape({-1}); }

}  // namespace

at::Tensor rng_state_of(const stock::TorchPhilox& drawn, const at::Device& device) {
  if (drawn.seed.is_cuda()) {
    return at::cat({drawn.seed.reshape({1}), drawn.offset.reshape({1}).bitwise_or(kTorchDrawTag)}).to(at::kLong);
  }
  auto host = at::empty({2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* state = host.data_ptr<int64_t>();
  state[0] = drawn.seed.item<int64_t>();
  state[1] = drawn.offset.item<int64_t>() | kTorchDrawTag;
  return host.to(device, /*non_blocking=*/true);
}

stock::TorchPhilox torch_philox_of(const at::Tensor& rng_state, const at::Tensor& host_state) {
  check_rng_state(rng_state, /*int64_only=*/true);
  if (capturing()) {
    TORCH_CHECK(rng_state.is_cuda(), "fastmha: a captured backward needs its rng_state on the GPU");
    const auto state = rng_state.contiguous().reshape({-1});
    return {state.select(0, 0), state.select(0, 1).bitwise_and(~kTorchDrawTag)};
  }
  const auto host = host_state.defined() ? host_state : on_host(rng_state);
  return {host.select(0, 0), host.select(0, 1).bitwise_and(~kTorchDrawTag)};
}

DropoutDraw dropout_draw_of(const at::Tensor& rng_state, at::Tensor* host_state) {
  check_rng_state(rng_state, /*int64_only=*/false);
  if (capturing()) {
    return DropoutDraw::kUnknown;
  }
  const auto host = on_host(rng_state);
  if (host_state != nullptr) {
    *host_state = host;
  }
  return (host.data_ptr<int64_t>()[1] & kTorchDrawTag) != 0 ? DropoutDraw::kTorch : DropoutDraw::kFastmha;
}

}  // namespace fastmha
