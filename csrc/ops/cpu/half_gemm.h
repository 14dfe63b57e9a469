// Products of half-type operands (bfloat16, float16) accumulated in fp32, for the CPU kernels' GEMMs (the
// forward's S = Q K^T and O (+)= P V, the blocked backward's five), without widening the operands. They run through
// ATen's batch-reduce GEMM (at::native::cpublas::brgemm, oneDNN's kernels: AMX tiles or AVX512-BF16 dot products),
// whose right operand comes packed: in the VNNI layout (pairs of rows interleaved) on those kernels, plain row-major
// for ATen's reference GEMM, which serves CPUs without them (slow; the kernels there widen to fp32 instead, and
// FASTMHA_CPU_HALF_GEMM=reference takes it only to test this path on any CPU).
//
// oneDNN compiles a kernel for every distinct shape and ATen keeps each one per thread for good, so every
// product here is cut into a small fixed set of shapes: panels of kPanel columns, depths in pieces of at most
// kMaxDepthPiece (multiples of kDepthMultiple), and row blocks of powers of two (computed_rows); the padding is
// zeros. Products written in place (half_gemm_in_place) take the caller's row stride, which it keeps to a few classes.
#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ops/cpu/cache_line_buffer.h"

namespace fastmha::cpu {

enum class HalfKind : uint8_t { kBFloat16, kFloat16 };

// Whether n half-type values (their bits) are all finite: a value is not when all its exponent bits are set. One
// pass with no widened copy, as a max that the compiler vectorizes: a value's exponent bits, as a number, reach the
// all-ones pattern only when they are all set.
// Internal linkage: this header is also compiled with each CPU capability's vector flags, and the linker must not
// hand a baseline caller a copy built for AVX-512.
static inline bool all_finite_bits(HalfKind kind, const uint16_t* bits, int64_t n) {
  const uint16_t exponent = kind == HalfKind::kBFloat16 ? 0x7F80 : 0x7C00;
  uint16_t highest = 0;
  for (int64_t i = 0; i < n; ++i) highest = std::max<uint16_t>(highest, bits[i] & exponent);
  return highest != exponent;
}

// Makes a scratch buffer hold at least n elements and never shrinks it: a vector resized down and up again zeroes
// its regrown part, which a thread alternating between chunk or block sizes would pay at every one of them (the
// callers write every element they read). Internal linkage, as all_finite_bits.
template <typename T, typename Allocator>
static inline void hold_at_least(std::vector<T, Allocator>& buffer, int64_t n) {
  if (buffer.size() < static_cast<size_t>(n)) {
    buffer.resize(static_cast<size_t>(n));
  }
}

// How calls in a half type multiply (FASTMHA_CPU_HALF_GEMM): `auto` (default) as `native` from kNativeFromRows
// query rows per head, each multiplying kNativeFromKeys keys or more (those a mask leaves; any count in a forward
// without kept weights, fewer keys in a backward and fewer rows where the products run on AMX tiles or without
// them: choose_half_products), and as `widen` below;
// `widen` converts the operands to fp32 for MKL's sgemm; `native` multiplies in the half type where this CPU has the
// instructions for it (elsewhere as widen); `reference` takes the half-type path through ATen's reference GEMM on any
// CPU (for tests).
enum class HalfGemmMode { kAuto, kWiden, kNative, kReference };
HalfGemmMode half_gemm_mode();

// The fewest keys at which `auto` multiplies natively (a forward with kept weights; others below). On Zen 4
// (AVX512-BF16), with the operands packed by portable code, the native bfloat16 forward took 0.48-0.67x the widened
// one's time from 256 to 4096 keys but 1.2-1.3x at 128 keys, where its packing and kernel calls weigh more than the
// products; so did a padded batch of 350 keys with 10-25% of them visible.
constexpr int64_t kNativeFromKeys = 256;
// The same for a backward where the products run on AMX tiles: on an Intel Xeon with AMX-BF16 (family 6, model 167
// as reported) the native backward of a padded bfloat16 batch (8 x 350 and 4 x 1024 keys, 8 heads) took 0.74-0.94x
// the widened one's time at 20-84 keys a row with d_k 64 (0.73-0.86x with d_k 128), about the same at 21 and
// 1.05-1.10x at 10-17 (d_k 128 even at 14).
constexpr int64_t kNativeBackwardOnTilesFromKeys = 20;
// The fewest query rows per head at which `auto` multiplies natively (fewer on AMX tiles or on operands packed in
// AVX-512: below): with fewer (decoding steps, short query blocks) the native forward over 1024-4096 keys took 9-10x
// the widened one's time on Zen 4 at 1 row, 2.6-2.7x at 32 and 1.25-1.37x at 128 rows, 0.91-1.01x at 256 rows
// (forward + backward 0.72-0.81x), with the operands packed by portable code.
constexpr int64_t kNativeFromRows = 256;
// The same for a forward without kept weights where the products run on AMX tiles, in chunks of this many rows
// or more: on an Intel Xeon with AMX-BF16 its native bfloat16 forward at 128 query rows and keys (d_k 64) took
// 0.91x torch's time, at 64 rows 2.2x; at 192 rows 1.15x while a chunk's product ran on rows padded to a power of
// two (256), about even once they ran in row blocks of 128 + 64 (computed_rows).
constexpr int64_t kNativeOnlineOnTilesFromRows = 128;
// Where the products run without AMX tiles (AVX512-BF16 alone, as on Zen 4) on operands packed in AVX-512 (fastmha's
// AVX512 kernels; the portable packers keep kNativeFromRows and kNativeFromKeys): the fewest query rows per head at
// which `auto` multiplies natively, and the fewest keys a row multiplies in a backward (a forward without kept weights:
// any count). On Zen 4 the native bfloat16 forward took 0.58-0.75x the widened one's time at 64 and 128 query rows over
// 512-4096 keys (d_k 64; forward + backward 0.60-0.70x) and 0.66-0.70x at 128 rows and keys (d_k 64 and 128); in padded
// batches (350 and 1024 keys) 0.58-0.68x with 17-51 keys visible, forward + backward 0.66-0.77x with 35-256 keys
// but 1.10x with 17. At 32 query rows (three runs, 512-4096 keys, d_k 64 and 128, with and without padding) forward
// 0.47-0.96x, forward + backward 0.74-1.03x; at 16 rows 0.90-1.51x, at 1 row 1.8-3.7x (both passes).
constexpr int64_t kNativeWithoutTilesFromRows = 32;
constexpr int64_t kNativeBackwardWithoutTilesFromKeys = 32;
// The same for a backward where the products run on AMX tiles: on an Intel Xeon with AMX-BF16 its native bfloat16
// backward at 128 query rows took 0.80-0.83x the widened one's time at 2048-4096 keys with d_k 64 (1.07x at 1024),
// 0.57-0.89x with d_k 128 at 1024-4096 (two runs) and 0.79-1.04x with d_k 96.
constexpr int64_t kNativeBackwardOnTilesFromRows = 128;

// Whether oneDNN multiplies `dtype` natively on this CPU with right operands in the VNNI layout: bfloat16 with
// AVX512-BF16 or AMX, float16 with AMX-FP16 (AVX512-FP16 alone takes a plain layout there), checked once by a
// small product against exact results; and oneDNN is enabled in torch.
bool native_half_products(at::ScalarType dtype);

// One small product of small integers against its exact result, with VNNI operands on oneDNN's native kernels
// or plain ones on the reference GEMM: false when the kernels refuse it or read another layout. The check behind
// native_half_products (vnni = true), also run with vnni = false by the tests on any CPU.
bool half_products_probe(HalfKind kind, bool vnni);

// How one call multiplies, decided once by the kernel choice and followed by the kernels.
struct HalfProducts {
  bool in_half_type = false;  // rather than widened to fp32
  bool vnni = true;           // right operands in the VNNI layout of oneDNN's kernels; plain on the reference GEMM
  std::string note;           // in words, for fastmha.explain; empty for float32 and float64
};

// How a forward or a backward in `dtype` with `rows` query rows per head multiplies under `mode` (the value of
// FASTMHA_CPU_HALF_GEMM). `keys` gives the keys a row multiplies (those a mask leaves); it is asked only where
// `auto` needs the count. `online`: a forward without kept weights (the online softmax's blocks, one pass per row
// from the raw products): where oneDNN multiplies on AMX tiles, or without them on operands packed in AVX-512, it
// takes native products at any key count (on an Intel Xeon with AMX-BF16 a padded batch's forward over 35-256
// visible keys took 0.55-0.85x the widened time), and a backward from kNativeBackwardOnTilesFromKeys keys
// (kNativeBackwardWithoutTilesFromKeys without tiles). `chunk_rows`: the query rows per task of an online forward
// (online_query_chunk); asked only there.
HalfProducts choose_half_products(at::ScalarType dtype, HalfGemmMode mode, bool forward, bool online, int64_t rows,
                                  int64_t chunk_rows, const std::function<int64_t()>& keys);

constexpr int64_t kPanel = 64;           // columns per panel of a packed right operand
constexpr int64_t kDepthMultiple = 64;   // depths are padded with zeros to a multiple of this (even: VNNI pairs)
constexpr int64_t kMaxDepthPiece = 512;  // depth per call of the kernel; longer sums add up pieces

inline int64_t padded_depth(int64_t depth) { return (depth + kDepthMultiple - 1) / kDepthMultiple * kDepthMultiple; }

// Rows of a left operand as laid out: m padded to a power of two of at least 16 (zero rows beyond m), so that its
// pieces (left_index) have a few row strides whatever m is.
inline int64_t padded_rows(int64_t m) {
  int64_t rows = 16;
  while (rows < m) rows *= 2;
  return rows;
}

constexpr int64_t kRowMultiple = 16;  // rows of one AMX tile

// The rows a product of m rows computes: m rounded up to kRowMultiple, in row blocks of powers of two (a few kernel
// shapes for any m: 192 rows as 128 + 64 rather than 256, whose padding would be a third of the work).
inline int64_t computed_rows(int64_t m) { return (m + kRowMultiple - 1) / kRowMultiple * kRowMultiple; }

// Elements of a packed right operand with `depth` rows and `cols` columns: whole panels of kPanel columns.
inline int64_t packed_size(int64_t depth, int64_t cols) { return (cols + kPanel - 1) / kPanel * kPanel * depth; }

// Where element (row r, column c) of a packed right operand with `depth` rows lives: in panel c / kPanel (depth x
// kPanel elements each), at (r, c % kPanel) row-major when plain, in pairs of rows when vnni.
inline int64_t packed_index(int64_t r, int64_t c, int64_t depth, bool vnni) {
  const int64_t panel = c / kPanel, col = c % kPanel;
  return panel * depth * kPanel + (vnni ? ((r / 2) * kPanel + col) * 2 + r % 2 : r * kPanel + col);
}

// The right operand B = src^T, where src has `n` rows of `d` elements (row stride ld): B has padded_depth(d) rows
// and n columns, zeros elsewhere in its packed_size. For S = Q K^T with src = a block of keys.
void pack_transposed(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst);

// The right operand B = src, where src has `n` rows of `d` elements (row stride ld): B has padded_depth(n) rows
// and d columns, zeros elsewhere in its packed_size. For O = P V with src = a block of values.
void pack_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst);

