// Fused CPU attention, compiled once per CPU capability (CPU_CAPABILITY = DEFAULT, AVX2 or AVX512, with the
// matching vector ISA flags; see csrc/CMakeLists.txt).
//
// Work is split into (batch*head, query chunk) tasks under one at::parallel_for. A task computes its chunk's
// scores with a BLAS GEMM, then one vectorized pass per row does scale + mask + softmax + log-sum-exp +
// dropout in place, and a second GEMM applies the weights to V. Scores live in a per-task buffer of
// chunk x Lk (or directly in the weights output when it is kept): nothing of size Lq x Lk is allocated
// otherwise. The backward recomputes each chunk's softmax from the saved log-sum-exp and regenerates the
// dropout mask from the Philox (seed, offset); it splits each head's query chunks into ranges that run in
// parallel (partial dK/dV per range, summed by the caller), so it scales even when batch*heads is small.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/attention_params.h"
#include "ops/cpu/blas.h"
#include "ops/philox.h"

namespace fastmha::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

constexpr double kMaskedScore = -1e9;  // the document's fill for mask == 0

template <typename T>
struct Head {
  const T* q;
  const T* k;
  const T* v;
  const bool* mask;  // row 0 of this head's mask, or nullptr
};

template <typename T>
Head<T> head_pointers(const AttentionInputs<T>& in, int64_t bh) {
  const int64_t b = bh / in.heads, h = bh % in.heads;
  const bool* mask = in.mask ? in.mask + b * in.mask_stride[0] + h * in.mask_stride[1] : nullptr;
  return {in.q + b * in.q_stride.batch + h * in.q_stride.head, in.k + b * in.k_stride.batch + h * in.k_stride.head,
          in.v + b * in.v_stride.batch + h * in.v_stride.head, mask};
}

// Writes -1e9 where the mask row is false (the mask is read through its broadcast strides).
template <typename T>
void apply_mask(T* s, int64_t n, const bool* mask_row, int64_t col_stride) {
  if (mask_row == nullptr) {
    return;
  }
  if (col_stride == 1) {
    for (int64_t j = 0; j < n; ++j) s[j] = mask_row[j] ? s[j] : T(kMaskedScore);
  } else {
    for (int64_t j = 0; j < n; ++j) s[j] = mask_row[j * col_stride] ? s[j] : T(kMaskedScore);
  }
}

// In place: s <- exp(s - max(s)); returns {max, sum of the exponentials}. The caller normalizes, either the
// row itself (weights kept) or, cheaper, the row's output after the GEMM.
template <typename T>
std::pair<T, T> exp_row(T* s, int64_t n) {
  using Vec = Vectorized<T>;
  if (n == 0) {
    return {-std::numeric_limits<T>::infinity(), T(0)};
  }
  const T max = at::vec::reduce_all<T>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, n);
  const Vec max_vec(max);
  Vec sum_vec(T(0));
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = (Vec::loadu(s + j) - max_vec).exp();
    e.store(s + j);
    sum_vec = sum_vec + e;
  }
  T sum = at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, sum_vec);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - max);
    sum += s[j];
  }
  return {max, sum};
}

template <typename T>
void scale_row(T* x, int64_t n, T factor) {
  using Vec = Vectorized<T>;
  at::vec::map([factor](Vec v) { return v * Vec(factor); }, x, x, n);
}

// Dropout keep multipliers for elements first .. first + n - 1 of the (B, H, Lq, Lk) score layout, from the
// Philox block of each group of four (the same numbers as philox::keep_scale, one block per four elements).
template <typename T, typename F>
void for_each_keep(const AttentionInputs<T>& in, uint64_t first, int64_t n, F&& f) {
  const float p = static_cast<float>(in.dropout_p);
  const T scale = T(1.0 / (1.0 - in.dropout_p));
  philox::Block block{};
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t index = first + static_cast<uint64_t>(j);
    if (j == 0 || (index & 3) == 0) {
      block = philox::random4(in.seed, in.offset, index >> 2);
    }
    f(j, philox::to_uniform(block.word[index & 3]) >= p ? scale : T(0));
  }
}

