// AVX2 activation quantizer: the same operations as mm_quantize_block
// (max |x|, dx = amax / 127, t = x * (1 / dx), clamp, round half to even),
// so both paths write identical codes.
#include <immintrin.h>

#include "kernels/cpu/matmul_impl.hpp"

namespace troupe::kernels::cpu {

namespace {

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline std::int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

void quantize_full_block(const float* x, std::int8_t* q, std::int8_t* a, float* d,
                         std::int32_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
               v3 = _mm256_loadu_ps(x + 24);
  // max(|x|, acc) keeps acc when |x| is NaN, as std::max(acc, |x|) does.
  __m256 m = _mm256_setzero_ps();
  m = _mm256_max_ps(_mm256_andnot_ps(sign, v0), m);
  m = _mm256_max_ps(_mm256_andnot_ps(sign, v1), m);
  m = _mm256_max_ps(_mm256_andnot_ps(sign, v2), m);
  m = _mm256_max_ps(_mm256_andnot_ps(sign, v3), m);
  const float amax = hmax(m);
  const float dx = amax / 127.0f;
  const float id = dx != 0.0f ? 1.0f / dx : 0.0f;
  const __m256 idv = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  auto code = [&](__m256 v) {
    __m256 t = _mm256_mul_ps(v, idv);
    t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);  // NaN -> -127
    return _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  };
  const __m256i c0 = code(v0), c1 = code(v1), c2 = code(v2), c3 = code(v3);
  *s = hsum(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)));
  // Pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane).
  const __m256i w01 = _mm256_packs_epi32(c0, c1), w23 = _mm256_packs_epi32(c2, c3);
  __m256i b = _mm256_packs_epi16(w01, w23);
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), _mm256_abs_epi8(b));
  *d = dx;
}

}  // namespace

void mm_quantize_rows_avx2(const float* x, std::int64_t ldx, std::int64_t k, std::int64_t r0,
                           std::int64_t r1, std::int8_t* q, std::int8_t* a, float* d,
                           std::int32_t* s, std::int64_t kp) {
  const std::int64_t blocks = kp / 32;
  for (std::int64_t r = r0; r < r1; ++r) {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * ldx + b * 32;
      std::int8_t* qb = q + r * kp + b * 32;
      std::int8_t* ab = a + r * kp + b * 32;
      if (k - b * 32 >= 32)
        quantize_full_block(xb, qb, ab, d + r * blocks + b, s + r * blocks + b);
      else
        mm_quantize_block(xb, k - b * 32, qb, ab, d + r * blocks + b, s + r * blocks + b);
    }
  }
}

void mm_flip_codes_avx2(const std::int8_t* q, std::uint8_t* u, std::int64_t n) {
  const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80));
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(u + i),
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i)), top));
  for (; i < n; ++i) u[i] = static_cast<std::uint8_t>(static_cast<std::uint8_t>(q[i]) ^ 0x80u);
}

}  // namespace troupe::kernels::cpu
