// Plain ATen oracle, written from the formulas: scores = Q K^T / sqrt(d_k); mask == 0 -> -1e9; softmax;
// output = weights V. The block projects with bias-free weights (x W^T) and splits d_model into heads.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <utility>

namespace oracle {

std::pair<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const std::optional<at::Tensor>& mask = std::nullopt);

std::pair<at::Tensor, at::Tensor> block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v,
                                        const at::Tensor& w_o, int64_t heads,
                                        const std::optional<at::Tensor>& mask = std::nullopt);

bool close(const at::Tensor& a, const at::Tensor& b, double rtol = 1e-7, double atol = 1e-9);

}  // namespace oracle
