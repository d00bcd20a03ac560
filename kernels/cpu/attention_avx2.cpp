// AVX2 + FMA + F16C attention kernels (head_dim a multiple of 8). Every
// (row, key) dot product and every (row, lane) accumulation runs the same
// instruction sequence whichever rows share the call, so results are
// independent of how rows are grouped.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/attention_impl.hpp"
#include "kernels/cpu/attention_lanes8.hpp"
#include "kernels/cpu/avx2_math.hpp"

namespace troupe::kernels::cpu::attn {
namespace {

// Scores of R rows against KP keys per step: R*KP independent accumulators.
template <kv_elem T, int R, int KP>
void qk_rows(const tile_keys& t, const row_state* rows) {
  static_assert(R * KP <= 8);
  const int d = t.head_dim;
  for (int j0 = t.lo; j0 < t.hi; j0 += KP) {
    const void* k[KP];
    for (int kk = 0; kk < KP; ++kk) k[kk] = t.k[j0 + kk < t.hi ? j0 + kk : t.hi - 1];
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      __m256 kv[KP];
      for (int kk = 0; kk < KP; ++kk) kv[kk] = load8<T>(k[kk], c);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(rows[r].q + c);
        for (int kk = 0; kk < KP; ++kk)
          acc[r * KP + kk] = _mm256_fmadd_ps(qv, kv[kk], acc[r * KP + kk]);
      }
    }
    alignas(32) float dots[8];
    _mm256_store_ps(dots, reduce8(acc));
    store_scores<T>(t, rows, R, KP, j0, dots);
  }
}

template <kv_elem T>
void qk_typed(const tile_keys& t, int n_rows, const row_state* rows) {
  by_row_groups(n_rows, [&](auto g, int r) {
    constexpr int R = decltype(g)::value;
    qk_rows<T, R, per_rows(R, 1)>(t, rows + r);
  });
}

void qk_avx2(const tile_keys& t, int n_rows, const row_state* rows) {
  on_elem(t.type, [&](auto e) { qk_typed<decltype(e)::value>(t, n_rows, rows); });
}

// Softmax part for one row: rescale by the new maximum, s <- p (times the
// value scale for i8), lsum += p.
template <kv_elem T>
void softmax_row(const tile_keys& t, const row_state& row) {
  static_assert(key_tile == 32);
  __m256 s[4];
  for (int i = 0; i < 4; ++i) s[i] = _mm256_loadu_ps(row.s + 8 * i);
  const float tile_max =
      avx2_hmax(_mm256_max_ps(_mm256_max_ps(s[0], s[1]), _mm256_max_ps(s[2], s[3])));
  const float m_old = *row.m;
  const float m_new = m_old > tile_max ? m_old : tile_max;
  __m256 lsum = _mm256_loadu_ps(row.lsum);
  if (m_new != m_old) {
    const __m256 alpha = avx2_exp_fast(_mm256_set1_ps(m_old - m_new));
    for (int c = 0; c < t.head_dim; c += 8)
      _mm256_storeu_ps(row.acc + c, _mm256_mul_ps(_mm256_loadu_ps(row.acc + c), alpha));
    lsum = _mm256_mul_ps(lsum, alpha);
    *row.m = m_new;
  }
  const __m256 mv = _mm256_set1_ps(m_new);
  for (int i = 0; i < 4; ++i) {
    const __m256 p = avx2_exp_fast(_mm256_sub_ps(s[i], mv));
    lsum = _mm256_add_ps(lsum, p);
    if constexpr (T == kv_elem::i8) {
      _mm256_storeu_ps(row.s + 8 * i, _mm256_mul_ps(p, _mm256_loadu_ps(t.v_scale + 8 * i)));
    } else {
      _mm256_storeu_ps(row.s + 8 * i, p);
    }
  }
  _mm256_storeu_ps(row.lsum, lsum);
}