// The two above in portable C++, for processors without AVX-512 (and to check the AVX-512 versions against).
namespace portable {
void pack_transposed(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst);
void pack_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst);
}  // namespace portable

// Where element (row r, column k) of a left operand of m rows lives: in piece k / kMaxDepthPiece (padded_rows(m)
// rows of kMaxDepthPiece elements each, so that every call sees the same row stride), at (r, k % kMaxDepthPiece).
inline int64_t left_index(int64_t r, int64_t k, int64_t m) {
  return (k / kMaxDepthPiece * padded_rows(m) + r) * kMaxDepthPiece + k % kMaxDepthPiece;
}

// Elements of a left operand of m rows and `depth` columns (the pieces a product reads).
inline int64_t left_size(int64_t m, int64_t depth) {
  return (depth + kMaxDepthPiece - 1) / kMaxDepthPiece * padded_rows(m) * kMaxDepthPiece;
}

// A left operand from m rows of `d` elements (row stride ld), laid out for padded_rows(m) rows of padded_depth(d)
// elements: zeros beyond m and d up to computed_rows(m) rows (the products read no further, nor beyond
// padded_depth(d) in a piece).
void pad_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t d, uint16_t* dst);

// The zeros of a left operand of m rows whose rows r < m hold their first `d` elements: rows m .. computed_rows(m)
// and columns d .. padded_depth(d).
void zero_left_padding(int64_t m, int64_t d, uint16_t* dst);

