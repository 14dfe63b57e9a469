// The CPU forward's float32 products on oneDNN's brgemm (ops/cpu/float_gemm.h): the process runs at most
// kMaxBrgemmShapes distinct shapes on it, the same in every thread, each product equal to a matmul of the same
// values, and refuses the rest without writing anything (its caller then multiplies on the BLAS).
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <thread>
#include <tuple>
#include <vector>

#include "ops/cpu/float_gemm.h"

namespace {

using fastmha::cpu::brgemm_if_admitted;
using fastmha::cpu::kMaxBrgemmShapes;

// C (+)= A B for an m x k A and k x n B taken from wider row-major buffers (row strides lda, ldb, ldc), on brgemm if
// the process admits the shape; whether it did, checked against the matmul of the same values.
bool checked_product(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add_c) {
  // Small integers: every sum is exact in float32, so the product must equal the matmul exactly.
  const auto a = at::randint(-3, 4, {m, lda}, at::kFloat), b = at::randint(-3, 4, {k, ldb}, at::kFloat);
  auto c = at::randint(-3, 4, {m, ldc}, at::kFloat);
  const auto before = c.clone();
  const bool ran = brgemm_if_admitted(m, n, k, a.const_data_ptr<float>(), lda, b.const_data_ptr<float>(), ldb,
                                      c.data_ptr<float>(), ldc, add_c);
  auto expected = before.clone();
  if (ran) {
    const auto product = at::matmul(a.narrow(1, 0, k), b.narrow(1, 0, n));
    expected.narrow(1, 0, n).copy_(add_c ? before.narrow(1, 0, n) + product : product);
  }
  CHECK(at::equal(c, expected));  // refused: nothing written; and never a column past n
  return ran;
}

}  // namespace

TEST_CASE("The process runs at most kMaxBrgemmShapes shapes on brgemm, never changing its mind, each exact",
          "[float gemm]") {
  if (!fastmha::cpu::float_brgemm_works()) {
    WARN("oneDNN's float32 brgemm does not run here: nothing to check");
    return;
  }
  // Shapes no kernel call makes (B's row stride of 1000 and more): other tests in this process may have taken some
  // of the places, so a first run admits a prefix of them, the places left, and refuses the rest.
  const auto shape = [](int i) { return std::make_tuple(3 + i % 4, 16 + i / 8, 24, 40, 1000 + i, 48, i % 2 == 0); };
  const auto run = [&](int i) {
    const auto [m, n, k, lda, ldb, ldc, add_c] = shape(i);
    return checked_product(m, n, k, lda, ldb, ldc, add_c);
  };
  std::vector<bool> first;
  for (int i = 0; i < kMaxBrgemmShapes + 8; ++i) first.push_back(run(i));
  const auto admitted = std::count(first.begin(), first.end(), true);
  CHECK(admitted <= kMaxBrgemmShapes);
  CHECK(std::is_sorted(first.rbegin(), first.rend()));  // true ... true false ... false
  CHECK_FALSE(first.back());
  // The same decisions again, from another thread too; an empty product is left to the caller.
  std::thread([&] {
    for (int i = 0; i < kMaxBrgemmShapes + 8; ++i) CHECK(run(i) == first[i]);
    CHECK_FALSE(checked_product(0, 7, 9, 9, 7, 7, false));
  }).join();
}
