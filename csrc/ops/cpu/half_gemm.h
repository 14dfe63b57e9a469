// Products of half-type operands (bfloat16, float16) accumulated in fp32, for the CPU forward's two GEMMs,
// S = Q K^T and O (+)= P V, without widening the operands. They run through ATen's batch-reduce GEMM
// (at::native::cpublas::brgemm, oneDNN's kernels: AMX tiles or AVX512-BF16/FP16 dot products), whose right
// operand comes packed: in the VNNI layout (pairs of rows interleaved) on those kernels, plain row-major for
// ATen's reference GEMM, which serves CPUs without them (slow; the kernels there widen to fp32 instead, and
// FASTMHA_CPU_HALF_GEMM=reference takes it only to test this path on any CPU).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace fastmha::cpu {

enum class HalfKind : uint8_t { kBFloat16, kFloat16 };

// How a forward in a half type multiplies (FASTMHA_CPU_HALF_GEMM): `widen` (default) converts q/k/v to fp32 for
// MKL's sgemm; `native` multiplies in the half type where this CPU has the instructions for it (elsewhere as
// widen); `reference` takes the half-type path through ATen's reference GEMM on any CPU (for tests).
enum class HalfGemmMode { kWiden, kNative, kReference };
HalfGemmMode half_gemm_mode();

// Whether this CPU multiplies `dtype` natively in oneDNN's kernels (and oneDNN is enabled in torch).
bool native_half_products(at::ScalarType dtype);

// Whether a forward in `dtype` multiplies in it (a half type) under `mode`, rather than widened to fp32.
bool multiplies_in_half_type(at::ScalarType dtype, HalfGemmMode mode);

// How a forward (or a backward, which always widens) in `dtype` multiplies, in words, for fastmha.explain; empty
// for float32 and float64.
std::string half_products_note(at::ScalarType dtype, bool forward);

// Every product's depth (the summed dimension) is padded with zeros to a multiple of this: a row of an AMX tile
// holds 32 half-type values of the depth, and VNNI pairs need an even depth.
constexpr int64_t kHalfDepthMultiple = 32;
inline int64_t padded_depth(int64_t depth) {
  return (depth + kHalfDepthMultiple - 1) / kHalfDepthMultiple * kHalfDepthMultiple;
}

// Where element (row r, column c) of a packed right operand with `cols` columns lives: r * cols + c when plain,
// in pairs of rows ((r / 2) * cols + c) * 2 + r % 2 when vnni.
inline int64_t packed_index(int64_t r, int64_t c, int64_t cols, bool vnni) {
  return vnni ? ((r / 2) * cols + c) * 2 + r % 2 : r * cols + c;
}

// The right operand B = src^T, where src has `n` rows of `d` elements (row stride ld): B has padded_depth(d) rows
// (zeros beyond d) and n columns. For S = Q K^T with src = a block of keys.
void pack_transposed(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst);

// The right operand B = src, where src has `n` rows of `d` elements (row stride ld): B has padded_depth(n) rows
// (zeros beyond n) and d columns. For O = P V with src = a block of values.
void pack_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst);

// A row-major left operand of m rows of `d` elements (row stride ld), copied with padded_depth(d) columns
// (zeros beyond d).
void pad_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t d, uint16_t* dst);

// C (m x n, fp32, row stride ldc) = A B (+ C when add_c): A is m x depth, row-major (row stride lda), B is
// depth x n packed as above (vnni or plain), depth a multiple of kHalfDepthMultiple.
void half_gemm(HalfKind kind, bool vnni, int64_t m, int64_t n, int64_t depth, const uint16_t* a, int64_t lda,
               const uint16_t* b, float* c, int64_t ldc, bool add_c);

// Frees the calling thread's hardware state of the native kernels (AMX tile configuration) at the end of a task.
void half_gemm_release(bool vnni);

}  // namespace fastmha::cpu
