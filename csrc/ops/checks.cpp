#include "ops/checks.h"

#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace fastmha {

void check_dense(const at::Tensor& t, const char* name) {
  if (!t.defined()) {
    return;
  }
  TORCH_CHECK(t.layout() == at::kStrided && !t.is_nested(), "fastmha: ", name,
              " must be a dense (strided) tensor, got ", t.is_nested() ? "a nested tensor" : "layout ",
              t.is_nested() ? std::string() : c10::str(t.layout()));
}

void check_dense(const std::optional<at::Tensor>& t, const char* name) {
  if (t.has_value()) {
    check_dense(*t, name);
  }
}

namespace {

// A required tensor argument: None from Python arrives as an undefined tensor.
void check_defined(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "fastmha: ", name, " must be a tensor, got None (an undefined tensor)");
  check_dense(t, name);
}

}  // namespace

void check_given_defined(const std::optional<at::Tensor>& t, const char* name) {
  if (t.has_value()) {
    check_defined(*t, name);
  }
}

void check_dense_attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const std::optional<at::Tensor>& mask) {
  check_defined(query, "query");
  check_defined(key, "key");
  check_defined(value, "value");
  check_dense(mask, "mask");
}

void check_dense_block_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
                            const std::optional<at::Tensor>& mask) {
  check_dense_attention_args(query, key, value, mask);
  check_defined(w_q, "w_q");
  check_defined(w_k, "w_k");
  check_defined(w_v, "w_v");
  check_defined(w_o, "w_o");
}

namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// `t` must share the query's dtype and device, which fix both for the call (a decoding step's query is named x).
void check_like_query(const at::Tensor& t, const char* name, const at::Tensor& query,
                      const char* query_name = "query") {
  check_defined(t, name);
  TORCH_CHECK(t.scalar_type() == query.scalar_type(), "fastmha: ", name, " must have the ", query_name, "'s dtype ",
              query.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == query.device(), "fastmha: ", name, " must be on the ", query_name, "'s device ",
              query.device(), ", got ", t.device());
}

void check_query_dtype(const at::Tensor& query, const char* query_name = "query") {
  check_defined(query, query_name);
  TORCH_CHECK(is_supported_float(query.scalar_type()), "fastmha: ", query_name,
              " must be a floating-point tensor (float32, float64, float16 or bfloat16), got ", query.scalar_type());
}

void check_dim(const at::Tensor& t, const char* name, int64_t dim, const char* layout) {
  TORCH_CHECK(t.dim() == dim, "fastmha: ", name, " must be ", dim, "-D ", layout, ", got shape ", t.sym_sizes());
}

void check_same_size(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t dim,
                     const char* what) {
  TORCH_CHECK(key.sym_size(dim) == query.sym_size(dim) && value.sym_size(dim) == query.sym_size(dim),
              "fastmha: query, key and value must have the same ", what, " (dim ", dim, "), got query ",
              query.sym_sizes(), ", key ", key.sym_sizes(), ", value ", value.sym_sizes());
}

void check_same_length(const at::Tensor& key, const at::Tensor& value, int64_t dim) {
  TORCH_CHECK(value.sym_size(dim) == key.sym_size(dim), "fastmha: key and value must have the same length (dim ", dim,
              "), got key ", key.sym_sizes(), ", value ", value.sym_sizes());
}

void check_dropout(double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "fastmha: dropout_p must be in [0, 1), got ", dropout_p);
}

