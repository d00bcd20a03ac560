#include "actors/head_status.hpp"

#include <iterator>
#include <map>

#include "actors/head_placement.hpp"
#include "actors/pipeline_stats.hpp"
#include "actors/placement_control.hpp"

namespace troupe::actors::head_detail {

using namespace std::chrono_literals;

cluster_status status_of(head_ptr self) {
  auto& st = self->state;
  cluster_status s;
  s.cluster = st.cfg.node.m.name;
  s.head = st.cfg.node.m.head;
  s.ready = st.ready && !st.placing;
  s.draining = st.draining;
  s.epoch = st.epoch;
  s.placement = cluster::describe(st.plan);
  s.encoder = st.encoder_where;
  s.replacements = st.replacements;
  s.last_event = st.last_event;
  s.detect_ms = st.detect_ms;
  s.resume_ms = st.resume_ms;
  using models::kv_tier;
  s.indexed_blocks = {st.blocks.count(kv_tier::device), st.blocks.count(kv_tier::host),
                      st.blocks.count(kv_tier::disk), st.blocks.count(kv_tier::remote)};
  s.kv_store = st.vault ? st.vault_on : std::string{};
  s.kv_stores = st.vault_stores;
  s.block_events = st.block_events;
  s.actor_restarts = st.actor_restarts;
  s.migrations = st.migrations;
  s.migration = st.migrating ? st.migration_phase : std::string{};
  s.migration_done = st.migrating ? st.migration_done : 0.0;
  s.stages_total = st.stages_total;
  s.stages_loaded = st.stages_loaded;
  for (const auto& [name, r] : st.rt)
    if (r.agent) st.node_names[to_string(r.agent->node())] = name;
  std::map<std::string, std::int64_t> links;
  for (const auto& [name, r] : st.rt) {
    const auto& rep = r.report;
    for (std::size_t i = 0; i < rep.link_peers.size() && i < rep.link_bytes.size(); ++i) {
      auto it = st.node_names.find(rep.link_peers[i]);
      links[name + "->" + (it == st.node_names.end() ? "unknown" : it->second)] +=
          rep.link_bytes[i];
    }
  }
  for (const auto& [l, b] : links) {
    s.links.push_back(l);
    s.link_bytes.push_back(b);
  }
  for (const auto& n : st.cfg.node.m.nodes) {
    member_view v;
    v.name = n.name;
    v.host = n.host;
    v.port = n.port;
    if (const auto* m = st.members->find(n.name)) {
      v.state = m->state;
      v.last_seen_ms = m->last_seen ? ms_since(*m->last_seen) : -1;
      v.joins = m->joins;
    }
    auto it = st.rt.find(n.name);
    if (it != st.rt.end()) {
      v.report = it->second.report;
      if (v.state != cluster::member_state::up && v.state != cluster::member_state::suspect &&
          !it->second.why.empty())
        v.report.failure = it->second.why;
    }
    s.nodes.push_back(std::move(v));
  }
  if (st.model_prof && !st.plan.empty()) {
    const auto prof = profile_now(self);
    if (auto cur = plan_of(st.plan, prof, st.precision, encoder_node(self))) {
      if (auto e = placement::evaluate(*cur, prof, *st.model_prof, st.work))
        s.plan_detail = e->describe();
      else
        s.plan_detail = "(not costed: " + e.error() + ")";
    } else {
      s.plan_detail = "(not costed: " + cur.error() + ")";
    }
  }
  s.decisions = st.decisions;
  // Where the pipeline's time went: the latest sample against the newest
  // one at least 10 s older.
  if (st.stat_samples.size() >= 2) {
    const auto& [t1, b] = st.stat_samples.back();
    for (auto it = st.stat_samples.rbegin(); it != st.stat_samples.rend(); ++it) {
      if (t1 - it->first < 10s && std::next(it) != st.stat_samples.rend()) continue;
      if (auto p = breakdown_between(it->second, b,
                                     std::chrono::duration<double>(t1 - it->first).count()))
        s.pipeline_detail = p->describe();
      break;
    }
  }
  return s;
}

namespace {

void stop_all(head_ptr self) {
  auto& st = self->state;
  event(self, "stopping every node");
  for (auto& [name, r] : st.rt)
    if (r.agent && name != st.cfg.node.name) self->send(r.agent, down_atom::value);
  for (auto& rp : st.drain_waiters) rp.deliver(true);
  st.drain_waiters.clear();
  // Our own node last, once the answers are out.
  if (auto own = st.rt[st.cfg.node.name].agent) self->delayed_send(own, 300ms, down_atom::value);
}

}  // namespace

void check_drain(head_ptr self) {
  auto& st = self->state;
  if (!st.draining || st.drain_waiters.empty() || st.drain_checking) return;
  if (!st.scheduler || steady::now() - st.drain_since > 120s) return stop_all(self);
  st.drain_checking = true;
  self->request(st.scheduler, 5s, stats_atom::value)
      .then(
          [self](const scheduler_stats& s) {
            self->state.drain_checking = false;
            if (s.queued == 0 && s.running == 0) return stop_all(self);
            self->state.last_event = "draining: " + std::to_string(s.running) + " running, " +
                                     std::to_string(s.queued) + " queued";
          },
          [self](caf::error&) {
            self->state.drain_checking = false;
            stop_all(self);
          });
}

}  // namespace troupe::actors::head_detail
