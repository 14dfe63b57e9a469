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

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fastmha::cpu {
namespace {

constexpr size_t kHugePage = size_t{1} << 21;
constexpr size_t kMinBytes = size_t{4} << 20;
constexpr size_t kKeptBuffers = 4;
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

// Freed buffers kept for the next calls, newest last. Shared by all threads: a buffer is often freed on another
// thread than the one that made it (autograd's, the user's).
class BufferPool {
 public:
  // A kept buffer of at least `bytes` and at most twice that (a big one is not spent on a small request).
  Buffer take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->capacity >= bytes && it->capacity / 2 <= bytes &&
          (best == kept_.end() || it->capacity < best->capacity)) {
        best = it;
      }
    }
    if (best == kept_.end()) {
      return {nullptr, 0};
    }
    const Buffer found = *best;
    bytes_ -= found.capacity;
    kept_.erase(best);
    return found;
  }

  // Keeps `buffer`, freeing the oldest kept ones beyond 4 buffers or 1 GiB (a buffer above 1 GiB is freed).
  void give_back(Buffer buffer) {
    std::deque<Buffer> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept_.push_back(buffer);
      bytes_ += buffer.capacity;
      while (kept_.size() > kKeptBuffers || bytes_ > kKeptBytes) {
        evicted.push_back(kept_.front());
        bytes_ -= kept_.front().capacity;
        kept_.pop_front();
      }
    }
    for (const auto& old : evicted) std::free(old.data);
  }

  void release_all() {
    std::deque<Buffer> kept;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept.swap(kept_);
      bytes_ = 0;
    }
    for (const auto& buffer : kept) std::free(buffer.data);
  }

  size_t kept_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return bytes_;
  }

 private:
  std::mutex mutex_;
  std::deque<Buffer> kept_;
  size_t bytes_ = 0;
};

BufferPool& pool() {
  static auto* instance = new BufferPool();  // never destroyed: tensors may be freed during static destruction
  return *instance;
}

void give_back(void* context) {
  auto* buffer = static_cast<Buffer*>(context);
  if (reuse_enabled()) {
    pool().give_back(*buffer);
  } else {
    std::free(buffer->data);
  }
  delete buffer;
}

// Fresh memory aligned to huge pages and advised to use them (whole 2 MiB pages, so the advice never reaches
// memory the buffer does not own).
void* fresh_buffer(size_t capacity) {
  void* data = nullptr;
  if (posix_memalign(&data, kHugePage, capacity) != 0) {
    TORCH_CHECK(false, "fastmha: could not allocate ", capacity, " bytes of CPU memory");
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(data, capacity & ~(kHugePage - 1), MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
  return data;
}

class LargeBufferAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    // Whole huge pages, so a buffer can serve later requests of about the same size.
    const size_t capacity = std::max(kHugePage, (bytes + kHugePage - 1) & ~(kHugePage - 1));
    Buffer buffer = pool().take(capacity);
    if (buffer.data == nullptr) {
      buffer = {fresh_buffer(capacity), capacity};
    }
    return {buffer.data, new Buffer(buffer), &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

LargeBufferAllocator& large_buffer_allocator() {
  static auto* instance = new LargeBufferAllocator();
  return *instance;
}

}  // namespace

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = c10::multiply_integers(sizes) * options.dtype().itemsize();
  if (bytes < kMinBytes || options.device().type() != c10::DeviceType::CPU) {
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
