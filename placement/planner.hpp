#pragma once

// The planner: which decoder layers form which pipeline stage on which
// device (or tensor-parallel group) at which precision, and where the vision
// encoder runs. Pure: the caller passes measured profiles in and gets a
// plan (or a reason why none fits) out.
//
// make_plan minimises the throughput step time (the slowest stage's
// compute + outgoing transfer) subject to every device's memory; among the
// plans within `step_time_slack` of the fastest it takes the one that lowers
// the fewest weights, then the one with the lowest per-token latency.
//
//  - Partition: a dynamic programme over (layer suffix, position in an
//    ordered list of stage units) that may skip units, so one run considers
//    every subset of the units in that order; O(units × layers²) stage
//    evaluations (each O(log layers)) with early cut-offs, plus
//    O(units × layers × nodes) for the next-hop transfers.
//  - Orders tried: units of one node are kept together so a pipeline
//    crosses few inter-node links: every order of the nodes when there are
//    at most 5 nodes and 12 units, else nearest-neighbour chains along the
//    fastest links (from the two strongest nodes, and reversed); within a
//    node, units fastest first and slowest first (this decides which one
//    holds the embedding / LM head). With at most 12 units, the best order
//    is then improved by local search (move or swap units, at most 300
//    orders costed), which may split a node's units when that pays.
//  - Tensor parallelism (when allowed): for each group size k = 2, 4, 8 …
//    (<= max_tensor_parallel) each node's like devices, fastest first, are
//    chunked into groups of k (leftovers stay single) and the partition is
//    run over those units too; the cost model decides which wins.
//  - Precision: first every layer at `preferred`. If nothing fits, the
//    non-sensitive layers of a stage may go one step lower (q8_0, then
//    q4_0, never below `min_precision`), in layer order, only as far as
//    that stage needs to fit its device; sensitive layers, the embedding,
//    the LM head and the vision encoder stay at `preferred`, the projector
//    at f16 or better.
//  - The vision encoder goes where it raises the step time least (then
//    where it encodes an image fastest), on a device with memory left; if
//    none has, memory is reserved for it on the devices with the most
//    memory and the decoder is planned around it.

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "placement/cost.hpp"
#include "placement/profile.hpp"

namespace troupe::placement {

/// Knobs of the planner.
struct planner_options {
  /// Precision every layer starts at.
  precision preferred = precision::f16;
  /// Non-sensitive layers are never lowered below this.
  precision min_precision = precision::q4_0;
  /// Form tensor-parallel groups of devices on one node when faster.
  bool allow_tensor_parallel = true;
  /// Largest tensor-parallel group (devices).
  int max_tensor_parallel = 8;
  /// Use at most this fraction of each device's memory, in (0, 1].
  double memory_fraction = 1.0;
  /// Accept a plan whose step time is up to this fraction slower than the
  /// fastest one found, when it lowers fewer weights or has lower latency.
  double step_time_slack = 0.0;
};

/// One pipeline stage of a plan.
struct stage {
  /// Device ids: one for a plain stage, k > 1 for a tensor-parallel group.
  std::vector<std::string> devices;
  /// Decoder layers [layer_begin, layer_end).
  int layer_begin = 0;
  int layer_end = 0;
  /// Precision of each layer in the range.
  std::vector<precision> layer_precision;
  /// Predicted compute time per decode step, including the vision encoder's
  /// share when it runs on one of these devices (seconds).
  double compute_s = 0;
  /// Predicted time to send activations to the next stage (seconds; 0 for
  /// the last stage).
  double transfer_s = 0;
};

/// A placement: pipeline stages in order, the encoder's device and the
/// predicted times and memory.
struct plan {
  std::vector<stage> stages;
  /// Precision of the embedding and LM head.
  precision head_precision = precision::f16;
  /// Device running the vision encoder and projector (models with vision).
  std::optional<std::string> encoder_device;
  precision encoder_precision = precision::f16;
  precision projector_precision = precision::f16;
  /// Encoding one image on encoder_device (seconds).
  double encoder_s_per_image = 0;
  /// Throughput bound: slowest stage's compute + outgoing transfer, or the
  /// encoder's per-step load on a device without a stage (seconds).
  double step_s = 0;
  /// Per-token latency through all stages (seconds).
  double latency_s = 0;
  /// Memory each used device needs (bytes), overhead included.
  std::map<std::string, double> memory_bytes;

  /// The stage holding decoder layer `layer`, or nullptr.
  const stage* stage_of(int layer) const;
  /// Decoder weight parameters held below `preferred` × the precision
  /// steps they were lowered (0 when nothing was lowered).
  double lowered_params(const model_profile& m, precision preferred) const;
  /// Multi-line human-readable summary.
  std::string describe() const;
};

/// The fixed rule (a manifest's `pipeline_stages = N`, `troupe generate
/// --stages N`): `parts` contiguous layer ranges [first, last) of as even a
/// size as the layers allow (part s holds [s*L/parts, (s+1)*L/parts)).
/// Empty when layers < 1 or parts < 1; at most `layers` parts.
std::vector<std::pair<int, int>> even_split(int layers, int parts);

/// The best plan the planner finds for `model` on `cluster` under `w`
/// (see the top of this file), or an error naming what does not fit or
/// which input is invalid.
result<plan> make_plan(const cluster_profile& cluster, const model_profile& model,
                       const workload& w, const planner_options& opt = {});

/// Like make_plan, but among the plans as fast as the best one (within
/// step_time_slack) and lowering as few weights, prefers the one that moves
/// the fewest decoder weights off the devices `current` has them on (and
/// keeps the vision encoder where it is on a tie): re-planning then moves
/// only what it must.
result<plan> make_plan_near(const plan& current, const cluster_profile& cluster,
                            const model_profile& model, const workload& w,
                            const planner_options& opt = {});

/// Brute force over every ordered subset of devices and every split of the
/// layers (no tensor parallelism, every layer at opt.preferred): the
/// reference for tests. At most 6 devices and 10 layers.
result<plan> exhaustive_plan(const cluster_profile& cluster, const model_profile& model,
                             const workload& w, const planner_options& opt = {});

/// `p`'s layout re-costed under new measurements: stage times, step time,
/// latency and memory. Errors when a device of the plan is not in the
/// cluster or the plan does not cover the model's layers.
result<plan> evaluate(const plan& p, const cluster_profile& cluster, const model_profile& model,
                      const workload& w);

/// What re-planning would buy.
struct replan_estimate {
  /// The current plan re-costed under the new measurements.
  plan current;
  /// A fresh plan for the new measurements.
  plan proposed;
  /// current.step_s and proposed.step_s (seconds).
  double current_step_s = 0;
  double proposed_step_s = 0;
  /// (current - proposed) / current: 0.2 = 20% faster steps.
  double gain = 0;
};

/// Re-costs `current` and plans afresh (make_plan_near) under the new
/// measurements.
result<replan_estimate> replan_gain(const plan& current, const cluster_profile& cluster,
                                    const model_profile& model, const workload& w,
                                    const planner_options& opt = {});

}  // namespace troupe::placement
