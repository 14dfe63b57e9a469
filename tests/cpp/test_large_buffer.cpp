// The CPU kernels' large buffers (ops/cpu/large_buffer.h): a freed one serves the next request of about its size,
// within the pool's limits (16 buffers, 1 GiB), and smaller requests get plain tensors.
#include <fastmha/cpu_buffers.h>
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <thread>
#include <vector>

#include "ops/cpu/large_buffer.h"

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
const auto kFloat = at::TensorOptions().dtype(at::kFloat);

// A float buffer of `mib` MiB.
at::Tensor buffer_of(int64_t mib) { return fastmha::cpu::empty_large({mib * kMiB / 4}, kFloat); }

}  // namespace

TEST_CASE("A freed large buffer serves the next request of about its size", "[large buffer]") {
  fastmha::release_cpu_buffers();
  auto first = buffer_of(8);
  const void* memory = first.data_ptr();
  first.fill_(1.0f);
  first.reset();
  CHECK(fastmha::cached_cpu_buffer_bytes() == static_cast<size_t>(8 * kMiB));
  auto second = fastmha::cpu::empty_large({2, 3 * kMiB / 4}, kFloat);  // 6 MiB: at least half of the kept 8
  CHECK(second.data_ptr() == memory);
  CHECK(fastmha::cached_cpu_buffer_bytes() == 0);
  CHECK(second.sizes() == at::IntArrayRef({2, 3 * kMiB / 4}));
  CHECK(second.is_contiguous());
  second.fill_(2.0f);
  CHECK(second.sum().item<double>() == 2.0 * static_cast<double>(second.numel()));
}

TEST_CASE("A kept buffer is not spent on a request under half its size or above it", "[large buffer]") {
  fastmha::release_cpu_buffers();
  buffer_of(16).reset();
  const auto small = buffer_of(6);
  const auto large = buffer_of(18);
  CHECK(fastmha::cached_cpu_buffer_bytes() == static_cast<size_t>(16 * kMiB));
  const auto fits = buffer_of(10);
  CHECK(fastmha::cached_cpu_buffer_bytes() == 0);
}

TEST_CASE("Buffers under 4 MiB are plain tensors and are not kept", "[large buffer]") {
  fastmha::release_cpu_buffers();
  fastmha::cpu::empty_large({kMiB / 4}, kFloat).reset();
  fastmha::cpu::empty_large({kMiB}, at::TensorOptions().dtype(at::kInt)).reset();  // exactly 4 MiB: kept
  CHECK(fastmha::cached_cpu_buffer_bytes() == static_cast<size_t>(4 * kMiB));
}

TEST_CASE("A lower threshold keeps smaller buffers, in whole 2 MiB", "[large buffer]") {
  fastmha::release_cpu_buffers();
  const auto shorts = at::TensorOptions().dtype(at::kShort);
  fastmha::cpu::empty_large({kMiB / 4}, shorts, kMiB).reset();  // 512 KiB: under the threshold, not kept
  CHECK(fastmha::cached_cpu_buffer_bytes() == 0);
  auto packs = fastmha::cpu::empty_large({kMiB / 2 + 1}, shorts, kMiB);  // just over 1 MiB: a 2 MiB buffer
  const void* memory = packs.data_ptr();
  CHECK(reinterpret_cast<std::uintptr_t>(memory) % 64 == 0);
  packs.reset();
  CHECK(fastmha::cached_cpu_buffer_bytes() == static_cast<size_t>(2 * kMiB));
  const auto next_call = fastmha::cpu::empty_large({kMiB - 7}, shorts, kMiB);  // reused
  CHECK(next_call.data_ptr() == memory);
  CHECK(fastmha::cached_cpu_buffer_bytes() == 0);
}

TEST_CASE("At most 16 buffers and 1 GiB are kept, the newest", "[large buffer]") {
  fastmha::release_cpu_buffers();
  std::vector<at::Tensor> buffers;
  for (int64_t mib = 4; mib <= 36; mib += 2) buffers.push_back(buffer_of(mib));  // 17 buffers
  const void* six = buffers[1].data_ptr();
  for (auto& b : buffers) b.reset();  // freed in order: 4, 6, ..., 36 MiB; the 4 MiB one is dropped
  CHECK(fastmha::cached_cpu_buffer_bytes() == static_cast<size_t>((6 + 36) * 16 / 2 * kMiB));
  auto again = buffer_of(4);  // 6 and 8 MiB fit (at most twice 4): the smaller is taken
  CHECK(again.data_ptr() == six);
  CHECK(fastmha::cached_cpu_buffer_bytes() == static_cast<size_t>(((6 + 36) * 16 / 2 - 6) * kMiB));
  fastmha::release_cpu_buffers();

  // Untouched memory: these cost no pages.
  buffer_of(600).reset();
  buffer_of(700).reset();  // 1300 MiB: the older one goes
  CHECK(fastmha::cached_cpu_buffer_bytes() == static_cast<size_t>(700 * kMiB));
  buffer_of(1100).reset();  // above 1 GiB: freed at once, the kept one stays
  CHECK(fastmha::cached_cpu_buffer_bytes() == static_cast<size_t>(700 * kMiB));
  fastmha::release_cpu_buffers();
  CHECK(fastmha::cached_cpu_buffer_bytes() == 0);
}

TEST_CASE("A tensor on a kept buffer can grow beyond it", "[large buffer]") {
  fastmha::release_cpu_buffers();
  auto t = buffer_of(4);
  t.fill_(3.0f);
  t.resize_({20 * kMiB / 4});
  CHECK(t.slice(0, 0, kMiB).eq(3.0f).all().item<bool>());
}

TEST_CASE("A tensor on a kept buffer has copy-on-write clones like any CPU tensor", "[large buffer]") {
  auto t = buffer_of(4);
  t.fill_(5.0f);
  auto lazy = at::_lazy_clone(t);
  t.fill_(6.0f);
  CHECK(lazy.eq(5.0f).all().item<bool>());
  CHECK(t.eq(6.0f).all().item<bool>());
}

TEST_CASE("Threads taking and freeing buffers at once", "[large buffer][concurrency]") {
  fastmha::release_cpu_buffers();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 50; ++i) {
        auto b = buffer_of(4 + 2 * ((t + i) % 3));
        b.data_ptr<float>()[0] = static_cast<float>(i);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(fastmha::cached_cpu_buffer_bytes() <= static_cast<size_t>(16 * 8 * kMiB));
  fastmha::release_cpu_buffers();
}
