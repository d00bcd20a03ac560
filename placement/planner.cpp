// make_plan: the search over tensor-parallel groupings, unit orders and
// precision levels around the partition dynamic programme; replan_gain.
#include "placement/planner.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "placement/format.hpp"
#include "placement/partition.hpp"

namespace troupe::placement {

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

std::unexpected<std::string> fail(std::string msg) {
  return std::unexpected(std::move(msg));
}

/// Orders of node indices tried when there are at most this many nodes
/// (and few units): all of them.
constexpr int all_orders_nodes = 5;
constexpr int all_orders_units = 12;
/// Orders of at most this many units are improved by local search.
constexpr int local_search_units = 12;
/// At most this many orders are costed in one local search.
constexpr int local_search_budget = 300;

/// Where memory is set aside for the vision encoder before partitioning.
struct reservation {
  int device = -1;
  double bytes = 0;
  double step_s = 0;
};

/// The cluster as index tables.
struct indexed_cluster {
  std::vector<std::string> nodes;
  std::vector<int> device_node;
  std::vector<double> transfer_s;   // nodes × nodes
  std::vector<link_profile> local;  // per node
};

indexed_cluster index_cluster(const cluster_profile& c, const model_profile& m, const workload& w) {
  indexed_cluster ic;
  std::map<std::string, int> ids;
  for (const auto& d : c.devices) {
    auto [it, fresh] = ids.try_emplace(d.node, static_cast<int>(ic.nodes.size()));
    if (fresh) ic.nodes.push_back(d.node);
    ic.device_node.push_back(it->second);
  }
  const auto n = ic.nodes.size();
  // One pass over the links (cluster_profile::link scans them per call).
  std::vector<const link_profile*> given(n * n, nullptr);
  for (const auto& l : c.links) {
    const auto a = ids.find(l.node_a), b = ids.find(l.node_b);
    if (a == ids.end() || b == ids.end()) continue;
    given[static_cast<std::size_t>(a->second) * n + static_cast<std::size_t>(b->second)] = &l;
    given[static_cast<std::size_t>(b->second) * n + static_cast<std::size_t>(a->second)] = &l;
  }
  ic.transfer_s.assign(n * n, inf);
  for (std::size_t a = 0; a < n; ++a) {
    ic.local.push_back(given[a * n + a] ? *given[a * n + a] : c.local_link);
    for (std::size_t b = 0; b < n; ++b) {
      const link_profile* l = given[a * n + b];
      if (!l)
        l = a == b ? &c.local_link : (c.default_remote_link ? &*c.default_remote_link : nullptr);
      if (l) ic.transfer_s[a * n + b] = transfer_s(*l, m, w);
    }
  }
  return ic;
}

/// Stage units for tensor-parallel size k (1 = every device alone): each
/// node's devices of one kind, fastest first, in groups of k; leftovers
/// alone. Fully loaded devices and devices without room are left out.
std::vector<detail::unit> make_units(const cluster_profile& c, const indexed_cluster& ic,
                                     const model_profile& m, const workload& w,
                                     const planner_options& opt, int k, const reservation& res) {
  const auto& devs = c.devices;
  auto usable = [&](int d) {
    const auto& dev = devs[static_cast<std::size_t>(d)];
    return dev.load < 1 && dev.memory_bytes * opt.memory_fraction - w.overhead_bytes > 0;
  };
  auto speed = [&](int d) {
    return rates_of(devs[static_cast<std::size_t>(d)]).gemv_bytes_per_s[index(opt.preferred)];
  };
  auto capacity = [&](int d) {
    double cap =
        devs[static_cast<std::size_t>(d)].memory_bytes * opt.memory_fraction - w.overhead_bytes;
    if (d == res.device) cap -= res.bytes;
    return cap;
  };
  std::vector<detail::unit> units;
  auto add = [&](std::vector<int> members) {
    detail::unit u;
    u.node = ic.device_node[static_cast<std::size_t>(members.front())];
    std::vector<const device_profile*> ptrs;
    double cap = inf;
    for (int d : members) {
      ptrs.push_back(&devs[static_cast<std::size_t>(d)]);
      cap = std::min(cap, capacity(d));
      if (d == res.device) u.extra_s = res.step_s;
    }
    const int size = static_cast<int>(members.size());
    const auto& link = ic.local[static_cast<std::size_t>(u.node)];
    u.rates = size == 1 ? rates_of(*ptrs.front()) : rates_of(ptrs, link);
    u.capacity_bytes = cap * size;
    u.allreduce_per_layer_s =
        size > 1 ? 2 * allreduce_s(double(w.batch) * m.activation_bytes_per_token(), size, link)
                 : 0;
    u.speed = u.rates.gemv_bytes_per_s[index(opt.preferred)];
    u.members = std::move(members);
    units.push_back(std::move(u));
  };
  for (std::size_t node = 0; node < ic.nodes.size(); ++node)
    for (auto kind : {device_kind::gpu, device_kind::npu, device_kind::cpu}) {
      std::vector<int> ds;
      for (int d = 0; d < static_cast<int>(devs.size()); ++d)
        if (ic.device_node[static_cast<std::size_t>(d)] == static_cast<int>(node) &&
            devs[static_cast<std::size_t>(d)].kind == kind && usable(d))
          ds.push_back(d);
      std::stable_sort(ds.begin(), ds.end(), [&](int a, int b) { return speed(a) > speed(b); });
      std::size_t i = 0;
      for (; k > 1 && i + static_cast<std::size_t>(k) <= ds.size();
           i += static_cast<std::size_t>(k))
        add(std::vector<int>(ds.begin() + static_cast<std::ptrdiff_t>(i),
                             ds.begin() + static_cast<std::ptrdiff_t>(i) + k));
      for (; i < ds.size(); ++i) add({ds[i]});
    }
  return units;
}

/// The unit orders tried for one set of units (see planner.hpp).
std::vector<detail::unit_order> make_orders(const std::vector<detail::unit>& units,
                                            const indexed_cluster& ic) {
  const int nodes = static_cast<int>(ic.nodes.size());
  std::vector<std::vector<int>> by_node(static_cast<std::size_t>(nodes));
  std::vector<double> strength(static_cast<std::size_t>(nodes), 0);
  for (int u = 0; u < static_cast<int>(units.size()); ++u) {
    by_node[static_cast<std::size_t>(units[static_cast<std::size_t>(u)].node)].push_back(u);
    strength[static_cast<std::size_t>(units[static_cast<std::size_t>(u)].node)] +=
        units[static_cast<std::size_t>(u)].speed;
  }
  std::vector<int> present;
  for (int n = 0; n < nodes; ++n)
    if (!by_node[static_cast<std::size_t>(n)].empty()) present.push_back(n);
  if (present.empty()) return {};
  auto t = [&](int a, int b) { return ic.transfer_s[static_cast<std::size_t>(a * nodes + b)]; };

  std::vector<std::vector<int>> node_orders;
  if (static_cast<int>(present.size()) <= all_orders_nodes &&
      static_cast<int>(units.size()) <= all_orders_units) {
    std::vector<int> perm = present;
    do node_orders.push_back(perm);
    while (std::next_permutation(perm.begin(), perm.end()));
  } else {
    std::vector<int> starts = present;
    std::stable_sort(starts.begin(), starts.end(), [&](int a, int b) {
      return strength[static_cast<std::size_t>(a)] > strength[static_cast<std::size_t>(b)];
    });
    starts.resize(std::min<std::size_t>(2, starts.size()));
    for (int s : starts) {
      std::vector<int> chain{s};
      std::vector<bool> seen(static_cast<std::size_t>(nodes), false);
      seen[static_cast<std::size_t>(s)] = true;
      while (chain.size() < present.size()) {
        int best = -1;
        for (int n : present) {
          if (seen[static_cast<std::size_t>(n)]) continue;
          if (best < 0 || t(chain.back(), n) < t(chain.back(), best) ||
              (t(chain.back(), n) == t(chain.back(), best) &&
               strength[static_cast<std::size_t>(n)] > strength[static_cast<std::size_t>(best)]))
            best = n;
        }
        seen[static_cast<std::size_t>(best)] = true;
        chain.push_back(best);
      }
      node_orders.push_back(chain);
      std::reverse(chain.begin(), chain.end());
      node_orders.push_back(chain);
    }
    std::sort(node_orders.begin(), node_orders.end());
    node_orders.erase(std::unique(node_orders.begin(), node_orders.end()), node_orders.end());
  }
  std::vector<detail::unit_order> out;
  for (bool fastest_first : {true, false}) {
    bool differs = fastest_first;
    for (auto& list : by_node) {
      std::vector<int> sorted = list;
      std::stable_sort(sorted.begin(), sorted.end(), [&](int a, int b) {
        const double sa = units[static_cast<std::size_t>(a)].speed,
                     sb = units[static_cast<std::size_t>(b)].speed;
        return fastest_first ? sa > sb : sa < sb;
      });
      if (sorted != list) differs = true;
      list = std::move(sorted);
    }
    if (!differs) continue;  // the slowest-first order is the same
    for (const auto& no : node_orders) {
      detail::unit_order o;
      for (int n : no)
        for (int u : by_node[static_cast<std::size_t>(n)]) o.push_back(u);
      out.push_back(std::move(o));
    }
  }
  return out;
}

/// Local search over the order for small clusters: move one unit to
/// another position, or swap two, while that makes the best split faster
/// (first improvement, at most local_search_budget orders costed). Lets a pipeline visit a node
/// twice when that pays, which node-contiguous orders cannot.
void improve_order(detail::partitioner& part, detail::unit_order& order, double& step) {
  const std::size_t n = order.size();
  int uncovered = 0;
  step = part.min_step(order, &uncovered);
  int budget = local_search_budget;
  // Lexicographic: fewer layers left uncovered, then a faster step.
  auto try_order = [&](detail::unit_order o) {
    --budget;
    int u = 0;
    const double s = part.min_step(o, &u);
    if (!(u < uncovered || (u == uncovered && s < step * (1 - 1e-9)))) return false;
    order = std::move(o);
    step = s;
    uncovered = u;
    return true;
  };
  for (bool improved = true; improved && budget > 0;) {
    improved = false;
    for (std::size_t a = 0; a < n && !improved && budget > 0; ++a)
      for (std::size_t b = 0; b < n && !improved && budget > 0; ++b) {
        if (a == b) continue;
        detail::unit_order moved = order;
        const int u = moved[a];
        moved.erase(moved.begin() + static_cast<std::ptrdiff_t>(a));
        moved.insert(moved.begin() + static_cast<std::ptrdiff_t>(b), u);
        improved = try_order(std::move(moved));
        if (!improved && a < b) {
          detail::unit_order swapped = order;
          std::swap(swapped[a], swapped[b]);
          improved = try_order(std::move(swapped));
        }
      }
  }
}

/// A partition and the units its stages refer to.
struct search_result {
  detail::partition part;
  std::vector<detail::unit> units;
};

/// Fills unit::stay_params from the current plan: parameters of the
/// layers each unit's exact device set holds there.
void mark_current(std::vector<detail::unit>& units, const cluster_profile& c,
                  const model_profile& m, const plan& current) {
  const auto L = static_cast<std::size_t>(m.layer_count());
  for (auto& u : units) {
    std::vector<std::string> ids;
    for (int d : u.members) ids.push_back(c.devices[static_cast<std::size_t>(d)].id);
    std::sort(ids.begin(), ids.end());
    std::vector<double> stay(L + 1, 0);
    bool any = false;
    for (std::size_t l = 0; l < L; ++l) {
      const auto* s = current.stage_of(static_cast<int>(l));
      bool here = false;
      if (s) {
        auto held = s->devices;
        std::sort(held.begin(), held.end());
        here = held == ids;
      }
      any = any || here;
      stay[l + 1] = stay[l] + (here ? m.layers[l].params : 0);
    }
    if (any) u.stay_params = std::move(stay);
  }
}

/// The order the current plan visits its units in (those that exist in
/// this grouping), then every other unit, fastest first: lets a re-plan
/// keep the current pipeline and shift only a few layers.
detail::unit_order current_order(const std::vector<detail::unit>& units, const cluster_profile& c,
                                 const plan& current) {
  detail::unit_order o;
  std::vector<bool> taken(units.size(), false);
  for (const auto& s : current.stages) {
    auto held = s.devices;
    std::sort(held.begin(), held.end());
    for (std::size_t u = 0; u < units.size(); ++u) {
      std::vector<std::string> ids;
      for (int d : units[u].members) ids.push_back(c.devices[static_cast<std::size_t>(d)].id);
      std::sort(ids.begin(), ids.end());
      if (ids == held && !taken[u]) {
        taken[u] = true;
        o.push_back(static_cast<int>(u));
        break;
      }
    }
  }
  std::vector<int> rest;
  for (std::size_t u = 0; u < units.size(); ++u)
    if (!taken[u]) rest.push_back(static_cast<int>(u));
  std::stable_sort(rest.begin(), rest.end(), [&](int a, int b) {
    return units[static_cast<std::size_t>(a)].speed > units[static_cast<std::size_t>(b)].speed;
  });
  o.insert(o.end(), rest.begin(), rest.end());
  return o;
}

/// The best partition over every grouping and order, non-sensitive layers
/// allowed down to `lowest`, memory reserved per `res`, weights kept where
/// `near` has them when that costs nothing.
std::optional<search_result> search(const cluster_profile& c, const indexed_cluster& ic,
                                    const model_profile& m, const workload& w,
                                    const planner_options& opt, precision lowest,
                                    const reservation& res, const plan* near) {
  std::vector<int> sizes{1};
  if (opt.allow_tensor_parallel)
    for (int k = 2; k <= opt.max_tensor_parallel; k *= 2) sizes.push_back(k);
  struct candidate {
    detail::problem prob;
    std::vector<detail::unit_order> orders;
    std::vector<double> steps;
  };
  std::vector<candidate> cands;
  double best = inf;
  for (int k : sizes) {
    candidate cand;
    cand.prob.model = &m;
    cand.prob.work = &w;
    cand.prob.preferred = opt.preferred;
    cand.prob.lowest = lowest;
    cand.prob.units = make_units(c, ic, m, w, opt, k, res);
    if (k > 1 && std::none_of(cand.prob.units.begin(), cand.prob.units.end(),
                              [](const detail::unit& u) { return u.members.size() > 1; }))
      break;  // no node has k like devices: larger groups do not form either
    cand.prob.node_count = static_cast<int>(ic.nodes.size());
    cand.prob.transfer_s = ic.transfer_s;
    if (near) {
      cand.prob.has_current = true;
      mark_current(cand.prob.units, c, m, *near);
    }
    cand.orders = make_orders(cand.prob.units, ic);
    if (near) cand.orders.push_back(current_order(cand.prob.units, c, *near));
    cands.push_back(std::move(cand));
  }
  for (auto& cand : cands) {
    detail::partitioner part(cand.prob);
    for (const auto& o : cand.orders) cand.steps.push_back(part.min_step(o));
    if (!cand.orders.empty() &&
        cand.orders.front().size() <= static_cast<std::size_t>(local_search_units)) {
      const auto first =
          std::min_element(cand.steps.begin(), cand.steps.end()) - cand.steps.begin();
      auto order = cand.orders[static_cast<std::size_t>(first)];
      double step = inf;
      improve_order(part, order, step);
      if (std::isfinite(step)) {
        cand.orders.push_back(std::move(order));
        cand.steps.push_back(step);
      }
    }
    for (double s : cand.steps) best = std::min(best, s);
  }
  if (!std::isfinite(best)) return std::nullopt;
  const double limit = best * (1 + opt.step_time_slack) * (1 + 1e-12);
  std::optional<search_result> out;
  for (auto& cand : cands) {
    detail::partitioner part(cand.prob);
    for (std::size_t o = 0; o < cand.orders.size(); ++o) {
      if (!(cand.steps[o] <= limit)) continue;
      auto p = part.best_within(cand.orders[o], limit);
      if (!p) continue;
      auto close = [](double a, double b) {
        return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(b));
      };
      bool take = !out;
      if (out) {
        const auto& b = out->part;
        if (!close(p->loss, b.loss))
          take = p->loss < b.loss;
        else if (!close(p->moved, b.moved))
          take = p->moved < b.moved;
        else
          take =
              p->latency_s < b.latency_s || (p->latency_s == b.latency_s && p->step_s < b.step_s);
      }
      if (take) out = search_result{std::move(*p), cand.prob.units};
    }
  }
  return out;
}

