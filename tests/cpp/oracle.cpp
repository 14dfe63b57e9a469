#include "oracle.h"

#include <cmath>

namespace oracle {

std::pair<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const std::optional<at::Tensor>& mask) {
  auto scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (mask) {
    scores = at::where(*mask == 0, at::full_like(scores, -1e9), scores);
  }
  auto weights = at::softmax(scores, -1);
  return {at::matmul(weights, v), weights};
}

std::pair<at::Tensor, at::Tensor> block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v,
                                        const at::Tensor& w_o, int64_t heads, const std::optional<at::Tensor>& mask) {
  auto split = [heads](const at::Tensor& x) {
    return x.reshape({x.size(0), x.size(1), heads, x.size(2) / heads}).permute({0, 2, 1, 3});
  };
  auto [out, weights] =
      attention(split(at::matmul(q, w_q.t())), split(at::matmul(k, w_k.t())), split(at::matmul(v, w_v.t())), mask);
  auto merged = out.permute({0, 2, 1, 3}).reshape({q.size(0), q.size(1), q.size(2)});
  return {at::matmul(merged, w_o.t()), weights};
}

bool close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol) {
  return a.sizes() == b.sizes() && at::allclose(a.to(at::kDouble), b.to(at::kDouble), rtol, atol);
}

}  // namespace oracle
