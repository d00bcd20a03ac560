// AVX-512 attention kernels (head_dim a multiple of 8): attention_avx2.cpp's
// arithmetic on zmm, with the same bits.
//  - q.k: a (row, key) dot keeps AVX2's eight lanes (lane l sums channels l,
//    l + 8, ... in order, then the same reduction tree); a zmm holds two of
//    them, two keys side by side against the query broadcast to both halves.
//  - softmax: the scores' exponentials on sixteen lanes; the eight-lane
//    denominator still adds them eight at a time, in AVX2's order.
//  - p.v and the final division: one chain per channel, sixteen channels per
//    zmm (eight for a last odd group).
// The block bound of sparse attention stays AVX2's.
// GCC 12's avx512fintrin.h builds some results from _mm512_undefined_*()
// and then warns that they may be used uninitialized (a false positive in
// the header, not in this code).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/attention_impl.hpp"
#include "kernels/cpu/attention_lanes8.hpp"
#include "kernels/cpu/avx512_math.hpp"

namespace troupe::kernels::cpu::attn {
namespace {

// Channels c..c+7 of two rows, a in the low half and b in the high one.
template <kv_elem T>
inline __m512 load8x2(const void* a, const void* b, int c) {
  if constexpr (T == kv_elem::f32) {
    const __m256 lo = _mm256_loadu_ps(static_cast<const float*>(a) + c);
    const __m256 hi = _mm256_loadu_ps(static_cast<const float*>(b) + c);
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
  } else if constexpr (T == kv_elem::f16) {
    const __m128i lo =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(a) + c));
    const __m128i hi =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(b) + c));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
  } else {
    const __m128i lo =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const std::int8_t*>(a) + c));
    const __m128i hi =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const std::int8_t*>(b) + c));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(lo, hi)));
  }
}

// Sixteen channels of one row (eight: load8, attention_lanes8.hpp).
template <kv_elem T>
inline __m512 load16(const void* row, int c) {
  if constexpr (T == kv_elem::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(row) + c);
  } else if constexpr (T == kv_elem::f16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(row) + c)));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const std::int8_t*>(row) + c))));
  }
}
// Scores of R rows against KP keys (KP even) per step: R*KP/2 zmm of two
// eight-lane accumulators each.
template <kv_elem T, int R, int KP>
void qk_rows(const tile_keys& t, const row_state* rows) {
  static_assert(KP % 2 == 0 && R * KP <= 16);
  constexpr int NZ = R * KP / 2;
  const int d = t.head_dim;
  for (int j0 = t.lo; j0 < t.hi; j0 += KP) {
    const void* k[KP];
    for (int kk = 0; kk < KP; ++kk) k[kk] = t.k[j0 + kk < t.hi ? j0 + kk : t.hi - 1];
    __m512 acc[NZ];
    for (int i = 0; i < NZ; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      __m512 kv[KP / 2];
      for (int kk = 0; kk < KP / 2; ++kk) kv[kk] = load8x2<T>(k[2 * kk], k[2 * kk + 1], c);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(rows[r].q + c));
        for (int kk = 0; kk < KP / 2; ++kk)
          acc[r * KP / 2 + kk] = _mm512_fmadd_ps(qv, kv[kk], acc[r * KP / 2 + kk]);
      }
    }
    // Accumulator of (r, kk) = half kk % 2 of zmm r * KP / 2 + kk / 2.
    __m256 lanes8[16];
    for (int i = 0; i < NZ; ++i) {
      lanes8[2 * i] = _mm512_castps512_ps256(acc[i]);
      lanes8[2 * i + 1] = _mm512_extractf32x8_ps(acc[i], 1);
    }
    for (int i = 2 * NZ; i < 16; ++i) lanes8[i] = _mm256_setzero_ps();
    alignas(32) float dots[16];
    _mm256_store_ps(dots, reduce8(lanes8));
    if constexpr (2 * NZ > 8) _mm256_store_ps(dots + 8, reduce8(lanes8 + 8));
    store_scores<T>(t, rows, R, KP, j0, dots);
  }
}

template <kv_elem T>
void qk_typed(const tile_keys& t, int n_rows, const row_state* rows) {
  by_row_groups(n_rows, [&](auto g, int r) {
    constexpr int R = decltype(g)::value;
    qk_rows<T, R, per_rows(R, 2)>(t, rows + r);
  });
}

void qk_avx512(const tile_keys& t, int n_rows, const row_state* rows) {
  on_elem(t.type, [&](auto e) { qk_typed<decltype(e)::value>(t, n_rows, rows); });
}