// Rows m .. computed_rows(m) of such an operand: zeros, padded_depth(d) columns (its rows r < m hold their own
// padding).
void zero_padding_rows(int64_t m, int64_t d, uint16_t* dst);

// A left operand as a product reads it: laid out by left_index (ld 0), or m rows read in place, ld elements apart,
// when m is a multiple of kRowMultiple (computed_rows(m) == m: no padding rows to read) and the depth a multiple of
// kDepthMultiple (no padding columns), such as a chunk of a head's queries.
struct LeftOperand {
  LeftOperand(const uint16_t* laid_out) : data(laid_out) {}  // NOLINT(google-explicit-constructor)
  LeftOperand(const uint16_t* rows, int64_t row_stride) : data(rows), ld(row_stride) {}
  // Row 0 of the depth piece from column k0 on, of a product of m rows.
  const uint16_t* piece(int64_t k0, int64_t m) const { return ld == 0 ? data + left_index(0, k0, m) : data + k0; }
  int64_t row_stride() const { return ld == 0 ? kMaxDepthPiece : ld; }

  const uint16_t* data;
  int64_t ld = 0;
};

// A packed right operand as a product reads it: `data` points at its first row, which may lie inside a larger
// packed operand of `rows` rows (its panels are rows x kPanel elements apart), such as a block of keys inside a
// head's values packed once; rows >= the product's depth.
struct PackedRight {
  const uint16_t* data;
  int64_t rows;
};

