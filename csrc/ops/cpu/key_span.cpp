#include "ops/cpu/key_span.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fastmha::cpu {
namespace {

constexpr int64_t kVisibleRun = 64;
constexpr int64_t kScanKeys = 64;

// The first true entry of the n entries of a row, or n.
int64_t first_visible(const bool* row, int64_t stride, int64_t n) {
  if (n <= 0) {
    return n;
  }
  if (stride == 0) {
    return row[0] ? 0 : n;
  }
  if (stride == 1) {
    const void* found = std::memchr(row, 1, static_cast<size_t>(n));
    return found == nullptr ? n : static_cast<const bool*>(found) - row;
  }
  int64_t j = 0;
  while (j < n && !row[j * stride]) ++j;
  return j;
}

// The last true entry of the n entries of a row, or -1.
int64_t last_visible(const bool* row, int64_t stride, int64_t n) {
  if (n <= 0) {
    return -1;
  }
  if (stride == 0) {
    return row[0] ? n - 1 : -1;
  }
  if (stride == 1) {
    const void* found = memrchr(row, 1, static_cast<size_t>(n));
    return found == nullptr ? -1 : static_cast<const bool*>(found) - row;
  }
  int64_t j = n - 1;
  while (j >= 0 && !row[j * stride]) --j;
  return j;
}

// Whether some of the n entries of a row is false.
bool any_hidden(const bool* row, int64_t stride, int64_t n) {
  if (n <= 0) {
    return false;
  }
  if (stride == 0) {
    return !row[0];
  }
  if (stride == 1) {
    return std::memchr(row, 0, static_cast<size_t>(n)) != nullptr;
  }
  for (int64_t j = 0; j < n; ++j) {
    if (!row[j * stride]) return true;
  }
  return false;
}

// The rows x len_k entries of a mask sample (rows, len_k) as bool in `out` (row stride len_k): nonzero, NaN too,
// attends. A plain loop for the usual dtypes: an ATen op per sample costs more than the sample's reads.
void sample_as_bool(const at::Tensor& sample, std::vector<uint8_t>& out) {
  const int64_t rows = sample.size(0), len_k = sample.size(1), row = sample.stride(0), col = sample.stride(1);
  out.resize(static_cast<size_t>(rows * len_k));
  const auto dtype = sample.scalar_type();
  const auto usual = {at::kByte, at::kChar,     at::kShort, at::kInt,   at::kLong,
                      at::kHalf, at::kBFloat16, at::kFloat, at::kDouble};
  if (std::find(usual.begin(), usual.end(), dtype) == usual.end()) {
    const at::Tensor converted = sample.ne(0).contiguous();
    std::memcpy(out.data(), converted.const_data_ptr<bool>(), out.size());
    return;
  }
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mask_sample", [&] {
    const scalar_t* data = sample.const_data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < len_k; ++j) {
        out[r * len_k + j] = static_cast<uint8_t>(data[r * row + j * col] != scalar_t(0));
      }
    }
  });
}

}  // namespace

std::pair<int64_t, int64_t> visible_range(const bool* row, int64_t stride, int64_t n) {
  const int64_t first = first_visible(row, stride, n);
  if (first == n) {
    return {n, -1};
  }
  return {first, first + last_visible(row + first * stride, stride, n - first)};
}

MaskRowExtents mask_row_extents(const at::Tensor& mask_view) {
  MaskRowExtents result;
  if (!mask_view.defined() || mask_view.numel() == 0 || mask_view.stride(3) == 0) {
    return result;
  }
  TORCH_INTERNAL_ASSERT(mask_view.scalar_type() == at::kBool && mask_view.dim() == 4);
  int64_t sizes[3];
  for (int i = 0; i < 3; ++i) sizes[i] = mask_view.stride(i) == 0 ? 1 : mask_view.size(i);
  result.stride[2] = sizes[2] == 1 ? 0 : 1;
  result.stride[1] = sizes[1] == 1 ? 0 : sizes[2];
  result.stride[0] = sizes[0] == 1 ? 0 : sizes[1] * sizes[2];
  const int64_t len_k = mask_view.size(3), col_stride = mask_view.stride(3);
  result.extents.resize(static_cast<size_t>(sizes[0] * sizes[1] * sizes[2]));
  const bool* data = mask_view.const_data_ptr<bool>();
  const int64_t rows = static_cast<int64_t>(result.extents.size());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t q = i % sizes[2], h = i / sizes[2] % sizes[1], b = i / (sizes[1] * sizes[2]);
      const bool* row = data + b * mask_view.stride(0) + h * mask_view.stride(1) + q * mask_view.stride(2);
      const auto [first, last] = visible_range(row, col_stride, len_k);
      result.extents[static_cast<size_t>(i)] = {first, last,
                                                first < last && has_hidden_key(row, col_stride, first, last)};
    }
  });
  return result;
}

int64_t keys_up_to_last_visible(const RowExtent* extents, int64_t row_stride, int64_t rows, int64_t n) {
  int64_t keys = 0;
  for (int64_t r = 0; r < (row_stride == 0 ? std::min<int64_t>(rows, 1) : rows); ++r) {
    const RowExtent& row = extents[r * row_stride];
    if (row.first > row.last) {
      return n;  // a row without a visible key is uniform over all keys
    }
    keys = std::max(keys, row.last + 1);
  }
  return rows == 0 ? n : keys;
}

