// The block's backward projection products in float32 on oneDNN's batch-reduce GEMM (at::native::cpublas::brgemm)
// instead of the BLAS's sgemm, where FASTMHA_CPU_FLOAT_GEMM puts float32 products on oneDNN (float_gemm.h: by
// default AMD processors with AVX-512, on which MKL runs no AVX-512 code): the input gradient g W, whose left
// operand g is row-major, and the weight gradient g^T x, whose left operand is a transposed view that each tile
// packs.
//
// The products are tiled over C, each tile one thread's. So that brgemm's kernel shapes follow the model's sizes,
// not the number of gradient rows (its own group of places, float_gemm.h), it runs whole tiles of 64 rows and, for
// g^T x, whole steps of 256 rows of depth; the rows left over (fewer than 64 of g W's, or of g^T x's when its
// features are not a multiple of 64) and g^T x's depth left over (fewer than 256 rows) run on ATen's GEMM.
#pragma once

#include <ATen/ATen.h>

namespace fastmha::cpu {

// a b for a (m x k) and b (k x n): on brgemm where a's rows or its columns are contiguous, b's rows are,
// onednn_takes_product (onednn_linear.h) allows it over the rows of the row-major one of g and g^T (m, or k for a
// transposed a), and the process runs the tiles' shapes there (float_gemm.h); by at::matmul elsewhere.
at::Tensor float_matmul(const at::Tensor& a, const at::Tensor& b);

// c += a b (c: m x n and contiguous), on brgemm where float_matmul would be; by c.addmm_(a, b) elsewhere.
void float_addmm_(at::Tensor& c, const at::Tensor& a, const at::Tensor& b);

// dst (rows x depth, row stride ld_dst) = the transpose of src (depth x rows, row stride ld_src): a transposed
// operand packed for brgemm, in 16 x 16 blocks of AVX-512 registers where fastmha runs its AVX512 kernels.
void pack_transposed(const float* src, int64_t ld_src, int64_t rows, int64_t depth, float* dst, int64_t ld_dst);

}  // namespace fastmha::cpu
