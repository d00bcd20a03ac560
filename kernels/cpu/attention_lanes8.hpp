#pragma once
// The eight-lane pieces of the attention kernels that AVX2's and AVX-512's
// share (attention_avx2.cpp, attention_avx512.cpp): loading eight channels
// of a key or value row, and the fixed reduction tree of the eight-lane dot
// products. Include only from files built with AVX2 (or wider) flags;
// internal linkage, as in avx2_math.hpp.

#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/attention_impl.hpp"

namespace troupe::kernels::cpu::attn {
namespace {

template <kv_elem T>
inline __m256 load8(const void* row, int c) {
  if constexpr (T == kv_elem::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + c);
  } else if constexpr (T == kv_elem::f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(row) + c)));
  } else {
    const __m128i b =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const std::int8_t*>(row) + c));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}

// ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)) of each of a[0..7], in one vector.
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The same tree for one vector.
inline float hsum(__m256 x) {
  __m256 t = _mm256_hadd_ps(x, x);
  t = _mm256_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

// Scores of keys j0 .. j0+KP-1 (those below t.hi) for R rows from their
// dots (row r, key kk at dots[r * KP + kk]), times the key scales for i8.
template <kv_elem T>
inline void store_scores(const tile_keys& t, const row_state* rows, int R, int KP, int j0,
                         const float* dots) {
  for (int r = 0; r < R; ++r) {
    for (int kk = 0; kk < KP && j0 + kk < t.hi; ++kk) {
      float s = dots[r * KP + kk];
      if constexpr (T == kv_elem::i8) s *= t.k_scale[j0 + kk];
      rows[r].s[j0 + kk] = s;
    }
  }
}

}  // namespace
}  // namespace troupe::kernels::cpu::attn
