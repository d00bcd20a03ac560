#pragma once

// The scheduler's books of the stages' KV blocks. Every stage holds the
// same sequences with the same block layout, so one set of books stands
// for all of them; it counts blocks with the formula the stages' caches
// use (models::kv_cache::blocks_held), which is what makes the books and
// the caches agree (tests/actors/core/kv_books_test.cpp checks it against
// a real cache).
//
// Two ways to keep them:
//
// - Counting (a sliding window, or prefix caching turned off): each stage's
//   cache picks its own blocks and the books only count them. A block a
//   sequence gives back is not free until every stage's store has freed it
//   (`released` -> `freed`); until then it still counts as used, so the
//   scheduler never books a block a store still holds.
//
// - Naming (prefix caching, vLLM's block manager): the books pick every
//   block id themselves and each step tells the stages which ids a
//   sequence's table gained (`take_delta`); a stage's cache then only
//   writes where it is told. A full block can be given a name (its
//   block_hash) once every stage has computed it; a new sequence whose
//   prompt starts with named blocks takes them (`attach`, a reference
//   count) and computes only the rest. A named block no sequence holds
//   stays cached, counts as free in `available()` and is evicted least
//   recently used when a booking needs it. Because the books decide every
//   id, the stages never disagree with them about what a block holds.

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "actors/core/block_hash.hpp"
#include "models/kv_cache.hpp"

namespace troupe::actors::core {

class kv_books {
 public:
  /// `name_blocks`: the naming books above (needs a layout without a window).
  kv_books(models::kv_options layout, std::int64_t total_blocks, bool name_blocks = false);

  /// Blocks a sequence holds with `committed` tokens in its cache and room
  /// for `reserved` (>= committed) tokens.
  std::int64_t blocks_for(std::int64_t committed, std::int64_t reserved) const {
    return models::kv_cache::blocks_held(layout_, committed, reserved);
  }
  /// Whether a sequence of `tokens` tokens could ever fit (alone).
  bool fits_alone(std::int64_t tokens) const { return blocks_for(tokens - 1, tokens) <= total_; }
  /// The most tokens, at most `cap`, a sequence of `from` or more could
  /// reach alone; `from` when not even `from + 1` fits.
  std::int64_t longest_alone(std::int64_t from, std::int64_t cap) const;

  /// Books what `seq` needs to hold `committed` tokens with room for
  /// `reserved`; false (nothing booked) when the pool cannot give it.
  bool reserve(std::int64_t seq, std::int64_t committed, std::int64_t reserved);
  /// After a step: `seq` holds exactly what `committed` tokens keep (a
  /// sliding window lets blocks go; naming: blocks booked ahead and not
  /// used go back).
  void settle(std::int64_t seq, std::int64_t committed);
  /// The sequence ends. Counting: its blocks are pending until `freed`;
  /// returns them. Naming: they are free (or cached) at once; returns 0.
  std::int64_t release(std::int64_t seq);
  /// The stores freed `blocks` released earlier.
  void freed(std::int64_t blocks) { used_ -= blocks; }
  /// Every store was replaced (a pipeline reset): nothing is held, nothing
  /// cached.
  void clear();

  std::int64_t held(std::int64_t seq) const;
  std::int64_t used() const { return used_; }  ///< booked, pending frees included
  std::int64_t total() const { return total_; }
  std::int64_t peak() const { return peak_; }
  /// Blocks a new booking may take (cached blocks nobody holds included).
  std::int64_t available() const { return total_ - used_; }
  const models::kv_options& layout() const { return layout_; }

  // -- naming books only ------------------------------------------------------------------

  bool names_blocks() const { return naming_; }
  /// How many of `names`, from the first, are cached.
  std::int64_t cached_prefix(std::span<const block_hash> names) const;
  /// A new sequence (holding nothing) takes the cached blocks named by
  /// `names`' longest cached prefix; returns how many.
  std::int64_t attach(std::int64_t seq, std::span<const block_hash> names);
  /// `seq`'s block `index` (full, computed on every stage) is named `name`,
  /// unless that name is taken (another sequence computed the same block:
  /// this one stays private) or the block has a name already.
  void publish(std::int64_t seq, std::int64_t index, const block_hash& name);
  /// The ids `seq`'s table gained (or changed) since the last call: its
  /// entries from `from` on are `ids` (from = -1: nothing changed).
  struct delta {
    std::int32_t from = -1;
    std::vector<std::int32_t> ids;
  };
  delta take_delta(std::int64_t seq);
  std::span<const std::int32_t> table(std::int64_t seq) const;
  /// Forgets every name: cached blocks nobody holds are free again, held
  /// ones stay with their sequences as private blocks. For an admin reset,
  /// and after a stage moved (the new one holds only live sequences' blocks).
  /// Returns the cached blocks that became free.
  std::int64_t forget_names();
  std::int64_t named() const { return static_cast<std::int64_t>(names_.size()); }
  std::int64_t cached_free() const { return static_cast<std::int64_t>(lru_.size()); }
  std::int64_t evictions() const { return evictions_; }

 private:
  struct block {
    block_hash name{};
    bool named = false;
    std::int32_t refs = 0;
    std::list<std::int32_t>::iterator lru;  // when named and refs == 0
  };
  struct sequence {
    std::vector<std::int32_t> table;
    std::int32_t delta_from = -1;
  };
  std::int32_t take_block();
  void drop_ref(std::int32_t id);

  models::kv_options layout_;
  std::int64_t total_ = 0;
  std::int64_t used_ = 0;
  std::int64_t peak_ = 0;
  std::unordered_map<std::int64_t, std::int64_t> held_;  ///< counting: per live sequence
  // naming:
  bool naming_ = false;
  std::vector<block> blocks_;  ///< by id (0 is the caches' hole block, never booked)
  std::vector<std::int32_t> free_;
  std::list<std::int32_t> lru_;  ///< cached blocks nobody holds, least recently used first
  std::unordered_map<block_hash, std::int32_t, block_hash_hasher> names_;
  std::unordered_map<std::int64_t, sequence> seqs_;
  std::int64_t evictions_ = 0;
};

}  // namespace troupe::actors::core
