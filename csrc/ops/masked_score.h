// The score the attention math writes where mask == 0, before the softmax (the textbook's
// masked_fill(mask == 0, -1e9)): one constant for every kernel and every rule built on it.
#pragma once

namespace fastmha {

inline constexpr double kMaskedScore = -1e9;

}  // namespace fastmha
