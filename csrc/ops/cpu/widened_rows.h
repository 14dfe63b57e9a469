// Half-type operands widened to fp32 by the kernels' tasks themselves (the forward's and the blocked backward's),
// and their fp32 result rows rounded back. A task widens the keys and values of a head when it moves to that head,
// and the rows of each query chunk, into its own buffers, where they stay in cache for the products; its output
// (or dQ) rows are rounded into the half-type tensor as each chunk ends. Widening the whole tensors first instead
// sends every operand and result through memory once more in fp32, which is a large part of a call whose
// products are small (a padded batch).
// Included by each per-ISA compile of the kernels (CPU_CAPABILITY).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/cpu/attention_params.h"
#include "ops/cpu/cache_line_buffer.h"

namespace fastmha::cpu {
namespace CPU_CAPABILITY {

// n fp32 values rounded to the half type `kind` (its bits), with vector conversions.
inline void round_to_half(HalfKind kind, const float* src, uint16_t* dst, int64_t n) {
  if (kind == HalfKind::kBFloat16) {
    at::vec::convert(src, reinterpret_cast<at::BFloat16*>(dst), n);
  } else {
    at::vec::convert(src, reinterpret_cast<at::Half*>(dst), n);
  }
}

// n fp32 values times `factor`, rounded to the half type H: the product, then one rounding, as scaling the values
// in place before round_to_half would give.
template <typename H>
void round_scaled(const float* src, float factor, H* dst, int64_t n) {
  using VecF = at::vec::Vectorized<float>;
  const VecF f(factor);
  int64_t j = 0;
  for (; j + 2 * VecF::size() <= n; j += 2 * VecF::size()) {
    at::vec::convert_from_float<H>(VecF::loadu(src + j) * f, VecF::loadu(src + j + VecF::size()) * f).store(dst + j);
  }
  for (; j < n; ++j) dst[j] = static_cast<H>(src[j] * factor);
}

template <typename H>
void widen_values(const H* src, float* dst, int64_t n) {
  using VecH = at::vec::Vectorized<H>;
  using VecF = at::vec::Vectorized<float>;
  int64_t j = 0;
  for (; j + VecH::size() <= n; j += VecH::size()) {
    const auto [lo, hi] = at::vec::convert_to_float<H>(VecH::loadu(src + j));
    lo.store(dst + j);
    hi.store(dst + j + VecF::size());
  }
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// `rows` rows of n half-type values (bits, row stride ld) widened to fp32 rows of n values each, back to back.
inline void widen_rows(HalfKind kind, const uint16_t* src, int64_t ld, int64_t rows, int64_t n, float* dst) {
  if (ld == n) {  // one run
    n *= rows;
    rows = 1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (kind == HalfKind::kBFloat16) {
      widen_values(reinterpret_cast<const at::BFloat16*>(src + r * ld), dst + r * n, n);
    } else {
      widen_values(reinterpret_cast<const at::Half*>(src + r * ld), dst + r * n, n);
    }
  }
}

// `rows` rows of n values of T (row stride src_ld) copied into rows of row stride dst_ld: widen_rows' and round_rows'
// counterpart for operands already in T.
template <typename T>
void copy_rows(const T* src, int64_t src_ld, int64_t rows, int64_t n, T* dst, int64_t dst_ld) {
  if (n == 0) {  // an empty operand's rows: no pointers to step
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * src_ld, n, dst + r * dst_ld);
}

// `rows` rows of n fp32 values, back to back, rounded to the half type `kind` into rows of row stride ld.
inline void round_rows(HalfKind kind, const float* src, int64_t rows, int64_t n, uint16_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) round_to_half(kind, src + r * n, dst + r * ld, n);
}

// Products of a few fp32 query rows with half-type keys and values read as they are, each vector widened in
// registers (a decoding step: no fp32 copy of the keys and values goes through memory).
//
// scores[r, j] = scale * q[r, :] . k[j, :] for r < rows, j < n (k: n rows of d in H, row stride k_ld), four keys
// at a time on vector accumulators.
template <typename H>
void half_rows_dots(const float* q, int64_t q_ld, int64_t rows, const H* k, int64_t k_ld, int64_t n, int64_t d,
                    float scale, float* scores, int64_t ld) {
  using VecH = at::vec::Vectorized<H>;
  using VecF = at::vec::Vectorized<float>;
  constexpr int64_t kKeys = 4;
  const int64_t d_vec = d - d % VecH::size();
  const auto sum = [](const VecF& x) {
    return at::vec::vec_reduce_all<float>([](VecF& a, VecF& b) { return a + b; }, x);
  };
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int64_t keys = std::min(kKeys, n - j0);
    const H* k_rows[kKeys];
    for (int64_t u = 0; u < kKeys; ++u) k_rows[u] = k + (j0 + std::min(u, keys - 1)) * k_ld;  // repeats the last
    __builtin_prefetch(k + std::min(j0 + 4 * kKeys, n - 1) * k_ld);
    for (int64_t r = 0; r < rows; ++r) {
      const float* q_row = q + r * q_ld;
      VecF acc[kKeys] = {VecF(0.0f), VecF(0.0f), VecF(0.0f), VecF(0.0f)};
      for (int64_t p = 0; p < d_vec; p += VecH::size()) {
        const VecF x_lo = VecF::loadu(q_row + p), x_hi = VecF::loadu(q_row + p + VecF::size());
        for (int64_t u = 0; u < kKeys; ++u) {
          const auto [lo, hi] = at::vec::convert_to_float<H>(VecH::loadu(k_rows[u] + p));
          acc[u] = at::vec::fmadd(x_hi, hi, at::vec::fmadd(x_lo, lo, acc[u]));
        }
      }
      for (int64_t u = 0; u < keys; ++u) {
        float dot = sum(acc[u]);
        for (int64_t p = d_vec; p < d; ++p) dot += q_row[p] * static_cast<float>(k_rows[u][p]);
        scores[r * ld + j0 + u] = scale * dot;
      }
    }
  }
}

// out_row[0 .. kChunks vectors of H) (+)= p_row . v in one pass over the keys, the columns in registers.
template <typename H, int kChunks>
void half_row_apply(const float* p_row, const H* v, int64_t v_ld, int64_t n, float* out_row, bool add) {
  using VecH = at::vec::Vectorized<H>;
  using VecF = at::vec::Vectorized<float>;
  VecF acc[2 * kChunks];
  for (int c = 0; c < 2 * kChunks; ++c) acc[c] = add ? VecF::loadu(out_row + c * VecF::size()) : VecF(0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const VecF w(p_row[j]);
    const H* v_row = v + j * v_ld;
    __builtin_prefetch(v + std::min(j + 8, n - 1) * v_ld);
    for (int c = 0; c < kChunks; ++c) {
      const auto [lo, hi] = at::vec::convert_to_float<H>(VecH::loadu(v_row + c * VecH::size()));
      acc[2 * c] = at::vec::fmadd(w, lo, acc[2 * c]);
      acc[2 * c + 1] = at::vec::fmadd(w, hi, acc[2 * c + 1]);
    }
  }
  for (int c = 0; c < 2 * kChunks; ++c) acc[c].store(out_row + c * VecF::size());
}

// out[r, :] (+)= p[r, :] . v for r < rows (p: rows x n fp32, row stride ld; v: n rows of d in H, row stride v_ld;
// out row stride out_ld), up to 4 vectors of columns (d 128 in bfloat16 on AVX-512) at a time held in registers over
// all n keys.
template <typename H>
void half_rows_apply(const float* p, int64_t ld, int64_t rows, const H* v, int64_t v_ld, int64_t n, int64_t d,
                     float* out, int64_t out_ld, bool add) {
  using VecH = at::vec::Vectorized<H>;
  const int64_t d_vec = d - d % VecH::size();
  const int64_t chunks = d_vec / VecH::size();
  constexpr int64_t kOnePassChunks = 4;
  using OnePass = void (*)(const float*, const H*, int64_t, int64_t, float*, bool);
  constexpr OnePass one_pass[kOnePassChunks + 1] = {nullptr, half_row_apply<H, 1>, half_row_apply<H, 2>,
                                                    half_row_apply<H, 3>, half_row_apply<H, 4>};
  for (int64_t r = 0; r < rows; ++r) {
    const float* p_row = p + r * ld;
    float* out_row = out + r * out_ld;
    for (int64_t c0 = 0; c0 < chunks; c0 += kOnePassChunks) {
      const int64_t c = c0 * VecH::size();
      one_pass[std::min(kOnePassChunks, chunks - c0)](p_row, v + c, v_ld, n, out_row + c, add);
    }
    for (int64_t c = d_vec; c < d; ++c) {
      float acc = add ? out_row[c] : 0.0f;
      for (int64_t j = 0; j < n; ++j) acc += p_row[j] * static_cast<float>(v[j * v_ld + c]);
      out_row[c] = acc;
    }
  }
}

inline void half_rows_dots(HalfKind kind, const float* q, int64_t q_ld, int64_t rows, const uint16_t* k, int64_t k_ld,
                           int64_t n, int64_t d, float scale, float* scores, int64_t ld) {
  if (kind == HalfKind::kBFloat16) {
    half_rows_dots(q, q_ld, rows, reinterpret_cast<const at::BFloat16*>(k), k_ld, n, d, scale, scores, ld);
  } else {
    half_rows_dots(q, q_ld, rows, reinterpret_cast<const at::Half*>(k), k_ld, n, d, scale, scores, ld);
  }
}

inline void half_rows_apply(HalfKind kind, const float* p, int64_t ld, int64_t rows, const uint16_t* v, int64_t v_ld,
                            int64_t n, int64_t d, float* out, int64_t out_ld, bool add) {
  if (kind == HalfKind::kBFloat16) {
    half_rows_apply(p, ld, rows, reinterpret_cast<const at::BFloat16*>(v), v_ld, n, d, out, out_ld, add);
  } else {
    half_rows_apply(p, ld, rows, reinterpret_cast<const at::Half*>(v), v_ld, n, d, out, out_ld, add);
  }
}

// One task's q, k and v in T when the tasks widen them (in.widen_in_tasks, from in.half_source, or copied from
// in.copy_source): the keys and values of one head at a time, widened when the task moves to another head (a head
// split among tasks is widened by each), and the query rows of its current chunk, in place of the rows of a head's
// whole queries (row stride d_k, d_k and d_v as in.q_stride etc. say).
template <typename T>
class WidenedHead {
 public:
  struct Rows {
    const T* q;
    const T* k;
    const T* v;
  };

