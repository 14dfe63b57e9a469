// The __global__ wrappers around the kernel bodies and their launches; included once per dtype by
// attention_kernels_<dtype>.cu so the instantiations compile in parallel and rebuild separately. The launch
// code calls the CUDA runtime directly (not through torch), so the launch test can run it against a stand-in
// runtime (tests/cuda_launch/).
#pragma once

#include <c10/util/Exception.h>

#include <climits>
#include <mutex>

#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/cuda_check.h"
#include "ops/cuda/device_threads.cuh"
#include "ops/cuda/flash/flash_backward.h"
#include "ops/cuda/flash/flash_backward_mma.h"
#include "ops/cuda/flash/flash_forward.h"
#include "ops/cuda/flash/flash_forward_mma.h"
#include "ops/cuda/flash/softmax_rows.h"

namespace fastmha::cuda_kernels {

constexpr int kFlashThreads = 128;
constexpr int kRowThreads = 256;
constexpr int kMaxDevices = 64;

template <typename T, typename Acc, int DP>
__global__ void __launch_bounds__(kFlashThreads) flash_forward_kernel(AttentionParams<T, Acc> p, int query_blocks) {
  extern __shared__ __align__(128) char smem[];
  const int64_t block = blockIdx.x;
  flash_forward_block<T, Acc, DP>(DeviceThreads<kFlashThreads>{}, p, smem, block / query_blocks,
                                  static_cast<int>(block % query_blocks));
}

template <typename T, int DP, int RowTiles>
__global__ void __launch_bounds__(MmaForwardTiles<DP, RowTiles>::kThreads)
    flash_forward_mma_kernel(AttentionParams<T, float> p, int query_blocks) {
  extern __shared__ __align__(128) char smem[];
  const int64_t block = blockIdx.x;
  flash_forward_mma_block<T, DP, RowTiles>(DeviceThreads<MmaForwardTiles<DP, RowTiles>::kThreads>{}, p, smem,
                                           block / query_blocks, static_cast<int>(block % query_blocks));
}

template <typename T, int DP>
__global__ void __launch_bounds__(MmaBackwardTiles<DP>::kThreads)
    flash_backward_mma_kernel(AttentionParams<T, float> p, int key_blocks) {
  extern __shared__ __align__(128) char smem[];
  const int64_t block = blockIdx.x;
  flash_backward_mma_block<T, DP>(DeviceThreads<MmaBackwardTiles<DP>::kThreads>{}, p, smem, block / key_blocks,
                                  static_cast<int>(block % key_blocks));
}

template <typename T, typename Acc, int DP>
__global__ void __launch_bounds__(kFlashThreads) flash_backward_kernel(AttentionParams<T, Acc> p, int key_blocks) {
  extern __shared__ __align__(128) char smem[];
  const int64_t block = blockIdx.x;
  flash_backward_block<T, Acc, DP>(DeviceThreads<kFlashThreads>{}, p, smem, block / key_blocks,
                                   static_cast<int>(block % key_blocks));
}

// The row kernels, forward or backward: a block per row, or (RegisterRows) row groups holding rows in registers.
template <bool Backward, typename T, typename Acc>
__global__ void __launch_bounds__(kRowThreads) softmax_rows_kernel(SoftmaxRowsParams<T, Acc> p) {
  __shared__ Acc scratch[kRowThreads / 32];
  if constexpr (Backward) {
    softmax_backward_row<T, Acc>(DeviceThreads<kRowThreads>{}, p, scratch, blockIdx.x);
  } else {
    softmax_forward_row<T, Acc>(DeviceThreads<kRowThreads>{}, p, scratch, blockIdx.x);
  }
}

template <bool Backward, typename Rows, typename T, typename Acc>
__global__ void __launch_bounds__(kRowThreads) softmax_register_rows_kernel(SoftmaxRowsParams<T, Acc> p) {
  __shared__ Acc scratch[kRowThreads / 32];
  if constexpr (Backward) {
    softmax_backward_register_rows<Rows, T, Acc>(DeviceThreads<kRowThreads>{}, p, scratch, blockIdx.x);
  } else {
    softmax_forward_register_rows<Rows, T, Acc>(DeviceThreads<kRowThreads>{}, p, scratch, blockIdx.x);
  }
}

inline unsigned int grid_size(int64_t blocks, const char* what) {
  TORCH_CHECK(blocks <= INT_MAX, "fastmha: ", what, " needs ", blocks, " CUDA blocks, more than one launch allows (",
              INT_MAX, ")");
  return static_cast<unsigned int>(blocks);
}

// Opts a kernel in to its dynamic shared memory (above the 48 KiB default), once per kernel and device (so a
// CUDA graph capture after the usual warm-up makes no attribute calls), and launches it. The kernel is a
// template argument, not a function parameter: all kernels of one dtype share one function type, and the
// once-flags below must belong to one kernel each (the attribute is set per function).
template <auto kernel, typename Params>
void launch_tiled(size_t shared_bytes, int64_t blocks, int per_head, const Params& p, cudaStream_t stream,
                  const char* what, int threads = kFlashThreads) {
  if (blocks == 0) {
    return;
  }
  static std::once_flag opted_in[kMaxDevices];
  int device = 0;
  FASTMHA_CUDA_CHECK(cudaGetDevice(&device));
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "fastmha: CUDA device index ", device, " out of range");
  std::call_once(opted_in[device], [&] {
    FASTMHA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)));
  });
  kernel<<<grid_size(blocks, what), threads, shared_bytes, stream>>>(p, per_head);
  check_launch(what);
}

