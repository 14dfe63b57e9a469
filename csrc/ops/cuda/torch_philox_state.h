// torch's dropout draw (stock::TorchPhilox) kept in the op's rng_state, int64[2] (seed, offset) on the query's
// device, between a forward and its backward that FASTMHA_CUDA_DROPOUT=sdpa runs on SDPA's memory-efficient kernel.
// The offset carries a tag in bit 0, which fastmha's own draws never set (torch's generator hands out offsets in
// multiples of 4, and the CPU's are 0), so that a backward can tell whose stream to replay.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/kernel_choice.h"
#include "ops/stock/stock_attention.h"

namespace fastmha {

// The forward's draw as the op's rng_state: copied from pinned memory without waiting for the GPU, or, drawn
// while a CUDA graph is captured (device tensors the kernel writes at replay), copied on the device.
at::Tensor rng_state_of(const stock::TorchPhilox& drawn, const at::Device& device);

// Whose stream a CUDA call's rng_state holds, read on the host (one wait for the GPU) into `host_state`; kUnknown
// (and no read) while a CUDA graph is captured.
DropoutDraw dropout_draw_of(const at::Tensor& rng_state, at::Tensor* host_state = nullptr);

// The draw for torch's backward, which reads it on the host (from `host_state` when dropout_draw_of read it,
// else this copy waits for the forward's work on the stream) or, while a graph is captured, from the device.
stock::TorchPhilox torch_philox_of(const at::Tensor& rng_state, const at::Tensor& host_state = at::Tensor());

}  // namespace fastmha
