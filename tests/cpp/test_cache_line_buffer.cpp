// The CPU kernels' scratch buffers (ops/cpu/cache_line_buffer.h) start on a cache line at every size, also past
// malloc's mmap threshold (where glibc's blocks start 16 bytes into a page), and after growing.
#include <catch2/catch.hpp>

#include <cstdint>

#include "ops/cpu/cache_line_buffer.h"

namespace {

bool on_cache_line(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % fastmha::cpu::kCacheLine == 0; }

}  // namespace

TEST_CASE("cache-line buffers are aligned at every size", "[cpu][cache_line_buffer]") {
  for (std::size_t n :
       {std::size_t{1}, std::size_t{3}, std::size_t{1000}, std::size_t{1} << 17, std::size_t{3} << 20}) {
    fastmha::cpu::CacheLineVector<uint16_t> halves(n);
    fastmha::cpu::CacheLineVector<float> floats(n, 1.0f);
    CHECK(on_cache_line(halves.data()));
    CHECK(on_cache_line(floats.data()));
    floats.resize(2 * n + 5);  // regrown: a new block, aligned too, the old elements kept
    CHECK(on_cache_line(floats.data()));
    CHECK(floats[n - 1] == 1.0f);
  }
}
