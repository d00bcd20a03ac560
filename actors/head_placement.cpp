#include "actors/head_placement.hpp"

#include <algorithm>
#include <cstdio>
#include <memory>

#include "actors/data_plane.hpp"
#include "actors/log.hpp"
#include "actors/placement_control.hpp"

namespace troupe::actors::head_detail {

using namespace std::chrono_literals;

namespace {

double since_start_s(head_ptr self) {
  return std::chrono::duration<double>(steady::now() - self->state.started).count();
}

}  // namespace

std::string encoder_node(head_ptr self) {
  const auto& st = self->state;
  return st.encoder_owner.empty() ? st.cfg.node.name : st.encoder_owner;
}

placement::cluster_profile profile_now(head_ptr self, const std::vector<std::string>* only) {
  auto& st = self->state;
  std::vector<node_measure> nodes;
  for (const auto& name : st.members->usable()) {
    if (only && std::find(only->begin(), only->end(), name) == only->end()) continue;
    auto it = st.rt.find(name);
    if (it != st.rt.end() && it->second.agent)
      nodes.push_back({name, it->second.report.probe, it->second.report.load});
  }
  std::vector<placement::link_profile> links;
  for (const auto& [name, l] : st.links)
    if (l.done && l.link.bandwidth_bytes_per_s > 0) links.push_back(l.link);
  return cluster_profile_of(nodes, links, st.precision);
}

bool measured_all(head_ptr self) {
  auto& st = self->state;
  for (const auto& name : st.members->usable()) {
    auto it = st.rt.find(name);
    if (it == st.rt.end() || !it->second.agent || it->second.report.probe.cores <= 0) return false;
    if (name == st.cfg.node.name) continue;
    auto l = st.links.find(name);
    if (l == st.links.end() || !l->second.done || l->second.of != it->second.agent->node())
      return false;
  }
  return true;
}

namespace {

struct link_run {
  std::string name;
  node_agent_actor agent;
  std::string key;
  // Round trips first, then transfers. The smallest of several round
  // trips is the link's: a node whose cores are busy decoding answers
  // some pings late (the CPU's cost, already in its measured compute),
  // and one late answer taken as the link's latency made the planner
  // see a loopback link as 0.85 ms one way.
  int pings_left = 8;
  int transfers_left = 3;
  double rtt_s = 1e9;
  double best = 0;
};

void link_round(head_ptr self, std::shared_ptr<link_run> run) {
  auto& st = self->state;
  auto finish = [self, run](const std::string& why) {
    auto& l = self->state.links[run->name];
    l.measuring = false;
    l.done = true;  // failed or not: the planner then assumes the default link
    l.of = run->agent->node();
    if (why.empty() && run->best > 0) {
      l.link = {self->state.cfg.node.name, run->name, run->best, run->rtt_s / 2};
      logging::of("head").info("link {} <-> {}: {:.2f} GB/s, {:.0f} us one way (measured)",
                               self->state.cfg.node.name, run->name, run->best / 1e9,
                               run->rtt_s / 2 * 1e6);
    } else {
      l.link = {};
      event(self,
            "measuring the link to " + run->name + ": " +
                (why.empty() ? "no transfer completed" : why),
            true);
    }
  };
  if (st.rt[run->name].agent != run->agent) return finish("the node left");
  if (run->transfers_left-- == 0) return finish("");
  const auto t0 = steady::now();
  self->request(run->agent, st.cfg.node.timeout, ping_atom::value)
      .then(
          [self, run, t0, finish](node_report&) {
            run->rtt_s =
                std::min(run->rtt_s, std::chrono::duration<double>(steady::now() - t0).count());
            if (run->pings_left-- > 0) {
              ++run->transfers_left;  // a round trip only: no transfer this round
              return link_round(self, run);
            }
            auto& st = self->state;
            // Host bytes (what a stage's activations cross the link as), from
            // a pool of the probe's own: its 8 MiB go back to the system
            // once sent instead of staying cached in the node's device pool.
            auto t = kernels::tensor::zeros(*kernels::memory_pool::create(), kernels::dtype::f32,
                                            {std::int64_t{2} << 20});
            if (!t) return finish(t.error().message);
            const auto t1 = steady::now();
            auto ref = data_plane::local().push(run->key, st.cfg.node.device.name, std::move(*t));
            if (!ref) return finish(ref.error().message);
            self->request(run->agent, st.cfg.node.timeout, probe_atom::value, *ref)
                .then(
                    [self, run, t1](std::int64_t bytes) {
                      // The push and the agent's answer: one round trip besides the bytes.
                      const double s =
                          std::chrono::duration<double>(steady::now() - t1).count() - run->rtt_s;
                      run->best =
                          std::max(run->best, static_cast<double>(bytes) / std::max(s, 1e-6));
                      link_round(self, run);
                    },
                    [self, finish](caf::error& e) { finish(describe(self->system(), e)); });
          },
          [self, finish](caf::error& e) { finish(describe(self->system(), e)); });
}

}  // namespace

void measure_link(head_ptr self, const std::string& name) {
  auto& st = self->state;
  auto& r = st.rt[name];
  if (name == st.cfg.node.name || !r.agent || r.report.engine_address.empty()) return;
  auto& l = st.links[name];
  if (l.measuring || (l.done && l.of == r.agent->node())) return;
  l.measuring = true;
  l.done = false;
  auto run = std::make_shared<link_run>();
  run->name = name;
  run->agent = r.agent;
  run->key = to_string(r.agent->node());
  auto& dp = data_plane::local();
  if (!dp.reachable(run->key)) {
    if (auto c = dp.connect(run->key, r.report.engine_address); !c) {
      l.measuring = false;
      l.done = true;
      l.of = r.agent->node();
      l.link = {};
      event(self, "measuring the link to " + name + ": " + c.error().message, true);
      return;
    }
  }
  link_round(self, run);
}

namespace {

placement::planner_options planner_opts(head_ptr self) {
  placement::planner_options o;
  o.preferred = self->state.precision;
  o.min_precision =
      self->state.precision;  // stages load the manifest's formats; the planner does not lower them
  o.allow_tensor_parallel = false;  // the cluster places one device per stage
  return o;
}

std::size_t record_decision(head_ptr self, placement_decision d) {
  auto& st = self->state;
  d.at_s = since_start_s(self);
  const auto window = std::chrono::duration_cast<steady::duration>(
      std::chrono::duration<double>(st.cfg.node.m.placement.measure_s));
  const auto rate = st.reps[0].tokens.rate(steady::now() - window, steady::now());
  d.measured_tps_before = rate ? *rate : -1;
  st.decisions.push_back(std::move(d));
  if (st.decisions.size() > 256) {
    st.decisions.erase(st.decisions.begin());
    std::erase_if(st.to_measure, [](const auto& p) { return p.index == 0; });
    for (auto& p : st.to_measure) --p.index;
    if (st.placing_decision) {
      if (*st.placing_decision == 0)
        st.placing_decision.reset();
      else
        --*st.placing_decision;
    }
  }
  const auto& x = st.decisions.back();
  char buf[160];
  std::snprintf(buf, sizeof buf, " (predicted step %.3f -> %.3f ms, throughput %+.0f%%)",
                x.predicted_step_ms_before, x.predicted_step_ms_after, 100 * x.predicted_gain);
  event(self, "placement decision, " + x.trigger + ": " + x.action +
                  (x.predicted_step_ms_after > 0 ? buf : ""));
  return st.decisions.size() - 1;
}

}  // namespace

void decision_applied(head_ptr self, std::optional<std::size_t> index) {
  auto& st = self->state;
  if (!index || *index >= st.decisions.size()) return;
  if (st.reps.size() > 1) {
    // The throughput measured is the pipeline's: with replicas it would
    // mix theirs.
    st.decisions[*index].state = "applied";
    return;
  }
  const auto& samples = st.reps[0].stat_samples;
  st.decisions[*index].state = "measuring";
  st.to_measure.push_back({*index,
                           steady::now(),
                           samples.empty() ? std::int64_t{-1} : samples.back().second.accepted,
                           {}});
}

void measure_decisions(head_ptr self) {
  auto& st = self->state;
  const auto now = steady::now();
  const auto window = std::chrono::duration_cast<steady::duration>(
      std::chrono::duration<double>(st.cfg.node.m.placement.measure_s));
  if (st.reps.size() != 1) return;
  const auto& samples = st.reps[0].stat_samples;
  const std::int64_t finished = samples.empty() ? -1 : samples.back().second.finished;
  std::erase_if(st.to_measure, [&](auto& p) {
    if (!p.settled && now >= p.applied + 5s &&
        (now >= p.applied + 60s || p.accepted < 0 || finished >= p.accepted))
      p.settled = now;
    if (!p.settled || now < *p.settled + window) return false;
    if (p.index >= st.decisions.size()) return true;
    auto& d = st.decisions[p.index];
    const auto r = st.reps[0].tokens.rate(*p.settled, now);
    d.measured_tps_after = r ? *r : -1;
    d.state = "measured";
    if (d.measured_tps_before > 0 && d.measured_tps_after >= 0)
      logging::of("head").info(
          "placement decision at {:.0f} s ({}): {:.1f} -> {:.1f} tokens/s measured ({:+.0f}%; from "
          "{:.0f} s after it, when the "
          "requests running then had finished), {:+.0f}% predicted",
          d.at_s, d.trigger, d.measured_tps_before, d.measured_tps_after,
          100 * (d.measured_tps_after / d.measured_tps_before - 1),
          std::chrono::duration<double>(*p.settled - p.applied).count(), 100 * d.predicted_gain);
    return true;
  });
}

std::vector<std::string> replica_usable(head_ptr self, int r) {
  auto& st = self->state;
  auto& p = rep(self, r);
  std::vector<std::string> out;
  for (const auto& n : st.members->usable())
    if (in_replica(p, n)) out.push_back(n);
  if (!out.empty() || st.reps.size() == 1) return out;
  // None of its nodes is up: it takes a node another replica has and does
  // not use (one left over when the nodes did not divide evenly, or a
  // replica's spare).
  const auto up = st.members->usable();
  for (auto& other : st.reps) {
    if (other.index == r) continue;
    for (auto it = other.nodes.begin(); it != other.nodes.end(); ++it) {
      const auto& n = *it;
      const bool used = cluster::plan_uses(other.plan, n);
      if (used || other.placing || other.nodes.size() < 2 ||
          std::find(up.begin(), up.end(), n) == up.end() || !st.rt[n].agent)
        continue;
      const auto name = n;
      other.nodes.erase(it);
      p.nodes.push_back(name);
      event(self, "replica " + std::to_string(r) + " takes node " + name + " (replica " +
                      std::to_string(other.index) + " had it spare)");
      return {name};
    }
  }
  return out;
}

namespace {

/// The stage nodes in the manifest's order, the head's first.
std::vector<std::string> stage_nodes_of(const head_state& st, bool usable_only) {
  const auto up = st.members->usable();
  std::vector<std::string> out;
  auto take = [&](const cluster::node_entry& n) {
    if (!n.holds_stages()) return;
    if (usable_only && std::find(up.begin(), up.end(), n.name) == up.end()) return;
    out.push_back(n.name);
  };
  const auto& m = st.cfg.node.m;
  if (const auto* h = m.node(m.head)) take(*h);
  for (const auto& n : m.nodes)
    if (n.name != m.head) take(n);
  return out;
}

/// `nodes` cut into `r` runs of (nearly) equal length, in order.
std::vector<std::vector<std::string>> split_nodes(const std::vector<std::string>& nodes, int r) {
  std::vector<std::vector<std::string>> out(static_cast<std::size_t>(r));
  const auto n = nodes.size();
  for (std::size_t i = 0; i < n; ++i) out[i * static_cast<std::size_t>(r) / n].push_back(nodes[i]);
  return out;
}

/// replicas = "auto": as many as the nodes hold. With a fixed number of
/// stages, one replica per that many nodes; with "auto" stages, the most
/// replicas for which the planner places the model on each run of nodes.
int auto_replicas(head_ptr self, const std::vector<std::string>& nodes) {
  auto& st = self->state;
  const int n = static_cast<int>(nodes.size());
  const int per = st.cfg.node.m.parallelism.pipeline_stages;
  if (per > 0 || !st.model_prof)
    return std::max(1, n / (std::max(1, per) * st.cfg.node.m.parallelism.tensor_parallel));
  for (int r = n; r > 1; --r) {
    bool fits = true;
    for (const auto& g : split_nodes(nodes, r)) {
      const auto prof = profile_now(self, &g);
      if (!placement::make_plan(prof, *st.model_prof, st.work, planner_opts(self))) {
        fits = false;
        break;
      }
    }
    if (fits) return r;
  }
  return 1;
}

}  // namespace

void group_replicas(head_ptr self) {
  auto& st = self->state;
  st.grouped = true;
  const int want = st.cfg.node.m.parallelism.replicas;
  if (want == 1) return;  // one pipeline over every node
  // A fixed number: every stage node of the manifest, up or not (its
  // replica places on it once it is); "auto": those up now, the others
  // join the smallest replica when they come.
  const auto nodes = stage_nodes_of(st, want == 0);
  int r = want == 0 ? auto_replicas(self, nodes) : want;
  r = std::clamp(r, 1, std::max(1, static_cast<int>(nodes.size())));
  if (r == 1) {
    if (want == 0) event(self, "replicas = \"auto\": the nodes hold one replica");
    return;
  }
  st.reps.resize(static_cast<std::size_t>(r));
  std::string what;
  const auto groups = split_nodes(nodes, r);
  for (int i = 0; i < r; ++i) {
    auto& p = st.reps[static_cast<std::size_t>(i)];
    p.index = i;
    p.nodes = groups[static_cast<std::size_t>(i)];
    what += (i ? "; " : "") + std::to_string(i) + " on ";
    for (std::size_t k = 0; k < p.nodes.size(); ++k) what += (k ? ", " : "") + p.nodes[k];
  }
  event(self, std::to_string(r) + " replicas: " + what);
}

void adopt_node(head_ptr self, const std::string& name) {
  auto& st = self->state;
  if (st.reps.size() < 2) return;
  const auto* n = st.cfg.node.m.node(name);
  if (!n || !n->holds_stages()) return;
  for (const auto& p : st.reps)
    if (in_replica(p, name)) return;
  // The replica waiting for a node, else the one with the fewest.
  auto* to = &st.reps.front();
  for (auto& p : st.reps) {
    const bool waiting = p.plan.empty() && !to->plan.empty();
    if (waiting || (p.plan.empty() == to->plan.empty() && p.nodes.size() < to->nodes.size()))
      to = &p;
  }
  to->nodes.push_back(name);
  event(self, "node " + name + " joins replica " + std::to_string(to->index));
}

namespace {

bool active(const replica_rt& p) {
  return !p.retired && !p.retiring;
}

}  // namespace

caf::result<std::string> scale_to(head_ptr self, int n) {
  auto& st = self->state;
  auto refuse = [](error_code c, const std::string& why) {
    return caf::result<std::string>(make_error(c, why));
  };
  if (n < 1 || n > 256)
    return refuse(error_code::invalid_request,
                  "replicas: " + std::to_string(n) + " is outside [1, 256]");
  if (st.draining) return refuse(error_code::unavailable, "the cluster is shutting down");
  if (!st.grouped) return refuse(error_code::unavailable, "the model is not placed yet");
  if (st.cfg.node.m.kv.store_tokens > 0)
    return refuse(error_code::invalid_request,
                  "the cluster's KV store serves one replica: scaling is refused with "
                  "kv.store_tokens");
  if (st.migrating || st.rebalancing)
    return refuse(error_code::unavailable, "a migration is under way; try again after it");
  int now = static_cast<int>(std::count_if(st.reps.begin(), st.reps.end(), active));
  if (n == now) return "the cluster runs " + std::to_string(n) + " replicas already";
  // One replica over every node becomes one over a list of them, which
  // the new replicas take their nodes from.
  if (st.reps.size() == 1 && st.reps[0].nodes.empty()) st.reps[0].nodes = stage_nodes_of(st, false);
  std::string what;
  if (n < now) {
    // The newest go: the router sends them nothing more, and they retire
    // once their requests are done.
    for (auto i = st.reps.size(); i-- > 0 && now > n;) {
      auto& p = st.reps[i];
      if (!active(p)) continue;
      p.retiring = true;
      p.retiring_since = steady::now();
      --now;
      what += (what.empty() ? "" : ", ") + std::to_string(p.index);
    }
    const auto line = "scaling to " + std::to_string(n) + " replicas: replica" +
                      (what.find(',') == std::string::npos ? " " : "s ") + what +
                      " take no more jobs and retire once theirs are done";
    event(self, line);
    return line;
  }
  // Up: replicas that are draining serve again first.
  for (auto& p : st.reps)
    if (p.retiring && now < n) {
      p.retiring = false;
      ++now;
      what += "replica " + std::to_string(p.index) + " serves again; ";
    }
  const int add = n - now;
  const int per = std::max(1, st.cfg.node.m.parallelism.pipeline_stages) *
                  st.cfg.node.m.parallelism.tensor_parallel;
  // Nodes up that hold stages and that no replica's placement uses.
  std::vector<std::string> spare;
  for (const auto& name : stage_nodes_of(st, true)) {
    const bool used = std::any_of(st.reps.begin(), st.reps.end(), [&](const replica_rt& p) {
      return cluster::plan_uses(p.plan, name) || (p.placing && in_replica(p, name));
    });
    if (!used && st.rt[name].agent) spare.push_back(name);
  }
  if (add > 0 && static_cast<int>(spare.size()) < add * per) {
    std::string names;
    for (const auto& x : spare) names += (names.empty() ? "" : ", ") + x;
    return refuse(error_code::unavailable,
                  std::to_string(n) + " replicas need " + std::to_string(add * per) +
                      (add * per == 1 ? " more node that holds" : " more nodes that hold") +
                      " nothing; " + std::to_string(spare.size()) + " are free" +
                      (names.empty() ? std::string{} : " (" + names + ")"));
  }
  for (int k = 0; k < add; ++k) {
    // A retired replica's slot, else a new one.
    auto it =
        std::find_if(st.reps.begin(), st.reps.end(), [](const replica_rt& p) { return p.retired; });
    if (it == st.reps.end()) {
      st.reps.emplace_back();
      st.reps.back().index = static_cast<int>(st.reps.size()) - 1;
      it = std::prev(st.reps.end());
    }
    auto& p = *it;
    const int idx = p.index;
    p = replica_rt{};  // a fresh start: no scheduler, no cache, no counters
    p.index = idx;
    for (int j = 0; j < per; ++j) {
      const auto name = spare.front();
      spare.erase(spare.begin());
      for (auto& o : st.reps) std::erase(o.nodes, name);  // a spare of another's no more
      p.nodes.push_back(name);
    }
    what += "replica " + std::to_string(idx) + " on ";
    for (std::size_t j = 0; j < p.nodes.size(); ++j) what += (j ? ", " : "") + p.nodes[j];
    what += "; ";
  }
  if (what.size() >= 2) what.resize(what.size() - 2);
  event(self, "scaling to " + std::to_string(n) + " replicas: " + what);
  for (auto& p : st.reps)
    if (active(p) && p.plan.empty() && !p.placing && !p.scheduler)
      replace(self, p.index, "scale to " + std::to_string(n));
  return "scaling to " + std::to_string(n) + " replicas: " + what;
}

void retire_drained(head_ptr self) {
  auto& st = self->state;
  for (auto& p : st.reps) {
    if (!p.retiring || p.placing || p.stat_samples.empty()) continue;
    const auto& [at, s] = p.stat_samples.back();
    // A count taken after it stopped taking jobs, with every job it was
    // sent counted, and nothing left.
    if (at <= p.retiring_since || p.routed_at_stats != p.routed || s.running + s.queued > 0)
      continue;
    for (const auto& slot : p.plan) {
      std::vector<std::string> nodes{slot.node};
      nodes.insert(nodes.end(), slot.ranks.begin(), slot.ranks.end());
      for (const auto& n : nodes)
        if (auto a = st.rt[n].agent)
          self->request(a, st.cfg.node.timeout, drop_atom::value)
              .then([](std::int32_t) {}, [](caf::error&) {});
    }
    if (p.scheduler) self->send_exit(p.scheduler, caf::exit_reason::user_shutdown);
    // Its nodes are spares of the first replica that serves.
    auto to = std::find_if(st.reps.begin(), st.reps.end(),
                           [](const replica_rt& o) { return !o.retired && !o.retiring; });
    std::string nodes;
    for (const auto& name : p.nodes) {
      nodes += (nodes.empty() ? "" : ", ") + name;
      if (to != st.reps.end() && !to->nodes.empty()) to->nodes.push_back(name);
    }
    const int idx = p.index;
    p = replica_rt{};
    p.index = idx;
    p.retired = true;
    event(self, "replica " + std::to_string(idx) + " retired (its requests are done)" +
                    (to != st.reps.end() && !nodes.empty()
                         ? "; " + nodes + " now spare for replica " + std::to_string(to->index)
                         : std::string{}));
  }
}

std::vector<cluster::stage_slot> choose_slots(head_ptr self, int r, const std::string& trigger) {
  auto& st = self->state;
  auto& p = rep(self, r);
  const bool one = st.reps.size() == 1;
  const auto usable = replica_usable(self, r);
  if (usable.empty()) return {};
  // The head's node is the first stage's with one replica (unless it holds
  // no stage: role "head"); a replica of several starts on the head's node
  // when it has it, else on its first.
  const auto* head_node = st.cfg.node.m.node(st.cfg.node.m.head);
  const bool head_stages = head_node && head_node->holds_stages();
  const bool has_head = std::find(usable.begin(), usable.end(), st.cfg.node.m.head) != usable.end();
  const std::string first = (one && head_stages) || has_head ? st.cfg.node.m.head : usable.front();
  auto fixed = [&] {
    return fixed_slots(st.layers, st.cfg.node.m.parallelism.pipeline_stages, usable, first,
                       st.cfg.node.m.parallelism.tensor_parallel);
  };
  if (!st.auto_place || !st.model_prof || (one && !has_head && head_stages)) return fixed();
  const auto prof = profile_now(self, one ? nullptr : &usable);
  placement_decision d;
  d.trigger = one ? trigger : "replica " + std::to_string(r) + ": " + trigger;
  if (!p.plan.empty()) {
    if (auto cur = plan_of(p.plan, prof, st.precision, encoder_node(self)))
      if (auto e = placement::evaluate(*cur, prof, *st.model_prof, st.work))
        d.predicted_step_ms_before = e->step_s * 1e3;
  }
  std::vector<cluster::stage_slot> slots;
  std::string why;
  if (one) st.want_encoder_on.clear();
  if (auto pl = placement::make_plan(prof, *st.model_prof, st.work, planner_opts(self)); !pl) {
    why = pl.error();
  } else if (auto sl = slots_of(*pl, prof); !sl) {
    why = sl.error();
  } else {
    slots = std::move(*sl);
    d.predicted_step_ms_after = pl->step_s * 1e3;
    // The encoder serves every replica: the planner moves it with one only.
    if (pl->encoder_device && one)
      if (const auto* dev = prof.find(*pl->encoder_device)) st.want_encoder_on = dev->node;
  }
  if (slots.empty()) {
    slots = fixed();
    d.action = "the planner found no plan (" + why + "); one stage per node instead";
  } else {
    d.action = "placed " + cluster::describe(slots);
    if (!st.want_encoder_on.empty() && st.encoder)
      d.action += ", vision encoder on " + st.want_encoder_on;
  }
  if (d.predicted_step_ms_before > 0 && d.predicted_step_ms_after > 0)
    d.predicted_gain = d.predicted_step_ms_before / d.predicted_step_ms_after - 1;
  d.plan = cluster::describe(slots);
  d.state = "placing";
  if (trigger == "retry" && st.placing_decision && *st.placing_decision < st.decisions.size()) {
    st.decisions[*st.placing_decision].plan = d.plan;  // the same decision, tried again
  } else {
    st.placing_decision = record_decision(self, std::move(d));
  }
  return slots;
}

namespace {

void run_moves(head_ptr self, std::shared_ptr<std::vector<migrate_request>> moves, std::size_t i,
               std::size_t index) {
  auto& st = self->state;
  if (i == moves->size()) {
    st.rebalancing = false;
    decision_applied(self, index);
    return;
  }
  const auto door = caf::actor_cast<frontdoor_actor>(self);
  self->request(door, std::chrono::minutes(10), migrate_atom::value, (*moves)[i])
      .then(
          [self, moves, i, index](const migrate_report&) { run_moves(self, moves, i + 1, index); },
          [self, index](caf::error& e) {
            auto& st = self->state;
            st.rebalancing = false;
            if (index < st.decisions.size())
              st.decisions[index].state = "failed: " + describe(self->system(), e);
            event(self, "placement decision: a move failed: " + describe(self->system(), e), true);
          });
}

/// Carries out the policy's decision `d` (recorded as decision `index`).
void apply_decision(head_ptr self, const placement::decision& d, std::size_t index,
                    const placement::cluster_profile& prof) {
  auto& st = self->state;
  auto target = slots_of(d.target, prof);
  if (!target) {
    st.decisions[index].state = "failed: " + target.error();
    return;
  }
  for (const auto& m : d.moves) placement::commit(st.policy, m, steady::now());
  std::string enc_to;
  if (d.target.encoder_device && st.encoder)
    if (const auto* dev = prof.find(*d.target.encoder_device)) enc_to = dev->node;
  auto change = change_between(st.reps[0].plan, *target, encoder_node(self), enc_to);
  st.rebalancing = true;
  if (!change.resplit) {
    run_moves(self, std::make_shared<std::vector<migrate_request>>(std::move(change.moves)), 0,
              index);
    return;
  }
  // A new layer split: hold the steps, place it, resume (the running
  // requests recompute their KV on the new stages).
  self->request(st.reps[0].scheduler, st.cfg.node.timeout, pause_atom::value)
      .then(
          [self, index, slots = *target, enc_to](std::int64_t) {
            auto& st = self->state;
            st.reps[0].resume_after_placement = true;
            st.placing_decision = index;
            st.want_encoder_on = enc_to;  // moved after the placement, if it is another node
            replace(self, 0, "re-split", slots);
          },
          [self, index](caf::error& e) {
            auto& st = self->state;
            st.rebalancing = false;
            st.decisions[index].state =
                "failed: pausing the scheduler: " + describe(self->system(), e);
          });
}

}  // namespace

void policy_tick(head_ptr self) {
  auto& st = self->state;
  // With replicas, each is placed by the planner on its nodes at the start
  // and after a loss; the policy's moves and re-splits are one pipeline's.
  if (st.reps.size() != 1) return;
  const auto& p = st.reps[0];
  if (!st.auto_place || !st.cfg.node.m.placement.rebalance || !st.model_prof || !p.ready ||
      p.placing || st.migrating || st.rebalancing || st.draining || p.plan.empty() || !p.scheduler)
    return;
  const auto now = steady::now();
  const bool joined = !st.joined_since.empty();
  if (!joined && now < st.next_policy) return;
  if (!measured_all(self)) return;  // a new node's probe and link first
  st.next_policy = now + std::chrono::duration_cast<steady::duration>(
                             std::chrono::duration<double>(st.cfg.node.m.placement.interval_s));
  const auto prof = profile_now(self);
  std::string trigger = "load or memory";
  if (joined) {
    trigger.clear();
    for (const auto& n : st.joined_since) trigger += (trigger.empty() ? "node " : ", ") + n;
    trigger += " joined";
    st.joined_since.clear();
  }
  auto cur = plan_of(p.plan, prof, st.precision, encoder_node(self));
  if (!cur) {
    if (joined)
      record_decision(self, {0, trigger, "stay: " + cur.error(), cluster::describe(p.plan), -1, -1,
                             0, -1, -1, "failed"});
    return;
  }
  auto d = placement::decide(st.policy, *cur, prof, *st.model_prof, st.work, now, st.policy_opt);
  if (!d) {
    record_decision(self, {0, trigger, "stay: " + d.error(), cluster::describe(p.plan), -1, -1, 0,
                           -1, -1, "failed"});
    return;
  }
  placement_decision x;
  x.trigger = trigger;
  x.predicted_step_ms_before = d->current_step_s * 1e3;
  x.predicted_step_ms_after = d->proposed_step_s * 1e3;
  x.predicted_gain = d->proposed_step_s > 0 ? d->current_step_s / d->proposed_step_s - 1 : 0;
  if (d->moves.empty()) {
    if (!joined) return;  // a steady cluster does not log every 5 s
    x.action = "stay: " + d->reason;
    x.plan = cluster::describe(p.plan);
    x.state = "stayed";
    record_decision(self, std::move(x));
    return;
  }
  std::string what;
  for (const auto& m : d->moves) what += (what.empty() ? "" : "; ") + m.describe();
  x.action = "move " + what + " (" + d->reason + ")";
  auto slots = slots_of(d->target, prof);
  x.plan = slots ? cluster::describe(*slots) : std::string{};
  x.state = "moving";
  const auto index = record_decision(self, std::move(x));
  apply_decision(self, *d, index, prof);
}

}  // namespace troupe::actors::head_detail
