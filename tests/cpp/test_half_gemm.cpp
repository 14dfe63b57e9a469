// The half-type products of the CPU forward (ops/cpu/half_gemm.h): the packed layouts of the right operand,
// element by element, and the products against fp32 matmuls of the same half-type values. The VNNI layout is
// multiplied by oneDNN's native kernels only on CPUs that have them (AVX512-BF16, AMX, AVX512-FP16).
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <vector>

#include "ops/cpu/cpu_capability.h"
#include "ops/cpu/half_gemm.h"
#ifdef FASTMHA_CPU_X86
#include "ops/cpu/half_packing_avx512.h"
#endif

namespace {

using fastmha::cpu::HalfKind;

// A half-type tensor's bits, row-major.
std::vector<uint16_t> bits_of(const at::Tensor& t) {
  const auto c = t.contiguous();
  const auto* p = static_cast<const uint16_t*>(c.const_data_ptr());
  return {p, p + c.numel()};
}

// The packed right operand (depth x cols, as pack_* wrote it) unpacked into a dense float matrix; whatever the
// panels hold beyond cols must be zero.
at::Tensor unpack(const std::vector<uint16_t>& packed, int64_t depth, int64_t cols, bool vnni, at::ScalarType dtype) {
  const int64_t panel_cols = fastmha::cpu::packed_size(depth, cols) / std::max<int64_t>(depth, 1);
  std::vector<uint16_t> dense(static_cast<size_t>(depth * panel_cols));
  for (int64_t r = 0; r < depth; ++r) {
    for (int64_t c = 0; c < panel_cols; ++c) {
      dense[r * panel_cols + c] = packed[fastmha::cpu::packed_index(r, c, depth, vnni)];
    }
  }
  const auto all = at::from_blob(dense.data(), {depth, panel_cols}, at::TensorOptions().dtype(dtype)).to(at::kFloat);
  CHECK(at::equal(all.narrow(1, cols, panel_cols - cols), at::zeros({depth, panel_cols - cols})));
  return all.narrow(1, 0, cols);
}

// A left operand (as pad_rows wrote it) as a dense float matrix of its padded rows and depth.
at::Tensor unpack_left(const std::vector<uint16_t>& left, int64_t m, int64_t depth, at::ScalarType dtype) {
  const int64_t rows = fastmha::cpu::padded_rows(m);
  std::vector<uint16_t> dense(static_cast<size_t>(rows * depth));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < depth; ++k) dense[r * depth + k] = left[fastmha::cpu::left_index(r, k, m)];
  }
  return at::from_blob(dense.data(), {rows, depth}, at::TensorOptions().dtype(dtype)).to(at::kFloat);
}

// Pads a matrix with zero rows up to `rows`.
at::Tensor zero_rows_to(const at::Tensor& m, int64_t rows) {
  return at::cat({m, at::zeros({rows - m.size(0), m.size(1)}, m.options())});
}

}  // namespace

TEST_CASE("Panels of 64 columns, the VNNI layout interleaving pairs of rows", "[half gemm]") {
  using fastmha::cpu::packed_index;
  CHECK(packed_index(0, 0, 128, true) == 0);
  CHECK(packed_index(1, 0, 128, true) == 1);
  CHECK(packed_index(0, 1, 128, true) == 2);
  CHECK(packed_index(2, 0, 128, true) == 128);
  CHECK(packed_index(3, 4, 128, true) == 128 + 9);
  CHECK(packed_index(3, 4, 128, false) == 3 * 64 + 4);
  CHECK(packed_index(0, 64, 128, false) == 128 * 64);  // the second panel
  CHECK(packed_index(5, 70, 128, true) == 128 * 64 + (2 * 64 + 6) * 2 + 1);
  CHECK(fastmha::cpu::packed_size(128, 65) == 128 * 128);
  CHECK(fastmha::cpu::padded_depth(1) == 64);
  CHECK(fastmha::cpu::padded_depth(64) == 64);
  CHECK(fastmha::cpu::padded_depth(65) == 128);
  CHECK(fastmha::cpu::padded_rows(1) == 16);
  CHECK(fastmha::cpu::padded_rows(33) == 64);
  CHECK(fastmha::cpu::left_index(2, 3, 20) == 2 * 512 + 3);
  CHECK(fastmha::cpu::left_index(2, 515, 20) == (32 + 2) * 512 + 3);  // the second piece of 512 columns
}

