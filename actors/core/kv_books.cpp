#include "actors/core/kv_books.hpp"

#include <algorithm>

namespace troupe::actors::core {

bool kv_books::reserve(std::int64_t seq, std::int64_t committed, std::int64_t reserved) {
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
  auto it = held_.find(seq);
  if (it == held_.end()) return;
  const std::int64_t now = blocks_for(committed, committed);
  used_ -= it->second - now;
  it->second = now;
}

std::int64_t kv_books::release(std::int64_t seq) {
  auto it = held_.find(seq);
  if (it == held_.end()) return 0;
  const std::int64_t blocks = it->second;
  held_.erase(it);
  return blocks;
}

void kv_books::clear() {
  used_ = 0;
  held_.clear();
}

std::int64_t kv_books::held(std::int64_t seq) const {
  auto it = held_.find(seq);
  return it == held_.end() ? 0 : it->second;
}

}  // namespace troupe::actors::core