// The mask must broadcast to the scores (batch, h, Lq, Lk) without growing them, as masked_fill_ requires.
void check_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query, c10::SymInt batch, c10::SymInt heads,
                c10::SymInt len_q, c10::SymInt len_k, const char* query_name = "query") {
  if (!mask.has_value()) {
    return;
  }
  const at::Tensor& m = *mask;
  check_defined(m, "mask");
  TORCH_CHECK(!at::isComplexType(m.scalar_type()), "fastmha: mask must be a real or bool tensor, got ",
              m.scalar_type());
  TORCH_CHECK(m.device() == query.device(), "fastmha: mask must be on the ", query_name, "'s device ", query.device(),
              ", got ", m.device());
  const std::vector<c10::SymInt> scores = {batch, heads, len_q, len_k};
  TORCH_CHECK(m.dim() <= 4, "fastmha: mask must have at most 4 dims broadcastable to the scores (batch, h, Lq, Lk) ",
              c10::SymIntArrayRef(scores), ", got shape ", m.sym_sizes());
  // The usual mistake: a (batch, Lk) padding mask, which lines up with (Lq, Lk) instead of batch and keys.
  const bool padding_2d = m.dim() == 2 && m.sym_size(0) == batch && m.sym_size(1) == len_k;
  const char* hint =
      padding_2d ? "; a (batch, Lk) padding mask needs the head and query dims: mask[:, None, None, :]" : "";
  for (int64_t i = 1; i <= m.dim(); ++i) {
    const auto& size = m.sym_size(-i);
    const auto& target = scores[4 - i];
    TORCH_CHECK(size == 1 || size == target, "fastmha: mask of shape ", m.sym_sizes(),
                " does not broadcast to the scores (batch, h, Lq, Lk) ", c10::SymIntArrayRef(scores), " (dim ",
                m.dim() - i, " is ", size, ")", hint);
  }
}

}  // namespace

void check_attention_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double dropout_p) {
  check_query_dtype(query);
  check_like_query(key, "key", query);
  check_like_query(value, "value", query);
  check_dim(query, "query", 4, "(batch, h, Lq, d_k)");
  check_dim(key, "key", 4, "(batch, h, Lk, d_k)");
  check_dim(value, "value", 4, "(batch, h, Lk, d_v)");
  check_same_size(query, key, value, 0, "batch size");
  check_same_size(query, key, value, 1, "number of heads");
  TORCH_CHECK(key.sym_size(3) == query.sym_size(3),
              "fastmha: key must have the query's head size d_k (dim 3), got query ", query.sym_sizes(), ", key ",
              key.sym_sizes());
  TORCH_CHECK(query.sym_size(3) > 0, "fastmha: the head size d_k (query dim 3) must be positive, got query ",
              query.sym_sizes());
  check_same_length(key, value, 2);
  check_mask(mask, query, query.sym_size(0), query.sym_size(1), query.sym_size(2), key.sym_size(2));
  check_dropout(dropout_p);
}

void check_block_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& w_q,
                        const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o, int64_t num_heads,
                        const std::optional<at::Tensor>& mask, double dropout_p, const char* query_name) {
  check_query_dtype(query, query_name);
  check_like_query(key, "key", query);
  check_like_query(value, "value", query);
  const std::pair<const at::Tensor*, const char*> weights[] = {
      {&w_q, "w_q"}, {&w_k, "w_k"}, {&w_v, "w_v"}, {&w_o, "w_o"}};
  for (const auto& [w, name] : weights) {
    check_like_query(*w, name, query, query_name);
  }
  TORCH_CHECK(num_heads > 0, "fastmha: num_heads must be positive, got ", num_heads);
  // w_q gives d_model, which the other weights and the inputs must have.
  check_dim(w_q, "w_q", 2, "(d_model, d_model)");
  const auto d_model = w_q.sym_size(0);
  TORCH_CHECK(w_q.sym_size(1) == d_model, "fastmha: w_q must be square (d_model, d_model), got ", w_q.sym_sizes());
  TORCH_CHECK(d_model > 0, "fastmha: d_model (w_q dim 0) must be positive, got w_q of shape ", w_q.sym_sizes());
  for (const auto& [w, name] : weights) {
    TORCH_CHECK(w->dim() == 2 && w->sym_size(0) == d_model && w->sym_size(1) == d_model, "fastmha: ", name,
                " must have w_q's shape (d_model, d_model) = (", d_model, ", ", d_model, "), got ", w->sym_sizes());
  }
  TORCH_CHECK(d_model % num_heads == 0, "fastmha: d_model must be divisible by num_heads, got d_model ", d_model,
              " and num_heads ", num_heads);
  check_dim(query, query_name, 3, "(batch, Lq, d_model)");
  check_dim(key, "key", 3, "(batch, Lk, d_model)");
  check_dim(value, "value", 3, "(batch, Lk, d_model)");
  const std::pair<const at::Tensor*, const char*> inputs[] = {{&query, query_name}, {&key, "key"}, {&value, "value"}};
  for (const auto& [x, name] : inputs) {
    TORCH_CHECK(x->sym_size(2) == d_model, "fastmha: ", name, " must have d_model = ", d_model,
                " features (last dim), got shape ", x->sym_sizes(), "; d_model is w_q's size ", w_q.sym_sizes());
  }
  check_same_size(query, key, value, 0, "batch size");
  check_same_length(key, value, 1);
  check_mask(mask, query, query.sym_size(0), c10::SymInt(num_heads), query.sym_size(1), key.sym_size(1));
  check_dropout(dropout_p);
}

