// Dropout on attention weights as a tensor of per-element multipliers (0 or 1/(1-p)) for the scores'
// contiguous (batch, h, Lq, Lk) layout, for the ATen implementation of the attention core (the CPU kernels
// apply dropout inside their fused row pass instead).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace fastmha {

struct DropoutKernels {
  // Takes a fresh (seed, offset) from the device's default generator (reproducible under torch.manual_seed).
  // Returns (multipliers of `sizes` in `options`' dtype, rng_state: int64[2] on the same device).
  std::pair<at::Tensor, at::Tensor> (*draw)(at::IntArrayRef sizes, double p, const at::TensorOptions& options);
  // The same multipliers again, from a saved rng_state.
  at::Tensor (*replay)(at::IntArrayRef sizes, double p, const at::TensorOptions& options, const at::Tensor& rng_state);
};

// A fresh (seed, offset) from ATen's default CPU generator, as the CPU kernels draw it: int64[2] on the CPU.
at::Tensor draw_cpu_rng_state();

// The multipliers a forward with `rng_state` applied, through the dispatcher (fastmha::_dropout_multipliers), so
// that a graph tracer records them, on `options`' device.
at::Tensor replayed_multipliers(at::IntArrayRef sizes, double p, const at::TensorOptions& options,
                                const at::Tensor& rng_state);

// The draw and replay of the ATen implementation on `device` (CPU or CUDA) when it runs in the kernels' place:
// the same streams as the device's kernels, so a seed gives the same mask on either path.
DropoutKernels dropout_kernels_for(const at::Device& device);

#ifdef FASTMHA_WITH_CUDA
// The ATen implementation draws its dropout with fastmha's Philox kernel, which needs code for the device: a
// clear error where this build has none (dropout_p > 0 only).
void check_cuda_dropout_runs(const at::Tensor& query, double dropout_p);
DropoutKernels cuda_dropout_kernels();
// A fresh Philox (seed, offset) from the default CUDA generator of `device`, as int64[2] on that device.
at::Tensor draw_cuda_rng_state(const at::Device& device);
#endif

}  // namespace fastmha
