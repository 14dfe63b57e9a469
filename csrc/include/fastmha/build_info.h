// What this copy of the fastmha library was built with (reported by fastmha._C and C++ programs).
#pragma once

#include <string>

namespace fastmha {

struct BuildInfo {
  std::string version;        // fastmha version
  std::string torch_version;  // torch the library was compiled against
  bool cuda_kernels;          // whether the CUDA kernels are compiled in
  std::string cuda_version;   // nvcc version, empty without CUDA
  std::string cuda_archs;     // TORCH_CUDA_ARCH_LIST used, empty without CUDA
};

BuildInfo build_info();

// The CPU kernel variant this process runs: "avx512", "avx2" or "default" (ATEN_CPU_CAPABILITY can lower it).
std::string cpu_capability();

// Whether this CPU multiplies "bfloat16" (AVX512-BF16, AMX-BF16) or "float16" (AVX512-FP16) natively; false for
// other names. Where it does not, the block computes its projections in that type by widening them to fp32.
bool cpu_native_products(const std::string& dtype);

// Whether the block computes a projection of `rows` rows (tokens) in "bfloat16" or "float16" on this CPU by widening
// the operands to fp32 and rounding the product once: where the CPU does not multiply the type natively, except
// float16 under float32 matmul precision "medium" (whose fp32 products may round operands to bfloat16), and except
// products of a few rows (a decoding step's), which stay torch's. False for other names.
bool cpu_widens_products(const std::string& dtype, int64_t rows);

}  // namespace fastmha
