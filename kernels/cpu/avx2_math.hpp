#pragma once
// AVX2 math shared by the *_avx2.cpp kernels. Include only from files built
// with AVX2 flags. Everything is in an anonymous namespace (internal
// linkage), so files built with different floating-point pragmas never share
// one definition.

#include <immintrin.h>

namespace troupe::kernels::cpu {
namespace {

/// The largest of the 8 lanes.
inline float avx2_hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline constexpr float avx2_exp_lo = -87.33654475f;  ///< below: the result would be subnormal
inline constexpr float avx2_exp_hi = 88.72283935f;   ///< above: overflow

/// e^x for x already clamped to [avx2_exp_lo, avx2_exp_hi] (Cephes: x = n ln2
/// + r, |r| <= ln2/2, degree-7 polynomial; about 1-2 ulp).
inline __m256 avx2_exp_clamped(__m256 xc) {
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  fx = _mm256_min_ps(fx, _mm256_set1_ps(127.0f));
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/// e^x for finite or -inf x on the attention hot path: exactly 0 below
/// avx2_exp_lo (so e^-inf = 0); inputs above avx2_exp_hi are clamped.
inline __m256 avx2_exp_fast(__m256 x) {
  const __m256 lo = _mm256_set1_ps(avx2_exp_lo);
  const __m256 valid = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(avx2_exp_hi));
  return _mm256_and_ps(avx2_exp_clamped(xc), valid);
}

/// e^x for any x: 0 below avx2_exp_lo, +inf above avx2_exp_hi, NaN stays NaN.
inline __m256 avx2_exp(__m256 x) {
  const __m256 lo = _mm256_set1_ps(avx2_exp_lo), hi = _mm256_set1_ps(avx2_exp_hi);
  __m256 y = avx2_exp_clamped(_mm256_min_ps(_mm256_max_ps(x, lo), hi));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

}  // namespace
}  // namespace troupe::kernels::cpu
