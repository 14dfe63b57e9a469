// Runs the CUDA kernel bodies (csrc/ops/cuda/flash/*.h) on the CPU. Each CUDA thread of a block is a fiber
// (ucontext) on one OS thread; __syncthreads switches to the next fiber, so a block's threads run phase by
// phase exactly as the barriers order them, deterministically and fast. Within a phase the threads run one
// after another in an order that ScheduleScope can reverse or shuffle: a missing barrier (thread a reads what
// thread b writes in the same phase) then gives wrong results under some order instead of hiding. Blocks run one after
// another. A warp's 16x16 tensor-core product is computed by its first lane in fp32 from the same operands (the GPU's
// WMMA call is the one part not exercised here). Shared memory and fiber stacks start as NaN bytes, so a read of
// anything the kernel did not write shows up in the results.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

namespace fastmha::testing {

enum class Schedule { kForward, kReverse, kShuffled };

inline Schedule& current_schedule() {
  static thread_local Schedule schedule = Schedule::kForward;
  return schedule;
}

// Runs the blocks started in its lifetime (on this OS thread) under `schedule`.
class ScheduleScope {
 public:
  explicit ScheduleScope(Schedule schedule) : saved_(current_schedule()) { current_schedule() = schedule; }
  ~ScheduleScope() { current_schedule() = saved_; }

 private:
  Schedule saved_;
};

// The fibers of one block and the scheduler that steps them from barrier to barrier.
class FiberBlock {
 public:
  FiberBlock(int threads, std::function<void(int)> body)
      : body_(std::move(body)), fibers_(threads), barriers_(threads, 0), done_(threads, false), staging_(threads) {}

  void run() {
    auto& stacks = stack_pool(fibers_.size());
    for (size_t t = 0; t < fibers_.size(); ++t) {
      getcontext(&fibers_[t]);
      fibers_[t].uc_stack.ss_sp = stacks[t].get();
      fibers_[t].uc_stack.ss_size = kStackBytes;
      fibers_[t].uc_link = &scheduler_;
      makecontext(&fibers_[t], reinterpret_cast<void (*)()>(&FiberBlock::trampoline), 0);
    }
    std::vector<size_t> order(fibers_.size());
    std::iota(order.begin(), order.end(), size_t{0});
    if (current_schedule() == Schedule::kReverse) {
      std::reverse(order.begin(), order.end());
    }
    std::mt19937 random(20261129);
    size_t finished = 0;
    while (finished < fibers_.size()) {
      if (current_schedule() == Schedule::kShuffled) {
        std::shuffle(order.begin(), order.end(), random);
      }
      for (const size_t t : order) {
        if (done_[t]) {
          continue;
        }
        current_ = static_cast<int>(t);
        active() = this;
        swapcontext(&scheduler_, &fibers_[t]);
        if (done_[t]) {
          ++finished;
        }
      }
      // Every thread of a block must pass the same barriers, as __syncthreads requires.
      for (size_t t = 1; t < fibers_.size(); ++t) {
        if (barriers_[t] != barriers_[0]) {
          throw std::logic_error("emulated block: threads passed different numbers of barriers");
        }
      }
    }
  }

  std::vector<double>& staging() { return staging_; }

  void sync() {
    ++barriers_[current_];
    swapcontext(&fibers_[current_], &scheduler_);
  }

 private:
  static constexpr size_t kStackBytes = 256 * 1024;

  // Fiber stacks, allocated once per OS thread and reused by every block. They start as NaN bytes, like
  // shared memory, so a kernel local read before it is written shows up in the results on every machine
  // instead of reading whatever the allocator handed out (zeros on one run, old values on another).
  static std::vector<std::unique_ptr<char[]>>& stack_pool(size_t count) {
    static thread_local std::vector<std::unique_ptr<char[]>> stacks;
    while (stacks.size() < count) {
      stacks.emplace_back(new char[kStackBytes]);
      std::memset(stacks.back().get(), 0xFF, kStackBytes);
    }
    return stacks;
  }

