#pragma once

// Where a pipeline's time goes, from two samples of the scheduler's
// cumulative counters (scheduler_stats): the pipeline bubble of
// `troupe bench` and `troupe status`.
//
// A micro-batch's round trip (the scheduler sends it to the first stage,
// the last stage's output comes back) is the stages' compute on it plus
// the rest: waiting at a stage behind another micro-batch, and the
// hand-offs (step messages, activation transfers). A stage computes
// `stage_busy` of the time on average; the pipeline is empty (no step in
// flight: the scheduler is between steps or has nothing to run) `idle` of
// it.

#include <optional>
#include <string>
#include <vector>

#include "actors/protocol.hpp"

namespace troupe::actors {

struct pipeline_breakdown {
  double wall_s = 0;
  std::int64_t stages = 0;
  double steps_per_s = 0;    ///< micro-batch steps per second
  double rows_per_s = 0;     ///< tokens through the stages per second (prompt and decode)
  double tokens_per_s = 0;   ///< tokens generated per second
  double round_trip_ms = 0;  ///< per step: sent to its output back
  double compute_ms = 0;     ///< per step: the stages' compute, summed over the stages
  double other_ms = 0;  ///< per step: round trip - compute (waiting behind other steps, hand-offs)
  double stage_busy = 0;  ///< compute / (stages x wall)
  std::vector<double>
      busy_per_stage;    ///< each stage's compute / wall (when the stages reported theirs)
  double idle = 0;       ///< share of the wall time with no step in flight
  double scheduler = 0;  ///< share of the wall time in the scheduler's own work

  /// One line per figure, indented by two spaces.
  std::string describe() const;
};

/// The breakdown between samples `a` (earlier) and `b`, `wall_s` apart;
/// nothing when no step completed in between, the counters went back (a
/// restarted scheduler) or wall_s <= 0.
std::optional<pipeline_breakdown> breakdown_between(const scheduler_stats& a,
                                                    const scheduler_stats& b, double wall_s);

/// The KV tiers' line of `troupe status` and `troupe bench`: slots used,
/// blocks moved each way and their bytes, blocks dropped; empty without
/// tiers.
std::string describe_kv_tiers(const scheduler_stats& s);

}  // namespace troupe::actors
