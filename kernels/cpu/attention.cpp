// Attention driver: validation, work split, per-row key sets (causal,
// window + sinks, sparse block selection), key tiles and ISA dispatch.
//
// Determinism: a row's keys are visited in tiles of key_tile keys starting at
// multiples of key_tile (absolute key positions); inside a tile the row sees
// the keys of its own mask. The kernels compute each row independently of the
// rows that share a call, so the output of a row depends only on its query,
// its mask and the cache, never on the batch, the chunking or the threads.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/cpu/attention_impl.hpp"

namespace troupe::kernels {
namespace {

using cpu::attn::key_tile;
using cpu::attn::kv_elem;
using cpu::attn::row_state;
using cpu::attn::tile_keys;
using cpu::attn::tile_ops;

// Query rows (positions x heads of a group) per work item: the rows of an
// item share each key tile while it is in cache, so larger items read K/V
// fewer times; their state (q, acc) must stay in L2.
constexpr std::int64_t max_rows_per_item = 256;
constexpr std::int64_t min_rows_per_item = 32;

// Where the keys and values of a KV head live.
struct kv_source {
  kv_elem type = kv_elem::f32;
  std::int64_t block_size = 1;
  int n_kv_heads = 1;
  int head_dim = 0;
  const std::byte* k = nullptr;
  const std::byte* v = nullptr;
  std::size_t block_stride = 0, head_stride = 0, token_stride = 0;  // bytes
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  std::size_t scale_block_stride = 0, scale_head_stride = 0;  // elements
  const float* summary = nullptr;                             // [blocks][heads][2][head_dim]
};

struct seq_view {
  const float* q = nullptr;
  float* out = nullptr;
  std::int64_t n_q = 0;
  int n_heads = 0;
  std::int64_t q_start = 0;
  std::int64_t kv_len = 0;
  const std::int32_t* table = nullptr;
};

struct resolved_options {
  bool causal = true;
  float scale = 1.0f;
  float softcap = 0.0f;
  std::int64_t window = 0;
  std::int64_t sinks = 0;
  std::int64_t top_k = -1;
  std::int64_t query_block = 1;
  bool sparse() const { return top_k >= 0; }
};

struct work_item {
  int seq = 0;
  int kv_head = 0;
  std::int64_t row_begin = 0, row_end = 0;
  double cost = 0;
};

struct interval {
  std::int64_t lo, hi;
};

// Per-thread scratch, reused across calls.
struct scratch {
  std::vector<float> qs, acc, lsum, m, s, qpos, qneg, bound;
  std::vector<interval> ivals;
  std::vector<std::size_t> ival_begin, cursor;
  std::vector<std::uint32_t> mask;
  std::vector<std::uint8_t> tile_used;
  std::vector<std::int64_t> sel, cand, set_end, set_b1;
  std::vector<std::size_t> sel_begin;
  std::vector<int> row_set;
  std::vector<const float*> qpos_ptr, qneg_ptr, summ_ptr;
  std::vector<row_state> states;
};

scratch& thread_scratch() {
  thread_local scratch s;
  return s;
}

const tile_ops& ops_for(const cpu::context& ctx, int head_dim) {
  const cpu::isa level = cpu::effective_isa(ctx.level(), cpu::isa::avx512);
  if (head_dim % 8 != 0 || level < cpu::isa::avx2) return cpu::attn::scalar_ops();
  return level >= cpu::isa::avx512 ? cpu::attn::avx512_ops() : cpu::attn::avx2_ops();
}

std::string str(std::int64_t v) {
  return std::to_string(v);
}

result<resolved_options> resolve(const attention_options& o, int head_dim) {
  if (!std::isfinite(o.scale) || o.scale < 0.0f)
    return make_error(errc::invalid_argument,
                      "attention scale must be finite and >= 0 (0 = 1/sqrt(d))");
  if (!std::isfinite(o.softcap) || o.softcap < 0.0f)
    return make_error(errc::invalid_argument,
                      "attention softcap must be finite and >= 0 (0 = off)");
  if (o.window < 0)
    return make_error(errc::invalid_argument,
                      "attention window must be >= 0, got " + str(o.window));
  if (o.sinks < 0)
    return make_error(errc::invalid_argument, "attention sinks must be >= 0, got " + str(o.sinks));
  if (o.sinks > 0 && o.window == 0)
    return make_error(errc::invalid_argument, "attention sinks need a window (window > 0)");
  if (o.window > 0 && !o.causal)
    return make_error(errc::invalid_argument, "a sliding window needs causal attention");
  if (o.top_k < -1)
    return make_error(errc::invalid_argument, "attention top_k must be >= -1, got " + str(o.top_k));
  if (o.query_block < 1)
    return make_error(errc::invalid_argument,
                      "attention query_block must be >= 1, got " + str(o.query_block));
  if (o.top_k >= 0 && !o.causal)
    return make_error(errc::invalid_argument,
                      "sparse attention (top_k >= 0) needs causal attention");
  if (o.top_k >= 0 && o.window == 0)
    return make_error(errc::invalid_argument, "sparse attention (top_k >= 0) needs a window >= 1");
  resolved_options r;
  r.causal = o.causal;
  r.scale = o.scale > 0.0f ? o.scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  r.softcap = o.softcap;
  r.window = o.window;
  r.sinks = o.sinks;
  r.top_k = o.top_k;
  r.query_block = o.top_k >= 0 ? o.query_block : 1;
  return r;
}

// Keys of KV block `b` of a sequence with table `table`: byte offset of slot 0.
inline std::size_t block_base(const kv_source& kv, const seq_view& sq, std::int64_t b, int head) {
  return static_cast<std::size_t>(sq.table[b]) * kv.block_stride +
         static_cast<std::size_t>(head) * kv.head_stride;
}

// Sparse block selection for the query blocks ("sets": positions aligned to
// multiples of query_block) of rows [row_begin, row_end) of `sq`. `q_rows`
// holds the pre-scaled queries of those rows, `group` heads per position.
// The summaries are read once for all sets. On return the sorted blocks of
// set k are sc.sel[sc.sel_begin[k] .. sc.sel_begin[k+1]) and its rows end at
// row_begin + sc.set_end[k].
void select_sets(const kv_source& kv, const seq_view& sq, const resolved_options& o,
                 const tile_ops& ops, int kv_head, int group, std::int64_t row_begin,
                 std::int64_t row_end, const float* q_rows, scratch& sc) {
  const int d = kv.head_dim;
  const auto ud = static_cast<std::size_t>(d);
  const std::int64_t n_pos = row_end - row_begin;
  sc.set_end.clear();
  for (std::int64_t i = 0; i < n_pos;) {
    const std::int64_t p = sq.q_start + row_begin + i;
    i = std::min(n_pos, i + (o.query_block - p % o.query_block));
    sc.set_end.push_back(i);
  }
  const std::size_t n_sets = sc.set_end.size();
  const std::int64_t b0 = o.sinks / kv.block_size;
  sc.set_b1.resize(n_sets);
  std::int64_t b_max = b0;
  std::int64_t n_rows = 0;
  for (std::size_t k = 0; k < n_sets; ++k) {
    const std::int64_t ws = sq.q_start + row_begin + sc.set_end[k] - o.window;
    sc.set_b1[k] = ws > o.sinks && o.top_k > 0 ? (ws + kv.block_size - 1) / kv.block_size : b0;
    if (sc.set_b1[k] - b0 > o.top_k) {
      b_max = std::max(b_max, sc.set_b1[k]);
      n_rows += (sc.set_end[k] - (k ? sc.set_end[k - 1] : 0)) * group;
    }
  }
  const std::int64_t n_cand = b_max - b0;
  if (n_rows > 0) {
    sc.qpos.resize(static_cast<std::size_t>(n_rows) * ud);
    sc.qneg.resize(sc.qpos.size());
    sc.qpos_ptr.clear();
    sc.qneg_ptr.clear();
    sc.row_set.clear();
    for (std::size_t k = 0; k < n_sets; ++k) {
      if (sc.set_b1[k] - b0 <= o.top_k) continue;
      for (std::int64_t r = (k ? sc.set_end[k - 1] : 0) * group; r < sc.set_end[k] * group; ++r) {
        float* qp = sc.qpos.data() + sc.qpos_ptr.size() * ud;
        float* qn = sc.qneg.data() + sc.qneg_ptr.size() * ud;
        for (int c = 0; c < d; ++c) {
          const float x = q_rows[static_cast<std::size_t>(r) * ud + static_cast<std::size_t>(c)];
          qp[c] = x > 0.0f ? x : 0.0f;
          qn[c] = x < 0.0f ? x : 0.0f;
        }
        sc.qpos_ptr.push_back(qp);
        sc.qneg_ptr.push_back(qn);
        sc.row_set.push_back(static_cast<int>(k));
      }
    }
    sc.summ_ptr.resize(static_cast<std::size_t>(n_cand));
    for (std::int64_t i = 0; i < n_cand; ++i) {
      const std::size_t blk = static_cast<std::size_t>(sq.table[b0 + i]);
      sc.summ_ptr[static_cast<std::size_t>(i)] =
          kv.summary +
          (blk * static_cast<std::size_t>(kv.n_kv_heads) + static_cast<std::size_t>(kv_head)) * 2 *
              ud;
    }
    sc.bound.assign(n_sets * static_cast<std::size_t>(n_cand),
                    -std::numeric_limits<float>::infinity());
    ops.bound(d, static_cast<int>(n_rows), sc.qpos_ptr.data(), sc.qneg_ptr.data(),
              sc.row_set.data(), static_cast<int>(n_cand), sc.summ_ptr.data(), sc.bound.data());
  }
  sc.sel.clear();
  sc.sel_begin.assign(n_sets + 1, 0);
  for (std::size_t k = 0; k < n_sets; ++k) {
    sc.sel_begin[k] = sc.sel.size();
    const std::int64_t n_k = sc.set_b1[k] - b0;
    if (n_k <= o.top_k) {
      for (std::int64_t b = b0; b < sc.set_b1[k]; ++b) sc.sel.push_back(b);
      continue;
    }
    float* score = sc.bound.data() + k * static_cast<std::size_t>(n_cand);
    for (std::int64_t i = 0; i < n_k; ++i)
      if (std::isnan(score[i])) score[i] = -std::numeric_limits<float>::infinity();
    sc.cand.resize(static_cast<std::size_t>(n_k));
    std::iota(sc.cand.begin(), sc.cand.end(), std::int64_t{0});
    auto better = [score](std::int64_t a, std::int64_t b) {
      return score[a] > score[b] || (score[a] == score[b] && a < b);
    };
    std::nth_element(sc.cand.begin(), sc.cand.begin() + o.top_k, sc.cand.end(), better);
    for (std::int64_t i = 0; i < o.top_k; ++i)
      sc.sel.push_back(b0 + sc.cand[static_cast<std::size_t>(i)]);
    std::sort(sc.sel.begin() + static_cast<std::ptrdiff_t>(sc.sel_begin[k]), sc.sel.end());
  }
  sc.sel_begin[n_sets] = sc.sel.size();
}

void push_interval(std::vector<interval>& iv, std::size_t first, std::int64_t lo, std::int64_t hi) {
  if (lo >= hi) return;
  if (iv.size() > first && lo <= iv.back().hi) {
    iv.back().hi = std::max(iv.back().hi, hi);
  } else {
    iv.push_back({lo, hi});
  }
}

// Appends the sorted, disjoint key intervals row position p may see.
void row_intervals(const kv_source& kv, const seq_view& sq, const resolved_options& o,
                   std::int64_t p, std::span<const std::int64_t> selected,
                   std::vector<interval>& iv) {
  const std::size_t first = iv.size();
  if (!o.causal) {
    push_interval(iv, first, 0, sq.kv_len);
    return;
  }
  if (o.window == 0) {
    push_interval(iv, first, 0, p + 1);
    return;
  }
  const std::int64_t ws = std::max<std::int64_t>(0, p + 1 - o.window);
  push_interval(iv, first, 0, std::min(o.sinks, p + 1));
  for (std::int64_t b : selected)
    push_interval(iv, first, std::max(b * kv.block_size, o.sinks),
                  std::min((b + 1) * kv.block_size, ws));
  push_interval(iv, first, ws, p + 1);
}

// Asks for the K and V rows of the keys in `mask` of tile `t` ahead of use:
// the blocks of a sequence are scattered, which defeats the hardware
// prefetcher.
void prefetch_keys(const kv_source& kv, const seq_view& sq, int head, std::int64_t t,
                   std::uint32_t mask) {
  const std::size_t row_bytes =
      static_cast<std::size_t>(kv.head_dim) *
      (kv.type == kv_elem::f32 ? 4u : (kv.type == kv_elem::f16 ? 2u : 1u));
  while (mask != 0) {
    const std::int64_t pos = t * key_tile + std::countr_zero(mask);
    mask &= mask - 1;
    const std::size_t off = block_base(kv, sq, pos / kv.block_size, head) +
                            static_cast<std::size_t>(pos % kv.block_size) * kv.token_stride;
    for (std::size_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(kv.k + off + b, 0, 2);
      __builtin_prefetch(kv.v + off + b, 0, 2);
    }
  }
}

inline std::uint32_t bits(int lo, int hi) {
  const int n = hi - lo;
  return n >= 32 ? ~0u : ((1u << n) - 1u) << lo;
}

void run_item(const kv_source& kv, const seq_view& sq, const resolved_options& o,
              const tile_ops& ops, const work_item& it, scratch& sc) {
  const int d = kv.head_dim;
  const int group = sq.n_heads / kv.n_kv_heads;
  const std::int64_t n_pos = it.row_end - it.row_begin;
  const std::int64_t n_rows = n_pos * group;
  const auto ud = static_cast<std::size_t>(d);
  const auto un = static_cast<std::size_t>(n_rows);
  sc.qs.resize(un * ud);
  sc.acc.assign(un * ud, 0.0f);
  sc.lsum.assign(un * cpu::attn::lanes, 0.0f);
  sc.m.assign(un, -std::numeric_limits<float>::infinity());
  sc.s.resize(un * key_tile);
  sc.states.resize(un);
  for (std::int64_t i = 0; i < n_pos; ++i) {
    for (int g = 0; g < group; ++g) {
      const std::size_t r = static_cast<std::size_t>(i * group + g);
      const int head = it.kv_head * group + g;
      const float* src = sq.q + ((it.row_begin + i) * sq.n_heads + head) * d;
      float* dst = sc.qs.data() + r * ud;
      for (int c = 0; c < d; ++c) dst[c] = src[c] * o.scale;
      sc.states[r] = row_state{dst, sc.acc.data() + r * ud, sc.lsum.data() + r * cpu::attn::lanes,
                               sc.m.data() + r, sc.s.data() + r * key_tile};
    }
  }

  // Key intervals per position (shared by the heads of the group).
  sc.ivals.clear();
  sc.ival_begin.assign(static_cast<std::size_t>(n_pos) + 1, 0);
  if (o.sparse()) {
    select_sets(kv, sq, o, ops, it.kv_head, group, it.row_begin, it.row_end, sc.qs.data(), sc);
  } else {
    sc.set_end.assign(1, n_pos);
    sc.sel.clear();
    sc.sel_begin.assign(2, 0);
  }
  for (std::size_t k = 0, i = 0; k < sc.set_end.size(); ++k) {
    const std::span<const std::int64_t> selected(sc.sel.data() + sc.sel_begin[k],
                                                 sc.sel_begin[k + 1] - sc.sel_begin[k]);
    for (; i < static_cast<std::size_t>(sc.set_end[k]); ++i) {
      sc.ival_begin[i] = sc.ivals.size();
      row_intervals(kv, sq, o, sq.q_start + it.row_begin + static_cast<std::int64_t>(i), selected,
                    sc.ivals);
    }
  }
  sc.ival_begin[static_cast<std::size_t>(n_pos)] = sc.ivals.size();

  const std::int64_t n_tiles = (sq.kv_len + key_tile - 1) / key_tile;
  sc.tile_used.assign(static_cast<std::size_t>(n_tiles), 0);
  for (const interval& v : sc.ivals)
    for (std::int64_t t = v.lo / key_tile; t <= (v.hi - 1) / key_tile; ++t)
      sc.tile_used[static_cast<std::size_t>(t)] = 1;
  sc.cursor.assign(sc.ival_begin.begin(), sc.ival_begin.end() - 1);
  sc.mask.resize(2 * static_cast<std::size_t>(n_pos));

  const void* kp[key_tile];
  const void* vp[key_tile];
  float ks[key_tile];
  float vs[key_tile];
  row_state batch[cpu::attn::max_rows];
  std::uint32_t batch_mask[cpu::attn::max_rows];
  tile_keys tk;
  tk.type = kv.type;
  tk.head_dim = d;
  tk.k = kp;
  tk.v = vp;
  tk.k_scale = ks;
  tk.v_scale = vs;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Masks of each position in tile t; returns their union.
  auto tile_masks = [&](std::int64_t t, std::uint32_t* masks) {
    const std::int64_t base = t * key_tile;
    std::uint32_t all = 0;
    for (std::int64_t i = 0; i < n_pos; ++i) {
      std::size_t& c = sc.cursor[static_cast<std::size_t>(i)];
      const std::size_t end = sc.ival_begin[static_cast<std::size_t>(i) + 1];
      while (c < end && sc.ivals[c].hi <= base) ++c;
      std::uint32_t mk = 0;
      for (std::size_t k = c; k < end && sc.ivals[k].lo < base + key_tile; ++k) {
        const int lo = static_cast<int>(std::max(sc.ivals[k].lo, base) - base);
        const int hi = static_cast<int>(std::min(sc.ivals[k].hi, base + key_tile) - base);
        mk |= bits(lo, hi);
      }
      masks[i] = mk;
      all |= mk;
    }
    return all;
  };
  auto next_tile = [&](std::int64_t from) {
    while (from < n_tiles && !sc.tile_used[static_cast<std::size_t>(from)]) ++from;
    return from;
  };
  std::uint32_t* cur_mask = sc.mask.data();
  std::uint32_t* next_mask = sc.mask.data() + n_pos;
  std::int64_t t = next_tile(0);
  std::uint32_t all = 0;
  if (t < n_tiles) {
    all = tile_masks(t, cur_mask);
    prefetch_keys(kv, sq, it.kv_head, t, all);
  }
  for (; t < n_tiles; std::swap(cur_mask, next_mask)) {
    // Masks and prefetches one tile ahead.
    const std::int64_t t_next = next_tile(t + 1);
    std::uint32_t all_next = 0;
    if (t_next < n_tiles) {
      all_next = tile_masks(t_next, next_mask);
      prefetch_keys(kv, sq, it.kv_head, t_next, all_next);
    }
    const std::int64_t base = t * key_tile;
    const std::uint32_t tile_all = all;
    t = t_next;
    all = all_next;
    if (tile_all == 0) continue;
    const int lo_all = std::countr_zero(tile_all);
    const int hi_all = 32 - std::countl_zero(tile_all);
    for (int j = lo_all; j < hi_all; ++j) {
      const std::int64_t pos = base + j;
      const std::int64_t b = pos / kv.block_size;
      const std::int64_t slot = pos % kv.block_size;
      const std::size_t off =
          block_base(kv, sq, b, it.kv_head) + static_cast<std::size_t>(slot) * kv.token_stride;
      kp[j] = kv.k + off;
      vp[j] = kv.v + off;
    }
    if (kv.type == kv_elem::i8) {
      for (int j = 0; j < key_tile; ++j) {
        ks[j] = 0.0f;
        vs[j] = 0.0f;
      }
      for (int j = lo_all; j < hi_all; ++j) {
        const std::int64_t pos = base + j;
        const std::int64_t b = pos / kv.block_size;
        const std::size_t si = static_cast<std::size_t>(sq.table[b]) * kv.scale_block_stride +
                               static_cast<std::size_t>(it.kv_head) * kv.scale_head_stride +
                               static_cast<std::size_t>(pos % kv.block_size);
        ks[j] = kv.k_scale[si];
        vs[j] = kv.v_scale[si];
      }
    }
    // Active rows, in order, in batches of max_rows.
    int nb = 0;
    auto flush = [&] {
      if (nb == 0) return;
      std::uint32_t u = 0;
      for (int r = 0; r < nb; ++r) u |= batch_mask[r];
      tk.lo = std::countr_zero(u);
      tk.hi = 32 - std::countl_zero(u);
      ops.qk(tk, nb, batch);
      if (o.softcap > 0.0f) {  // scalar on every ISA: the same bits
        const float cap = o.softcap;
        for (int r = 0; r < nb; ++r)
          for (int j = tk.lo; j < tk.hi; ++j) batch[r].s[j] = cap * std::tanh(batch[r].s[j] / cap);
      }
      for (int r = 0; r < nb; ++r) {
        const std::uint32_t mk = batch_mask[r];
        if (mk == ~0u) continue;
        for (int j = 0; j < key_tile; ++j)
          if (!((mk >> j) & 1u)) batch[r].s[j] = neg_inf;
      }
      ops.softmax_pv(tk, nb, batch);
      nb = 0;
    };
    for (std::int64_t i = 0; i < n_pos; ++i) {
      const std::uint32_t mk = cur_mask[i];
      if (mk == 0) continue;
      for (int g = 0; g < group; ++g) {
        batch[nb] = sc.states[static_cast<std::size_t>(i * group + g)];
        batch_mask[nb] = mk;
        if (++nb == cpu::attn::max_rows) flush();
      }
    }
    flush();
  }

  for (std::int64_t i = 0; i < n_pos; ++i) {
    for (int g = 0; g < group; ++g) {
      const int head = it.kv_head * group + g;
      float* dst = sq.out + ((it.row_begin + i) * sq.n_heads + head) * d;
      ops.finish(d, sc.states[static_cast<std::size_t>(i * group + g)], dst);
    }
  }
}

// Splits every sequence into (KV head, query tile) items and runs them.
void run_all(cpu::context& ctx, const kv_source& kv, const std::vector<seq_view>& seqs,
             const resolved_options& o) {
  const tile_ops& ops = ops_for(ctx, kv.head_dim);
  std::vector<work_item> items;
  // At least one item per thread when there is enough work; item sizes never
  // change results, only speed.
  std::int64_t total_rows = 0;
  for (const seq_view& sq : seqs) total_rows += sq.n_q * sq.n_heads;
  const std::int64_t rows_per_item =
      std::clamp<std::int64_t>(total_rows / ctx.threads(), min_rows_per_item, max_rows_per_item);
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    const seq_view& sq = seqs[s];
    if (sq.n_q == 0) continue;
    const int group = sq.n_heads / kv.n_kv_heads;
    const std::int64_t unit = o.query_block;
    const std::int64_t tile = unit * std::max<std::int64_t>(1, (rows_per_item / group) / unit);
    for (std::int64_t p = sq.q_start; p < sq.q_start + sq.n_q;) {
      const std::int64_t next = std::min(sq.q_start + sq.n_q, (p / tile + 1) * tile);
      const std::int64_t kept =
          o.window + o.sinks + std::max(o.top_k, std::int64_t{0}) * kv.block_size;
      const std::int64_t keys = o.causal ? (o.window > 0 ? std::min(next, kept) : next) : sq.kv_len;
      for (int h = 0; h < kv.n_kv_heads; ++h) {
        work_item it{static_cast<int>(s), h, p - sq.q_start, next - sq.q_start,
                     static_cast<double>(next - p) * group * static_cast<double>(keys)};
        items.push_back(it);
      }
      p = next;
    }
  }
  if (items.empty()) return;
  // Largest first, then handed out dynamically: which thread runs an item
  // never changes its result.
  std::stable_sort(items.begin(), items.end(),
                   [](const work_item& a, const work_item& b) { return a.cost > b.cost; });
  std::atomic<std::size_t> next{0};
  const auto workers = static_cast<std::int64_t>(
      std::min<std::size_t>(static_cast<std::size_t>(ctx.threads()), items.size()));
  ctx.pool().parallel_for(workers, 1, [&](std::int64_t, std::int64_t, int) {
    scratch& sc = thread_scratch();
    for (std::size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) {
      const work_item& it = items[i];
      run_item(kv, seqs[static_cast<std::size_t>(it.seq)], o, ops, it, sc);
    }
  });
}

result<void> check_queries(const tensor& q, const tensor& out, int n_kv_heads, int head_dim,
                           const std::string& what) {
  if (auto ok = expect_tensor(q, dtype::f32, 3, (what + " q").c_str()); !ok) return ok;
  if (auto ok = expect_tensor(out, dtype::f32, 3, (what + " out").c_str()); !ok) return ok;
  if (q.dim(2) != head_dim)
    return make_error(errc::shape_mismatch, what + " q head_dim " + str(q.dim(2)) +
                                                " differs from the keys' " + str(head_dim));
  if (q.dim(1) < 1 || q.dim(1) % n_kv_heads != 0)
    return make_error(errc::shape_mismatch, what + " n_heads " + str(q.dim(1)) +
                                                " is not a positive multiple of n_kv_heads " +
                                                str(n_kv_heads));
  if (q.dim(1) > (1 << 16) || q.dim(0) > (std::int64_t{1} << 32))
    return make_error(errc::invalid_argument, what + " q is too large");
  if (!(out.shape() == q.shape()))
    return make_error(errc::shape_mismatch, what + " out " + out.shape().to_string() +
                                                " differs from q " + q.shape().to_string());
  return {};
}

result<void> check_positions(const resolved_options& o, std::int64_t n_q, std::int64_t q_start,
                             std::int64_t kv_len, const std::string& what) {
  if (q_start < 0 || q_start > (std::int64_t{1} << 40))
    return make_error(errc::invalid_argument, what + " q_start must be >= 0, got " + str(q_start));
  if (n_q > 0 && kv_len < 1) return make_error(errc::invalid_argument, what + " has no keys");
  if (o.causal && q_start + n_q > kv_len)
    return make_error(errc::invalid_argument, what + " causal queries reach position " +
                                                  str(q_start + n_q - 1) + " but only " +
                                                  str(kv_len) + " keys are in the cache");
  return {};
}

kv_source paged_source(const paged_kv_cache& cache) {
  const auto& c = cache.config;
  kv_source kv;
  kv.type =
      c.type == dtype::f16 ? kv_elem::f16 : (c.type == dtype::i8 ? kv_elem::i8 : kv_elem::f32);
  kv.block_size = c.block_size;
  kv.n_kv_heads = c.n_kv_heads;
  kv.head_dim = c.head_dim;
  kv.k = cache.k.data_as<const std::byte>();
  kv.v = cache.v.data_as<const std::byte>();
  kv.token_stride = static_cast<std::size_t>(c.head_dim) * block_bytes(c.type);
  kv.head_stride = kv.token_stride * static_cast<std::size_t>(c.block_size);
  kv.block_stride = kv.head_stride * static_cast<std::size_t>(c.n_kv_heads);
  if (c.type == dtype::i8) {
    kv.k_scale = cache.k_scales.data_as<const float>();
    kv.v_scale = cache.v_scales.data_as<const float>();
    kv.scale_head_stride = static_cast<std::size_t>(c.block_size);
    kv.scale_block_stride = kv.scale_head_stride * static_cast<std::size_t>(c.n_kv_heads);
  }
  if (cache.has_summaries()) kv.summary = cache.k_summary.data_as<const float>();
  return kv;
}

result<seq_view> check_sequence(const paged_kv_cache& cache, const attention_sequence& s,
                                const resolved_options& o, const std::string& what) {
  const auto& c = cache.config;
  if (auto ok = check_queries(s.q, s.out, c.n_kv_heads, c.head_dim, what); !ok)
    return std::unexpected(ok.error());
  if (auto ok = check_block_table(c, s.block_table, s.kv_len); !ok)
    return make_error(ok.error().code, what + ": " + ok.error().message);
  if (auto ok = check_positions(o, s.q.dim(0), s.q_start, s.kv_len, what); !ok)
    return std::unexpected(ok.error());
  seq_view v;
  v.q = s.q.data_as<const float>();
  v.out = s.out.data_as<float>();
  v.n_q = s.q.dim(0);
  v.n_heads = static_cast<int>(s.q.dim(1));
  v.q_start = s.q_start;
  v.kv_len = s.kv_len;
  v.table = s.block_table.data();
  return v;
}

result<resolved_options> resolve_paged(const paged_kv_cache& cache, const attention_options& opt) {
  if (auto ok = cache.validate(); !ok) return std::unexpected(ok.error());
  auto o = resolve(opt, cache.config.head_dim);
  if (!o) return o;
  if (o->sparse() && !cache.has_summaries())
    return make_error(errc::invalid_argument, "sparse attention needs a kv cache with summaries");
  if (o->sparse() && o->window < cache.config.block_size)
    return make_error(errc::invalid_argument, "sparse attention needs window >= block_size (" +
                                                  str(cache.config.block_size) + "), got " +
                                                  str(o->window));
  return o;
}

}  // namespace

