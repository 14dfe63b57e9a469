#include "ops/cpu/brgemm_matmul.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "ops/cpu/cpu_capability.h"
#include "ops/cpu/float_gemm.h"
#include "ops/cpu/onednn_linear.h"
#ifdef FASTMHA_CPU_X86
#include "ops/cpu/float_transpose_avx512.h"
#endif

namespace fastmha::cpu {
namespace {

// Tile sizes measured on Zen 4 (1 MiB of L2 a core) at 4096 x 512 by 512 x 512 and 512 x 4096 by 4096 x 512. A
// row-major a: tiles of 64 x 256 over steps of up to 512 of depth (b's piece, 512 KiB, stays in L2 while a
// streams). A transposed a: tiles of 64 rows by up to 512 columns, so that each packed piece of a (64 x 256) serves
// up to 512 columns.
constexpr int64_t kTileRows = 64;
constexpr int64_t kRowMajorCols = 256, kRowMajorDepth = 512;
constexpr int64_t kPackedCols = 512, kPackedDepth = 256;
constexpr int64_t kBlock = 16;  // the fast transpose's block

// C (m x n, row stride ldc) (+)= A (m x k) B (k x n, row stride ldb); A's element (r, p) at a[r * lda + p], or at
// a[p * lda + r] when `transposed`. So that brgemm's shapes follow the model's sizes, not the row count (the rows
// of g, m for a row-major A and k for a transposed one), it runs whole tiles of 64 rows and, for a transposed A,
// whole steps of depth; the rows and that depth left over run on ATen's GEMM.
struct Product {
  int64_t m, n, k;
  const float* a;
  int64_t lda;
  bool transposed;
  const float* b;
  int64_t ldb;
  float* c = nullptr;
  bool add = false;

  int64_t tile_rows() const { return std::min(m, kTileRows); }
  int64_t tile_cols() const { return std::min(n, transposed ? kPackedCols : kRowMajorCols); }
  int64_t depth() const { return std::min(k, transposed ? kPackedDepth : kRowMajorDepth); }
  int64_t tiled_rows() const { return m / tile_rows() * tile_rows(); }
  int64_t tiled_depth() const { return transposed ? k / depth() * depth() : k; }
  // A's row stride as brgemm reads it: a packed piece's for a transposed A.
  int64_t brgemm_lda() const { return transposed ? depth() : lda; }
};

// Whether the process runs every shape of p's brgemm calls there (float_gemm.h): tiles of whole and remaining
// columns, over whole steps of depth and the one left over (row-major A), the first step adding to C only if p adds.
bool all_shapes_admitted(const Product& p) {
  std::vector<int64_t> cols = {p.tile_cols()};
  if (p.n % p.tile_cols() != 0) cols.push_back(p.n % p.tile_cols());
  std::vector<std::pair<int64_t, bool>> steps;
  for (int64_t k0 = 0; k0 < p.tiled_depth(); k0 += p.depth()) {
    const std::pair<int64_t, bool> step = {std::min(p.depth(), p.tiled_depth() - k0), p.add || k0 > 0};
    if (std::find(steps.begin(), steps.end(), step) == steps.end()) steps.push_back(step);
  }
  for (const int64_t width : cols) {
    for (const auto& [depth, add] : steps) {
      if (!brgemm_admits(p.tile_rows(), width, depth, p.brgemm_lda(), p.ldb, p.n, add, BrgemmShapes::kProjections)) {
        return false;
      }
    }
  }
  return true;
}

// The tiles of rows [0, tiled_rows) over depth [0, tiled_depth).
void run_tiles(const Product& p) {
  const int64_t tile_rows = p.tile_rows(), cols = p.tile_cols(), depth = p.depth();
  const int64_t row_tiles = p.tiled_rows() / tile_rows, col_tiles = (p.n + cols - 1) / cols;
  // A row-major A: consecutive tiles of a thread share their piece of b. A transposed A: a tile spans up to 512
  // columns, so each packed piece of A serves them all.
  at::parallel_for(0, row_tiles * col_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> packed(p.transposed ? tile_rows * depth : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = p.transposed ? t / col_tiles : t % row_tiles;
      const int64_t j = p.transposed ? t % col_tiles : t / row_tiles;
      const int64_t r0 = i * tile_rows, c0 = j * cols, width = std::min(cols, p.n - c0);
      for (int64_t k0 = 0; k0 < p.tiled_depth(); k0 += depth) {
        const int64_t size = std::min(depth, p.tiled_depth() - k0);
        const float* a = p.a + r0 * p.lda + k0;
        if (p.transposed) {
          pack_transposed(p.a + k0 * p.lda + r0, p.lda, tile_rows, size, packed.data(), depth);
          a = packed.data();
        }
        at::native::cpublas::brgemm(tile_rows, width, size, p.brgemm_lda(), p.ldb, p.n, p.add || k0 > 0, a,
                                    p.b + k0 * p.ldb + c0, p.c + r0 * p.n + c0, /*is_vnni=*/false);
      }
    }
  });
}

// The product a b on brgemm, where the operands' layout and the switch allow it; C's pointer and `add` are set by
// the caller.
std::optional<Product> brgemm_plan(const at::Tensor& a, const at::Tensor& b) {
  // Sizes are read only where they are known (not while torch.compile traces with symbolic ones).
  if (!plain_cpu(a) || !plain_cpu(b) || a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0) || a.numel() == 0 ||
      b.numel() == 0) {
    return std::nullopt;
  }
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const bool row_major = a.stride(1) == 1 && a.stride(0) >= k;
  const bool transposed = !row_major && a.stride(0) == 1 && a.stride(1) >= m;
  if (!(row_major || transposed) || b.stride(1) != 1 || b.stride(0) < n ||
      !onednn_takes_product(a, b, row_major ? m : k)) {
    return std::nullopt;
  }
  const int64_t lda = row_major ? a.stride(0) : a.stride(1);
  return Product{m, n, k, a.const_data_ptr<float>(), lda, transposed, b.const_data_ptr<float>(), b.stride(0)};
}