// scores[r, :] = scale * q[row0 + r] . k[:]  for r < rows, then the mask.
template <typename T>
void chunk_scores(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, T* scores) {
  gemm<T>(false, true, rows, in.len_k, in.d_k, in.scale, head.q + row0 * in.q_stride.row, in.q_stride.row, head.k,
          in.k_stride.row, T(0), scores, in.len_k);
  if (head.mask) {
    for (int64_t r = 0; r < rows; ++r) {
      apply_mask(scores + r * in.len_k, in.len_k, head.mask + (row0 + r) * in.mask_stride[2], in.mask_stride[3]);
    }
  }
}

template <typename T>
void forward_impl(const AttentionInputs<T>& in, const AttentionForwardOutputs<T>& out) {
  const int64_t chunk = std::min<int64_t>(query_chunk(in.len_k), std::max<int64_t>(in.len_q, 1));
  const int64_t chunks = (in.len_q + chunk - 1) / chunk;
  const int64_t tasks = in.batch * in.heads * chunks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> buffer(out.weights ? 0 : chunk * in.len_k), inv_sum(chunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / chunks, row0 = (task % chunks) * chunk;
      const int64_t rows = std::min(chunk, in.len_q - row0);
      const Head<T> head = head_pointers(in, bh);
      const int64_t first_row = bh * in.len_q + row0;  // row index in (B*H*Lq)
      T* scores = out.weights ? out.weights + first_row * in.len_k : buffer.data();
      chunk_scores(in, head, row0, rows, scores);
      T* out_rows = out.out + first_row * in.d_v;
      for (int64_t r = 0; r < rows; ++r) {
        T* s = scores + r * in.len_k;
        const auto [max, sum] = exp_row(s, in.len_k);
        out.lse[first_row + r] = max + std::log(sum);
        inv_sum[r] = T(1) / sum;
        if (out.weights) {
          scale_row(s, in.len_k, inv_sum[r]);
        }
        if (in.dropout_p > 0) {
          const auto first = static_cast<uint64_t>((first_row + r) * in.len_k);
          for_each_keep(in, first, in.len_k, [s](int64_t j, T keep) { s[j] *= keep; });
        }
      }
      gemm<T>(false, false, rows, in.d_v, in.len_k, T(1), scores, in.len_k, head.v, in.v_stride.row, T(0), out_rows,
              in.d_v);
      if (!out.weights) {  // normalize d_v outputs per row instead of Lk weights
        for (int64_t r = 0; r < rows; ++r) {
          scale_row(out_rows + r * in.d_v, in.d_v, in.len_k > 0 ? inv_sum[r] : T(0));
        }
      }
    }
  });
}

