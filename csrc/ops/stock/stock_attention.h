// torch's own fused attention kernels (CPU flash; CUDA flash, memory-efficient and cuDNN) behind a thin layer
// that keeps fastmha's contract exactly, for calls without kept weights and without dropout (on CUDA masked calls
// only with FASTMHA_CUDA_MASKED=sdpa, and dropout calls with FASTMHA_CUDA_DROPOUT=sdpa, which then draw torch's
// own dropout masks: see cuda_backend). contract_inputs.h says what the kernels are given:
//  - mask == 0 for masks of any dtype and broadcast shape: the mask becomes an additive 0 / -inf bias. Next to one
//    visible key a masked score contributes exp(-inf) = 0, exactly as exp(-1e9 - max) = 0 does in every dtype.
//  - A row with no visible key is uniform over all keys (the -1e9 rule): its bias row is opened and its
//    query row zeroed, so all its scores are 0. Its query gradient is zeroed again in the backward (the
//    scores of such a row do not depend on the query), and its key gradient is 0 because its query is.
//  - is_causal stays top-left aligned: it is passed through when there is no mask, and folded into the bias
//    otherwise (a row that the mask and causality hide together is then uniform over all keys too).
// The saved log-sum-exp keeps the op's meaning whichever kernel wrote it (that of the masked, scaled scores),
// so a forward and a backward may run on different kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "ops/attention_ops.h"

namespace fastmha::stock {

// SDPA's fused CUDA backends that the layer wraps (values of at::_fused_sdp_choice).
enum class CudaBackend : int64_t { kFlash = 1, kEfficient = 2, kCudnn = 3 };

// Whether torch's own rules let `backend` run these tensors with this bias (or none), and whether the user left it
// enabled. Set by ops/cuda/ when the CUDA kernels are compiled in.
using CudaBackendUsable = bool (*)(CudaBackend backend, const at::Tensor& query, const at::Tensor& key,
                                   const at::Tensor& value, const std::optional<at::Tensor>& bias, double dropout_p,
                                   bool is_causal);
void set_cuda_backend_usable(CudaBackendUsable usable);

// The CUDA backend that runs this call behind the layer, or nullopt (with the reason in `why`) when torch's
// kernels are not used for it. Without a mask the layer runs SDPA's own pick where it wraps it; it passes cuDNN
// no causality with Lq != Lk (where top-left and bottom-right alignment differ): where SDPA picks cuDNN for such a
// call, flash or the memory-efficient kernel runs it if torch's rules allow them. A masked call is taken only with
// `take_masks`, a call with dropout (masked or not) only with `take_dropout` (both paths are unproven on a GPU),
// and by the memory-efficient kernel only: flash reads no bias, and cuDNN's has not been checked against the
// contract; one kernel for every dropout call, as its backward must replay the forward's draw. `training`: a
// gradient will be taken (torch's choice has rules for that case).
std::optional<CudaBackend> cuda_backend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& mask, bool is_causal, double dropout_p,
                                        bool training, bool take_masks, bool take_dropout, std::string* why);

// torch's dropout draw in a forward, for its backward to replay: the Philox seed and offset its kernel returned,
// host tensors or, while a CUDA graph is captured, device tensors (as torch's kernels take them).
struct TorchPhilox {
  at::Tensor seed;
  at::Tensor offset;
};

// (output, empty weights, logsumexp, zero rng_state), as the internal forward op returns them. On CUDA,
// `cuda` is the backend the kernel choice found with cuda_backend() (it is not looked up again). With dropout
// (memory-efficient kernel only) `drawn` receives the draw, which the caller keeps for the backward.
detail::AttentionForwardResult attention_forward(const at::Tensor& query, const at::Tensor& key,
                                                 const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                 bool is_causal, std::optional<CudaBackend> cuda,
                                                 double dropout_p = 0.0, TorchPhilox* drawn = nullptr);

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& mask, const at::Tensor& output, const at::Tensor& saved_logsumexp, bool is_causal,
    std::optional<CudaBackend> cuda, double dropout_p = 0.0, const TorchPhilox* drawn = nullptr);

}  // namespace fastmha::stock
