#include "actors/core/batching.hpp"

#include <algorithm>

namespace troupe::actors::core {

batching_options sanitized(batching_options o) {
  o.max_batch = std::max(1, o.max_batch);
  o.min_batch = std::clamp(o.min_batch, 1, o.max_batch);
  o.max_wait_ms = std::max(0, o.max_wait_ms);
  return o;
}

batch_decision decide_batch(const batching_options& o, std::size_t waiting, time_point oldest,
                            time_point now) {
  batch_decision d;
  if (waiting == 0) return d;
  const auto max_batch = static_cast<std::size_t>(o.max_batch);
  if (waiting >= max_batch) {
    d.close = max_batch;
    return d;
  }
  const auto wait = std::chrono::milliseconds(o.max_wait_ms);
  const bool enough = waiting >= static_cast<std::size_t>(o.min_batch);
  const auto limit = enough ? wait : 4 * wait;
  if (now - oldest >= limit) {
    d.close = waiting;
    return d;
  }
  d.wake_at = oldest + limit;
  return d;
}

}  // namespace troupe::actors::core