template <int DP, typename T, typename Acc>
void flash_forward_for(const AttentionParams<T, Acc>& p, cudaStream_t stream) {
  using Tiles = ForwardTiles<T, Acc, DP>;
  const int query_blocks = (p.len_q + Tiles::kRows - 1) / Tiles::kRows;
  launch_tiled<flash_forward_kernel<T, Acc, DP>>(Tiles::kSharedBytes, p.batch_heads * query_blocks, query_blocks, p,
                                                 stream, "the attention forward");
}

template <int DP, int RowTiles, typename T>
void flash_forward_mma_for(const AttentionParams<T, float>& p, cudaStream_t stream) {
  using Tiles = MmaForwardTiles<DP, RowTiles>;
  const int query_blocks = (p.len_q + Tiles::kRows - 1) / Tiles::kRows;
  launch_tiled<flash_forward_mma_kernel<T, DP, RowTiles>>(Tiles::kSharedBytes, p.batch_heads * query_blocks,
                                                          query_blocks, p, stream, "the attention forward (mma)",
                                                          Tiles::kThreads);
}

template <int DP, typename T>
void flash_backward_mma_for(const AttentionParams<T, float>& p, cudaStream_t stream) {
  using Tiles = MmaBackwardTiles<DP>;
  const int key_blocks = (p.len_k + Tiles::kCols - 1) / Tiles::kCols;
  launch_tiled<flash_backward_mma_kernel<T, DP>>(Tiles::kSharedBytes, p.batch_heads * key_blocks, key_blocks, p, stream,
                                                 "the attention backward (mma)", Tiles::kThreads);
}

template <int DP, typename T, typename Acc>
void flash_backward_for(const AttentionParams<T, Acc>& p, cudaStream_t stream) {
  using Tiles = BackwardTiles<T, Acc, DP>;
  const int key_blocks = (p.len_k + Tiles::kCols - 1) / Tiles::kCols;
  launch_tiled<flash_backward_kernel<T, Acc, DP>>(Tiles::kSharedBytes, p.batch_heads * key_blocks, key_blocks, p,
                                                  stream, "the attention backward");
}

template <typename T, typename Acc>
int flash_head_dim(const AttentionParams<T, Acc>& p) {
  const int d = p.d_k > p.d_v ? p.d_k : p.d_v;
  TORCH_CHECK(d <= kMaxFlashHeadDim, "fastmha: the CUDA flash kernels take head sizes up to ", kMaxFlashHeadDim,
              ", got d_k ", p.d_k, " and d_v ", p.d_v);
  return d;
}

template <typename T, typename Acc>
void launch_flash_forward(const AttentionParams<T, Acc>& p, cudaStream_t stream) {
  with_padded_head_dim(flash_head_dim(p), [&](auto dp) { flash_forward_for<decltype(dp)::value>(p, stream); });
}