namespace {

using Packer = void (*)(const uint16_t*, int64_t, int64_t, int64_t, bool, uint16_t*);

// pack_transposed and pack_rows of n rows of d elements, ld apart, against the layout read back element by element.
void check_packers(Packer transposed, Packer rows_of, at::ScalarType dtype, bool vnni, int64_t n, int64_t d,
                   int64_t ld) {
  const auto rows = at::randn({n, ld}).to(dtype);
  const auto bits = bits_of(rows);
  const auto dense = rows.narrow(1, 0, d).to(at::kFloat);

  const int64_t depth_d = fastmha::cpu::padded_depth(d);
  std::vector<uint16_t> keys(static_cast<size_t>(fastmha::cpu::packed_size(depth_d, n)), 0xFFFF);
  transposed(bits.data(), ld, n, d, vnni, keys.data());
  CHECK(at::equal(unpack(keys, depth_d, n, vnni, dtype), zero_rows_to(dense.t().contiguous(), depth_d)));

  const int64_t depth_n = fastmha::cpu::padded_depth(n);
  std::vector<uint16_t> values(static_cast<size_t>(fastmha::cpu::packed_size(depth_n, d)), 0xFFFF);
  rows_of(bits.data(), ld, n, d, vnni, values.data());
  CHECK(at::equal(unpack(values, depth_n, d, vnni, dtype), zero_rows_to(dense, depth_n)));
}

}  // namespace

TEST_CASE("Packed right operands hold the keys transposed and the values as rows, zeros beyond", "[half gemm]") {
  const auto dtype = GENERATE(at::kBFloat16, at::kHalf);
  const bool vnni = GENERATE(false, true);
  // Pairs of elements as words or an odd last one; two panels of keys, a part of a group of 16, one key; head
  // sizes of one and more panels; rows further apart than their elements.
  const auto [n, d, ld] = GENERATE(table<int64_t, int64_t, int64_t>(
      {{77, 20, 24}, {77, 21, 24}, {1, 64, 64}, {16, 2, 3}, {130, 128, 512}, {33, 65, 65}, {5, 1, 1}}));
  CAPTURE(dtype, vnni, n, d, ld);
  // Whichever packer this CPU runs, and each implementation by itself.
  check_packers(fastmha::cpu::pack_transposed, fastmha::cpu::pack_rows, dtype, vnni, n, d, ld);
  check_packers(fastmha::cpu::portable::pack_transposed, fastmha::cpu::portable::pack_rows, dtype, vnni, n, d, ld);
#ifdef FASTMHA_CPU_X86
  if (fastmha::cpu::capability() == fastmha::cpu::Capability::AVX512 && fastmha::cpu::avx512::packs(ld, d)) {
    check_packers(fastmha::cpu::avx512::pack_transposed, fastmha::cpu::avx512::pack_rows, dtype, vnni, n, d, ld);
  }
#endif
}

TEST_CASE("Left operands have padded rows and depth, zeros beyond, in pieces of 512 columns", "[half gemm]") {
  const auto dtype = GENERATE(at::kBFloat16, at::kHalf);
  const int64_t m = 37, d = GENERATE(int64_t{20}, int64_t{600}), ld = d + 5;
  const auto rows = at::randn({m, ld}).to(dtype);
  const auto bits = bits_of(rows);
  // Laid out for 64 rows; the products read 48 (computed_rows), which hold zeros beyond m.
  const int64_t depth = fastmha::cpu::padded_depth(d), computed = fastmha::cpu::computed_rows(m);
  std::vector<uint16_t> left(static_cast<size_t>(fastmha::cpu::left_size(m, depth)), 0xFFFF);
  fastmha::cpu::pad_rows(bits.data(), ld, m, d, left.data());
  const auto want = at::zeros({computed, depth});
  want.narrow(0, 0, m).narrow(1, 0, d).copy_(rows.narrow(1, 0, d).to(at::kFloat));
  CHECK(at::equal(unpack_left(left, m, depth, dtype).narrow(0, 0, computed), want));
}

