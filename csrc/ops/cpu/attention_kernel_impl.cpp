// Fused CPU attention, compiled once per CPU capability (CPU_CAPABILITY = DEFAULT, AVX2 or AVX512, with the
// matching vector ISA flags; see csrc/CMakeLists.txt).
//
// Each chunk of queries computes only the span of keys that some row of it can see (KeySpan): keys beyond
// the last visible one (padding, causality) or before the first are masked for the whole chunk, and a -1e9
// score next to a visible key scoring well above it has weight exactly 0, so skipping them changes no result.
// A span with no masked key inside reads no mask at all. Inside a span, runs of keys that every row of the chunk
// hides (block-sparse masks) are skipped as well, and a block that every row sees all of reads no mask; the
// whole-row kernels give such runs -1e9 without a product. Where the math would still feel a skipped key (a
// row with no visible key, or none scoring well above -1e9; a NaN or infinity in a score, or one that a zero
// weight or gradient would multiply) the chunk takes all keys.
//
// Work is split into (batch*head, query chunk) tasks that the threads take as they come free (task_queue.h).
// A task computes its chunk's scores with a BLAS GEMM, then one vectorized pass per row does scale + mask +
// softmax + log-sum-exp + dropout in place, and a second GEMM applies the weights to V. Scores live in a
// per-task buffer of chunk x Lk (kept weights are written out from it): nothing of size Lq x Lk is allocated
// otherwise. The backward recomputes each chunk's softmax from the saved log-sum-exp and regenerates the
// dropout mask from the Philox (seed, offset), or takes P from the weights the forward kept (with dropout, all but
// the dropped ones, which it recomputes from a dot product each).
// It splits each head's query chunks into ranges that run in parallel (partial dK/dV per range, summed by the
// caller), so it scales even when batch*heads is small.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "ops/cpu/attention_params.h"
#include "ops/cpu/blas.h"
#include "ops/cpu/brgemm_matmul.h"
#include "ops/cpu/cache_line_buffer.h"
#include "ops/cpu/float_gemm.h"
#include "ops/cpu/gathered_dots.h"
#include "ops/cpu/key_span.h"
#include "ops/cpu/large_buffer.h"
#include "ops/cpu/philox_batch.h"
#include "ops/cpu/softmax_exp2.h"
#include "ops/cpu/task_queue.h"
#include "ops/cpu/weights_row.h"
#include "ops/cpu/widened_rows.h"
#include "ops/masked_score.h"
#include "ops/philox.h"

namespace fastmha::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

template <typename T>
struct Head {
  const T* q;
  const T* k;
  const T* v;
  const bool* mask;                      // row 0 of this head's mask, or nullptr
  const RowExtent* mask_rows = nullptr;  // row 0 of its mask rows' extents (in.mask_rows), or nullptr
  // The same rows in the half type when the products run in it (in.half), otherwise nullptr.
  const uint16_t* half_q = nullptr;
  const uint16_t* half_k = nullptr;
  const uint16_t* half_v = nullptr;
  // The keys and values as the caller gave them in a half type (in.half_source), where a forward of few query rows
  // reads them as they are (uses_half_keys_directly), otherwise nullptr; k and v are then nullptr.
  const uint16_t* direct_k = nullptr;
  const uint16_t* direct_v = nullptr;
  // This head's operands packed once (HalfOperands; with_packed_heads), or nullptr; keys 0 .. packed_keys - 1.
  const uint16_t* keys_t = nullptr;
  const uint16_t* values = nullptr;
  const uint16_t* values_t = nullptr;
  const uint16_t* keys = nullptr;
  int64_t packed_keys = 0;
};

template <typename T>
Head<T> head_pointers(const AttentionInputs<T>& in, int64_t bh) {
  const int64_t b = bh / in.heads, h = bh % in.heads;
  const bool* mask = in.mask ? in.mask + b * in.mask_stride[0] + h * in.mask_stride[1] : nullptr;
  // No q/k/v pointers when the tasks widen or copy them (in.half_source, in.copy_source: forward_chunk and
  // for_each_backward_chunk give them), nor in a forward whose products run in the half type.
  Head<T> head{head_row(in.q, in.q_stride, in.heads, bh, 0), head_row(in.k, in.k_stride, in.heads, bh, 0),
               head_row(in.v, in.v_stride, in.heads, bh, 0), mask};
  if (in.mask_rows != nullptr) {
    head.mask_rows = in.mask_rows + b * in.mask_rows_stride[0] + h * in.mask_rows_stride[1];
  }
  if (const HalfOperands& half = in.half; half.q != nullptr) {
    head.half_q = head_row(half.q, half.q_stride, in.heads, bh, 0);
    head.half_k = head_row(half.k, half.k_stride, in.heads, bh, 0);
    head.half_v = head_row(half.v, half.v_stride, in.heads, bh, 0);
    auto of_head = [bh](const PackedHeads& p) { return p.data != nullptr ? p.data + bh * p.per_head : nullptr; };
    head.keys_t = of_head(half.keys_t);
    head.values = of_head(half.values);
    head.values_t = of_head(half.values_t);
    head.keys = of_head(half.keys);
    head.packed_keys = half.packed_keys != nullptr ? half.packed_keys[bh] : in.len_k;
  }
  return head;
}

// The calling thread's operand buffers of the half-type products: one product's own operands, a chunk's rows
// padded or packed once for all its key blocks (the blocked backward's dO and Q, the online forward's Q), and the
// blocked backward's score gradients rounded once for two products (rows, then transposed).
struct HalfScratch {
  CacheLineVector<uint16_t> left, right, chunk_grad_out, chunk_q, grad_scores;
};
inline HalfScratch& half_scratch() {
  thread_local HalfScratch scratch;
  return scratch;
}

// Rows of fp32 (row stride ld, n elements each) rounded to the half type as a left operand (half_gemm.h).
template <typename T>
void rows_to_half(HalfKind kind, const T* src, int64_t ld, int64_t rows, int64_t n, uint16_t* dst) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k0 = 0; k0 < n; k0 += kMaxDepthPiece) {
        const int64_t width = std::min(kMaxDepthPiece, n - k0);
        round_to_half(kind, src + r * ld + k0, dst + left_index(r, k0, rows), width);
      }
    }
    zero_left_padding(rows, n, dst);
  } else {
    TORCH_INTERNAL_ASSERT(false, "half-type products take float scores");
  }
}

// fp32 rows (rows x n, row stride ld) transposed and rounded to the half type: a left operand of n rows of `rows`
// elements (half_gemm.h). Rows are rounded a band at a time with vector conversions, then the band is transposed
// from that small buffer in tiles of kBand x kBand 16-bit elements (ATen's vector transpose: the same bits for
// both half types), so the strided reads stay in cache.
template <typename T>
void transposed_to_half(HalfKind kind, const T* src, int64_t ld, int64_t rows, int64_t n, uint16_t* dst) {
  if constexpr (std::is_same_v<T, float>) {
    // Divides kMaxDepthPiece: a band's elements of one output row are contiguous, output rows kMaxDepthPiece apart.
    constexpr int64_t kBand = 32;
    thread_local std::vector<at::BFloat16> band;
    hold_at_least(band, kBand * n);
    for (int64_t r0 = 0; r0 < rows; r0 += kBand) {
      const int64_t height = std::min(kBand, rows - r0);
      for (int64_t r = 0; r < height; ++r) {
        round_to_half(kind, src + (r0 + r) * ld, reinterpret_cast<uint16_t*>(band.data() + r * n), n);
      }
      for (int64_t j0 = 0; j0 < n; j0 += kBand) {
        at::vec::transpose_mxn<at::BFloat16>(
            band.data() + j0, n, reinterpret_cast<at::BFloat16*>(dst + left_index(j0, r0, n)), kMaxDepthPiece,
            static_cast<int>(height), static_cast<int>(std::min(kBand, n - j0)));
      }
    }
    zero_left_padding(n, rows, dst);
  } else {
    TORCH_INTERNAL_ASSERT(false, "half-type products take float scores");
  }
}

// A left operand of m rows and n columns in the half type (half_gemm.h) transposed: a left operand of n rows of m
// elements, in tiles of 32 x 32 16-bit elements (ATen's vector transpose), with its zero padding.
inline void transposed_left(const uint16_t* src, int64_t m, int64_t n, uint16_t* dst) {
  constexpr int64_t kTile = 32;  // divides kMaxDepthPiece: a tile's rows lie in one piece of src and of dst
  for (int64_t r0 = 0; r0 < m; r0 += kTile) {
    for (int64_t j0 = 0; j0 < n; j0 += kTile) {
      at::vec::transpose_mxn<at::BFloat16>(reinterpret_cast<const at::BFloat16*>(src + left_index(r0, j0, m)),
                                           kMaxDepthPiece, reinterpret_cast<at::BFloat16*>(dst + left_index(j0, r0, n)),
                                           kMaxDepthPiece, static_cast<int>(std::min(kTile, m - r0)),
                                           static_cast<int>(std::min(kTile, n - j0)));
    }
  }
  zero_left_padding(n, m, dst);
}

// Columns lo .. lo + n of a head's packed K^T or V^T (zeros beyond its last packed key) as a right operand, when lo
// starts a panel and the pack holds them (head.packed_keys); otherwise {nullptr}: the block is packed on its own.
template <typename T>
PackedRight columns_of_head(const Head<T>& head, const uint16_t* head_pack, const PackedHeads& layout, int64_t lo,
                            int64_t n, bool vnni) {
  if (head_pack == nullptr || lo % kPanel != 0 || lo + n > head.packed_keys) {
    return {nullptr, 0};
  }
  return {head_pack + packed_index(0, lo, layout.rows, vnni), layout.rows};
}

// The right operand B = rows lo .. lo + n of a head's K or V (`src`: the head's rows in the half type, row stride ld,
// d elements each), padded_depth(n) deep. Taken from the head's pack (of `packed_keys` keys, zeros after them up to
// padded_depth(packed_keys) rows) when that depth reads only these rows and the pack's zeros (lo on a multiple of
// kDepthMultiple; n one too, or the block ends at the last packed key): the rows after a block may hold a NaN or
// an infinity, which the zero weights of the padding would turn into NaN. Otherwise the rows are packed into
// `scratch`.
inline PackedRight rows_of_head(const uint16_t* head_pack, int64_t packed_keys, const uint16_t* src, int64_t ld,
                                int64_t lo, int64_t n, int64_t d, bool vnni, CacheLineVector<uint16_t>& scratch) {
  if (head_pack != nullptr && lo % kDepthMultiple == 0 && lo + n <= packed_keys &&
      (n % kDepthMultiple == 0 || lo + n == packed_keys)) {
    return packed_from_row(head_pack, padded_depth(packed_keys), lo, vnni);
  }
  const int64_t depth = padded_depth(n);
  hold_at_least(scratch, packed_size(depth, d));
  pack_rows(src + lo * ld, ld, n, d, vnni, scratch.data());
  return {scratch.data(), depth};
}

// The right operand B = right^T for n rows of d elements (row stride right_ld): `packed` where its data is given
// (columns_of_head), otherwise those rows packed into `scratch`.
inline PackedRight transposed_right(const uint16_t* right, int64_t right_ld, PackedRight packed, int64_t n, int64_t d,
                                    bool vnni, CacheLineVector<uint16_t>& scratch) {
  if (packed.data != nullptr) {
    return packed;
  }
  const int64_t depth = padded_depth(d);
  hold_at_least(scratch, packed_size(depth, n));
  pack_transposed(right, right_ld, n, d, vnni, scratch.data());
  return {scratch.data(), depth};
}

// out (rows x n, row stride ld) = alpha * left . right^T in the half type, accumulated in fp32: `rows` rows of `d`
// elements (row stride left_ld) times n rows of d elements (row stride right_ld), whose packed panels are taken
// from `packed` where its data is given (columns_of_head).
inline void half_times_transposed(const HalfOperands& half, const uint16_t* left, int64_t left_ld, int64_t rows,
                                  const uint16_t* right, int64_t right_ld, PackedRight packed, int64_t n, int64_t d,
                                  float* out, int64_t ld, float alpha) {
  HalfScratch& scratch = half_scratch();
  const int64_t depth = padded_depth(d);
  hold_at_least(scratch.left, left_size(rows, depth));
  pad_rows(left, left_ld, rows, d, scratch.left.data());
  packed = transposed_right(right, right_ld, packed, n, d, half.vnni, scratch.right);
  half_gemm(half.kind, half.vnni, rows, n, depth, scratch.left.data(), packed, out, ld, false, alpha);
}

// scores (rows x n, row stride ld) = scale * q[row0 ..] . k[lo .. lo + n] in the half type.
template <typename T>
void half_scores(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, int64_t lo, int64_t n,
                 T* scores, int64_t ld) {
  if constexpr (std::is_same_v<T, float>) {
    const HalfOperands& half = in.half;
    half_times_transposed(half, head.half_q + row0 * half.q_stride.row, half.q_stride.row, rows,
                          head.half_k + lo * half.k_stride.row, half.k_stride.row,
                          columns_of_head(head, head.keys_t, half.keys_t, lo, n, half.vnni), n, in.d_k, scores, ld,
                          in.scale);
  } else {
    TORCH_INTERNAL_ASSERT(false, "half-type products take float scores");
  }
}

// What with_packed_heads packs into: the operands' bits (from 1 MiB on in buffers kept from call to call,
// empty_large; aligned to a cache line either way) and each head's count of packed keys.
struct PackedHeadsStorage {
  at::Tensor bits;
  std::vector<int64_t> keys;
};
constexpr size_t kPooledPacksFromBytes = size_t{1} << 20;

// The keys of each head (b * heads + h) that its query chunks multiply: up to the last key that some row of its
// mask shows (keys_up_to_last_visible), all keys without a mask or where a row shows none (then that row is
// uniform over all keys). A chunk that needs keys beyond (to keep a NaN or an infinity of a hidden value) packs
// those blocks itself.
template <typename T>
std::vector<int64_t> keys_to_pack(const AttentionInputs<T>& in) {
  const int64_t heads = in.batch * in.heads;
  std::vector<int64_t> keys(static_cast<size_t>(heads), in.len_k);
  if (in.mask_rows == nullptr) {
    return keys;
  }
  // Heads that share a mask slice (a head stride of 0) share one pass over its rows' extents.
  const bool shared = in.mask_rows_stride[1] == 0;
  at::parallel_for(0, shared ? in.batch : heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t slice = begin; slice < end; ++slice) {
      const int64_t first_head = shared ? slice * in.heads : slice;
      const int64_t n =
          keys_up_to_last_visible(head_pointers(in, first_head).mask_rows, in.mask_rows_stride[2], in.len_q, in.len_k);
      std::fill_n(keys.begin() + first_head, shared ? in.heads : 1, n);
    }
  });
  return keys;
}

