// AVX2 row kernels of kernels/ops.hpp (intrinsics only, no library templates).
// No implicit FMA contraction: a product followed by a sum stays two rounded
// operations, exactly as written (RoPE and add then match the scalar path bit
// for bit); FMAs appear only where an intrinsic asks for one.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/avx2_math.hpp"
#include "kernels/cpu/ops_impl.hpp"

#pragma GCC optimize("fp-contract=off")

namespace troupe::kernels::cpu {

namespace {

// Lane mask for the first `n` (0..8) lanes.
inline __m256i tail_mask(std::int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}

// Loads / stores min(rem, 8) floats (masked only when rem < 8).
inline __m256 load_n(const float* p, std::int64_t rem) {
  return rem >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(rem));
}
inline void store_n(float* p, std::int64_t rem, __m256 v) {
  if (rem >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, tail_mask(rem), v);
}

inline float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x / (1 + exp(-k x)) (x * sigmoid(k x)).
inline __m256 x_sigmoid(__m256 x, __m256 k) {
  const __m256 e = avx2_exp(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), k), x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// erfc(z) (Numerical Recipes' erfcc, fractional error < 1.2e-7 in exact
// arithmetic): t = 1/(1+z/2), erfc(|z|) = t exp(-z^2 - 1.26551223 + t P(t)).
inline __m256 erfc_ps(__m256 z) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign, z);
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.5f), a, _mm256_set1_ps(1.0f)));
  __m256 p = _mm256_set1_ps(0.17087277f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.82215223f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.48851587f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.13520398f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.27886807f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.18628806f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.09678418f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.37409196f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.00002368f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.26551223f));
  const __m256 arg = _mm256_fnmadd_ps(a, a, p);
  const __m256 r = _mm256_mul_ps(t, avx2_exp(arg));
  // erfc(-a) = 2 - erfc(a)
  return _mm256_blendv_ps(r, _mm256_sub_ps(_mm256_set1_ps(2.0f), r),
                          _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ));
}

inline __m256 gelu_ps(__m256 x, int kind) {
  if (kind == 0) {  // x * sigmoid(2u) == 0.5 x (1 + tanh(u))
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x);
    const __m256 u2 = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), inner);
    const __m256 e = avx2_exp(_mm256_sub_ps(_mm256_setzero_ps(), u2));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  }
  if (kind == 1) {  // 0.5 x erfc(-x / sqrt 2)
    const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(-0.70710678118654752f));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), erfc_ps(z));
  }
  return x_sigmoid(x, _mm256_set1_ps(1.702f));
}

// y[i] = f(x[i]) over a row: full vectors with plain loads/stores (masked
// stores are slow on AMD), the tail through masked ones; the same vector code
// computes every element.
template <class F>
inline void map1(const float* x, float* y, std::int64_t n, F f) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, f(_mm256_loadu_ps(x + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(y + i, m, f(_mm256_maskload_ps(x + i, m)));
  }
}

template <class F>
inline void map2(const float* a, const float* b, float* y, std::int64_t n, F f) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, f(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(y + i, m, f(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m)));
  }
}

}  // namespace

