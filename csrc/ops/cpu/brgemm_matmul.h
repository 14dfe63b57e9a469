// The block's backward projection products in float32 on oneDNN's batch-reduce GEMM (at::native::cpublas::brgemm)
// instead of the BLAS's sgemm, where FASTMHA_CPU_FLOAT_GEMM puts float32 products on oneDNN (float_gemm.h: by
// default AMD processors with AVX-512, on which MKL runs no AVX-512 code): the input gradient g W, whose left
// operand g is row-major, and the weight gradient g^T x, whose left operand is a transposed view that each tile
// packs. On Zen 4 (2 threads, 4096 gradient rows, 512 features) each took about 0.9x its sgemm time.
//
// The products are tiled over C, each tile one thread's. brgemm runs whole tiles of 64 rows over whole steps of
// depth, so its kernels' shapes follow the model's sizes, not the number of rows (its own group of places,
// float_gemm.h); the few rows and the depth left over run on ATen's GEMM.
#pragma once

#include <ATen/ATen.h>

namespace fastmha::cpu {

// a b for a (m x k) and b (k x n): on brgemm where a's rows or its columns are contiguous, b's rows are,
// onednn_takes_product (onednn_linear.h) allows it over the rows of the row-major one of g and g^T (m, or k for a
// transposed a), and the process runs the tiles' shapes there (float_gemm.h); by at::matmul elsewhere.
at::Tensor float_matmul(const at::Tensor& a, const at::Tensor& b);

// c += a b (c: m x n and contiguous), on brgemm where float_matmul would be; by c.addmm_(a, b) elsewhere.
void float_addmm_(at::Tensor& c, const at::Tensor& a, const at::Tensor& b);

}  // namespace fastmha::cpu