  // Head bh's rows, with queries row0 .. row0 + rows widened.
  Rows rows_of(const AttentionInputs<T>& in, int64_t bh, int64_t row0, int64_t rows) {
    if (bh != bh_) {
      k_.resize(static_cast<size_t>(in.len_k * in.d_k));
      v_.resize(static_cast<size_t>(in.len_k * in.d_v));
      load(in, Operand::kKey, bh, 0, in.len_k, k_.data());
      load(in, Operand::kValue, bh, 0, in.len_k, v_.data());
      bh_ = bh;
    }
    q_.resize(static_cast<size_t>(in.len_q * in.d_k));
    load(in, Operand::kQuery, bh, row0, rows, q_.data() + row0 * in.d_k);
    return {q_.data(), k_.data(), v_.data()};
  }

  // Head bh's queries row0 .. row0 + rows widened (as rows_of gives them), the keys and values left as they are.
  const T* query_rows_of(const AttentionInputs<T>& in, int64_t bh, int64_t row0, int64_t rows) {
    q_.resize(static_cast<size_t>(in.len_q * in.d_k));
    load(in, Operand::kQuery, bh, row0, rows, q_.data() + row0 * in.d_k);
    bh_ = -1;  // the keys and values held, if any, are no longer this head's
    return q_.data();
  }

