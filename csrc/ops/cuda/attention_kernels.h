// Host entry points of fastmha's CUDA attention kernels (instantiated per dtype in attention_kernels_*.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "ops/cuda/flash/kernel_common.h"

namespace fastmha::cuda_kernels {

template <typename T, typename Acc>
void launch_flash_forward(const AttentionParams<T, Acc>& p, cudaStream_t stream);
// The register-resident forward (ops/cuda/flash/flash_forward_mma.h): c10::Half and c10::BFloat16, head sizes
// up to kMaxMmaHeadDim, 16 x row_tiles (1 or 2) query rows per warp.
template <typename T>
void launch_flash_forward_mma(const AttentionParams<T, float>& p, int row_tiles, cudaStream_t stream);
// The register-resident backward (ops/cuda/flash/flash_backward_mma.h), for the same types and head sizes.
template <typename T>
void launch_flash_backward_mma(const AttentionParams<T, float>& p, cudaStream_t stream);
template <typename T, typename Acc>
void launch_flash_backward(const AttentionParams<T, Acc>& p, cudaStream_t stream);
template <typename T, typename Acc>
void launch_softmax_forward(const SoftmaxRowsParams<T, Acc>& p, cudaStream_t stream);
template <typename T, typename Acc>
void launch_softmax_backward(const SoftmaxRowsParams<T, Acc>& p, cudaStream_t stream);

// Whether the library holds code (SASS or PTX) that the current device can run.
bool kernel_image_available();

}  // namespace fastmha::cuda_kernels
