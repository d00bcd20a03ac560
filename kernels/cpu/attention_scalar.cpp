// Portable attention kernels: the reference path and the fallback for head
// dimensions that are not a multiple of 8.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/cpu/attention_impl.hpp"
#include "kernels/half.hpp"

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

void qk_scalar(const tile_keys& t, int n_rows, const row_state* rows) {
  for (int r = 0; r < n_rows; ++r) {
    const float* q = rows[r].q;
    for (int j = t.lo; j < t.hi; ++j) {
      float dot = 0.0f;
      for (int c = 0; c < t.head_dim; ++c) dot += q[c] * load_elem(t.type, t.k[j], c);
      if (t.type == kv_elem::i8) dot *= t.k_scale[j];
      rows[r].s[j] = dot;
    }
  }
}

void softmax_pv_scalar(const tile_keys& t, int n_rows, const row_state* rows) {
  for (int r = 0; r < n_rows; ++r) {
    const row_state& row = rows[r];
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < key_tile; ++j) tile_max = std::fmax(tile_max, row.s[j]);
    const float m_old = *row.m;
    const float m_new = std::fmax(m_old, tile_max);
    if (m_new != m_old) {
      const float alpha = std::exp(m_old - m_new);
      for (int c = 0; c < t.head_dim; ++c) row.acc[c] *= alpha;
      for (int i = 0; i < lanes; ++i) row.lsum[i] *= alpha;
      *row.m = m_new;
    }
    for (int j = 0; j < key_tile; ++j) {
      const float p = std::exp(row.s[j] - m_new);
      row.s[j] = p;
      row.lsum[j % lanes] += p;
    }
    for (int j = t.lo; j < t.hi; ++j) {
      const float p = t.type == kv_elem::i8 ? row.s[j] * t.v_scale[j] : row.s[j];
      for (int c = 0; c < t.head_dim; ++c) row.acc[c] += p * load_elem(t.type, t.v[j], c);
    }
  }
}

void finish_scalar(int head_dim, const row_state& row, float* out) {
  const float* l = row.lsum;
  const float sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (int c = 0; c < head_dim; ++c) out[c] = row.acc[c] / sum;
}

void bound_scalar(int head_dim, int n_rows, const float* const* qpos, const float* const* qneg,
                  const int* set, int n_blocks, const float* const* summary, float* score) {
  for (int b = 0; b < n_blocks; ++b) {
    const float* mn = summary[b];
    const float* mx = summary[b] + head_dim;
    for (int r = 0; r < n_rows; ++r) {
      float sum = 0.0f;
      for (int c = 0; c < head_dim; ++c) sum += qpos[r][c] * mx[c] + qneg[r][c] * mn[c];
      float& best = score[static_cast<std::size_t>(set[r]) * n_blocks + b];
      best = std::fmax(best, sum);
    }
  }
}

}  // namespace

const tile_ops& scalar_ops() {
  static const tile_ops ops{qk_scalar, softmax_pv_scalar, finish_scalar, bound_scalar};
  return ops;
}

}  // namespace troupe::kernels::cpu::attn
