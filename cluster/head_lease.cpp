#include "cluster/head_lease.hpp"

namespace troupe::cluster {

head_lease::verdict head_lease::offer(const std::string& node_id, std::uint64_t term) {
  if (term < term_) return verdict::stale;
  if (term == term_ && !holder_.empty() && holder_ != node_id) return verdict::contested;
  holder_ = node_id;
  term_ = term;
  return verdict::granted;
}

bool head_lease::holds(const std::string& node_id) const {
  return !holder_.empty() && holder_ == node_id;
}

const char* to_string(head_lease::verdict v) {
  switch (v) {
    case head_lease::verdict::granted:
      return "granted";
    case head_lease::verdict::stale:
      return "a head with a higher term holds this node";
    case head_lease::verdict::contested:
      return "another head holds this node with the same term";
  }
  return "?";
}

shared_head_lease& local_head_lease() {
  static shared_head_lease l;
  return l;
}

}  // namespace troupe::cluster
