// The block's float32 forward projections x W^T on oneDNN's inner product (torch's mkldnn::_linear_pointwise op)
// instead of the BLAS's sgemm, where FASTMHA_CPU_FLOAT_GEMM puts float32 products on oneDNN (float_gemm.h: by
// default AMD processors with AVX-512, on which MKL runs no AVX-512 code). On Zen 4 x W^T took 0.79-0.95x its
// sgemm time from 512 rows (256-1024 features).
// The backward's products run on oneDNN's brgemm instead (brgemm_matmul.h): on this op its input gradients g W
// gained 0-2% of the block's forward + backward (within noise) and its weight gradients g^T x measured slower.
//
// oneDNN compiles a kernel for each new product shape (a few milliseconds, kept in its bounded cache of recent
// shapes), so products of fewer than kFewestOnednnRows rows, such as the decoding steps of a small batch, stay on
// the BLAS.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace fastmha::cpu {

constexpr int64_t kFewestOnednnRows = 512;

// x W^T (x: (..., d_in), weight: (d_out, d_in)): on oneDNN where both are plain float32 CPU tensors (not fake,
// functional, batched or otherwise wrapped, nor a negated view) that autograd does not record (the op has no
// derivative), where CPU autocast would not cast it (the op has no autocast rule), with kFewestOnednnRows rows of x
// or more, the switch putting float32 products on oneDNN and torch carrying the op; by at::linear elsewhere. Half
// types widened to float32 count as float32.
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight);

// Whether t is a dense CPU tensor of known sizes whose data is there, with no other dispatch key than those of every
// such tensor (autograd's, autocast's): not fake, symbolic, functional, batched, wrapped by a transform, nested, or
// a negated or conjugated view. Its sizes and strides may be read.
bool plain_cpu(const at::Tensor& t);

// Whether a float32 product of a and b over `rows` rows (the rows of x, or of the gradients a backward product
// reads) may run on oneDNN: the conditions of float_linear above, but for the operands' shapes and torch's op.
bool onednn_takes_product(const at::Tensor& a, const at::Tensor& b, int64_t rows);

}  // namespace fastmha::cpu
