#pragma once
// AVX-512 math shared by the *_avx512.cpp kernels: avx2_math.hpp's
// functions on sixteen lanes, operation for operation (the same rounding,
// the same FMAs), so every lane gives avx2_math's bits. Include only from
// files built with AVX-512 flags. Internal linkage, as in avx2_math.hpp.

#include <immintrin.h>

#include "kernels/cpu/avx2_math.hpp"

namespace troupe::kernels::cpu {
namespace {

/// avx2_exp_clamped on sixteen lanes.
inline __m512 avx512_exp_clamped(__m512 xc) {
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  fx = _mm512_min_ps(fx, _mm512_set1_ps(127.0f));
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/// avx2_exp_fast on sixteen lanes.
inline __m512 avx512_exp_fast(__m512 x) {
  const __m512 lo = _mm512_set1_ps(avx2_exp_lo);
  const __mmask16 valid = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(avx2_exp_hi));
  return _mm512_maskz_mov_ps(valid, avx512_exp_clamped(xc));
}

/// avx2_exp on sixteen lanes.
inline __m512 avx512_exp(__m512 x) {
  const __m512 lo = _mm512_set1_ps(avx2_exp_lo), hi = _mm512_set1_ps(avx2_exp_hi);
  __m512 y = avx512_exp_clamped(_mm512_min_ps(_mm512_max_ps(x, lo), hi));
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps());
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ),
                         _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

}  // namespace
}  // namespace troupe::kernels::cpu
