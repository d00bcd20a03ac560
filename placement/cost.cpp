#include "placement/cost.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "placement/format.hpp"

namespace troupe::placement {

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

/// amount / rate, with nothing to do costing nothing and no rate costing
/// forever.
double over(double amount, double rate) {
  if (amount <= 0) return 0;
  if (!(rate > 0)) return inf;
  return amount / rate;
}

}  // namespace

std::expected<void, std::string> validate(const workload& w) {
  if (w.batch < 1)
    return std::unexpected("workload: batch must be >= 1 (got " + std::to_string(w.batch) + ")");
  if (w.context_tokens < 0)
    return std::unexpected("workload: context tokens must be >= 0 (got " +
                           std::to_string(w.context_tokens) + ")");
  if (!(std::isfinite(w.images_per_step) && w.images_per_step >= 0))
    return std::unexpected("workload: images per step must be >= 0 (got " +
                           detail::num(w.images_per_step) + ")");
  if (!(std::isfinite(w.overhead_bytes) && w.overhead_bytes >= 0))
    return std::unexpected("workload: overhead must be >= 0 bytes (got " +
                           detail::num(w.overhead_bytes) + ")");
  return {};
}

unit_rates rates_of(const device_profile& d) {
  const double free = std::clamp(1.0 - d.load, 0.0, 1.0);
  unit_rates r;
  for (auto p : all_precisions) r.gemv_bytes_per_s[index(p)] = d.gemv(p) * free;
  r.gemm_flop_per_s = d.gemm_flop_per_s * free;
  r.kv_bytes_per_s = d.gemv(precision::f16) * free;
  r.tp = 1;
  return r;
}

unit_rates rates_of(std::span<const device_profile* const> group, const link_profile& link) {
  unit_rates r;
  if (group.empty()) return r;
  r = rates_of(*group.front());
  for (const auto* d : group.subspan(1)) {
    const auto m = rates_of(*d);
    for (std::size_t i = 0; i < r.gemv_bytes_per_s.size(); ++i)
      r.gemv_bytes_per_s[i] = std::min(r.gemv_bytes_per_s[i], m.gemv_bytes_per_s[i]);
    r.gemm_flop_per_s = std::min(r.gemm_flop_per_s, m.gemm_flop_per_s);
    r.kv_bytes_per_s = std::min(r.kv_bytes_per_s, m.kv_bytes_per_s);
  }
  const double k = static_cast<double>(group.size());
  for (auto& g : r.gemv_bytes_per_s) g *= k;
  r.gemm_flop_per_s *= k;
  r.kv_bytes_per_s *= k;
  r.tp = static_cast<int>(group.size());
  r.group_link = link;
  return r;
}

precision shard::at(int layer) const {
  const auto i = static_cast<std::size_t>(layer - layer_begin);
  if (layer_precision.empty() || layer < layer_begin || i >= layer_precision.size())
    return head_precision;
  return layer_precision[i];
}

double weight_bytes(const model_profile& m, const shard& s) {
  double sum = 0;
  for (int l = s.layer_begin; l < s.layer_end; ++l) sum += m.layer_bytes(l, s.at(l));
  if (s.has_embedding) sum += m.embedding_bytes(s.head_precision);
  if (s.has_lm_head) sum += m.head_bytes_on_stage(s.head_precision, s.has_embedding);
  return sum;
}

double kv_bytes(const model_profile& m, const workload& w, const shard& s) {
  double per_token = 0;
  for (int l = s.layer_begin; l < s.layer_end; ++l)
    per_token += m.layers[static_cast<std::size_t>(l)].kv_bytes_per_token;
  return double(w.batch) * double(w.context_tokens) * per_token;
}

double memory_per_device_bytes(const model_profile& m, const workload& w, const shard& s, int tp) {
  const double k = tp < 1 ? 1.0 : double(tp);
  return (weight_bytes(m, s) + kv_bytes(m, w, s)) / k + w.overhead_bytes;
}

compute_breakdown stage_compute(const unit_rates& r, const model_profile& m, const workload& w,
                                const shard& s) {
  compute_breakdown c;
  double flops = 0, kv = 0;
  for (int l = s.layer_begin; l < s.layer_end; ++l) {
    const auto& layer = m.layers[static_cast<std::size_t>(l)];
    const auto p = s.at(l);
    c.weights_s += over(m.layer_bytes(l, p), r.gemv_bytes_per_s[index(p)]);
    flops +=
        layer.flops_per_token + double(w.context_tokens) * layer.attention_flops_per_context_token;
    kv += layer.kv_bytes_per_token;
  }
  if (s.has_lm_head) {
    c.weights_s +=
        over(m.lm_head_bytes(s.head_precision), r.gemv_bytes_per_s[index(s.head_precision)]);
    flops += 2 * m.lm_head_params;
  }
  c.gemm_s = over(double(w.batch) * flops, r.gemm_flop_per_s);
  c.kv_s = over(double(w.batch) * double(w.context_tokens) * kv, r.kv_bytes_per_s);
  if (r.tp > 1)
    c.allreduce_s =
        2.0 * (s.layer_end - s.layer_begin) *
        allreduce_s(double(w.batch) * m.activation_bytes_per_token(), r.tp, r.group_link);
  return c;
}

double allreduce_s(double bytes, int k, const link_profile& link) {
  if (k <= 1) return 0;
  const double kk = k;
  return 2.0 * (kk - 1) / kk * over(bytes, link.bandwidth_bytes_per_s) +
         2.0 * (kk - 1) * link.latency_s;
}

double transfer_s(const link_profile& link, const model_profile& m, const workload& w) {
  return link.latency_s +
         over(double(w.batch) * m.activation_bytes_per_token(), link.bandwidth_bytes_per_s);
}

double encoder_bytes(const model_profile& m, precision preferred) {
  if (!m.vision) return 0;
  return m.vision->params * bytes_per_weight(preferred) +
         m.vision->projector_params * bytes_per_weight(projector_precision(preferred));
}

double encoder_s_per_image(const unit_rates& r, const model_profile& m) {
  if (!m.vision) return 0;
  return over(m.vision->flops_per_image + m.vision->projector_flops_per_image, r.gemm_flop_per_s);
}

pipeline_time pipeline(std::span<const stage_time> stages) {
  pipeline_time t;
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const double out = i + 1 < stages.size() ? stages[i].transfer_s : 0.0;
    t.step_s = std::max(t.step_s, stages[i].compute_s + out);
    t.latency_s += stages[i].compute_s + out;
  }
  return t;
}

}  // namespace troupe::placement
