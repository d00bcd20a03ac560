#include "actors/core/block_index.hpp"

namespace troupe::actors::core {

void block_index::apply(const kv_books::event& e) {
  using kind = kv_books::event::kind;
  if (static_cast<int>(e.tier) > 2) return;
  switch (e.what) {
    case kind::cleared:
      clear();
      return;
    case kind::stored: {
      auto [it, fresh] = blocks_.try_emplace(e.name, e.tier);
      if (!fresh) --count_[static_cast<int>(it->second)];
      it->second = e.tier;
      ++count_[static_cast<int>(e.tier)];
      return;
    }
    case kind::removed: {
      auto it = blocks_.find(e.name);
      if (it == blocks_.end() || it->second != e.tier) return;
      --count_[static_cast<int>(e.tier)];
      blocks_.erase(it);
      return;
    }
  }
}

void block_index::clear() {
  blocks_.clear();
  for (auto& c : count_) c = 0;
}

std::optional<models::kv_tier> block_index::find(const block_hash& name) const {
  auto it = blocks_.find(name);
  if (it == blocks_.end()) return std::nullopt;
  return it->second;
}

std::int64_t block_index::cached_prefix(std::span<const block_hash> names) const {
  std::int64_t n = 0;
  for (const auto& h : names) {
    if (!blocks_.contains(h)) break;
    ++n;
  }
  return n;
}

}  // namespace troupe::actors::core
