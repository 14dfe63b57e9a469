// ops/cpu/blas.h hands the BLAS int sizes and row strides: a product whose row stride or size does not fit one is
// refused with an error before the BLAS reads anything, never truncated into a wrong product.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT

#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "ops/cpu/blas.h"

TEST_CASE("A BLAS product with a row stride beyond int's range is refused", "[blas]") {
  // Never read: the check comes first.
  const std::vector<float> a(64 * 64), b(64 * 64);
  std::vector<float> c(64 * 64);
  const int64_t huge = int64_t{1} << 31;
  REQUIRE_THROWS_WITH(
      fastmha::cpu::DEFAULT::gemm(false, false, 64, 64, 64, 1.0f, a.data(), huge, b.data(), 64, 0.0f, c.data(), 64),
      Catch::Contains("exceed the BLAS's int range") && Catch::Contains("2147483648"));
  // In range: the product runs (ones times ones: every entry is k).
  const std::vector<float> ones(64 * 64, 1.0f);
  fastmha::cpu::DEFAULT::gemm(false, false, 64, 64, 64, 1.0f, ones.data(), 64, ones.data(), 64, 0.0f, c.data(), 64);
  CHECK(c[0] == 64.0f);
  CHECK(c[64 * 64 - 1] == 64.0f);
}