plan to_plan(const cluster_profile& c, const search_result& r, const planner_options& opt) {
  plan p;
  p.head_precision = opt.preferred;
  p.encoder_precision = opt.preferred;
  p.projector_precision = projector_precision(opt.preferred);
  for (const auto& s : r.part.stages) {
    stage st;
    for (int d : r.units[static_cast<std::size_t>(s.unit)].members)
      st.devices.push_back(c.devices[static_cast<std::size_t>(d)].id);
    st.layer_begin = s.begin;
    st.layer_end = s.end;
    st.layer_precision = s.precisions;
    p.stages.push_back(std::move(st));
  }
  return p;
}

/// Why nothing fits: the first of a layer too large for any device, the
/// whole model too large for the cluster, or fragmentation.
std::string diagnose(const cluster_profile& c, const indexed_cluster& ic, const model_profile& m,
                     const workload& w, const planner_options& opt) {
  // A decoder held in its own formats is not lowered (partition.cpp).
  const precision lowest = m.held_at ? opt.preferred : opt.min_precision;
  std::vector<detail::unit> units = make_units(c, ic, m, w, opt, 1, {});
  if (units.empty())
    return "no device can take a stage: every device is fully loaded or has less memory than the " +
           detail::bytes(w.overhead_bytes) + " overhead";
  double total_cap = 0;
  for (const auto& u : units) total_cap += u.capacity_bytes;
  std::vector<detail::unit> all = units;
  if (opt.allow_tensor_parallel)
    for (int k = 2; k <= opt.max_tensor_parallel; k *= 2)
      for (auto& u : make_units(c, ic, m, w, opt, k, {}))
        if (u.members.size() > 1) all.push_back(std::move(u));
  const auto* largest = &*std::max_element(
      all.begin(), all.end(),
      [](const auto& a, const auto& b) { return a.capacity_bytes < b.capacity_bytes; });
  std::string where;
  for (std::size_t i = 0; i < largest->members.size(); ++i)
    where += (i ? "+" : "") + c.devices[static_cast<std::size_t>(largest->members[i])].id;
  const double kv_scale = double(w.batch) * double(w.context_tokens);
  const std::string kv_note = " (at " + std::string(to_string(lowest)) + ", sensitive layers at " +
                              to_string(opt.preferred) + ", KV for batch " +
                              std::to_string(w.batch) + " x " + std::to_string(w.context_tokens) +
                              " tokens)";
  double total = 0;
  for (int l = 0; l < m.layer_count(); ++l) {
    const auto& layer = m.layers[static_cast<std::size_t>(l)];
    const double need = m.layer_bytes(l, layer.sensitive ? opt.preferred : lowest) +
                        kv_scale * layer.kv_bytes_per_token;
    total += need;
    if (need > largest->capacity_bytes)
      return "layer " + std::to_string(l) + " needs " + detail::bytes(need) + kv_note +
             " but the largest device or group, " + where + ", offers " +
             detail::bytes(largest->capacity_bytes);
  }
  const auto& first = m.layers.front();
  const double first_need = m.embedding_bytes(opt.preferred) +
                            m.layer_bytes(0, first.sensitive ? opt.preferred : lowest) +
                            kv_scale * first.kv_bytes_per_token;
  if (first_need > largest->capacity_bytes)
    return "the embedding with layer 0 needs " + detail::bytes(first_need) + kv_note +
           " but the largest device or group, " + where + ", offers " +
           detail::bytes(largest->capacity_bytes);
  const auto& last = m.layers.back();
  const double last_need =
      m.lm_head_bytes(opt.preferred) +
      m.layer_bytes(m.layer_count() - 1, last.sensitive ? opt.preferred : lowest) +
      kv_scale * last.kv_bytes_per_token;
  if (last_need > largest->capacity_bytes)
    return "the LM head with layer " + std::to_string(m.layer_count() - 1) + " needs " +
           detail::bytes(last_need) + kv_note + " but the largest device or group, " + where +
           ", offers " + detail::bytes(largest->capacity_bytes);
  total += m.embedding_bytes(opt.preferred) + m.head_bytes_on_stage(opt.preferred, true);
  const double enc = encoder_bytes(m, opt.preferred);
  if (total + enc > total_cap)
    return "the model needs at least " + detail::bytes(total + enc) + kv_note +
           (enc > 0 ? " with the vision encoder" : "") + " but the " +
           std::to_string(units.size()) + " usable devices offer " + detail::bytes(total_cap) +
           " (memory x " + detail::num(opt.memory_fraction) + " - " +
           detail::bytes(w.overhead_bytes) + " overhead each)";
  if (m.vision)
    return "no split of the " + std::to_string(m.layer_count()) +
           " layers into contiguous stages leaves room for the vision encoder and projector (" +
           detail::bytes(enc) + ") on any device";
  return "no split of the " + std::to_string(m.layer_count()) +
         " layers into contiguous stages fits the devices' memory (the model needs " +
         detail::bytes(total) + kv_note + " of " + detail::bytes(total_cap) + ")";
}

}  // namespace

