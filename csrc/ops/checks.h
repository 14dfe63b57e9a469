// Input checks shared by every backend's kernels (CPU, CUDA and Meta), so a bad call fails the same way
// eagerly, in TorchScript and while torch.compile traces. Each error names the argument and what it got.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>

namespace fastmha {

// `t` (when defined or given) must be a dense tensor: not sparse, nested or oneDNN-blocked. The ops' autograd kernels
// ask it first, since a tensor of another layout would otherwise meet the dispatcher's "could not run" error.
void check_dense(const at::Tensor& t, const char* name);
void check_dense(const std::optional<at::Tensor>& t, const char* name);
// An optional tensor argument, when given, must be defined (a C++ caller's undefined tensor is Python's None, which
// the argument would take as not given) and dense.
void check_given_defined(const std::optional<at::Tensor>& t, const char* name);
// The attention core's query, key and value given (not None) and dense, and the mask dense: asked by the kernels
// that run before any backend's (autograd, and the composite ones that inference mode reaches; those are also
// registered for nested tensors, which have no backend kernel to name them).
void check_dense_attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const std::optional<at::Tensor>& mask);
// The same for the block op's tensors.
void check_dense_block_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
                            const std::optional<at::Tensor>& mask);

// query (batch, h, Lq, d_k), key (batch, h, Lk, d_k), value (batch, h, Lk, d_v).
void check_attention_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double dropout_p);

// A mask for scores of shape (batch, heads, len_q, len_k): real or bool, on the query's device, broadcastable to
// them without growing them. Errors call the query `query_name`.
void check_attention_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query, const c10::SymInt& batch,
                          const c10::SymInt& heads, const c10::SymInt& len_q, const c10::SymInt& len_k,
                          const char* query_name = "query");

// The backward's tensors from its forward: grad_output and output (batch, h, Lq, d_v) in the query's dtype,
// logsumexp (batch, h, Lq) in its accumulation type, rng_state 2 int64 values; and the forward's own checks.
void check_backward_inputs(const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
                           const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p);

// The backward's kept weights: nullopt, or (batch, h, Lq, Lk) in the query's dtype, on its device.
void check_kept_weights(const std::optional<at::Tensor>& weights, const at::Tensor& query, const at::Tensor& key);
// The weights' gradient: nullopt or undefined (the weights reach no loss), or shaped like the kept weights.
void check_grad_weights(const std::optional<at::Tensor>& grad_weights, const at::Tensor& query, const at::Tensor& key);

// query (batch, Lq, d_model), key and value (batch, Lk, d_model), weights (d_model, d_model). Errors call the
// query `query_name` (a decoding step's is its input x).
void check_block_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& w_q,
                        const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o, int64_t num_heads,
                        const std::optional<at::Tensor>& mask, double dropout_p, const char* query_name = "query");

// `t` in the query's dtype, on its device, of the given shape (`what` names it, e.g. "shape (batch, Lq, d_model)").
void check_shaped_like_query(const at::Tensor& t, const char* name, const at::Tensor& query, c10::SymIntArrayRef shape,
                             const char* what);

}  // namespace fastmha
