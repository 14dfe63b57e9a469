// fastmha's CUDA attention kernels for c10::Half tensors.
#include "ops/cuda/attention_kernels.cuh"

FASTMHA_INSTANTIATE_CUDA_KERNELS(c10::Half, float)
FASTMHA_INSTANTIATE_CUDA_MMA_KERNELS(c10::Half)
