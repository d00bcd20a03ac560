#pragma once

// What a pipeline's KV cache holds, as seen from outside it: the head
// follows its scheduler's block events (kv_books::event: stored, removed,
// cleared) into this index, which a router asks how much of a prompt's
// prefix a pipeline holds, and in which tier, without asking the pipeline.

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>

#include "actors/core/block_hash.hpp"
#include "actors/core/kv_books.hpp"

namespace troupe::actors::core {

class block_index {
 public:
  /// Follows one event. A removal from a tier the index does not have the
  /// block in (an event missed) is ignored.
  void apply(const kv_books::event& e);
  void clear();

  /// Blocks held in some tier (one in a local tier and in the remote one counts once).
  std::int64_t size() const;
  std::int64_t count(models::kv_tier t) const { return count_[static_cast<int>(t)]; }
  /// The nearest tier that holds `name`.
  std::optional<models::kv_tier> find(const block_hash& name) const;
  /// How many of `names`, from the first, some tier holds.
  std::int64_t cached_prefix(std::span<const block_hash> names) const;

 private:
  std::unordered_map<block_hash, models::kv_tier, block_hash_hasher> blocks_;
  /// The remote tier keeps copies: a block there may be in another tier too.
  std::unordered_set<block_hash, block_hash_hasher> remote_;
  std::int64_t count_[4] = {};
};

}  // namespace troupe::actors::core
