// The CPU buffers of 4 MiB and more that fastmha keeps for reuse (kept attention weights, the backward's
// partial gradients): a freed one serves a later call of about its size, so its pages need no fresh mapping and
// zeroing by the OS. Up to 16 are kept, 1 GiB in all; FASTMHA_CPU_REUSE_BUFFERS=0 keeps none.
#pragma once

#include <cstddef>

namespace fastmha {

// Frees the kept buffers (tensors in use are not touched). Thread-safe.
void release_cpu_buffers();

// Bytes held in kept buffers that no tensor uses.
std::size_t cached_cpu_buffer_bytes();

}  // namespace fastmha