  static FiberBlock*& active() {
    static thread_local FiberBlock* block = nullptr;
    return block;
  }

  static void trampoline() {
    FiberBlock* self = active();
    const int t = self->current_;
    self->body_(t);
    self->done_[t] = true;
    // Returning switches to uc_link (the scheduler).
  }

  std::function<void(int)> body_;
  std::vector<ucontext_t> fibers_;
  std::vector<int64_t> barriers_;
  std::vector<bool> done_;
  std::vector<double> staging_;  // one slot per thread for warp_all_reduce
  ucontext_t scheduler_{};
  int current_ = 0;
};

template <int Threads>
struct EmulatedThreads {
  static constexpr int kThreads = Threads;
  static constexpr int kWarps = Threads / 32;
  int id;
  FiberBlock* block;

  int thread() const { return id; }
  int warp() const { return id / 32; }
  int lane() const { return id % 32; }
  void sync() const { block->sync(); }
  // Through the staging slots between two barriers, as warp_all_reduce.
  bool sync_or(bool predicate) const {
    auto& staging = block->staging();
    staging[id] = predicate ? 1.0 : 0.0;
    block->sync();
    bool any = false;
    for (int t = 0; t < kThreads; ++t) any = any || staging[t] != 0.0;
    block->sync();
    return any;
  }
  // A barrier of the whole block, stronger than the GPU's warp barrier: the kernel bodies call it where every
  // thread does, as warp_all_reduce (a call in one warp only fails the barrier count check).
  void warp_sync() const { block->sync(); }

  // The warp's lanes exchange through the block's staging slots between two barriers, so every thread of
  // the block must call it alike (the kernel bodies do: their warp reductions sit in uniform loops).
  template <typename A, typename Op>
  A warp_all_reduce(A value, Op op) const {
    auto& staging = block->staging();
    staging[id] = static_cast<double>(value);
    block->sync();
    A result = static_cast<A>(staging[warp() * 32]);
    for (int l = 1; l < 32; ++l) {
      result = op(result, static_cast<A>(staging[warp() * 32 + l]));
    }
    block->sync();
    return result;
  }

  // Fibers of a block never run at the same time: a plain add is atomic here.
  template <typename A>
  void atomic_add(A* address, A value) const {
    *address += value;
  }

  template <bool ACol, bool BCol, bool Accumulate, typename In>
  void mma16(const In* a, int lda, const In* b, int ldb, float* c, int ldc, int k) const {
    if (id % 32 != 0) {
      return;
    }
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 16; ++j) {
        float sum = Accumulate ? c[i * ldc + j] : 0.0f;
        for (int kk = 0; kk < k; ++kk) {
          sum += static_cast<float>(ACol ? a[kk * lda + i] : a[i * lda + kk]) *
                 static_cast<float>(BCol ? b[j * ldb + kk] : b[kk * ldb + j]);
        }
        c[i * ldc + j] = sum;
      }
    }
  }
};

// Calls body(ctx, shared_memory, block) for every block and thread, like kernel<<<blocks, Threads, bytes>>>.
template <int Threads, typename Body>
void run_blocks(int64_t blocks, size_t shared_bytes, Body body) {
  constexpr size_t kAlign = 128;
  std::vector<unsigned char> storage(shared_bytes + kAlign);
  auto* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(storage.data()) + kAlign - 1) / kAlign * kAlign);
  for (int64_t b = 0; b < blocks; ++b) {
    std::memset(base, 0xFF, shared_bytes);  // NaN in every float type
    FiberBlock* block_ptr = nullptr;
    FiberBlock block(Threads, [&](int t) { body(EmulatedThreads<Threads>{t, block_ptr}, base, b); });
    block_ptr = &block;
    block.run();
  }
}

}  // namespace fastmha::testing
