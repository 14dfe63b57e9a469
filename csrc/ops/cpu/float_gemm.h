// float32 products of the CPU kernels on oneDNN's batch-reduce GEMM (at::native::cpublas::brgemm) instead of the
// BLAS's sgemm, where that is faster: the forward's O (+)= P V, the product that needs no packed operand (a single
// query row, a decoding step's, runs blas.h's vector loop instead: it keeps no kernel per key length), and the
// blocked backward's four products, with their transposed operands packed.
//
// MKL, the BLAS that torch's x86 wheels carry, runs no AVX-512 code on AMD processors; oneDNN's kernels do. On
// Zen 4 (AVX-512) the forward took 0.89-0.94x its sgemm time with P V on brgemm (float32, 128-8192 keys, d 64 and
// 128). On Zen 3 (AVX2) brgemm ran the forward's S = Q K^T at about half of sgemm's rate, and on Intel MKL uses
// AVX-512 itself, so `auto` takes brgemm only on AMD processors with AVX-512.
//
// oneDNN compiles a kernel for every distinct product shape and ATen keeps each one per thread for good, so the
// process runs at most kMaxBrgemmShapes distinct shapes of each group (BrgemmShapes) on it (the first ones it
// meets, in every thread alike: a product's numbers do not depend on the thread that runs it) and the rest on
// sgemm. A workload of a few shapes (training at one sequence length) runs them all on brgemm; one whose lengths
// keep changing runs its first shapes there. Where a call meets the last free places with more new shapes than places,
// which of them take the places depends on its threads' timing, and so may the last bits of its outputs, in that call
// and later ones with those shapes.
#pragma once

#include <cstdint>
#include <string>

namespace fastmha::cpu {

// FASTMHA_CPU_FLOAT_GEMM: `auto` (default) as `brgemm` on AMD processors with AVX-512 and as `blas` elsewhere;
// `blas` multiplies on the BLAS's sgemm; `brgemm` on oneDNN's brgemm wherever it runs (elsewhere as blas).
enum class FloatGemmMode { kAuto, kBlas, kBrgemm };
FloatGemmMode float_gemm_mode();

// How a forward's (or with `backward`, a backward's) float32 products run under `mode`: on brgemm or not, and why
// in words (for fastmha.explain; empty where they run on the BLAS as usual).
struct FloatProducts {
  bool on_brgemm = false;
  std::string note;
};
FloatProducts choose_float_products(FloatGemmMode mode, bool backward = false);

// Whether oneDNN's float32 brgemm runs here: an x86-64 processor with AVX2 (elsewhere ATen's brgemm is its plain
// GEMM), oneDNN enabled in torch, and a small product of small integers that matches its exact result (checked
// once).
bool float_brgemm_works();

// The most distinct product shapes the process runs on brgemm, for each of BrgemmShapes.
constexpr int kMaxBrgemmShapes = 32;

// Groups of products, each with kMaxBrgemmShapes places of its own, so that none takes another's: the attention
// forward's and the attention backward's (shapes that follow the sequence lengths and the keys a mask leaves,
// the backward's more of them), and the block's projections' (brgemm_matmul.h: shapes that follow the model's sizes
// only).
enum class BrgemmShapes { kAttention, kAttentionBackward, kProjections };

// Whether the process runs products of this shape on brgemm (see brgemm_if_admitted): true where it did before or
// there was still a place for a new one among `shapes`, which the shape now takes; false for an empty product.
bool brgemm_admits(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                   BrgemmShapes shapes = BrgemmShapes::kAttention);

// C (m x n, row stride ldc) (+)= A (m x k, row stride lda) . B (k x n, row stride ldb) on brgemm, when the process
// runs this shape there (it did before, or there is still a place for a new one, kMaxBrgemmShapes): false, and
// nothing written, otherwise (also for an empty product).
bool brgemm_if_admitted(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                        float* c, int64_t ldc, bool add_c, BrgemmShapes shapes = BrgemmShapes::kAttention);

}  // namespace fastmha::cpu
