// Which compiled variant of the CPU kernels runs: the best the processor supports, or the one named by
// ATEN_CPU_CAPABILITY (default, avx2, avx512), the variable torch itself honours.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace fastmha::cpu {

enum class Capability { DEFAULT, AVX2, AVX512 };

Capability capability();
std::string capability_name();

// Whether the processor multiplies bfloat16 / float16 natively (AVX512-BF16 or AMX-BF16; AVX512-FP16): torch's
// GEMMs in those types are then fast, so the block's projections need not be widened.
bool native_bfloat16_products();
bool native_float16_products();
// The two above by type: whether the processor multiplies `dtype` natively (false for any other type).
bool native_products(c10::ScalarType dtype);
// Whether torch's CPU flash kernels multiply `dtype` (a half type) on AMX tiles: they pack their operands for
// them when ATen's cpublas::could_pack says so (which also follows torch.backends.mkldnn, so it is asked at every
// call), and then run several times faster than on AVX512-BF16 dot products or widened, where they are no faster
// than in float32. torch's kernel may still skip the tiles for some shapes (small head counts or head sizes that
// are not multiples of 64); the choice does not model that. Never with torch's CPU capability below AVX512, where its
// kernels fail to pack for them.
bool torch_half_on_tiles(c10::ScalarType dtype);
// The L2 cache of one core in bytes, as the C library reports it (1 MiB when it reports nothing).
int64_t l2_cache_bytes();

}  // namespace fastmha::cpu

// Calls `function(...)` of the compiled variant that capability() picks: fastmha::cpu::AVX512, AVX2 or DEFAULT
// (each variant's translation unit defines the same functions in its own namespace).
#ifdef FASTMHA_CPU_X86
#define FASTMHA_CPU_DISPATCH(function, ...)                    \
  [&] {                                                        \
    switch (::fastmha::cpu::capability()) {                    \
      case ::fastmha::cpu::Capability::AVX512:                 \
        return ::fastmha::cpu::AVX512::function(__VA_ARGS__);  \
      case ::fastmha::cpu::Capability::AVX2:                   \
        return ::fastmha::cpu::AVX2::function(__VA_ARGS__);    \
      default:                                                 \
        return ::fastmha::cpu::DEFAULT::function(__VA_ARGS__); \
    }                                                          \
  }()
#else
#define FASTMHA_CPU_DISPATCH(function, ...) ::fastmha::cpu::DEFAULT::function(__VA_ARGS__)
#endif
