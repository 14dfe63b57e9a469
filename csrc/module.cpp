#include <fastmha/module.h>
#include <fastmha/ops.h>

#include <c10/util/Exception.h>

namespace fastmha {

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
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0, "fastmha: dropout must be in [0, 1), got ",
              options.dropout());
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
  const double dropout_p = is_training() ? options.dropout() : 0.0;
  auto [output, weights] =
      multi_head_attention(query, key, value, w_q->weight, w_k->weight, w_v->weight, w_o->weight, options.heads(),
                           mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt, dropout_p,
                           options.need_weights(), options.is_causal());
  attention_scores_.set(options.need_weights() ? weights : at::Tensor());
  return output;
}

void MultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "fastmha::MultiHeadAttention(d_model=" << options.d_model() << ", heads=" << options.heads()
         << ", dropout=" << options.dropout() << ", need_weights=" << (options.need_weights() ? "true" : "false")
         << ", is_causal=" << (options.is_causal() ? "true" : "false") << ")";
}

}  // namespace fastmha
