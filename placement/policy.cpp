#include "placement/policy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "placement/format.hpp"

namespace troupe::placement {

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

std::unexpected<std::string> fail(std::string msg) {
  return std::unexpected(std::move(msg));
}

double seconds(duration d) {
  return std::chrono::duration<double>(d).count();
}

std::string join(const std::vector<std::string>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? "+" : "") + ids[i];
  return out;
}

std::string range_name(int begin, int end) {
  return end - begin == 1 ? "layer " + std::to_string(begin)
                          : "layers " + std::to_string(begin) + "-" + std::to_string(end - 1);
}

/// Where layer `l` lives in `p` and at which precision.
struct placed {
  std::vector<std::string> devices;
  precision prec = precision::f16;
  bool operator==(const placed&) const = default;
};

placed where(const plan& p, int l) {
  const auto* s = p.stage_of(l);
  if (!s) return {};
  const auto i = static_cast<std::size_t>(l - s->layer_begin);
  return {s->devices, i < s->layer_precision.size() ? s->layer_precision[i] : p.head_precision};
}

/// The moves that turn `from` into `to`: maximal runs of layers with the
/// same old and new placement, then the vision encoder.
std::vector<move> diff(const plan& from, const plan& to, int layers) {
  std::vector<move> out;
  for (int l = 0; l < layers;) {
    const auto a = where(from, l), b = where(to, l);
    if (a == b) {
      ++l;
      continue;
    }
    int e = l + 1;
    while (e < layers && where(from, e) == a && where(to, e) == b) ++e;
    move m;
    m.shard = range_name(l, e);
    m.layer_begin = l;
    m.layer_end = e;
    m.from = a.devices;
    m.to = b.devices;
    m.from_precision = a.prec;
    m.to_precision = b.prec;
    out.push_back(std::move(m));
    l = e;
  }
  if (to.encoder_device && from.encoder_device != to.encoder_device) {
    move m;
    m.shard = "vision";
    m.vision = true;
    if (from.encoder_device) m.from = {*from.encoder_device};
    m.to = {*to.encoder_device};
    m.from_precision = from.encoder_precision;
    m.to_precision = to.encoder_precision;
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace

std::string move::describe() const {
  std::string out =
      shard + ": " + (from.empty() ? std::string("(nowhere)") : join(from)) + " -> " + join(to);
  out += from_precision == to_precision ? std::string(" (") + to_string(to_precision) + ")"
                                        : std::string(" (") + to_string(from_precision) + " -> " +
                                              to_string(to_precision) + ")";
  return out;
}

result<decision> decide(policy_state& state, const plan& current, const cluster_profile& cluster,
                        const model_profile& model, const workload& w, time_point now,
                        const policy_options& opt) {
  if (!(std::isfinite(opt.gain_threshold) && opt.gain_threshold >= 0))
    return fail("policy options: gain_threshold must be >= 0 (got " +
                detail::num(opt.gain_threshold) + ")");
  if (!(opt.memory_pressure > 0 && opt.memory_pressure <= 1))
    return fail("policy options: memory_pressure must be in (0, 1] (got " +
                detail::num(opt.memory_pressure) + ")");
  if (opt.cooldown.count() < 0 || opt.load_half_life.count() < 0)
    return fail("policy options: cooldown and load_half_life must be >= 0");
  if (auto ok = validate(cluster); !ok) return fail(ok.error());
  if (auto ok = validate(model); !ok) return fail(ok.error());

  // 1. Smooth the measured loads.
  cluster_profile seen = cluster;
  for (auto& d : seen.devices) {
    auto it = state.loads.find(d.id);
    if (it == state.loads.end() || opt.load_half_life.count() == 0) {
      state.loads[d.id] = {d.load, now};
      continue;
    }
    const double dt = std::max(0.0, seconds(now - it->second.at));
    const double alpha = 1 - std::exp2(-dt / seconds(opt.load_half_life));
    it->second.load += alpha * (d.load - it->second.load);
    it->second.at = std::max(now, it->second.at);
    d.load = std::clamp(it->second.load, 0.0, 1.0);
  }

  // 2. The plan in force, re-costed: gone devices, memory pressure.
  std::set<std::string> gone;
  for (const auto& s : current.stages)
    for (const auto& id : s.devices)
      if (!seen.find(id)) gone.insert(id);
  if (current.encoder_device && !seen.find(*current.encoder_device))
    gone.insert(*current.encoder_device);
  decision out;
  std::vector<std::string> overflow, pressured;
  if (gone.empty()) {
    auto cur = evaluate(current, seen, model, w);
    if (!cur) return fail("the plan in force cannot be re-costed: " + cur.error());
    out.target = *cur;
    out.current_step_s = cur->step_s;
    for (const auto& [id, used] : cur->memory_bytes) {
      const double cap = seen.find(id)->memory_bytes;
      const double share = used / cap;
      if (used > cap * (1 + 1e-12))
        overflow.push_back(id + " needs " + detail::bytes(used) + " of its " + detail::bytes(cap));
      else if (used > opt.memory_pressure * cap * (1 + 1e-12))
        pressured.push_back(id + " at " + detail::percent(share) + " of its memory");
    }
  } else {
    out.target = current;
    out.current_step_s = inf;
  }
  const bool forced = !gone.empty() || !overflow.empty();

  // 3. A fresh plan, with headroom under the pressure mark when it fits.
  planner_options po = opt.planner;
  po.memory_fraction = std::min(po.memory_fraction, opt.memory_pressure);
  auto fresh = make_plan_near(current, seen, model, w, po);
  if (!fresh) fresh = make_plan_near(current, seen, model, w, opt.planner);
  if (!fresh) {
    if (forced) return fail("shards must move but no plan fits: " + fresh.error());
    out.reason = "no move: re-planning failed: " + fresh.error();
    return out;
  }
  out.proposed_step_s = fresh->step_s;
  out.gain = std::isfinite(out.current_step_s) && out.current_step_s > 0
                 ? (out.current_step_s - fresh->step_s) / out.current_step_s
                 : (std::isfinite(fresh->step_s) ? 1.0 : 0.0);

  std::string why;
  auto add_why = [&](const std::string& s) { why += (why.empty() ? "" : "; ") + s; };
  for (const auto& id : gone) add_why("device " + id + " is gone");
  for (const auto& s : overflow) add_why("overflow: " + s);
  for (const auto& s : pressured)
    add_why("memory pressure: " + s + " (threshold " + detail::percent(opt.memory_pressure) + ")");
  const std::string step_note = "step " + detail::ms(out.current_step_s) + " -> " +
                                detail::ms(out.proposed_step_s) + ", gain " +
                                detail::percent(out.gain);
  if (!forced && pressured.empty() && out.gain < opt.gain_threshold) {
    out.reason = "no move: predicted gain " + detail::percent(out.gain) + " is below the " +
                 detail::percent(opt.gain_threshold) + " threshold (" + step_note + ")";
    return out;
  }
  if (out.gain >= opt.gain_threshold)
    add_why(step_note + " >= " + detail::percent(opt.gain_threshold));
  else
    add_why(step_note);

  auto moves = diff(current, *fresh, model.layer_count());
  if (moves.empty()) {
    out.reason = "no move: the re-plan keeps every shard where it is (" + why + ")";
    return out;
  }

  // 4. Cooldown.
  for (const auto& m : moves) {
    std::optional<time_point> last;
    if (m.vision) {
      last = state.vision_moved;
    } else {
      for (int l = m.layer_begin; l < m.layer_end; ++l)
        if (static_cast<std::size_t>(l) < state.layer_moved.size() &&
            state.layer_moved[static_cast<std::size_t>(l)] &&
            (!last || *state.layer_moved[static_cast<std::size_t>(l)] > *last))
          last = state.layer_moved[static_cast<std::size_t>(l)];
    }
    if (!last || now - *last >= opt.cooldown) continue;
    const std::string note = m.shard + " moved " + detail::fixed(seconds(now - *last), 1) +
                             " s ago, within the " + detail::fixed(seconds(opt.cooldown), 1) +
                             " s cooldown";
    if (!forced) {
      out.reason = "no move: " + note + " (" + why + ")";
      return out;
    }
    add_why("overriding the cooldown: " + note);
    break;
  }

  for (auto& m : moves) {
    m.gain = out.gain;
    m.reason = why;
  }
  out.moves = std::move(moves);
  out.reason = why;
  out.target = std::move(*fresh);
  return out;
}

void commit(policy_state& state, const move& m, time_point now) {
  if (m.vision) {
    state.vision_moved = now;
  } else if (m.layer_end > m.layer_begin && m.layer_begin >= 0) {
    if (state.layer_moved.size() < static_cast<std::size_t>(m.layer_end))
      state.layer_moved.resize(static_cast<std::size_t>(m.layer_end));
    for (int l = m.layer_begin; l < m.layer_end; ++l)
      state.layer_moved[static_cast<std::size_t>(l)] = now;
  }
  ++state.moves;
}

}  // namespace troupe::placement
