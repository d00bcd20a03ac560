#pragma once

// The head's side of placement (the planner itself is placement/, pure):
// what the head turns its nodes' reports into for the planner, and the
// planner's answers back into stages to load. Plain code, no CAF, so that
// each translation is testable on its own.

#include <chrono>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "actors/protocol.hpp"
#include "cluster/membership.hpp"
#include "kernels/quant.hpp"
#include "models/llama.hpp"
#include "models/llama_config.hpp"
#include "models/llava_config.hpp"
#include "placement/planner.hpp"
#include "placement/policy.hpp"

namespace troupe::actors {

/// The planner's precision for a weight format (int8 as q8_0, int4 as
/// q4_0, bf16 as f16: the same bytes per weight, near enough; the other GGUF
/// formats as the tier at or above their bits per weight).
placement::precision precision_of(kernels::weight_format f);

/// Marks `m`'s decoder as held in the formats `held` lists (what every
/// stage will load, models::decoder_formats) at tier `tier`: each layer's,
/// the embedding's and the LM head's bytes there are the prepared matrices'
/// (kernels::held_bits_per_weight) plus f32 for the rest of their
/// parameters (norms, biases); the embedding table stays in the file's
/// blocks.
void hold_as_stored(placement::model_profile& m, const std::vector<models::held_matrix>& held,
                    placement::precision tier);

/// The decoder (and vision tower) as the planner sees it; KV bytes per
/// token for the cache's dtype ("f32", "f16", "int8").
placement::result<placement::model_profile> model_profile_of(
    const models::llama_config& text, const std::optional<models::llava_config>& llava,
    const std::string& kv_type);

/// One node's measurements as the head holds them.
struct node_measure {
  std::string node;
  device_probe probe;
  double load = 0;
};

/// "node1:cpu:1-1": a device's id in plans.
std::string device_id(const std::string& node, const std::string& device);

/// The planner's view of the nodes (one device each) and the links
/// measured between them. GEMM throughput is the one measured for the
/// weights' format `p`. A pair of nodes without a measured link gets
/// the slowest measured one (`default_remote_link`), or 1 GB/s and 100 us
/// when none was measured. Nodes whose probe is missing are left out.
placement::cluster_profile cluster_profile_of(const std::vector<node_measure>& nodes,
                                              const std::vector<placement::link_profile>& links,
                                              placement::precision p);

/// The stages of a plan as the cluster loads them (node by device id).
/// Errors on a tensor-parallel stage or a device no node owns.
/// The fixed rule over nodes (`pipeline_stages = N`; 0: one stage per
/// usable node): placement::even_split over the first usable nodes in
/// manifest order, the head's first (it runs the scheduler and the vision
/// encoder, so the first stage's inputs stay local); fewer nodes than
/// stages: as many stages as nodes. With `tensor_parallel` = k > 1 each
/// stage is a group of k nodes in that order (rank 0 first), and fewer
/// than k nodes place nothing. Empty when no node is usable or the head
/// is not.
std::vector<cluster::stage_slot> fixed_slots(int layers, int stages,
                                             const std::vector<std::string>& usable,
                                             const std::string& head, int tensor_parallel = 1);

placement::result<std::vector<cluster::stage_slot>> slots_of(const placement::plan& p,
                                                             const placement::cluster_profile& c);

/// A placement the cluster runs (slots by node), as a plan the planner can
/// re-cost with `placement::evaluate`: every layer at `p`, the encoder on
/// `encoder_node`'s device (if any).
placement::result<placement::plan> plan_of(const std::vector<cluster::stage_slot>& slots,
                                           const placement::cluster_profile& c,
                                           placement::precision p, const std::string& encoder_node);

/// How the cluster turns the stages `current` into `target`. The same
/// layer split: live migrations of the stages whose node changes (by
/// index), then of the encoder when `encoder_to` is another node than
/// `encoder_from` (empty `encoder_to`: it stays). Another split: a
/// re-placement (`resplit`), the encoder moved afterwards.
struct plan_change {
  bool resplit = false;
  std::vector<migrate_request> moves;
};
plan_change change_between(const std::vector<cluster::stage_slot>& current,
                           const std::vector<cluster::stage_slot>& target,
                           const std::string& encoder_from, const std::string& encoder_to);

/// Generated tokens over time (the scheduler's running count), sampled at
/// heartbeats; the rate over a window for the decision log.
class token_rate {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  /// A sample; samples come in time order. Kept for `keep`.
  void add(time_point t, std::int64_t tokens,
           std::chrono::seconds keep = std::chrono::seconds(600));
  /// Tokens per second between the samples nearest `from` and `to` (both
  /// inside the window); nullopt with fewer than two samples there or
  /// under `min_span` between them.
  std::optional<double> rate(
      time_point from, time_point to,
      std::chrono::milliseconds min_span = std::chrono::milliseconds(2000)) const;

 private:
  std::deque<std::pair<time_point, std::int64_t>> samples_;
};

}  // namespace troupe::actors