float sum_squares_avx2(const float* x, std::int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * k);
      acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
    }
  for (int k = 0; i < n; i += 8, ++k) {
    const __m256 v = _mm256_maskload_ps(x + i, tail_mask(n - i));
    acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

void scale_mul_avx2(const float* x, const float* w, float r, float* y, std::int64_t n) {
  const __m256 vr = _mm256_set1_ps(r);
  map2(x, w, y, n, [vr](__m256 v, __m256 wv) { return _mm256_mul_ps(wv, _mm256_mul_ps(v, vr)); });
}

void silu_row_avx2(const float* x, float* y, std::int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  map1(x, y, n, [one](__m256 v) { return x_sigmoid(v, one); });
}

void swiglu_row_avx2(const float* g, const float* u, float* y, std::int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  map2(g, u, y, n, [one](__m256 gv, __m256 uv) { return _mm256_mul_ps(x_sigmoid(gv, one), uv); });
}

void geglu_row_avx2(const float* g, const float* u, float* y, std::int64_t n) {
  map2(g, u, y, n, [](__m256 gv, __m256 uv) { return _mm256_mul_ps(gelu_ps(gv, 0), uv); });
}

void gelu_row_avx2(const float* x, float* y, std::int64_t n, int kind) {
  if (kind == 0)
    map1(x, y, n, [](__m256 v) { return gelu_ps(v, 0); });
  else if (kind == 1)
    map1(x, y, n, [](__m256 v) { return gelu_ps(v, 1); });
  else
    map1(x, y, n, [](__m256 v) { return gelu_ps(v, 2); });
}

void add_row_avx2(const float* a, const float* b, float* y, std::int64_t n) {
  map2(a, b, y, n, [](__m256 u, __m256 v) { return _mm256_add_ps(u, v); });
}

void softmax_row_avx2(const float* x, float* y, std::int64_t n, float scale) {
  const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-__builtin_inff());
  const std::int64_t full = n / 8 * 8;
  const __m256i mt = tail_mask(n - full);
  __m256 vmax = ninf;
  for (std::int64_t i = 0; i < full; i += 8)
    vmax = _mm256_max_ps(vmax, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
  if (full < n) {
    const __m256 z = _mm256_mul_ps(_mm256_maskload_ps(x + full, mt), vs);
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(ninf, z, _mm256_castsi256_ps(mt)));
  }
  const float mx = avx2_hmax(vmax);
  if (mx == -__builtin_inff()) {
    map1(x, y, n, [](__m256) { return _mm256_setzero_ps(); });
    return;
  }
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (std::int64_t i = 0; i < full; i += 8) {
    const __m256 e = avx2_exp(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), vm));
    acc = _mm256_add_ps(acc, e);
    _mm256_storeu_ps(y + i, e);
  }
  if (full < n) {
    const __m256 z = _mm256_mul_ps(_mm256_maskload_ps(x + full, mt), vs);
    const __m256 e = _mm256_and_ps(avx2_exp(_mm256_sub_ps(z, vm)), _mm256_castsi256_ps(mt));
    acc = _mm256_add_ps(acc, e);
    _mm256_maskstore_ps(y + full, mt, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(acc));
  map1(y, y, n, [inv](__m256 v) { return _mm256_mul_ps(v, inv); });
}

void rope_token_avx2(const float* x, float* y, int heads, int head_dim, int rot, bool adjacent,
                     const float* cs, const float* sn) {
  for (int h = 0; h < heads; ++h) {
    const float* xh = x + static_cast<std::int64_t>(h) * head_dim;
    float* yh = y + static_cast<std::int64_t>(h) * head_dim;
    if (adjacent) {
      // [a0 b0 a1 b1 ..] -> [a c - b s, b c + a s, ..] (mul, mul, addsub as the scalar code)
      for (int i = 0; i < rot; i += 8) {
        const __m256 v = load_n(xh + i, rot - i);
        const __m256 sw = _mm256_permute_ps(v, 0xB1);
        store_n(yh + i, rot - i,
                _mm256_addsub_ps(_mm256_mul_ps(v, load_n(cs + i, rot - i)),
                                 _mm256_mul_ps(sw, load_n(sn + i, rot - i))));
      }
    } else {
      const int half = rot / 2;
      for (int i = 0; i < half; i += 8) {
        const int rem = half - i;
        const __m256 a = load_n(xh + i, rem), b = load_n(xh + i + half, rem);
        const __m256 c = load_n(cs + i, rem), s = load_n(sn + i, rem);
        store_n(yh + i, rem, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
        store_n(yh + i + half, rem, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
      }
    }
    if (yh != xh)
      for (int i = rot; i < head_dim; i += 8)
        store_n(yh + i, head_dim - i, load_n(xh + i, head_dim - i));
  }
}

}  // namespace troupe::kernels::cpu
