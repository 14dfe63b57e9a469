// IEEE floating-point values read through their bits, for scans that the compiler vectorizes: without its sign
// bit a value's bits are 0 for either zero, order as its magnitude does, and reach kInfinity for infinity and NaN.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace fastmha {

template <typename T>
struct FloatBits;
template <>
struct FloatBits<float> {
  using type = uint32_t;
  static constexpr type kMagnitude = 0x7fffffffu, kInfinity = 0x7f800000u;
};
template <>
struct FloatBits<double> {
  using type = uint64_t;
  static constexpr type kMagnitude = 0x7fffffffffffffffull, kInfinity = 0x7ff0000000000000ull;
};
template <>
struct FloatBits<c10::BFloat16> {
  using type = uint16_t;
  static constexpr type kMagnitude = 0x7fff, kInfinity = 0x7f80;
};
template <>
struct FloatBits<c10::Half> {
  using type = uint16_t;
  static constexpr type kMagnitude = 0x7fff, kInfinity = 0x7c00;
};

// Internal linkage (static), as cpu/half_gemm.h's helpers: a file compiled with a CPU capability's vector flags that
// includes this header must not lend its copies to the baseline files' callers.

// |v|'s bits: v's bits without the sign.
template <typename T>
static inline typename FloatBits<T>::type magnitude_bits(T v) {
  typename FloatBits<T>::type bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & FloatBits<T>::kMagnitude;
}

// The value whose bits these are.
template <typename T>
static inline T from_bits(typename FloatBits<T>::type bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(bits));
  return v;
}

}  // namespace fastmha
