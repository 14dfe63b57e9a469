// How much of the key range a mask leaves to compute: fastmha's CPU kernels skip the keys before the first
// and after the last visible one of each query chunk (padding), torch's CPU flash kernel computes them all.
// The kernel choice weighs the two with this estimate.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace fastmha::cpu {

// The first and last true entry among row[0], row[stride], ... (n entries), or {n, -1} when there is none.
// Compiled once (not per vector ISA): unit-stride rows are searched with glibc's vectorized memchr/memrchr,
// which rely on torch's bool being one byte holding 0 or 1.
std::pair<int64_t, int64_t> visible_range(const bool* row, int64_t stride, int64_t n);

// Whether some entry of the row strictly between `first` and `last` is false.
bool has_hidden_key(const bool* row, int64_t stride, int64_t first, int64_t last);

// The mean over the mask's (batch, head) rows of (last visible key - first visible key + 1) / len_k, read
// from the last query row (for padding and padding & causal masks that row spans the widest range). 1 for
// masks that do not vary over the keys; a row with no visible key counts as all keys.
double visible_key_fraction(const at::Tensor& mask, int64_t len_k);

}  // namespace fastmha::cpu