 private:
  enum class Operand { kQuery, kKey, kValue };

  // Rows first .. first + count - 1 of head bh's q, k or v, back to back at dst: copied from in.copy_source, or
  // widened from in.half_source.
  static void load(const AttentionInputs<T>& in, Operand operand, int64_t bh, int64_t first, int64_t count, T* dst) {
    const int64_t d = operand == Operand::kValue ? in.d_v : in.d_k;
    const auto rows_of_head = [&](const auto& src) {  // the operand's first row and its row stride
      const auto* base = operand == Operand::kQuery ? src.q : operand == Operand::kKey ? src.k : src.v;
      const Strides3& stride = operand == Operand::kQuery ? src.q_stride
                               : operand == Operand::kKey ? src.k_stride
                                                          : src.v_stride;
      return std::make_pair(head_row(base, stride, in.heads, bh, first), stride.row);
    };
    if (in.copy_source.q != nullptr) {
      const auto [rows, ld] = rows_of_head(in.copy_source);
      copy_rows(rows, ld, count, d, dst, d);
    } else if constexpr (std::is_same_v<T, float>) {
      const auto [rows, ld] = rows_of_head(in.half_source);
      widen_rows(in.half_source.kind, rows, ld, count, d, dst);
    }
  }

  CacheLineVector<T> q_, k_, v_;
  int64_t bh_ = -1;
};

// A blocked backward task's rows of dO and O, and of dQ, for one chunk of queries: those of the tensors, or,
// when they are in a half type (g.source_grad_out), dO and O widened into the task's buffers and dQ computed
// there, rounded into the gradient by done().
template <typename T>
class BackwardChunkRows {
 public:
  const T* grad_out = nullptr;
  const T* out = nullptr;
  T* grad_q = nullptr;
  int64_t ld_grad_out = 0, ld_out = 0, ld_grad_q = 0;

