// The thread context the kernel bodies (ops/cuda/flash/*.h) run with on the GPU: a 1-D thread block,
// __syncthreads barriers, atomics, 16x16 warp products on the tensor cores (WMMA, fp32 accumulators), and the
// register-fragment operations of the mma kernels (ldmatrix, mma.sync m16n8k16, cp.async), sm_80 and newer.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>
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

  // op over the 4 lanes of the calling lane's quad (lanes 4g..4g+3, which share rows of an mma fragment).
  template <typename A, typename Op>
  __device__ __forceinline__ A quad_all_reduce(A value, Op op) const {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, 1));
    return op(value, __shfl_xor_sync(0xffffffffu, value, 2));
  }

  // ldmatrix .x4: lane l names row l % 8 of 8x8 matrix l / 8 (16 bytes of shared memory); r[i] receives
  // matrix i's elements (row l / 4, columns 2 (l % 4) and + 1), or with Trans (rows 2 (l % 4) and + 1, column l / 4).
  template <bool Trans, typename T>
  __device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const T* row) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    if constexpr (Trans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(address)
                   : "memory");  // ordered after the plain shared-memory stores before it
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(address)
                   : "memory");
    }
#else
    (void)r;
    (void)row;
    __trap();  // the mma kernels are launched on sm_80 and newer only
#endif
  }

  // d += A * B on the tensor cores: mma.sync.m16n8k16.row.col, fp32 accumulators, fragments as in the PTX ISA.
  template <typename T>
  __device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
      static_assert(std::is_same_v<T, c10::Half>, "mma operands are float16 or bfloat16");
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#else
    (void)d;
    (void)a;
    (void)b0;
    (void)b1;
    __trap();
#endif
  }

  // 16 bytes from global to shared memory without passing through registers (cp.async.cg: bypasses L1).
  // They land once a later copy_wait covers their group; a barrier then shows them to the other threads.
  __device__ __forceinline__ void copy_async16(void* shared, const void* global) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
#else
    (void)shared;
    (void)global;
    __trap();
#endif
  }
  // Closes the calling thread's group of copies issued since the last commit.
  __device__ __forceinline__ void copy_commit() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
  }
  // Waits until at most Pending of the calling thread's committed groups are still in flight.
  template <int Pending>
  __device__ __forceinline__ void copy_wait() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
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
