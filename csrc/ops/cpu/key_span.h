// Which keys a mask leaves a group of query rows to compute. fastmha's CPU kernels compute, for each chunk of
// queries, only the runs of keys that some row of it sees (padding, causality, block-sparse holes) and skip the
// rest; torch's CPU flash kernel computes them all. The kernel choice weighs the two with an estimate.
// Compiled once (not per vector ISA): unit-stride rows are searched with glibc's vectorized memchr/memrchr,
// which rely on torch's bool being one byte holding 0 or 1.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace fastmha::cpu {

// The first and last true entry among row[0], row[stride], ... (n entries), or {n, -1} when there is none.
std::pair<int64_t, int64_t> visible_range(const bool* row, int64_t stride, int64_t n);

// The keys one mask row shows: its first and last visible key (first > last: none) and whether it hides a key
// between them.
struct RowExtent {
  int64_t first, last;
  bool holes;
};

// The RowExtent of each distinct row of a bool mask view of shape (B, H, Lq, Lk) (broadcast dimensions, of stride 0,
// are read once): row (b, h, q) at extents[b * stride[0] + h * stride[1] + q * stride[2]]. Found once per call, in
// parallel, for the kernels' chunks, which would otherwise each search their rows again for every head that
// shares them. Empty without a mask and for one that does not vary over the keys (Lk stride 0).
struct MaskRowExtents {
  std::vector<RowExtent> extents;
  int64_t stride[3] = {0, 0, 0};
};
MaskRowExtents mask_row_extents(const at::Tensor& mask_view);

// The number of keys up to the last one that any of `rows` mask rows shows (row r at extents[r * row_stride]; a
// row stride of 0 means one row), or n when some row shows none.
int64_t keys_up_to_last_visible(const RowExtent* extents, int64_t row_stride, int64_t rows, int64_t n);

// Whether some entry of the row strictly between `first` and `last` is false.
bool has_hidden_key(const bool* row, int64_t stride, int64_t first, int64_t last);

// Keys that every row hides, at least, for a run to end before them: a shorter gap is computed (masked) rather
// than split into two products.
constexpr int64_t kSplitGap = 32;

// A run of keys [lo, hi) for a group of query rows; `masked`: some row hides a key inside it.
struct KeyBlock {
  int64_t lo, hi;
  bool masked;
};

// The next run of at most `block` keys, searching [from, end), that `rows` mask rows need (row r at
// mask + r * row_stride, its keys col_stride apart; a row stride of 0 means one row): it starts at the first key
// some row sees and ends after the last key some row sees within `block` keys of that, or earlier, before a gap
// of 32 keys or more that every row hides, or, when every row sees its first 64 keys or more, where that stops.
// {end, end, false} when no row sees a key in [from, end).
KeyBlock next_visible_block(const bool* mask, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t from,
                            int64_t end, int64_t block);

// The share of the keys fastmha's kernels compute under this mask (of any dtype, broadcast to (batch, heads,
// len_q, len_k)): the runs of next_visible_block (256 keys at most) over chunks of 64 query rows, for a sample of
// up to 4 chunks (the last among them) of up to 8 (batch, head) slices. 1 for masks that do not vary over the
// keys; a chunk with no visible key counts as all keys (its rows are uniform over all of them).
double computed_key_fraction(const at::Tensor& mask, int64_t batch, int64_t heads, int64_t len_q, int64_t len_k);

}  // namespace fastmha::cpu
