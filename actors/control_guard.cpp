#include "actors/control_guard.hpp"

#include <algorithm>

namespace troupe::actors {

basp_stream_guard::basp_stream_guard(std::atomic<std::uint64_t>* budget, std::uint32_t max_payload,
                                     std::uint64_t budget_limit)
    : budget_(budget), max_payload_(max_payload), budget_limit_(budget_limit) {}

basp_stream_guard::~basp_stream_guard() {
  release_budget();
}

void basp_stream_guard::release_budget() {
  if (budget_ && payload_left_ > 0) budget_->fetch_sub(payload_left_);
  payload_left_ = 0;
}

std::optional<std::string> basp_stream_guard::feed(std::span<const std::uint8_t> bytes) {
  if (refused_) return refused_;
  std::size_t at = 0;
  while (at < bytes.size()) {
    if (payload_left_ > 0) {
      const auto take = std::min<std::uint64_t>(payload_left_, bytes.size() - at);
      payload_left_ -= take;
      if (budget_) budget_->fetch_sub(take);
      at += static_cast<std::size_t>(take);
      continue;
    }
    const std::size_t take = std::min(basp_header_bytes - header_have_, bytes.size() - at);
    std::copy_n(bytes.data() + at, take, header_ + header_have_);
    header_have_ += take;
    at += take;
    if (header_have_ < basp_header_bytes) break;
    header_have_ = 0;
    ++messages_;
    const std::uint32_t len = (std::uint32_t{header_[4]} << 24) |
                              (std::uint32_t{header_[5]} << 16) | (std::uint32_t{header_[6]} << 8) |
                              std::uint32_t{header_[7]};
    if (len > max_payload_) {
      refused_ = "a control message announced " + std::to_string(len) + " bytes (at most " +
                 std::to_string(max_payload_) + ")";
      return refused_;
    }
    if (len == 0) continue;
    if (budget_) {
      const auto before = budget_->fetch_add(len);
      if (before + len > budget_limit_) {
        budget_->fetch_sub(len);
        refused_ = "a control message announced " + std::to_string(len) +
                   " bytes while others announced " + std::to_string(before) +
                   " not yet sent (the process takes at most " + std::to_string(budget_limit_) +
                   " at once)";
        return refused_;
      }
    }
    payload_left_ = len;
  }
  return std::nullopt;
}

connection_admission::verdict connection_admission::accepted(int fd, const std::string& address,
                                                             clock::time_point now) {
  closed(fd);  // a reused descriptor number is a new connection
  if (pending_.size() >= limits_.total) return verdict::refuse_total;
  const auto from = per_address_.find(address);
  if ((from == per_address_.end() ? 0 : from->second) >= limits_.per_address)
    return verdict::refuse_address;
  ++per_address_[address];
  pending_.emplace(fd, entry{address, now, false});
  return verdict::admit;
}

void connection_admission::authenticated(int fd) {
  closed(fd);
}

void connection_admission::closed(int fd) {
  auto it = pending_.find(fd);
  if (it == pending_.end()) return;
  auto a = per_address_.find(it->second.address);
  if (a != per_address_.end() && --a->second == 0) per_address_.erase(a);
  pending_.erase(it);
}

std::vector<int> connection_admission::overdue(clock::time_point now) {
  std::vector<int> out;
  for (auto& [fd, e] : pending_) {
    if (!e.expired && now - e.since >= limits_.handshake_deadline) {
      e.expired = true;
      out.push_back(fd);
    }
  }
  return out;
}

std::size_t connection_admission::pending_from(const std::string& address) const {
  auto it = per_address_.find(address);
  return it == per_address_.end() ? 0 : it->second;
}

const char* to_string(connection_admission::verdict v) {
  switch (v) {
    case connection_admission::verdict::admit:
      return "admitted";
    case connection_admission::verdict::refuse_address:
      return "too many handshakes in progress from its address";
    case connection_admission::verdict::refuse_total:
      return "too many handshakes in progress";
  }
  return "?";
}

}  // namespace troupe::actors
