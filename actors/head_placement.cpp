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

placement::cluster_profile profile_now(head_ptr self) {
  auto& st = self->state;
  std::vector<node_measure> nodes;
  for (const auto& name : st.members->usable()) {
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
  const auto rate = st.tokens.rate(steady::now() - window, steady::now());
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
  st.decisions[*index].state = "measuring";
  st.to_measure.push_back(
      {*index,
       steady::now(),
       st.stat_samples.empty() ? std::int64_t{-1} : st.stat_samples.back().second.accepted,
       {}});
}

void measure_decisions(head_ptr self) {
  auto& st = self->state;
  const auto now = steady::now();
  const auto window = std::chrono::duration_cast<steady::duration>(
      std::chrono::duration<double>(st.cfg.node.m.placement.measure_s));
  const std::int64_t finished =
      st.stat_samples.empty() ? -1 : st.stat_samples.back().second.finished;
  std::erase_if(st.to_measure, [&](auto& p) {
    if (!p.settled && now >= p.applied + 5s &&
        (now >= p.applied + 60s || p.accepted < 0 || finished >= p.accepted))
      p.settled = now;
    if (!p.settled || now < *p.settled + window) return false;
    if (p.index >= st.decisions.size()) return true;
    auto& d = st.decisions[p.index];
    const auto r = st.tokens.rate(*p.settled, now);
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

std::vector<cluster::stage_slot> choose_slots(head_ptr self, const std::string& trigger) {
  auto& st = self->state;
  const auto usable = st.members->usable();
  auto fixed = [&] {
    return fixed_slots(st.layers, st.cfg.node.m.parallelism.pipeline_stages, usable,
                       st.cfg.node.m.head);
  };
  if (!st.auto_place || !st.model_prof ||
      std::find(usable.begin(), usable.end(), st.cfg.node.m.head) == usable.end())
    return fixed();
  const auto prof = profile_now(self);
  placement_decision d;
  d.trigger = trigger;
  if (!st.plan.empty()) {
    if (auto cur = plan_of(st.plan, prof, st.precision, encoder_node(self)))
      if (auto e = placement::evaluate(*cur, prof, *st.model_prof, st.work))
        d.predicted_step_ms_before = e->step_s * 1e3;
  }
  std::vector<cluster::stage_slot> slots;
  std::string why;
  st.want_encoder_on.clear();
  if (auto p = placement::make_plan(prof, *st.model_prof, st.work, planner_opts(self)); !p) {
    why = p.error();
  } else if (auto sl = slots_of(*p, prof); !sl) {
    why = sl.error();
  } else {
    slots = std::move(*sl);
    d.predicted_step_ms_after = p->step_s * 1e3;
    if (p->encoder_device)
      if (const auto* dev = prof.find(*p->encoder_device)) st.want_encoder_on = dev->node;
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
  auto change = change_between(st.plan, *target, encoder_node(self), enc_to);
  st.rebalancing = true;
  if (!change.resplit) {
    run_moves(self, std::make_shared<std::vector<migrate_request>>(std::move(change.moves)), 0,
              index);
    return;
  }
  // A new layer split: hold the steps, place it, resume (the running
  // requests recompute their KV on the new stages).
  self->request(st.scheduler, st.cfg.node.timeout, pause_atom::value)
      .then(
          [self, index, slots = *target, enc_to](std::int64_t) {
            auto& st = self->state;
            st.resume_after_placement = true;
            st.placing_decision = index;
            st.want_encoder_on = enc_to;  // moved after the placement, if it is another node
            replace(self, "re-split", slots);
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
  if (!st.auto_place || !st.cfg.node.m.placement.rebalance || !st.model_prof || !st.ready ||
      st.placing || st.migrating || st.rebalancing || st.draining || st.plan.empty() ||
      !st.scheduler)
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
  auto cur = plan_of(st.plan, prof, st.precision, encoder_node(self));
  if (!cur) {
    if (joined)
      record_decision(self, {0, trigger, "stay: " + cur.error(), cluster::describe(st.plan), -1, -1,
                             0, -1, -1, "failed"});
    return;
  }
  auto d = placement::decide(st.policy, *cur, prof, *st.model_prof, st.work, now, st.policy_opt);
  if (!d) {
    record_decision(self, {0, trigger, "stay: " + d.error(), cluster::describe(st.plan), -1, -1, 0,
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
    x.plan = cluster::describe(st.plan);
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
