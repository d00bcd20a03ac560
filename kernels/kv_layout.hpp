#pragma once

#include <cstdint>
#include <span>

#include "kernels/dtype.hpp"
#include "kernels/memory_pool.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor.hpp"

namespace troupe::kernels {

/// Shape and element type of one layer's paged KV cache.
struct kv_cache_config {
  int block_size = 16;  ///< tokens per block
  int n_kv_heads = 1;
  int head_dim = 128;
  dtype type = dtype::f32;    ///< f32, f16 or i8 (one f32 scale per token per head)
  std::int64_t n_blocks = 0;  ///< blocks in the pool
  bool summaries = true;      ///< keep per-block key min/max (needed by sparse attention)
};

/// One layer's paged KV cache: a pool of blocks shared by all sequences; a
/// sequence owns a list of block ids (its block table), token t of the
/// sequence lives in block table[t / block_size] at slot t % block_size.
///
/// Layout (all dense, row-major, head-major inside a block so that the keys
/// of one head in one block are contiguous):
///  - `k`, `v`: [n_blocks, n_kv_heads, block_size, head_dim] of `type`.
///  - `k_scales`, `v_scales` (i8 only): f32 [n_blocks, n_kv_heads, block_size];
///    value = scale * q, symmetric, q in [-127, 127].
///  - `k_summary` (optional): f32 [n_blocks, n_kv_heads, 2, head_dim], the
///    per-channel minimum (row 0) and maximum (row 1) of the stored (rounded or
///    dequantized) keys written to the block so far. Sparse attention ranks
///    blocks by the bound sum_c max(q_c*min_c, q_c*max_c) >= q.k.
struct paged_kv_cache {
  kv_cache_config config;
  tensor k;
  tensor v;
  tensor k_scales;
  tensor v_scales;
  tensor k_summary;

  /// A zero-filled cache with `config`'s shape, from `pool`.
  static result<paged_kv_cache> create(memory_pool& pool, const kv_cache_config& config);
  /// Checks that the tensors agree with `config` (for caches assembled from
  /// imported blocks).
  result<void> validate() const;
  bool has_summaries() const { return !k_summary.empty_view(); }
};

/// Writes the keys and values of `k.dim(0)` tokens (f32 [n, n_kv_heads,
/// head_dim] each) at positions [start, start + n) of the sequence whose block
/// table is `block_table`: rounds to f16 or quantizes to int8 as the cache's
/// type says, and updates the block summaries (a write to slot 0 of a block
/// restarts its summary).
result<void> append_kv(paged_kv_cache& cache, std::span<const std::int32_t> block_table,
                       std::int64_t start, const tensor& k, const tensor& v);

/// Recomputes, from the stored keys, the summaries of the blocks holding
/// positions [0, length) of the sequence with `block_table` (e.g. after
/// blocks were imported or a sequence was truncated).
result<void> build_kv_summaries(paged_kv_cache& cache, std::span<const std::int32_t> block_table,
                                std::int64_t length);

/// Checks a block table for a sequence of `length` tokens: enough entries and
/// every id used in [0, n_blocks).
result<void> check_block_table(const kv_cache_config& config,
                               std::span<const std::int32_t> block_table, std::int64_t length);

}  // namespace troupe::kernels