void check_attention_mask(const std::optional<at::Tensor>& mask, const at::Tensor& query, const c10::SymInt& batch,
                          const c10::SymInt& heads, const c10::SymInt& len_q, const c10::SymInt& len_k,
                          const char* query_name) {
  check_mask(mask, query, batch, heads, len_q, len_k, query_name);
}

void check_backward_inputs(const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const std::optional<at::Tensor>& mask, const at::Tensor& output,
                           const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p) {
  check_attention_inputs(query, key, value, mask, dropout_p);
  const auto batch = query.sym_size(0), heads = query.sym_size(1), len_q = query.sym_size(2);
  const std::vector<c10::SymInt> out_shape = {batch, heads, len_q, value.sym_size(3)};
  const std::pair<const at::Tensor*, const char*> outputs[] = {{&grad_output, "grad_output"}, {&output, "output"}};
  for (const auto& [t, name] : outputs) {
    check_shaped_like_query(*t, name, query, out_shape, "the forward output's shape (batch, h, Lq, d_v)");
  }
  check_defined(logsumexp, "logsumexp");
  const std::vector<c10::SymInt> lse_shape = {batch, heads, len_q};
  const auto lse_dtype = at::toOpMathType(query.scalar_type());
  TORCH_CHECK(logsumexp.sym_sizes() == c10::SymIntArrayRef(lse_shape) && logsumexp.scalar_type() == lse_dtype &&
                  logsumexp.device() == query.device(),
              "fastmha: logsumexp must be the forward's (batch, h, Lq) = ", c10::SymIntArrayRef(lse_shape), " ",
              lse_dtype, " on ", query.device(), ", got ", logsumexp.sym_sizes(), " ", logsumexp.scalar_type(), " on ",
              logsumexp.device());
  check_defined(rng_state, "rng_state");
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.dim() == 1 && rng_state.sym_numel() == 2,
              "fastmha: rng_state must be the forward's 2 int64 values (seed, offset), got ", rng_state.sym_sizes(),
              " ", rng_state.scalar_type());
}

namespace {

// `t` shaped like the scores (batch, h, Lq, Lk), in the query's dtype, on its device.
void check_scores_shaped(const at::Tensor& t, const char* name, const char* what, const at::Tensor& query,
                         const at::Tensor& key) {
  check_like_query(t, name, query);
  TORCH_CHECK(t.dim() == 4 && t.sym_size(0) == query.sym_size(0) && t.sym_size(1) == query.sym_size(1) &&
                  t.sym_size(2) == query.sym_size(2) && t.sym_size(3) == key.sym_size(2),
              "fastmha: ", name, " must ", what, " (batch, h, Lq, Lk) = (", query.sym_size(0), ", ", query.sym_size(1),
              ", ", query.sym_size(2), ", ", key.sym_size(2), "), got shape ", t.sym_sizes());
}

}  // namespace

void check_kept_weights(const std::optional<at::Tensor>& weights, const at::Tensor& query, const at::Tensor& key) {
  if (weights.has_value()) {
    check_scores_shaped(*weights, "weights", "be the forward's kept weights of shape", query, key);
  }
}

void check_grad_weights(const std::optional<at::Tensor>& grad_weights, const at::Tensor& query, const at::Tensor& key) {
  if (grad_weights.has_value() && grad_weights->defined()) {
    check_scores_shaped(*grad_weights, "grad_weights", "have the weights' shape", query, key);
  }
}

void check_shaped_like_query(const at::Tensor& t, const char* name, const at::Tensor& query, c10::SymIntArrayRef shape,
                             const char* what) {
  check_like_query(t, name, query);
  TORCH_CHECK(t.sym_sizes() == shape, "fastmha: ", name, " must have ", what, " = ", shape, ", got ", t.sym_sizes());
}

}  // namespace fastmha
