// libFuzzer target for the op boundary: shapes, strides, dtypes, masks, dropout and flags decoded from bytes
// drive fastmha::attention and its backward. Invalid combinations must raise c10::Error (caught here); valid
// ones must return correctly shaped, finite results, and in float64 without dropout the oracle's output and
// gradients. Crashes, hangs, sanitizer reports and wrong numbers are the findings.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <fastmha/ops.h>
#include <cstdint>
#include <cstdlib>

#include "oracle.h"  // tests/cpp: the oracle the C++ tests use

namespace {

struct Bytes {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  uint8_t next() { return pos < size ? data[pos++] : 0; }
  int64_t range(int64_t lo, int64_t hi) { return lo + next() % (hi - lo + 1); }
};

at::Tensor make(Bytes& in, at::IntArrayRef sizes, at::ScalarType dtype) {
  auto t = at::randn(sizes, at::kDouble).to(dtype);
  switch (in.next() % 3) {
    case 1:  // transposed storage, same values
      return t.dim() >= 2 ? t.transpose(-1, -2).contiguous().transpose(-1, -2) : t;
    case 2:  // every other element of a wider tensor
      if (t.dim() >= 1 && t.numel() > 0) {
        std::vector<int64_t> wide(sizes.begin(), sizes.end());
        wide.back() *= 2;
        return at::zeros(wide, t.options()).slice(-1, 0, wide.back(), 2).copy_(t);
      }
      return t;
    default:
      return t;
  }
}

// In float64 without dropout the results must be the oracle's: output, and the gradients of q and v.
void check_against_oracle(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, bool is_causal, const at::Tensor& out) {
  auto ref_q = q.detach().clone().requires_grad_(true), ref_v = v.detach().clone().requires_grad_(true);
  std::optional<at::Tensor> visible = mask;
  if (is_causal) {  // top-left: query i sees keys j <= i
    const auto causal = at::ones({q.size(2), k.size(2)}, at::kBool).tril();
    visible = mask.has_value() ? mask->ne(0).logical_and(causal) : causal;
  }
  const auto ref = oracle::attention(ref_q, k, ref_v, visible).first;
  if (!oracle::close(out.detach(), ref.detach(), 1e-9, 1e-11)) abort();
  if (!q.requires_grad() || out.numel() == 0) {
    return;
  }
  const auto grads = torch::autograd::grad({out}, {q, v}, {at::ones_like(out)});
  const auto ref_grads = torch::autograd::grad({ref}, {ref_q, ref_v}, {at::ones_like(ref)});
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!oracle::close(grads[i], ref_grads[i], 1e-9, 1e-11)) abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in{data, size};
  at::manual_seed(in.next());
  const int64_t b = in.range(0, 3), h = in.range(1, 3), lq = in.range(0, 40), lk = in.range(0, 40);
  const int64_t dk = in.range(0, 9), dv = in.range(1, 9);
  const at::ScalarType dtypes[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kLong};
  const auto dtype = dtypes[in.next() % 5];
  const auto mask_dtype = dtypes[in.next() % 5];
  const bool bad_batch = in.next() % 16 == 0, bad_len = in.next() % 16 == 0;
  auto q = make(in, {b, h, lq, dk}, dtype);
  auto k = make(in, {bad_batch ? b + 1 : b, h, lk, dk}, dtype);
  auto v = make(in, {b, h, bad_len ? lk + 1 : lk, dv}, dtype);
  std::optional<at::Tensor> mask;
  switch (in.next() % 5) {
    case 1:
      mask = (at::rand({b, 1, 1, lk}) > 0.3).to(mask_dtype);
      break;
    case 2:
      mask = (at::rand({lq, lk}) > 0.3).to(mask_dtype);
      break;
    case 3:
      mask = (at::rand({1, h, 1, lk}) > 0.3).to(mask_dtype).expand({b, h, lq, lk});
      break;
    case 4:
      mask = at::ones({in.range(0, 3), lk + 1}, mask_dtype);
      break;  // usually does not broadcast
    default:
      break;
  }
  const double dropout = in.next() % 4 == 0 ? in.next() / 200.0 : 0.0;  // sometimes >= 1: must be rejected
  const bool need_weights = in.next() % 2, is_causal = in.next() % 2, backward = in.next() % 2;
  const bool floating = at::isFloatingType(dtype);
  if (backward && floating) {
    q.requires_grad_(true);
    v.requires_grad_(true);
  }
  try {
    auto [out, weights] = fastmha::attention(q, k, v, mask, dropout, need_weights, is_causal);
    if (out.sizes() != at::IntArrayRef({b, h, lq, dv}) || !at::isfinite(out).all().item<bool>()) abort();
    if (need_weights && weights.sizes() != at::IntArrayRef({b, h, lq, lk})) abort();
    if (dtype == at::kDouble && dropout == 0.0 && dk > 0) {
      check_against_oracle(q, k, v, mask, is_causal, out);
      return 0;
    }
    if (backward && floating && out.numel() > 0) {
      out.to(at::kFloat).sum().backward();
      if (!at::isfinite(q.grad()).all().item<bool>()) abort();
    }
  } catch (const c10::Error&) {
    // a rejected input: the contract is a clear error, which the Python tests check by message
  }
  return 0;
}
