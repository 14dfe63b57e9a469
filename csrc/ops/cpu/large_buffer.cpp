#include "ops/cpu/large_buffer.h"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fastmha::cpu {

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  auto tensor = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  constexpr size_t kMinBytes = size_t{4} << 20;
  if (tensor.nbytes() >= kMinBytes) {
    // Only whole huge pages inside the buffer: the advice never reaches memory the buffer does not own.
    const auto begin = reinterpret_cast<uintptr_t>(tensor.data_ptr());
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + tensor.nbytes()) & ~(kHugePage - 1);
    if (last > first) {
      madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice only: failure is harmless
    }
  }
#endif
  return tensor;
}

}  // namespace fastmha::cpu
