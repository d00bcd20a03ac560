#pragma once

// An encoder's dynamic batching as a pure decision over one length bucket
// (inputs with different token counts never share a batch: no padding).
// A batch closes when it holds max_batch inputs, or once its oldest input
// has waited max_wait_ms and at least min_batch inputs wait; with fewer it
// closes after 4 x max_wait_ms anyway, so nothing waits forever.

#include <cstddef>
#include <optional>

#include "actors/core/clock.hpp"

namespace troupe::actors::core {

struct batching_options {
  int max_batch = 8;
  int min_batch = 1;
  int max_wait_ms = 5;
};

/// Clamps the options into a usable range (max_batch >= 1, min_batch in
/// [1, max_batch], max_wait_ms >= 0).
batching_options sanitized(batching_options o);

/// What to do with a bucket now.
struct batch_decision {
  std::size_t close = 0;              ///< inputs to encode now as one batch (0: none)
  std::optional<time_point> wake_at;  ///< when to look again if inputs remain
};

/// For a bucket of `waiting` inputs whose oldest arrived at `oldest`: the
/// batch to close now, if any, else when the oldest input's wait ends.
/// Call again after closing a batch (a full bucket may hold several).
batch_decision decide_batch(const batching_options& o, std::size_t waiting, time_point oldest,
                            time_point now);

}  // namespace troupe::actors::core
