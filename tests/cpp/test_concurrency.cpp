// Many threads calling one module (eval) or one TorchScript module at once get exactly the serial results.
#include <torch/script.h>
#include <torch/torch.h>

#include <fastmha/module.h>
#include <fastmha/ops.h>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <thread>
#include <vector>

#include "script_module.h"

namespace {

constexpr int kThreads = 8;
constexpr int kCalls = 20;

// Runs call(i) for i in [0, kCalls) on every thread and checks each result against expected[i].
template <typename Call>
void check_concurrent(const std::vector<at::Tensor>& expected, Call call) {
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      torch::NoGradGuard no_grad;
      for (int i = 0; i < kCalls; ++i) {
        const int index = (i + t) % kCalls;  // threads walk the inputs in different orders
        if (!torch::equal(call(index), expected[index])) ++mismatches[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    INFO("thread " << t);
    CHECK(mismatches[t] == 0);
  }
}

}  // namespace

TEST_CASE("concurrent forward calls on one module match serial calls", "[concurrency]") {
  torch::manual_seed(5);
  fastmha::MultiHeadAttention mha(fastmha::MultiHeadAttentionOptions(32, 4).dropout(0.3));
  mha->eval();
  std::vector<at::Tensor> inputs, masks, expected;
  torch::NoGradGuard no_grad;
  for (int i = 0; i < kCalls; ++i) {
    inputs.push_back(torch::randn({2, 17 + i, 32}));
    masks.push_back(torch::rand({2, 1, 1, 17 + i}) > 0.2);
    expected.push_back(mha(inputs[i], inputs[i], inputs[i], masks[i]));
  }
  check_concurrent(expected, [&](int i) { return mha(inputs[i], inputs[i], inputs[i], masks[i]); });
  CHECK(mha->attention_scores().defined());
}

TEST_CASE("concurrent calls on one TorchScript module match serial calls", "[concurrency]") {
  torch::manual_seed(6);
  auto module = attention_script_module();
  std::vector<at::Tensor> q, expected;
  for (int i = 0; i < kCalls; ++i) {
    q.push_back(torch::randn({1, 2, 9 + i, 8}));
    expected.push_back(module.forward({q[i], q[i], q[i], torch::jit::IValue()}).toTensor());
  }
  check_concurrent(expected, [&](int i) {
    return module.forward({q[i], q[i], q[i], torch::jit::IValue()}).toTensor();
  });
}

TEST_CASE("results do not depend on the intra-op thread count", "[concurrency]") {
  torch::manual_seed(7);
  auto q = torch::randn({1, 1, 300, 16});
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  auto [out_one, w_one] = fastmha::attention(q, q, q, std::nullopt, 0.0, true);
  at::set_num_threads(before);
  auto [out_all, w_all] = fastmha::attention(q, q, q, std::nullopt, 0.0, true);
  CHECK(torch::equal(out_one, out_all));
  CHECK(torch::equal(w_one, w_all));
}

TEST_CASE("concurrent bfloat16 forwards with half-type products match serial calls", "[concurrency][half gemm]") {
  // The half-type products pack their operands in per-thread scratch buffers (ops/cpu/half_gemm.h).
  setenv("FASTMHA_CPU_KERNELS", "own", 1);
  setenv("FASTMHA_CPU_HALF_GEMM", "reference", 1);
  torch::manual_seed(8);
  std::vector<at::Tensor> q, k, masks, expected;
  for (int i = 0; i < kCalls; ++i) {
    q.push_back(torch::randn({1, 2, 40 + i, 24}).to(at::kBFloat16));
    k.push_back(torch::randn({1, 2, 70 + 3 * i, 24}).to(at::kBFloat16));
    masks.push_back(torch::rand({1, 1, 1, 70 + 3 * i}) > 0.5);
    expected.push_back(std::get<0>(fastmha::attention(q[i], k[i], k[i], masks[i], 0.0, i % 2 == 0)));
  }
  check_concurrent(expected,
                   [&](int i) { return std::get<0>(fastmha::attention(q[i], k[i], k[i], masks[i], 0.0, i % 2 == 0)); });
  unsetenv("FASTMHA_CPU_HALF_GEMM");
  unsetenv("FASTMHA_CPU_KERNELS");
}
