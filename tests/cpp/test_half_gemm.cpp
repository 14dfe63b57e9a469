// The half-type products of the CPU forward (ops/cpu/half_gemm.h): the packed layouts of the right operand,
// element by element, and the products against fp32 matmuls of the same half-type values. The VNNI layout is
// multiplied by oneDNN's native kernels only on CPUs that have them (AVX512-BF16, AMX, AVX512-FP16).
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <vector>

#include "ops/cpu/half_gemm.h"

namespace {

using fastmha::cpu::HalfKind;

// A half-type tensor's bits, row-major.
std::vector<uint16_t> bits_of(const at::Tensor& t) {
  const auto c = t.contiguous();
  const auto* p = static_cast<const uint16_t*>(c.const_data_ptr());
  return {p, p + c.numel()};
}

// The packed right operand (depth x cols, as pack_* wrote it) unpacked into a dense float matrix.
at::Tensor unpack(const std::vector<uint16_t>& packed, int64_t depth, int64_t cols, bool vnni, at::ScalarType dtype) {
  std::vector<uint16_t> dense(static_cast<size_t>(depth * cols));
  for (int64_t r = 0; r < depth; ++r) {
    for (int64_t c = 0; c < cols; ++c) dense[r * cols + c] = packed[fastmha::cpu::packed_index(r, c, cols, vnni)];
  }
  return at::from_blob(dense.data(), {depth, cols}, at::TensorOptions().dtype(dtype)).to(at::kFloat);
}

// Pads a matrix with zero rows up to `rows`.
at::Tensor zero_rows_to(const at::Tensor& m, int64_t rows) {
  return at::cat({m, at::zeros({rows - m.size(0), m.size(1)}, m.options())});
}

}  // namespace

TEST_CASE("The VNNI layout interleaves pairs of rows", "[half gemm]") {
  using fastmha::cpu::packed_index;
  CHECK(packed_index(0, 0, 5, true) == 0);
  CHECK(packed_index(1, 0, 5, true) == 1);
  CHECK(packed_index(0, 1, 5, true) == 2);
  CHECK(packed_index(2, 0, 5, true) == 10);
  CHECK(packed_index(3, 4, 5, true) == 19);
  CHECK(packed_index(3, 4, 5, false) == 19);
  CHECK(packed_index(2, 1, 5, false) == 11);
  CHECK(fastmha::cpu::padded_depth(1) == 32);
  CHECK(fastmha::cpu::padded_depth(64) == 64);
  CHECK(fastmha::cpu::padded_depth(65) == 96);
}

TEST_CASE("Packed right operands hold the keys transposed and the values as rows, zeros beyond", "[half gemm]") {
  const auto dtype = GENERATE(at::kBFloat16, at::kHalf);
  const bool vnni = GENERATE(false, true);
  const int64_t d = GENERATE(20, 21);  // pairs of elements as words, or one element at a time
  const int64_t n = 37, ld = 24;       // rows of d elements, 24 apart
  const auto rows = at::randn({n, ld}).to(dtype);
  const auto bits = bits_of(rows);
  const auto dense = rows.narrow(1, 0, d).to(at::kFloat);

  const int64_t depth_d = fastmha::cpu::padded_depth(d);
  std::vector<uint16_t> keys(static_cast<size_t>(depth_d * n), 0xFFFF);
  fastmha::cpu::pack_transposed(bits.data(), ld, n, d, vnni, keys.data());
  CHECK(at::equal(unpack(keys, depth_d, n, vnni, dtype), zero_rows_to(dense.t().contiguous(), depth_d)));

  const int64_t depth_n = fastmha::cpu::padded_depth(n);
  std::vector<uint16_t> values(static_cast<size_t>(depth_n * d), 0xFFFF);
  fastmha::cpu::pack_rows(bits.data(), ld, n, d, vnni, values.data());
  CHECK(at::equal(unpack(values, depth_n, d, vnni, dtype), zero_rows_to(dense, depth_n)));

  std::vector<uint16_t> padded(static_cast<size_t>(n * depth_d), 0xFFFF);
  fastmha::cpu::pad_rows(bits.data(), ld, n, d, padded.data());
  const auto left = at::from_blob(padded.data(), {n, depth_d}, at::TensorOptions().dtype(dtype)).to(at::kFloat);
  CHECK(at::equal(left.narrow(1, 0, d), dense));
  CHECK(at::equal(left.narrow(1, d, depth_d - d), at::zeros({n, depth_d - d})));
}

namespace {

// half_gemm of an m x d by d x n product of half-type values (d padded), against the fp32 product, with and
// without adding to C.
void check_half_gemm(at::ScalarType dtype, bool vnni, int64_t m, int64_t n, int64_t d) {
  const auto kind = dtype == at::kBFloat16 ? HalfKind::kBFloat16 : HalfKind::kFloat16;
  const auto a = at::randn({m, d}).to(dtype), b = at::randn({d, n}).to(dtype);
  const int64_t depth = fastmha::cpu::padded_depth(d);
  const auto a_bits = bits_of(a), b_t_bits = bits_of(b.t().contiguous());
  std::vector<uint16_t> left(static_cast<size_t>(m * depth)), right(static_cast<size_t>(depth * n));
  fastmha::cpu::pad_rows(a_bits.data(), d, m, d, left.data());
  fastmha::cpu::pack_transposed(b_t_bits.data(), d, n, d, vnni, right.data());  // B = (B^T)^T
  const int64_t ldc = n + 3;
  auto c = at::full({m, ldc}, 7.0f);
  fastmha::cpu::half_gemm(kind, vnni, m, n, depth, left.data(), depth, right.data(), c.data_ptr<float>(), ldc, false);
  const auto want = at::matmul(a.to(at::kFloat), b.to(at::kFloat));
  CHECK(at::allclose(c.narrow(1, 0, n), want, 1e-4, 1e-4));
  CHECK(at::equal(c.narrow(1, n, 3), at::full({m, 3}, 7.0f)));  // nothing written beyond n columns
  fastmha::cpu::half_gemm(kind, vnni, m, n, depth, left.data(), depth, right.data(), c.data_ptr<float>(), ldc, true);
  CHECK(at::allclose(c.narrow(1, 0, n), 2 * want, 1e-4, 1e-4));
  fastmha::cpu::half_gemm_release(vnni);
}

}  // namespace

TEST_CASE("Half-type products through ATen's reference GEMM (plain layout) match fp32 products", "[half gemm]") {
  const auto dtype = GENERATE(at::kBFloat16, at::kHalf);
  check_half_gemm(dtype, false, 5, 7, 20);
  check_half_gemm(dtype, false, 33, 65, 64);
}

TEST_CASE("Half-type products on the CPU's own instructions (VNNI layout) match fp32 products", "[half gemm]") {
  const auto dtype = GENERATE(at::kBFloat16, at::kHalf);
  if (!fastmha::cpu::native_half_products(dtype)) {
    WARN("this CPU has no native " << dtype << " products: the VNNI path is not run here");
    return;
  }
  check_half_gemm(dtype, true, 5, 7, 20);
  check_half_gemm(dtype, true, 256, 512, 64);   // the online forward's block shapes
  check_half_gemm(dtype, true, 128, 64, 1000);  // weights times values over 1000 keys
}