bool has_hidden_key(const bool* row, int64_t stride, int64_t first, int64_t last) {
  return any_hidden(row + (first + 1) * stride, stride, last - first - 1);
}

KeyBlock next_visible_block(const bool* mask, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t from,
                            int64_t end, int64_t block) {
  const int64_t distinct = row_stride == 0 ? std::min<int64_t>(rows, 1) : rows;
  auto row = [&](int64_t r, int64_t key) { return mask + r * row_stride + key * col_stride; };
  int64_t lo = end;  // each row's search stops at the best start found so far
  for (int64_t r = 0; r < distinct && lo > from; ++r) {
    lo = from + first_visible(row(r, from), col_stride, lo - from);
  }
  if (lo == end) {
    return {end, end, false};
  }
  // Which keys of the window some row sees (any) and every row sees (all), read kScanKeys keys at a time over
  // all rows: the run ends at its last key some row sees before a gap of kSplitGap keys that every row hides
  // (so a run of one key next to a gap reads no more than a segment of the mask).
  const int64_t n = std::min(lo + block, end) - lo;
  thread_local std::vector<uint8_t> any_buffer, all_buffer;
  any_buffer.assign(static_cast<size_t>(n), 0);
  all_buffer.assign(static_cast<size_t>(n), 1);
  uint8_t* __restrict any = any_buffer.data();
  uint8_t* __restrict all = all_buffer.data();
  int64_t last = 0;  // key lo itself is seen
  bool gap = false;
  for (int64_t scanned = 0; scanned < n && !gap;) {
    const int64_t next = std::min(scanned + kScanKeys, n);
    for (int64_t r = 0; r < distinct; ++r) {
      const auto* __restrict keys = reinterpret_cast<const uint8_t*>(row(r, lo));
      if (col_stride == 1) {  // vectorized
        for (int64_t j = scanned; j < next; ++j) {
          any[j] |= keys[j];
          all[j] &= keys[j];
        }
      } else {
        for (int64_t j = scanned; j < next; ++j) {
          any[j] |= keys[j * col_stride];
          all[j] &= keys[j * col_stride];
        }
      }
    }
    for (int64_t j = std::max<int64_t>(scanned, 1); j < next && !gap; ++j) {
      if (any[j]) {
        last = j;
      } else {
        gap = j - last >= kSplitGap;
      }
    }
    scanned = next;
  }
  const void* hidden = std::memchr(all, 0, static_cast<size_t>(last + 1));
  if (hidden == nullptr) {
    return {lo, lo + last + 1, false};
  }
  // A run whose first kVisibleRun keys or more every row sees ends there, so that they are computed without
  // reading the mask (the blocks of a causal mask below its diagonal).
  const int64_t visible = static_cast<const uint8_t*>(hidden) - all;
  return visible >= kVisibleRun ? KeyBlock{lo, lo + visible, false} : KeyBlock{lo, lo + last + 1, true};
}

double computed_key_fraction(const at::Tensor& mask, int64_t batch, int64_t heads, int64_t len_q, int64_t len_k) {
  const auto view = mask.expand({batch, heads, len_q, len_k});
  if (view.numel() == 0 || view.stride(3) == 0) {
    return 1.0;
  }
  constexpr int64_t kRows = 64, kBlock = 256, kChunks = 4, kSlices = 8;
  // Distinct (batch, head) slices (a zero stride repeats one), a few spread evenly.
  const int64_t bs = view.stride(0) == 0 ? 1 : batch, hs = view.stride(1) == 0 ? 1 : heads;
  const int64_t slices = std::min(bs * hs, kSlices), chunks = (len_q + kRows - 1) / kRows;
  const int64_t sampled_chunks = std::min(chunks, kChunks);
  double computed = 0, total = 0;
  std::vector<uint8_t> converted;
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t slice = slices == 1 ? 0 : s * (bs * hs - 1) / (slices - 1);
    for (int64_t c = 0; c < sampled_chunks; ++c) {
      const int64_t chunk = sampled_chunks == 1 ? chunks - 1 : c * (chunks - 1) / (sampled_chunks - 1);
      const int64_t row0 = chunk * kRows, rows = std::min(kRows, len_q - row0);
      // Only the sampled rows of a mask that is not bool are converted.
      const auto sample = view.select(0, slice / hs).select(0, slice % hs).narrow(0, row0, rows);
      const bool* first = sample.scalar_type() == at::kBool ? sample.const_data_ptr<bool>() : nullptr;
      int64_t row_stride = sample.stride(0), col_stride = sample.stride(1);
      if (first == nullptr) {
        sample_as_bool(sample, converted);
        first = reinterpret_cast<const bool*>(converted.data());
        row_stride = len_k;
        col_stride = 1;
      }
      int64_t keys = 0;
      for (int64_t lo = 0; lo < len_k;) {
        const KeyBlock run = next_visible_block(first, row_stride, col_stride, rows, lo, len_k, kBlock);
        keys += run.hi - run.lo;
        lo = run.hi;
      }
      computed += static_cast<double>(keys == 0 ? len_k : keys);
      total += static_cast<double>(len_k);
    }
  }
  return total == 0 ? 1.0 : computed / total;
}

}  // namespace fastmha::cpu