// Row `r` of a packed operand of `rows` rows onwards, as a PackedRight (r even: VNNI pairs stay whole).
inline PackedRight packed_from_row(const uint16_t* packed, int64_t rows, int64_t r, bool vnni) {
  return {packed + packed_index(r, 0, rows, vnni), rows};
}

// C (m x n, fp32, row stride ldc) = alpha A B (+ C when add_c): A is a left operand of m rows laid out as above,
// B is depth x n packed as above (vnni or plain), depth a multiple of kDepthMultiple.
void half_gemm(HalfKind kind, bool vnni, int64_t m, int64_t n, int64_t depth, const uint16_t* a, PackedRight b,
               float* c, int64_t ldc, bool add_c, float alpha = 1.0f);

// C (+)= A B as half_gemm without its copy: the kernels write C in place, so C must hold computed_rows(m) rows of at
// least n rounded up to kPanel columns (row stride ldc); what lies beyond m rows and n columns is overwritten.
void half_gemm_in_place(HalfKind kind, bool vnni, int64_t m, int64_t n, int64_t depth, LeftOperand a, PackedRight b,
                        float* c, int64_t ldc, bool add_c = false);

// Frees the calling thread's hardware state of the native kernels (AMX tile configuration) when it goes out of
// scope: one per task of a forward.
class HalfProductsTask {
 public:
  explicit HalfProductsTask(bool vnni) : vnni_(vnni) {}
  ~HalfProductsTask();
  HalfProductsTask(const HalfProductsTask&) = delete;
  HalfProductsTask& operator=(const HalfProductsTask&) = delete;

 private:
  bool vnni_;
};

}  // namespace fastmha::cpu
