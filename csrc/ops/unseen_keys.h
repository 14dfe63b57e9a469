// Keys that no query sees, through a padding mask for instance: the block projects only the others.
//
// Where mask == 0 the score is -1e9, and next to a visible key scoring well above that, such a key weighs exactly
// 0. A key that every query of its batch element has masked (every head, every query) then changes no output, no
// kept weight and no gradient, as long as its key and value projections are finite (0 * inf is NaN: in the output
// through the value, in the query's gradient through the key). So the block computes the key and value projections of
// the seen rows only, with zeros elsewhere, checks afterwards that every row's log-sum-exp leaves the unseen keys a
// weight of exactly 0, and otherwise projects the unseen rows too and runs the attention again (with the same
// dropout draw).
//
// Left open: a finite dO whose product with an unseen value row overflows (|dO| |v| beyond the dtype's range) is
// NaN in the math's softmax backward through that key's zero weight; with the zero row it stays finite.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fastmha {

// Rows of the flattened (batch * Lk) key and value inputs, as int64 indices.
struct KeyRows {
  at::Tensor seen, unseen;
};

// The rows some query sees through `mask` (any shape broadcastable to (batch, h, Lq, Lk); nonzero = attend), and
// the others. All keys of a batch element count as seen when one of its query rows sees no key (the -1e9 rule
// spreads that row's weight over every key). nullopt where skipping is not worth it or not possible here: no mask,
// is_causal, a mask that does not vary over keys, fewer than 1/4 of the rows unseen, or tensors other than dense CPU
// ones (on a GPU the choice would synchronize; meta and fake tensors have no data).
std::optional<KeyRows> split_key_rows(const std::optional<at::Tensor>& mask, const at::Tensor& key,
                                      const at::Tensor& value, bool is_causal);

// x W^T (x: batch, L, d_in) on the given rows of x, and zeros on the others.
at::Tensor project_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rows);

// Writes x W^T on the given rows of x into those rows of `out` (batch, L, d_out).
void project_rows_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rows);

// Whether key W_k^T and value W_v^T are surely finite on the given rows: x there and W are finite, and the largest
// |x| times W's largest row sum of |w| stays below half the dtype's largest value (for each of the two products).
// False where an input and its weight differ in dtype. `rows` must index rows of key and value (batch * L of them).
bool projections_surely_finite(const at::Tensor& key, const at::Tensor& w_k, const at::Tensor& value,
                               const at::Tensor& w_v, const at::Tensor& rows);

// Whether every row's log-sum-exp (the attention core's, for keys of length len_k) leaves a key scored -1e9 a
// weight of exactly 0: its exponential underflows even against the row's largest score, which is at least the
// log-sum-exp minus log(len_k). Also false for NaN.
bool unseen_keys_weigh_zero(const at::Tensor& logsumexp, int64_t len_k);

}  // namespace fastmha
