// fastmha's CUDA attention kernels for double tensors.
#include "ops/cuda/attention_kernels.cuh"

FASTMHA_INSTANTIATE_CUDA_KERNELS(double, double)