result<void> attention_paged(cpu::context& ctx, const paged_kv_cache& cache,
                             std::span<const attention_sequence> seqs,
                             const attention_options& opt) {
  auto o = resolve_paged(cache, opt);
  if (!o) return std::unexpected(o.error());
  std::vector<seq_view> views;
  views.reserve(seqs.size());
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    auto v = check_sequence(cache, seqs[i], *o, "attention sequence " + std::to_string(i));
    if (!v) return std::unexpected(v.error());
    views.push_back(*v);
  }
  run_all(ctx, paged_source(cache), views, *o);
  return {};
}

result<void> attention(cpu::context& ctx, const tensor& q, const tensor& k, const tensor& v,
                       const tensor& out, const attention_options& opt, std::int64_t q_start) {
  if (k.type() != dtype::f32 && k.type() != dtype::f16)
    return make_error(errc::unsupported_dtype,
                      "attention k must be f32 or f16, got " + std::string(to_string(k.type())));
  if (auto ok = expect_tensor(k, k.type(), 3, "attention k"); !ok) return ok;
  if (auto ok = expect_tensor(v, k.type(), 3, "attention v"); !ok) return ok;
  if (!(v.shape() == k.shape()))
    return make_error(errc::shape_mismatch, "attention v " + v.shape().to_string() +
                                                " differs from k " + k.shape().to_string());
  if (k.dim(1) < 1 || k.dim(2) < 1 || k.dim(2) > (1 << 14))
    return make_error(
        errc::shape_mismatch,
        "attention k must be [n_kv, n_kv_heads >= 1, 1..16384], got " + k.shape().to_string());
  const int n_kv_heads = static_cast<int>(k.dim(1));
  const int d = static_cast<int>(k.dim(2));
  if (auto ok = check_queries(q, out, n_kv_heads, d, "attention"); !ok) return ok;
  auto o = resolve(opt, d);
  if (!o) return std::unexpected(o.error());
  if (o->sparse())
    return make_error(errc::unsupported_op,
                      "sparse attention needs a paged kv cache with summaries");
  const std::int64_t n_kv = k.dim(0);
  if (q_start < -1) return make_error(errc::invalid_argument, "attention q_start must be >= -1");
  if (q_start == -1) q_start = o->causal ? n_kv - q.dim(0) : 0;
  if (auto ok = check_positions(*o, q.dim(0), q_start, n_kv, "attention"); !ok) return ok;
  if (q.dim(0) == 0) return {};
  static const std::int32_t identity_table[1] = {0};
  kv_source kv;
  kv.type = k.type() == dtype::f16 ? kv_elem::f16 : kv_elem::f32;
  kv.block_size = n_kv;
  kv.n_kv_heads = n_kv_heads;
  kv.head_dim = d;
  kv.k = k.data_as<const std::byte>();
  kv.v = v.data_as<const std::byte>();
  kv.head_stride = static_cast<std::size_t>(d) * block_bytes(k.type());
  kv.token_stride = kv.head_stride * static_cast<std::size_t>(n_kv_heads);
  kv.block_stride = 0;
  seq_view sv;
  sv.q = q.data_as<const float>();
  sv.out = out.data_as<float>();
  sv.n_q = q.dim(0);
  sv.n_heads = static_cast<int>(q.dim(1));
  sv.q_start = q_start;
  sv.kv_len = n_kv;
  sv.table = identity_table;
  run_all(ctx, kv, {sv}, *o);
  return {};
}

