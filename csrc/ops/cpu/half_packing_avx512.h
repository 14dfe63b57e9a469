// AVX-512 versions of the data movement around the half-type products (half_gemm.h): packing the right operands
// and storing a product's panel. They give exactly the scalar versions' results; half_gemm.cpp calls them where the
// processor runs fastmha's AVX512 kernels (cpu_capability.h), which is every CPU with native half-type products.
#pragma once

#include <cstdint>

namespace fastmha::cpu::avx512 {

// Whether the packers below take operands with row stride `ld` and rows of `d` elements: they gather 32-bit words
// with 32-bit offsets from a group's first row and read pairs of elements, so d must be at least 2.
bool packs(int64_t ld, int64_t d);

// As fastmha::cpu::pack_transposed and pack_rows (half_gemm.h), for operands that packs() accepts.
void pack_transposed(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst);
void pack_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst);

// c (m x width, row stride ldc) = alpha * panel, or += when `add`; panel holds m rows of kPanel floats.
void store_panel(const float* panel, int64_t m, int64_t width, float* c, int64_t ldc, bool add, float alpha);

}  // namespace fastmha::cpu::avx512