// The inputs with the right operands that every query chunk of a head multiplies by packed once per head, into
// `storage` (HalfOperands: K^T and V for the forward; K^T, V^T and K for the backward), instead of once per block
// and chunk: the keys keys_to_pack gives, so that a padded batch packs only what its rows see. An operand whose head
// size, padded to the packs' 64 columns or depth, would more than double is left to the blocks (a head of 8 would
// take 8 times its memory for the whole call). Unchanged without half-type products.
template <typename T>
AttentionInputs<T> with_packed_heads(const AttentionInputs<T>& in, bool backward, PackedHeadsStorage& storage) {
  if (in.half.q == nullptr) {
    return in;
  }
  AttentionInputs<T> packed = in;
  HalfOperands& half = packed.half;
  const int64_t keys = padded_depth(in.len_k);
  const bool k_fits = padded_depth(in.d_k) <= 2 * in.d_k, v_fits = padded_depth(in.d_v) <= 2 * in.d_v;
  half.keys_t = {nullptr, k_fits ? packed_size(padded_depth(in.d_k), in.len_k) : 0, padded_depth(in.d_k)};
  half.values = {nullptr, !backward && v_fits ? packed_size(keys, in.d_v) : 0, keys};
  half.values_t = {nullptr, backward && v_fits ? packed_size(padded_depth(in.d_v), in.len_k) : 0, padded_depth(in.d_v)};
  half.keys = {nullptr, backward && k_fits ? packed_size(keys, in.d_k) : 0, keys};
  const int64_t heads = in.batch * in.heads;
  int64_t total = 0;
  for (PackedHeads* p : {&half.keys_t, &half.values, &half.values_t, &half.keys}) total += p->per_head * heads;
  if (total == 0) {  // nothing packed: every block packs its own
    return packed;
  }
  storage.bits = empty_large({total}, at::TensorOptions().dtype(at::kShort), kPooledPacksFromBytes);
  storage.keys = keys_to_pack(in);
  half.packed_keys = storage.keys.data();
  auto* next = static_cast<uint16_t*>(storage.bits.data_ptr());
  auto place = [&](PackedHeads& p) {  // p's place in storage, nullptr when it is not packed
    uint16_t* base = p.per_head > 0 ? next : nullptr;
    p.data = base;
    next += p.per_head * heads;
    return base;
  };
  uint16_t* const keys_t = place(half.keys_t);
  uint16_t* const values = place(half.values);
  uint16_t* const values_t = place(half.values_t);
  uint16_t* const keys_rows = place(half.keys);
  const int64_t k_ld = in.half.k_stride.row, v_ld = in.half.v_stride.row;
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const Head<T> head = head_pointers(in, bh);
      const int64_t n = storage.keys[bh];
      if (keys_t != nullptr) {
        pack_transposed(head.half_k, k_ld, n, in.d_k, half.vnni, keys_t + bh * half.keys_t.per_head);
      }
      if (values != nullptr) {
        pack_rows(head.half_v, v_ld, n, in.d_v, half.vnni, values + bh * half.values.per_head);
      }
      if (values_t != nullptr) {
        pack_transposed(head.half_v, v_ld, n, in.d_v, half.vnni, values_t + bh * half.values_t.per_head);
      }
      if (keys_rows != nullptr) {
        pack_rows(head.half_k, k_ld, n, in.d_k, half.vnni, keys_rows + bh * half.keys.per_head);
      }
    }
  });
  return packed;
}

// out_rows (rows x d_v, row stride out_ld) (+)= p (rows x n, row stride ld) . v[lo .. lo + n]: in the half type
// when the forward's products run in it (p rounded to it, as torch's flash kernel rounds its weights), otherwise in T.
template <typename T>
void apply_values(const AttentionInputs<T>& in, const Head<T>& head, const T* p, int64_t ld, int64_t rows, int64_t lo,
                  int64_t n, T* out_rows, int64_t out_ld, bool add) {
  if constexpr (std::is_same_v<T, float>) {
    if (head.direct_v != nullptr) {
      const HalfOperands& src = in.half_source;
      return half_rows_apply(src.kind, p, ld, rows, head.direct_v + lo * src.v_stride.row, src.v_stride.row, n, in.d_v,
                             out_rows, out_ld, add);
    }
  }
  if (head.half_v == nullptr) {
    if constexpr (std::is_same_v<T, float>) {
      // A single row (a decoding step, whose key length changes every call) that gemm runs on its vector loops
      // takes none of brgemm's places for a shape it will not meet again.
      const bool on_vector_loops = rows == 1 && single_row_on_vector_loops<T>(false, in.d_v);
      if (in.float_brgemm && !on_vector_loops &&
          brgemm_if_admitted(rows, in.d_v, n, p, ld, head.v + lo * in.v_stride.row, in.v_stride.row, out_rows, out_ld,
                             add)) {
        return;
      }
    }
    gemm<T>(false, false, rows, in.d_v, n, T(1), p, ld, head.v + lo * in.v_stride.row, in.v_stride.row,
            add ? T(1) : T(0), out_rows, out_ld);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    HalfScratch& scratch = half_scratch();
    const int64_t depth = padded_depth(n);
    hold_at_least(scratch.left, left_size(rows, depth));
    rows_to_half(in.half.kind, p, ld, rows, n, scratch.left.data());
    const PackedRight values = rows_of_head(head.values, head.packed_keys, head.half_v, in.half.v_stride.row, lo, n,
                                            in.d_v, in.half.vnni, scratch.right);
    half_gemm(in.half.kind, in.half.vnni, rows, in.d_v, depth, scratch.left.data(), values, out_rows, out_ld, add);
  }
}

// s[j] <- scale * s[j] where the mask row (its keys col_stride apart) shows key j, -1e9 where it hides it: 16 keys a
// step on AVX-512 for a row of unit stride (its bytes tested into a lane mask), a plain loop otherwise.
template <typename T>
void masked_scaled(T* s, int64_t n, T scale, const bool* mask_row, int64_t col_stride) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 scale_vec = _mm512_set1_ps(scale), masked = _mm512_set1_ps(static_cast<float>(kMaskedScore));
    for (; col_stride == 1 && j + 16 <= n; j += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mask_row + j));
      const __mmask16 seen = _mm_test_epi8_mask(bytes, bytes);
      _mm512_storeu_ps(s + j, _mm512_mask_mul_ps(masked, seen, _mm512_loadu_ps(s + j), scale_vec));
    }
  }
#endif
  for (; j < n; ++j) s[j] = mask_row[j * col_stride] ? s[j] * scale : T(kMaskedScore);
}

// The first `count` elements at s (fewer than a vector's lanes), `fill` in the other lanes, reading nothing past
// them: one masked load on AVX-512 (ATen's Vec::set, a switch, is not inlined), a copy elsewhere.
template <typename T>
Vectorized<T> load_first(const T* s, int64_t count, T fill) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << count) - 1), s);
  }
#endif
  return Vectorized<T>::set(Vectorized<T>(fill), Vectorized<T>::loadu(s, count), count);
}

// x in its first `count` lanes, zeros in the others.
template <typename T>
Vectorized<T> first_lanes(const Vectorized<T>& x, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << count) - 1), x);
  }
#endif
  return Vectorized<T>::set(Vectorized<T>(T(0)), x, count);
}

#if defined(CPU_CAPABILITY_AVX512)
// row_max of a float row on AVX-512 in two instructions per vector where at::vec::maximum takes four to keep a NaN:
// the plain max (which may drop one) and a running sum, NaN if some element is (or where infinities of both signs
// meet); std::nullopt then, and the caller takes the exact max.
inline std::optional<float> max_of_numbers(const float* s, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = lowest, m1 = lowest, sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 x0 = _mm512_loadu_ps(s + j), x1 = _mm512_loadu_ps(s + j + 16);
    m0 = _mm512_max_ps(m0, x0);
    m1 = _mm512_max_ps(m1, x1);
    sum0 = _mm512_add_ps(sum0, x0);
    sum1 = _mm512_add_ps(sum1, x1);
  }
  for (; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, s + j);
    m0 = _mm512_mask_max_ps(m0, lanes, m0, x);
    sum0 = _mm512_add_ps(sum0, x);
  }
  if (std::isnan(_mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1)))) {
    return std::nullopt;
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}
#endif

// The max of a row (NaN if any element is NaN; -inf if it is empty). Four running maxima, so that long rows are
// not held up by the latency of one chain of max instructions; the last few elements in one masked load.
template <typename T>
T row_max(const T* s, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (const std::optional<float> max = max_of_numbers(s, n)) {
      return *max;
    }
  }
#endif
  using Vec = Vectorized<T>;
  constexpr int64_t kLanes = Vec::size();
  const Vec lowest(-std::numeric_limits<T>::infinity());
  Vec m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  int64_t j = 0;
  for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
    m0 = at::vec::maximum(m0, Vec::loadu(s + j));
    m1 = at::vec::maximum(m1, Vec::loadu(s + j + kLanes));
    m2 = at::vec::maximum(m2, Vec::loadu(s + j + 2 * kLanes));
    m3 = at::vec::maximum(m3, Vec::loadu(s + j + 3 * kLanes));
  }
  for (; j + kLanes <= n; j += kLanes) m0 = at::vec::maximum(m0, Vec::loadu(s + j));
  if (j < n) {
    m1 = at::vec::maximum(m1, load_first(s + j, n - j, -std::numeric_limits<T>::infinity()));
  }
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                    at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3)));
}

// exp for the softmax. `fast` takes a polynomial exp for float: fastmha's on AVX-512 (softmax_exp2.h), torch's
// 20-ULP one elsewhere (the one its flash kernel uses); both within about 1e-6, far below fp32 attention's
// rounding, exactly 1 at 0 and exactly 0 below about -87, so uniform rows stay uniform and masked keys weigh 0.
// torch's does not return NaN for NaN or infinite arguments, so callers ask for it only when the row's max or
// log-sum-exp is finite.
template <typename T>
Vectorized<T> softmax_exp(const Vectorized<T>& x, bool fast) {
  if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    if (fast) {
      return softmax_exp_avx512(x);
    }
#endif
    return fast ? x.exp_u20() : x.exp();
  } else {
    return x.exp();
  }
}

// In place: s <- exp(s - max); returns the sum of the exponentials. A row's last few elements take one masked
// vector load rather than scalar exp calls (short rows, such as a padded batch's, are mostly such elements).
template <typename T>
T exp_shifted(T* s, int64_t n, T max, bool fast = false) {
  using Vec = Vectorized<T>;
  const Vec max_vec(max);
  Vec sum_vec(T(0));
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = softmax_exp(Vec::loadu(s + j) - max_vec, fast);
    e.store(s + j);
    sum_vec = sum_vec + e;
  }
  if (j < n) {  // the last few in one masked load: lanes beyond the row add 0
    const int64_t count = n - j;
    const Vec e = first_lanes(softmax_exp(load_first(s + j, count, T(0)) - max_vec, fast), count);
    e.store(s + j, count);
    sum_vec = sum_vec + e;
  }
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, sum_vec);
}

// In place: s <- exp(s - max(s)); returns {max, sum of the exponentials}. The caller normalizes, either the
// row itself (weights kept) or, cheaper, the row's output after the GEMM. The same exp as the online forward's.
template <typename T>
std::pair<T, T> exp_row(T* s, int64_t n) {
  if (n == 0) {
    return {-std::numeric_limits<T>::infinity(), T(0)};
  }
  const T max = row_max(s, n);
  return {max, exp_shifted(s, n, max, std::isfinite(max))};
}

template <typename T>
void scale_row(T* x, int64_t n, T factor) {
  using Vec = Vectorized<T>;
  at::vec::map([factor](Vec v) { return v * Vec(factor); }, x, x, n);
}

#if defined(CPU_CAPABILITY_AVX512)
// Whether the processor rounds fp32 to bfloat16 in one instruction (AVX512-BF16).
inline bool bfloat16_rounding_instruction() {
  static const bool instruction = __builtin_cpu_supports("avx512bf16");
  return instruction;
}
#endif

// Two vectors of floats rounded to the half type H (to nearest even) and stored at `out`: by AVX512-BF16's one
// instruction where the processor has it (this variant is compiled without its flag, hence the assembly), otherwise
// by ATen's conversion in a few integer steps. That instruction flushes results below bfloat16's normal range to
// zero: weights under 1e-38, which the softmax's exp already gives as zero.
// Only the first `count` of them where count is less than both vectors' lanes.
template <typename H>
inline void store_rounded(const Vectorized<float>& lo, const Vectorized<float>& hi, H* out,
                          int64_t count = 2 * Vectorized<float>::size()) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<H, at::BFloat16>) {
    if (bfloat16_rounding_instruction() && count == 2 * Vectorized<float>::size()) {
      __m512i bits;
      asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(bits) : "v"(__m512(hi)), "v"(__m512(lo)));  // low half from lo
      _mm512_storeu_si512(out, bits);
      return;
    }
  }
#endif
  at::vec::convert_from_float<H>(lo, hi).store(out, static_cast<int>(count));
}

#if defined(CPU_CAPABILITY_AVX512)
// exp_to_half_row's whole steps from..to of a bfloat16 row whose max is finite, where AVX512-BF16 rounds: the same
// weights, with the loop's state in registers (the generic loop reloads some of it around each store, which may
// alias anything). Returns the sum of the exponentials (added in another order than the generic loop's, so the
// row sums may differ in their last bits from a processor without AVX512-BF16).
inline __m512 bfloat16_weight_steps(const float* s, int64_t from, int64_t to, const HalfWeightExp& exp,
                                    const float* keep, const float* next, uint16_t* out) {
  const __m512 scale = _mm512_set1_ps(exp.scale), max = _mm512_set1_ps(exp.max);
  const __m512 log2e = _mm512_set1_ps(static_cast<float>(M_LOG2E));
  const auto exponent = [&](const float* at) {  // as half_weights: rounded once, then in base 2
    return _mm512_mul_ps(_mm512_fmsub_ps(_mm512_loadu_ps(at), scale, max), log2e);
  };
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (int64_t j = from; j < to; j += 32) {
    if (next != nullptr) {
      __builtin_prefetch(next + j, 0, 3);
      __builtin_prefetch(next + j + 16, 0, 3);
    }
    __m512 e0 = exp2_for_half_weights(exponent(s + j)), e1 = exp2_for_half_weights(exponent(s + j + 16));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    if (keep != nullptr) {
      e0 = _mm512_mul_ps(e0, _mm512_loadu_ps(keep + j));
      e1 = _mm512_mul_ps(e1, _mm512_loadu_ps(keep + j + 16));
    }
    __m512i bits;
    asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(bits) : "v"(e1), "v"(e0));  // low half from e0
    _mm512_storeu_si512(out + j, bits);
  }
  return _mm512_add_ps(sum0, sum1);
}
#endif

