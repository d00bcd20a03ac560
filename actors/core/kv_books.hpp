#pragma once

// The scheduler's books of the stages' KV blocks. Every stage holds the
// same sequences with the same block layout, so one set of books stands
// for all of them; it counts blocks with the formula the stages' caches
// use (models::kv_cache::blocks_held), which is what makes the books and
// the caches agree (tests/actors/core/kv_books_test.cpp checks it against
// a real cache).
//
// A block a sequence gives back is not free until every stage's store has
// freed it (`released` -> `freed`); until then it still counts as used, so
// the scheduler never books a block a store still holds.
//
// Designed for prefix caching (the KV-service issue): a block will be able
// to be shared (a reference count) and kept after its sequence ends as
// cached-but-evictable; such blocks count as free in `available()`, which
// is the one figure admission reads.

#include <cstdint>
#include <unordered_map>

#include "models/kv_cache.hpp"

namespace troupe::actors::core {

class kv_books {
 public:
  kv_books(models::kv_options layout, std::int64_t total_blocks)
      : layout_(layout), total_(total_blocks) {}

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
  /// sliding window lets blocks go).
  void settle(std::int64_t seq, std::int64_t committed);
  /// The sequence ends; its blocks are pending until `freed`. Returns them.
  std::int64_t release(std::int64_t seq);
  /// The stores freed `blocks` released earlier.
  void freed(std::int64_t blocks) { used_ -= blocks; }
  /// Every store was replaced (a pipeline reset): nothing is held.
  void clear();

  std::int64_t held(std::int64_t seq) const;
  std::int64_t used() const { return used_; }  ///< booked, pending frees included
  std::int64_t total() const { return total_; }
  std::int64_t peak() const { return peak_; }
  /// Blocks a new booking may take.
  std::int64_t available() const { return total_ - used_; }
  const models::kv_options& layout() const { return layout_; }

 private:
  models::kv_options layout_;
  std::int64_t total_ = 0;
  std::int64_t used_ = 0;
  std::int64_t peak_ = 0;
  std::unordered_map<std::int64_t, std::int64_t> held_;  ///< per live sequence
};

}  // namespace troupe::actors::core
