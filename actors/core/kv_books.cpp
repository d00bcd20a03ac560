#include "actors/core/kv_books.hpp"

#include <algorithm>

namespace troupe::actors::core {

using models::kv_move;
using models::kv_tier;

kv_books::kv_books(models::kv_options layout, std::int64_t total_blocks, bool name_blocks,
                   std::int64_t host_blocks, std::int64_t disk_blocks, std::int64_t remote_blocks)
    : layout_(layout), total_(total_blocks), naming_(name_blocks && layout.window <= 0) {
  if (naming_) {
    lower_[0].slots = std::max<std::int64_t>(0, host_blocks);
    lower_[1].slots = std::max<std::int64_t>(0, disk_blocks);
    remote_.slots = std::max<std::int64_t>(0, remote_blocks);
    remote_.reset();
    clear();
  }
}

void kv_books::tier::reset() {
  free.clear();
  lru.clear();
  names.clear();
  name.assign(static_cast<std::size_t>(slots), block_hash{});
  at.assign(static_cast<std::size_t>(slots), lru.end());
  confirmed.assign(static_cast<std::size_t>(slots), 0);
  pending = 0;
  for (auto i = slots; i-- > 0;) free.push_back(static_cast<std::int32_t>(i));
}

std::int32_t kv_books::tier::take(bool* evicted) {
  *evicted = free.empty();
  std::int32_t slot = 0;
  if (!*evicted) {
    slot = free.back();
    free.pop_back();
    return slot;
  }
  slot = lru.front();
  lru.pop_front();
  names.erase(name[static_cast<std::size_t>(slot)]);
  return slot;
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
  for (auto& t : lower_) t.reset();
  moves_.clear();
  // The remote tier outlives the stages: what its store confirmed stays;
  // copies on their way may never arrive (their stage may be the lost one).
  for (std::int32_t slot = 0; slot < remote_.slots; ++slot) {
    const auto i = static_cast<std::size_t>(slot);
    if (remote_.at[i] == remote_.lru.end() || remote_.confirmed[i]) continue;
    remote_.names.erase(remote_.name[i]);
    remote_.lru.erase(remote_.at[i]);
    remote_.at[i] = remote_.lru.end();
    remote_.free.push_back(slot);
    --remote_.pending;
  }
  note(event::kind::cleared, {}, kv_tier::device);
  note_remote();
}

void kv_books::note_remote() {
  for (auto slot : remote_.lru)
    note(event::kind::stored, remote_.name[static_cast<std::size_t>(slot)], kv_tier::remote);
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
  note(event::kind::removed, b.name, kv_tier::device);
  demote(b.name, kv_tier::device, id);  // its copy goes out before the block is written
  return id;
}

void kv_books::demote(const block_hash& name, kv_tier from, std::int32_t index) {
  for (int k = static_cast<int>(from); k < 2; ++k) {
    auto& t = lower_[k];
    if (t.free.empty() && t.lru.empty()) continue;  // none, or its only slots are on the move
    bool evicted = false;
    const auto slot = t.take(&evicted);
    if (evicted) {
      // The tier's least recent block goes further down first (its copy is
      // queued before the one that overwrites its slot).
      const auto victim = t.name[static_cast<std::size_t>(slot)];
      note(event::kind::removed, victim, static_cast<kv_tier>(k + 1));
      demote(victim, static_cast<kv_tier>(k + 1), slot);
    }
    const auto to = static_cast<kv_tier>(k + 1);
    moves_.push_back(
        kv_move{static_cast<std::uint8_t>(from), index, static_cast<std::uint8_t>(to), slot});
    ++moved_[static_cast<int>(from)][static_cast<int>(to)];
    t.name[static_cast<std::size_t>(slot)] = name;
    t.at[static_cast<std::size_t>(slot)] = t.lru.insert(t.lru.end(), slot);
    t.names.emplace(name, slot);
    note(event::kind::stored, name, to);
    return;
  }
  ++dropped_;
}

std::pair<kv_tier, std::int32_t> kv_books::find_lower(const block_hash& name) const {
  for (int k = 0; k < 2; ++k)
    if (auto it = lower_[k].names.find(name); it != lower_[k].names.end())
      return {static_cast<kv_tier>(k + 1), it->second};
  return {kv_tier::device, -1};
}

std::int32_t kv_books::promote(const block_hash& name, kv_tier from, std::int32_t slot,
                               bool keep_name) {
  if (available() <= 0) return -1;
  auto& t = lower_[static_cast<int>(from) - 1];
  // Out of the tier, but the slot is not free until its copy is out.
  t.names.erase(name);
  note(event::kind::removed, name, from);
  t.lru.erase(t.at[static_cast<std::size_t>(slot)]);
  const auto id = take_block();  // may send another block down first
  moves_.push_back(kv_move{static_cast<std::uint8_t>(from), slot,
                           static_cast<std::uint8_t>(kv_tier::device), id});
  ++moved_[static_cast<int>(from)][0];
  t.free.push_back(slot);
  auto& b = blocks_[static_cast<std::size_t>(id)];
  b.refs = 1;
  ++used_;
  if (keep_name) {
    b.named = true;
    b.name = name;
    names_.emplace(name, id);
    note(event::kind::stored, name, kv_tier::device);
  }
  return id;
}

void kv_books::take_ref(std::int32_t id) {
  auto& b = blocks_[static_cast<std::size_t>(id)];
  if (b.refs++ == 0) {
    lru_.erase(b.lru);
    ++used_;
  }
}

std::vector<kv_move> kv_books::take_moves() {
  std::vector<kv_move> out;
  out.swap(moves_);
  return out;
}

std::int64_t kv_books::tier_slots(kv_tier t) const {
  if (t == kv_tier::remote) return remote_.slots;
  return t == kv_tier::device ? total_ : lower_[static_cast<int>(t) - 1].slots;
}

std::int64_t kv_books::tier_used(kv_tier t) const {
  if (t == kv_tier::device) return used_ + static_cast<std::int64_t>(lru_.size());
  if (t == kv_tier::remote) return remote_.slots - std::ssize(remote_.free) - remote_.pending;
  const auto& l = lower_[static_cast<int>(t) - 1];
  return l.slots - static_cast<std::int64_t>(l.free.size());
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
    if (!names_.contains(h) && find_lower(h).first == kv_tier::device && find_remote(h) < 0) break;
    ++n;
  }
  return n;
}

