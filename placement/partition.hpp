#pragma once

// The planner's partition search (internal to placement/): stage units, the
// per-stage cost in O(log layers) from prefix sums, and the dynamic
// programme over (layer suffix, position in an ordered unit list).

#include <optional>
#include <vector>

#include "placement/cost.hpp"
#include "placement/planner.hpp"
#include "placement/profile.hpp"

namespace troupe::placement::detail {

/// A place a stage can run: one device, or a tensor-parallel group of
/// devices on one node.
struct unit {
  /// Indices into cluster_profile::devices.
  std::vector<int> members;
  /// Index of the node (into problem::node_names).
  int node = 0;
  unit_rates rates;
  /// Bytes of weights + KV the unit can hold: size × the smallest member's
  /// (memory × fraction - overhead - reserved).
  double capacity_bytes = 0;
  /// Seconds added to the compute of a stage on this unit (the vision
  /// encoder's per-step load when memory is reserved for it here).
  double extra_s = 0;
  /// All-reduce time per layer (two all-reduces; 0 for a single device).
  double allreduce_per_layer_s = 0;
  /// Sort key: effective GEMV bandwidth at the preferred precision.
  double speed = 0;
  /// Prefix sums over layers of the parameters the current plan already
  /// holds on exactly these devices (empty: none).
  std::vector<double> stay_params;
};

/// Everything the partition search needs.
struct problem {
  const model_profile* model = nullptr;
  const workload* work = nullptr;
  precision preferred = precision::f16;
  /// Non-sensitive layers may go down to this.
  precision lowest = precision::f16;
  std::vector<unit> units;
  int node_count = 0;
  /// Activation transfer time between nodes a and b: [a * node_count + b].
  std::vector<double> transfer_s;
  /// A current plan is given: weights not already on their unit count as
  /// moved (see unit::stay_params).
  bool has_current = false;
};

/// Units in the order a pipeline may visit them (indices into
/// problem::units); a split uses any subsequence.
using unit_order = std::vector<int>;

/// A stage the search chose.
struct chosen_stage {
  int unit = 0;
  int begin = 0;
  int end = 0;
  std::vector<precision> precisions;
  /// Compute (with extra_s) and outgoing transfer, seconds.
  double compute_s = 0;
  double transfer_s = 0;
};

/// A partition: stages, its step time, latency and precision loss.
struct partition {
  std::vector<chosen_stage> stages;
  double step_s = 0;
  double latency_s = 0;
  /// Σ lowered params × precision steps lowered.
  double loss = 0;
  /// Parameters not already on their unit in the current plan.
  double moved = 0;
};

/// The dynamic programme. Reuses its buffers across calls.
///
/// f[pos][i] is the best value for layers [i, L) when the unit at `pos`
/// holds the stage starting at layer i and later stages use units after
/// `pos`. Processing positions from the back, it keeps for every node the
/// best f over the units of that node seen so far; the next stage's node
/// then only matters through the transfer time to it, so each (pos, j)
/// needs one pass over the nodes sorted by that transfer time.
class partitioner {
 public:
  explicit partitioner(const problem& p);

  /// The smallest throughput step time over `order` (seconds; infinity when
  /// no split fits). `uncovered`, when given, receives how many leading
  /// layers no split over `order` can hold (0 when one fits): a measure of
  /// how far an order is from fitting.
  double min_step(const unit_order& order, int* uncovered = nullptr);

  /// Among the splits over `order` whose every stage (compute + outgoing
  /// transfer) is <= limit_s: the one with the least precision loss, then
  /// the fewest parameters moved from the current plan, then the lowest
  /// latency.
  std::optional<partition> best_within(const unit_order& order, double limit_s);

  /// The cost of layers [i, j) on unit u.
  struct stage_eval {
    bool fits = false;
    double time_s = 0;
    double loss = 0;
    /// Non-sensitive layers at level `phase`, the first `lowered` of them one
    /// level lower (levels: preferred, then each lower precision).
    int phase = 0;
    int lowered = 0;
  };
  stage_eval eval(const unit& u, int i, int j) const;
  /// A lower bound on eval(u, i, j).time_s that never decreases with j.
  double lower_bound_s(const unit& u, int i, int j) const;
  /// Parameters of layers [i, j) the current plan does not hold on u.
  double moved_params(const unit& u, int i, int j) const;
  /// Per-layer precisions of a stage as eval chose them.
  std::vector<precision> precisions(int i, int j, const stage_eval& e) const;

 private:
  double transfer(int node_a, int node_b) const {
    return p_.transfer_s[static_cast<std::size_t>(node_a * p_.node_count + node_b)];
  }

  const problem& p_;
  int layers_ = 0;
  std::vector<precision> levels_;  // preferred … lowest
  // Prefix sums over layers (size layers + 1).
  std::vector<double> sens_params_, ns_params_, flops_, kv_per_token_;
  std::vector<double> sens_bytes_, ns_bytes_;  // weight bytes at the preferred level
  std::vector<int> ns_before_;                 // non-sensitive layers before l
  std::vector<double> ns_prefix_;              // params of the first q non-sensitive layers
  // Buffers.
  std::vector<double> f_;
  std::vector<int> next_j_, next_pos_;
  std::vector<std::vector<int>> nodes_by_transfer_;  // per node: nodes, nearest first
};

/// Puts the vision encoder of `m` on the device of `c` where it raises the
/// step time of `p` (costed without an encoder) least, then where it encodes
/// an image fastest, among devices with memory left. False when none has
/// room; a tie on step time goes to `prefer` (the current encoder device).
/// Leaves `p` without an encoder for a model without vision.
bool place_encoder(plan& p, const cluster_profile& c, const model_profile& m, const workload& w,
                   const planner_options& opt,
                   const std::optional<std::string>& prefer = std::nullopt);

/// Checks the planner options.
std::expected<void, std::string> validate(const planner_options& opt);

}  // namespace troupe::placement::detail