namespace {

result<plan> plan_impl(const cluster_profile& cluster, const model_profile& model,
                       const workload& w, const planner_options& opt, const plan* near) {
  if (auto ok = validate(cluster); !ok) return fail(ok.error());
  if (auto ok = validate(model); !ok) return fail(ok.error());
  if (auto ok = validate(w); !ok) return fail(ok.error());
  if (auto ok = detail::validate(opt); !ok) return fail(ok.error());
  const auto ic = index_cluster(cluster, model, w);

  auto finish = [&](const search_result& r) -> std::optional<plan> {
    auto costed = evaluate(to_plan(cluster, r, opt), cluster, model, w);
    if (!costed) return std::nullopt;
    if (!detail::place_encoder(*costed, cluster, model, w, opt,
                               near ? near->encoder_device : std::nullopt))
      return std::nullopt;
    auto final = evaluate(*costed, cluster, model, w);
    if (!final) return std::nullopt;
    return *final;
  };

  for (precision lowest = opt.preferred;;) {
    if (auto r = search(cluster, ic, model, w, opt, lowest, {}, near)) {
      if (auto p = finish(*r)) return *p;
      // No room left for the vision encoder: set memory aside for it on the
      // devices with the most memory and plan around it.
      std::vector<int> devs(cluster.devices.size());
      std::iota(devs.begin(), devs.end(), 0);
      std::stable_sort(devs.begin(), devs.end(), [&](int a, int b) {
        return cluster.devices[static_cast<std::size_t>(a)].memory_bytes >
               cluster.devices[static_cast<std::size_t>(b)].memory_bytes;
      });
      std::optional<plan> best;
      const double bytes = encoder_bytes(model, opt.preferred);
      for (std::size_t i = 0; i < devs.size() && i < 3; ++i) {
        const auto& d = cluster.devices[static_cast<std::size_t>(devs[i])];
        if (d.load >= 1) continue;
        reservation res{devs[i], bytes,
                        w.images_per_step * encoder_s_per_image(rates_of(d), model)};
        if (auto rr = search(cluster, ic, model, w, opt, lowest, res, near))
          if (auto p = finish(*rr); p && (!best || p->step_s < best->step_s)) best = std::move(p);
      }
      if (best) return *best;
    }
    const auto next = lower(lowest);
    if (lowest == opt.min_precision || !next || model.held_at) break;
    lowest = *next;
  }
  return fail("the model does not fit: " + diagnose(cluster, ic, model, w, opt));
}

}  // namespace

