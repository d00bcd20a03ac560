#include "actors/core/kv_books.hpp"

#include <algorithm>

namespace troupe::actors::core {

kv_books::kv_books(models::kv_options layout, std::int64_t total_blocks, bool name_blocks)
    : layout_(layout), total_(total_blocks), naming_(name_blocks && layout.window <= 0) {
  if (naming_) clear();
}

bool kv_books::reserve(std::int64_t seq, std::int64_t committed, std::int64_t reserved) {
  if (naming_) {
    auto& s = seqs_[seq];
    const auto want = blocks_for(committed, reserved);
    const auto have = static_cast<std::int64_t>(s.table.size());
    if (want <= have) return true;
    if (want - have > available()) {
      if (s.table.empty()) seqs_.erase(seq);
      return false;
    }
    if (s.delta_from < 0 || s.delta_from > have) s.delta_from = static_cast<std::int32_t>(have);
    for (auto k = have; k < want; ++k) {
      const auto id = take_block();
      blocks_[static_cast<std::size_t>(id)].refs = 1;
      ++used_;
      s.table.push_back(id);
    }
    peak_ = std::max(peak_, used_);
    return true;
  }
  auto& h = held_[seq];
  const std::int64_t need = blocks_for(committed, reserved) - h;
  if (used_ + need > total_) {
    if (h == 0) held_.erase(seq);
    return false;
  }
  used_ += need;
  h += need;
  peak_ = std::max(peak_, used_);
  return true;
}

std::int64_t kv_books::longest_alone(std::int64_t from, std::int64_t cap) const {
  // fits_alone is monotone in the length: the largest that fits, by halves.
  std::int64_t lo = from, hi = std::max(from, cap);
  if (!fits_alone(from + 1)) return from;
  while (lo < hi) {
    const auto mid = lo + (hi - lo + 1) / 2;
    if (fits_alone(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

void kv_books::settle(std::int64_t seq, std::int64_t committed) {
  if (naming_) {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return;
    auto& t = it->second.table;
    const auto keep = static_cast<std::size_t>(blocks_for(committed, committed));
    if (t.size() <= keep) return;
    while (t.size() > keep) {
      drop_ref(t.back());
      t.pop_back();
    }
    auto& from = it->second.delta_from;
    if (from < 0 || from > static_cast<std::int32_t>(keep)) from = static_cast<std::int32_t>(keep);
    return;
  }
  auto it = held_.find(seq);
  if (it == held_.end()) return;
  const std::int64_t now = blocks_for(committed, committed);
  used_ -= it->second - now;
  it->second = now;
}

std::int64_t kv_books::release(std::int64_t seq) {
  if (naming_) {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return 0;
    // The last block first: a chain's tail is evicted before its head,
    // which more prompts share.
    for (auto b = it->second.table.rbegin(); b != it->second.table.rend(); ++b) drop_ref(*b);
    seqs_.erase(it);
    return 0;
  }
  auto it = held_.find(seq);
  if (it == held_.end()) return 0;
  const std::int64_t blocks = it->second;
  held_.erase(it);
  return blocks;
}

void kv_books::clear() {
  used_ = 0;
  held_.clear();
  if (!naming_) return;
  seqs_.clear();
  names_.clear();
  lru_.clear();
  blocks_.assign(static_cast<std::size_t>(std::max<std::int64_t>(total_, 0)) + 1, block{});
  free_.clear();
  for (auto id = total_; id >= 1; --id) free_.push_back(static_cast<std::int32_t>(id));
}

std::int64_t kv_books::held(std::int64_t seq) const {
  if (naming_) {
    auto it = seqs_.find(seq);
    return it == seqs_.end() ? 0 : static_cast<std::int64_t>(it->second.table.size());
  }
  auto it = held_.find(seq);
  return it == held_.end() ? 0 : it->second;
}

std::int32_t kv_books::take_block() {
  if (!free_.empty()) {
    const auto id = free_.back();
    free_.pop_back();
    return id;
  }
  // available() counted the cached blocks nobody holds: one is there.
  const auto id = lru_.front();
  lru_.pop_front();
  auto& b = blocks_[static_cast<std::size_t>(id)];
  names_.erase(b.name);
  b.named = false;
  ++evictions_;
  return id;
}

void kv_books::drop_ref(std::int32_t id) {
  auto& b = blocks_[static_cast<std::size_t>(id)];
  if (--b.refs > 0) return;
  --used_;
  if (b.named)
    b.lru = lru_.insert(lru_.end(), id);
  else
    free_.push_back(id);
}

std::int64_t kv_books::cached_prefix(std::span<const block_hash> names) const {
  std::int64_t n = 0;
  for (const auto& h : names) {
    if (!names_.contains(h)) break;
    ++n;
  }
  return n;
}

std::int64_t kv_books::attach(std::int64_t seq, std::span<const block_hash> names) {
  if (!naming_) return 0;
  auto& s = seqs_[seq];
  if (!s.table.empty()) return 0;
  for (const auto& h : names) {
    auto it = names_.find(h);
    if (it == names_.end()) break;
    auto& b = blocks_[static_cast<std::size_t>(it->second)];
    if (b.refs++ == 0) {
      lru_.erase(b.lru);
      ++used_;
    }
    s.table.push_back(it->second);
  }
  s.delta_from = 0;
  peak_ = std::max(peak_, used_);
  if (s.table.empty()) seqs_.erase(seq);
  return static_cast<std::int64_t>(s.table.size());
}

void kv_books::publish(std::int64_t seq, std::int64_t index, const block_hash& name) {
  auto it = seqs_.find(seq);
  if (!naming_ || it == seqs_.end() || index < 0 ||
      index >= static_cast<std::int64_t>(it->second.table.size()))
    return;
  auto& b = blocks_[static_cast<std::size_t>(it->second.table[static_cast<std::size_t>(index)])];
  if (b.named || names_.contains(name)) return;
  b.named = true;
  b.name = name;
  names_.emplace(name, it->second.table[static_cast<std::size_t>(index)]);
}

kv_books::delta kv_books::take_delta(std::int64_t seq) {
  delta d;
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || it->second.delta_from < 0) return d;
  auto& s = it->second;
  d.from = s.delta_from;
  d.ids.assign(s.table.begin() + s.delta_from, s.table.end());
  s.delta_from = -1;
  return d;
}

std::span<const std::int32_t> kv_books::table(std::int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return {};
  return it->second.table;
}

std::int64_t kv_books::forget_names() {
  const auto freed = static_cast<std::int64_t>(lru_.size());
  for (auto id : lru_) free_.push_back(id);
  lru_.clear();
  for (auto& [h, id] : names_) blocks_[static_cast<std::size_t>(id)].named = false;
  names_.clear();
  return freed;
}

}  // namespace troupe::actors::core
