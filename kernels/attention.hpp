#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/context.hpp"
#include "kernels/kv_layout.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor.hpp"

namespace troupe::kernels {

/// Which keys a query row sees, and how scores are scaled.
///
/// A query at absolute position p (causal) sees keys [0, p]; bidirectional
/// (and cross) attention sees all keys of its sequence. With `window` > 0
/// (causal only) the row keeps the first `sinks` keys and the last `window`
/// keys [p + 1 - window, p]. With `top_k` >= 0 the attention is sparse
/// (Quest-style): on top of the sinks ("global tokens") and the window, each
/// query block keeps the `top_k` KV blocks with the largest bound
/// sum_c max(q_c*min_c, q_c*max_c), taken over every query row of the block
/// and every query head of the KV head's group; blocks are ranked by that
/// bound, never by position. Candidates are the blocks holding a key in
/// [sinks, p_last + 1 - window), where p_last is the block's last row present
/// in the call. Sparse needs causal attention, a cache with summaries and
/// window >= block_size (so candidate blocks hold only keys <= p_last and
/// their summaries are final whatever the chunking). With top_k >= the number
/// of candidates every key of the causal prefix is kept and the output is
/// bit-identical to dense attention (same keys, same tiles, same order).
struct attention_options {
  bool causal = true;
  float scale = 0.0f;  ///< score scale; 0 means 1/sqrt(head_dim)
  int window = 0;      ///< 0 = no window
  int sinks = 0;       ///< attention-sink / global tokens kept with a window
  /// Soft-capping (Gemma 2): each scaled score s becomes c * tanh(s / c)
  /// before the softmax; 0 = off.
  float softcap = 0.0f;
  int top_k = -1;  ///< -1 = not sparse; >= 0 KV blocks chosen per query block
  /// Sparse only: query positions [j*query_block, (j+1)*query_block) share one
  /// block selection. With 1 a row's output never depends on the other rows
  /// of the call; with more it is the same for any chunking whose chunk
  /// boundaries are multiples of query_block.
  int query_block = 1;
};

/// One sequence of a batched attention call over a paged KV cache.
struct attention_sequence {
  tensor q;    ///< f32 [n_q, n_heads, head_dim], contiguous
  tensor out;  ///< f32 [n_q, n_heads, head_dim], contiguous (written)
  /// Absolute position of query row 0; row i is at q_start + i. Causal
  /// attention needs q_start + n_q <= kv_len (the rows' own keys appended).
  std::int64_t q_start = 0;
  std::int64_t kv_len = 0;  ///< tokens of this sequence in the cache
  std::span<const std::int32_t> block_table;
};

/// Flash-style attention (tiles of 32 keys aligned to absolute key positions,
/// online softmax, no score matrix) for a batch of sequences reading K/V from
/// `cache` through their block tables. n_heads must be a multiple of the
/// cache's n_kv_heads (grouped-query attention). Every output row is
/// bit-identical whatever the other sequences of the call, the chunking of
/// the queries (see query_block for sparse) and the thread count (for finite
/// cached values: a row may multiply a masked key's value by 0). Work is
/// split over (sequence, KV head, query tile).
result<void> attention_paged(cpu::context& ctx, const paged_kv_cache& cache,
                             std::span<const attention_sequence> seqs,
                             const attention_options& opt);

/// The same kernel on contiguous K/V: q f32 [n_q, n_heads, d], k and v f32 or
/// f16 [n_kv, n_kv_heads, d], out f32 [n_q, n_heads, d]. Causal rows are at
/// positions q_start + i, with q_start = -1 meaning n_kv - n_q (the queries
/// are the last n_q keys). Sparse options need a paged cache (summaries).
result<void> attention(cpu::context& ctx, const tensor& q, const tensor& k, const tensor& v,
                       const tensor& out, const attention_options& opt, std::int64_t q_start = -1);

/// The logical KV block indices (block b holds keys [b*block_size,
/// (b+1)*block_size)) that sparse attention keeps by its bound for KV head
/// `kv_head` in the query block holding query row `q_row` of `seq`, in
/// increasing order (sinks and window come on top of them).
result<std::vector<std::int64_t>> sparse_selection(cpu::context& ctx, const paged_kv_cache& cache,
                                                   const attention_sequence& seq,
                                                   const attention_options& opt, std::int64_t q_row,
                                                   int kv_head);

}  // namespace troupe::kernels