// Row r of a left operand of m rows (half_gemm.h) <- exp(scale * s - max) rounded to the half type, times the
// dropout multipliers `keep` where given, and zeros beyond n up to padded_depth(n); returns the sum of the
// exponentials (before dropout). The scale, the exp (half_weights) and the rounding of the online forward's
// exp_shifted and rows_to_half in one pass, for raw products s. `next`, where given, is the next row of scores of
// the same length, fetched into the L1 cache along the way: the next row's max reads it from there, rather than
// wait for the L2 cache (a block of scores is too large for L1).
template <typename H>
float exp_to_half_row(const float* s, int64_t n, float scale, float max, bool fast, const float* keep, uint16_t* left,
                      int64_t r, int64_t m, const float* next = nullptr) {
  using Vec = Vectorized<float>;
  constexpr int64_t kStep = 2 * Vec::size();
  static_assert(kDepthMultiple % kStep == 0 && kMaxDepthPiece % kStep == 0, "whole steps fit the padded depth");
  const HalfWeightExp exp{scale, max};
  Vec sum0(0.0f), sum1(0.0f);  // two sums: shorter chains of dependent adds
  for (int64_t k0 = 0; k0 < n; k0 += kMaxDepthPiece) {
    const int64_t end = std::min(n, k0 + kMaxDepthPiece);
    H* out = reinterpret_cast<H*>(left + left_index(r, k0, m)) - k0;
    int64_t j = k0;
#if defined(CPU_CAPABILITY_AVX512)
    if (std::is_same_v<H, at::BFloat16> && fast && bfloat16_rounding_instruction()) {
      const int64_t whole = k0 + (end - k0) / kStep * kStep;
      sum0 = sum0 + Vec(bfloat16_weight_steps(s, j, whole, exp, keep, next, reinterpret_cast<uint16_t*>(out)));
      j = whole;
    }
#endif
    for (; j + kStep <= end; j += kStep) {
      if (next != nullptr) {  // one cache line per vector of 16 floats
        __builtin_prefetch(next + j, 0, 3);
        __builtin_prefetch(next + j + Vec::size(), 0, 3);
      }
      Vec e0 = half_weights(Vec::loadu(s + j), exp, fast),
          e1 = half_weights(Vec::loadu(s + j + Vec::size()), exp, fast);
      sum0 = sum0 + e0;
      sum1 = sum1 + e1;
      if (keep != nullptr) {
        e0 = e0 * Vec::loadu(keep + j);
        e1 = e1 * Vec::loadu(keep + j + Vec::size());
      }
      store_rounded<H>(e0, e1, out + j);
    }
    if (j < end) {  // fewer than kStep elements: masked loads, lanes beyond the row weigh 0
      const int64_t count0 = std::min<int64_t>(end - j, Vec::size()), count1 = end - j - count0;
      const Vec zero(0.0f);
      const auto weights = [&](int64_t at, int64_t count) {
        if (count == 0) {
          return zero;
        }
        const Vec e = first_lanes(half_weights(load_first(s + at, count, 0.0f), exp, fast), count);
        sum0 = sum0 + e;
        return keep != nullptr ? e * load_first(keep + at, count, 0.0f) : e;
      };
      const Vec w0 = weights(j, count0), w1 = weights(j + Vec::size(), count1);  // in this order: the sum's
      // A whole step: the zeros beyond the row land in the operand's padding (depths are multiples of
      // kDepthMultiple, itself a multiple of kStep, and the piece's row holds kMaxDepthPiece elements).
      store_rounded<H>(w0, w1, out + j);
      j += kStep;
    }
    if (end == n) {  // the row's last piece: zeros up to the product's depth
      std::fill(out + j, out + k0 + std::min(kMaxDepthPiece, padded_depth(n) - k0), H(0.0f));
    }
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum0 + sum1);
}

// Dropout multipliers (0 or 1/(1-p)) of elements first .. first + n - 1 of the (B, H, Lq, Lk) score layout.
template <typename T>
void fill_keep(const AttentionInputs<T>& in, uint64_t first, int64_t n, std::vector<uint32_t>& words, T* keep) {
  fill_multipliers(in.seed, in.offset, static_cast<float>(in.dropout_p), T(1.0 / (1.0 - in.dropout_p)), first, n, words,
                   keep);
}

// The keys [lo, hi) a chunk of queries computes; every key outside is masked for each row of the chunk.
// `masked`: some key inside may be masked, so the mask is read.
struct KeySpan {
  int64_t lo, hi;
  bool masked;
  bool row_without_key = false;  // some row of the chunk sees no key: all keys, none of them skipped
  // Every row of the chunk sees one run of keys, its mask row's extent (RowExtent without holes): the blocks hide
  // the keys outside each row's run without reading the mask (padding, causal and padding & causal masks).
  bool runs = false;
  // With runs: they all start at lo or all end at hi - 1, so that together they leave no key of [lo, hi) hidden
  // from every row.
  bool one_run = false;
  int64_t size() const { return hi - lo; }
};

// A chunk's score rows are packed in a task buffer with this row stride, so that a short span of long rows
// stays dense in cache.
inline int64_t packed_ld(const KeySpan& span) { return std::max<int64_t>(span.size(), 1); }

// Dropout multipliers of a chunk's rows over its key span, packed (row stride = the span's size): one pass
// when the rows are contiguous in the score layout (all keys), so short rows do not each pay for a Philox
// batch.
template <typename T>
void fill_chunk_keep(const AttentionInputs<T>& in, int64_t first_row, int64_t rows, const KeySpan& span,
                     std::vector<uint32_t>& words, T* keep) {
  const int64_t n = span.size();
  if (n == in.len_k) {
    fill_keep(in, static_cast<uint64_t>(first_row * n), rows * n, words, keep);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    fill_keep(in, static_cast<uint64_t>((first_row + r) * in.len_k + span.lo), n, words, keep + r * n);
  }
}

// The extent of query row `query`'s mask row (head.mask_rows holds them).
template <typename T>
const RowExtent& row_extent(const AttentionInputs<T>& in, const Head<T>& head, int64_t query) {
  return head.mask_rows[query * in.mask_rows_stride[2]];
}

// The keys rows row0 .. row0+rows-1 can see. With is_causal, query i attends keys j <= i, so the chunk needs
// only the first row0 + rows keys. With a mask, the span shrinks to the chunk's first and last visible key
// (rows whose mask rows coincide, a broadcast row stride of 0, are read once). A chunk with no visible key
// at all takes all keys: its rows are uniform over all of them (the -1e9 rule).
template <typename T>
KeySpan visible_span(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows) {
  const int64_t limit = in.is_causal ? std::min(in.len_k, row0 + rows) : in.len_k;
  if (head.mask == nullptr) {
    return {0, limit, false};
  }
  const int64_t col_stride = in.mask_stride[3];
  if (col_stride == 0) {  // one value per row, broadcast over the keys: nothing to narrow
    return {0, limit, true};
  }
  int64_t lo = limit, hi = 0, latest_first = 0, earliest_last = limit;
  bool holes = false, runs = true;
  const int64_t distinct_rows = in.mask_stride[2] == 0 ? 1 : rows;
  for (int64_t r = 0; r < distinct_rows; ++r) {
    const bool* row = head.mask + (row0 + r) * in.mask_stride[2];
    // From the row's extent where found and within the limit; otherwise (with is_causal, a row that shows keys
    // beyond the chunk's limit) by a search of the row up to the limit.
    const RowExtent* extent =
        head.mask_rows != nullptr ? head.mask_rows + (row0 + r) * in.mask_rows_stride[2] : nullptr;
    if (extent != nullptr && extent->last >= limit) {
      extent = nullptr;
    }
    const auto [first, last] =
        extent != nullptr ? std::pair{extent->first, extent->last} : visible_range(row, col_stride, limit);
    if (first > last) {
      return {0, in.len_k, true, true};  // a row with no visible key: uniform over all keys
    }
    lo = std::min(lo, first);
    hi = std::max(hi, last + 1);
    latest_first = std::max(latest_first, first);
    earliest_last = std::min(earliest_last, last);
    holes = holes || (extent != nullptr ? extent->holes : has_hidden_key(row, col_stride, first, last));
    runs = runs && extent != nullptr && !extent->holes;
  }
  if (lo >= hi) {
    return {0, in.len_k, true};
  }
  // Rows with a narrower range than the union see masked keys at the span's edges: with runs, a row whose run
  // starts after lo or ends before hi - 1.
  if (runs) {
    holes = latest_first > lo || earliest_last < hi - 1;
  }
  for (int64_t r = 0; r < distinct_rows && !holes && !runs; ++r) {
    const bool* row = head.mask + (row0 + r) * in.mask_stride[2];
    holes = !row[lo * col_stride] || !row[(hi - 1) * col_stride];
  }
  return {lo, hi, holes, false, runs, runs && (latest_first == lo || earliest_last == hi - 1)};
}

// What hides keys of one row of a block: its mask entries (mask_row, the entry for the block's first key,
// col_stride apart; nullptr: none to read) and every key outside [from, to) in block coordinates (the row's run
// of visible keys, its causal limit).
struct RowHiding {
  const bool* mask_row;
  int64_t col_stride, from, to;
};

template <typename T>
RowHiding row_hiding(const AttentionInputs<T>& in, const Head<T>& head, const KeySpan& block, int64_t query) {
  RowHiding hiding{nullptr, 0, 0, block.size()};
  if (block.masked && block.runs) {
    const RowExtent& extent = row_extent(in, head, query);
    hiding.from = extent.first - block.lo;
    hiding.to = extent.last + 1 - block.lo;
  } else if (block.masked) {
    hiding.mask_row = head.mask + query * in.mask_stride[2] + block.lo * in.mask_stride[3];
    hiding.col_stride = in.mask_stride[3];
  }
  if (in.is_causal) {
    hiding.to = std::min(hiding.to, query + 1 - block.lo);
  }
  return hiding;
}

// One row of n raw products s of a block: s <- scale * s where `hiding` shows the key, -1e9 where it hides it.
template <typename T>
void hide_keys(T* s, int64_t n, T scale, const RowHiding& hiding) {
  if (hiding.mask_row != nullptr) {
    masked_scaled(s, n, scale, hiding.mask_row, hiding.col_stride);
  } else if (scale != T(1)) {
    scale_row(s, n, scale);
  }
  const int64_t from = std::clamp<int64_t>(hiding.from, 0, n);
  std::fill(s, s + from, T(kMaskedScore));
  std::fill(s + std::clamp<int64_t>(hiding.to, from, n), s + n, T(kMaskedScore));
}

// Score row r, key j of a block (lo <= j < hi) = scale * q[row0 + r] . k[j] for r < rows, then the masks (-1e9)
// (the mask is read only when block.masked), into scores (row stride ld).
template <typename T>
void block_scores(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, const KeySpan& block,
                  T* scores, int64_t ld) {
  const int64_t n = block.size();
  if (head.half_q != nullptr) {
    half_scores(in, head, row0, rows, block.lo, n, scores, ld);
  } else if (head.direct_k != nullptr) {
    if constexpr (std::is_same_v<T, float>) {
      const HalfOperands& src = in.half_source;
      half_rows_dots(src.kind, head.q + row0 * in.q_stride.row, in.q_stride.row, rows,
                     head.direct_k + block.lo * src.k_stride.row, src.k_stride.row, n, in.d_k, in.scale, scores, ld);
    }
  } else {
    gemm<T>(false, true, rows, n, in.d_k, in.scale, head.q + row0 * in.q_stride.row, in.q_stride.row,
            head.k + block.lo * in.k_stride.row, in.k_stride.row, T(0), scores, ld);
  }
  for (int64_t r = 0; r < rows && (block.masked || in.is_causal); ++r) {
    hide_keys(scores + r * ld, n, T(1), row_hiding(in, head, block, row0 + r));
  }
}

// next_visible_block over the chunk's mask rows: the next run of at most max_keys keys in [from, end) that some
// row of the chunk sees.
template <typename T>
KeySpan visible_run(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, int64_t from,
                    int64_t end, int64_t max_keys) {
  const KeyBlock run = next_visible_block(head.mask + row0 * in.mask_stride[2], in.mask_stride[2], in.mask_stride[3],
                                          rows, from, end, max_keys);
  return {run.lo, run.hi, run.masked};
}

// next_block for a chunk whose rows each see one run of keys (KeySpan::runs), from their extents: it starts at the
// first key from `from` on that some row sees and ends after the last one some row sees within in.key_block keys,
// or earlier, before a gap of kSplitGap keys or more that every row hides (as next_visible_block's runs).
template <typename T>
KeySpan next_run_block(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, int64_t end,
                       int64_t from) {
  const int64_t distinct_rows = in.mask_rows_stride[2] == 0 ? 1 : rows;
  int64_t lo = end, latest_first = 0, earliest_last = end;
  for (int64_t r = 0; r < distinct_rows; ++r) {
    const RowExtent& extent = row_extent(in, head, row0 + r);
    if (extent.last >= from) lo = std::min(lo, std::max(extent.first, from));
    latest_first = std::max(latest_first, extent.first);
    earliest_last = std::min(earliest_last, extent.last);
  }
  if (lo >= end) {
    return {end, end, false};
  }
  const int64_t limit = std::min(lo + in.key_block, end);
  int64_t hi = lo + 1;
  for (bool grew = true; grew;) {  // until no row's run starts within a gap's length of the block's end
    grew = false;
    for (int64_t r = 0; r < distinct_rows; ++r) {
      const RowExtent& extent = row_extent(in, head, row0 + r);
      const int64_t end_of_run = std::min(extent.last + 1, limit);
      if (extent.first < std::min(hi + kSplitGap, limit) && extent.last >= lo && end_of_run > hi) {
        hi = end_of_run;
        grew = true;
      }
    }
  }
  // Some row hides a key of the block: its run starts after lo or ends before hi - 1.
  return {lo, hi, latest_first > lo || earliest_last < hi - 1, false, true};
}

// The next block of a chunk's span from key `from`: in.key_block keys, or, with `narrow` and a mask to read, the
// next run of at most in.key_block keys that some row of the chunk sees (keys every row hides are skipped), read
// without the mask when every row sees all of it. Empty when no row sees a key from `from` on.
template <typename T>
KeySpan next_block(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, const KeySpan& span,
                   int64_t from, bool narrow) {
  if (!narrow || !span.masked) {
    return {from, std::min(from + in.key_block, span.hi), span.masked, false, span.runs};
  }
  if (span.runs) {
    // A span of one block without a gap is that block: its first and last keys, and whether a row sees less, are
    // the span's.
    return from == span.lo && span.size() <= in.key_block && span.one_run
               ? span
               : next_run_block(in, head, row0, rows, span.hi, from);
  }
  return visible_run(in, head, row0, rows, from, span.hi, in.key_block);
}

// Keys per run of the whole-row scores (next_visible_block): keys that every row of the chunk hides get -1e9
// without a product, and a run that every row sees all of is computed without reading the mask.
constexpr int64_t kScoreRun = 128;

// The scores of a chunk over its whole span (row stride packed_ld(span)), run by run when a mask is read: the
// same numbers as one product over the span followed by the mask.
template <typename T>
void span_scores(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, const KeySpan& span,
                 T* scores) {
  const int64_t ld = packed_ld(span);
  if (!span.masked) {
    return block_scores(in, head, row0, rows, span, scores, ld);
  }
  auto fill_masked = [&](int64_t from, int64_t to) {
    for (int64_t r = 0; r < rows && from < to; ++r) {
      std::fill(scores + r * ld + (from - span.lo), scores + r * ld + (to - span.lo), T(kMaskedScore));
    }
  };
  for (int64_t from = span.lo; from < span.hi;) {
    const KeySpan run = visible_run(in, head, row0, rows, from, span.hi, kScoreRun);
    fill_masked(from, run.lo);
    if (run.size() > 0) {
      block_scores(in, head, row0, rows, run, scores + (run.lo - span.lo), ld);
    }
    from = run.hi;
  }
}

// The skipped keys' weight in the math, exp(-1e9 - max) / sum, must be exactly 0 for a row whose scores peak
// at `max`: it is not in a row with no visible key, with scores near or below -1e9, or with a NaN or infinite
// score (then it is NaN).
template <typename T>
bool skipped_keys_weigh_zero(T max) {
  return std::isfinite(max) && std::exp(T(kMaskedScore) - max) == T(0);
}

