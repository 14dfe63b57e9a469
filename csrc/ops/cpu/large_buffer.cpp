#include "ops/cpu/large_buffer.h"

#include <fastmha/cpu_buffers.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <utility>

#if defined(__linux__)
#include <pthread.h>
#include <sys/mman.h>
#endif

namespace fastmha::cpu {
namespace {

constexpr size_t kHugePage = size_t{1} << 21;
constexpr size_t kMinBytes = size_t{4} << 20;
constexpr size_t kKeptBuffers = 16;
constexpr size_t kKeptBytes = size_t{1} << 30;  // what freed buffers may hold in all

bool reuse_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("FASTMHA_CPU_REUSE_BUFFERS");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

struct Buffer {
  void* data;
  size_t capacity;
};

// Every buffer this allocator made, in use or kept, by address; freed buffers kept for the next calls, newest
// last. Shared by all threads: a buffer is often freed on another thread than the one that made it (autograd's,
// the user's). The DataPtr's context is the data pointer itself, as with c10's own CPU allocator, so torch's
// copy-on-write clones (lazy_clone) can wrap these tensors too.
class BufferPool {
 public:
  BufferPool() {
#if defined(__linux__)
    // A fork while another thread holds the lock would leave the child's copy locked forever.
    // The prepare handler takes the lock in the forking thread, which is also the child's only thread.
    pthread_atfork([] { pool_mutex().lock(); }, [] { pool_mutex().unlock(); }, [] { pool_mutex().unlock(); });
#endif
  }

  // A buffer of at least `bytes` and its capacity: a kept one of at most twice that (a big one is not spent on a
  // small request), else fresh memory; nullptr if none can be had.
  std::pair<void*, size_t> take(size_t bytes) {
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(pool_mutex());
      auto best = kept_.end();
      for (auto it = kept_.begin(); it != kept_.end(); ++it) {
        if (it->capacity >= bytes && it->capacity / 2 <= bytes &&
            (best == kept_.end() || it->capacity < best->capacity)) {
          best = it;
        }
      }
      if (best != kept_.end()) {
        const Buffer found = *best;
        kept_bytes_ -= found.capacity;
        kept_.erase(best);
        return {found.data, found.capacity};
      }
    }
    data = fresh_buffer(bytes);
    if (data == nullptr) {  // out of memory: what is kept goes back to the system first
      release_all();
      data = fresh_buffer(bytes);
    }
    if (data != nullptr) {
      std::lock_guard<std::mutex> lock(pool_mutex());
      capacity_[data] = bytes;
      reserved_ += bytes;
    }
    return {data, bytes};
  }

  // Keeps the buffer at `data`, freeing the oldest kept ones beyond 16 buffers or 1 GiB; a buffer above 1 GiB,
  // or any when reuse is off, is freed at once. Returns its capacity.
  size_t give_back(void* data) {
    std::deque<Buffer> evicted;
    size_t capacity = 0;
    {
      std::lock_guard<std::mutex> lock(pool_mutex());
      const Buffer buffer{data, capacity_.at(data)};
      capacity = buffer.capacity;
      if (!reuse_enabled() || buffer.capacity > kKeptBytes) {
        evicted.push_back(buffer);
        forget(buffer);
      } else {
        kept_.push_back(buffer);
        kept_bytes_ += buffer.capacity;
        while (kept_.size() > kKeptBuffers || kept_bytes_ > kKeptBytes) {
          evicted.push_back(kept_.front());
          kept_bytes_ -= kept_.front().capacity;
          forget(kept_.front());
          kept_.pop_front();
        }
      }
    }
    for (const auto& old : evicted) std::free(old.data);
    return capacity;
  }

  void release_all() {
    std::deque<Buffer> kept;
    {
      std::lock_guard<std::mutex> lock(pool_mutex());
      kept.swap(kept_);
      kept_bytes_ = 0;
      for (const auto& buffer : kept) forget(buffer);
    }
    for (const auto& buffer : kept) std::free(buffer.data);
  }

  size_t kept_bytes() {
    std::lock_guard<std::mutex> lock(pool_mutex());
    return kept_bytes_;
  }

  // Bytes in use by tensors and bytes held in all (in use and kept), for the profiler.
  std::pair<size_t, size_t> totals() {
    std::lock_guard<std::mutex> lock(pool_mutex());
    return {reserved_ - kept_bytes_, reserved_};
  }

 private:
  static std::mutex& pool_mutex() {
    static std::mutex mutex;
    return mutex;
  }

  // Fresh memory aligned to huge pages and advised to use them (whole 2 MiB pages, so the advice never reaches
  // memory the buffer does not own); nullptr when the system has none.
  static void* fresh_buffer(size_t capacity) {
    void* data = nullptr;
    if (posix_memalign(&data, kHugePage, capacity) != 0) {
      return nullptr;
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(data, capacity & ~(kHugePage - 1), MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
    return data;
  }

  // Under the lock: the buffer is about to be freed.
  void forget(const Buffer& buffer) {
    capacity_.erase(buffer.data);
    reserved_ -= buffer.capacity;
  }

  std::deque<Buffer> kept_;
  std::unordered_map<void*, size_t> capacity_;
  size_t kept_bytes_ = 0, reserved_ = 0;
};

BufferPool& pool() {
  static auto* instance = new BufferPool();  // never destroyed: tensors may be freed during static destruction
  return *instance;
}

void report_to_profiler(void* data, int64_t bytes) {
  if (c10::memoryProfilingEnabled()) {
    const auto [allocated, reserved] = pool().totals();
    c10::reportMemoryUsageToProfiler(data, bytes, allocated, reserved, c10::Device(c10::DeviceType::CPU));
  }
}

void give_back(void* data) {
  const size_t capacity = pool().give_back(data);
  report_to_profiler(data, -static_cast<int64_t>(capacity));
}

class LargeBufferAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    // Whole huge pages, so a buffer can serve later requests of about the same size.
    const size_t capacity = std::max(kHugePage, (bytes + kHugePage - 1) & ~(kHugePage - 1));
    const auto [data, capacity_taken] = pool().take(capacity);
    if (data == nullptr) {
      const auto [allocated, reserved] = pool().totals();
      c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(capacity), allocated, reserved,
                                       c10::Device(c10::DeviceType::CPU));
      TORCH_CHECK(false, "fastmha: could not allocate ", capacity, " bytes of CPU memory");
    }
    // The buffer's own capacity, which give_back reports freed.
    report_to_profiler(data, static_cast<int64_t>(capacity_taken));
    return {data, data, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

LargeBufferAllocator& large_buffer_allocator() {
  static auto* instance = new LargeBufferAllocator();
  return *instance;
}

}  // namespace

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return empty_large(sizes, options, kMinBytes);
}

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options, size_t min_bytes) {
  const size_t bytes = c10::multiply_integers(sizes) * options.dtype().itemsize();
  if (bytes < min_bytes || options.device().type() != c10::DeviceType::CPU) {
    return at::empty(sizes, options);
  }
  return at::detail::empty_generic(sizes, &large_buffer_allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   options.dtype().toScalarType(), std::nullopt);
}

}  // namespace fastmha::cpu

namespace fastmha {

void release_cpu_buffers() { cpu::pool().release_all(); }

std::size_t cached_cpu_buffer_bytes() { return cpu::pool().kept_bytes(); }

}  // namespace fastmha