std::int64_t kv_books::attach(std::int64_t seq, std::span<const block_hash> names,
                              const block_hash* partial, bool* took_partial) {
  if (took_partial) *took_partial = false;
  if (!naming_) return 0;
  auto& s = seqs_[seq];
  if (!s.table.empty()) return 0;
  for (const auto& h : names) {
    if (auto it = names_.find(h); it != names_.end()) {
      take_ref(it->second);
      s.table.push_back(it->second);
      continue;
    }
    const auto [t, slot] = find_lower(h);
    std::int32_t id = -1;
    if (t != kv_tier::device)
      id = promote(h, t, slot, true);
    else if (const auto r = find_remote(h); r >= 0)
      id = promote_remote(h, r);
    if (id < 0) break;
    s.table.push_back(id);
  }
  const auto full = static_cast<std::int64_t>(s.table.size());
  if (partial && s.table.size() == names.size()) {
    // A partly filled block is the sequence's own from now on: it writes
    // its next tokens into it. Taken only where nobody else holds it.
    if (auto it = names_.find(*partial); it != names_.end()) {
      const auto id = it->second;
      auto& b = blocks_[static_cast<std::size_t>(id)];
      if (b.refs == 0) {
        take_ref(id);
        note(event::kind::removed, b.name, kv_tier::device);
        names_.erase(it);
        b.named = false;
        s.table.push_back(id);
        if (took_partial) *took_partial = true;
      }
    } else if (const auto [t, slot] = find_lower(*partial); t != kv_tier::device) {
      if (const auto id = promote(*partial, t, slot, false); id >= 0) {
        s.table.push_back(id);
        if (took_partial) *took_partial = true;
      }
    }
  }
  s.delta_from = 0;
  peak_ = std::max(peak_, used_);
  if (s.table.empty()) seqs_.erase(seq);
  return full;  // the partial block is not a full one
}