// span_scores, and whether skipping the keys outside the span changes no weight. When it returns false, a row
// came out masked everywhere (uniform over all Lk keys by the -1e9 rule) or with no score well above -1e9, and
// the caller recomputes the chunk over all keys.
template <typename T>
bool chunk_scores(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, const KeySpan& span,
                  T* scores) {
  span_scores(in, head, row0, rows, span, scores);
  const int64_t ld = packed_ld(span), n = span.size();
  bool complete = true;
  if (n < in.len_k && n > 0) {
    for (int64_t r = 0; r < rows; ++r) complete = complete && skipped_keys_weigh_zero(row_max(scores + r * ld, n));
  }
  return complete;
}

// Whether rows [0, rows) of x (d wide, row stride ld) are all zero; a nonzero block usually ends the scan at its
// first element.
template <typename T>
bool all_zero(const T* x, int64_t ld, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < d; ++i) {
      if (x[r * ld + i] != T(0)) {
        return false;
      }
    }
  }
  return true;
}

// Zeroes rows [0, rows) of x (d wide, row stride ld).
template <typename T>
void zero_rows(T* x, int64_t ld, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) std::fill(x + r * ld, x + r * ld + d, T(0));
}

// Whether rows [from, to) of a value matrix hold only finite numbers (x * 0 is 0 for those, NaN otherwise).
template <typename T>
bool finite_rows(const T* v, int64_t row_stride, int64_t from, int64_t to, int64_t d) {
  using Vec = Vectorized<T>;
  Vec acc(T(0));
  T tail(0);
  for (int64_t i = from; i < to; ++i) {
    const T* row = v + i * row_stride;
    int64_t j = 0;
    for (; j + Vec::size() <= d; j += Vec::size()) acc = acc + Vec::loadu(row + j) * Vec(T(0));
    for (; j < d; ++j) tail += row[j] * T(0);
  }
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, acc) + tail == T(0);
}

// finite_rows of a half-type matrix (bits, row stride row_stride).
inline bool finite_half_rows(HalfKind kind, const uint16_t* x, int64_t row_stride, int64_t from, int64_t to,
                             int64_t d) {
  if (row_stride == d) {  // one run
    return all_finite_bits(kind, x + from * d, (to - from) * d);
  }
  bool finite = true;
  for (int64_t i = from; i < to && finite; ++i) finite = all_finite_bits(kind, x + i * row_stride, d);
  return finite;
}

// The first and the last key of a head whose key or value row holds a NaN or an infinity, found once per head
// (a task keeps one of these and walks its chunks head by head). A zero weight times such a value is NaN in
// the forward; a zero score gradient times such a key is NaN in dQ. The forward looks at the values only
// (`with_keys` false): the score of a hidden key is -1e9 whatever the key holds.
template <typename T>
class NonFiniteKeys {
 public:
  explicit NonFiniteKeys(bool with_keys) : with_keys_(with_keys) {}

  // Whether such a key lies outside the span (a skipped key).
  bool outside(const AttentionInputs<T>& in, const Head<T>& head, int64_t head_index, const KeySpan& span) {
    scan(in, head, head_index);
    return first_ <= last_ && (first_ < span.lo || last_ >= span.hi);
  }

  // Whether the head has such a key at all.
  bool any(const AttentionInputs<T>& in, const Head<T>& head, int64_t head_index) {
    scan(in, head, head_index);
    return first_ <= last_;
  }

 private:
  void scan(const AttentionInputs<T>& in, const Head<T>& head, int64_t head_index) {
    if (head_index == head_index_) {
      return;
    }
    head_index_ = head_index;
    first_ = in.len_k;
    last_ = -1;
    // Read in the half type where the products run in it (the forward has no widened copy then).
    const HalfOperands& half = in.half;
    const HalfOperands& src = in.half_source;
    auto finite = [&](int64_t from, int64_t to) {
      const bool values =
          head.half_v != nullptr     ? finite_half_rows(half.kind, head.half_v, half.v_stride.row, from, to, in.d_v)
          : head.direct_v != nullptr ? finite_half_rows(src.kind, head.direct_v, src.v_stride.row, from, to, in.d_v)
                                     : finite_rows(head.v, in.v_stride.row, from, to, in.d_v);
      return values &&
             (!with_keys_ ||
              (head.half_k != nullptr ? finite_half_rows(half.kind, head.half_k, half.k_stride.row, from, to, in.d_k)
               : head.direct_k != nullptr
                   ? finite_half_rows(src.kind, head.direct_k, src.k_stride.row, from, to, in.d_k)
                   : finite_rows(head.k, in.k_stride.row, from, to, in.d_k)));
    };
    if (!finite(0, in.len_k)) {
      for (int64_t i = 0; i < in.len_k; ++i) {
        if (!finite(i, i + 1)) {
          first_ = std::min(first_, i);
          last_ = i;
        }
      }
    }
  }

  bool with_keys_;
  int64_t head_index_ = -1, first_ = 0, last_ = -1;
};

// Whether query rows row0 .. row0 + rows of a head are all finite, read in the half type where the products run in it.
template <typename T>
bool query_rows_finite(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows) {
  return head.half_q != nullptr
             ? finite_half_rows(in.half.kind, head.half_q, in.half.q_stride.row, row0, row0 + rows, in.d_k)
             : finite_rows(head.q, in.q_stride.row, row0, row0 + rows, in.d_k);
}

// The keys a chunk computes: its visible span, or all keys when asked or when a skipped key holds a NaN or an
// infinity (a weight or score gradient of exactly 0 there keeps it: 0 * inf is NaN).
template <typename T>
KeySpan chunk_span(const AttentionInputs<T>& in, const Head<T>& head, int64_t head_index, int64_t row0, int64_t rows,
                   NonFiniteKeys<T>& non_finite, bool all_keys) {
  const KeySpan all{0, in.len_k, head.mask != nullptr};
  const KeySpan span = all_keys ? all : visible_span(in, head, row0, rows);
  return span.size() < in.len_k && non_finite.outside(in, head, head_index, span) ? all : span;
}

template <typename T>
KeySpan scores_for_chunk(const AttentionInputs<T>& in, const Head<T>& head, int64_t head_index, int64_t row0,
                         int64_t rows, T* scores, NonFiniteKeys<T>& non_finite, bool all_keys = false) {
  const KeySpan span = chunk_span(in, head, head_index, row0, rows, non_finite, all_keys);
  if (chunk_scores(in, head, row0, rows, span, scores)) {
    return span;
  }
  const KeySpan all{0, in.len_k, head.mask != nullptr};
  chunk_scores(in, head, row0, rows, all, scores);
  return all;
}

// Folds a block of a row, whose scores peak at block_max, into the row's running max and sum (the online softmax):
// exponentiate(now, fast) turns the block's scores into its weights exp(score - now) and returns their sum, and the
// returned factor rescales what was accumulated against the old max (1 when it stayed). While every score so far
// is -inf the row gets no weight yet: no_weight() gives the block zeros. A NaN max stays NaN.
template <typename T, typename Exponentiate, typename NoWeight>
T fold_into_row(T block_max, T& max, T& sum, const Exponentiate& exponentiate, const NoWeight& no_weight) {
  const T old = max;
  const T now = std::isnan(block_max) || block_max > old ? block_max : old;
  if (now == -std::numeric_limits<T>::infinity()) {
    no_weight();
    return T(1);
  }
  // 0 for the first finite block (without a call of exp: most rows of a padded batch have only one block)
  const T rescale = old == -std::numeric_limits<T>::infinity() && !std::isnan(now) ? T(0) : std::exp(old - now);
  sum = sum * rescale + exponentiate(now, std::isfinite(now));
  max = now;
  return rescale;
}

// fold_into_row for a block of scores s, which become the weights in place.
template <typename T>
T fold_block(T* s, int64_t n, T& max, T& sum) {
  return fold_into_row(
      row_max(s, n), max, sum, [&](T now, bool fast) { return exp_shifted(s, n, now, fast); },
      [&] { std::fill(s, s + n, T(0)); });
}

// Per-task buffers of the online-softmax forward: one key block of scores (and dropout multipliers) per row.
template <typename T>
struct OnlineBuffers {
  CacheLineVector<T> scores, keep, max, sum;
  std::vector<uint32_t> words;
};

// Row stride of the online forward's score buffer: the key block rounded up to a power of two of at least kPanel
// (its half-type products write whole panels, and ATen keeps a kernel for every row stride, so the strides come
// in a few classes whatever the lengths), plus a panel that keeps it off powers of two, whose rows share cache sets
// (on an Intel Xeon with AMX the products of 1024 keys into a stride of 1088 floats ran 1.25x as fast as into 1024).
inline int64_t online_scores_ld(int64_t key_block) {
  int64_t ld = kPanel;
  while (ld < key_block) ld *= 2;
  return ld + kPanel;
}

// One block of online_chunk whose products run in the half type: the kernels write the raw products Q K^T in place
// (q_left: the chunk's query rows as a left operand), one pass per row folds them into the running max and sum and
// leaves the weights in the half type as the left operand of P V, whose products are added to the output rows
// (after rescaling them when a row's max grew). A block that a row may not see all of (a mask to read, a causal
// cut) first gets its scores scaled and masked in place, row by row. Returns as online_chunk's block would: the
// same numbers up to rounding (the scale and the max may fuse into one instruction), fewer passes over the scores.
// Only the chunk's rows from `skip` on (a multiple of kRowMultiple; see causal_pieces) take part. With `prefixes`,
// a row may take its weights over the first keys it sees alone; returns whether one did.
template <typename T>
bool fold_half_block(const AttentionInputs<T>& in, const Head<T>& head, LeftOperand chunk_q, int64_t chunk_row0,
                     int64_t chunk_rows, int64_t skip, int64_t chunk_first_row, const KeySpan& block, bool prefixes,
                     OnlineBuffers<T>& buf, T* chunk_out, int64_t out_ld, bool computed) {
  if constexpr (std::is_same_v<T, float>) {
    const HalfOperands& half = in.half;
    HalfScratch& scratch = half_scratch();
    const int64_t row0 = chunk_row0 + skip, rows = chunk_rows - skip, first_row = chunk_first_row + skip;
    // A suffix of a laid-out operand starts skip rows into its first depth piece: one piece deep only.
    TORCH_INTERNAL_ASSERT(skip == 0 || (skip % kRowMultiple == 0 && padded_depth(in.d_k) <= kMaxDepthPiece));
    const LeftOperand q_left(chunk_q.data + skip * chunk_q.row_stride(), chunk_q.ld);
    T* const out_rows = chunk_out + skip * out_ld;
    T* const max = buf.max.data() + skip;
    T* const sum = buf.sum.data() + skip;
    const int64_t n = block.size(), ld = online_scores_ld(in.key_block), depth_k = padded_depth(in.d_k);
    const PackedRight keys = transposed_right(head.half_k + block.lo * half.k_stride.row, half.k_stride.row,
                                              columns_of_head(head, head.keys_t, half.keys_t, block.lo, n, half.vnni),
                                              n, in.d_k, half.vnni, scratch.right);
    half_gemm_in_place(half.kind, half.vnni, rows, n, depth_k, q_left, keys, buf.scores.data(), ld);
    if (in.dropout_p > 0) {
      fill_chunk_keep(in, first_row, rows, block, buf.words, buf.keep.data());
    }
    const int64_t depth = padded_depth(n);
    hold_at_least(scratch.left, left_size(rows, depth));
    const bool cut = in.is_causal && block.hi > row0 + 1;  // some row's causal limit falls inside the block
    bool cut_short = false;
    for (int64_t r = 0; r < rows; ++r) {
      float* s = buf.scores.data() + r * ld;
      const float* next = r + 1 < rows ? s + ld : nullptr;
      const float* keep = in.dropout_p > 0 ? buf.keep.data() + r * n : nullptr;
      uint16_t* left = scratch.left.data();
      // Unmasked rows keep their raw products: their max times the scale is the scaled scores' max (the scale is
      // positive), and the exp pass scales them.
      float scale = in.scale, block_max = 0.0f;
      const RowHiding hiding =
          block.masked || cut ? row_hiding(in, head, block, row0 + r) : RowHiding{nullptr, 0, 0, n};
      // A row that sees the block's first `seen` keys and no more (its causal limit, the end of its run) takes its
      // max and weights over them, zeros beyond: the weights exp(-1e9 - max) of the keys it does not see, exactly,
      // where the row's final max leaves them 0 (checked by online_chunk, as for skipped keys).
      const bool prefix = prefixes && hiding.mask_row == nullptr && hiding.from <= 0 && hiding.to > 0 && hiding.to < n;
      const int64_t seen = prefix ? hiding.to : n;
      cut_short = cut_short || prefix;
      if (!prefix && (hiding.mask_row != nullptr || hiding.from > 0 || hiding.to < n)) {  // keys to hide in place
        hide_keys(s, n, in.scale, hiding);
        scale = 1.0f;
        block_max = row_max(s, n);
      } else {
        block_max = row_max(s, seen) * in.scale;
      }
      const auto zeros_from = [&](int64_t from) {  // the row's weights from column `from` to the product's depth
        for (int64_t k0 = from / kMaxDepthPiece * kMaxDepthPiece; k0 < depth; k0 += kMaxDepthPiece) {
          const int64_t start = std::max(from, k0), stop = std::min(depth, k0 + kMaxDepthPiece);
          std::fill_n(left + left_index(r, start, rows), stop - start, uint16_t{0});
        }
      };
      const float rescale = fold_into_row(
          block_max, max[r], sum[r],
          [&](float now, bool fast) {
            const float weights =
                half.kind == HalfKind::kBFloat16
                    ? exp_to_half_row<at::BFloat16>(s, seen, scale, now, fast, keep, left, r, rows, next)
                    : exp_to_half_row<at::Half>(s, seen, scale, now, fast, keep, left, r, rows, next);
            zeros_from(padded_depth(seen));
            return weights;
          },
          [&] { zeros_from(0); });
      if (computed && rescale != 1.0f) {
        scale_row(out_rows + r * out_ld, in.d_v, rescale);
      }
    }
    zero_padding_rows(rows, n, scratch.left.data());
    const PackedRight values = rows_of_head(head.values, head.packed_keys, head.half_v, half.v_stride.row, block.lo, n,
                                            in.d_v, half.vnni, scratch.right);
    half_gemm_in_place(half.kind, half.vnni, rows, in.d_v, depth, scratch.left.data(), values, out_rows, out_ld,
                       computed);
    return cut_short;
  } else {
    TORCH_INTERNAL_ASSERT(false, "half-type products take float scores");
    return false;
  }
}

// lse[r] = max[r] + log(sum[r]) for n rows, a vector of rows at a time.
template <typename T>
void log_sum_exp(const T* max, const T* sum, int64_t n, T* lse) {
  at::vec::map2([](Vectorized<T> m, Vectorized<T> s) { return m + s.log(); }, lse, max, sum, n);
}

