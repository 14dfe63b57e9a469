// CPU kernels of the attention core: input checks, dtype handling and the hand-off to the fused kernels
// (attention_kernel_impl.cpp, one variant per CPU capability). Scores, softmax and gradients accumulate in fp32.
// The GEMMs of the forward and of the blocked backward multiply half types as they are where the kernel choice
// says so (by default on CPUs with native products once a head has enough query rows multiplying enough keys; the
// limits are choose_half_products', FASTMHA_CPU_HALF_GEMM, ops/cpu/half_gemm.h), and widen them to fp32 otherwise.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "ops/attention_ops.h"
#include "ops/broadcast_mask.h"
#include "ops/checks.h"
#include "ops/cpu/attention_params.h"
#include "ops/cpu/cpu_capability.h"
#include "ops/cpu/half_gemm.h"
#include "ops/cpu/large_buffer.h"
#include "ops/dropout.h"
#include "ops/heads.h"
#include "ops/kernel_choice.h"
#include "ops/stock/stock_attention.h"

namespace fastmha {
namespace {

// q/k/v in the accumulation type with a unit-stride last dim and row strides BLAS accepts.
at::Tensor kernel_operand(const at::Tensor& x, at::ScalarType acc) {
  auto y = x.to(acc);
  if (y.stride(3) != 1 || y.stride(2) < std::max<int64_t>(1, y.size(3))) {
    y = y.contiguous();
  }
  return y;
}

cpu::Strides3 strides3(const at::Tensor& t) { return cpu::Strides3{t.stride(0), t.stride(1), t.stride(2)}; }

// A (batch, h, L, d) output of the kernels in the layout the ops give it for `input` (heads.h).
at::Tensor empty_output(at::IntArrayRef sizes, const at::Tensor& input, const at::TensorOptions& options) {
  if (!heads_interleaved(input)) {
    return cpu::empty_large(sizes, options);
  }
  return cpu::empty_large({sizes[0], sizes[2], sizes[1], sizes[3]}, options).transpose(1, 2);
}

// Keys per block of the blocked kernels: sized to this CPU's L2 cache for the pass, or FASTMHA_CPU_KEY_BLOCK (a
// positive count, for tuning and for tests that cross many block edges with short sequences).
int64_t key_block_size(Pass pass, int64_t len_q, int64_t heads_total, int64_t d_k, int64_t d_v, int64_t element_bytes) {
  const char* requested = std::getenv("FASTMHA_CPU_KEY_BLOCK");
  if (requested != nullptr && *requested != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long keys = std::strtoll(requested, &end, 10);
    TORCH_CHECK(std::isdigit(static_cast<unsigned char>(requested[0])) && *end == '\0' && errno == 0 && keys > 0,
                "FASTMHA_CPU_KEY_BLOCK must be a positive number of keys, got '", requested, "'");
    return keys;
  }
  if (pass == Pass::kBackward) {
    const int64_t rows = cpu::online_query_chunk(len_q, heads_total, at::get_num_threads());
    return cpu::backward_key_block(cpu::l2_cache_bytes(), rows, element_bytes);
  }
  return cpu::forward_key_block(cpu::l2_cache_bytes(), d_k, d_v, element_bytes);
}

// The kernels' inputs. q/k/v in a half type (with T = float) are not read in T (the forward's products take
// them as they are, in.half) or are left to the kernels' tasks to widen (in.half_source), both set by the
// caller: no pointers, rows of d_k and d_v in the tasks' buffers.
template <typename T>
cpu::AttentionInputs<T> kernel_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& mask, const cpu::MaskRowExtents& mask_rows, double dropout_p,
                                      bool is_causal, uint64_t seed, uint64_t offset, Pass pass) {
  cpu::AttentionInputs<T> in{};
  auto operand = [](const at::Tensor& t, const T*& data, cpu::Strides3& stride) {
    const bool typed = t.scalar_type() == c10::CppTypeToScalarType<T>::value;
    data = typed ? t.const_data_ptr<T>() : nullptr;
    stride = typed ? strides3(t) : cpu::Strides3{0, 0, t.size(3)};
  };
  operand(q, in.q, in.q_stride);
  operand(k, in.k, in.k_stride);
  operand(v, in.v, in.v_stride);
  in.batch = q.size(0);
  in.heads = q.size(1);
  in.len_q = q.size(2);
  in.len_k = k.size(2);
  in.d_k = q.size(3);
  in.d_v = v.size(3);
  set_mask_view(in, mask);
  if (!mask_rows.extents.empty()) {
    in.mask_rows = mask_rows.extents.data();
    std::copy(mask_rows.stride, mask_rows.stride + 3, in.mask_rows_stride);
  }
  in.scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(in.d_k)));
  in.dropout_p = dropout_p;
  in.is_causal = is_causal;
  in.seed = seed;
  in.offset = offset;
  // No block needs more keys than there are (the kernels' buffers and spans are sized by it).
  in.key_block = std::min<int64_t>(key_block_size(pass, in.len_q, in.batch * in.heads, in.d_k, in.d_v, sizeof(T)),
                                   std::max<int64_t>(in.len_k, 1));
  return in;
}

