#include "ops/cpu/cpu_capability.h"

#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>

#include <cstdlib>
#include <cstring>

#ifdef __unix__
#include <unistd.h>
#endif

namespace fastmha::cpu {
namespace {

Capability detect() {
#ifdef FASTMHA_CPU_X86
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char* requested = std::getenv("ATEN_CPU_CAPABILITY");
  if (requested != nullptr) {
    if (std::strcmp(requested, "default") == 0) return Capability::DEFAULT;
    if (std::strcmp(requested, "avx2") == 0) return avx2 ? Capability::AVX2 : Capability::DEFAULT;
  }
  if (avx512) return Capability::AVX512;
  if (avx2) return Capability::AVX2;
#endif
  return Capability::DEFAULT;
}

}  // namespace

Capability capability() {
  static const Capability chosen = detect();  // fixed for the process, like torch's own choice
  return chosen;
}

std::string capability_name() {
  switch (capability()) {
    case Capability::AVX512:
      return "avx512";
    case Capability::AVX2:
      return "avx2";
    default:
      return "default";
  }
}

bool native_bfloat16_products() {
#ifdef FASTMHA_CPU_X86
  static const bool native = __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
  return native;
#else
  return false;
#endif
}

int64_t l2_cache_bytes() {
#ifdef _SC_LEVEL2_CACHE_SIZE
  static const int64_t bytes = [] {
    const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return reported > 0 ? int64_t{reported} : int64_t{1} << 20;
  }();
  return bytes;
#else
  return int64_t{1} << 20;
#endif
}

bool native_float16_products() {
#ifdef FASTMHA_CPU_X86
  static const bool native = __builtin_cpu_supports("avx512fp16");
  return native;
#else
  return false;
#endif
}

bool native_products(c10::ScalarType dtype) {
  return (dtype == c10::kBFloat16 && native_bfloat16_products()) || (dtype == c10::kHalf && native_float16_products());
}

bool torch_half_on_tiles(c10::ScalarType dtype) {
  if (dtype != c10::kBFloat16 && dtype != c10::kHalf) {
    return false;
  }
  // Below AVX512 (ATEN_CPU_CAPABILITY lowered on an AMX machine) torch's flash kernels still ask could_pack, then
  // refuse to pack ("pack_vnni2 is only supported when avx512 is supported"): no tiles for them, and fastmha's
  // kernel takes those calls.
  static const bool avx512 = at::get_cpu_capability() == "AVX512";
  return avx512 && at::native::cpublas::could_pack(dtype);
}

}  // namespace fastmha::cpu