// With is_causal, row r of a chunk sees keys up to row0 + r: the later a key of a block cut by causality, the fewer
// of the chunk's rows see it. fold(skip, piece) folds the block in pieces of kCausalPieceKeys keys from row0 on
// (the keys before, which every row sees, with the first), each for the rows from `skip` on, the first that see a
// key of it: the products skip the rows above the diagonal in steps of a piece, most of the block's triangle. On an
// Intel Xeon with AMX (8 heads, d_k 64, 128-1024 keys) the float32 forward took 0.81-0.86x the time of whole
// blocks; in bfloat16 products on AMX tiles, where a piece's fixed costs weigh more, 0.92-1.03x. Pieces start on
// kPanel keys past row0 (a multiple of kPanel), where the heads' packs serve them (columns_of_head; blocks of other
// sizes pack their own), and skip a multiple of kRowMultiple rows of a left operand one depth piece deep
// (fold_half_block). Called with `pieces` only where the rows' skipped keys can weigh 0 (online_chunk
// checks each row's final max, as for skipped keys): no mask (every row sees key 0, so the span's first block
// computes every row's output), no NaN or infinite value among the values.
constexpr int64_t kCausalPieceKeys = 64;
static_assert(kCausalPieceKeys % kPanel == 0 && kCausalPieceKeys % kRowMultiple == 0);

template <typename T, typename Fold>
void causal_pieces(const AttentionInputs<T>& in, int64_t row0, int64_t rows, const KeySpan& block, bool pieces,
                   const Fold& fold) {
  if (!pieces || rows <= kCausalPieceKeys || block.hi <= row0 + kCausalPieceKeys || row0 % kPanel != 0 ||
      padded_depth(in.d_k) > kMaxDepthPiece) {
    fold(0, block);
    return;
  }
  for (int64_t lo = block.lo; lo < block.hi;) {
    const int64_t piece = std::max<int64_t>(0, (lo - row0) / kCausalPieceKeys);
    KeySpan part = block;
    part.lo = lo;
    part.hi = std::min(block.hi, row0 + (piece + 1) * kCausalPieceKeys);
    fold(piece * kCausalPieceKeys, part);
    lo = part.hi;
  }
}

// The output rows of a chunk over its key span, without kept weights: the span is walked in blocks of at most
// in.key_block keys with an online softmax. Each block's scores are exponentiated against the running row max,
// and the output accumulated so far is rescaled whenever that max grows, so only rows x key_block scores exist
// at a time and they stay in cache at any Lk. With `narrow`, runs of keys that every row of the chunk hides are
// skipped (next_block). Returns false when keys were skipped and a row's final max leaves them a weight other
// than exactly 0 (see skipped_keys_weigh_zero): the caller redoes the chunk over all keys. The rows are normalized
// in place, or, given row_factors, left to the caller to multiply by them (as it rounds them to a half type).
template <typename T>
bool online_chunk(const AttentionInputs<T>& in, const Head<T>& head, int64_t row0, int64_t rows, int64_t first_row,
                  const KeySpan& span, bool narrow, bool pieces, OnlineBuffers<T>& buf, T* out_rows, int64_t out_ld,
                  T* lse, T* row_factors) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  std::fill(buf.max.begin(), buf.max.begin() + rows, kNegInf);
  std::fill(buf.sum.begin(), buf.sum.begin() + rows, T(0));
  bool skipped = span.size() < in.len_k, computed = false;
  // The chunk's query rows as the left operand of its blocks' half-type products: read in place where they need
  // no padding (a multiple of 16 rows, a head size of whole depth multiples) and their row stride is a power of two
  // (ATen keeps a kernel for every stride: this keeps them to a few classes), otherwise padded once.
  LeftOperand q_left{nullptr};
  if (head.half_q != nullptr) {
    const int64_t ld = in.half.q_stride.row;
    const uint16_t* q_rows = head.half_q + row0 * ld;
    if (computed_rows(rows) == rows && in.d_k % kDepthMultiple == 0 && (ld & (ld - 1)) == 0) {
      q_left = LeftOperand(q_rows, ld);
    } else {
      CacheLineVector<uint16_t>& chunk_q = half_scratch().chunk_q;
      hold_at_least(chunk_q, left_size(rows, padded_depth(in.d_k)));
      pad_rows(q_rows, ld, rows, in.d_k, chunk_q.data());
      q_left = LeftOperand(chunk_q.data());
    }
  }
  for (int64_t from = span.lo; from < span.hi;) {
    const KeySpan block = next_block(in, head, row0, rows, span, from, narrow);
    skipped = skipped || block.lo > from;
    if (block.size() == 0) {
      break;
    }
    from = block.hi;
    causal_pieces(in, row0, rows, block, pieces, [&](int64_t skip, const KeySpan& piece) {
      if (q_left.data != nullptr) {
        const bool cut_short = fold_half_block(in, head, q_left, row0, rows, skip, first_row, piece, pieces || narrow,
                                               buf, out_rows, out_ld, computed);
        skipped = skipped || skip > 0 || cut_short;
        computed = true;
        return;
      }
      const int64_t n = piece.size(), m = rows - skip;
      skipped = skipped || skip > 0;
      T* const piece_out = out_rows + skip * out_ld;
      block_scores(in, head, row0 + skip, m, piece, buf.scores.data(), n);
      if (in.dropout_p > 0) {
        fill_chunk_keep(in, first_row + skip, m, piece, buf.words, buf.keep.data());
      }
      for (int64_t r = 0; r < m; ++r) {
        T* s = buf.scores.data() + r * n;
        const T rescale = fold_block(s, n, buf.max[skip + r], buf.sum[skip + r]);
        if (computed && rescale != T(1)) {
          scale_row(piece_out + r * out_ld, in.d_v, rescale);
        }
        if (in.dropout_p > 0) {
          at::vec::map2([](Vectorized<T> a, Vectorized<T> b) { return a * b; }, s, s, buf.keep.data() + r * n, n);
        }
      }
      apply_values(in, head, buf.scores.data(), n, m, piece.lo, n, piece_out, out_ld, computed);
      computed = true;
    });
  }
  if (!computed) {  // no key at all (Lk = 0), or every key skipped: zero outputs
    zero_rows(out_rows, out_ld, rows, in.d_v);
  }
  bool complete = true;
  log_sum_exp(buf.max.data(), buf.sum.data(), rows, lse);
  for (int64_t r = 0; r < rows; ++r) {
    const T factor = computed ? T(1) / buf.sum[r] : T(1);
    if (row_factors != nullptr) {
      row_factors[r] = factor;
    } else if (computed) {
      scale_row(out_rows + r * out_ld, in.d_v, factor);
    }
    complete = complete && (!skipped || skipped_keys_weigh_zero(buf.max[r]));
  }
  return complete;
}

// Forward task `task` of a head's `chunks` query chunks of `chunk` rows: head bh (= batch index * heads + head
// index), rows row0 .. row0 + rows, the first of them row first_row of (B*H*Lq).
template <typename T>
struct ForwardChunk {
  int64_t bh, row0, rows, first_row;
  Head<T> head;
};

// Points head bh's q/k/v at the task's widened rows, query rows row0 .. row0 + rows, when the tasks widen them
// (in.widen_in_tasks); leaves them otherwise.
template <typename T>
void use_widened_rows(const AttentionInputs<T>& in, WidenedHead<T>& widened, int64_t bh, int64_t row0, int64_t rows,
                      Head<T>& head) {
  if (in.widen_in_tasks) {
    const auto own = widened.rows_of(in, bh, row0, rows);
    head.q = own.q;
    head.k = own.k;
    head.v = own.v;
  }
}

// The most query rows per head at which a forward without kept weights whose tasks would widen a half type reads
// the keys and values as they are (half_rows_dots, half_rows_apply): a decoding step's row multiplies each key
// and value once, so widening the head's keys and values into fp32 first moved them through memory three times
// for products of a row each. On an Intel Xeon (bfloat16, 8 heads, d_k 64 and 128, 128-2048 keys) a row took
// 0.52-0.83x the widened time (0.89x with 2 rows, padded), but 4 rows 1.1x and 8 rows 1.7x: the rows re-read
// the keys and values.
constexpr int64_t kHalfKeysDirectlyUpToQueries = 2;

template <typename T>
bool uses_half_keys_directly(const AttentionInputs<T>& in) {
  return std::is_same_v<T, float> && in.widen_in_tasks && in.half_source.k != nullptr &&
         in.len_q <= kHalfKeysDirectlyUpToQueries;
}

template <typename T>
ForwardChunk<T> forward_chunk(const AttentionInputs<T>& in, int64_t task, int64_t chunks, int64_t chunk,
                              WidenedHead<T>& widened, bool half_keys_directly = false) {
  const int64_t bh = task / chunks, row0 = (task % chunks) * chunk;
  const int64_t rows = std::min(chunk, in.len_q - row0);
  Head<T> head = head_pointers(in, bh);
  if (half_keys_directly) {
    const HalfOperands& src = in.half_source;
    head.q = widened.query_rows_of(in, bh, row0, rows);
    head.k = head.v = nullptr;
    head.direct_k = head_row(src.k, src.k_stride, in.heads, bh, 0);
    head.direct_v = head_row(src.v, src.v_stride, in.heads, bh, 0);
  } else {
    use_widened_rows(in, widened, bh, row0, rows, head);
  }
  return {bh, row0, rows, bh * in.len_q + row0, head};
}

// Forward tasks handed out a head's chunks at a time (its keys and values, and the scan of them for
// non-finite entries, stay with one thread) when there are heads enough to balance the threads; otherwise one
// chunk at a time.
template <typename T>
int64_t head_grain(const AttentionInputs<T>& in, int64_t chunks) {
  return in.batch * in.heads >= 4 * at::get_num_threads() ? chunks : 1;
}

template <typename T>
void online_forward(const AttentionInputs<T>& in, const AttentionForwardOutputs<T>& out) {
  const int64_t chunk = online_query_chunk(in.len_q, in.batch * in.heads, at::get_num_threads());
  const int64_t chunks = (in.len_q + chunk - 1) / chunk;
  const bool directly = uses_half_keys_directly(in);
  for_each_task(in.batch * in.heads * chunks, head_grain(in, chunks), [&](const auto& claim) {
    const HalfProductsTask half_products(in.half.vnni);
    OnlineBuffers<T> buf;
    // Half-type products write padded rows and whole panels (fold_half_block).
    buf.scores.resize(in.half.q != nullptr ? padded_rows(chunk) * online_scores_ld(in.key_block)
                                           : chunk * in.key_block);
    buf.keep.resize(in.dropout_p > 0 ? chunk * in.key_block : 0);
    buf.max.resize(chunk);
    buf.sum.resize(chunk);
    NonFiniteKeys<T> non_finite(false);
    WidenedHead<T> widened;
    OutputRows<T> output(in, out, chunk);
    // Rows rounded to a half type are normalized as they are rounded.
    std::vector<T> factors(output.scales_rows() ? chunk : 0);
    T* const row_factors = factors.empty() ? nullptr : factors.data();
    for (int64_t begin, end; claim(begin, end);) {
      for (int64_t task = begin; task < end; ++task) {
        const auto [bh, row0, rows, first_row, head] = forward_chunk(in, task, chunks, chunk, widened, directly);
        T* const out_rows = output.rows(bh, row0);
        const int64_t out_ld = output.ld();
        const KeySpan span = chunk_span(in, head, bh, row0, rows, non_finite, false);
        // A zero weight times a NaN or infinite value is NaN: no key is skipped inside the span of such a head.
        // Nor in a chunk with a row that sees no key (uniform over all keys: skipping would only cost a redo).
        const bool narrow = span.masked && !span.row_without_key && !non_finite.any(in, head, bh);
        const bool pieces = in.is_causal && head.mask == nullptr && !non_finite.any(in, head, bh);
        if (!online_chunk(in, head, row0, rows, first_row, span, narrow, pieces, buf, out_rows, out_ld,
                          out.lse + first_row, row_factors)) {
          online_chunk(in, head, row0, rows, first_row, KeySpan{0, in.len_k, head.mask != nullptr}, false, false, buf,
                       out_rows, out_ld, out.lse + first_row, row_factors);
        }
        output.done(rows, row_factors);
      }
    }
  });
}

// Row `first` (an element offset) of the half-type weights (out.half_weights) from a chunk's score row s.
template <typename T>
void write_half_weights(const AttentionForwardOutputs<T>& out, int64_t first, const T* s, const KeySpan& span,
                        int64_t ld, T scale, bool streaming, T* row, uint16_t* bits) {
  if constexpr (std::is_same_v<T, float>) {
    write_half_weights_row(out.half_out_kind, out.half_weights + first, s, span.lo, span.hi, ld, scale, streaming, row,
                           bits);
  } else {
    TORCH_INTERNAL_ASSERT(false, "half-type weights are rounded from float");
  }
}

template <typename T>
void forward_impl(const AttentionInputs<T>& inputs, const AttentionForwardOutputs<T>& out) {
  PackedHeadsStorage packed_heads;
  TORCH_INTERNAL_ASSERT(!inputs.widen_in_tasks || inputs.copy_source.q != nullptr ||
                            (inputs.half.q == nullptr && std::is_same_v<T, float>),
                        "the tasks widen half-type operands only for products in float");
  const AttentionInputs<T> in = with_packed_heads(inputs, false, packed_heads);
  if (!out.keeps_weights()) {
    return online_forward(in, out);
  }
  const int64_t chunk = std::min<int64_t>(query_chunk(in.len_k), std::max<int64_t>(in.len_q, 1));
  const int64_t chunks = (in.len_q + chunk - 1) / chunk;
  const int64_t tasks = in.batch * in.heads * chunks;
  const int64_t ld = in.len_k;
  // Weights beyond what the caches hold are streamed to memory (see weights_row.h).
  constexpr int64_t kStreamBytes = int64_t{16} << 20;
  const int64_t weight_bytes = out.half_weights != nullptr ? int64_t(sizeof(uint16_t)) : int64_t(sizeof(T));
  const bool stream_weights = in.batch * in.heads * in.len_q * ld * weight_bytes >= kStreamBytes;
  for_each_task(tasks, head_grain(in, chunks), [&](const auto& claim) {
    const HalfProductsTask half_products(in.half.vnni);
    // Scores are computed in a task buffer, packed to the span's width, also when the weights are kept: they
    // are then written out once, normalized, and the buffer stays in cache for the GEMM with V.
    CacheLineVector<T> buffer(chunk * ld), inv_sum(chunk), keep(in.dropout_p > 0 ? chunk * ld : 0);
    NonFiniteKeys<T> non_finite(false);
    WidenedHead<T> widened;
    OutputRows<T> output(in, out, chunk);
    std::vector<uint32_t> words;
    // A row of half-type weights is written in T, then rounded.
    std::vector<T> weights_row(out.half_weights != nullptr ? ld : 0);
    std::vector<uint16_t> weights_bits(weights_row.size());
    for (int64_t begin, end; claim(begin, end);) {
      for (int64_t task = begin; task < end; ++task) {
        const auto [bh, row0, rows, first_row, head] = forward_chunk(in, task, chunks, chunk, widened);
        const KeySpan span = scores_for_chunk(in, head, bh, row0, rows, buffer.data(), non_finite);
        const int64_t n = span.size(), score_ld = packed_ld(span);
        T* const first = buffer.data();
        T* out_rows = output.rows(bh, row0);
        const int64_t out_ld = output.ld();
        if (in.dropout_p > 0) {
          fill_chunk_keep(in, first_row, rows, span, words, keep.data());
        }
        for (int64_t r = 0; r < rows; ++r) {
          T* s = first + r * score_ld;
          const auto [max, sum] = exp_row(s, n);
          out.lse[first_row + r] = max + std::log(sum);
          inv_sum[r] = T(1) / sum;
          if (in.dropout_p > 0) {
            at::vec::map2([](Vectorized<T> a, Vectorized<T> b) { return a * b; }, s, s, keep.data() + r * n, n);
          }
          // zeros at the keys no query of this chunk can see
          if (out.weights != nullptr) {
            write_weights_row(out.weights + (first_row + r) * ld, s, span.lo, span.hi, ld, inv_sum[r], stream_weights);
          } else {
            write_half_weights(out, (first_row + r) * ld, s, span, ld, inv_sum[r], stream_weights, weights_row.data(),
                               weights_bits.data());
          }
        }
        apply_values(in, head, first, score_ld, rows, span.lo, n, out_rows, out_ld, false);
        for (int64_t r = 0; r < rows; ++r) {  // normalize d_v outputs per row instead of Lk weights
          scale_row(out_rows + r * out_ld, in.d_v, n > 0 ? inv_sum[r] : T(0));
        }
        output.done(rows);
      }
    }
    fence_streamed_stores();
  });
}

