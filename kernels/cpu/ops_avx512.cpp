// AVX-512 row kernels of kernels/ops.hpp: ops_avx2.cpp's arithmetic on
// sixteen lanes. Element-wise kernels compute every element as the AVX2
// ones do; sum_squares keeps AVX2's four accumulators of eight lanes (two
// zmm, each holding two of them) and its reduction order, so the bits are
// the same at every level. softmax and RoPE stay on AVX2 (softmax's sum runs
// in eight lanes block after block; sixteen lanes would change its order).
// As in ops_avx2.cpp, no implicit FMA contraction.
// GCC 12's avx512fintrin.h builds some results from _mm512_undefined_*()
// and then warns that they may be used uninitialized (a false positive in
// the header, not in this code).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/avx512_math.hpp"
#include "kernels/cpu/ops_impl.hpp"

#pragma GCC optimize("fp-contract=off")

namespace troupe::kernels::cpu {

namespace {

inline __mmask16 tail_mask16(std::int64_t n) {
  return static_cast<__mmask16>((1u << n) - 1u);
}

// x / (1 + exp(-k x)), as ops_avx2.cpp's x_sigmoid.
inline __m512 x_sigmoid(__m512 x, __m512 k) {
  const __m512 e = avx512_exp(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), k), x));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// ops_avx2.cpp's erfc_ps.
inline __m512 erfc_ps(__m512 z) {
  const __m512 a = _mm512_abs_ps(z);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                 _mm512_fmadd_ps(_mm512_set1_ps(0.5f), a, _mm512_set1_ps(1.0f)));
  __m512 p = _mm512_set1_ps(0.17087277f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.82215223f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.48851587f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.13520398f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.27886807f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.18628806f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.09678418f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.37409196f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.00002368f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.26551223f));
  const __m512 arg = _mm512_fnmadd_ps(a, a, p);
  const __m512 r = _mm512_mul_ps(t, avx512_exp(arg));
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ),
                            _mm512_sub_ps(_mm512_set1_ps(2.0f), r));
}

template <int Kind>
inline __m512 gelu_ps(__m512 x) {
  if constexpr (Kind == 0) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 inner = _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x);
    const __m512 u2 = _mm512_mul_ps(_mm512_set1_ps(2.0f * 0.7978845608028654f), inner);
    const __m512 e = avx512_exp(_mm512_sub_ps(_mm512_setzero_ps(), u2));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  } else if constexpr (Kind == 1) {
    const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(-0.70710678118654752f));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), erfc_ps(z));
  } else {
    return x_sigmoid(x, _mm512_set1_ps(1.702f));
  }
}

template <class F>
inline void map1(const float* x, float* y, std::int64_t n, F f) {
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, f(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = tail_mask16(n - i);
    _mm512_mask_storeu_ps(y + i, m, f(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

template <class F>
inline void map2(const float* a, const float* b, float* y, std::int64_t n, F f) {
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, f(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
  if (i < n) {
    const __mmask16 m = tail_mask16(n - i);
    _mm512_mask_storeu_ps(y + i, m,
                          f(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)));
  }
}

}  // namespace

float sum_squares_avx512(const float* x, std::int64_t n) {
  // a01 holds AVX2's accumulators 0 (low half) and 1; a23 holds 2 and 3.
  __m512 a01 = _mm512_setzero_ps(), a23 = _mm512_setzero_ps();
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 u = _mm512_loadu_ps(x + i), v = _mm512_loadu_ps(x + i + 16);
    a01 = _mm512_fmadd_ps(u, u, a01);
    a23 = _mm512_fmadd_ps(v, v, a23);
  }
  // The tail's blocks of eight go to accumulators 0 to 3 in turn; a lane
  // past the end adds 0 * 0 to +0 or more, which changes nothing.
  if (i < n) {
    const std::int64_t left = n - i;
    const __m512 u = _mm512_maskz_loadu_ps(tail_mask16(left < 16 ? left : 16), x + i);
    a01 = _mm512_fmadd_ps(u, u, a01);
    if (left > 16) {
      const __m512 v = _mm512_maskz_loadu_ps(tail_mask16(left - 16), x + i + 16);
      a23 = _mm512_fmadd_ps(v, v, a23);
    }
  }
  const __m256 s01 = _mm256_add_ps(_mm512_castps512_ps256(a01), _mm512_extractf32x8_ps(a01, 1));
  const __m256 s23 = _mm256_add_ps(_mm512_castps512_ps256(a23), _mm512_extractf32x8_ps(a23, 1));
  const __m256 s = _mm256_add_ps(s01, s23);
  const __m128 lo = _mm256_castps256_ps128(s), hi = _mm256_extractf128_ps(s, 1);
  __m128 h = _mm_add_ps(lo, hi);
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

void scale_mul_avx512(const float* x, const float* w, float r, float* y, std::int64_t n) {
  const __m512 vr = _mm512_set1_ps(r);
  map2(x, w, y, n, [vr](__m512 v, __m512 wv) { return _mm512_mul_ps(wv, _mm512_mul_ps(v, vr)); });
}

void silu_row_avx512(const float* x, float* y, std::int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  map1(x, y, n, [one](__m512 v) { return x_sigmoid(v, one); });
}

void swiglu_row_avx512(const float* g, const float* u, float* y, std::int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  map2(g, u, y, n, [one](__m512 gv, __m512 uv) { return _mm512_mul_ps(x_sigmoid(gv, one), uv); });
}

void geglu_row_avx512(const float* g, const float* u, float* y, std::int64_t n) {
  map2(g, u, y, n, [](__m512 gv, __m512 uv) { return _mm512_mul_ps(gelu_ps<0>(gv), uv); });
}

void gelu_row_avx512(const float* x, float* y, std::int64_t n, int kind) {
  if (kind == 0)
    map1(x, y, n, [](__m512 v) { return gelu_ps<0>(v); });
  else if (kind == 1)
    map1(x, y, n, [](__m512 v) { return gelu_ps<1>(v); });
  else
    map1(x, y, n, [](__m512 v) { return gelu_ps<2>(v); });
}

void add_row_avx512(const float* a, const float* b, float* y, std::int64_t n) {
  map2(a, b, y, n, [](__m512 u, __m512 v) { return _mm512_add_ps(u, v); });
}

}  // namespace troupe::kernels::cpu
