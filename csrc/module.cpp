#include <fastmha/module.h>
#include <fastmha/ops.h>

#include <c10/util/Exception.h>

namespace fastmha {
namespace {

void check_dropout(double p) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "fastmha: dropout must be in [0, 1], got ", p);  // NaN fails both
}

// The ops take no mask as std::nullopt; the module's callers pass an undefined tensor.
std::optional<at::Tensor> optional_mask(const at::Tensor& mask) {
  return mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
}

}  // namespace

MultiHeadAttentionImpl::MultiHeadAttentionImpl(const MultiHeadAttentionOptions& options_) : options(options_) {
  reset();
}

void MultiHeadAttentionImpl::reset() {
  const auto d_model = options.d_model();
  const auto heads = options.heads();
  TORCH_CHECK(d_model > 0, "fastmha: d_model must be positive, got ", d_model);
  TORCH_CHECK(heads > 0, "fastmha: heads must be positive, got ", heads);
  TORCH_CHECK(d_model % heads == 0, "fastmha: d_model must be divisible by heads, got d_model ", d_model, " and heads ",
              heads);
  check_dropout(options.dropout());
  auto linear = torch::nn::LinearOptions(d_model, d_model).bias(false);
  w_q = register_module("w_q", torch::nn::Linear(linear));
  w_k = register_module("w_k", torch::nn::Linear(linear));
  w_v = register_module("w_v", torch::nn::Linear(linear));
  w_o = register_module("w_o", torch::nn::Linear(linear));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
  attention_scores_.set(at::Tensor());
}

at::Tensor MultiHeadAttentionImpl::forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                           const at::Tensor& mask) {
  const AppliedDropout drop = applied_dropout();
  auto [output, weights] =
      multi_head_attention(query, key, value, w_q->weight, w_k->weight, w_v->weight, w_o->weight, options.heads(),
                           optional_mask(mask), drop.op_p, options.need_weights(), options.is_causal());
  attention_scores_.set(options.need_weights() ? drop.applied_to(weights) : at::Tensor());
  return drop.applied_to(output);
}

std::pair<at::Tensor, std::pair<at::Tensor, at::Tensor>> MultiHeadAttentionImpl::forward_step(
    const at::Tensor& x, const std::optional<std::pair<at::Tensor, at::Tensor>>& cache, const at::Tensor& mask) {
  const AppliedDropout drop = applied_dropout();
  auto [output, keys, values] = multi_head_attention_step(
      x, w_q->weight, w_k->weight, w_v->weight, w_o->weight, options.heads(),
      cache.has_value() ? std::optional<at::Tensor>(cache->first) : std::nullopt,
      cache.has_value() ? std::optional<at::Tensor>(cache->second) : std::nullopt, optional_mask(mask), drop.op_p);
  return {drop.applied_to(output), {keys, values}};
}

MultiHeadAttentionImpl::AppliedDropout MultiHeadAttentionImpl::applied_dropout() const {
  // The registered dropout module decides, as the Python block's does: its probability (options.dropout() at
  // construction, dropout->options.p() after) while it is in training mode.
  const double p = dropout->options.p();
  check_dropout(p);
  const double applied = dropout->is_training() ? p : 0.0;
  // The ops take p < 1; torch::nn::Dropout(1.0) drops every weight, which zeroes the weights and the output.
  return applied < 1.0 ? AppliedDropout{applied, false} : AppliedDropout{0.0, true};
}

void MultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "fastmha::MultiHeadAttention(d_model=" << options.d_model() << ", heads=" << options.heads()
         << ", dropout=" << dropout->options.p() << ", need_weights=" << (options.need_weights() ? "true" : "false")
         << ", is_causal=" << (options.is_causal() ? "true" : "false") << ")";
}

}  // namespace fastmha