// Whether a row's log-sum-exp is too close to the -1e9 of masked scores to recompute its weights from: a row
// masked everywhere (lse = -1e9 + log(Lk), uniform weights) or whose scores all lie near or below -1e9. In
// float32 such an lse is a multiple of 64, so these rows take their max and sum over all keys instead (such a
// row is computed at full width). -inf (every score -inf) is not one: its weights are NaN as in the math.
template <typename T>
bool lse_near_fill(T lse) {
  return std::isfinite(lse) && !skipped_keys_weigh_zero(lse);
}

// How the backward recomputes a row's weights: P = exp(S - shift) * scale. From the saved lse (shift = lse,
// scale = 1), or for rows with lse_near_fill from the row's own max and sum (`exact`; their masked keys can
// weigh more than 0, so their dS is zeroed there explicitly).
template <typename T>
struct RowSoftmax {
  T shift, scale;
  bool exact;
  bool gathering = false;  // while row_softmax_constants sums the row: shift = max so far, scale = sum so far
};

// Zeroes dS where the scores were overwritten (mask == 0, or above the diagonal when causal); ds holds the
// span's columns.
template <typename T>
void zero_masked(const AttentionInputs<T>& in, const Head<T>& head, int64_t query, const KeySpan& span, T* ds) {
  if (span.masked) {
    const bool* mask_row = head.mask + query * in.mask_stride[2];
    for (int64_t j = span.lo; j < span.hi; ++j) {
      if (!mask_row[j * in.mask_stride[3]]) ds[j - span.lo] = T(0);
    }
  }
  if (in.is_causal) {
    for (int64_t j = std::max(query + 1, span.lo); j < span.hi; ++j) ds[j - span.lo] = T(0);
  }
}

// D = dO . O of a row: the sum over its keys of dP_j P_j (with dropout too), from the forward output row.
template <typename T>
T output_dot(const T* grad_out, const T* out, int64_t d_v) {
  using Vec = Vectorized<T>;
  return at::vec::map2_reduce_all<T>([](Vec a, Vec b) { return a * b; }, [](Vec a, Vec b) { return a + b; }, grad_out,
                                     out, d_v);
}

// A NaN or infinity in dO, O or V makes 0 * (dP - D) NaN at masked keys too, where the math has no gradient
// (the -1e9 overwrote those scores): zero them as the general path does. So are they in rows with exact softmax
// constants, whose masked keys may weigh more than 0.
template <typename T>
void zero_masked_gradients(const AttentionInputs<T>& in, const Head<T>& head, int64_t query, const KeySpan& span,
                           const RowSoftmax<T>& softmax, T* dw) {
  if ((span.masked || in.is_causal) && (softmax.exact || !finite_rows(dw, span.size(), 0, 1, span.size()))) {
    zero_masked(in, head, query, span, dw);
  }
}

// One pass over a row: P = exp(S - shift) * scale, dP = dW * keep, dS = P * (dP - D) * ds_scale, W = P * keep,
// where D = sum_j dP_j P_j = dO . O (the forward output row; true with dropout too; the argument d), so no row
// reduction is needed.
// Masked scores have P = 0 exactly (exp(-1e9 - lse)), hence dS = 0, except in rows with exact softmax
// constants (whose span is all keys) and in rows with a non-finite dS. p, dw and keep hold the span's columns.
template <typename T>
void fused_backward_row(const AttentionInputs<T>& in, T d, int64_t query, const KeySpan& span, const Head<T>& head,
                        const RowSoftmax<T>& softmax, T* p, T* dw, const T* keep, T ds_scale = T(1)) {
  const int64_t width = span.size();
  using Vec = Vectorized<T>;
  const Vec shift_vec(softmax.shift), scale_vec(softmax.scale), d_vec(d), ds_scale_vec(ds_scale);
  const bool dropout = keep != nullptr;
  const bool fast = std::isfinite(softmax.shift);
  int64_t j = 0;
  for (; j + Vec::size() <= width; j += Vec::size()) {
    const Vec prob = softmax_exp(Vec::loadu(p + j) - shift_vec, fast) * scale_vec;
    Vec dp = Vec::loadu(dw + j);
    if (dropout) {
      const Vec k = Vec::loadu(keep + j);
      dp = dp * k;
      (prob * k).store(p + j);
    } else {
      prob.store(p + j);
    }
    (prob * (dp - d_vec) * ds_scale_vec).store(dw + j);
  }
  for (; j < width; ++j) {
    const T prob = std::exp(p[j] - softmax.shift) * softmax.scale;
    const T k = dropout ? keep[j] : T(1);
    p[j] = prob * k;
    dw[j] = prob * (dw[j] * k - d) * ds_scale;
  }
  zero_masked_gradients(in, head, query, span, softmax, dw);
}

// fused_backward_row for a row whose forward (without dropout) kept its weights W = P, which w holds over the
// span's columns: dS = W * (dP - D), no scores recomputed.
template <typename T>
void kept_weights_backward_row(const AttentionInputs<T>& in, T d, int64_t query, const KeySpan& span,
                               const Head<T>& head, const RowSoftmax<T>& softmax, const T* w, T* dw) {
  const int64_t width = span.size();
  using Vec = Vectorized<T>;
  const Vec d_vec(d);
  int64_t j = 0;
  for (; j + Vec::size() <= width; j += Vec::size()) {
    (Vec::loadu(w + j) * (Vec::loadu(dw + j) - d_vec)).store(dw + j);
  }
  for (; j < width; ++j) dw[j] = w[j] * (dw[j] - d);
  zero_masked_gradients(in, head, query, span, softmax, dw);
}

// fused_backward_row for a row whose forward with dropout kept its weights W = P * keep (keep = 0, or 1 / (1 - p)
// as the forward multiplied), which w holds over the span's columns. With dP = dW * keep, dS = P * (dP - D) is
// W * (dW - D / keep) where W != 0, with no scores recomputed; where W == 0 (a dropped weight, or P == 0) it is
// P * ((dW - dW) - D) (NaN where dW is not finite, as dW * 0 is in the math; a product with a constant zero may be
// folded away), P recomputed from that one score, except at keys
// the mask or causality hide, whose dS is zero (a masked score has no gradient). Only rows whose softmax constants
// are not exact come here: the others' constants come from GEMM scores that one dot product would not match.
template <typename T>
void kept_dropout_weights_backward_row(const AttentionInputs<T>& in, T d, int64_t query, const KeySpan& span,
                                       const Head<T>& head, const RowSoftmax<T>& softmax, const T* w, T* dw,
                                       std::vector<int32_t>& dropped) {
  const int64_t width = span.size();
  using Vec = Vectorized<T>;
  const T keep = T(1.0 / (1.0 - in.dropout_p));
  const Vec d_kept(d / keep), d_vec(d), zero(T(0));
  int64_t j = 0;
  for (; j + Vec::size() <= width; j += Vec::size()) {
    const Vec wj = Vec::loadu(w + j), dwj = Vec::loadu(dw + j);
    // Where W == 0, the factor (dW - dW) - D that P multiplies below.
    Vec::blendv(wj * (dwj - d_kept), (dwj - dwj) - d_vec, wj == zero).store(dw + j);
  }
  for (; j < width; ++j) dw[j] = w[j] == T(0) ? (dw[j] - dw[j]) - d : w[j] * (dw[j] - d / keep);
  const T* q_row = head.q + query * in.q_stride.row;
  const int64_t end = in.is_causal ? std::clamp<int64_t>(query + 1, span.lo, span.hi) : span.hi;
  std::fill(dw + (end - span.lo), dw + width, T(0));  // above the diagonal
  // The zero weights' keys (indices into the span), less those the mask hides, whose dS is zero.
  hold_at_least(dropped, end - span.lo);
  int64_t count = zero_positions(w, end - span.lo, dropped.data());
  if (span.masked) {
    const bool* mask_row = head.mask + query * in.mask_stride[2];
    int64_t visible = 0;
    for (int64_t i = 0; i < count; ++i) {
      const int32_t key = dropped[i];
      if (mask_row[(span.lo + key) * in.mask_stride[3]]) {
        dropped[visible++] = key;
      } else {
        dw[key] = T(0);
      }
    }
    count = visible;
  }
  // Their scores and exponentials a batch at a time.
  constexpr int kBatch = 4 * kGatheredRows;
  std::array<T, kBatch> p;
  const Vec shift(softmax.shift), scale(softmax.scale), score_scale(in.scale);
  const T* span_keys = head.k + span.lo * in.k_stride.row;
  for (int64_t first = 0; first < count; first += kBatch) {
    const int batch = static_cast<int>(std::min<int64_t>(kBatch, count - first));
    const int32_t* keys = dropped.data() + first;
    for (int i = 0; i < batch; i += kGatheredRows) {
      gathered_dots(q_row, span_keys, in.k_stride.row, keys + i, std::min(kGatheredRows, batch - i), in.d_k,
                    p.data() + i);
    }
    at::vec::map([&](Vec s) { return (s * score_scale - shift).exp() * scale; }, p.data(), p.data(), batch);
    for (int i = 0; i < batch; ++i) dw[keys[i]] *= p[i];
  }
  zero_masked_gradients(in, head, query, span, softmax, dw);
}

// One backward task: a range of one head's query chunks, with its own partial dK and dV, zeroed here (the
// caller sums the splits), or the task's own rows of them (g.half_grad_k, g.task_grad_k; own_k and own_v hold them).
template <typename T>
struct SplitTask {
  int64_t bh, chunk_begin, chunk_end;
  Head<T> head;
  T* grad_k;
  T* grad_v;
};

template <typename T>
SplitTask<T> split_task(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g, int64_t task,
                        int64_t chunks, CacheLineVector<T>& own_k, CacheLineVector<T>& own_v) {
  const int64_t bh = task / g.splits, split = task % g.splits;
  T* grad_k = nullptr;
  T* grad_v = nullptr;
  if (g.half_grad_k != nullptr || g.task_grad_k != nullptr) {
    hold_at_least(own_k, in.len_k * in.d_k);
    hold_at_least(own_v, in.len_k * in.d_v);
    grad_k = own_k.data();
    grad_v = own_v.data();
  } else {
    grad_k = head_row(g.grad_k.data + split * g.grad_k.split, g.grad_k.stride, in.heads, bh, 0);
    grad_v = head_row(g.grad_v.data + split * g.grad_v.split, g.grad_v.stride, in.heads, bh, 0);
  }
  zero_rows(grad_k, g.grad_k.stride.row, in.len_k, in.d_k);
  zero_rows(grad_v, g.grad_v.stride.row, in.len_k, in.d_v);
  return {bh, split * chunks / g.splits, (split + 1) * chunks / g.splits, head_pointers(in, bh), grad_k, grad_v};
}

// A task's own dK and dV rows (g.half_grad_k, g.task_grad_k), final once it has run all its head's chunks, rounded
// into the half-type gradients or copied into those in T.
template <typename T>
void finish_task_gradients(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g,
                           const SplitTask<T>& task) {
  if (g.task_grad_k != nullptr) {
    copy_rows(task.grad_k, in.d_k, in.len_k, in.d_k,
              head_row(g.task_grad_k, g.task_grad_k_stride, in.heads, task.bh, 0), g.task_grad_k_stride.row);
    copy_rows(task.grad_v, in.d_v, in.len_k, in.d_v,
              head_row(g.task_grad_v, g.task_grad_v_stride, in.heads, task.bh, 0), g.task_grad_v_stride.row);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    round_rows(in.half_source.kind, task.grad_k, in.len_k, in.d_k,
               head_row(g.half_grad_k, g.half_grad_k_stride, in.heads, task.bh, 0), g.half_grad_k_stride.row);
    round_rows(in.half_source.kind, task.grad_v, in.len_k, in.d_v,
               head_row(g.half_grad_v, g.half_grad_v_stride, in.heads, task.bh, 0), g.half_grad_v_stride.row);
  }
}

// The blocked backward's dV += W^T dO and dK += dS^T Q on brgemm, which takes no transposed operand: run as
// dV^T += dO^T W and dK^T += Q^T dS, so that W and dS (rows x block, every block) are read as they are and only dO
// and Q (rows x d) are packed transposed, once per chunk. dK^T and dV^T are the task's own (d x len_k), zeroed
// before its first such product and added transposed into its dK and dV rows once its chunks are done.
template <typename T>
struct TransposedGradients {
  CacheLineVector<T> grad_k, grad_v;  // d_k x len_k and d_v x len_k
  CacheLineVector<T> grad_out, q;     // the chunk's dO^T (d_v x rows) and Q^T (d_k x rows)
  bool task_started = false;          // grad_k and grad_v hold the current task's sums
  bool chunk_packed = false;          // grad_out and q hold the current chunk's rows
};

// Per-task state of the backward: score and score-gradient rows (chunk x width), dropout multipliers, and
// the scans of a head's keys.
template <typename T>
struct BackwardBuffers {
  CacheLineVector<T> probs, grad_w, keep;
  std::vector<T> out_dots;  // D = dO . O of each row of a chunk
  std::vector<RowSoftmax<T>> softmax;
  NonFiniteKeys<T> non_finite{true};
  std::vector<uint32_t> words;
  WidenedHead<T> widened;  // q/k/v when the tasks widen them (in.widen_in_tasks)
  BackwardChunkRows<T> chunk_rows;
  CacheLineVector<T> own_grad_k, own_grad_v;  // a task's dK and dV rows (half_grad_k, task_grad_k)
  CacheLineVector<T> packed;     // a transposed operand of brgemm (in.float_brgemm); add_transposed_gradients' scratch
  std::vector<int32_t> dropped;  // a row's zero weights (kept_dropout_weights_backward_row)
  TransposedGradients<T> transposed;  // dK^T and dV^T on brgemm (in.float_brgemm)
};

// Whether query row `query` sees no key at all (mask, and causality with is_causal): all its scores are -1e9.
template <typename T>
bool sees_no_key(const AttentionInputs<T>& in, const Head<T>& head, int64_t query) {
  const int64_t limit = in.is_causal ? std::min(in.len_k, query + 1) : in.len_k;
  if (head.mask == nullptr) {
    return limit == 0;
  }
  const auto [first, last] = visible_range(head.mask + query * in.mask_stride[2], in.mask_stride[3], limit);
  return first > last;
}

