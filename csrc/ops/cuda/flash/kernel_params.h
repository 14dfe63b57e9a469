// What the CUDA attention kernels read and write: plain pointers, sizes and strides, shared by the device code
// and by the host emulation that tests the kernel bodies without a GPU (tests/cpp/test_cuda_kernel_bodies.cpp).
// T is the storage dtype (float, double, at::Half, at::BFloat16); Acc the accumulation dtype (float, or double).
#pragma once

#include <cstdint>

namespace fastmha::cuda_kernels {

// Strides of a (batch, h, rows, features) tensor whose last dim is contiguous.
struct RowStrides {
  int64_t batch, head, row;
};

template <typename T, typename Acc>
struct AttentionParams {
  const T* q;  // (B, H, Lq, d_k)
  const T* k;  // (B, H, Lk, d_k)
  const T* v;  // (B, H, Lk, d_v)
  RowStrides q_stride, k_stride, v_stride;
  int64_t batch_heads;
  int heads, len_q, len_k, d_k, d_v;
  const bool* mask;  // broadcast to (B, H, Lq, Lk) through mask_stride (0 where broadcast); nullptr: no mask
  int64_t mask_stride[4];
  Acc scale;       // 1 / sqrt(d_k)
  bool is_causal;  // key j > query i is masked (top-left), like tril(ones(Lq, Lk)) in the mask
  float dropout_p;
  Acc dropout_scale;         // 1 / (1 - p)
  const int64_t* rng_state;  // device int64[2]: Philox (seed, offset); read only when dropout_p > 0
  // (B * H): whether head bh's tensors that skipped tiles would meet are finite (see flash_mask_view);
  // nullptr: they are everywhere.
  const bool* finite_heads;
  // Forward outputs, contiguous.
  T* out;    // (B, H, Lq, d_v)
  Acc* lse;  // (B, H, Lq): log-sum-exp of the masked, scaled scores
  // Backward inputs and outputs, contiguous.
  const Acc* saved_lse;  // (B, H, Lq): the forward's lse
  const T* grad_out;     // (B, H, Lq, d_v)
  const Acc* delta;      // (B, H, Lq): rowsum(grad_out * out), the softmax backward's row term
  Acc* grad_q_acc;       // (B, H, Lq, d_k), zeroed by the caller; key blocks add into it
  T* grad_k;             // (B, H, Lk, d_k)
  T* grad_v;             // (B, H, Lk, d_v)
};

// The row-wise kernels of the weights-kept path: the scores come from cuBLAS in Acc, contiguous (B, H, Lq, Lk).
template <typename T, typename Acc>
struct SoftmaxRowsParams {
  const Acc* scores;        // raw q @ k^T
  const Acc* grad_weights;  // backward: dW = grad_out @ v^T (+ the weights' own gradient)
  T* weights;               // forward: softmax * dropout multipliers; backward: the same, recomputed
  T* grad_scores;           // backward: dL/d(q @ k^T), zero where masked, scale folded in
  Acc* lse;                 // forward: (B, H, Lq)
  const Acc* saved_lse;     // backward: the forward's lse
  int64_t rows;             // B * H * Lq
  int heads, len_q, len_k;
  const bool* mask;
  int64_t mask_stride[4];
  Acc scale;
  bool is_causal;
  float dropout_p;
  Acc dropout_scale;
  const int64_t* rng_state;
};

}  // namespace fastmha::cuda_kernels
