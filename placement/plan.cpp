// The plan type, re-costing a plan, the vision encoder's placement and the
// brute-force reference planner.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "placement/format.hpp"
#include "placement/partition.hpp"
#include "placement/planner.hpp"

namespace troupe::placement {

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

std::unexpected<std::string> fail(std::string msg) {
  return std::unexpected(std::move(msg));
}

/// The link a tensor-parallel group all-reduces over: the slowest link
/// between its members' nodes (the node's own link when they share one).
link_profile group_link(const cluster_profile& c,
                        const std::vector<const device_profile*>& members) {
  link_profile worst = c.link(members.front()->node, members.front()->node).value_or(c.local_link);
  const bool one_node = std::all_of(members.begin(), members.end(), [&](const device_profile* d) {
    return d->node == members.front()->node;
  });
  if (one_node) return worst;
  for (const auto* a : members)
    for (const auto* b : members) {
      const auto l = c.link(a->node, b->node);
      if (!l) continue;
      if (l->bandwidth_bytes_per_s < worst.bandwidth_bytes_per_s)
        worst.bandwidth_bytes_per_s = l->bandwidth_bytes_per_s;
      if (l->latency_s > worst.latency_s) worst.latency_s = l->latency_s;
    }
  return worst;
}

}  // namespace

const stage* plan::stage_of(int layer) const {
  for (const auto& s : stages)
    if (layer >= s.layer_begin && layer < s.layer_end) return &s;
  return nullptr;
}

double plan::lowered_params(const model_profile& m, precision preferred) const {
  double sum = 0;
  for (const auto& s : stages)
    for (int l = s.layer_begin; l < s.layer_end; ++l) {
      const auto i = static_cast<std::size_t>(l - s.layer_begin);
      if (i >= s.layer_precision.size() || static_cast<std::size_t>(l) >= m.layers.size()) continue;
      const int steps = rank(preferred) - rank(s.layer_precision[i]);
      if (steps > 0) sum += steps * m.layers[static_cast<std::size_t>(l)].params;
    }
  return sum;
}

std::string plan::describe() const {
  std::string out = "plan: " + std::to_string(stages.size()) + " stage" +
                    (stages.size() == 1 ? "" : "s") + ", step " + detail::ms(step_s) +
                    " (throughput), latency " + detail::ms(latency_s) + " per token\n";
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const auto& s = stages[i];
    out += "  stage " + std::to_string(i) + ": ";
    for (std::size_t d = 0; d < s.devices.size(); ++d) out += (d ? "+" : "") + s.devices[d];
    if (s.devices.size() > 1) out += " (TP " + std::to_string(s.devices.size()) + ")";
    out += " layers [" + std::to_string(s.layer_begin) + "," + std::to_string(s.layer_end) + ")";
    for (auto p : all_precisions) {
      const auto n = std::count(s.layer_precision.begin(), s.layer_precision.end(), p);
      if (n) out += std::string(" ") + to_string(p) + "x" + std::to_string(n);
    }
    out += ", compute " + detail::ms(s.compute_s);
    if (i + 1 < stages.size()) out += ", send " + detail::ms(s.transfer_s);
    out += "\n";
  }
  out += std::string("  embedding and LM head: ") + to_string(head_precision) + "\n";
  if (encoder_device)
    out += "  vision encoder: " + *encoder_device + " (" + to_string(encoder_precision) +
           ", projector " + to_string(projector_precision) + ", " +
           detail::ms(encoder_s_per_image) + " per image)\n";
  out += "  memory:";
  for (const auto& [id, bytes] : memory_bytes) out += " " + id + " " + detail::bytes(bytes) + ";";
  out += "\n";
  return out;
}