// Where the rows of q, k or v are not back to back (their heads interleaved), the kernels' tasks copy each head's rows
// into their own buffers (cpu::AttentionInputs::copy_source). Measured in float32 (8 heads of 64, all interleaved)
// against reading them in place: the backward took 0.95-0.97x the time at 16-512 query rows; the forward 0.95-0.97x
// from 128 query rows, but 1.03-1.15x below, whose products read each key and value only once or twice (decoding
// steps). With the core at (8, 8, 512, 64), forward + backward took 1.06-1.08x the contiguous layout's time
// so, 1.12-1.15x without.
constexpr int64_t kCopiedHeadsForwardFromQueries = 128;

template <typename T>
void copy_interleaved_heads_in_tasks(cpu::AttentionInputs<T>& in, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v) {
  const auto apart = [](const at::Tensor& t) { return t.size(2) > 1 && t.stride(2) != t.size(3); };
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0 || (!apart(q) && !apart(k) && !apart(v))) {
    return;  // nothing to copy, or rows already back to back
  }
  in.copy_source = {in.q, in.k, in.v, in.q_stride, in.k_stride, in.v_stride};
  in.q = in.k = in.v = nullptr;
  in.q_stride = {0, 0, in.d_k};
  in.k_stride = {0, 0, in.d_k};
  in.v_stride = {0, 0, in.d_v};
  in.widen_in_tasks = true;
}

// q/k/v in their half type, for the kernels' half-type products or their own widening (empty when not wanted).
struct HalfInputs {
  at::Tensor q, k, v;

  HalfInputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool wanted) {
    if (wanted) {
      q = kernel_operand(query, query.scalar_type());
      k = kernel_operand(key, key.scalar_type());
      v = kernel_operand(value, value.scalar_type());
    }
  }

  // The kernels' view of them (rows of unit stride, any other strides).
  cpu::HalfOperands view(bool vnni) const {
    auto bits = [](const at::Tensor& t) { return static_cast<const uint16_t*>(t.const_data_ptr()); };
    const auto kind = q.scalar_type() == at::kBFloat16 ? cpu::HalfKind::kBFloat16 : cpu::HalfKind::kFloat16;
    return {bits(q), bits(k), bits(v), strides3(q), strides3(k), strides3(v), kind, vnni};
  }
};

// Whether a forward output holds only finite values. A half-type one is read as bits in one pass (a value is
// finite unless its exponent bits are all ones), where at::isfinite's several passes and temporaries took about
// a sixth of a padded bfloat16 backward.
bool all_finite(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || !t.is_non_overlapping_and_dense()) {
    return at::isfinite(t).all().item<bool>();
  }
  // Dense with positive strides: the elements fill numel() places from the first one on.
  const auto* bits = static_cast<const uint16_t*>(t.const_data_ptr());
  const auto kind = dtype == at::kBFloat16 ? cpu::HalfKind::kBFloat16 : cpu::HalfKind::kFloat16;
  std::atomic<bool> finite{true};
  at::parallel_for(0, t.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    if (!cpu::all_finite_bits(kind, bits + begin, end - begin)) finite = false;
  });
  return finite;
}

// Whether `t` holds a NaN or an infinity: a half-type tensor read as bits, any other through its sum (NaN or
// infinite if an element is: one read, no buffer; a sum that overflows only costs a rerun with the same result).
bool holds_non_finite(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  if (dtype == at::kBFloat16 || dtype == at::kHalf) {
    return !all_finite(t);
  }
  return !std::isfinite(t.sum().item<double>());
}