template <typename T>
void backward_impl(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g) {
  using Vec = Vectorized<T>;
  const int64_t chunk = std::min<int64_t>(query_chunk(in.len_k), std::max<int64_t>(in.len_q, 1));
  const int64_t chunks = (in.len_q + chunk - 1) / chunk;
  const int64_t splits = g.splits;
  const int64_t tasks = in.batch * in.heads * splits;
  const int64_t n = in.len_k;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> probs(chunk * n), grad_w(chunk * n), keep_row(in.dropout_p > 0 ? n : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / splits, split = task % splits;
      const Head<T> head = head_pointers(in, bh);
      T* grad_k = g.grad_k_partial + (bh * splits + split) * n * in.d_k;
      T* grad_v = g.grad_v_partial + (bh * splits + split) * n * in.d_v;
      std::fill(grad_k, grad_k + n * in.d_k, T(0));
      std::fill(grad_v, grad_v + n * in.d_v, T(0));
      const int64_t chunk_begin = split * chunks / splits, chunk_end = (split + 1) * chunks / splits;
      for (int64_t c = chunk_begin; c < chunk_end; ++c) {
        const int64_t row0 = c * chunk, rows = std::min(chunk, in.len_q - row0);
        const int64_t first_row = bh * in.len_q + row0;
        const T* grad_out = g.grad_out + first_row * in.d_v;
        // P = exp(S - lse), recomputed; dW = dO V^T (+ the gradient of the returned weights)
        chunk_scores(in, head, row0, rows, probs.data());
        gemm<T>(false, true, rows, n, in.d_v, T(1), grad_out, in.d_v, head.v, in.v_stride.row, T(0), grad_w.data(), n);
        for (int64_t r = 0; r < rows; ++r) {
          T* p = probs.data() + r * n;
          T* dw = grad_w.data() + r * n;
          const Vec lse(g.lse[first_row + r]);
          at::vec::map([lse](Vec s) { return (s - lse).exp(); }, p, p, n);
          if (g.grad_weights) {
            const T* gw = g.grad_weights + (first_row + r) * n;
            at::vec::map2([](Vec a, Vec b) { return a + b; }, dw, dw, gw, n);
          }
          // With dropout: dP = dW * keep, and the weights that were applied are W = P * keep.
          T dot;
          if (in.dropout_p > 0) {
            const auto first = static_cast<uint64_t>((first_row + r) * n);
            for_each_keep(in, first, n, [&](int64_t j, T keep) { keep_row[j] = keep; });
            at::vec::map2([](Vec a, Vec b) { return a * b; }, dw, dw, keep_row.data(), n);
          }
          dot = at::vec::map2_reduce_all<T>([](Vec a, Vec b) { return a * b; }, [](Vec a, Vec b) { return a + b; }, dw,
                                            p, n);
          // dS = P * (dP - sum_j dP_j P_j) into dW's row; masked scores were overwritten: no gradient there.
          const Vec dot_vec(dot);
          at::vec::map2([dot_vec](Vec pj, Vec dpj) { return pj * (dpj - dot_vec); }, dw, p, dw, n);
          if (head.mask) {
            const bool* mask_row = head.mask + (row0 + r) * in.mask_stride[2];
            for (int64_t j = 0; j < n; ++j) {
              if (!mask_row[j * in.mask_stride[3]]) dw[j] = T(0);
            }
          }
          if (in.dropout_p > 0) {  // P's row becomes W for the dV GEMM
            at::vec::map2([](Vec a, Vec b) { return a * b; }, p, p, keep_row.data(), n);
          }
        }
        // dV += W^T dO ; dQ = scale * dS K ; dK += scale * dS^T Q
        gemm<T>(true, false, n, in.d_v, rows, T(1), probs.data(), n, grad_out, in.d_v, T(1), grad_v, in.d_v);
        gemm<T>(false, false, rows, in.d_k, n, in.scale, grad_w.data(), n, head.k, in.k_stride.row, T(0),
                g.grad_q + first_row * in.d_k, in.d_k);
        gemm<T>(true, false, n, in.d_k, rows, in.scale, grad_w.data(), n, head.q + row0 * in.q_stride.row,
                in.q_stride.row, T(1), grad_k, in.d_k);
      }
    }
  });
}

}  // namespace

void attention_forward(const AttentionInputs<float>& in, const AttentionForwardOutputs<float>& out) {
  forward_impl(in, out);
}
void attention_forward(const AttentionInputs<double>& in, const AttentionForwardOutputs<double>& out) {
  forward_impl(in, out);
}
void attention_backward(const AttentionInputs<float>& in, const AttentionBackwardTensors<float>& g) {
  backward_impl(in, g);
}
void attention_backward(const AttentionInputs<double>& in, const AttentionBackwardTensors<double>& g) {
  backward_impl(in, g);
}

}  // namespace CPU_CAPABILITY
}  // namespace fastmha::cpu