result<plan> make_plan(const cluster_profile& cluster, const model_profile& model,
                       const workload& w, const planner_options& opt) {
  return plan_impl(cluster, model, w, opt, nullptr);
}

result<plan> make_plan_near(const plan& current, const cluster_profile& cluster,
                            const model_profile& model, const workload& w,
                            const planner_options& opt) {
  return plan_impl(cluster, model, w, opt, &current);
}

result<replan_estimate> replan_gain(const plan& current, const cluster_profile& cluster,
                                    const model_profile& model, const workload& w,
                                    const planner_options& opt) {
  auto now = evaluate(current, cluster, model, w);
  if (!now) return fail("the current plan cannot be re-costed: " + now.error());
  auto fresh = make_plan_near(current, cluster, model, w, opt);
  if (!fresh) return fail(fresh.error());
  replan_estimate e;
  e.current = std::move(*now);
  e.proposed = std::move(*fresh);
  e.current_step_s = e.current.step_s;
  e.proposed_step_s = e.proposed.step_s;
  if (std::isfinite(e.current_step_s) && e.current_step_s > 0)
    e.gain = (e.current_step_s - e.proposed_step_s) / e.current_step_s;
  else
    e.gain = std::isfinite(e.proposed_step_s) ? 1.0 : 0.0;
  return e;
}

std::vector<std::pair<int, int>> even_split(int layers, int parts) {
  std::vector<std::pair<int, int>> out;
  if (layers < 1 || parts < 1) return out;
  parts = std::min(parts, layers);
  for (int s = 0; s < parts; ++s) out.emplace_back(s * layers / parts, (s + 1) * layers / parts);
  return out;
}

}  // namespace troupe::placement