result<plan> evaluate(const plan& p, const cluster_profile& cluster, const model_profile& model,
                      const workload& w) {
  if (auto ok = validate(model); !ok) return fail(ok.error());
  if (auto ok = validate(w); !ok) return fail(ok.error());
  if (p.stages.empty()) return fail("the plan has no stages");
  const int layers = model.layer_count();
  plan out = p;
  out.memory_bytes.clear();
  std::vector<std::vector<const device_profile*>> members(p.stages.size());
  int next = 0;
  for (std::size_t i = 0; i < p.stages.size(); ++i) {
    const auto& s = p.stages[i];
    const std::string what = "stage " + std::to_string(i);
    if (s.layer_begin != next || s.layer_end <= s.layer_begin || s.layer_end > layers)
      return fail(what + " holds layers [" + std::to_string(s.layer_begin) + "," +
                  std::to_string(s.layer_end) +
                  "), which does not continue the stages before it within the model's " +
                  std::to_string(layers) + " layers");
    if (!s.layer_precision.empty() &&
        s.layer_precision.size() != static_cast<std::size_t>(s.layer_end - s.layer_begin))
      return fail(what + " has " + std::to_string(s.layer_precision.size()) + " precisions for " +
                  std::to_string(s.layer_end - s.layer_begin) + " layers");
    if (s.devices.empty()) return fail(what + " has no device");
    for (const auto& id : s.devices) {
      const auto* d = cluster.find(id);
      if (!d) return fail(what + ": device " + id + " is not in the cluster");
      members[i].push_back(d);
    }
    next = s.layer_end;
  }
  if (next != layers)
    return fail("the plan covers layers [0," + std::to_string(next) + ") of " +
                std::to_string(layers));

  const device_profile* encoder = nullptr;
  if (p.encoder_device) {
    encoder = cluster.find(*p.encoder_device);
    if (!encoder)
      return fail("vision encoder device " + *p.encoder_device + " is not in the cluster");
  }
  const double encoder_step_s =
      encoder ? w.images_per_step * encoder_s_per_image(rates_of(*encoder), model) : 0.0;
  out.encoder_s_per_image = encoder ? encoder_s_per_image(rates_of(*encoder), model) : 0.0;

  std::vector<stage_time> times;
  bool encoder_in_stage = false;
  for (std::size_t i = 0; i < p.stages.size(); ++i) {
    auto& s = out.stages[i];
    shard sh;
    sh.layer_begin = s.layer_begin;
    sh.layer_end = s.layer_end;
    sh.layer_precision = s.layer_precision;
    sh.has_embedding = i == 0;
    sh.has_lm_head = i + 1 == p.stages.size();
    sh.head_precision = p.head_precision;
    const int tp = static_cast<int>(members[i].size());
    const unit_rates r = tp == 1 ? rates_of(*members[i].front())
                                 : rates_of(members[i], group_link(cluster, members[i]));
    s.compute_s = stage_compute(r, model, w, sh).total_s();
    const bool holds_encoder =
        encoder && std::find(members[i].begin(), members[i].end(), encoder) != members[i].end();
    if (holds_encoder) {
      s.compute_s += encoder_step_s;
      encoder_in_stage = true;
    }
    s.transfer_s = 0;
    if (i + 1 < p.stages.size()) {
      const auto l = cluster.link(members[i].front()->node, members[i + 1].front()->node);
      if (!l)
        return fail("no link between nodes " + members[i].front()->node + " and " +
                    members[i + 1].front()->node);
      s.transfer_s = transfer_s(*l, model, w);
    }
    times.push_back({s.compute_s, s.transfer_s});
    const double mem = memory_per_device_bytes(model, w, sh, tp);
    for (const auto* d : members[i]) {
      auto [it, fresh] = out.memory_bytes.try_emplace(d->id, mem);
      if (!fresh) it->second += mem - w.overhead_bytes;
    }
  }
  const auto t = pipeline(times);
  out.step_s = t.step_s;
  out.latency_s = t.latency_s;
  if (encoder) {
    if (!encoder_in_stage) out.step_s = std::max(out.step_s, encoder_step_s);
    const double bytes =
        model.vision ? model.vision->params * bytes_per_weight(p.encoder_precision) +
                           model.vision->projector_params * bytes_per_weight(p.projector_precision)
                     : 0.0;
    auto [it, fresh] = out.memory_bytes.try_emplace(encoder->id, bytes + w.overhead_bytes);
    if (!fresh) it->second += bytes;
  }
  return out;
}

namespace detail {

std::expected<void, std::string> validate(const planner_options& opt) {
  if (!at_least(opt.preferred, opt.min_precision))
    return fail(std::string("planner options: min_precision ") + to_string(opt.min_precision) +
                " is more precise than preferred " + to_string(opt.preferred));
  if (opt.max_tensor_parallel < 1)
    return fail("planner options: max_tensor_parallel must be >= 1 (got " +
                std::to_string(opt.max_tensor_parallel) + ")");
  if (!(opt.memory_fraction > 0 && opt.memory_fraction <= 1))
    return fail("planner options: memory_fraction must be in (0, 1] (got " +
                num(opt.memory_fraction) + ")");
  if (!(std::isfinite(opt.step_time_slack) && opt.step_time_slack >= 0))
    return fail("planner options: step_time_slack must be >= 0 (got " + num(opt.step_time_slack) +
                ")");
  return {};
}

bool place_encoder(plan& p, const cluster_profile& c, const model_profile& m, const workload& w,
                   const planner_options& opt, const std::optional<std::string>& prefer) {
  p.encoder_device.reset();
  p.encoder_precision = opt.preferred;
  p.projector_precision = projector_precision(opt.preferred);
  if (!m.vision) return true;
  const double need = encoder_bytes(m, opt.preferred);
  const device_profile* best = nullptr;
  double best_step = inf, best_image = inf;
  for (const auto& d : c.devices) {
    if (d.load >= 1) continue;
    const auto used = p.memory_bytes.find(d.id);
    const double free = d.memory_bytes * opt.memory_fraction -
                        (used == p.memory_bytes.end() ? w.overhead_bytes : used->second);
    if (free < need) continue;
    const double image_s = encoder_s_per_image(rates_of(d), m);
    const double add = w.images_per_step * image_s;
    double step = 0;
    bool in_stage = false;
    for (const auto& s : p.stages) {
      const bool here = std::find(s.devices.begin(), s.devices.end(), d.id) != s.devices.end();
      in_stage = in_stage || here;
      step = std::max(step, s.compute_s + s.transfer_s + (here ? add : 0.0));
    }
    if (!in_stage) step = std::max(step, add);
    const bool tie = std::abs(step - best_step) <= 1e-12 * std::max(step, best_step);
    const bool preferred = prefer && d.id == *prefer;
    const bool best_preferred = best && prefer && best->id == *prefer;
    if ((!tie && step < best_step) ||
        (tie && !best_preferred && (preferred || image_s < best_image))) {
      best = &d;
      best_step = step;
      best_image = image_s;
    }
  }
  if (!best) return false;
  p.encoder_device = best->id;
  return true;
}

}  // namespace detail

