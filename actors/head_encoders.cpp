// The vision encoder as a service of its own (`[encoders.vision]`): the
// first replica is the head's (or where a migration moved it); up to
// `max - 1` more run on nodes' agents, one per node. Every scheduler sends
// each request's images to the pool's least busy encoder; the head reads
// the schedulers' encoder counters at each heartbeat, asks the scaler
// (actors/core/encoder_scaler.hpp) for a count, loads a replica on the
// node with the most room, or drains the newest: left out of the pool, it
// is stopped once no request's rows are held there any more.

#include <algorithm>
#include <cstdio>

#include "actors/data_plane.hpp"
#include "actors/head_placement.hpp"
#include "actors/head_state.hpp"
#include "actors/head_status.hpp"
#include "placement/cost.hpp"

namespace troupe::actors::head_detail {

using namespace std::chrono_literals;
using phase = encoder_replica_rt::phase;

namespace {

/// A drained replica is stopped after this long even if rows are still
/// held there: its requests encode their images again elsewhere.
constexpr auto drain_limit = 120s;
/// A node where loading a replica failed is not tried again for this long.
constexpr auto failed_pause = 60s;

/// The replica loading on `node`, if one is.
encoder_replica_rt* loading_on_node(head_state& st, const std::string& node) {
  for (auto& e : st.enc_extra)
    if (e.node == node && e.state == phase::loading) return &e;
  return nullptr;
}

int serving_count(const head_state& st) {
  int n = st.encoder ? 1 : 0;
  for (const auto& e : st.enc_extra)
    if (e.state == phase::serving) ++n;
  return n;
}

void stop_replica(head_ptr self, const encoder_replica_rt& e) {
  auto& st = self->state;
  auto a = st.rt.count(e.node) ? st.rt[e.node].agent : node_agent_actor{};
  if (a)
    self->request(a, st.cfg.node.timeout, drop_enc_atom::value,
                  encoder_order{encoder_kind::vision, {}})
        .then([](std::int32_t) {}, [](caf::error&) {});
  else if (e.actor)
    caf::anon_send_exit(e.actor, caf::exit_reason::user_shutdown);
}

/// The node for one more replica: up, holding stages, without an encoder,
/// with room for its weights; nodes without stages first, then the most
/// free memory, then manifest order.
std::optional<std::string> node_for_replica(head_ptr self, std::string* why) {
  auto& st = self->state;
  const auto now = steady::now();
  const double need = st.model_prof ? placement::encoder_bytes(*st.model_prof, st.precision) : 0;
  struct cand {
    std::string name;
    bool has_stages;
    double room;
    std::size_t order;
  };
  std::vector<cand> c;
  std::size_t order = 0;
  int full = 0;
  for (const auto& name : st.members->usable()) {
    ++order;
    if (name == encoder_node(self) || hosts_encoder_replica(self, name)) continue;
    auto it = st.rt.find(name);
    if (it == st.rt.end() || !it->second.agent) continue;
    if (auto f = st.enc_failed.find(name);
        f != st.enc_failed.end() && now - f->second < failed_pause)
      continue;
    const auto& rep = it->second.report;
    const double room = rep.memory_limit > 0 ? static_cast<double>(rep.memory_limit - rep.rss_bytes)
                                             : 1e18;  // no limit set
    if (room < need) {
      ++full;
      continue;
    }
    bool stages = false;
    for (const auto& p : st.reps) stages = stages || cluster::plan_uses(p.plan, name);
    c.push_back({name, stages, room, order});
  }
  if (c.empty()) {
    *why = full > 0 ? std::to_string(full) + " node(s) without an encoder lack the memory for one"
                    : "every node up runs an encoder already";
    return std::nullopt;
  }
  std::sort(c.begin(), c.end(), [](const cand& a, const cand& b) {
    if (a.has_stages != b.has_stages) return !a.has_stages;
    if (a.room != b.room) return a.room > b.room;
    return a.order < b.order;
  });
  return c.front().name;
}

/// Loads a replica on `node`, connects it to every replica's first stage
/// and adds it to the pool.
void add_replica(head_ptr self, const std::string& node, const std::string& why) {
  auto& st = self->state;
  encoder_replica_rt e;
  e.node = node;
  e.where = node;
  st.enc_extra.push_back(e);
  event(self, "adding a vision encoder replica on " + node + ": " + why);
  auto agent = st.rt[node].agent;
  auto busy = loading_on(self, node);
  const auto t0 = steady::now();
  auto fail = [self, node](const std::string& what) {
    auto& st = self->state;
    std::erase_if(st.enc_extra, [&](const encoder_replica_rt& x) {
      return x.node == node && x.state == phase::loading;
    });
    st.enc_failed[node] = steady::now();
    if (st.enc_scaler) st.enc_scaler->restart();
    event(self, "the vision encoder replica on " + node + " failed: " + what, true);
  };
  self->request(agent, st.cfg.node.timeout, load_enc_atom::value,
                encoder_order{encoder_kind::vision, data_plane::local().address()})
      .then(
          [self, node, agent, fail, busy, t0](encoder_actor& fresh) {
            auto& st = self->state;
            if (!loading_on_node(st, node)) return;  // lost meanwhile
            // It sends image rows to each replica's first stage: its node
            // reaches theirs first.
            const auto firsts = first_stages_away_from(self, node);
            auto ready = [self, node, fresh, t0] {
              auto& st = self->state;
              auto* it = loading_on_node(st, node);
              if (!it) return;
              it->actor = fresh;
              it->state = phase::serving;
              it->since = steady::now();
              const auto& rep = st.rt[node].report;
              it->where = node + " " + (rep.devices.empty() ? std::string("cpu") : rep.devices);
              ++st.enc_scale_ups;
              if (st.enc_scaler) st.enc_scaler->restart();
              push_encoder_pool(self);
              char buf[160];
              std::snprintf(buf, sizeof buf,
                            "vision encoder replica on %s serves (loaded in %.0f ms; %d now)",
                            node.c_str(), ms_since(t0), serving_count(st));
              event(self, buf);
            };
            if (firsts.empty()) return ready();
            auto left = std::make_shared<std::size_t>(firsts.size());
            auto failed = std::make_shared<bool>(false);
            for (const auto& f : firsts)
              self->request(agent, st.cfg.node.timeout, connect_atom::value, f.first, f.second)
                  .then(
                      [ready, left, failed](bool) {
                        if (--*left == 0 && !*failed) ready();
                      },
                      [self, fail, failed, first = f.second](caf::error& e) {
                        if (*failed) return;
                        *failed = true;
                        fail("connecting it to " + first + ": " + describe(self->system(), e));
                      });
          },
          [self, fail](caf::error& e) { fail(describe(self->system(), e)); });
}

/// Drains the newest serving replica: no new images; stopped once free.
void drain_replica(head_ptr self, const std::string& why) {
  auto& st = self->state;
  for (auto it = st.enc_extra.rbegin(); it != st.enc_extra.rend(); ++it) {
    if (it->state != phase::serving) continue;
    it->state = phase::draining;
    it->since = steady::now();
    ++st.enc_scale_downs;
    event(self, "draining the vision encoder replica on " + it->node + ": " + why);
    push_encoder_pool(self);
    return;
  }
}

/// Stops drained replicas once no scheduler holds rows there (or after drain_limit).
void stop_drained(head_ptr self) {
  auto& st = self->state;
  const bool any = std::any_of(st.enc_extra.begin(), st.enc_extra.end(),
                               [](const auto& e) { return e.state == phase::draining; });
  if (!any || st.enc_drain_asking) return;
  const auto schedulers = schedulers_of(self);
  auto finish = [self](bool free) {
    auto& st = self->state;
    st.enc_drain_asking = false;
    const auto now = steady::now();
    std::vector<encoder_replica_rt> stopped;
    std::erase_if(st.enc_extra, [&](const encoder_replica_rt& e) {
      if (e.state != phase::draining || !(free || now - e.since > drain_limit)) return false;
      stopped.push_back(e);
      return true;
    });
    for (const auto& e : stopped) {
      stop_replica(self, e);
      event(self, "stopped the vision encoder replica on " + e.node + " (drained)");
    }
  };
  if (schedulers.empty()) return finish(true);
  st.enc_drain_asking = true;
  struct tally {
    std::size_t left;
    std::int64_t held = 0;
    bool failed = false;
  };
  auto t = std::make_shared<tally>(tally{schedulers.size()});
  const auto pool = encoder_pool(self);
  for (const auto& s : schedulers)
    self->request(s, 5s, encoders_atom::value, pool, std::vector<encoder_actor>{})
        .then(
            [t, finish](std::int64_t held) {
              t->held += held;
              if (--t->left == 0) finish(t->held == 0 && !t->failed);
            },
            [t, finish](caf::error&) {
              t->failed = true;
              if (--t->left == 0) finish(false);
            });
}

}  // namespace

std::vector<encoder_actor> encoder_pool(head_ptr self) {
  auto& st = self->state;
  std::vector<encoder_actor> pool;
  if (st.encoder) pool.push_back(st.encoder);
  for (const auto& e : st.enc_extra)
    if (e.state == phase::serving && e.actor) pool.push_back(e.actor);
  return pool;
}

void push_encoder_pool(head_ptr self, const std::vector<encoder_actor>& lost) {
  const auto pool = encoder_pool(self);
  for (const auto& s : schedulers_of(self))
    self->request(s, 5s, encoders_atom::value, pool, lost)
        .then([](std::int64_t) {}, [](caf::error&) {});
}

std::vector<std::pair<stage_handles, std::string>> first_stages_away_from(head_ptr self,
                                                                          const std::string& node) {
  std::vector<std::pair<stage_handles, std::string>> out;
  for (const auto& p : self->state.reps)
    if (!p.plan.empty() && !p.handles.empty() && p.plan[0].node != node)
      out.emplace_back(p.handles[0], p.plan[0].node);
  return out;
}

bool hosts_encoder_replica(head_ptr self, const std::string& node) {
  const auto& x = self->state.enc_extra;
  return std::any_of(x.begin(), x.end(), [&](const auto& e) { return e.node == node; });
}

void encoder_node_lost(head_ptr self, const std::string& name) {
  auto& st = self->state;
  std::vector<encoder_actor> lost;
  std::erase_if(st.enc_extra, [&](const encoder_replica_rt& e) {
    if (e.node != name) return false;
    if (e.actor) lost.push_back(e.actor);
    return true;
  });
  if (lost.empty()) return;
  event(self, "the vision encoder replica on " + name + " is lost with its node", true);
  if (st.enc_scaler) st.enc_scaler->restart();
  push_encoder_pool(self, lost);
}

void connect_encoders_to(head_ptr self, int r) {
  auto& st = self->state;
  const auto& p = rep(self, r);
  if (p.plan.empty() || p.handles.empty()) return;
  const auto first = p.plan[0].node;
  for (const auto& e : st.enc_extra) {
    if (e.node == first || e.state == phase::loading) continue;
    auto a = st.rt[e.node].agent;
    if (!a) continue;
    self->request(a, st.cfg.node.timeout, connect_atom::value, p.handles[0], first)
        .then([](bool) {},
              [self, node = e.node, first](caf::error& err) {
                event(self,
                      "connecting the vision encoder replica on " + node + " to " + first + ": " +
                          describe(self->system(), err) +
                          " (its requests' images are encoded again elsewhere)",
                      true);
              });
  }
}

void encoder_service_tick(head_ptr self) {
  auto& st = self->state;
  if (!st.encoder || !st.enc_scaler || st.draining) return;
  stop_drained(self);
  // The schedulers' counters at their last answers.
  std::int64_t waiting = 0, encodes = 0;
  double wait_ms = 0;
  bool serving = false;
  for (const auto& p : st.reps) {
    if (p.retired || !p.scheduler || p.stat_samples.empty()) continue;
    const auto& s = p.stat_samples.back().second;
    waiting += s.encode_waiting;
    encodes += s.encodes;
    wait_ms += s.encode_wait_ms;
    serving = serving || p.serving();
  }
  std::int64_t answered = encodes - st.enc_seen_encodes;
  double waited = wait_ms - st.enc_seen_wait_ms;
  if (answered < 0 || waited < 0) answered = 0, waited = 0;  // a scheduler started over
  st.enc_seen_encodes = encodes;
  st.enc_seen_wait_ms = wait_ms;
  st.enc_waiting = waiting;
  st.enc_mean_wait_ms = answered > 0 ? waited / static_cast<double>(answered) : -1;
  if (!serving) return;  // the first placement, or every replica placed again
  const bool loading = std::any_of(st.enc_extra.begin(), st.enc_extra.end(),
                                   [](const auto& e) { return e.state == phase::loading; });
  if (loading) return;
  const int n = serving_count(st);
  const auto d = st.enc_scaler->observe({n, waiting, answered, waited});
  if (d.replicas > n) {
    std::string why;
    if (auto node = node_for_replica(self, &why)) {
      st.enc_no_room.clear();
      add_replica(self, *node, d.reason);
    } else if (st.enc_no_room != why) {
      st.enc_no_room = why;
      event(self, "the vision encoder would take another replica (" + d.reason + "), but " + why,
            true);
    }
  } else if (d.replicas < n && n > 1) {
    drain_replica(self, d.reason);
  }
}

}  // namespace troupe::actors::head_detail
