#include "ops/cpu/key_span.h"

#include <ATen/ATen.h>

#include <cstring>

namespace fastmha::cpu {

std::pair<int64_t, int64_t> visible_range(const bool* row, int64_t stride, int64_t n) {
  if (stride == 1) {
    const void* first = std::memchr(row, 1, static_cast<size_t>(n));
    if (first == nullptr) {
      return {n, -1};
    }
    const void* last = memrchr(row, 1, static_cast<size_t>(n));
    return {static_cast<const bool*>(first) - row, static_cast<const bool*>(last) - row};
  }
  int64_t first = 0, last = n - 1;
  while (first < n && !row[first * stride]) ++first;
  while (last > first && !row[last * stride]) --last;
  return first == n ? std::pair<int64_t, int64_t>{n, -1} : std::pair<int64_t, int64_t>{first, last};
}

bool has_hidden_key(const bool* row, int64_t stride, int64_t first, int64_t last) {
  if (last - first < 2) {
    return false;
  }
  if (stride == 1) {
    return std::memchr(row + first + 1, 0, static_cast<size_t>(last - first - 1)) != nullptr;
  }
  for (int64_t j = first + 1; j < last; ++j) {
    if (!row[j * stride]) return true;
  }
  return false;
}

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
    const auto [first, last] = visible_range(data + r * len_k, 1, len_k);
    keys += static_cast<double>(first > last ? len_k : last - first + 1);
  }
  return keys / static_cast<double>(rows * len_k);
}

}  // namespace fastmha::cpu
