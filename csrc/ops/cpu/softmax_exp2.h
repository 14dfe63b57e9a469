// The softmax's exp as 2^t on AVX-512, for float32 scores and for weights rounded to a half type. Included only by the
// per-capability kernel files: the code lives in the CPU_CAPABILITY namespace (each file keeps its own ISA's copy,
// see blas.h).
#pragma once

#ifndef CPU_CAPABILITY
#error "ops/cpu/softmax_exp2.h is for the files compiled once per CPU capability"
#endif

#include <ATen/cpu/vec/vec.h>

#include <cmath>

namespace fastmha::cpu::CPU_CAPABILITY {

// The scale and max of exp(s * scale - max).
struct HalfWeightExp {
  float scale, max;
};

#if defined(CPU_CAPABILITY_AVX512)
// 2^t on AVX-512: f = t - floor(t) (vreduceps), 2^f by a polynomial on [0, 1) (least-squares fits with 2^0 = 1
// exactly), times 2^floor(t) (vscalefps). Lanes below 2^-126 are zero, so that no lane makes a subnormal (slow on
// some processors) and keys about 87.3 or more below the max weigh exactly 0, masked ones (-1e9) among them; a NaN
// lane stays NaN. Degree 4 (eight instructions): relative error at most 3.1e-6 in fp32, a thirtieth of bfloat16's
// rounding; degree 5: 1.7e-7, a few fp32 roundings (for 2^t itself: the callers' t = x * log2(e) adds its own).
template <int kDegree>
inline __m512 exp2_polynomial(__m512 t) {
  static_assert(kDegree == 4 || kDegree == 5, "fits of degree 4 and 5");
  const __m512 lowest = _mm512_set1_ps(-126.0f);
  const __mmask16 normal = _mm512_cmp_ps_mask(t, lowest, _CMP_NLT_UQ);              // NaN too
  const __m512 x = _mm512_max_ps(lowest, t);                                        // returns t where t is NaN
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x)
  __m512 p;
  if constexpr (kDegree == 4) {
    p = _mm512_fmadd_ps(_mm512_set1_ps(0.013425349f), f, _mm512_set1_ps(0.052243151f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24128109f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69304442f));
  } else {
    p = _mm512_fmadd_ps(_mm512_set1_ps(0.0018670314f), f, _mm512_set1_ps(0.0090170521f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055800103f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24016431f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69315135f));
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, p, x);
}

inline __m512 exp2_for_half_weights(__m512 t) { return exp2_polynomial<4>(t); }

// exp(x) for the float32 softmax where x = score - max (or - log-sum-exp) is at most about 0, in about half the
// instructions of torch's exp_u20: within 2e-7 of exp near 0, the error growing with |x| as x * log2(e) is rounded
// once, to about 4e-6 between -32 and -87 (exp_u20: about 1e-6 there; such weights are below e^-32 of the row's
// largest); exactly 1 at 0 and 0 below about -87.3.
inline __m512 softmax_exp_avx512(__m512 x) {
  return exp2_polynomial<5>(_mm512_mul_ps(x, _mm512_set1_ps(static_cast<float>(M_LOG2E))));
}
#endif

// The weights exp(s * scale - max) of a vector of raw products s. `fast` (the max is finite): on AVX-512 the
// polynomial above, elsewhere torch's fast exp meant for results downcast to a half type (relative error at most
// 1.1e-4 over [-87, 0], 0 below about -87). The rows' sums, hence the log-sum-exp that the forward returns for the
// backward, carry that error too. Otherwise the exact exp, which keeps NaN and infinities as the math does.
inline at::vec::Vectorized<float> half_weights(const at::vec::Vectorized<float>& s, const HalfWeightExp& e, bool fast) {
  using Vec = at::vec::Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  if (fast) {
    // s * scale - max rounded once, as elsewhere, then in base 2 (max * log2(e) as one constant would be off by up
    // to 64 near the -1e9 of masked scores)
    return exp2_for_half_weights(at::vec::fmsub(s, Vec(e.scale), Vec(e.max)) * Vec(static_cast<float>(M_LOG2E)));
  }
#endif
  const Vec x = s * Vec(e.scale) - Vec(e.max);
  return fast ? x.fexp_u20() : x.exp();
}

}  // namespace fastmha::cpu::CPU_CAPABILITY
