#include "actors/head_status.hpp"

#include <algorithm>
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
  // A standby names the head it follows (connect_client looks for the
  // node that names itself).
  s.head = st.standby_mode ? st.partner : st.cfg.node.m.head;
  const bool one = st.reps.size() == 1;
  s.ready = std::any_of(st.reps.begin(), st.reps.end(),
                        [](const replica_rt& p) { return p.ready && !p.placing; });
  s.draining = st.draining;
  s.epoch = st.epochs;
  s.encoder = st.encoder_where;
  if (st.encoder) {
    s.encoder_replicas.push_back(st.encoder_where);
    s.encoder_states.push_back("serving");
    for (const auto& e : st.enc_extra) {
      s.encoder_replicas.push_back(e.where);
      s.encoder_states.push_back(e.state == encoder_replica_rt::phase::loading   ? "loading"
                                 : e.state == encoder_replica_rt::phase::serving ? "serving"
                                                                                 : "draining");
    }
    s.encoder_waiting = st.enc_waiting;
    s.encoder_wait_ms = st.enc_mean_wait_ms;
    s.encoder_scale_ups = st.enc_scale_ups;
    s.encoder_scale_downs = st.enc_scale_downs;
    if (st.enc_scaler) {
      s.encoder_min = st.enc_scaler->options().min;
      s.encoder_max = st.enc_scaler->options().max;
    }
  }
  s.last_event = st.last_event;
  s.term = st.cfg.term;
  s.journal_jobs = static_cast<std::int64_t>(st.journal.size());
  if (!st.partner.empty()) {
    const auto waiting = static_cast<std::int64_t>(st.adoptable.size());
    if (st.standby_mode && st.probing)
      s.standby = "this node (" + st.cfg.node.name + ") starts: asking " + st.partner +
                  " whether it took over";
    else if (st.standby_mode)
      s.standby = "this node (" + st.cfg.node.name + ") is the standby: " +
                  (st.followed_once && st.follow_why.empty()
                       ? "following head " + st.partner + ", " + std::to_string(waiting) +
                             " job(s) in its journal"
                       : "not following head " + st.partner + " yet" +
                             (st.follow_why.empty() ? "" : ": " + st.follow_why));
    else if (st.took_over_at)
      s.standby = "took over from head " + st.partner + " " +
                  std::to_string(static_cast<std::int64_t>(ms_since(*st.took_over_at) / 1000)) +
                  " s ago: " + std::to_string(st.resumed_jobs) + " job(s) resumed, " +
                  std::to_string(waiting) + " waiting for their clients, " +
                  std::to_string(st.dropped_jobs) + " dropped; " +
                  (st.follower ? "standby " + st.partner + " follows" : "no standby now");
    else
      s.standby = st.partner + (st.follower ? ": following" : ": not following");
  }
  s.indexed_blocks.assign(4, 0);
  s.detect_ms = st.detect_ms;
  s.resume_ms = st.resume_ms;
  for (const auto& p : st.reps) {
    if (!p.retired) {
      if (!s.placement.empty()) s.placement += "; ";
      if (!one) s.placement += "replica " + std::to_string(p.index) + ": ";
      s.placement += p.plan.empty() ? std::string("(none)") : cluster::describe(p.plan);
    }
    if (one) s.placement = cluster::describe(p.plan);
    s.replacements += p.replacements;
    using models::kv_tier;
    for (int t = 0; t < 4; ++t) s.indexed_blocks[t] += p.blocks.count(static_cast<kv_tier>(t));
    s.block_events += p.block_events;
    s.stages_total += p.stages_total;
    s.stages_loaded += p.stages_loaded;
    replica_view v;
    v.index = p.index;
    v.nodes = p.nodes;
    v.placement = cluster::describe(p.plan);
    v.ready = p.ready && !p.placing && !p.retired;
    v.state = p.retired                      ? "retired"
              : p.retiring                   ? "draining"
              : p.placing                    ? "placing"
              : v.ready                      ? "serving"
              : p.plan.empty() && st.grouped ? "waiting"
                                             : "placing";
    v.epoch = p.epoch;
    v.routed = p.routed;
    v.replacements = p.replacements;
    v.resume_ms = p.resume_ms;
    v.cached_blocks = p.blocks.size();
    if (!p.stat_samples.empty()) fill_replica_view(v, p.stat_samples.back().second);
    s.replicas.push_back(std::move(v));
  }
  s.routed_by_prefix = st.routed_by_prefix;
  s.routed_by_load = st.routed_by_load;
  s.kv_store = st.vault ? st.vault_on : std::string{};
  s.kv_stores = st.vault_stores;
  s.actor_restarts = st.actor_restarts;
  s.migrations = st.migrations;
  s.migration = st.migrating ? st.migration_phase : std::string{};
  s.migration_done = st.migrating ? st.migration_done : 0.0;
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
  if (st.model_prof && one && !st.reps[0].plan.empty()) {
    const auto prof = profile_now(self);
    if (auto cur = plan_of(st.reps[0].plan, prof, st.precision, encoder_node(self))) {
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
  for (const auto& p : st.reps) {
    const auto& q = p.stat_samples;
    if (q.size() < 2) continue;
    const auto& [t1, b] = q.back();
    for (auto it = q.rbegin(); it != q.rend(); ++it) {
      if (t1 - it->first < 10s && std::next(it) != q.rend()) continue;
      if (auto d = breakdown_between(it->second, b,
                                     std::chrono::duration<double>(t1 - it->first).count())) {
        if (!one) s.pipeline_detail += "replica " + std::to_string(p.index) + ": ";
        s.pipeline_detail += d->describe();
        if (!one) s.pipeline_detail += "\n";
      }
      break;
    }
  }
  return s;
}

std::vector<scheduler_actor> schedulers_of(head_ptr self) {
  std::vector<scheduler_actor> out;
  for (const auto& p : self->state.reps)
    if (p.scheduler) out.push_back(p.scheduler);
  return out;
}

void fill_replica_view(replica_view& v, const scheduler_stats& x) {
  v.running = x.running;
  v.queued = x.queued;
  v.kv_total_blocks = x.kv_total_blocks;
  v.kv_used_blocks = x.kv_used_blocks;
  v.finished = x.finished;
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
  const auto schedulers = schedulers_of(self);
  if (schedulers.empty() || steady::now() - st.drain_since > 120s) return stop_all(self);
  st.drain_checking = true;
  // Every replica's requests, summed.
  struct tally {
    std::int64_t running = 0, queued = 0;
    std::size_t left = 0;
    bool failed = false;
  };
  auto t = std::make_shared<tally>();
  t->left = schedulers.size();
  auto one = [self, t](const scheduler_stats* s) {
    if (s) {
      t->running += s->running;
      t->queued += s->queued;
    } else {
      t->failed = true;
    }
    if (--t->left > 0) return;
    self->state.drain_checking = false;
    if (t->failed || (t->queued == 0 && t->running == 0)) return stop_all(self);
    self->state.last_event = "draining: " + std::to_string(t->running) + " running, " +
                             std::to_string(t->queued) + " queued";
  };
  for (const auto& sch : schedulers)
    self->request(sch, 5s, stats_atom::value)
        .then([one](const scheduler_stats& s) { one(&s); }, [one](caf::error&) { one(nullptr); });
}

}  // namespace troupe::actors::head_detail