template <typename T>
void launch_flash_forward_mma(const AttentionParams<T, float>& p, int row_tiles, cudaStream_t stream) {
  TORCH_CHECK(p.d_k <= kMaxMmaHeadDim && p.d_v <= kMaxMmaHeadDim,
              "fastmha: the CUDA mma forward takes head sizes up to ", kMaxMmaHeadDim, ", got d_k ", p.d_k, " and d_v ",
              p.d_v);
  TORCH_CHECK(row_tiles == 1 || row_tiles == 2, "fastmha: the CUDA mma forward gives a warp 1 or 2 row tiles, got ",
              row_tiles);
  const bool narrow = p.d_k <= 64 && p.d_v <= 64;
  if (row_tiles == 1) {
    narrow ? flash_forward_mma_for<64, 1>(p, stream) : flash_forward_mma_for<128, 1>(p, stream);
  } else {
    narrow ? flash_forward_mma_for<64, 2>(p, stream) : flash_forward_mma_for<128, 2>(p, stream);
  }
}

template <typename T>
void launch_flash_backward_mma(const AttentionParams<T, float>& p, cudaStream_t stream) {
  TORCH_CHECK(p.d_k <= kMaxMmaHeadDim && p.d_v <= kMaxMmaHeadDim,
              "fastmha: the CUDA mma backward takes head sizes up to ", kMaxMmaHeadDim, ", got d_k ", p.d_k,
              " and d_v ", p.d_v);
  p.d_k <= 64 && p.d_v <= 64 ? flash_backward_mma_for<64>(p, stream) : flash_backward_mma_for<128>(p, stream);
}

template <typename T, typename Acc>
void launch_flash_backward(const AttentionParams<T, Acc>& p, cudaStream_t stream) {
  with_padded_head_dim(flash_head_dim(p), [&](auto dp) { flash_backward_for<decltype(dp)::value>(p, stream); });
}

// Blocks of kRowThreads threads: rows that fit in registers a row group each (several per block), longer ones
// a block each.
template <bool Backward, typename T, typename Acc>
void launch_softmax_rows(const SoftmaxRowsParams<T, Acc>& p, cudaStream_t stream, const char* what) {
  if (p.rows == 0) {
    return;
  }
  const bool in_registers = with_register_rows(p.len_k, [&](auto rows) {
    using Rows = decltype(rows);
    constexpr int kRowsPerBlock = kRowThreads / Rows::kThreadsPerRow;
    softmax_register_rows_kernel<Backward, Rows, T, Acc>
        <<<grid_size((p.rows + kRowsPerBlock - 1) / kRowsPerBlock, what), kRowThreads, 0, stream>>>(p);
  });
  if (!in_registers) {
    softmax_rows_kernel<Backward, T, Acc><<<grid_size(p.rows, what), kRowThreads, 0, stream>>>(p);
  }
  check_launch(what);
}

template <typename T, typename Acc>
void launch_softmax_forward(const SoftmaxRowsParams<T, Acc>& p, cudaStream_t stream) {
  launch_softmax_rows<false>(p, stream, "the attention softmax");
}

template <typename T, typename Acc>
void launch_softmax_backward(const SoftmaxRowsParams<T, Acc>& p, cudaStream_t stream) {
  launch_softmax_rows<true>(p, stream, "the attention softmax backward");
}

}  // namespace fastmha::cuda_kernels

// Instantiates the four launches for one (storage, accumulation) dtype pair.
#define FASTMHA_INSTANTIATE_CUDA_KERNELS(T, Acc)                                                 \
  namespace fastmha::cuda_kernels {                                                              \
  template void launch_flash_forward<T, Acc>(const AttentionParams<T, Acc>&, cudaStream_t);      \
  template void launch_flash_backward<T, Acc>(const AttentionParams<T, Acc>&, cudaStream_t);     \
  template void launch_softmax_forward<T, Acc>(const SoftmaxRowsParams<T, Acc>&, cudaStream_t);  \
  template void launch_softmax_backward<T, Acc>(const SoftmaxRowsParams<T, Acc>&, cudaStream_t); \
  }

// Instantiates the mma forward and backward for a half type.
#define FASTMHA_INSTANTIATE_CUDA_MMA_KERNELS(T)                                                   \
  namespace fastmha::cuda_kernels {                                                               \
  template void launch_flash_forward_mma<T>(const AttentionParams<T, float>&, int, cudaStream_t); \
  template void launch_flash_backward_mma<T>(const AttentionParams<T, float>&, cudaStream_t);     \
  }