result<std::vector<std::int64_t>> sparse_selection(cpu::context& ctx, const paged_kv_cache& cache,
                                                   const attention_sequence& seq,
                                                   const attention_options& opt, std::int64_t q_row,
                                                   int kv_head) {
  auto o = resolve_paged(cache, opt);
  if (!o) return std::unexpected(o.error());
  if (!o->sparse()) return make_error(errc::invalid_argument, "sparse_selection needs top_k >= 0");
  auto sv = check_sequence(cache, seq, *o, "sparse_selection");
  if (!sv) return std::unexpected(sv.error());
  if (q_row < 0 || q_row >= sv->n_q)
    return make_error(errc::invalid_argument,
                      "sparse_selection row " + str(q_row) + " outside [0, " + str(sv->n_q) + ")");
  if (kv_head < 0 || kv_head >= cache.config.n_kv_heads)
    return make_error(errc::invalid_argument,
                      "sparse_selection kv_head " + str(kv_head) + " out of range");
  const kv_source kv = paged_source(cache);
  const int d = kv.head_dim;
  const int group = sv->n_heads / kv.n_kv_heads;
  const std::int64_t p = sv->q_start + q_row;
  const std::int64_t r0 = std::max<std::int64_t>(0, q_row - p % o->query_block);
  const std::int64_t r1 = std::min(sv->n_q, q_row - p % o->query_block + o->query_block);
  std::vector<float> qs(static_cast<std::size_t>((r1 - r0) * group * d));
  for (std::int64_t i = r0; i < r1; ++i)
    for (int g = 0; g < group; ++g)
      for (int c = 0; c < d; ++c)
        qs[static_cast<std::size_t>(((i - r0) * group + g) * d + c)] =
            sv->q[(i * sv->n_heads + kv_head * group + g) * d + c] * o->scale;
  scratch sc;
  select_sets(kv, *sv, *o, ops_for(ctx, d), kv_head, group, r0, r1, qs.data(), sc);
  std::vector<std::int64_t> out(sc.sel.begin(), sc.sel.end());
  return out;
}

}  // namespace troupe::kernels
