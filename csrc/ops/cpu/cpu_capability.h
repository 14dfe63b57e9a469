// Which compiled variant of the CPU kernels runs: the best the processor supports, or the one named by
// ATEN_CPU_CAPABILITY (default, avx2, avx512), the variable torch itself honours.
#pragma once

#include <string>

namespace fastmha::cpu {

enum class Capability { DEFAULT, AVX2, AVX512 };

Capability capability();
std::string capability_name();

}  // namespace fastmha::cpu