namespace {

// half_gemm of an m x d by d x n product of half-type values (d padded), against the fp32 product, with and
// without adding to C.
void check_half_gemm(at::ScalarType dtype, bool vnni, int64_t m, int64_t n, int64_t d) {
  const auto kind = dtype == at::kBFloat16 ? HalfKind::kBFloat16 : HalfKind::kFloat16;
  const auto a = at::randn({m, d}).to(dtype), b = at::randn({d, n}).to(dtype);
  const int64_t depth = fastmha::cpu::padded_depth(d);
  const auto a_bits = bits_of(a), b_t_bits = bits_of(b.t().contiguous());
  std::vector<uint16_t> left(static_cast<size_t>(fastmha::cpu::left_size(m, depth)));
  std::vector<uint16_t> right(static_cast<size_t>(fastmha::cpu::packed_size(depth, n)));
  fastmha::cpu::pad_rows(a_bits.data(), d, m, d, left.data());
  fastmha::cpu::pack_transposed(b_t_bits.data(), d, n, d, vnni, right.data());  // B = (B^T)^T
  const fastmha::cpu::HalfProductsTask task(vnni);
  const int64_t ldc = n + 3;
  auto c = at::full({m, ldc}, 7.0f);
  fastmha::cpu::half_gemm(kind, vnni, m, n, depth, left.data(), {right.data(), depth}, c.data_ptr<float>(), ldc, false);
  const auto want = at::matmul(a.to(at::kFloat), b.to(at::kFloat));
  CHECK(at::allclose(c.narrow(1, 0, n), want, 1e-4, 1e-4));
  CHECK(at::equal(c.narrow(1, n, 3), at::full({m, 3}, 7.0f)));  // nothing written beyond n columns
  fastmha::cpu::half_gemm(kind, vnni, m, n, depth, left.data(), {right.data(), depth}, c.data_ptr<float>(), ldc, true,
                          0.5f);
  CHECK(at::allclose(c.narrow(1, 0, n), 1.5 * want, 1e-4, 1e-4));
}

// half_gemm of an m x d product whose right operand is rows lo .. lo + d of a `total` x n operand packed once
// (as the kernels take a block of keys from a head's values): d a multiple of 64, or lo + d == total.
void check_half_gemm_inside(at::ScalarType dtype, bool vnni, int64_t m, int64_t n, int64_t total, int64_t lo,
                            int64_t d) {
  const auto kind = dtype == at::kBFloat16 ? HalfKind::kBFloat16 : HalfKind::kFloat16;
  const auto a = at::randn({m, d}).to(dtype), b = at::randn({total, n}).to(dtype);
  const int64_t depth = fastmha::cpu::padded_depth(d), rows = fastmha::cpu::padded_depth(total);
  const auto a_bits = bits_of(a), b_bits = bits_of(b);
  std::vector<uint16_t> left(static_cast<size_t>(fastmha::cpu::left_size(m, depth)));
  std::vector<uint16_t> whole(static_cast<size_t>(fastmha::cpu::packed_size(rows, n)));
  fastmha::cpu::pad_rows(a_bits.data(), d, m, d, left.data());
  fastmha::cpu::pack_rows(b_bits.data(), n, total, n, vnni, whole.data());
  const fastmha::cpu::HalfProductsTask task(vnni);
  auto c = at::zeros({m, n});
  fastmha::cpu::half_gemm(kind, vnni, m, n, depth, left.data(),
                          fastmha::cpu::packed_from_row(whole.data(), rows, lo, vnni), c.data_ptr<float>(), n, false);
  CHECK(at::allclose(c, at::matmul(a.to(at::kFloat), b.narrow(0, lo, d).to(at::kFloat)), 1e-4, 1e-4));
}

// half_gemm_in_place with the left operand's m rows read in place (row stride ld, the first d elements of each) and
// added into C of padded_rows(m) rows: the products in C's first m rows, the rows from computed_rows(m) on untouched
// (a product of 192 rows runs as 128 + 64, not as 256).
void check_half_gemm_in_place(at::ScalarType dtype, bool vnni, int64_t m, int64_t n, int64_t d, int64_t ld,
                              bool add_c) {
  const auto kind = dtype == at::kBFloat16 ? HalfKind::kBFloat16 : HalfKind::kFloat16;
  const auto a = at::randn({m, ld}).to(dtype), b = at::randn({d, n}).to(dtype);
  const auto a_bits = bits_of(a), b_t_bits = bits_of(b.t().contiguous());
  std::vector<uint16_t> right(static_cast<size_t>(fastmha::cpu::packed_size(d, n)));
  fastmha::cpu::pack_transposed(b_t_bits.data(), d, n, d, vnni, right.data());
  const fastmha::cpu::HalfProductsTask task(vnni);
  const int64_t ldc = (n + fastmha::cpu::kPanel - 1) / fastmha::cpu::kPanel * fastmha::cpu::kPanel + 8;
  auto c = at::full({fastmha::cpu::padded_rows(m), ldc}, 7.0f);
  fastmha::cpu::half_gemm_in_place(kind, vnni, m, n, d, fastmha::cpu::LeftOperand(a_bits.data(), ld), {right.data(), d},
                                   c.data_ptr<float>(), ldc, add_c);
  const auto want = (add_c ? 7.0f : 0.0f) + at::matmul(a.narrow(1, 0, d).to(at::kFloat), b.to(at::kFloat));
  CHECK(at::allclose(c.narrow(0, 0, m).narrow(1, 0, n), want, 1e-4, 1e-4));
  const int64_t computed = fastmha::cpu::computed_rows(m);
  CHECK(at::equal(c.narrow(0, computed, c.size(0) - computed), at::full({c.size(0) - computed, ldc}, 7.0f)));
}

}  // namespace

