// fastmha::MultiHeadAttention, the C++ frontend twin of the Python fastmha.MultiHeadAttentionBlock.
// Parameters are named w_q.weight, w_k.weight, w_v.weight, w_o.weight as in Python, so weights move between
// the two (e.g. through a TorchScript archive or torch::save / torch::load of the parameters).
//
//   fastmha::MultiHeadAttention mha(fastmha::MultiHeadAttentionOptions(512, 8).dropout(0.1));
//   auto y = mha(x, x, x, mask);          // (batch, L, 512)
//   auto w = mha->attention_scores();     // (batch, 8, L, L), post-dropout
//
// forward may run on many threads at once (eval mode gives each the same result as a serial call).
#pragma once

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_module_holder.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <mutex>
#include <optional>
#include <utility>

namespace fastmha {

namespace detail {
// The last forward's weights, safe to set and read from many threads at once (concurrent forwards on one
// module are allowed; which call's weights remain is then unspecified). Copies get their own lock.
class LastWeights {
 public:
  LastWeights() = default;
  LastWeights(const LastWeights& other) : tensor_(other.get()) {}
  LastWeights& operator=(const LastWeights& other) {
    set(other.get());
    return *this;
  }
  void set(at::Tensor tensor) {
    std::lock_guard<std::mutex> lock(mutex_);
    tensor_ = std::move(tensor);
  }
  at::Tensor get() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return tensor_;
  }

 private:
  mutable std::mutex mutex_;
  at::Tensor tensor_;
};
}  // namespace detail

struct MultiHeadAttentionOptions {
  MultiHeadAttentionOptions(int64_t d_model, int64_t heads) : d_model_(d_model), heads_(heads) {}

  /// Model width; inputs are (batch, seq, d_model). Must be divisible by heads.
  TORCH_ARG(int64_t, d_model);
  /// Number of heads h; each has d_k = d_model / h features.
  TORCH_ARG(int64_t, heads);
  /// Dropout probability on the attention weights, in training mode only, in [0, 1] (1 drops every weight). It
  /// initialises the module's `dropout` submodule, which forward and forward_step read (its p and training mode),
  /// as in Python: change it later through `dropout->options.p()`.
  TORCH_ARG(double, dropout) = 0.0;
  /// Keep the attention weights after each forward (attention_scores()); false saves their memory.
  TORCH_ARG(bool, need_weights) = true;
  /// Query i attends keys j <= i only (top-left aligned when Lq != Lk), without a mask tensor.
  TORCH_ARG(bool, is_causal) = false;
};

class MultiHeadAttentionImpl : public torch::nn::Cloneable<MultiHeadAttentionImpl> {
 public:
  MultiHeadAttentionImpl(int64_t d_model, int64_t heads)
      : MultiHeadAttentionImpl(MultiHeadAttentionOptions(d_model, heads)) {}
  explicit MultiHeadAttentionImpl(const MultiHeadAttentionOptions& options);

  /// query (batch, Lq, d_model), key and value (batch, Lk, d_model); mask of any dtype broadcastable to
  /// (batch, heads, Lq, Lk), positions where mask == 0 are not attended. Returns (batch, Lq, d_model).
  at::Tensor forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& mask = {});

  /// Incremental decoding of a decoder's self-attention, as the Python block's forward_step: x (batch, T_new,
  /// d_model) are new positions, cache the (key, value) tensors (batch, heads, T_past, d_k) that the previous step
  /// returned (std::nullopt at the start). Each new position attends the cached positions and the new ones up to
  /// itself, where mask (broadcastable to (batch, heads, T_new, T_past + T_new)) is not 0. Returns the output
  /// (batch, T_new, d_model) and the new cache (pass it back as is, or std::make_pair(keys, values));
  /// attention_scores() is left as it was. The outputs equal forward's with a causal mask, except for a position
  /// that sees no key: forward spreads it over every position of the sequence, a step over the cached positions
  /// and the new ones of its call.
  std::pair<at::Tensor, std::pair<at::Tensor, at::Tensor>> forward_step(
      const at::Tensor& x, const std::optional<std::pair<at::Tensor, at::Tensor>>& cache = std::nullopt,
      const at::Tensor& mask = {});

  /// The post-dropout attention weights of the last forward (batch, heads, Lq, Lk); undefined when
  /// need_weights is false or before the first forward.
  at::Tensor attention_scores() const { return attention_scores_.get(); }

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  MultiHeadAttentionOptions options;
  torch::nn::Linear w_q{nullptr}, w_k{nullptr}, w_v{nullptr}, w_o{nullptr};
  torch::nn::Dropout dropout{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({3, torch::nn::AnyValue(at::Tensor())})

 private:
  // The dropout forward and forward_step apply now: the dropout submodule's probability, checked, in its training
  // mode, else 0. op_p is what the ops are given; drops_all (p = 1) zeroes what they return instead.
  struct AppliedDropout {
    double op_p;
    bool drops_all;
    at::Tensor applied_to(const at::Tensor& t) const { return drops_all ? t * 0.0 : t; }
  };
  AppliedDropout applied_dropout() const;

  detail::LastWeights attention_scores_;
};

TORCH_MODULE(MultiHeadAttention);

}  // namespace fastmha
