// Runs the CUDA kernel bodies (csrc/ops/cuda/flash/*.h) on the CPU. Each CUDA thread of a block is a fiber
// (ucontext) on one OS thread that runs until it waits at a barrier: __syncthreads (the whole block) or a warp
// collective (its 32 lanes). A waiting fiber resumes once every thread the barrier names has arrived, so the
// threads run exactly as the barriers order them, deterministically and fast. The schedule picks which of the
// released fibers runs next: in thread order, reversed, or shuffled, and under the reverse schedule each warp
// runs as far as its own barriers let it before the next warp starts. A missing barrier (thread a reads what
// thread b writes, unordered) then gives wrong results under some schedule instead of hiding. Blocks run one
// after another. A warp's 16x16 tensor-core product is computed by its first lane in fp32 from the same operands
// (the GPU's WMMA call is the one part not exercised here). The register-fragment operations of the mma kernels
// (ldmatrix, mma.sync m16n8k16, quad shuffles) exchange each lane's registers (and ldmatrix's rows, read as the
// lane runs) through staging slots at a barrier of the warp, and compute every lane's result from the fragment
// layouts the PTX ISA specifies, written here independently of the kernels. cp.async copies land when the
// issuing thread waits for their group (a read before the wait, or before the barrier after it, sees the NaN
// bytes), or under the reverse schedule as soon as they are issued (a buffer overwritten while another warp
// still reads it shows). Shared memory and fiber stacks start as NaN bytes, so a read of anything the kernel did
// not write shows up in the results.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
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
  // A lane's registers in a warp collective.
  struct LaneWords {
    uint64_t word[6];
  };

  FiberBlock(int threads, std::function<void(int)> body)
      : body_(std::move(body)),
        fibers_(threads),
        waits_(threads, Wait::kNone),
        block_barriers_(threads, 0),
        warp_barriers_(threads, 0),
        done_(threads, false),
        staging_(threads),
        lane_words_{std::vector<LaneWords>(threads), std::vector<LaneWords>(threads)},
        collectives_(threads, 0),
        open_copies_(threads),
        committed_copies_(threads) {}

  void run() {
    auto& stacks = stack_pool(fibers_.size());
    for (size_t t = 0; t < fibers_.size(); ++t) {
      getcontext(&fibers_[t]);
      fibers_[t].uc_stack.ss_sp = stacks[t].get();
      fibers_[t].uc_stack.ss_size = kStackBytes;
      fibers_[t].uc_link = &scheduler_;
      makecontext(&fibers_[t], reinterpret_cast<void (*)()>(&FiberBlock::trampoline), 0);
    }
    const size_t threads = fibers_.size();
    std::vector<size_t> order(threads);
    std::iota(order.begin(), order.end(), size_t{0});
    const Schedule schedule = current_schedule();
    if (schedule == Schedule::kReverse) {
      std::reverse(order.begin(), order.end());
    }
    std::mt19937 random(20261129);
    size_t finished = 0;
    // Resumes t if its barrier has let it go; says whether it ran.
    const auto step = [&](size_t t, int64_t slowest_block) {
      if (done_[t] || !released(t, slowest_block)) {
        return false;
      }
      resume(t);
      finished += done_[t] ? 1 : 0;
      return true;
    };
    while (finished < threads) {
      // A fiber waiting at a block barrier goes on once every thread has arrived, finished ones included (a
      // thread that ends before a barrier the others wait at leaves them waiting: reported below).
      const int64_t slowest_block = *std::min_element(block_barriers_.begin(), block_barriers_.end());
      bool progressed = false;
      if (schedule == Schedule::kReverse) {  // warp by warp, each as far as it can go
        for (size_t first = 0; first < threads; first += 32) {
          bool warp_progressed = true;
          while (warp_progressed) {
            warp_progressed = false;
            for (size_t l = first; l < std::min(first + 32, threads); ++l) {
              warp_progressed = step(order[l], slowest_block) || warp_progressed;
            }
            progressed = progressed || warp_progressed;
          }
        }
      } else {
        if (schedule == Schedule::kShuffled) {
          std::shuffle(order.begin(), order.end(), random);
        }
        for (const size_t t : order) {
          progressed = step(t, slowest_block) || progressed;
        }
      }
      if (!progressed) {
        throw std::logic_error("emulated block: threads wait at barriers the others never reach");
      }
    }
    // Every thread of a block must pass the same barriers, as __syncthreads requires.
    for (size_t t = 1; t < threads; ++t) {
      if (block_barriers_[t] != block_barriers_[0]) {
        throw std::logic_error("emulated block: threads passed different numbers of barriers");
      }
    }
    for (size_t t = 0; t < fibers_.size(); ++t) {
      if (!open_copies_[t].empty() || !committed_copies_[t].empty()) {
        throw std::logic_error("emulated block: a thread ended with cp.async copies it never waited for");
      }
    }
  }

  // Stages the calling thread's words, waits for its warp's lanes and returns every thread's slots (a lane reads
  // its warp's). Collectives use two sets of slots in turn: a lane can overwrite a set only two collectives
  // later, after every lane of its warp has passed the barrier of the one in between, and so has read this one's.
  const std::vector<LaneWords>& exchange(const LaneWords& mine) {
    const int self = current_;
    auto& slots = lane_words_[collectives_[self]++ % 2];
    slots[self] = mine;
    ++warp_barriers_[self];
    waits_[self] = Wait::kWarp;
    swapcontext(&fibers_[self], &scheduler_);
    return slots;
  }

  // Under Schedule::kReverse a copy lands as it is issued (the earliest the hardware may write it), elsewhere
  // when its group is waited for (the latest): a buffer still read by another thread, or read before the wait,
  // then shows the wrong data under one of them.
  void copy_async(void* shared, const void* global) {
    if (current_schedule() == Schedule::kReverse) {
      std::memcpy(shared, global, 16);
      return;
    }
    open_copies_[current_].push_back({shared, global});
  }
  void copy_commit() {
    committed_copies_[current_].push_back(std::move(open_copies_[current_]));
    open_copies_[current_].clear();
  }
  // Lands the calling thread's oldest committed groups until at most `pending` remain.
  void copy_wait(size_t pending) {
    auto& groups = committed_copies_[current_];
    while (groups.size() > pending) {
      for (const auto& copy : groups.front()) {
        std::memcpy(copy.shared, copy.global, 16);
      }
      groups.pop_front();
    }
  }

  std::vector<double>& staging() { return staging_; }

  // __syncthreads: waits until every thread of the block has arrived.
  void sync() {
    ++block_barriers_[current_];
    waits_[current_] = Wait::kBlock;
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

  enum class Wait { kNone, kBlock, kWarp };

  bool released(size_t t, int64_t slowest_block) const {
    if (waits_[t] == Wait::kBlock) {
      return slowest_block >= block_barriers_[t];
    }
    if (waits_[t] == Wait::kWarp) {
      const size_t first = t / 32 * 32, end = std::min(first + 32, fibers_.size());
      for (size_t l = first; l < end; ++l) {
        if (warp_barriers_[l] < warp_barriers_[t]) {
          return false;
        }
      }
    }
    return true;
  }

  void resume(size_t t) {
    current_ = static_cast<int>(t);
    waits_[t] = Wait::kNone;
    active() = this;
    swapcontext(&scheduler_, &fibers_[t]);
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
  std::vector<Wait> waits_;
  std::vector<int64_t> block_barriers_, warp_barriers_;
  std::vector<bool> done_;
  std::vector<double> staging_;  // one slot per thread for warp_all_reduce
  std::vector<LaneWords> lane_words_[2];
  std::vector<int64_t> collectives_;
  struct Copy {
    void* shared;
    const void* global;
  };
  std::vector<std::vector<Copy>> open_copies_;
  std::vector<std::deque<std::vector<Copy>>> committed_copies_;
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

  // The register-fragment operations of the mma kernels; see device_threads.cuh for what each does.
  template <typename A, typename Op>
  A quad_all_reduce(A value, Op op) const {
    static_assert(sizeof(A) <= sizeof(uint64_t), "one word per lane");
    FiberBlock::LaneWords mine{};
    std::memcpy(&mine.word[0], &value, sizeof(A));
    const auto& slots = block->exchange(mine);
    A v[4];
    for (int t = 0; t < 4; ++t) {
      std::memcpy(&v[t], &slots[id / 4 * 4 + t].word[0], sizeof(A));
    }
    return op(op(v[0], v[1]), op(v[2], v[3]));  // the same in all four lanes, as the butterfly gives
  }

  // ldmatrix.x4: lanes 8i..8i+7 name the rows of 8x8 matrix i (16-byte aligned, 8 16-bit elements each).
  template <bool Trans, typename T>
  void ldmatrix_x4(uint32_t (&r)[4], const T* row) const {
    static_assert(sizeof(T) == 2, "16-bit elements");
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0) {
      throw std::logic_error("emulated ldmatrix: a row address is not 16-byte aligned");
    }
    // Each lane reads its own row before the exchange's barrier, as it runs: a read that a missing barrier
    // leaves unordered against another thread's write then sees that write or not, by schedule.
    FiberBlock::LaneWords mine{};
    std::memcpy(&mine.word[0], row, 16);
    const auto& slots = block->exchange(mine);
    const auto row_of = [&](int matrix, int r) {
      return reinterpret_cast<const uint16_t*>(&slots[warp() * 32 + 8 * matrix + r].word[0]);
    };
    const int l = lane();
    for (int i = 0; i < 4; ++i) {
      uint16_t first, second;
      if (Trans) {  // rows 2 (l % 4) and + 1 of column l / 4
        first = row_of(i, 2 * (l % 4))[l / 4];
        second = row_of(i, 2 * (l % 4) + 1)[l / 4];
      } else {  // row l / 4, columns 2 (l % 4) and + 1
        first = row_of(i, l / 4)[2 * (l % 4)];
        second = row_of(i, l / 4)[2 * (l % 4) + 1];
      }
      r[i] = static_cast<uint32_t>(first) | (static_cast<uint32_t>(second) << 16);
    }
  }

  // mma.sync.m16n8k16.row.col with fp32 accumulators. Fragments (g = lane / 4, c = 2 (lane % 4)):
  // A register r holds row g + 8 (r % 2), columns c + 8 (r / 2) and + 1; B register r holds rows c + 8 r and + 1
  // of column g; D element e is row g + 8 (e / 2), column c + e % 2.
  template <typename T>
  void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) const {
    FiberBlock::LaneWords mine{};
    for (int r = 0; r < 4; ++r) {
      mine.word[r] = a[r];
    }
    mine.word[4] = b0;
    mine.word[5] = b1;
    const auto& slots = block->exchange(mine);
    const auto* warp_words = &slots[warp() * 32];
    const auto element = [](uint64_t word, int half) {
      return static_cast<float>(T(static_cast<uint16_t>(word >> (16 * half)), T::from_bits()));
    };
    const auto a_at = [&](int row, int k) {
      return element(warp_words[(row % 8) * 4 + (k % 8) / 2].word[row / 8 + 2 * (k / 8)], k % 2);
    };
    const auto b_at = [&](int k, int col) { return element(warp_words[col * 4 + (k % 8) / 2].word[4 + k / 8], k % 2); };
    const int g = lane() / 4, c = 2 * (lane() % 4);
    for (int e = 0; e < 4; ++e) {
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) {
        sum += a_at(g + 8 * (e / 2), k) * b_at(k, c + e % 2);
      }
      d[e] += sum;
    }
  }

  void copy_async16(void* shared, const void* global) const { block->copy_async(shared, global); }
  void copy_commit() const { block->copy_commit(); }
  template <int Pending>
  void copy_wait() const {
    block->copy_wait(Pending);
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