// Whether a log-sum-exp from torch's forward marks a row that its kernel computed otherwise than the math: NaN or
// infinite, or exactly 0, which torch's CPU kernel writes, with a zero output row, for a row whose every score is
// -inf (the math: NaN, or the hidden keys' values when the mask hides some, as their -1e9 beats -inf). A row whose
// scores really give 0 only costs a rerun with the same result. `lse` is contiguous (B, H, Lq).
bool stock_lse_needs_own(const at::Tensor& lse) {
  bool needs_own = false;
  AT_DISPATCH_FLOATING_TYPES(lse.scalar_type(), "fastmha_stock_lse_check", [&] {
    const scalar_t* x = lse.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < lse.numel() && !needs_own; ++i) {
      needs_own = x[i] == scalar_t(0) || !std::isfinite(x[i]);
    }
  });
  return needs_own;
}

// torch's kernel, behind the contract layer, departs from the math only in rows of non-finite inputs or scores: a
// NaN or infinite score at a hidden key makes its row NaN (the kernel adds the mask as a -inf bias; the contract
// replaces the score with -1e9); a row with no visible key has its query zeroed, so an infinite or NaN key makes
// its scores NaN; a row whose every score is -inf (above). Such a call runs again on fastmha's kernel, which gives
// the contract's result: a forward whose log-sum-exp says so or whose output is not finite, a backward whose
// gradients are not finite.
bool stock_forward_needs_own(const detail::AttentionForwardResult& result) {
  return stock_lse_needs_own(std::get<2>(result)) || holds_non_finite(std::get<0>(result));
}

bool stock_backward_needs_own(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& grads) {
  return holds_non_finite(std::get<0>(grads)) || holds_non_finite(std::get<1>(grads)) ||
         holds_non_finite(std::get<2>(grads));
}

// Whether torch's backward may run at all: not from a non-finite log-sum-exp (a row of NaN weights), and under a
// mask not with a non-finite query or key. The layer zeroes the query of a row with no visible key, whose key
// gradient (0 * inf) is NaN in the math; and a row whose visible scores are all -inf gives its hidden keys all its
// weight in the math, none in torch's kernel, with finite gradients either way.
bool stock_backward_may_run(const std::optional<at::Tensor>& mask, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& logsumexp) {
  return !holds_non_finite(logsumexp) && !(mask.has_value() && (holds_non_finite(query) || holds_non_finite(key)));
}

// The mask as bool, converted once per call: the kernel choice's estimate of the keys computed and whichever
// kernel runs then read it so, where each would otherwise convert it again (an int64 (B, 1, L, L) mask is eight
// times the bool one: its conversion took a fifth of a padded bfloat16 forward at 4 x 1024). Only its distinct
// elements are converted, into a kept buffer when large (cpu/large_buffer.h), which reuses the pages of an earlier
// call's.
std::optional<at::Tensor> mask_as_bool(const std::optional<at::Tensor>& mask) {
  if (!mask.has_value() || mask->scalar_type() == at::kBool) {
    return mask;
  }
  const auto distinct = distinct_elements(*mask);
  auto converted = cpu::empty_large(distinct.sizes(), distinct.options().dtype(at::kBool));
  converted.copy_(distinct);  // nonzero (NaN too) attends, as in .to(at::kBool)
  return converted.expand(mask->sizes());
}