// Runs `plan` into c (m x n, contiguous) if the process runs its shapes on brgemm: whether it did.
bool run_if_admitted(std::optional<Product> plan, const at::Tensor& a, const at::Tensor& b, at::Tensor& c, bool add) {
  if (!plan.has_value()) {
    return false;
  }
  plan->c = c.data_ptr<float>();
  plan->add = add;
  if (!all_shapes_admitted(*plan)) {
    return false;
  }
  run_tiles(*plan);
  const int64_t rows = plan->tiled_rows(), depth = plan->tiled_depth();
  if (rows < plan->m) {
    at::Tensor rest = c.narrow(0, rows, plan->m - rows);
    const at::Tensor a_rest = a.narrow(0, rows, plan->m - rows);
    add ? rest.addmm_(a_rest, b) : at::mm_out(rest, a_rest, b);
  }
  if (depth < plan->k) {
    c.narrow(0, 0, rows)
        .addmm_(a.narrow(0, 0, rows).narrow(1, depth, plan->k - depth), b.narrow(0, depth, plan->k - depth));
  }
  return true;
}

}  // namespace

void pack_transposed(const float* src, int64_t ld_src, int64_t rows, int64_t depth, float* dst, int64_t ld_dst) {
#ifdef FASTMHA_CPU_X86
  const bool fast = capability() == Capability::AVX512;
#else
  constexpr bool fast = false;
#endif
  const int64_t whole_rows = fast ? rows / kBlock * kBlock : 0, whole_depth = fast ? depth / kBlock * kBlock : 0;
#ifdef FASTMHA_CPU_X86
  for (int64_t p = 0; p < whole_depth; p += kBlock) {
    for (int64_t r = 0; r < whole_rows; r += kBlock) {
      avx512::transpose_16x16(src + p * ld_src + r, ld_src, dst + r * ld_dst + p, ld_dst);
    }
  }
#endif
  // The rest (all of it without AVX-512) element by element.
  for (int64_t p = 0; p < depth; ++p) {
    for (int64_t r = p < whole_depth ? whole_rows : 0; r < rows; ++r) dst[r * ld_dst + p] = src[p * ld_src + r];
  }
}

at::Tensor float_matmul(const at::Tensor& a, const at::Tensor& b) {
  if (const auto plan = brgemm_plan(a, b); plan.has_value()) {
    at::Tensor c = at::empty({plan->m, plan->n}, a.options());
    if (run_if_admitted(plan, a, b, c, /*add=*/false)) return c;
  }
  return at::matmul(a, b);
}

void float_addmm_(at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  const auto plan = brgemm_plan(a, b);
  if (plan.has_value() && c.scalar_type() == at::kFloat && c.device().is_cpu() && c.is_contiguous() && c.dim() == 2 &&
      c.size(0) == plan->m && c.size(1) == plan->n && run_if_admitted(plan, a, b, c, /*add=*/true)) {
    return;
  }
  c.addmm_(a, b);
}

}  // namespace fastmha::cpu
