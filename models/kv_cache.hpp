#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/device.hpp"
#include "kernels/kv_layout.hpp"
#include "models/mapped_file.hpp"

namespace troupe::models {

/// Token capacities of the lower tiers (per stage, like kv_options'
/// capacity_tokens), from the manifest's [kv] table.
struct kv_tier_options {
  std::int64_t host_tokens = 0;  ///< 0: no host tier
  std::int64_t disk_tokens = 0;  ///< 0: no disk tier
  std::string disk_dir;          ///< empty: the system's temporary folder
  /// The remote tier (a cluster's KV store on another node, for the whole
  /// pipeline; the stages hold no part of it): 0: none.
  std::int64_t store_tokens = 0;
  bool operator==(const kv_tier_options&) const = default;
};

/// Shape and policy of a model's KV cache.
struct kv_options {
  int block_size = 16;
  kernels::dtype type = kernels::dtype::f32;  ///< f32, f16 or i8
  std::int64_t capacity_tokens = 4096;        ///< total tokens over all sequences
  int window = 0;           ///< > 0: sliding window; blocks that fall out of it are freed
  int sinks = 0;            ///< tokens kept from the start of a sequence with a window
  bool summaries = false;   ///< per-block key summaries (sparse attention)
  kv_tier_options tiers{};  ///< lower tiers of the stage's store (models/kv_tiers.hpp)
};

using seq_id = std::int64_t;

/// Block counts of a whole cache.
struct kv_usage {
  std::int64_t total_blocks = 0;  ///< blocks in the pool (the hole block not counted)
  std::int64_t free_blocks = 0;
  std::int64_t sequences = 0;
  std::int64_t tokens = 0;  ///< committed tokens over all sequences
};

/// A host copy of one sequence's live KV blocks, all layers.
///
/// `data` holds, for each layer l in 0..layers-1, for each entry of `live`
/// in order, one block's bytes:
///  - k: [n_kv_heads, block_size, head_dim] elements of `type`;
///  - v: the same;
///  - with `type` == i8 only: k scales, then v scales, f32 [n_kv_heads, block_size].
/// That is block_bytes() per block and layers * live.size() * block_bytes()
/// in all. Slots at or past `length` in the last block are zero.
struct kv_snapshot {
  int layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  kernels::dtype type = kernels::dtype::f32;
  int window = 0;
  int sinks = 0;
  std::int64_t length = 0;  ///< committed tokens
  /// Table indices (block positions in the sequence) that hold data, in
  /// increasing order; the other entries below ceil(length / block_size)
  /// are window holes.
  std::vector<std::int32_t> live;
  /// Per layer, per live block: k, v (and i8 scales) bytes, in the order above.
  std::vector<std::byte> data;
  /// From a cache whose blocks the scheduler names: each live block's id,
  /// which an importing cache of that kind keeps (empty otherwise).
  std::vector<std::int32_t> ids;

  /// Bytes of one block of one layer (k, v and, for i8, their scales); 0
  /// when the shape is invalid or too large.
  std::size_t block_bytes() const;
};

/// The paged KV cache of every layer of one model: one block pool per
/// layer, block ids shared across layers, a block table per sequence.
/// With a sliding window, blocks wholly behind the window (and not holding
/// sink tokens) return to the free list; their table entries point at the
/// reserved hole block 0, which attention never reads.
class kv_cache {
 public:
  static result<kv_cache> create(kernels::memory_pool& pool, int layers, int n_kv_heads,
                                 int head_dim, const kv_options& opts);
  /// The same in `dev`'s memory (kernels::create_paged_kv_cache), for a
  /// device whose memory host code cannot touch.
  static result<kv_cache> create(kernels::device& dev, int layers, int n_kv_heads, int head_dim,
                                 const kv_options& opts);

  seq_id add_sequence();
  /// Frees the sequence's blocks (named blocks: forgets its table).
  void release(seq_id s);

  /// From now on the scheduler names every block (prefix caching, where
  /// sequences share blocks): tables are set by `assign`, reserve only
  /// checks that they cover, release forgets a table and frees nothing.
  /// Only while the cache holds no sequence, and not with a window.
  result<void> name_blocks();
  bool blocks_named() const { return named_; }
  /// Named blocks: sequence `s`'s table from entry `from` on becomes `ids`.
  /// A new sequence (no table yet) takes `from` 0 and may start at
  /// `length` > 0 tokens: a cached prefix its first blocks already hold.
  /// An existing one keeps its length (`length` must equal it) and must
  /// keep every entry that holds its tokens.
  result<void> assign(seq_id s, std::int32_t from, std::span<const std::int32_t> ids,
                      std::int64_t length);
  /// Makes room for `length` tokens of `s` (allocating blocks); an
  /// out_of_memory error leaves the sequence as it was.
  result<void> reserve(seq_id s, std::int64_t length);
  /// Records that `s` now holds `length` tokens and frees blocks the window
  /// no longer needs.
  result<void> commit(seq_id s, std::int64_t length);

