#pragma once
// Internal interface between the attention driver (attention.cpp) and its
// ISA kernels (attention_scalar.cpp, attention_avx2.cpp). Plain structs and
// functions only, so the AVX2 file instantiates no library templates.

#include <cstdint>

namespace troupe::kernels::cpu::attn {

constexpr int key_tile = 32;  ///< keys per tile; tiles start at multiples of it
constexpr int max_rows = 4;   ///< rows a kernel call processes together
constexpr int lanes = 8;      ///< partial sums kept per row for the softmax denominator

enum class kv_elem : std::uint8_t { f32, f16, i8 };

/// An element type as a type, for the ISA files' templates on it.
template <kv_elem T>
struct elem_tag {
  static constexpr kv_elem value = T;
};
/// Calls f(elem_tag<t>{}).
template <class F>
inline void on_elem(kv_elem t, F&& f) {
  switch (t) {
    case kv_elem::f32:
      f(elem_tag<kv_elem::f32>{});
      break;
    case kv_elem::f16:
      f(elem_tag<kv_elem::f16>{});
      break;
    case kv_elem::i8:
      f(elem_tag<kv_elem::i8>{});
      break;
  }
}

/// Keys [lo, hi) of one tile as seen by one KV head.
struct tile_keys {
  kv_elem type = kv_elem::f32;
  int head_dim = 0;
  int lo = 0, hi = 0;
  const void* const* k = nullptr;  ///< [key_tile] key rows, valid in [lo, hi)
  const void* const* v = nullptr;  ///< [key_tile] value rows
  const float* k_scale = nullptr;  ///< [key_tile] (i8)
  const float* v_scale = nullptr;  ///< [key_tile] (i8)
};

/// State of one query row.
struct row_state {
  const float* q = nullptr;  ///< query times scale [head_dim]
  float* acc = nullptr;      ///< unnormalised output [head_dim]
  float* lsum = nullptr;     ///< [lanes] partial softmax denominators
  float* m = nullptr;        ///< running maximum score
  float* s = nullptr;        ///< [key_tile] scores of the current tile
};

/// A group of R rows as a type, for the ISA files' templates on R.
template <int R>
struct rows_tag {
  static constexpr int value = R;
};
/// Calls f(rows_tag<R>{}, first) over n_rows rows
/// in groups of 4 and a last group of 1-3: every row's arithmetic is the
/// same whichever group it lands in.
template <class F>
inline void by_row_groups(int n_rows, F&& f) {
  int r = 0;
  for (; r + 4 <= n_rows; r += 4) f(rows_tag<4>{}, r);
  switch (n_rows - r) {
    case 3:
      f(rows_tag<3>{}, r);
      break;
    case 2:
      f(rows_tag<2>{}, r);
      break;
    case 1:
      f(rows_tag<1>{}, r);
      break;
    default:
      break;
  }
}
/// Per step: keys (q.k) or vector groups (p.v) next to R rows, so that a
/// call holds about 8 accumulators (x `width` vectors of eight lanes).
constexpr int per_rows(int r, int width) {
  return (r == 3 ? 2 : 8 / r) * width;
}

/// One ISA's kernels. Each row's arithmetic depends only on its own data, the
/// tile and its own mask, never on the other rows of the call.
struct tile_ops {
  /// s[j] = q.k_j (times k_scale for i8) for j in [lo, hi).
  void (*qk)(const tile_keys& t, int n_rows, const row_state* rows);
  /// Online softmax update with the tile's scores (entries outside the row's
  /// mask are -inf; at least one is finite): m, lsum, acc.
  void (*softmax_pv)(const tile_keys& t, int n_rows, const row_state* rows);
  /// out = acc / sum(lsum).
  void (*finish)(int head_dim, const row_state& row, float* out);
  /// score[set[r] * n_blocks + b] = max(itself, sum_c qpos_r,c*max_b,c + qneg_r,c*min_b,c)
  /// for every row r, where summary[b] points to [2][head_dim] (min row, then
  /// max row). Each (row, block) sum is computed the same way whatever the
  /// other rows and blocks of the call.
  void (*bound)(int head_dim, int n_rows, const float* const* qpos, const float* const* qneg,
                const int* set, int n_blocks, const float* const* summary, float* score);
};

const tile_ops& scalar_ops();
const tile_ops& avx2_ops();
/// AVX-512 (attention_avx512.cpp): avx2_ops' bits.
const tile_ops& avx512_ops();

}  // namespace troupe::kernels::cpu::attn
