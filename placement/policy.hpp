#pragma once

// The offload / rebalance policy: given the plan in force and fresh
// measurements, should shards move, and where? Pure: the caller passes the
// time in (`now`, from its steady clock) and commits the moves it carries
// out, so every rule is testable with simulated time.
//
// Rules, in order:
//  1. Measured loads are smoothed (exponential moving average with half-life
//     `load_half_life`, default 30 s), so a short burst does not look like a
//     lasting change.
//  2. The plan in force is re-costed and a fresh plan is made that keeps
//     every device under `memory_pressure` of its memory when it can and,
//     among plans within 2% of the fastest, moves the fewest weights
//     (make_plan_near).
//  3. Moves happen when the fresh plan's step time is at least
//     `gain_threshold` (default 15%) better, or when a device of the plan in
//     force needs more than `memory_pressure` (default 90%) of its memory
//     (offload, whatever the gain), or when a device of the plan is gone.
//  4. No shard (decoder layer range, or the vision encoder) moves again
//     within `cooldown` (default 60 s) of its last committed move; when any
//     move would break that, nothing moves. Only a device that would
//     overflow (needs more than all its memory) or is gone overrides the
//     cooldown.
// The moves of one decision belong together: they turn the plan in force
// into `decision::target`; carry them all out, commit each, then use the
// target as the plan in force.

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "placement/planner.hpp"

namespace troupe::placement {

/// The caller's steady-clock time; the policy never reads a clock itself.
using time_point = std::chrono::steady_clock::time_point;
/// A span of that clock.
using duration = std::chrono::steady_clock::duration;

/// The policy's knobs (defaults in the comments above).
struct policy_options {
  /// Move only if the predicted step time improves by at least this
  /// fraction (0.15 = 15%).
  double gain_threshold = 0.15;
  /// A shard that moved does not move again for this long.
  duration cooldown = std::chrono::seconds(60);
  /// A device needing more than this fraction of its memory triggers an
  /// offload regardless of gain (still within the cooldown rule unless it
  /// would overflow), in (0, 1].
  double memory_pressure = 0.9;
  /// Half-life of the load smoothing; zero takes each measurement as is.
  duration load_half_life = std::chrono::seconds(30);
  /// How re-plans are made (make_plan_near; memory_fraction is capped at
  /// memory_pressure). By default a re-plan may be up to 2% slower than the
  /// fastest one when that moves fewer weights.
  planner_options planner = [] {
    planner_options p;
    p.step_time_slack = 0.02;
    return p;
  }();
};

/// One shard moving from one device (or tensor-parallel group) to another,
/// or being re-quantized where it is.
struct move {
  /// "layers 10-19" or "vision".
  std::string shard;
  /// True for the vision encoder (with its projector); the layer range is
  /// then empty.
  bool vision = false;
  /// Decoder layers [layer_begin, layer_end).
  int layer_begin = 0;
  int layer_end = 0;
  /// Device ids before and after (several for a tensor-parallel group).
  std::vector<std::string> from;
  std::vector<std::string> to;
  /// Precision of the shard's weights before and after.
  precision from_precision = precision::f16;
  precision to_precision = precision::f16;
  /// Predicted relative step-time gain of the decision it belongs to.
  double gain = 0;
  /// Why it moves.
  std::string reason;

  /// "layers 10-19: node1:gpu0 -> node2:gpu0 (f16)".
  std::string describe() const;
};

/// What the policy decided.
struct decision {
  /// Empty: stay.
  std::vector<move> moves;
  /// Why these moves, or why none.
  std::string reason;
  /// The plan once the moves are done (the plan in force, re-costed, when
  /// there are none).
  plan target;
  /// Predicted step times (seconds) of the plan in force and of the fresh
  /// plan, both under the smoothed measurements; gain = (current - fresh)
  /// / current.
  double current_step_s = 0;
  double proposed_step_s = 0;
  double gain = 0;
};

/// What the policy remembers between decisions.
struct policy_state {
  /// When each decoder layer last moved (index = layer; empty = never).
  std::vector<std::optional<time_point>> layer_moved;
  /// When the vision encoder last moved.
  std::optional<time_point> vision_moved;
  /// A device's smoothed load and when it was last updated.
  struct smoothed_load {
    double load = 0;
    time_point at{};
  };
  /// Smoothed loads by device id.
  std::map<std::string, smoothed_load> loads;
  /// Moves committed so far.
  int moves = 0;
};

/// Decides whether shards of `current` should move, given measurements in
/// `cluster` (loads, memory) at time `now`. Updates the load smoothing in
/// `state`; does not record moves (see commit). Errors on invalid input, or
/// when shards must move (device gone or overflowing) but no plan fits.
result<decision> decide(policy_state& state, const plan& current, const cluster_profile& cluster,
                        const model_profile& model, const workload& w, time_point now,
                        const policy_options& opt = {});

/// Records that `m` was carried out at `now` (starts its cooldown).
void commit(policy_state& state, const move& m, time_point now);

}  // namespace troupe::placement