  std::int64_t length(seq_id s) const;
  /// Blocks a sequence holds when `committed` tokens are committed (window
  /// freeing applied) and room for `reserved` >= committed tokens was
  /// reserved (reserve allocates before commit frees): what this cache's
  /// reserve and commit leave it with. Negative counts count as 0, a
  /// `reserved` below `committed` as `committed`.
  static std::int64_t blocks_held(const kv_options& opts, std::int64_t committed,
                                  std::int64_t reserved);
  /// Pool, sequence and token counts.
  kv_usage usage() const;

  /// A host copy of sequence `s`'s committed tokens (its live blocks, every
  /// layer); the sequence stays as it was. Unknown sequence: invalid_argument.
  result<kv_snapshot> export_sequence(seq_id s) const { return export_sequence(s, 0); }
  /// The same with only the live blocks at table index >= `from_block`
  /// (a delta for import_tail); `length` is still the whole sequence's.
  result<kv_snapshot> export_sequence(seq_id s, std::int32_t from_block) const;
  /// Recreates a sequence from a snapshot under a new id: new blocks from
  /// this cache's pool, block summaries rebuilt when the cache keeps them.
  /// The snapshot must match this cache's shape (layers, heads, head_dim,
  /// block size, dtype) and policy (window, sinks), its live blocks must be
  /// exactly the ones this cache's window keeps for `length` tokens, in
  /// order, and `data` must have exactly the expected size
  /// (invalid_argument otherwise). Too few free blocks: out_of_memory. On
  /// any error the cache is unchanged.
  result<seq_id> import_sequence(const kv_snapshot& snap);
  /// Extends sequence `s` with a delta exported from a longer copy of it:
  /// the blocks from `from_block` on are overwritten or added and the
  /// length becomes snap.length. Used by live migration, whose rounds copy
  /// a sequence while it keeps growing. Needs a cache without a window (a
  /// window cache is copied whole); `from_block` must not lie past the
  /// sequence's current blocks, the length must not shrink, and the
  /// snapshot's live blocks must be exactly [from_block, blocks of
  /// snap.length) with data to match (invalid_argument otherwise). Too few
  /// free blocks: out_of_memory. On any error the cache is unchanged.
  result<void> import_tail(seq_id s, const kv_snapshot& snap, std::int32_t from_block);
  std::span<const std::int32_t> block_table(seq_id s) const;

  /// Bytes of one block over every layer (k, v, int8 scales and key
  /// summaries, whole rows): a slot of a lower KV tier (models/kv_tiers.hpp).
  std::size_t slot_bytes() const;
  /// Copies block `id` of every layer out to `out` (slot_bytes() bytes) /
  /// in from `in`, through the device where host code cannot touch its
  /// memory. The block's owner (the scheduler's books) decides what it
  /// holds; these do not look at the tables. Bad id or size: invalid_argument.
  result<void> read_block(std::int32_t id, std::span<std::byte> out) const;
  result<void> write_block(std::int32_t id, std::span<const std::byte> in);
  bool contains(seq_id s) const { return seqs_.count(s) != 0; }

  kernels::paged_kv_cache& layer(int l) { return layers_[static_cast<std::size_t>(l)]; }
  const kernels::paged_kv_cache& layer(int l) const { return layers_[static_cast<std::size_t>(l)]; }
  int layers() const { return static_cast<int>(layers_.size()); }
  const kv_options& options() const { return opts_; }
  std::int64_t free_blocks() const { return static_cast<std::int64_t>(free_.size()); }
  std::int64_t total_blocks() const { return n_blocks_ - 1; }

 private:
  static result<kv_cache> create_with(
      const std::function<result<kernels::paged_kv_cache>(const kernels::kv_cache_config&)>& make,
      int layers, int n_kv_heads, int head_dim, const kv_options& opts);
  result<void> check_ids(const kv_snapshot& snap) const;
  struct sequence {
    std::vector<std::int32_t> table;
    std::int64_t length = 0;
  };
  std::vector<kernels::paged_kv_cache> layers_;
  /// The device whose memory holds the layers when host code cannot touch
  /// it (export and import then copy through it); null otherwise.
  kernels::device* dev_ = nullptr;
  std::vector<std::int32_t> free_;
  std::unordered_map<seq_id, sequence> seqs_;
  kv_options opts_;
  std::int64_t n_blocks_ = 0;
  seq_id next_ = 1;
  bool named_ = false;
};

}  // namespace troupe::models
