// Portable attention kernels: the reference path and the fallback for head
// dimensions that are not a multiple of 8. Each computes what the AVX2
// kernels compute, rounding by rounding (kernels/cpu/lane_math.hpp), so the
// instruction set never changes the bits.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/cpu/attention_impl.hpp"
#include "kernels/cpu/lane_math.hpp"
#include "kernels/half.hpp"

#pragma GCC optimize("fp-contract=off")

namespace troupe::kernels::cpu::attn {
namespace {

float load_elem(kv_elem type, const void* row, int c) {
  switch (type) {
    case kv_elem::f32:
      return static_cast<const float*>(row)[c];
    case kv_elem::f16:
      return to_f32(static_cast<const f16*>(row)[c]);
    case kv_elem::i8:
      return static_cast<float>(static_cast<const std::int8_t*>(row)[c]);
  }
  return 0.0f;
}

// Eight lanes of a dot product over the row (lane l takes channels c with
// c % 8 == l, fused as vfmadd), then the vector path's sum of the lanes:
// ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) (reduce8 / hsum in attention_avx2.cpp).
float lanes_sum(const float* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

void qk_scalar(const tile_keys& t, int n_rows, const row_state* rows) {
  for (int r = 0; r < n_rows; ++r) {
    const float* q = rows[r].q;
    for (int j = t.lo; j < t.hi; ++j) {
      float l[8] = {};
      for (int c = 0; c < t.head_dim; ++c)
        l[c % 8] = std::fma(q[c], load_elem(t.type, t.k[j], c), l[c % 8]);
      float dot = lanes_sum(l);
      if (t.type == kv_elem::i8) dot *= t.k_scale[j];
      rows[r].s[j] = dot;
    }
  }
}

// The online softmax as softmax_row (attention_avx2.cpp) computes it: the
// tile's maximum, alpha = e^(m_old - m_new) and p = e^(s - m_new) by the
// vector path's exponential (lane::exp_fast), lane j % 8 of the
// denominators summing p in key order, p times the value scale (i8), and
// the values accumulated with fused multiply-adds in key order.
void softmax_pv_scalar(const tile_keys& t, int n_rows, const row_state* rows) {
  for (int r = 0; r < n_rows; ++r) {
    const row_state& row = rows[r];
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < key_tile; ++j) tile_max = tile_max > row.s[j] ? tile_max : row.s[j];
    const float m_old = *row.m;
    const float m_new = m_old > tile_max ? m_old : tile_max;
    if (m_new != m_old) {
      const float alpha = lane::exp_fast(m_old - m_new);
      for (int c = 0; c < t.head_dim; ++c) row.acc[c] *= alpha;
      for (int i = 0; i < lanes; ++i) row.lsum[i] *= alpha;
      *row.m = m_new;
    }
    for (int j = 0; j < key_tile; ++j) {
      const float p = lane::exp_fast(row.s[j] - m_new);
      row.lsum[j % lanes] += p;
      row.s[j] = t.type == kv_elem::i8 ? p * t.v_scale[j] : p;
    }
    for (int j = t.lo; j < t.hi; ++j) {
      const float p = row.s[j];
      for (int c = 0; c < t.head_dim; ++c)
        row.acc[c] = std::fma(p, load_elem(t.type, t.v[j], c), row.acc[c]);
    }
  }
}

void finish_scalar(int head_dim, const row_state& row, float* out) {
  const float sum = lanes_sum(row.lsum);
  for (int c = 0; c < head_dim; ++c) out[c] = row.acc[c] / sum;
}

void bound_scalar(int head_dim, int n_rows, const float* const* qpos, const float* const* qneg,
                  const int* set, int n_blocks, const float* const* summary, float* score) {
  for (int b = 0; b < n_blocks; ++b) {
    const float* mn = summary[b];
    const float* mx = summary[b] + head_dim;
    for (int r = 0; r < n_rows; ++r) {
      float l[8] = {};
      for (int c = 0; c < head_dim; ++c) {
        l[c % 8] = std::fma(qpos[r][c], mx[c], l[c % 8]);
        l[c % 8] = std::fma(qneg[r][c], mn[c], l[c % 8]);
      }
      const float sum = lanes_sum(l);
      float& best = score[static_cast<std::size_t>(set[r]) * n_blocks + b];
      best = best > sum ? best : sum;
    }
  }
}

}  // namespace

const tile_ops& scalar_ops() {
  static const tile_ops ops{qk_scalar, softmax_pv_scalar, finish_scalar, bound_scalar};
  return ops;
}

}  // namespace troupe::kernels::cpu::attn