inline float hmax16(__m512 v) {
  return avx2_hmax(_mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

// attention_avx2.cpp's softmax_row.
template <kv_elem T>
void softmax_row(const tile_keys& t, const row_state& row) {
  static_assert(key_tile == 32);
  const __m512 s0 = _mm512_loadu_ps(row.s), s1 = _mm512_loadu_ps(row.s + 16);
  const float tile_max = hmax16(_mm512_max_ps(s0, s1));
  const float m_old = *row.m;
  const float m_new = m_old > tile_max ? m_old : tile_max;
  __m256 lsum = _mm256_loadu_ps(row.lsum);
  if (m_new != m_old) {
    const __m512 alpha = avx512_exp_fast(_mm512_set1_ps(m_old - m_new));
    int c = 0;
    for (; c + 16 <= t.head_dim; c += 16)
      _mm512_storeu_ps(row.acc + c, _mm512_mul_ps(_mm512_loadu_ps(row.acc + c), alpha));
    if (c < t.head_dim)
      _mm256_storeu_ps(row.acc + c,
                       _mm256_mul_ps(_mm256_loadu_ps(row.acc + c), _mm512_castps512_ps256(alpha)));
    lsum = _mm256_mul_ps(lsum, _mm512_castps512_ps256(alpha));
    *row.m = m_new;
  }
  const __m512 mv = _mm512_set1_ps(m_new);
  const __m512 p0 = avx512_exp_fast(_mm512_sub_ps(s0, mv));
  const __m512 p1 = avx512_exp_fast(_mm512_sub_ps(s1, mv));
  lsum = _mm256_add_ps(lsum, _mm512_castps512_ps256(p0));
  lsum = _mm256_add_ps(lsum, _mm512_extractf32x8_ps(p0, 1));
  lsum = _mm256_add_ps(lsum, _mm512_castps512_ps256(p1));
  lsum = _mm256_add_ps(lsum, _mm512_extractf32x8_ps(p1, 1));
  if constexpr (T == kv_elem::i8) {
    _mm512_storeu_ps(row.s, _mm512_mul_ps(p0, _mm512_loadu_ps(t.v_scale)));
    _mm512_storeu_ps(row.s + 16, _mm512_mul_ps(p1, _mm512_loadu_ps(t.v_scale + 16)));
  } else {
    _mm512_storeu_ps(row.s, p0);
    _mm512_storeu_ps(row.s + 16, p1);
  }
  _mm256_storeu_ps(row.lsum, lsum);
}

// acc_r += sum_j p_rj v_j for R rows, CH zmm of sixteen channels at a time.
template <kv_elem T, int R, int CH>
void pv_rows(const tile_keys& t, const row_state* rows, int c_begin, int c_end) {
  for (int c0 = c_begin; c0 + 16 * CH <= c_end; c0 += 16 * CH) {
    __m512 acc[R][CH];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < CH; ++h) acc[r][h] = _mm512_loadu_ps(rows[r].acc + c0 + 16 * h);
    for (int j = t.lo; j < t.hi; ++j) {
      __m512 v[CH];
      for (int h = 0; h < CH; ++h) v[h] = load16<T>(t.v[j], c0 + 16 * h);
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(rows[r].s[j]);
        for (int h = 0; h < CH; ++h) acc[r][h] = _mm512_fmadd_ps(p, v[h], acc[r][h]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < CH; ++h) _mm512_storeu_ps(rows[r].acc + c0 + 16 * h, acc[r][h]);
  }
}

// The last eight channels of a head_dim that is an odd multiple of 8.
template <kv_elem T, int R>
void pv_rows8(const tile_keys& t, const row_state* rows, int c0) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_loadu_ps(rows[r].acc + c0);
  for (int j = t.lo; j < t.hi; ++j) {
    const __m256 v = load8<T>(t.v[j], c0);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(rows[r].s[j]), v, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(rows[r].acc + c0, acc[r]);
}

template <kv_elem T, int R, int CH>
void pv_all(const tile_keys& t, const row_state* rows) {
  const int d = t.head_dim;
  const int main_end = d - d % (16 * CH);
  pv_rows<T, R, CH>(t, rows, 0, main_end);
  pv_rows<T, R, 1>(t, rows, main_end, d);
  if (d % 16) pv_rows8<T, R>(t, rows, d - 8);
}

template <kv_elem T>
void softmax_pv_typed(const tile_keys& t, int n_rows, const row_state* rows) {
  for (int r = 0; r < n_rows; ++r) softmax_row<T>(t, rows[r]);
  by_row_groups(n_rows, [&](auto g, int r) {
    constexpr int R = decltype(g)::value;
    pv_all<T, R, per_rows(R, 1)>(t, rows + r);
  });
}

void softmax_pv_avx512(const tile_keys& t, int n_rows, const row_state* rows) {
  on_elem(t.type, [&](auto e) { softmax_pv_typed<decltype(e)::value>(t, n_rows, rows); });
}

// attention_avx2.cpp's finish: the same sum of the eight lanes, then one
// division per channel.
void finish_avx512(int head_dim, const row_state& row, float* out) {
  const __m512 sum = _mm512_set1_ps(hsum(_mm256_loadu_ps(row.lsum)));
  int c = 0;
  for (; c + 16 <= head_dim; c += 16)
    _mm512_storeu_ps(out + c, _mm512_div_ps(_mm512_loadu_ps(row.acc + c), sum));
  if (c < head_dim)
    _mm256_storeu_ps(out + c,
                     _mm256_div_ps(_mm256_loadu_ps(row.acc + c), _mm512_castps512_ps256(sum)));
}

}  // namespace

const tile_ops& avx512_ops() {
  static const tile_ops ops{qk_avx512, softmax_pv_avx512, finish_avx512, avx2_ops().bound};
  return ops;
}

}  // namespace troupe::kernels::cpu::attn
