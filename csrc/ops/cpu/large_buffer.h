// Fresh output buffers of many megabytes for the CPU kernels, backed by transparent huge pages where the OS
// offers them.
#pragma once

#include <ATen/ATen.h>

namespace fastmha::cpu {

// at::empty(sizes, options), with buffers of 4 MiB and more marked for transparent huge pages before anything
// touches them. Such buffers (kept weights are batch x heads x Lq x Lk) are usually fresh memory on every call,
// and the first write to each 4 KiB page faults: on Zen 3 the faults of a 128 MiB buffer cost about 60 ms, five
// times the writes themselves. With huge pages there are 512 times fewer. Linux's default "madvise" mode gives
// huge pages only to ranges marked so; torch marks all its CPU allocations the same way when
// THP_MEM_ALLOC_ENABLE=1. Elsewhere, or when the OS declines, this is plain at::empty.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace fastmha::cpu
