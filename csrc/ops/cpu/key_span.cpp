#include "ops/cpu/key_span.h"

#include <ATen/ATen.h>

#include <cstring>

namespace fastmha::cpu {

double visible_key_fraction(const at::Tensor& mask, int64_t len_k) {
  if (mask.dim() == 0 || mask.size(-1) == 1 || len_k == 0 || mask.numel() == 0) {
    return 1.0;
  }
  auto last_row = mask.dim() >= 2 ? mask.select(-2, mask.size(-2) - 1) : mask;
  const auto visible = last_row.ne(0).reshape({-1, len_k}).to(at::kCPU).contiguous();
  const auto* data = visible.const_data_ptr<bool>();
  const int64_t rows = visible.size(0);
  double keys = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const bool* row = data + r * len_k;
    const void* first = std::memchr(row, 1, static_cast<size_t>(len_k));
    if (first == nullptr) {
      keys += static_cast<double>(len_k);
      continue;
    }
    const void* last = memrchr(row, 1, static_cast<size_t>(len_k));
    keys += static_cast<double>(static_cast<const bool*>(last) - static_cast<const bool*>(first) + 1);
  }
  return keys / static_cast<double>(rows * len_k);
}

}  // namespace fastmha::cpu