// acc_r += sum_j p_rj v_j for R rows, CH vectors of 8 channels at a time.
template <kv_elem T, int R, int CH>
void pv_rows(const tile_keys& t, const row_state* rows, int c_begin, int c_end) {
  for (int c0 = c_begin; c0 + 8 * CH <= c_end; c0 += 8 * CH) {
    __m256 acc[R][CH];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < CH; ++h) acc[r][h] = _mm256_loadu_ps(rows[r].acc + c0 + 8 * h);
    for (int j = t.lo; j < t.hi; ++j) {
      __m256 v[CH];
      for (int h = 0; h < CH; ++h) v[h] = load8<T>(t.v[j], c0 + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_broadcast_ss(rows[r].s + j);
        for (int h = 0; h < CH; ++h) acc[r][h] = _mm256_fmadd_ps(p, v[h], acc[r][h]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < CH; ++h) _mm256_storeu_ps(rows[r].acc + c0 + 8 * h, acc[r][h]);
  }
}

template <kv_elem T, int R, int CH>
void pv_all(const tile_keys& t, const row_state* rows) {
  const int d = t.head_dim;
  const int main_end = d - d % (8 * CH);
  pv_rows<T, R, CH>(t, rows, 0, main_end);
  pv_rows<T, R, 1>(t, rows, main_end, d);
}

template <kv_elem T>
void softmax_pv_typed(const tile_keys& t, int n_rows, const row_state* rows) {
  for (int r = 0; r < n_rows; ++r) softmax_row<T>(t, rows[r]);
  by_row_groups(n_rows, [&](auto g, int r) {
    constexpr int R = decltype(g)::value;
    pv_all<T, R, per_rows(R, 1)>(t, rows + r);
  });
}

void softmax_pv_avx2(const tile_keys& t, int n_rows, const row_state* rows) {
  on_elem(t.type, [&](auto e) { softmax_pv_typed<decltype(e)::value>(t, n_rows, rows); });
}

void finish_avx2(int head_dim, const row_state& row, float* out) {
  const __m256 sum = _mm256_set1_ps(hsum(_mm256_loadu_ps(row.lsum)));
  for (int c = 0; c < head_dim; c += 8)
    _mm256_storeu_ps(out + c, _mm256_div_ps(_mm256_loadu_ps(row.acc + c), sum));
}

// Bounds of NB blocks for R rows: one chain per (row, block), two FMAs per
// 8 channels (q+ * max, then q- * min).
template <int R, int NB>
void bound_rows(int head_dim, const float* const* qpos, const float* const* qneg, const int* set,
                int n_blocks, const float* const* summary, int b0, float* score) {
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NB; ++k) acc[r][k] = _mm256_setzero_ps();
  for (int c = 0; c < head_dim; c += 8) {
    __m256 mn[NB], mx[NB];
    for (int k = 0; k < NB; ++k) {
      mn[k] = _mm256_loadu_ps(summary[b0 + k] + c);
      mx[k] = _mm256_loadu_ps(summary[b0 + k] + head_dim + c);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 qp = _mm256_loadu_ps(qpos[r] + c);
      const __m256 qn = _mm256_loadu_ps(qneg[r] + c);
      for (int k = 0; k < NB; ++k) {
        acc[r][k] = _mm256_fmadd_ps(qp, mx[k], acc[r][k]);
        acc[r][k] = _mm256_fmadd_ps(qn, mn[k], acc[r][k]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < NB; ++k) {
      const float s = hsum(acc[r][k]);
      float& best = score[static_cast<long>(set[r]) * n_blocks + b0 + k];
      best = best > s ? best : s;
    }
  }
}

template <int NB>
void bound_blocks(int head_dim, int n_rows, const float* const* qpos, const float* const* qneg,
                  const int* set, int n_blocks, const float* const* summary, int b0, float* score) {
  int r = 0;
  for (; r + 4 <= n_rows; r += 4)
    bound_rows<4, NB>(head_dim, qpos + r, qneg + r, set + r, n_blocks, summary, b0, score);
  for (; r < n_rows; ++r)
    bound_rows<1, NB>(head_dim, qpos + r, qneg + r, set + r, n_blocks, summary, b0, score);
}

void bound_avx2(int head_dim, int n_rows, const float* const* qpos, const float* const* qneg,
                const int* set, int n_blocks, const float* const* summary, float* score) {
  int b = 0;
  for (; b + 2 <= n_blocks; b += 2) {
    // The summaries of a sequence's blocks are scattered: fetch the next pair.
    for (int k = b + 2; k < b + 4 && k < n_blocks; ++k)
      for (int c = 0; c < 2 * head_dim; c += 16)
        _mm_prefetch(reinterpret_cast<const char*>(summary[k] + c), _MM_HINT_T0);
    bound_blocks<2>(head_dim, n_rows, qpos, qneg, set, n_blocks, summary, b, score);
  }
  if (b < n_blocks) bound_blocks<1>(head_dim, n_rows, qpos, qneg, set, n_blocks, summary, b, score);
}

}  // namespace

const tile_ops& avx2_ops() {
  static const tile_ops ops{qk_avx2, softmax_pv_avx2, finish_avx2, bound_avx2};
  return ops;
}

}  // namespace troupe::kernels::cpu::attn
