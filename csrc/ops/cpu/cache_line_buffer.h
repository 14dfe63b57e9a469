// Scratch memory of the CPU kernels that starts on a cache line. The kernels' product operands and results (packed
// panels, padded rows, score blocks, fp32 output rows) have row strides of whole cache lines, so with an aligned
// start every row an AMX tile or a 64-byte vector loads or stores lies in one line. malloc gives 16-byte alignment
// (large blocks come from mmap at 16 bytes past a page): on an Intel Xeon with AMX-BF16, oneDNN's brgemm ran
// 256 x 128 x 512 products at 300-400 GFLOP/s a core on such buffers and at 1100-1450 on aligned ones.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <vector>

namespace fastmha::cpu {

constexpr std::size_t kCacheLine = 64;

// std::allocator's contract with memory aligned to kCacheLine.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;

  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor)

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{kCacheLine})); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete (p, std::align_val_t{kCacheLine}); }

  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
};

template <typename T>
using CacheLineVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace fastmha::cpu
