// How much of the key range a mask leaves to compute: fastmha's CPU kernels skip the keys before the first
// and after the last visible one of each query chunk (padding), torch's CPU flash kernel computes them all.
// The kernel choice weighs the two with this estimate.
#pragma once

#include <ATen/core/Tensor.h>

namespace fastmha::cpu {

// The mean over the mask's (batch, head) rows of (last visible key - first visible key + 1) / len_k, read
// from the last query row (for padding and padding & causal masks that row spans the widest range). 1 for
// masks that do not vary over the keys; a row with no visible key counts as all keys.
double visible_key_fraction(const at::Tensor& mask, int64_t len_k);

}  // namespace fastmha::cpu