void kv_books::publish(std::int64_t seq, std::int64_t index, const block_hash& name) {
  auto it = seqs_.find(seq);
  if (!naming_ || it == seqs_.end() || index < 0 ||
      index >= static_cast<std::int64_t>(it->second.table.size()))
    return;
  auto& b = blocks_[static_cast<std::size_t>(it->second.table[static_cast<std::size_t>(index)])];
  if (b.named || names_.contains(name) || find_lower(name).first != kv_tier::device) return;
  b.named = true;
  b.name = name;
  names_.emplace(name, it->second.table[static_cast<std::size_t>(index)]);
  note(event::kind::stored, name, kv_tier::device);
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

std::int64_t kv_books::forget_names(bool keep_remote) {
  const auto freed = static_cast<std::int64_t>(lru_.size());
  for (auto id : lru_) free_.push_back(id);
  lru_.clear();
  for (auto& [h, id] : names_) blocks_[static_cast<std::size_t>(id)].named = false;
  names_.clear();
  for (auto& t : lower_) t.reset();
  if (!keep_remote) remote_.reset();
  note(event::kind::cleared, {}, kv_tier::device);
  note_remote();
  return freed;
}

void kv_books::remote_online(bool on) {
  if (!naming_ || remote_.slots == 0 || on == remote_on_) return;
  remote_on_ = on;
  for (auto slot : remote_.lru)
    if (remote_.confirmed[static_cast<std::size_t>(slot)])
      note(event::kind::removed, remote_.name[static_cast<std::size_t>(slot)], kv_tier::remote);
  remote_.reset();
}

void kv_books::back_up(const block_hash& name) {
  if (!naming_ || remote_.slots == 0 || !remote_on_) return;
  auto& t = remote_;
  if (auto it = t.names.find(name); it != t.names.end()) {
    t.lru.splice(t.lru.end(), t.lru, t.at[static_cast<std::size_t>(it->second)]);
    return;
  }
  auto dev = names_.find(name);
  if (dev == names_.end()) return;
  bool evicted = false;
  const auto slot = t.take(&evicted);
  if (evicted) {
    // The least recently used copy makes room (a late confirmation of it
    // then names another block and is ignored).
    const auto i = static_cast<std::size_t>(slot);
    if (t.confirmed[i])
      note(event::kind::removed, t.name[i], kv_tier::remote);
    else
      --t.pending;
  }
  const auto i = static_cast<std::size_t>(slot);
  t.name[i] = name;
  t.confirmed[i] = 0;
  ++t.pending;
  t.at[i] = t.lru.insert(t.lru.end(), slot);
  t.names.emplace(name, slot);
  kv_move m{static_cast<std::uint8_t>(kv_tier::device), dev->second,
            static_cast<std::uint8_t>(kv_tier::remote), slot};
  m.name = name;
  moves_.push_back(m);
  ++moved_[0][3];
}

bool kv_books::confirm(std::int32_t slot, const block_hash& name) {
  if (slot < 0 || slot >= remote_.slots) return false;
  const auto i = static_cast<std::size_t>(slot);
  if (remote_.at[i] == remote_.lru.end() || remote_.name[i] != name || remote_.confirmed[i])
    return false;
  remote_.confirmed[i] = 1;
  --remote_.pending;
  note(event::kind::stored, name, kv_tier::remote);
  return true;
}

std::int32_t kv_books::find_remote(const block_hash& name) const {
  auto it = remote_.names.find(name);
  if (it == remote_.names.end() || !remote_.confirmed[static_cast<std::size_t>(it->second)])
    return -1;
  return it->second;
}

std::int32_t kv_books::promote_remote(const block_hash& name, std::int32_t slot) {
  if (available() <= 0) return -1;
  auto& t = remote_;
  t.lru.splice(t.lru.end(), t.lru, t.at[static_cast<std::size_t>(slot)]);  // the copy stays
  const auto id = take_block();
  kv_move m{static_cast<std::uint8_t>(kv_tier::remote), slot,
            static_cast<std::uint8_t>(kv_tier::device), id};
  m.name = name;
  moves_.push_back(m);
  ++moved_[3][0];
  auto& b = blocks_[static_cast<std::size_t>(id)];
  b.refs = 1;
  ++used_;
  b.named = true;
  b.name = name;
  names_.emplace(name, id);
  note(event::kind::stored, name, kv_tier::device);
  return id;
}

void kv_books::note(event::kind k, const block_hash& name, kv_tier t) {
  if (!naming_) return;
  if (events_.size() >= max_events) {
    events_.clear();
    overflowed_ = true;
  }
  events_.push_back(event{k, name, t});
}

std::vector<kv_books::event> kv_books::take_events(bool* overflowed) {
  if (overflowed) *overflowed = overflowed_;
  overflowed_ = false;
  std::vector<event> out;
  out.swap(events_);
  return out;
}

std::vector<std::pair<block_hash, kv_tier>> kv_books::contents() const {
  std::vector<std::pair<block_hash, kv_tier>> out;
  for (const auto& [h, id] : names_) out.emplace_back(h, kv_tier::device);
  for (int k = 0; k < 2; ++k)
    for (const auto& [h, slot] : lower_[k].names) out.emplace_back(h, static_cast<kv_tier>(k + 1));
  for (const auto& [h, slot] : remote_.names)
    if (remote_.confirmed[static_cast<std::size_t>(slot)]) out.emplace_back(h, kv_tier::remote);
  return out;
}

}  // namespace troupe::actors::core
