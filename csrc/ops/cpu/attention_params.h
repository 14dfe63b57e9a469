// What the fused CPU attention kernels read and write. Tensors arrive in the accumulation type T (float or
// double; half types are widened by the caller or by the kernels' tasks, and may also come as they are,
// HalfOperands); q/k/v and the (B, H, L, d) outputs and gradients have rows of unit stride and any other strides
// (Strides3); the mask is a bool view broadcast to (B, H, Lq, Lk) through its strides (zeros where broadcast).
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops/cpu/half_gemm.h"
#include "ops/cpu/key_span.h"

namespace fastmha::cpu {

struct Strides3 {
  int64_t batch, head, row;  // the last dim is contiguous
};

// One operand of every head packed as a right operand (half_gemm.h): per_head elements apart, `rows` rows each (the
// padded head size for K^T and V^T; K and V hold padded_depth of the head's packed keys, HalfOperands::packed_keys,
// and `rows` is their most). data == nullptr: packed per block.
struct PackedHeads {
  const uint16_t* data = nullptr;
  int64_t per_head = 0, rows = 0;
};

// The half-type q/k/v of a forward or a blocked backward whose GEMMs multiply in the half type
// (ops/cpu/half_gemm.h); rows have unit stride. q == nullptr: the products run in T on the widened operands.
struct HalfOperands {
  const uint16_t* q = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  Strides3 q_stride{}, k_stride{}, v_stride{};
  HalfKind kind = HalfKind::kBFloat16;
  bool vnni = false;  // right operands packed for oneDNN's native kernels; plain for the reference GEMM
  // Right operands the kernels pack once per head for every query chunk of it (with_packed_heads): K^T for the
  // scores, V for the forward's P V; V^T for the backward's dO V^T and K for its dS K.
  PackedHeads keys_t, values, values_t, keys;
  // Per head (b * heads + h): the packs hold keys 0 .. packed_keys[bh] - 1 (nullptr: all keys).
  const int64_t* packed_keys = nullptr;
};

template <typename T>
struct AttentionInputs {
  const T* q;
  const T* k;
  const T* v;
  Strides3 q_stride, k_stride, v_stride;
  int64_t batch, heads, len_q, len_k, d_k, d_v;
  const bool* mask;  // nullptr: no mask; true = attend, false = filled with -1e9
  int64_t mask_stride[4];
  // Each distinct mask row's visible keys (MaskRowExtents), or nullptr: the kernels then search the rows themselves.
  const RowExtent* mask_rows = nullptr;
  int64_t mask_rows_stride[3] = {0, 0, 0};
  T scale;         // 1 / sqrt(d_k)
  bool is_causal;  // query i attends keys j <= i only (top-left), as if tril(ones(Lq, Lk)) were in the mask
  double dropout_p;
  uint64_t seed, offset;  // Philox stream of this call's dropout
  int64_t key_block;      // keys per block of the online-softmax forward and the blocked backward (> 0)
  HalfOperands half;      // T = float only
  // q/k/v in their half type when the kernels' tasks widen them, a head at a time into their own buffers
  // (widened_rows.h): q, k and v above are then nullptr, their row strides d_k and d_v. They are nullptr too where
  // the products run in the half type (half); the backward then also sets half_source. T = float only.
  HalfOperands half_source;
  // Or q/k/v in T whose rows are not back to back (heads interleaved: (B, L, H, d) memory), which the tasks copy the
  // same way (the backward's always, the forward's from 128 query rows): rows a row of heads apart share a few cache
  // sets, where the GEMMs' repeated reads of them evict one another.
  struct {
    const T *q = nullptr, *k = nullptr, *v = nullptr;
    Strides3 q_stride{}, k_stride{}, v_stride{};
  } copy_source;
  bool widen_in_tasks = false;  // whether the tasks widen half_source or copy copy_source (nullptr where empty)
  // T = float only: the forward's P V and the blocked backward's products on oneDNN's brgemm (float_gemm.h)
  bool float_brgemm = false;
};

template <typename T>
struct AttentionForwardOutputs {
  T* out;               // (B, H, Lq, d_v), rows of unit stride laid out by out_stride
  T* weights;           // (B, H, Lq, Lk) contiguous, or nullptr when the weights are not kept in T
  T* lse;               // (B, H, Lq) log-sum-exp of the masked, scaled scores
  Strides3 out_stride;  // of out
  // The output in a half type (out_stride), rounded from each task's T rows; out is then nullptr. T = float only.
  uint16_t* half_out = nullptr;
  HalfKind half_out_kind = HalfKind::kBFloat16;
  bool rounds_to_half = false;  // whether the output is half_out (nullptr where it is empty)
  // The kept weights in the half type half_out_kind, (B, H, Lq, Lk) contiguous, each rounded once from its T value
  // (a NaN may get another NaN's bits); weights is then nullptr. T = float only.
  uint16_t* half_weights = nullptr;
  bool keeps_weights() const { return weights != nullptr || half_weights != nullptr; }
};

// dK or dV as the backward's tasks write them: per split of a head's query chunks, partial sums that the caller
// adds up (or the result itself when there is one split).
template <typename T>
struct PartialGradients {
  T* data;
  Strides3 stride;  // of a split's (B, H, Lk, d) rows, of unit stride
  int64_t split;    // elements from one split's rows to the next's
};

template <typename T>
struct AttentionBackwardTensors {
  const T* grad_out;      // (B, H, Lq, d_v), laid out by grad_out_stride
  const T* grad_weights;  // (B, H, Lq, Lk) contiguous, or nullptr
  const T* lse;           // (B, H, Lq)
  const T* out;           // (B, H, Lq, d_v) forward output in T (out_stride), or nullptr (then row sums, or source_out)
  T* grad_q;              // (B, H, Lq, d_k), laid out by grad_q_stride
  PartialGradients<T> grad_k, grad_v;
  int64_t splits;  // query-chunk ranges per head processed in parallel
  Strides3 grad_out_stride, out_stride, grad_q_stride;
  // The blocked backward's dO, O and dQ in a half type (with half-type products, which also read dO so, or tasks
  // that widen): dO and O rows are widened a chunk at a time and dQ rows rounded (laid out by grad_out_stride,
  // out_stride and grad_q_stride); grad_out, out and grad_q are then nullptr. T = float only.
  const uint16_t* source_grad_out = nullptr;
  const uint16_t* source_out = nullptr;
  uint16_t* half_grad_q = nullptr;
  // dK and dV in the half type when each head is one task (splits == 1) of such a backward: the task sums them in
  // its own fp32 rows, which stay in cache, and rounds them in when it ends (laid out by half_grad_k_stride and
  // half_grad_v_stride); grad_k and grad_v then have no data, their row strides d_k and d_v. T = float only.
  uint16_t* half_grad_k = nullptr;
  uint16_t* half_grad_v = nullptr;
  Strides3 half_grad_k_stride{}, half_grad_v_stride{};
  // dK and dV in T when each head is one task and they have their heads interleaved ((B, L, H, d) memory): summed
  // the same way and copied in (laid out by task_grad_k_stride and task_grad_v_stride). Summed in place, a head's
  // rows a row of heads apart share a few cache sets, which the GEMMs' repeated adds into them kept evicting: the
  // float32 backward at (8, 8, 512, 64) took 2 ms (4%) more so.
  T* task_grad_k = nullptr;
  T* task_grad_v = nullptr;
  Strides3 task_grad_k_stride{}, task_grad_v_stride{};
  // The weights a forward kept (dropout up to kKeptWeightsMaxDropout), (B, H, Lq, Lk) contiguous in T, or nullptr:
  // the blocked backward takes P from them instead of recomputing the scores (with dropout, all but the dropped ones).
  const T* weights = nullptr;
};

// Row `row` of head bh (= batch index * heads + head index) of a (B, H, L, d) tensor laid out by s.
// nullptr for a nullptr base (an empty tensor's, or an operand the kernels widen themselves).
template <typename T>
T* head_row(T* base, const Strides3& s, int64_t heads, int64_t bh, int64_t row) {
  return base == nullptr ? nullptr : base + (bh / heads) * s.batch + (bh % heads) * s.head + row * s.row;
}

// Rows of queries one task handles at a time: about 2 MiB of fp32 score rows per buffer (measured on a
// 2-core AVX-512 machine: 32..128 rows all within noise at Lk = 1024..4096), between 16 and 128 rows.
inline int64_t query_chunk(int64_t len_k) {
  return std::clamp<int64_t>((int64_t{1} << 19) / std::max<int64_t>(len_k, 1), 16, 128);
}

// Rows of queries per task of the online-softmax forward, whose scores are only rows x key block in size: 256
// rows (large GEMMs, as torch's flash kernel takes; 128 rows measured 10-25% slower at 8192 keys on Zen 3),
// halved down to 32 while there would be fewer than 4 tasks per thread.
inline int64_t online_query_chunk(int64_t len_q, int64_t heads_total, int64_t threads) {
  int64_t rows = 256;
  while (rows > 32 && heads_total * ((len_q + rows - 1) / rows) < 4 * threads) rows /= 2;
  return std::min<int64_t>(rows, std::max<int64_t>(len_q, 1));
}

// Rows per query chunk of the backward: blocked (the forward output at hand, no gradient of the weights) as the
// online forward, otherwise whole score rows as query_chunk. The caller sizes its per-split partial sums by it.
inline int64_t backward_query_chunk(bool blocked, int64_t len_q, int64_t len_k, int64_t heads_total, int64_t threads) {
  return blocked ? online_query_chunk(len_q, heads_total, threads)
                 : std::min<int64_t>(query_chunk(len_k), std::max<int64_t>(len_q, 1));
}

// Keys per block of the online-softmax forward: the block's rows of K and V fill about the core's L2 cache
// (their scores, rows x block, stream through it). A multiple of 64 keys between 64 and 1024, so that the blocks
// of the half-type products start on the panels of the operands packed per head (half_gemm.h); on Zen 3 (512 KiB
// L2) at d 64 and 128, blocks of 512-1024 keys measured 2-15% faster than 160-256.
inline int64_t forward_key_block(int64_t l2_bytes, int64_t d_k, int64_t d_v, int64_t element_bytes) {
  return std::clamp<int64_t>(l2_bytes / ((d_k + d_v) * element_bytes) / kPanel * kPanel, 64, 1024);
}

// Keys per block of the blocked backward, which keeps two rows x block buffers (P and dS) in use at once: both
// together fill about the L2 cache for a chunk of `rows` queries (on Zen 3, 256 keys measured 5-15% faster than
// 512-1024 for forward + backward). A multiple of 64 keys, as the forward's.
inline int64_t backward_key_block(int64_t l2_bytes, int64_t rows, int64_t element_bytes) {
  return std::clamp<int64_t>(l2_bytes / (2 * std::max<int64_t>(rows, 1) * element_bytes) / kPanel * kPanel, 64, 1024);
}

// One implementation per CPU capability (compiled with its own vector ISA flags); see cpu/cpu_capability.cpp.
#define FASTMHA_DECLARE_CPU_KERNELS(capability)                                                     \
  namespace capability {                                                                            \
  void attention_forward(const AttentionInputs<float>&, const AttentionForwardOutputs<float>&);     \
  void attention_forward(const AttentionInputs<double>&, const AttentionForwardOutputs<double>&);   \
  void attention_backward(const AttentionInputs<float>&, const AttentionBackwardTensors<float>&);   \
  void attention_backward(const AttentionInputs<double>&, const AttentionBackwardTensors<double>&); \
  void dropout_multipliers(uint64_t, uint64_t, double, uint64_t, int64_t, float*);                  \
  void dropout_multipliers(uint64_t, uint64_t, double, uint64_t, int64_t, double*);                 \
  }

FASTMHA_DECLARE_CPU_KERNELS(DEFAULT)
#ifdef FASTMHA_CPU_X86
FASTMHA_DECLARE_CPU_KERNELS(AVX2)
FASTMHA_DECLARE_CPU_KERNELS(AVX512)
#endif

// Dropout multipliers (0 or 1/(1-p)) of elements first .. first + n - 1 of the stream (seed, offset) into out, as
// the kernels apply them, on the vector ISA the kernels run on (one thread; the caller splits the range).
void dropout_multipliers(uint64_t seed, uint64_t offset, double p, uint64_t first, int64_t n, float* out);
void dropout_multipliers(uint64_t seed, uint64_t offset, double p, uint64_t first, int64_t n, double* out);

}  // namespace fastmha::cpu
