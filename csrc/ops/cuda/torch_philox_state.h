// torch's dropout draw (stock::TorchPhilox) kept in the op's rng_state, int64[2] (seed, offset) on the query's
// device, between a forward and its backward that FASTMHA_CUDA_DROPOUT=sdpa runs on SDPA's memory-efficient kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/stock/stock_attention.h"

namespace fastmha {

// The forward's draw as the op's rng_state: copied from pinned memory without waiting for the GPU, or, drawn
// while a CUDA graph is captured (device tensors the kernel writes at replay), copied on the device.
at::Tensor rng_state_of(const stock::TorchPhilox& drawn, const at::Device& device);

// The draw for torch's backward, which reads it on the host (this copy waits for the forward's work on the stream)
// or, while a graph is captured, from the device.
stock::TorchPhilox torch_philox_of(const at::Tensor& rng_state);

}  // namespace fastmha
