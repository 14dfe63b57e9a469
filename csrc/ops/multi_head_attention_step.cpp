// Incremental decoding: the block's self-attention for new decoder positions, with a key/value cache of the
// earlier positions' projected keys and values. A step projects only the new positions (O(new) projections
// instead of re-projecting the whole prefix) and attends with the new queries over cache + new keys, each new
// position seeing keys up to itself (causal, aligned to the end of the cache).
// It is composed of registered ops (linear, to, cat, fastmha::attention), so autograd, TorchScript and
// torch.compile handle it through them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <fastmha/ops.h>

#include "ops/checks.h"
#include "ops/heads.h"
#include "ops/widened_products.h"

namespace fastmha {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> multi_head_attention_step_impl(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
    int64_t num_heads, const std::optional<at::Tensor>& key_cache, const std::optional<at::Tensor>& value_cache,
    const std::optional<at::Tensor>& mask, double dropout_p) {
  TORCH_CHECK(key_cache.has_value() == value_cache.has_value(),
              "fastmha: key_cache and value_cache must be given together");
  check_dense(x, "x");
  check_given_defined(key_cache, "key_cache");
  check_given_defined(value_cache, "value_cache");  // the mask's check comes with its shape's, below
  check_block_inputs(x, x, x, w_q, w_k, w_v, w_o, num_heads, std::nullopt, dropout_p, "x");
  auto keys = split_heads(widened_linear(x, w_k), num_heads);
  auto values = split_heads(widened_linear(x, w_v), num_heads);
  if (key_cache.has_value()) {
    // Against the new keys, not x: under autocast the projections (and so the caches) are in the autocast type.
    const std::pair<const at::Tensor*, const char*> caches[] = {{&*key_cache, "key_cache"},
                                                                {&*value_cache, "value_cache"}};
    for (const auto& [cache, name] : caches) {
      TORCH_CHECK(cache->scalar_type() == keys.scalar_type() && cache->device() == keys.device(), "fastmha: ", name,
                  " must have the projected keys' dtype ", keys.scalar_type(), " and device ", keys.device(), ", got ",
                  cache->scalar_type(), " on ", cache->device());
    }
    TORCH_CHECK(key_cache->dim() == 4 && key_cache->sym_size(0) == keys.sym_size(0) &&
                    key_cache->sym_size(1) == keys.sym_size(1) && key_cache->sym_size(3) == keys.sym_size(3) &&
                    value_cache->sym_sizes() == key_cache->sym_sizes(),
                "fastmha: key_cache and value_cache must have shape (batch, heads, T_past, d_k) = (", keys.sym_size(0),
                ", ", keys.sym_size(1), ", T_past, ", keys.sym_size(3), "), got key_cache ", key_cache->sym_sizes(),
                " and value_cache ", value_cache->sym_sizes());
    keys = at::cat({*key_cache, keys}, 2);
    values = at::cat({*value_cache, values}, 2);
  } else {
    keys = keys.contiguous();
    values = values.contiguous();
  }
  const auto len_new = x.sym_size(1), len_total = keys.sym_size(2);
  // The caller's mask, checked as given (not after it is combined with the causal cut).
  check_attention_mask(mask, x, x.sym_size(0), c10::SymInt(num_heads), len_new, len_total, "x");
  // New position i (absolute T_past + i) sees keys j <= T_past + i.
  auto positions = at::arange(c10::Scalar(len_total), x.options().dtype(at::kLong));
  auto limits = at::arange(c10::Scalar(len_new), x.options().dtype(at::kLong)).add(c10::Scalar(len_total - len_new));
  auto visible = positions.unsqueeze(0).le(limits.unsqueeze(1));  // (T_new, T_total)
  auto combined = mask.has_value() ? at::logical_and(mask->ne(0), visible) : visible;
  auto [heads_out, weights] =
      attention(split_heads(widened_linear(x, w_q), num_heads), keys, values, combined, dropout_p,
                /*need_weights=*/false, /*is_causal=*/false);
  auto merged = merge_heads(heads_out);
  return {widened_linear(merged, w_o), keys, values};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> multi_head_attention_step(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
    int64_t num_heads, const std::optional<at::Tensor>& key_cache, const std::optional<at::Tensor>& value_cache,
    const std::optional<at::Tensor>& mask, double dropout_p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastmha::multi_head_attention_step", "")
                       .typed<decltype(multi_head_attention_step)>();
  return op.call(x, w_q, w_k, w_v, w_o, num_heads, key_cache, value_cache, mask, dropout_p);
}

TORCH_LIBRARY_FRAGMENT(fastmha, m) {
  m.def(
      "multi_head_attention_step(Tensor x, Tensor w_q, Tensor w_k, Tensor w_v, Tensor w_o, int num_heads, "
      "Tensor? key_cache=None, Tensor? value_cache=None, Tensor? mask=None, float dropout_p=0.0) "
      "-> (Tensor output, Tensor key_cache, Tensor value_cache)",
      {at::Tag::nondeterministic_seeded});
}

TORCH_LIBRARY_IMPL(fastmha, CompositeImplicitAutograd, m) {
  m.impl("multi_head_attention_step", &multi_head_attention_step_impl);
}

}  // namespace fastmha
