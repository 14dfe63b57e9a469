// fastmha's CUDA attention kernels for c10::BFloat16 tensors.
#include "ops/cuda/attention_kernels.cuh"

FASTMHA_INSTANTIATE_CUDA_KERNELS(c10::BFloat16, float)
FASTMHA_INSTANTIATE_CUDA_MMA_KERNELS(c10::BFloat16)
