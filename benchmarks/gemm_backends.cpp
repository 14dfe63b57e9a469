// Single-thread GFLOP/s of the CPU kernels' float32 block products on the two GEMMs libtorch_cpu exports: the
// Fortran BLAS sgemm (MKL in torch's wheels; what csrc/ops/cpu/blas.h calls) and ATen's batch-reduce GEMM
// at::native::cpublas::brgemm (oneDNN), at the online forward's shapes: S = Q K^T (rows x keys, depth d; brgemm
// takes K^T packed) and O = P V (rows x d, depth keys). Best of 5 runs of 50 calls each.
//
//   T=$(.venv/bin/python -c "import torch, os; print(os.path.dirname(torch.__file__))")
//   g++ -O2 -std=c++20 -I$T/include benchmarks/gemm_backends.cpp -L$T/lib -ltorch_cpu -lc10 \
//       -Wl,-rpath,$T/lib -o /tmp/gemm_backends && /tmp/gemm_backends
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);

namespace {

// Row-major C (m x n) = A (m x k) op(B), op(B) = B^T (B is n x k) when trans_b: the column-major C^T = op(B)^T A^T.
void sgemm(bool trans_b, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  const char ta = trans_b ? 'T' : 'N', tb = 'N';
  const float one = 1, zero = 0;
  sgemm_(&ta, &tb, &n, &m, &k, &one, b, &ldb, a, &lda, &zero, c, &ldc);
}

template <typename F>
double best_seconds(F call) {
  double best = 1e30;
  for (int run = 0; run < 5; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 50; ++i) call();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 50);
  }
  return best;
}

}  // namespace

int main() {
  at::set_num_threads(1);
  std::printf(
      "| d | rows | keys | S = Q K^T: sgemm | brgemm | O = P V: sgemm | brgemm |\n|---|---|---|---|---|---|---|\n");
  for (int d : {64, 128}) {
    for (int rows : {64, 128, 256}) {
      for (int keys : {256, 512, 1024}) {
        std::vector<float> q(rows * d, 0.5f), k(keys * d, 0.25f), k_t(d * keys, 0.25f), s(rows * keys),
            v(keys * d, 0.125f), o(rows * d);
        namespace blas = at::native::cpublas;
        const double qk_sgemm =
            best_seconds([&] { sgemm(true, rows, keys, d, q.data(), d, k.data(), d, s.data(), keys); });
        const double qk_brgemm = best_seconds(
            [&] { blas::brgemm(rows, keys, d, d, keys, keys, false, q.data(), k_t.data(), s.data(), false); });
        const double pv_sgemm =
            best_seconds([&] { sgemm(false, rows, d, keys, s.data(), keys, v.data(), d, o.data(), d); });
        const double pv_brgemm =
            best_seconds([&] { blas::brgemm(rows, d, keys, keys, d, d, false, s.data(), v.data(), o.data(), false); });
        const double flop = 2.0 * rows * keys * d / 1e9;
        std::printf("| %d | %d | %d | %.1f | %.1f | %.1f | %.1f |\n", d, rows, keys, flop / qk_sgemm, flop / qk_brgemm,
                    flop / pv_sgemm, flop / pv_brgemm);
      }
    }
  }
  at::native::cpublas::brgemm_release(false);
  return 0;
}