result<plan> exhaustive_plan(const cluster_profile& cluster, const model_profile& model,
                             const workload& w, const planner_options& opt) {
  if (auto ok = validate(cluster); !ok) return fail(ok.error());
  if (auto ok = validate(model); !ok) return fail(ok.error());
  if (auto ok = validate(w); !ok) return fail(ok.error());
  if (auto ok = detail::validate(opt); !ok) return fail(ok.error());
  const int D = static_cast<int>(cluster.devices.size());
  const int L = model.layer_count();
  if (D > 6 || L > 10)
    return fail("exhaustive_plan handles at most 6 devices and 10 layers (got " +
                std::to_string(D) + " and " + std::to_string(L) + ")");
  // compute[d][i][j]: stage [i, j) on device d, or infinity when it does not fit.
  auto cell = [&](int d, int i, int j) {
    return (static_cast<std::size_t>(d) * (L + 1) + i) * (L + 1) + j;
  };
  std::vector<double> compute(static_cast<std::size_t>(D) * (L + 1) * (L + 1), inf);
  for (int d = 0; d < D; ++d) {
    const auto& dev = cluster.devices[static_cast<std::size_t>(d)];
    const auto r = rates_of(dev);
    for (int i = 0; i < L; ++i)
      for (int j = i + 1; j <= L; ++j) {
        shard sh{
            i,      j,      std::vector<precision>(static_cast<std::size_t>(j - i), opt.preferred),
            i == 0, j == L, opt.preferred};
        if (memory_per_device_bytes(model, w, sh, 1) > dev.memory_bytes * opt.memory_fraction)
          continue;
        compute[cell(d, i, j)] = stage_compute(r, model, w, sh).total_s();
      }
  }
  std::vector<double> link_s(static_cast<std::size_t>(D * D));
  for (int a = 0; a < D; ++a)
    for (int b = 0; b < D; ++b)
      link_s[static_cast<std::size_t>(a * D + b)] =
          transfer_s(*cluster.link(cluster.devices[static_cast<std::size_t>(a)].node,
                                   cluster.devices[static_cast<std::size_t>(b)].node),
                     model, w);
  struct pick {
    int device, begin, end;
  };
  std::vector<pick> path, best_path;
  double best_step = inf, best_latency = inf;
  std::vector<bool> used(static_cast<std::size_t>(D), false);
  std::function<void(int)> walk = [&](int i) {
    if (i == L) {
      double step = 0, latency = 0;
      for (std::size_t s = 0; s < path.size(); ++s) {
        double t = compute[cell(path[s].device, path[s].begin, path[s].end)];
        if (s + 1 < path.size())
          t += link_s[static_cast<std::size_t>(path[s].device * D + path[s + 1].device)];
        step = std::max(step, t);
        latency += t;
      }
      if (step < best_step || (step == best_step && latency < best_latency)) {
        best_step = step;
        best_latency = latency;
        best_path = path;
      }
      return;
    }
    for (int d = 0; d < D; ++d) {
      if (used[static_cast<std::size_t>(d)]) continue;
      used[static_cast<std::size_t>(d)] = true;
      for (int j = i + 1; j <= L; ++j) {
        if (!std::isfinite(compute[cell(d, i, j)])) continue;
        path.push_back({d, i, j});
        walk(j);
        path.pop_back();
      }
      used[static_cast<std::size_t>(d)] = false;
    }
  };
  walk(0);
  if (best_path.empty())
    return fail("no ordered subset of the devices holds the model at " +
                std::string(to_string(opt.preferred)));
  plan p;
  p.head_precision = opt.preferred;
  for (const auto& s : best_path)
    p.stages.push_back(
        {{cluster.devices[static_cast<std::size_t>(s.device)].id},
         s.begin,
         s.end,
         std::vector<precision>(static_cast<std::size_t>(s.end - s.begin), opt.preferred),
         0,
         0});
  auto costed = evaluate(p, cluster, model, w);
  if (!costed) return costed;
  if (!detail::place_encoder(*costed, cluster, model, w, opt))
    return fail("the vision encoder fits on no device beside the decoder");
  return evaluate(*costed, cluster, model, w);
}

}  // namespace troupe::placement
