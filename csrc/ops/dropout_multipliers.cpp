// fastmha::_dropout_multipliers: the dropout multipliers (0 or 1/(1-p)) that a forward applied to its weights of
// `sizes` (the scores' contiguous (batch, h, Lq, Lk) layout), again, from its rng_state: the same numbers as the CPU
// kernels' fused row pass (whose batched Philox code draws them here too) and the CUDA kernels draw (ops/philox.h).
// The gradients built for a second differentiation multiply by them. Also the CPU's (seed, offset) draw, and the ATen
// implementation's draw and replay per device (ops/dropout.h).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>

#include "ops/cpu/attention_params.h"
#include "ops/dropout.h"
#include "ops/kernel_choice.h"
#ifdef FASTMHA_WITH_CUDA
#include "ops/cuda/torch_philox_state.h"
#endif

namespace fastmha {
namespace {

// Every kernel's checks (Meta's too, so that a traced call fails as an eager one would).
void check_multipliers_args(double p, at::ScalarType dtype, const at::Tensor& rng_state) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fastmha: dropout_p must be in [0, 1), got ", p);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "fastmha: dtype must be float32 or float64 (the dtypes dropout is applied in), got ", dtype);
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.dim() == 1 && rng_state.size(0) == 2,
              "fastmha: rng_state must be the int64 (seed, offset) pair a forward returned, got ",
              rng_state.scalar_type(), " of shape ", rng_state.sizes());
}

at::Tensor dropout_multipliers_cpu(c10::SymIntArrayRef sizes, double p, at::ScalarType dtype,
                                   const at::Tensor& rng_state) {
  check_multipliers_args(p, dtype, rng_state);
  auto multipliers = at::empty(C10_AS_INTARRAYREF_SLOW(sizes), at::TensorOptions().dtype(dtype));
  const auto state = rng_state.contiguous();
  const auto seed = static_cast<uint64_t>(state.const_data_ptr<int64_t>()[0]);
  const auto offset = static_cast<uint64_t>(state.const_data_ptr<int64_t>()[1]);
  AT_DISPATCH_FLOATING_TYPES(dtype, "fastmha_dropout_multipliers", [&] {
    auto* out = multipliers.data_ptr<scalar_t>();
    at::parallel_for(0, multipliers.numel(), int64_t{1} << 14, [&](int64_t begin, int64_t end) {
      cpu::dropout_multipliers(seed, offset, p, static_cast<uint64_t>(begin), end - begin, out + begin);
    });
  });
  return multipliers;
}

at::Tensor dropout_multipliers_meta(c10::SymIntArrayRef sizes, double p, at::ScalarType dtype,
                                    const at::Tensor& rng_state) {
  check_multipliers_args(p, dtype, rng_state);
  return at::empty_symint(sizes, at::TensorOptions().dtype(dtype).device(at::kMeta));
}

#ifdef FASTMHA_WITH_CUDA
at::Tensor dropout_multipliers_cuda(c10::SymIntArrayRef sizes, double p, at::ScalarType dtype,
                                    const at::Tensor& rng_state) {
  check_multipliers_args(p, dtype, rng_state);
  // These multipliers replay fastmha's stream (a double backward rebuilds the weights from them); torch's kernel
  // draws another, which only its own backward replays.
  TORCH_CHECK(p == 0 || !cuda_dropout_on_sdpa() || dropout_draw_of(rng_state) == DropoutDraw::kFastmha,
              "fastmha: this call's dropout was drawn by SDPA's memory-efficient kernel (FASTMHA_CUDA_DROPOUT=sdpa), "
              "whose mask fastmha cannot rebuild for a double backward (create_graph=True) or a replay, or it is "
              "replayed inside a CUDA graph capture, where the switch cannot tell whose; run such calls without "
              "FASTMHA_CUDA_DROPOUT=sdpa");
  return cuda_dropout_kernels().replay(C10_AS_INTARRAYREF_SLOW(sizes), p,
                                       at::TensorOptions().dtype(dtype).device(rng_state.device()), rng_state);
}
#endif

std::pair<at::Tensor, at::Tensor> draw_on_cpu(at::IntArrayRef sizes, double p, const at::TensorOptions& options) {
  auto rng_state = draw_cpu_rng_state();
  return {replayed_multipliers(sizes, p, options, rng_state), rng_state};
}

}  // namespace

at::Tensor draw_cpu_rng_state() {
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    seed = gen->random64();
  }
  auto state = at::empty({2}, at::kLong);
  state.data_ptr<int64_t>()[0] = static_cast<int64_t>(seed);
  state.data_ptr<int64_t>()[1] = 0;
  return state;
}

at::Tensor replayed_multipliers(at::IntArrayRef sizes, double p, const at::TensorOptions& options,
                                const at::Tensor& rng_state) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastmha::_dropout_multipliers", "")
                             .typed<at::Tensor(c10::SymIntArrayRef, double, at::ScalarType, const at::Tensor&)>();
  return op.call(c10::fromIntArrayRefSlow(sizes), p, options.dtype().toScalarType(), rng_state.to(options.device()));
}

DropoutKernels dropout_kernels_for(const at::Device& device) {
#ifdef FASTMHA_WITH_CUDA
  if (device.is_cuda()) {
    return cuda_dropout_kernels();
  }
#endif
  TORCH_CHECK(device.is_cpu(), "fastmha: dropout runs on CPU and CUDA tensors, got ", device);
  return {&draw_on_cpu, &replayed_multipliers};
}

TORCH_LIBRARY_IMPL(fastmha, CPU, m) { m.impl("_dropout_multipliers", &dropout_multipliers_cpu); }
TORCH_LIBRARY_IMPL(fastmha, Meta, m) { m.impl("_dropout_multipliers", &dropout_multipliers_meta); }
#ifdef FASTMHA_WITH_CUDA
TORCH_LIBRARY_IMPL(fastmha, CUDA, m) { m.impl("_dropout_multipliers", &dropout_multipliers_cuda); }
#endif

}  // namespace fastmha