  void take(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g, int64_t bh, int64_t row0,
            int64_t rows) {
    bh_ = bh;
    row0_ = row0;
    if (g.source_grad_out == nullptr) {
      grad_out = head_row(g.grad_out, g.grad_out_stride, in.heads, bh, row0);
      out = head_row(g.out, g.out_stride, in.heads, bh, row0);
      grad_q = head_row(g.grad_q, g.grad_q_stride, in.heads, bh, row0);
      ld_grad_out = g.grad_out_stride.row;
      ld_out = g.out_stride.row;
      ld_grad_q = g.grad_q_stride.row;
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      const HalfKind kind = in.half_source.kind;
      grad_out_.resize(static_cast<size_t>(rows * in.d_v));
      out_.resize(static_cast<size_t>(rows * in.d_v));
      grad_q_.resize(static_cast<size_t>(rows * in.d_k));
      widen_rows(kind, head_row(g.source_grad_out, g.grad_out_stride, in.heads, bh, row0), g.grad_out_stride.row, rows,
                 in.d_v, grad_out_.data());
      widen_rows(kind, head_row(g.source_out, g.out_stride, in.heads, bh, row0), g.out_stride.row, rows, in.d_v,
                 out_.data());
    }
    grad_out = grad_out_.data();
    out = out_.data();
    grad_q = grad_q_.data();
    ld_grad_out = ld_out = in.d_v;
    ld_grad_q = in.d_k;
  }

  // The chunk's `rows` dQ rows are final.
  void done(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g, int64_t rows) {
    if constexpr (std::is_same_v<T, float>) {
      if (g.source_grad_out != nullptr && g.half_grad_q != nullptr) {
        round_rows(in.half_source.kind, grad_q_.data(), rows, in.d_k,
                   head_row(g.half_grad_q, g.grad_q_stride, in.heads, bh_, row0_), g.grad_q_stride.row);
      }
    }
  }

 private:
  CacheLineVector<T> grad_out_, out_, grad_q_;
  int64_t bh_ = 0, row0_ = 0;
};

// Where a task puts a chunk's output rows: straight into the output, or, when that is in a half type
// (out.rounds_to_half), into the task's buffer, rounded into the output by done(). With half-type products
// (in.half) the buffer holds padded_rows(chunk) rows of whole panels, which the products of P V add to in place.
template <typename T>
class OutputRows {
 public:
  OutputRows(const AttentionInputs<T>& in, const AttentionForwardOutputs<T>& out, int64_t chunk)
      : in_(in),
        out_(out),
        ld_(in.half.q != nullptr ? (in.d_v + kPanel - 1) / kPanel * kPanel : in.d_v),
        buffer_(out.rounds_to_half ? static_cast<size_t>((in.half.q != nullptr ? padded_rows(chunk) : chunk) * ld_)
                                   : 0) {}

  // The rows of head bh from row0 on, with their row stride.
  T* rows(int64_t bh, int64_t row0) {
    bh_ = bh;
    row0_ = row0;
    return out_.rounds_to_half ? buffer_.data() : head_row(out_.out, out_.out_stride, in_.heads, bh, row0);
  }
  int64_t ld() const { return out_.rounds_to_half ? ld_ : out_.out_stride.row; }

  // Whether done() can scale the rows (rounding them from the buffer): the chunk may leave that to it.
  bool scales_rows() const { return out_.rounds_to_half && out_.half_out != nullptr; }

  // The chunk's `count` rows are final, once multiplied by factors[r] where given (scales_rows()).
  void done(int64_t count, const T* factors = nullptr) {
    if constexpr (std::is_same_v<T, float>) {
      if (scales_rows()) {
        uint16_t* rows = head_row(out_.half_out, out_.out_stride, in_.heads, bh_, row0_);
        for (int64_t r = 0; r < count; ++r) {
          const float* src = buffer_.data() + r * ld_;
          uint16_t* dst = rows + r * out_.out_stride.row;
          if (factors == nullptr) {
            round_to_half(out_.half_out_kind, src, dst, in_.d_v);
          } else if (out_.half_out_kind == HalfKind::kBFloat16) {
            round_scaled(src, factors[r], reinterpret_cast<at::BFloat16*>(dst), in_.d_v);
          } else {
            round_scaled(src, factors[r], reinterpret_cast<at::Half*>(dst), in_.d_v);
          }
        }
      }
    }
  }

 private:
  const AttentionInputs<T>& in_;
  const AttentionForwardOutputs<T>& out_;
  int64_t ld_;
  CacheLineVector<T> buffer_;
  int64_t bh_ = 0, row0_ = 0;
};

}  // namespace CPU_CAPABILITY
}  // namespace fastmha::cpu
