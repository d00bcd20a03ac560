#include "actors/core/block_index.hpp"

namespace troupe::actors::core {

void block_index::apply(const kv_books::event& e) {
  using kind = kv_books::event::kind;
  if (static_cast<int>(e.tier) > 3) return;
  if (e.tier == models::kv_tier::remote && e.what != kind::cleared) {
    if (e.what == kind::stored)
      count_[3] += remote_.insert(e.name).second;
    else
      count_[3] -= static_cast<std::int64_t>(remote_.erase(e.name));
    return;
  }
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

std::int64_t block_index::size() const {
  auto n = static_cast<std::int64_t>(blocks_.size());
  for (const auto& h : remote_) n += !blocks_.contains(h);
  return n;
}

void block_index::clear() {
  blocks_.clear();
  remote_.clear();
  for (auto& c : count_) c = 0;
}

std::optional<models::kv_tier> block_index::find(const block_hash& name) const {
  auto it = blocks_.find(name);
  if (it != blocks_.end()) return it->second;
  if (remote_.contains(name)) return models::kv_tier::remote;
  return std::nullopt;
}

std::int64_t block_index::cached_prefix(std::span<const block_hash> names) const {
  std::int64_t n = 0;
  for (const auto& h : names) {
    if (!blocks_.contains(h) && !remote_.contains(h)) break;
    ++n;
  }
  return n;
}

}  // namespace troupe::actors::core