TEST_CASE("Products of rows that are no power of two run in row blocks, reading the rows in place", "[half gemm]") {
  const auto dtype = GENERATE(at::kBFloat16, at::kHalf);
  const bool vnni = GENERATE(false, true);
  if (vnni && !fastmha::cpu::native_half_products(dtype)) {
    return;  // the VNNI layout needs the native kernels
  }
  check_half_gemm_in_place(dtype, vnni, 192, 128, 64, 512, true);  // 128 + 64 rows
  check_half_gemm_in_place(dtype, vnni, 48, 70, 128, 128, false);  // 32 + 16 rows, a partial panel
  check_half_gemm_in_place(dtype, vnni, 256, 64, 64, 64, true);    // one block
  // A laid-out left operand (pad_rows) of 200 rows, as P V's weights: blocks of 128 + 64 + 16 rows into C of 256
  // rows, the last 48 untouched.
  const auto kind = dtype == at::kBFloat16 ? HalfKind::kBFloat16 : HalfKind::kFloat16;
  const int64_t m = 200, d = 96, n = 64, depth = fastmha::cpu::padded_depth(d);
  const auto a = at::randn({m, d}).to(dtype), b = at::randn({d, n}).to(dtype);
  const auto a_bits = bits_of(a), b_t_bits = bits_of(b.t().contiguous());
  std::vector<uint16_t> left(static_cast<size_t>(fastmha::cpu::left_size(m, depth)), 0xFFFF);
  std::vector<uint16_t> right(static_cast<size_t>(fastmha::cpu::packed_size(depth, n)));
  fastmha::cpu::pad_rows(a_bits.data(), d, m, d, left.data());
  fastmha::cpu::pack_transposed(b_t_bits.data(), d, n, d, vnni, right.data());
  const fastmha::cpu::HalfProductsTask task(vnni);
  auto c = at::full({256, n}, 7.0f);
  fastmha::cpu::half_gemm_in_place(kind, vnni, m, n, depth, left.data(), {right.data(), depth}, c.data_ptr<float>(), n,
                                   false);
  CHECK(at::allclose(c.narrow(0, 0, m), at::matmul(a.to(at::kFloat), b.to(at::kFloat)), 1e-4, 1e-4));
  CHECK(at::equal(c.narrow(0, 208, 48), at::full({48, n}, 7.0f)));
}

TEST_CASE("Half-type products through ATen's reference GEMM (plain layout) match fp32 products", "[half gemm]") {
  const auto dtype = GENERATE(at::kBFloat16, at::kHalf);
  check_half_gemm(dtype, false, 5, 7, 20);
  check_half_gemm(dtype, false, 33, 65, 64);
  check_half_gemm(dtype, false, 17, 130, 1100);                 // three panels, three pieces of the depth
  check_half_gemm_inside(dtype, false, 20, 130, 700, 64, 128);  // a block inside: three panels, 704 rows apart
  check_half_gemm_inside(dtype, false, 20, 70, 700, 128, 572);  // the last block, its depth padded with zeros
  check_half_gemm_inside(dtype, false, 9, 64, 1300, 0, 1280);   // three pieces of the depth inside
}

TEST_CASE("The probe of the native kernels: exact on the reference GEMM, false where they refuse", "[half gemm]") {
  const auto kind = GENERATE(HalfKind::kBFloat16, HalfKind::kFloat16);
  const auto dtype = kind == HalfKind::kBFloat16 ? at::kBFloat16 : at::kHalf;
  CHECK(fastmha::cpu::half_products_probe(kind, false));
  // On a CPU without the kernels ATen refuses VNNI operands: the probe says no instead of throwing.
  CHECK(fastmha::cpu::half_products_probe(kind, true) == fastmha::cpu::native_half_products(dtype));
}

TEST_CASE("Half-type products on the CPU's own instructions (VNNI layout) match fp32 products", "[half gemm]") {
  const auto dtype = GENERATE(at::kBFloat16, at::kHalf);
  if (!fastmha::cpu::native_half_products(dtype)) {
    WARN("this CPU has no native " << dtype << " products: the VNNI path is not run here");
    return;
  }
  check_half_gemm(dtype, true, 5, 7, 20);
  check_half_gemm(dtype, true, 256, 512, 64);                     // the online forward's block shapes
  check_half_gemm(dtype, true, 128, 64, 1000);                    // weights times values over 1000 keys (two pieces)
  check_half_gemm(dtype, true, 350, 130, 96);                     // 256 + 64 + 32 rows (352), three panels
  check_half_gemm(dtype, true, 192, 128, 64);                     // 128 + 64 rows straight into C
  check_half_gemm(dtype, true, 48, 64, 64);                       // 32 + 16 rows straight into C
  check_half_gemm_inside(dtype, true, 256, 128, 1024, 256, 512);  // a block of a head's values packed once
  check_half_gemm_inside(dtype, true, 20, 70, 700, 128, 572);
}