// The softmax constants of a chunk's rows for fused_backward_row: from the saved lse, except for rows with
// lse_near_fill: uniform over all keys when the row sees no key, otherwise their max and sum over all keys in one
// more pass of scores (their chunk's span is all keys: none of its keys is skipped).
template <typename T>
void row_softmax_constants(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g, const Head<T>& head,
                           int64_t row0, int64_t rows, int64_t first_row, BackwardBuffers<T>& buf) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  bool any_exact = false;
  for (int64_t r = 0; r < rows; ++r) {
    const T lse = g.lse[first_row + r];
    const bool exact = lse_near_fill(lse);
    if (!exact) {
      buf.softmax[r] = {lse, T(1), false};
    } else if (sees_no_key(in, head, row0 + r)) {  // every score is exactly -1e9: uniform over all keys
      buf.softmax[r] = {T(kMaskedScore), T(1) / T(in.len_k), true};
    } else {
      buf.softmax[r] = {kNegInf, T(0), true, true};
      any_exact = true;
    }
  }
  if (!any_exact) {
    return;
  }
  for (int64_t lo = 0; lo < in.len_k; lo += in.key_block) {  // running max in shift, running sum in scale
    const KeySpan block{lo, std::min(lo + in.key_block, in.len_k), head.mask != nullptr};
    const int64_t n = block.size();
    block_scores(in, head, row0, rows, block, buf.probs.data(), n);
    for (int64_t r = 0; r < rows; ++r) {
      if (buf.softmax[r].gathering) fold_block(buf.probs.data() + r * n, n, buf.softmax[r].shift, buf.softmax[r].scale);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (buf.softmax[r].gathering) buf.softmax[r] = {buf.softmax[r].shift, T(1) / buf.softmax[r].scale, true};
  }
}

// The blocked backward's products of one block in the half type (in.half; see apply_values for the forward's):
// dP = dO V^T into grad_w before fused_backward_row; after it, dV += W^T dO, dQ (+)= scale dS K and
// dK += scale dS^T Q, with W (probs) and dS (grad_w) rounded to the half type. The chunk's dO and Q rows, right
// operands of dV and dK at every block, are packed once per chunk (half_chunk_rows).
template <typename T>
void half_grad_weights(const AttentionInputs<T>& in, const uint16_t* grad_out, int64_t ld_grad_out, const Head<T>& head,
                       int64_t rows, int64_t lo, int64_t n, T* grad_w) {
  if constexpr (std::is_same_v<T, float>) {
    half_times_transposed(
        in.half, grad_out, ld_grad_out, rows, head.half_v + lo * in.half.v_stride.row, in.half.v_stride.row,
        columns_of_head(head, head.values_t, in.half.values_t, lo, n, in.half.vnni), n, in.d_v, grad_w, n, 1.0f);
  } else {
    TORCH_INTERNAL_ASSERT(false, "half-type products take float scores");
  }
}

// The chunk's dO rows (row stride ld_grad_out) and Q rows (rows from row0) packed as right operands,
// padded_depth(rows) deep, into the calling thread's scratch for half_block_gradients.
template <typename T>
void half_chunk_rows(const AttentionInputs<T>& in, const uint16_t* grad_out, int64_t ld_grad_out, const Head<T>& head,
                     int64_t row0, int64_t rows) {
  HalfScratch& scratch = half_scratch();
  const int64_t depth = padded_depth(rows);
  hold_at_least(scratch.chunk_grad_out, packed_size(depth, in.d_v));
  hold_at_least(scratch.chunk_q, packed_size(depth, in.d_k));
  pack_rows(grad_out, ld_grad_out, rows, in.d_v, in.half.vnni, scratch.chunk_grad_out.data());
  pack_rows(head.half_q + row0 * in.half.q_stride.row, in.half.q_stride.row, rows, in.d_k, in.half.vnni,
            scratch.chunk_q.data());
}

template <typename T>
void half_block_gradients(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g, const Head<T>& head,
                          int64_t rows, int64_t lo, int64_t n, const T* probs, T* grad_w, T* grad_q, int64_t ld_grad_q,
                          T* grad_k, T* grad_v, bool add_q) {
  if constexpr (std::is_same_v<T, float>) {
    // dS comes scaled (fused_backward_row's ds_scale) and is rounded so: scale * dS stays finite in float16 where dS
    // alone may not (a large output gradient).
    HalfScratch& scratch = half_scratch();
    const HalfKind kind = in.half.kind;
    const bool vnni = in.half.vnni;
    const int64_t by_rows = padded_depth(rows), by_keys = padded_depth(n);
    // dV += W^T dO
    hold_at_least(scratch.left, left_size(n, by_rows));
    transposed_to_half(kind, probs, n, rows, n, scratch.left.data());
    half_gemm(kind, vnni, n, in.d_v, by_rows, scratch.left.data(), {scratch.chunk_grad_out.data(), by_rows},
              grad_v + lo * g.grad_v.stride.row, g.grad_v.stride.row, true);
    // scale dS rounded once, rows for dQ and transposed for dK
    hold_at_least(scratch.grad_scores, left_size(rows, by_keys));
    rows_to_half(kind, grad_w, n, rows, n, scratch.grad_scores.data());
    // dK += scale dS^T Q
    transposed_left(scratch.grad_scores.data(), rows, n, scratch.left.data());
    half_gemm(kind, vnni, n, in.d_k, by_rows, scratch.left.data(), {scratch.chunk_q.data(), by_rows},
              grad_k + lo * g.grad_k.stride.row, g.grad_k.stride.row, true);
    // dQ (+)= scale dS K
    const PackedRight keys = rows_of_head(head.keys, head.packed_keys, head.half_k, in.half.k_stride.row, lo, n, in.d_k,
                                          vnni, scratch.right);
    half_gemm(kind, vnni, rows, in.d_k, by_keys, scratch.grad_scores.data(), keys, grad_q, ld_grad_q, add_q);
  } else {
    TORCH_INTERNAL_ASSERT(false, "half-type products take float scores");
  }
}

// The blocked backward's float32 products on oneDNN's brgemm where `use` (in.float_brgemm, float_gemm.h, outside
// causal pieces after the first, whose row counts would each take a place), each where the process runs its shape
// there, among the backward's own places: whether it ran (nothing written otherwise, for gemm to run it).
// C (m x n) (+ when add)= A (m x k) B (k x n), all row-major.
constexpr BrgemmShapes kBackwardShapes = BrgemmShapes::kAttentionBackward;
template <typename T>
bool brgemm_plain(bool use, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                  int64_t ldc, bool add) {
  if constexpr (std::is_same_v<T, float>) {
    return use && brgemm_if_admitted(m, n, k, a, lda, b, ldb, c, ldc, add, kBackwardShapes);
  }
  return false;
}

// dP = dO V^T (m rows, n keys) into grad_w (row stride n), V^T packed into `packed` (d_v x n) first.
template <typename T>
bool brgemm_grad_weights(bool use, const AttentionInputs<T>& in, int64_t m, int64_t n, const T* grad_out,
                         int64_t ld_grad_out, const T* v, CacheLineVector<T>& packed, T* grad_w) {
  if constexpr (std::is_same_v<T, float>) {
    if (use && brgemm_admits(m, n, in.d_v, ld_grad_out, n, n, false, kBackwardShapes)) {
      hold_at_least(packed, in.d_v * n);
      pack_transposed(v, in.v_stride.row, in.d_v, n, packed.data(), n);
      at::native::cpublas::brgemm(m, n, in.d_v, ld_grad_out, n, n, false, grad_out, packed.data(), grad_w,
                                  /*is_vnni=*/false);
      return true;
    }
  }
  return false;
}

// Readies t for a chunk's products into dK^T and dV^T (TransposedGradients): the task's sums zeroed before its first,
// the chunk's dO (rows x d_v, row stride ld_grad_out) and Q rows (row stride ld_q) packed transposed before its
// first.
template <typename T>
void ready_transposed(const AttentionInputs<T>& in, int64_t rows, const T* grad_out, int64_t ld_grad_out, const T* q,
                      int64_t ld_q, TransposedGradients<T>& t) {
  if constexpr (std::is_same_v<T, float>) {
    if (!t.task_started) {
      t.grad_k.assign(static_cast<size_t>(in.d_k * in.len_k), T(0));
      t.grad_v.assign(static_cast<size_t>(in.d_v * in.len_k), T(0));
      t.task_started = true;
    }
    if (!t.chunk_packed) {
      hold_at_least(t.grad_out, in.d_v * rows);
      hold_at_least(t.q, in.d_k * rows);
      pack_transposed(grad_out, ld_grad_out, in.d_v, rows, t.grad_out.data(), rows);
      pack_transposed(q, ld_q, in.d_k, rows, t.q.data(), rows);
      t.chunk_packed = true;
    }
  }
}

// C^T (d x n, the columns from key lo of a d x len_k sum) += A^T B for the chunk's rows A^T (d x rows) and B
// (rows x n, row stride ldb) on brgemm, where `use` and the process runs the shape there: whether it ran. `ready`
// readies the operands only then (ready_transposed) and returns A^T and the sum.
template <typename T, typename Ready>
bool brgemm_into_transposed(bool use, const AttentionInputs<T>& in, int64_t d, int64_t rows, int64_t lo, int64_t n,
                            const T* b, int64_t ldb, const Ready& ready) {
  if constexpr (std::is_same_v<T, float>) {
    if (use && brgemm_admits(d, n, rows, rows, ldb, in.len_k, true, kBackwardShapes)) {
      const auto [a_t, sum_t] = ready();
      at::native::cpublas::brgemm(d, n, rows, rows, ldb, in.len_k, true, a_t, b, sum_t + lo, /*is_vnni=*/false);
      return true;
    }
  }
  return false;
}

// Adds a task's dK^T and dV^T, where its products made them, transposed into its dK and dV rows.
template <typename T>
void add_transposed_gradients(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g, T* grad_k, T* grad_v,
                              TransposedGradients<T>& t, CacheLineVector<T>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    if (!t.task_started) {
      return;
    }
    using Vec = Vectorized<T>;
    const auto add = [&](const CacheLineVector<T>& sum_t, int64_t d, T* rows, int64_t ld) {
      hold_at_least(scratch, in.len_k * d);
      pack_transposed(sum_t.data(), in.len_k, in.len_k, d, scratch.data(), d);
      for (int64_t j = 0; j < in.len_k; ++j) {
        at::vec::map2([](Vec x, Vec y) { return x + y; }, rows + j * ld, rows + j * ld, scratch.data() + j * d, d);
      }
    };
    add(t.grad_k, in.d_k, grad_k, g.grad_k.stride.row);
    add(t.grad_v, in.d_v, grad_v, g.grad_v.stride.row);
    t.task_started = false;
  }
}

// The scale factor of dS's products: where `use`, 1 (brgemm has none) after scaling the `count` elements of grad_w
// once; in.scale otherwise.
template <typename T>
T scale_for_brgemm(bool use, const AttentionInputs<T>& in, T* grad_w, int64_t count) {
  if (!use) {
    return in.scale;
  }
  using Vec = at::vec::Vectorized<T>;
  at::vec::map([&](Vec x) { return x * Vec(in.scale); }, grad_w, grad_w, count);
  return T(1);
}

// Runs body(task, row0, rows, buffers) for every query chunk of `chunk` rows, the split tasks in parallel.
template <typename T, typename Body>
void for_each_backward_chunk(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g, int64_t chunk,
                             int64_t width, const Body& body) {
  const int64_t chunks = (in.len_q + chunk - 1) / chunk;
  for_each_task(in.batch * in.heads * g.splits, 1, [&](const auto& claim) {
    const HalfProductsTask half_products(in.half.vnni);
    BackwardBuffers<T> buf;
    buf.probs.resize(chunk * width);
    buf.grad_w.resize(chunk * width);
    buf.keep.resize(in.dropout_p > 0 ? chunk * width : 0);
    buf.softmax.resize(chunk);
    for (int64_t begin, end; claim(begin, end);) {
      for (int64_t t = begin; t < end; ++t) {
        SplitTask<T> task = split_task(in, g, t, chunks, buf.own_grad_k, buf.own_grad_v);
        for (int64_t c = task.chunk_begin; c < task.chunk_end; ++c) {
          const int64_t row0 = c * chunk, rows = std::min(chunk, in.len_q - row0);
          use_widened_rows(in, buf.widened, task.bh, row0, rows, task.head);
          body(task, row0, rows, buf);
        }
        add_transposed_gradients(in, g, task.grad_k, task.grad_v, buf.transposed, buf.packed);
        if (g.half_grad_k != nullptr || g.task_grad_k != nullptr) {
          finish_task_gradients(in, g, task);
        }
      }
    }
  });
}

