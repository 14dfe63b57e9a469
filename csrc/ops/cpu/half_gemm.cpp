#include "ops/cpu/half_gemm.h"

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ops/cpu/cpu_capability.h"

namespace fastmha::cpu {

HalfGemmMode half_gemm_mode() {
  // Read at every call, as the other switches: set it before the first forward.
  const char* value = std::getenv("FASTMHA_CPU_HALF_GEMM");
  const std::string mode = value == nullptr || *value == '\0' ? "widen" : value;
  if (mode == "widen") return HalfGemmMode::kWiden;
  if (mode == "native") return HalfGemmMode::kNative;
  if (mode == "reference") return HalfGemmMode::kReference;
  TORCH_CHECK(false, "fastmha: FASTMHA_CPU_HALF_GEMM must be widen, native or reference, got '", mode, "'");
}

bool native_half_products(at::ScalarType dtype) {
  if (!at::globalContext().userEnabledMkldnn()) {
    return false;  // brgemm would fall back to the reference GEMM
  }
  if (dtype == at::kBFloat16) return native_bfloat16_products();
  if (dtype == at::kHalf) return native_float16_products();
  return false;
}

bool multiplies_in_half_type(at::ScalarType dtype, HalfGemmMode mode) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    return false;
  }
  return mode == HalfGemmMode::kReference || (mode == HalfGemmMode::kNative && native_half_products(dtype));
}

std::string half_products_note(at::ScalarType dtype, bool forward) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    return "";
  }
  const std::string type = dtype == at::kBFloat16 ? "bfloat16" : "float16";
  const auto mode = half_gemm_mode();
  if (!forward) {
    return type + " products widened to float32";
  }
  switch (mode) {
    case HalfGemmMode::kReference:
      return type + " products in ATen's reference GEMM (FASTMHA_CPU_HALF_GEMM=reference)";
    case HalfGemmMode::kNative:
      return native_half_products(dtype)
                 ? type + " products on this CPU's own instructions (oneDNN brgemm)"
                 : type + " products widened to float32: this CPU has no native " + type + " products";
    default:
      return type + " products widened to float32 (FASTMHA_CPU_HALF_GEMM=widen)";
  }
}

void pack_transposed(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst) {
  const int64_t depth = padded_depth(d);
  if (vnni && d % 2 == 0) {  // a pair of elements of a key is one 32-bit word: a transpose of words
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* row = src + j * ld;
      for (int64_t p = 0; p < d / 2; ++p) std::memcpy(dst + (p * n + j) * 2, row + 2 * p, sizeof(uint32_t));
    }
    std::fill(dst + d * n, dst + depth * n, uint16_t{0});
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* row = src + j * ld;
    for (int64_t r = 0; r < d; ++r) dst[packed_index(r, j, n, vnni)] = row[r];
    for (int64_t r = d; r < depth; ++r) dst[packed_index(r, j, n, vnni)] = 0;
  }
}

void pack_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t d, bool vnni, uint16_t* dst) {
  const int64_t depth = padded_depth(n);
  if (!vnni) {
    for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * d, src + r * ld, static_cast<size_t>(d) * sizeof(uint16_t));
    std::fill(dst + n * d, dst + depth * d, uint16_t{0});
    return;
  }
  for (int64_t r = 0; r < depth; r += 2) {  // rows r and r + 1 interleaved
    const uint16_t* even = r < n ? src + r * ld : nullptr;
    const uint16_t* odd = r + 1 < n ? src + (r + 1) * ld : nullptr;
    uint16_t* pair = dst + r * d;
    for (int64_t c = 0; c < d; ++c) {
      pair[2 * c] = even ? even[c] : uint16_t{0};
      pair[2 * c + 1] = odd ? odd[c] : uint16_t{0};
    }
  }
}

void pad_rows(const uint16_t* src, int64_t ld, int64_t m, int64_t d, uint16_t* dst) {
  const int64_t depth = padded_depth(d);
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(dst + r * depth, src + r * ld, static_cast<size_t>(d) * sizeof(uint16_t));
    std::fill(dst + r * depth + d, dst + (r + 1) * depth, uint16_t{0});
  }
}

void half_gemm(HalfKind kind, bool vnni, int64_t m, int64_t n, int64_t depth, const uint16_t* a, int64_t lda,
               const uint16_t* b, float* c, int64_t ldc, bool add_c) {
  if (m == 0 || n == 0) {
    return;
  }
  if (depth == 0) {  // an empty sum
    for (int64_t r = 0; r < m && !add_c; ++r) std::fill(c + r * ldc, c + r * ldc + n, 0.0f);
    return;
  }
  namespace blas = at::native::cpublas;
  if (kind == HalfKind::kBFloat16) {
    blas::brgemm(m, n, depth, lda, n, ldc, add_c, reinterpret_cast<const at::BFloat16*>(a),
                 reinterpret_cast<const at::BFloat16*>(b), c, vnni);
  } else {
    blas::brgemm(m, n, depth, lda, n, ldc, add_c, reinterpret_cast<const at::Half*>(a),
                 reinterpret_cast<const at::Half*>(b), c, vnni);
  }
}

void half_gemm_release(bool vnni) {
  if (vnni) {
    at::native::cpublas::brgemm_release(true);
  }
}

}  // namespace fastmha::cpu
