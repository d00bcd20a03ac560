#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "kernels/kv_layout.hpp"
#include "models/mapped_file.hpp"

namespace troupe::models {

/// Shape and policy of a model's KV cache.
struct kv_options {
  int block_size = 16;
  kernels::dtype type = kernels::dtype::f32;  ///< f32, f16 or i8
  std::int64_t capacity_tokens = 4096;        ///< total tokens over all sequences
  int window = 0;  ///< > 0: sliding window; blocks that fall out of it are freed
  int sinks = 0;   ///< tokens kept from the start of a sequence with a window
  bool summaries = false;  ///< per-block key summaries (sparse attention)
};

using seq_id = std::int64_t;

/// The paged KV cache of every layer of one model: one block pool per
/// layer, block ids shared across layers, a block table per sequence.
/// With a sliding window, blocks wholly behind the window (and not holding
/// sink tokens) return to the free list; their table entries point at the
/// reserved hole block 0, which attention never reads.
class kv_cache {
 public:
  static result<kv_cache> create(kernels::memory_pool& pool, int layers, int n_kv_heads, int head_dim,
                                 const kv_options& opts);

  seq_id add_sequence();
  /// Frees the sequence's blocks.
  void release(seq_id s);
  /// Makes room for `length` tokens of `s` (allocating blocks); an
  /// out_of_memory error leaves the sequence as it was.
  result<void> reserve(seq_id s, std::int64_t length);
  /// Records that `s` now holds `length` tokens and frees blocks the window
  /// no longer needs.
  result<void> commit(seq_id s, std::int64_t length);

  std::int64_t length(seq_id s) const;
  std::span<const std::int32_t> block_table(seq_id s) const;
  bool contains(seq_id s) const { return seqs_.count(s) != 0; }

  kernels::paged_kv_cache& layer(int l) { return layers_[static_cast<std::size_t>(l)]; }
  const kernels::paged_kv_cache& layer(int l) const { return layers_[static_cast<std::size_t>(l)]; }
  int layers() const { return static_cast<int>(layers_.size()); }
  const kv_options& options() const { return opts_; }
  std::int64_t free_blocks() const { return static_cast<std::int64_t>(free_.size()); }
  std::int64_t total_blocks() const { return n_blocks_ - 1; }

 private:
  struct sequence {
    std::vector<std::int32_t> table;
    std::int64_t length = 0;
  };
  std::vector<kernels::paged_kv_cache> layers_;
  std::vector<std::int32_t> free_;
  std::unordered_map<seq_id, sequence> seqs_;
  kv_options opts_;
  std::int64_t n_blocks_ = 0;
  seq_id next_ = 1;
};

}  // namespace troupe::models
