// The thread context the kernel bodies (ops/cuda/flash/*.h) run with on the GPU: a 1-D thread block,
// __syncthreads barriers, atomics, and 16x16 warp products on the tensor cores (WMMA, fp32 accumulators).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <type_traits>

namespace fastmha::cuda_kernels {

template <typename T>
struct WmmaType;
template <>
struct WmmaType<c10::Half> {
  using type = __half;
};
template <>
struct WmmaType<c10::BFloat16> {
  using type = __nv_bfloat16;
};

template <int Threads>
struct DeviceThreads {
  static constexpr int kThreads = Threads;
  static constexpr int kWarps = Threads / 32;

  __device__ __forceinline__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ int warp() const { return static_cast<int>(threadIdx.x) / 32; }
  __device__ __forceinline__ int lane() const { return static_cast<int>(threadIdx.x) % 32; }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  // A barrier of the block that also tells whether `predicate` held in any of its threads.
  __device__ __forceinline__ bool sync_or(bool predicate) const { return __syncthreads_or(predicate) != 0; }
  // Orders the calling warp's shared-memory accesses before the call against those after it (shuffles do not).
  __device__ __forceinline__ void warp_sync() const { __syncwarp(); }

  // op over the 32 lanes of the calling warp (a butterfly of shuffles), the result in every lane.
  template <typename A, typename Op>
  __device__ __forceinline__ A warp_all_reduce(A value, Op op) const {
    for (int offset = 16; offset > 0; offset /= 2) {
      value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    return value;
  }

  template <typename A>
  __device__ __forceinline__ void atomic_add(A* address, A value) const {
    atomicAdd(address, value);
  }

  // c[16][16] (+)= A[16][k] * B[k][16], called by all 32 lanes of a warp (layouts as in block_gemm).
  template <bool ACol, bool BCol, bool Accumulate, typename In>
  __device__ __forceinline__ void mma16(const In* a, int lda, const In* b, int ldb, float* c, int ldc, int k) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    namespace wmma = nvcuda::wmma;
    using W = typename WmmaType<In>::type;
    using LayoutA = std::conditional_t<ACol, wmma::col_major, wmma::row_major>;
    using LayoutB = std::conditional_t<BCol, wmma::col_major, wmma::row_major>;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    if (Accumulate) {
      wmma::load_matrix_sync(acc, c, ldc, wmma::mem_row_major);
    } else {
      wmma::fill_fragment(acc, 0.0f);
    }
    wmma::fragment<wmma::matrix_a, 16, 16, 16, W, LayoutA> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, W, LayoutB> fb;
    for (int kk = 0; kk < k; kk += 16) {
      wmma::load_matrix_sync(fa, reinterpret_cast<const W*>(ACol ? a + kk * lda : a + kk), lda);
      wmma::load_matrix_sync(fb, reinterpret_cast<const W*>(BCol ? b + kk : b + kk * ldb), ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c, acc, ldc, wmma::mem_row_major);
#else
    // Before sm_80 (no bf16 WMMA): each lane computes 8 of the 256 outputs with FMAs.
    const int lane = static_cast<int>(threadIdx.x) % 32;
    for (int e = lane; e < 256; e += 32) {
      const int i = e / 16, j = e % 16;
      float sum = Accumulate ? c[i * ldc + j] : 0.0f;
      for (int kk = 0; kk < k; ++kk) {
        sum += static_cast<float>(ACol ? a[kk * lda + i] : a[i * lda + kk]) *
               static_cast<float>(BCol ? b[j * ldb + kk] : b[kk * ldb + j]);
      }
      c[i * ldc + j] = sum;
    }
    __syncwarp();
#endif
  }
};

}  // namespace fastmha::cuda_kernels
