#include "ops/cpu/float_gemm.h"

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <tuple>
#include <vector>

#include "ops/cpu/cpu_capability.h"

namespace fastmha::cpu {
namespace {

bool amd_with_avx512() {
#ifdef FASTMHA_CPU_X86
  static const bool amd = __builtin_cpu_is("amd") && capability() == Capability::AVX512;
  return amd;
#else
  return false;
#endif
}

bool onednn_enabled() { return at::hasMKLDNN() && at::globalContext().userEnabledMkldnn(); }

bool probe() {
  constexpr int64_t m = 16, n = 48, k = 40;
  std::vector<float> a(m * k), b(k * n), c(m * n, 1.0f), expected(m * n, 1.0f);
  for (int64_t i = 0; i < m * k; ++i) a[i] = static_cast<float>(i % 7 - 3);
  for (int64_t i = 0; i < k * n; ++i) b[i] = static_cast<float>(i % 5 - 2);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t p = 0; p < k; ++p) expected[r * n + j] += a[r * k + p] * b[p * n + j];
    }
  }
  try {
    at::native::cpublas::brgemm(m, n, k, k, n, n, /*add_C=*/true, a.data(), b.data(), c.data(), false);
  } catch (const std::exception&) {
    return false;
  }
  return c == expected;
}

using Shape = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;

// The shapes this process runs on brgemm: the first kMaxBrgemmShapes it meets, the same for every thread, so that
// a product's numbers do not depend on which thread runs it. Entries are written once, before the count that
// publishes them; a shape once admitted or refused stays so.
class AdmittedShapes {
 public:
  bool admit(const Shape& shape) {
    const int seen = count_.load(std::memory_order_acquire);
    for (int i = 0; i < seen; ++i) {
      if (shapes_[i] == shape) return true;
    }
    if (seen == kMaxBrgemmShapes) {
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const int now = count_.load(std::memory_order_relaxed);
    for (int i = seen; i < now; ++i) {
      if (shapes_[i] == shape) return true;
    }
    if (now == kMaxBrgemmShapes) {
      return false;
    }
    shapes_[now] = shape;
    count_.store(now + 1, std::memory_order_release);
    return true;
  }

 private:
  std::array<Shape, kMaxBrgemmShapes> shapes_{};
  std::atomic<int> count_{0};
  std::mutex mutex_;
};

}  // namespace

FloatGemmMode float_gemm_mode() {
  // Read at every call, as the other switches.
  const char* value = std::getenv("FASTMHA_CPU_FLOAT_GEMM");
  const std::string mode = value == nullptr || *value == '\0' ? "auto" : value;
  if (mode == "auto") return FloatGemmMode::kAuto;
  if (mode == "blas") return FloatGemmMode::kBlas;
  if (mode == "brgemm") return FloatGemmMode::kBrgemm;
  TORCH_CHECK(false, "fastmha: FASTMHA_CPU_FLOAT_GEMM must be auto, blas or brgemm, got '", mode, "'");
}

bool float_brgemm_works() {
  // Elsewhere ATen's brgemm is its plain GEMM under another name (no oneDNN kernel below AVX2 or off x86-64).
#ifdef FASTMHA_CPU_X86
  static const bool isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  constexpr bool isa = false;
#endif
  if (!isa || !onednn_enabled()) {
    return false;
  }
  static const bool works = probe();
  return works;
}

FloatProducts choose_float_products(FloatGemmMode mode, bool backward) {
  const std::string unavailable = "float32 products on the BLAS: oneDNN's brgemm does not run here";
  const std::string products = backward ? "the blocked backward's products" : "the forward's P V";
  switch (mode) {
    case FloatGemmMode::kBlas:
      return {};
    case FloatGemmMode::kBrgemm:
      if (float_brgemm_works()) {
        return {true, products + " on oneDNN's brgemm (FASTMHA_CPU_FLOAT_GEMM=brgemm)"};
      }
      return {false, unavailable + " (FASTMHA_CPU_FLOAT_GEMM=brgemm)"};
    case FloatGemmMode::kAuto:
      break;
  }
  if (!amd_with_avx512() || !float_brgemm_works()) {
    return {};
  }
  return {true, products + " on oneDNN's brgemm (faster than the BLAS on AMD processors with AVX-512)"};
}

bool brgemm_admits(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                   BrgemmShapes shapes) {
  if (m <= 0 || n <= 0 || k <= 0) {
    return false;
  }
  static AdmittedShapes groups[3];
  return groups[static_cast<int>(shapes)].admit({m, n, k, lda, ldb, ldc, add_c});
}

bool brgemm_if_admitted(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                        float* c, int64_t ldc, bool add_c, BrgemmShapes shapes) {
  if (!brgemm_admits(m, n, k, lda, ldb, ldc, add_c, shapes)) {
    return false;
  }
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add_c, a, b, c, false);
  return true;
}

}  // namespace fastmha::cpu