detail::AttentionForwardResult attention_forward_kernel(const at::Tensor& query, const at::Tensor& key,
                                                        const at::Tensor& value,
                                                        const std::optional<at::Tensor>& user_mask, double dropout_p,
                                                        bool need_weights, bool is_causal) {
  check_attention_inputs(query, key, value, user_mask, dropout_p);
  const auto mask = mask_as_bool(user_mask);
  const AttentionCall call{query, key, value, mask, dropout_p, need_weights, is_causal};
  const auto choice = choose_kernel_logged(call);
  if (choice.kernel == AttentionKernel::kStockCpu) {
    auto result = stock::attention_forward(query, key, value, mask, is_causal, std::nullopt);
    if (!stock_forward_needs_own(result)) {
      return result;
    }
  }
  const auto dtype = query.scalar_type();
  const auto acc = at::toOpMathType(dtype);
  const int64_t batch = query.size(0), heads = query.size(1), len_q = query.size(2), len_k = key.size(2);
  const auto acc_options = query.options().dtype(acc);
  const bool half = choice.half_products;
  // Half types: the tasks round their output rows into the half-type output, and, when the products are
  // widened, widen k/v a head at a time and q a chunk at a time (ops/cpu/widened_rows.h), rather than whole fp32
  // copies going through memory.
  const bool half_output = dtype != acc;
  const bool widen_in_tasks = half_output && !half;
  auto output = empty_output({batch, heads, len_q, value.size(3)}, query, half_output ? query.options() : acc_options);
  // Kept weights in a half type are rounded from fp32 row by row by the tasks.
  auto weights = need_weights
                     ? cpu::empty_large({batch, heads, len_q, len_k}, half_output ? query.options() : acc_options)
                     : at::empty({0}, acc_options);
  auto logsumexp = at::empty({batch, heads, len_q}, acc_options);
  auto rng_state = dropout_p > 0 ? draw_cpu_rng_state() : at::zeros({2}, at::kLong);
  // The half-type operands: of the products, or of the tasks' widening. With half-type products the forward
  // widens none of them (its scan of the values for non-finite entries reads their bits).
  const HalfInputs half_inputs(query, key, value, half_output);
  const auto operand = [&](const at::Tensor& half_type, const at::Tensor& x, bool widened) {
    return widened ? kernel_operand(x, acc) : half_type;
  };
  const auto q = operand(half_inputs.q, query, !half_output), k = operand(half_inputs.k, key, !half_output);
  const auto v = operand(half_inputs.v, value, !half_output);
  const auto mask_view = broadcast_mask(mask, query, key);
  const auto mask_rows = cpu::mask_row_extents(mask_view);
  const auto* state = rng_state.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(acc, "fastmha_cpu_attention_forward", [&] {
    auto in = kernel_inputs<scalar_t>(q, k, v, mask_view, mask_rows, dropout_p, is_causal, state[0], state[1],
                                      Pass::kForward);
    cpu::AttentionForwardOutputs<scalar_t> out{half_output ? nullptr : output.data_ptr<scalar_t>(),
                                               need_weights && !half_output ? weights.data_ptr<scalar_t>() : nullptr,
                                               logsumexp.data_ptr<scalar_t>(), strides3(output)};
    if (half_output) {
      out.half_out = static_cast<uint16_t*>(output.data_ptr());
      out.half_out_kind = dtype == at::kBFloat16 ? cpu::HalfKind::kBFloat16 : cpu::HalfKind::kFloat16;
      out.rounds_to_half = true;
      out.half_weights = need_weights ? static_cast<uint16_t*>(weights.data_ptr()) : nullptr;
    }
    if (half) {
      in.half = half_inputs.view(choice.half_products_vnni);
    } else if (widen_in_tasks) {
      in.half_source = half_inputs.view(false);
      in.widen_in_tasks = true;
    }
    in.float_brgemm = choice.float_brgemm;
    if (!half_output && len_q >= kCopiedHeadsForwardFromQueries) {
      copy_interleaved_heads_in_tasks(in, q, k, v);
    }
    FASTMHA_CPU_DISPATCH(attention_forward, in, out);
  });
  return {output.to(dtype), weights.to(dtype), logsumexp, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_kernel(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& user_mask,
    const at::Tensor& output, const at::Tensor& logsumexp, const at::Tensor& rng_state, double dropout_p,
    bool is_causal, const std::optional<at::Tensor>& weights) {
  check_backward_inputs(grad_output, query, key, value, user_mask, output, logsumexp, rng_state, dropout_p);
  const auto mask = mask_as_bool(user_mask);
  check_kept_weights(weights, query, key);
  check_grad_weights(grad_weights, query, key);
  const auto dtype = query.scalar_type();
  const auto acc = at::toOpMathType(dtype);
  const bool weights_serve = weights.has_value() && weights_stand_for_softmax(dtype, dropout_p);
  AttentionCall call{query, key, value, mask, dropout_p, weights_kept(grad_weights), is_causal, Pass::kBackward};
  call.weights_at_hand = weights_serve;
  const auto choice = choose_kernel_logged(call);
  if (choice.kernel == AttentionKernel::kStockCpu && stock_backward_may_run(mask, query, key, logsumexp)) {
    auto grads =
        stock::attention_backward(grad_output, query, key, value, mask, output, logsumexp, is_causal, std::nullopt);
    if (!stock_backward_needs_own(grads)) {
      return grads;
    }
  }
  const int64_t batch = query.size(0), heads = query.size(1), len_q = query.size(2), len_k = key.size(2);
  const int64_t d_k = query.size(3), d_v = value.size(3);
  const int64_t heads_total = batch * heads;
  const int64_t threads = at::get_num_threads();
  const bool has_grad_weights = grad_weights.has_value() && grad_weights->defined();
  // The forward output gives each row's softmax-gradient constant D = dO . O directly when the weights carry
  // no gradient of their own; the kernel then walks the keys in blocks. In half types that output was rounded
  // to the half type, as FlashAttention's and torch's flash backward also use it (D then carries that
  // rounding, within half-type tolerance); unless it overflowed there (float16 with dropout), where the math's
  // gradient stays finite: then D comes from the rows' own sums.
  const bool use_output =
      !has_grad_weights && output.numel() > 0 && (output.scalar_type() == acc || all_finite(output));
  const int64_t chunk = cpu::backward_query_chunk(use_output, len_q, len_k, heads_total, threads);
  const int64_t chunks = (len_q + chunk - 1) / chunk;
  // Enough independent ranges for every thread, even with a single head (each range keeps its own dK/dV).
  const int64_t splits = heads_total == 0 ? 1
                                          : std::clamp<int64_t>((2 * threads + heads_total - 1) / heads_total, 1,
                                                                std::max<int64_t>(chunks, 1));
  const auto acc_options = query.options().dtype(acc);
  // The blocked backward multiplies in the half type as the forward does (ops/cpu/half_gemm.h); or, with
  // products widened, its tasks widen q/k/v, dO and O and round their dQ rows (ops/cpu/widened_rows.h).
  const bool half = use_output && choice.half_products;
  const bool widen_in_tasks = use_output && dtype != acc && !half;
  // Half types with the output at hand: q/k/v, dO and O stay in the half type (the products read them so, or the
  // tasks widen them), the tasks widen dO and O a chunk at a time and round their dQ rows into the gradient, rather
  // than whole fp32 copies going through memory.
  const bool half_rows = half || widen_in_tasks;
  auto grad_q = empty_output({batch, heads, len_q, d_k}, query, half_rows ? query.options() : acc_options);
  // One split: the tasks write dK and dV themselves, summed in their own rows where the tasks round them into a half
  // type or the gradients, in the accumulation type, have their heads interleaved (copied in). More: partial sums
  // (splits, B, H, Lk, d), added up below.
  const auto interleaved = [](const at::Tensor& t) { return t.size(1) > 1 && heads_interleaved(t); };
  const bool own_key_rows = splits == 1 && (half_rows || (dtype == acc && (interleaved(key) || interleaved(value))));
  auto partial = [&](const at::Tensor& input, int64_t d) {
    if (own_key_rows) {
      return empty_output({batch, heads, len_k, d}, input, input.options().dtype(dtype)).unsqueeze(0);
    }
    return splits == 1 ? empty_output({batch, heads, len_k, d}, input, acc_options).unsqueeze(0)
                       : cpu::empty_large({splits, batch, heads, len_k, d}, acc_options);
  };
  auto grad_k_partial = partial(key, d_k), grad_v_partial = partial(value, d_v);
  const HalfInputs half_inputs(query, key, value, half_rows);
  // The operands in the accumulation type, or in the half type for the products or the tasks' widening.
  const auto operand = [&](const at::Tensor& x) { return kernel_operand(x, half_rows ? dtype : acc); };
  const auto q = half_rows ? half_inputs.q : kernel_operand(query, acc);
  const auto k = half_rows ? half_inputs.k : kernel_operand(key, acc);
  const auto v = half_rows ? half_inputs.v : kernel_operand(value, acc);
  const auto grad_out = operand(grad_output);
  const auto grad_w = has_grad_weights ? grad_weights->to(acc).contiguous() : at::Tensor();
  const auto lse = logsumexp.to(acc).contiguous();
  const auto out = use_output ? operand(output) : at::Tensor();
  const auto mask_view = broadcast_mask(mask, query, key);
  const auto mask_rows = cpu::mask_row_extents(mask_view);
  const auto state = rng_state.to(at::kCPU).contiguous();
  const auto* seed_offset = state.const_data_ptr<int64_t>();
  const auto kept = use_output && weights_serve ? weights->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(acc, "fastmha_cpu_attention_backward", [&] {
    auto in = kernel_inputs<scalar_t>(q, k, v, mask_view, mask_rows, dropout_p, is_causal, seed_offset[0],
                                      seed_offset[1], Pass::kBackward);
    auto partial_gradients = [&](const at::Tensor& t, int64_t d) {
      if (own_key_rows) {  // the tasks' own rows, of row stride d
        return cpu::PartialGradients<scalar_t>{nullptr, cpu::Strides3{0, 0, d}, 0};
      }
      const auto split = t.select(0, 0);
      return cpu::PartialGradients<scalar_t>{t.data_ptr<scalar_t>(), strides3(split), t.stride(0)};
    };
    const auto typed = [&](const at::Tensor& t) { return half_rows ? nullptr : t.const_data_ptr<scalar_t>(); };
    cpu::AttentionBackwardTensors<scalar_t> grads{typed(grad_out),
                                                  has_grad_weights ? grad_w.const_data_ptr<scalar_t>() : nullptr,
                                                  lse.const_data_ptr<scalar_t>(),
                                                  use_output ? typed(out) : nullptr,
                                                  half_rows ? nullptr : grad_q.data_ptr<scalar_t>(),
                                                  partial_gradients(grad_k_partial, d_k),
                                                  partial_gradients(grad_v_partial, d_v),
                                                  splits,
                                                  strides3(grad_out),
                                                  use_output ? strides3(out) : cpu::Strides3{},
                                                  strides3(grad_q)};
    grads.weights = kept.defined() ? kept.const_data_ptr<scalar_t>() : nullptr;
    if (half_rows) {
      in.half_source = half_inputs.view(false);
      grads.source_grad_out = static_cast<const uint16_t*>(grad_out.const_data_ptr());
      grads.source_out = static_cast<const uint16_t*>(out.const_data_ptr());
      grads.half_grad_q = static_cast<uint16_t*>(grad_q.data_ptr());
    }
    if (own_key_rows && half_rows) {
      grads.half_grad_k = static_cast<uint16_t*>(grad_k_partial.data_ptr());
      grads.half_grad_v = static_cast<uint16_t*>(grad_v_partial.data_ptr());
      grads.half_grad_k_stride = strides3(grad_k_partial.select(0, 0));
      grads.half_grad_v_stride = strides3(grad_v_partial.select(0, 0));
    } else if (own_key_rows) {
      grads.task_grad_k = grad_k_partial.data_ptr<scalar_t>();
      grads.task_grad_v = grad_v_partial.data_ptr<scalar_t>();
      grads.task_grad_k_stride = strides3(grad_k_partial.select(0, 0));
      grads.task_grad_v_stride = strides3(grad_v_partial.select(0, 0));
    }
    if (half) {
      in.half = half_inputs.view(choice.half_products_vnni);
    } else if (widen_in_tasks) {
      in.widen_in_tasks = true;
    } else if (use_output && !has_grad_weights) {  // the blocked backward
      copy_interleaved_heads_in_tasks(in, q, k, v);
    }
    in.float_brgemm = choice.float_brgemm && std::is_same_v<scalar_t, float>;
    FASTMHA_CPU_DISPATCH(attention_backward, in, grads);
  });
  // The outputs were allocated in the ops' layout (empty_output); .to keeps it.
  auto reduce = [&](const at::Tensor& partial, const at::Tensor& input) {
    if (splits == 1) {
      return partial.select(0, 0).to(input.scalar_type());
    }
    auto summed = empty_output(partial.sizes().slice(1), input, partial.options());
    const int64_t split_dim = 0;
    at::sum_out(summed, partial, at::IntArrayRef(split_dim));
    return summed.to(input.scalar_type());
  };
  return {grad_q.to(dtype), reduce(grad_k_partial, key), reduce(grad_v_partial, value)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastmha, CPU, m) {
  m.impl("_attention_forward", &attention_forward_kernel);
  m.impl("_attention_backward", &attention_backward_kernel);
}

namespace cpu {

void dropout_multipliers(uint64_t seed, uint64_t offset, double p, uint64_t first, int64_t n, float* out) {
  FASTMHA_CPU_DISPATCH(dropout_multipliers, seed, offset, p, first, n, out);
}
void dropout_multipliers(uint64_t seed, uint64_t offset, double p, uint64_t first, int64_t n, double* out) {
  FASTMHA_CPU_DISPATCH(dropout_multipliers, seed, offset, p, first, n, out);
}

}  // namespace cpu
}  // namespace fastmha
