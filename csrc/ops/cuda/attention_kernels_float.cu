// fastmha's CUDA attention kernels for float tensors.
#include "ops/cuda/attention_kernels.cuh"

FASTMHA_INSTANTIATE_CUDA_KERNELS(float, float)
