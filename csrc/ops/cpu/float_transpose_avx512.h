// An AVX-512 transpose of float32 blocks, for packing a transposed left operand of oneDNN's brgemm
// (brgemm_matmul.h). It gives exactly the scalar copy's result; brgemm_matmul.cpp calls it where the processor runs
// fastmha's AVX512 kernels (cpu_capability.h).
#pragma once

#include <cstdint>

namespace fastmha::cpu::avx512 {

// dst (16 x 16, row stride ld_dst) = the transpose of src (16 x 16, row stride ld_src).
void transpose_16x16(const float* src, int64_t ld_src, float* dst, int64_t ld_dst);

}  // namespace fastmha::cpu::avx512
