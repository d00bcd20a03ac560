#pragma once

// The cost model: how long one decode step takes on a stage, how long the
// hand-off to the next stage takes, and how much memory a stage needs.
// Pure functions of measured profiles.
//
// Per stage on a device (seconds per decode step):
//   compute = max(weight bytes / GEMV bandwidth at each layer's precision,
//                 batch × FLOPs / GEMM FLOP/s)
//           + batch × context × KV bytes per token / KV bandwidth
//           (+ tensor-parallel all-reduces)
// with every rate multiplied by (1 - load).
//
// Queueing: a device that other work keeps busy a fraction ρ = load of the
// time is modelled as a processor-sharing queue, whose response time is
// service time / (1 - ρ); that is exactly the (1 - load) scaling of the
// rates above. No other queueing term is added: a decode pipeline is a
// closed loop (one step in flight per stage), so it does not queue behind
// itself.
//
// Transfer to the next stage: latency + batch × hidden × 4 bytes / link
// bandwidth. Throughput step time = the slowest stage's compute + outgoing
// transfer; per-token latency = the sum over stages.

#include <span>
#include <vector>

#include "placement/profile.hpp"

namespace troupe::placement {

/// What the cluster is asked to serve.
struct workload {
  /// Sequences decoded together in one step (batch size), >= 1.
  int batch = 1;
  /// Tokens of context per sequence; each decode step reads their KV.
  int context_tokens = 1024;
  /// Images encoded per decode step, on average (the vision encoder's
  /// amortised load; 0 = text only).
  double images_per_step = 0;
  /// Fixed memory every used device needs besides weights and KV:
  /// activations, scratch, runtime (bytes).
  double overhead_bytes = 256.0 * 1024 * 1024;
};

/// Checks batch >= 1, context >= 0, images >= 0, overhead >= 0.
std::expected<void, std::string> validate(const workload& w);

/// The effective rates one stage runs at: one device, or a tensor-parallel
/// group of `tp` devices on one node, which runs at tp × its slowest
/// member's rate (per precision). Load is already applied.
struct unit_rates {
  /// Weight bytes per second a decode GEMV streams, per precision (bytes/s).
  per_precision gemv_bytes_per_s{};
  /// GEMM rate (FLOP/s).
  double gemm_flop_per_s = 0;
  /// KV-cache read bandwidth (bytes/s): the f16 GEMV bandwidth.
  double kv_bytes_per_s = 0;
  /// Devices in the group (1 = a plain stage).
  int tp = 1;
  /// The link the group's all-reduces run over (tp > 1).
  link_profile group_link;
};

/// One device's rates × (1 - load).
unit_rates rates_of(const device_profile& d);

/// A tensor-parallel group's rates: size × the slowest member's rates,
/// all-reduces over `link`. An empty group has zero rates.
unit_rates rates_of(std::span<const device_profile* const> group, const link_profile& link);

/// What one pipeline stage holds: decoder layers [layer_begin, layer_end),
/// the embedding (first stage) and the LM head (last stage).
struct shard {
  int layer_begin = 0;
  int layer_end = 0;
  /// One precision per layer in the range; empty = all at head_precision.
  std::vector<precision> layer_precision;
  bool has_embedding = false;
  bool has_lm_head = false;
  /// Precision of the embedding and the LM head.
  precision head_precision = precision::f16;

  /// Precision of decoder layer `layer` (absolute index, in the range).
  precision at(int layer) const;
};

/// Weight bytes the shard holds (a tied embedding + LM head counted once).
double weight_bytes(const model_profile& m, const shard& s);

/// KV-cache bytes for batch × context tokens over the shard's layers.
double kv_bytes(const model_profile& m, const workload& w, const shard& s);

/// Memory on each device of a group of `tp` holding the shard (bytes):
/// (weights + KV) / tp + overhead.
double memory_per_device_bytes(const model_profile& m, const workload& w, const shard& s,
                               int tp = 1);

/// One decode step's compute on a stage, by term (seconds).
struct compute_breakdown {
  /// Streaming the weights once (bandwidth-bound GEMV).
  double weights_s = 0;
  /// batch × FLOPs at the GEMM rate (compute-bound).
  double gemm_s = 0;
  /// Reading batch × context tokens of KV.
  double kv_s = 0;
  /// Tensor-parallel all-reduces (two per layer).
  double allreduce_s = 0;

  /// max(weights, gemm) + kv + all-reduce.
  double total_s() const { return (weights_s > gemm_s ? weights_s : gemm_s) + kv_s + allreduce_s; }
};

/// Compute time of one decode step of shard `s` on a stage with rates `r`.
compute_breakdown stage_compute(const unit_rates& r, const model_profile& m, const workload& w,
                                const shard& s);

/// A ring all-reduce of `bytes` over `k` devices (seconds):
/// 2 (k-1)/k × bytes / bandwidth + 2 (k-1) × latency; 0 for k <= 1.
double allreduce_s(double bytes, int k, const link_profile& link);

/// Sending one step's activations (batch × hidden × 4 bytes) over `link`
/// (seconds): latency + bytes / bandwidth.
double transfer_s(const link_profile& link, const model_profile& m, const workload& w);

/// Precision of the projector: the preferred one, but never below f16.
constexpr precision projector_precision(precision preferred) {
  return most_precise(preferred, precision::f16);
}

/// Bytes of the vision encoder (at `preferred`) and projector (at
/// projector_precision(preferred)); 0 without a vision part.
double encoder_bytes(const model_profile& m, precision preferred);

/// Encoding one image (encoder + projector FLOPs at the GEMM rate),
/// seconds; 0 without a vision part.
double encoder_s_per_image(const unit_rates& r, const model_profile& m);

/// A stage's time per decode step (seconds).
struct stage_time {
  double compute_s = 0;
  /// Sending to the next stage; 0 for the last.
  double transfer_s = 0;
};

/// A pipeline's step time estimates (seconds).
struct pipeline_time {
  /// Throughput bound: the slowest stage's compute + outgoing transfer.
  double step_s = 0;
  /// Per-token latency: every stage's compute + transfer, summed.
  double latency_s = 0;
};

/// Step time and latency of stages run as a pipeline.
pipeline_time pipeline(std::span<const stage_time> stages);

}  // namespace troupe::placement
