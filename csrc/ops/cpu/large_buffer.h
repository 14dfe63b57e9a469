// Fresh output buffers of many megabytes for the CPU kernels: backed by transparent huge pages where the OS
// offers them, and reused from call to call.
#pragma once

#include <ATen/ATen.h>

namespace fastmha::cpu {

// at::empty(sizes, options) for CPU buffers of 4 MiB and more from fastmha's own allocator. Such buffers (kept
// weights are batch x heads x Lq x Lk; the backward's partial dK and dV) are otherwise fresh memory on every
// call, and the OS zeroes each page at its first write: 67 MB cost about 22 ms on Zen 3, five times writing
// them. The allocator
//  - aligns them to 2 MiB and marks them for transparent huge pages (512 times fewer page faults; Linux's
//    default "madvise" mode gives huge pages only to ranges marked so);
//  - keeps up to 16 freed buffers (1 GiB in all) and hands one back to a later request of about its size
//    (between half its size and all of it), whose pages are then already mapped. FASTMHA_CPU_REUSE_BUFFERS=0
//    frees them at once; fastmha::release_cpu_buffers() (fastmha/cpu_buffers.h) frees the kept ones.
// Smaller buffers, and other devices, get plain at::empty.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options);

// The same from `min_bytes` on: for scratch that every call needs afresh (the heads' operands packed once per
// call), whose pages malloc may hand back to the OS between calls, so that the next call faults them in again (on
// an Intel Xeon, about 270 faults a call of 2 MiB of packed bfloat16 keys and values, 12% of a short forward).
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options, size_t min_bytes);

}  // namespace fastmha::cpu
