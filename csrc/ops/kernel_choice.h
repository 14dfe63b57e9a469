// The one place that decides which kernel runs a call of the attention core, on CPU and CUDA alike: a list
// of small named checks, each of which can say why it refused (as SDPA's backend selection does). The
// forward and the backward of a call are chosen separately (each where it measures faster): the saved
// log-sum-exp means the same whichever kernel wrote it. `fastmha.explain(...)` shows both choices and their
// reasons, and FASTMHA_LOG_KERNELS=1 prints them for every call.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "ops/stock/stock_attention.h"

namespace fastmha {

enum class AttentionKernel {
  kOwnCpu,     // fastmha's fused CPU kernels (ops/cpu/)
  kStockCpu,   // torch's CPU flash attention behind the contract layer (ops/stock/)
  kOwnCuda,    // fastmha's CUDA kernels: flash (weights not kept) or cuBLAS + row kernels (weights kept)
  kStockCuda,  // torch's CUDA flash, memory-efficient or cuDNN attention behind the contract layer
  kAten,       // the ATen composite (ops/aten/): GEMMs, softmax, fastmha's dropout
};

const char* kernel_name(AttentionKernel kernel);

enum class Pass { kForward, kBackward };

enum class DropoutDraw { kUnknown, kFastmha, kTorch };

// What a call asks for. In a backward `need_weights` is true when the weights carry a gradient (the loss read the
// weights its forward kept), and `weights_at_hand` when the kept weights themselves are given.
struct AttentionCall {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  const std::optional<at::Tensor>& mask;
  double dropout_p;
  bool need_weights;
  bool is_causal;
  Pass pass = Pass::kForward;
  // A backward given the weights its forward (float32 or float64, dropout up to 0.1) kept: fastmha's takes P from
  // them.
  bool weights_at_hand = false;
  // A CUDA backward with dropout: whose stream its forward drew (FASTMHA_CUDA_DROPOUT=sdpa lets torch's kernel draw),
  // when known. The backward must replay that draw whatever the switches say now.
  DropoutDraw drawn = DropoutDraw::kUnknown;
};

struct KernelChoice {
  AttentionKernel kernel;
  std::string reason;  // why this kernel and not the one before it in the list
  std::optional<stock::CudaBackend> sdpa_backend = std::nullopt;  // kStockCuda: the SDPA kernel to call
  // kOwnCpu in bfloat16/float16: whether its products run in the half type rather than widened to fp32
  // (FASTMHA_CPU_HALF_GEMM; `auto` counts the query rows and the keys a row computes, from the mask's sample).
  bool half_products = false;
  bool half_products_vnni = true;  // their right operands in the VNNI layout; plain on ATen's reference GEMM
  // kOwnCpu forward in float32 or widened to it: whether its P V runs on oneDNN's brgemm (FASTMHA_CPU_FLOAT_GEMM);
  // kOwnCpu backward in float32: whether the blocked backward's products do.
  bool float_brgemm = false;
  // kOwnCuda forward without kept weights: the register-resident mma kernel with this many 16-row tiles per warp
  // (1 or 2), or 0 for the WMMA tile kernel.
  int mma_row_tiles = 0;
  // kOwnCuda backward without kept weights: the register-resident mma kernel instead of the WMMA tile kernel.
  bool mma_backward = false;
};

KernelChoice choose_kernel(const AttentionCall& call);

// Whether FASTMHA_CUDA_DROPOUT=sdpa lets torch's kernel draw the dropout of CUDA calls without kept weights.
bool cuda_dropout_on_sdpa();

// Whether a backward's forward kept the weights: the weights' gradient is passed (it may be undefined when
// the weights were not used, and the dispatcher may turn that into no value; the saved log-sum-exp means the
// same for every kernel, so a backward on another kernel than its forward's is still right).
inline bool weights_kept(const std::optional<at::Tensor>& grad_weights) {
  return grad_weights.has_value() && grad_weights->defined();
}

// Whether kept weights can stand for the softmax P in a backward: in float32 or float64 (half-type weights are too
// coarse to stand for the fp32 softmax), and with dropout up to kKeptWeightsMaxDropout. With dropout the weights are
// P times the dropout multipliers: the backward recovers P from the kept ones and recomputes the dropped ones one by
// one, which pays while they are few. On Zen 4 the float32 backward took 0.86-0.98x the recomputing one's time at
// p = 0.1 (512-4096 keys), 0.95-1.04x with a padded batch; at p = 0.3 1.0x without a mask, 1.04-1.14x with padding.
inline constexpr double kKeptWeightsMaxDropout = 0.1;
inline bool weights_stand_for_softmax(at::ScalarType dtype, double dropout_p) {
  return (dtype == at::kFloat || dtype == at::kDouble) && dropout_p <= kKeptWeightsMaxDropout;
}

// Whether the weights that a forward call kept should be saved for its backward, which then takes P from them
// instead of recomputing the scores: where they stand for the softmax (above) and fastmha's CPU kernel runs that
// backward (when the loss does not read the weights). With dropout only in float32: in float64 the recomputed
// dropped weights cost more than the scores they spare (on Zen 4 the weights-reading backward took 1.18-1.27x the
// recomputing one's time at p = 0.1, 0.93-0.96x without dropout). Elsewhere saving them would only hold memory. With
// symbolic sizes (a graph compiler tracing) the choice's size checks cannot run: the weights are then saved unless
// FASTMHA_CPU_KERNELS=stock.
bool weights_serve_backward(const AttentionCall& forward_call);

// choose_kernel, and the choice printed to stderr when FASTMHA_LOG_KERNELS=1.
KernelChoice choose_kernel_logged(const AttentionCall& call);

// Facts about a CUDA device that only CUDA code can find out (set by ops/cuda/ when it is compiled in).
struct CudaDeviceFacts {
  bool own_kernels_fit;   // enough shared memory per block for fastmha's flash tiles
  bool has_kernel_image;  // the library holds code (SASS or PTX) that this device can run
  std::string device_name;
};
using CudaFactsProvider = CudaDeviceFacts (*)(const at::Device&);
void set_cuda_facts_provider(CudaFactsProvider provider);

}  // namespace fastmha