// One chunk of the blocked backward: rows row0 .. row0 + rows of the task's head, whose dO, O and dQ rows are
// buf.chunk_rows.
template <typename T>
void blocked_chunk(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g, const SplitTask<T>& task,
                   int64_t row0, int64_t rows, BackwardBuffers<T>& buf) {
  const auto& [bh, chunk_begin, chunk_end, head, grad_k, grad_v] = task;
  auto& [probs, grad_w, keep, out_dots, softmax, non_finite, words, widened, chunk_rows, own_grad_k, own_grad_v, packed,
         dropped, transposed] = buf;
  transposed.chunk_packed = false;
  const int64_t first_row = bh * in.len_q + row0;
  const T* grad_out = chunk_rows.grad_out;
  const T* out = chunk_rows.out;
  const T* q_rows = head.q != nullptr ? head.q + row0 * in.q_stride.row : nullptr;  // nullptr: in the half type
  T* grad_q = chunk_rows.grad_q;
  const int64_t ld_grad_out = chunk_rows.ld_grad_out, ld_grad_q = chunk_rows.ld_grad_q;
  const int64_t ld_grad_k = g.grad_k.stride.row, ld_grad_v = g.grad_v.stride.row;
  // dO rows in the half type, for the half-type products.
  const uint16_t* half_grad_out =
      in.half.q != nullptr ? head_row(g.source_grad_out, g.grad_out_stride, in.heads, bh, row0) : nullptr;
  // dO rows all zero (padded queries that the loss ignores): dP = 0 and D = sum_j P_j dP_j = 0, so dS = 0.
  // The chunk adds nothing to dK and dV and its dQ rows are zero, unless 0 * inf makes NaN: a non-finite
  // Q row, key, value or log-sum-exp (P = exp(S - lse)).
  if (all_zero(grad_out, ld_grad_out, rows, in.d_v) && query_rows_finite(in, head, row0, rows) &&
      finite_rows(g.lse + first_row, 1, 0, rows, 1) && !non_finite.any(in, head, bh)) {
    zero_rows(grad_q, ld_grad_q, rows, in.d_k);
    return;
  }
  // Kept weights without dropout are P itself: no scores are recomputed, and of the softmax constants only
  // `exact` is read (zero_masked_gradients). With dropout the dropped ones are recomputed from the constants.
  const T* kept = g.weights == nullptr ? nullptr : g.weights + first_row * in.len_k;
  if (kept == nullptr || in.dropout_p > 0) {
    row_softmax_constants(in, g, head, row0, rows, first_row, buf);
    // With dropout, a chunk with exact softmax constants (rows near the -1e9 fill) recomputes all its scores.
    for (int64_t r = 0; r < rows && kept != nullptr; ++r) {
      if (softmax[r].exact) kept = nullptr;
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) softmax[r] = {T(0), T(1), lse_near_fill(g.lse[first_row + r])};
  }
  // dV and dK of a skipped key are zero weights (score gradients) times dO (Q) rows: a NaN or an infinity
  // there makes them NaN in the math.
  bool may_skip = finite_rows(grad_out, ld_grad_out, 0, rows, in.d_v) && query_rows_finite(in, head, row0, rows);
  for (int64_t r = 0; r < rows && may_skip; ++r) may_skip = skipped_keys_weigh_zero(g.lse[first_row + r]);
  const KeySpan span = chunk_span(in, head, bh, row0, rows, non_finite, !may_skip);
  const bool narrow = may_skip && span.masked && !non_finite.any(in, head, bh);
  if (in.half.q != nullptr) {
    half_chunk_rows(in, half_grad_out, g.grad_out_stride.row, head, row0, rows);
  }
  // Causal pieces as in the forward (causal_pieces), where the rows' softmax constants leave the keys they do not
  // see a weight of exactly 0 (may_skip) and no product runs in the half type (whose operands are packed per chunk).
  const bool pieces = in.is_causal && head.mask == nullptr && may_skip && kept == nullptr && in.half.q == nullptr &&
                      !non_finite.any(in, head, bh);
  // Each row's D once for all its key blocks, in a loop of its own: with the heads interleaved in dO and O a row
  // is a whole row of heads from the next, and reading them between the rows' passes cost more than the dots.
  out_dots.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    out_dots[r] = output_dot(grad_out + r * ld_grad_out, out + r * chunk_rows.ld_out, in.d_v);
  }
  bool computed = false;
  for (int64_t from = span.lo; from < span.hi;) {
    const KeySpan block = next_block(in, head, row0, rows, span, from, narrow);
    if (block.size() == 0) {
      break;
    }
    from = block.hi;
    causal_pieces(in, row0, rows, block, pieces, [&](int64_t skip, const KeySpan& part) {
      // The rows from `skip` on: their dO, O, Q and dQ rows, softmax constants and place in the score layout.
      const int64_t m = rows - skip, n = part.size(), lo = part.lo;
      const T* piece_grad_out = grad_out + skip * ld_grad_out;
      const T* piece_q = q_rows != nullptr ? q_rows + skip * in.q_stride.row : nullptr;
      T* piece_grad_q = grad_q + skip * ld_grad_q;
      // Rows of the block in T (none where the products run in the half type).
      const T* v_part = head.v != nullptr ? head.v + lo * in.v_stride.row : nullptr;
      const T* k_part = head.k != nullptr ? head.k + lo * in.k_stride.row : nullptr;
      const bool on_brgemm = in.float_brgemm && skip == 0;
      if (kept == nullptr) {
        block_scores(in, head, row0 + skip, m, part, probs.data(), n);
      }
      // The half-type products read the chunk's rows packed whole (half_chunk_rows): no pieces there.
      TORCH_INTERNAL_ASSERT(skip == 0 || in.half.q == nullptr, "causal pieces of the half-type backward");
      if (in.half.q != nullptr) {
        half_grad_weights(in, half_grad_out, g.grad_out_stride.row, head, rows, lo, n, grad_w.data());
      } else if (!brgemm_grad_weights(on_brgemm, in, m, n, piece_grad_out, ld_grad_out, v_part, packed,
                                      grad_w.data())) {
        gemm<T>(false, true, m, n, in.d_v, T(1), piece_grad_out, ld_grad_out, v_part, in.v_stride.row, T(0),
                grad_w.data(), n);
      }
      if (in.dropout_p > 0 && kept == nullptr) {
        fill_chunk_keep(in, first_row + skip, m, part, words, keep.data());
      }
      for (int64_t r = 0; r < m; ++r) {
        const T d = out_dots[skip + r];
        const int64_t query = row0 + skip + r;
        if (kept != nullptr && in.dropout_p > 0) {
          kept_dropout_weights_backward_row(in, d, query, part, head, softmax[skip + r],
                                            kept + (skip + r) * in.len_k + lo, grad_w.data() + r * n, dropped);
        } else if (kept != nullptr) {
          kept_weights_backward_row(in, d, query, part, head, softmax[skip + r], kept + (skip + r) * in.len_k + lo,
                                    grad_w.data() + r * n);
        } else {
          // The half-type products take dS scaled (half_block_gradients); the others scale it in their GEMMs.
          fused_backward_row(in, d, query, part, head, softmax[skip + r], probs.data() + r * n, grad_w.data() + r * n,
                             in.dropout_p > 0 ? keep.data() + r * n : nullptr, in.half.q != nullptr ? in.scale : T(1));
        }
      }
      if (in.half.q != nullptr) {
        half_block_gradients(in, g, head, rows, lo, n, probs.data(), grad_w.data(), grad_q, ld_grad_q, grad_k, grad_v,
                             computed);
        computed = true;
        return;
      }
      // dV += W^T dO ; dQ (+)= scale * dS K ; dK += scale * dS^T Q (over this piece's keys and rows). The first
      // piece of the first block has every row (causal_pieces), so every dQ row is written before one is added to.
      const T* applied = kept != nullptr ? kept + skip * in.len_k + lo : probs.data();
      const int64_t ld_applied = kept != nullptr ? in.len_k : n;
      // On brgemm (skip == 0, so the piece is the whole chunk) dV and dK sum transposed (TransposedGradients).
      TORCH_INTERNAL_ASSERT(!on_brgemm || m == rows, "a piece of a chunk on brgemm");
      const auto ready = [&](bool values) {
        ready_transposed(in, rows, grad_out, ld_grad_out, q_rows, in.q_stride.row, transposed);
        return values ? std::pair{transposed.grad_out.data(), transposed.grad_v.data()}
                      : std::pair{transposed.q.data(), transposed.grad_k.data()};
      };
      if (!brgemm_into_transposed(on_brgemm, in, in.d_v, rows, lo, n, applied, ld_applied,
                                  [&] { return ready(true); })) {
        gemm<T>(true, false, n, in.d_v, m, T(1), applied, ld_applied, piece_grad_out, ld_grad_out, T(1),
                grad_v + lo * ld_grad_v, ld_grad_v);
      }
      // brgemm has no scale factor: on it dS is scaled once for both products.
      const T scale = scale_for_brgemm(on_brgemm, in, grad_w.data(), m * n);
      if (!brgemm_plain(on_brgemm, m, in.d_k, n, grad_w.data(), n, k_part, in.k_stride.row, piece_grad_q, ld_grad_q,
                        computed)) {
        gemm<T>(false, false, m, in.d_k, n, scale, grad_w.data(), n, k_part, in.k_stride.row, computed ? T(1) : T(0),
                piece_grad_q, ld_grad_q);
      }
      if (!brgemm_into_transposed(on_brgemm, in, in.d_k, rows, lo, n, grad_w.data(), n, [&] { return ready(false); })) {
        gemm<T>(true, false, n, in.d_k, m, scale, grad_w.data(), n, piece_q, in.q_stride.row, T(1),
                grad_k + lo * ld_grad_k, ld_grad_k);
      }
      computed = true;
    });
  }
  if (!computed) {
    zero_rows(grad_q, ld_grad_q, rows, in.d_k);
  }
}

// The backward when the weights carry no gradient and the forward output is at hand (fused_backward_row needs
// no row reduction): each chunk walks its key span in blocks of at most in.key_block keys, so only rows x key_block
// scores and score gradients exist at a time. Keys outside the span, and runs inside it that every row of the
// chunk hides, are skipped when their weight in the math, exp(-1e9 - lse), is exactly 0 in every row of the chunk
// (then so is their score gradient).
template <typename T>
void blocked_backward(const AttentionInputs<T>& inputs, const AttentionBackwardTensors<T>& g) {
  PackedHeadsStorage packed_heads;
  const AttentionInputs<T> in = with_packed_heads(inputs, true, packed_heads);
  const int64_t chunk = backward_query_chunk(true, in.len_q, in.len_k, in.batch * in.heads, at::get_num_threads());
  for_each_backward_chunk(in, g, chunk, in.key_block,
                          [&](const SplitTask<T>& task, int64_t row0, int64_t rows, BackwardBuffers<T>& buf) {
                            BackwardChunkRows<T>& chunk_rows = buf.chunk_rows;
                            chunk_rows.take(in, g, task.bh, row0, rows);
                            blocked_chunk(in, g, task, row0, rows, buf);
                            chunk_rows.done(in, g, rows);
                          });
}

template <typename T>
void backward_impl(const AttentionInputs<T>& in, const AttentionBackwardTensors<T>& g) {
  const bool copies = in.copy_source.q != nullptr;
  TORCH_INTERNAL_ASSERT(!in.widen_in_tasks || copies || (std::is_same_v<T, float>), "the tasks widen for float only");
  TORCH_INTERNAL_ASSERT(g.weights == nullptr || (in.half.q == nullptr && (!in.widen_in_tasks || copies)),
                        "kept weights are read in the accumulation type only");
  if ((g.out != nullptr || g.source_out != nullptr) && g.grad_weights == nullptr) {
    return blocked_backward(in, g);
  }
  TORCH_INTERNAL_ASSERT(in.half.q == nullptr && !in.widen_in_tasks,
                        "the backward that keeps whole score rows multiplies operands widened by the caller");
  using Vec = Vectorized<T>;
  const int64_t chunk = backward_query_chunk(false, in.len_q, in.len_k, in.batch * in.heads, at::get_num_threads());
  const int64_t ld = in.len_k;
  for_each_backward_chunk(
      in, g, chunk, ld, [&](const SplitTask<T>& task, int64_t row0, int64_t rows, BackwardBuffers<T>& buf) {
        const auto& [bh, chunk_begin, chunk_end, head, grad_k, grad_v] = task;
        auto& [probs, grad_w, keep, out_dots, softmax, non_finite, words, widened, chunk_rows, own_grad_k, own_grad_v,
               packed, dropped, transposed] = buf;
        const int64_t first_row = bh * in.len_q + row0;
        const T* grad_out = head_row(g.grad_out, g.grad_out_stride, in.heads, bh, row0);
        const int64_t ld_grad_out = g.grad_out_stride.row;
        // P = exp(S - lse), recomputed; dW = dO V^T (+ the gradient of the returned weights)
        // dV and dK of a skipped key are sums of zero weights (score gradients) times dO (Q) rows: a NaN or an
        // infinity in those rows makes them NaN in the math.
        const bool rows_finite = finite_rows(grad_out, ld_grad_out, 0, rows, in.d_v) &&
                                 finite_rows(head.q + row0 * in.q_stride.row, in.q_stride.row, 0, rows, in.d_k);
        const KeySpan span = scores_for_chunk(in, head, bh, row0, rows, probs.data(), non_finite, !rows_finite);
        const int64_t width = span.size(), ld_span = packed_ld(span);
        const T* v_span = head.v + span.lo * in.v_stride.row;
        const T* k_span = head.k + span.lo * in.k_stride.row;
        gemm<T>(false, true, rows, width, in.d_v, T(1), grad_out, ld_grad_out, v_span, in.v_stride.row, T(0),
                grad_w.data(), ld_span);
        if (in.dropout_p > 0) {
          fill_chunk_keep(in, first_row, rows, span, words, keep.data());
        }
        for (int64_t r = 0; r < rows; ++r) {
          T* p = probs.data() + r * ld_span;
          T* dw = grad_w.data() + r * ld_span;
          const T* keep_row = in.dropout_p > 0 ? keep.data() + r * width : nullptr;
          const Vec lse(g.lse[first_row + r]);
          if (lse_near_fill(g.lse[first_row + r])) {  // the row is all keys wide: its own max and sum
            scale_row(p, width, T(1) / exp_row(p, width).second);
          } else {
            at::vec::map([lse](Vec s) { return (s - lse).exp(); }, p, p, width);
          }
          if (g.grad_weights) {
            const T* gw = g.grad_weights + (first_row + r) * ld + span.lo;
            at::vec::map2([](Vec a, Vec b) { return a + b; }, dw, dw, gw, width);
          }
          // With dropout: dP = dW * keep, and the weights that were applied are W = P * keep.
          if (in.dropout_p > 0) {
            at::vec::map2([](Vec a, Vec b) { return a * b; }, dw, dw, keep_row, width);
          }
          const T dot = at::vec::map2_reduce_all<T>([](Vec a, Vec b) { return a * b; },
                                                    [](Vec a, Vec b) { return a + b; }, dw, p, width);
          // dS = P * (dP - sum_j dP_j P_j) into dW's row; masked scores were overwritten: no gradient there.
          const Vec dot_vec(dot);
          at::vec::map2([dot_vec](Vec pj, Vec dpj) { return pj * (dpj - dot_vec); }, dw, p, dw, width);
          zero_masked(in, head, row0 + r, span, dw);
          if (in.dropout_p > 0) {  // P's row becomes W for the dV GEMM
            at::vec::map2([](Vec a, Vec b) { return a * b; }, p, p, keep_row, width);
          }
        }
        // dV += W^T dO ; dQ = scale * dS K ; dK += scale * dS^T Q (over the keys this chunk sees)
        const int64_t ld_grad_k = g.grad_k.stride.row, ld_grad_v = g.grad_v.stride.row;
        gemm<T>(true, false, width, in.d_v, rows, T(1), probs.data(), ld_span, grad_out, ld_grad_out, T(1),
                grad_v + span.lo * ld_grad_v, ld_grad_v);
        gemm<T>(false, false, rows, in.d_k, width, in.scale, grad_w.data(), ld_span, k_span, in.k_stride.row, T(0),
                head_row(g.grad_q, g.grad_q_stride, in.heads, bh, row0), g.grad_q_stride.row);
        gemm<T>(true, false, width, in.d_k, rows, in.scale, grad_w.data(), ld_span, head.q + row0 * in.q_stride.row,
                in.q_stride.row, T(1), grad_k + span.lo * ld_grad_k, ld_grad_k);
      });
}

// The op's replay of a stream (fastmha::_dropout_multipliers) in pieces of a bounded Philox buffer.
template <typename T>
void dropout_multipliers_impl(uint64_t seed, uint64_t offset, double p, uint64_t first, int64_t n, T* out) {
  constexpr int64_t kPiece = 4096;
  std::vector<uint32_t> words;
  const T scale = T(1.0 / (1.0 - p));
  for (int64_t i = 0; i < n; i += kPiece) {
    fill_multipliers(seed, offset, static_cast<float>(p), scale, first + static_cast<uint64_t>(i),
                     std::min(kPiece, n - i), words, out + i);
  }
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
void dropout_multipliers(uint64_t seed, uint64_t offset, double p, uint64_t first, int64_t n, float* out) {
  dropout_multipliers_impl(seed, offset, p, first, n, out);
}
void dropout_multipliers(uint64_t seed, uint64_t offset, double p, uint64_t first, int64_t n, double* out) {
  dropout_multipliers_impl(seed, offset, p, first, n, out);
}

}  // namespace CPU_CAPABILITY
}  // namespace fastmha::cpu
