#include "actors/cluster.hpp"
#include "actors/log.hpp"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <caf/io/all.hpp>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>

#include "actors/data_plane.hpp"
#include "actors/device_probe.hpp"
#include "actors/gatekeeper.hpp"
#include "actors/pipeline_stats.hpp"
#include "actors/placement_control.hpp"
#include "actors/prompt.hpp"
#include "actors/stage.hpp"
#include "cluster/certs.hpp"
#include "models/weights.hpp"

namespace troupe::actors {

namespace {

using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

double ms_since(steady::time_point t) {
  return std::chrono::duration<double, std::milli>(steady::now() - t).count();
}

// The node id each node had when this process last joined it: a stage's
// agent joins the next stage's node only when no live connection to that
// incarnation exists yet (the head's joins count too).
struct joined_registry {
  std::mutex mtx;
  std::map<std::string, caf::node_id> ids;
};
joined_registry& joined_nodes() {
  static joined_registry r;
  return r;
}

// One compute context per device and process: the head's encoder and the
// stages its agent loads share the device's team and lock.
std::shared_ptr<device_context> context_for(const device_spec& d) {
  static std::mutex mtx;
  static std::map<std::string, std::shared_ptr<device_context>> contexts;
  std::lock_guard lock(mtx);
  auto& c = contexts[d.name];
  if (!c) c = device_context::create(d);
  return c;
}

std::int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  std::int64_t pages = 0, resident = 0;
  if (!(f >> pages >> resident)) return 0;
  return resident * static_cast<std::int64_t>(::sysconf(_SC_PAGESIZE));
}

std::string gib(std::int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

// -- the node agent ------------------------------------------------------------

struct held_stage {
  std::shared_ptr<stage_resources> res;
  shard_actor shard;
  kv_store_actor kv;
  models::kv_usage usage;  ///< last read (heartbeat reports)
};

struct agent_state {
  node_config cfg;
  std::vector<held_stage> stages;
  encoder_actor encoder;  ///< a vision encoder moved here (live migration)
  std::uint64_t epoch = 0;
  std::string failure;
  device_probe probe;                  ///< measured at start
  std::unique_ptr<foreign_load> load;  ///< sampled at each heartbeat
};

using agent_ptr = node_agent_actor::stateful_pointer<agent_state>;

void drop_stages(agent_ptr self) {
  auto& st = self->state;
  for (auto& h : st.stages) {
    self->demonitor(h.shard.address());
    self->demonitor(h.kv.address());
    caf::anon_send_exit(h.shard, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(h.kv, caf::exit_reason::user_shutdown);
  }
  st.stages.clear();
  st.failure.clear();
}

/// Makes the stage that follows reachable from this node: joins its node
/// (once) and connects the data plane to it. An error names `what`.
caf::error connect_next(agent_ptr self, const std::string& what, const stage_handles& next,
                        const std::string& next_node) {
  const auto& c = self->state.cfg;
  if (!next.shard)
    return make_error(error_code::invalid_request, what + ": the next stage has no shard");
  if (next_node == c.name) return {};
  const auto nid = next.shard->node();
  bool known = false;
  {
    auto& r = joined_nodes();
    std::lock_guard lock(r.mtx);
    auto it = r.ids.find(next_node);
    known = it != r.ids.end() && it->second == nid;
  }
  if (!known) {
    auto pass = join_node(self->system(), c.m, c.name, next_node, c.timeout);
    if (!pass)
      return make_error(error_code::stage_failed,
                        what + ": joining the next stage's node: " + pass.error());
    if (!pass->agent || pass->agent->node() != nid)
      return make_error(error_code::stage_failed, what + ": node " + next_node +
                                                      " restarted since the head placed its stage");
    auto& r = joined_nodes();
    std::lock_guard lock(r.mtx);
    r.ids[next_node] = nid;
  }
  if (auto r = data_plane::local().connect(to_string(nid), next.engine_address); !r)
    return make_error(error_code::stage_failed,
                      what + ": data plane to node " + next_node + ": " + r.error().message);
  return {};
}

caf::result<stage_handles> load_stage(agent_ptr self, const stage_order& o) {
  auto& st = self->state;
  const auto& c = st.cfg;
  const std::string what = "node " + c.name + ", layers [" + std::to_string(o.first_layer) + "," +
                           std::to_string(o.last_layer) + ")";
  if (o.epoch < st.epoch)
    return make_error(error_code::invalid_request, what + ": placement " + std::to_string(o.epoch) +
                                                       " is older than this node's " +
                                                       std::to_string(st.epoch));
  if (o.epoch > st.epoch) {
    drop_stages(self);  // a new placement: what the old one left goes
    st.epoch = o.epoch;
  }
  if (o.first_layer < 0 || o.last_layer <= o.first_layer)
    return make_error(error_code::invalid_request, what + ": an empty or negative layer range");
  auto& dp = data_plane::local();
  if (o.has_next) {
    if (auto e = connect_next(self, what, o.next, o.next_node)) return e;
  }
  models::layer_range range;
  range.first = o.first_layer;
  range.last = o.last_layer;
  range.embed = o.embed;
  range.head = o.head;
  const auto t0 = steady::now();
  auto res = make_stage(context_for(c.device), c.model, range, c.plan, c.kv);
  if (!res) return make_error(error_code::stage_failed, what + ": " + res.error().message);
  if (c.memory_limit > 0 && resident_bytes() > c.memory_limit)
    return make_error(error_code::stage_failed,
                      what + ": the node now uses " + gib(resident_bytes()) +
                          ", over its memory limit of " + gib(c.memory_limit) + " (manifest)");
  auto shard = spawn_shard(self->system(), *res, o.has_next ? o.next.shard : shard_actor{});
  auto kv = spawn_kv_store(self->system(), *res);
  self->monitor(shard);
  self->monitor(kv);
  st.stages.push_back({*res, shard, kv, {}});
  logging::of("agent").info(
      "node {}: holds layers [{},{}) on {} (placement {}, loaded in {:.0f} ms)", c.name,
      o.first_layer, o.last_layer, c.device.name, o.epoch, ms_since(t0));
  return stage_handles{shard, kv, o.first_layer, o.last_layer, dp.address(), 0, 1};
}

node_report report_of(agent_ptr self) {
  auto& st = self->state;
  node_report r;
  r.node = st.cfg.name;
  r.devices = st.cfg.device.name;
  r.epoch = st.epoch;
  r.rss_bytes = resident_bytes();
  r.memory_limit = st.cfg.memory_limit;
  r.failure = st.failure;
  r.probe = st.probe;
  r.load = st.load ? st.load->sample() : 0.0;
  r.engine_address = data_plane::local().address();
  for (auto& h : st.stages) {
    const auto range = h.res->model->range();
    if (!r.stages.empty()) r.stages += ", ";
    r.stages += "layers [" + std::to_string(range.first) + "," + std::to_string(range.last) + ")";
    // A step holds the KV store's lock for its whole length (hundreds of
    // ms for a big model, back to back): the heartbeat answer does not
    // wait behind it, and reports the usage it last saw.
    std::unique_lock lock(h.res->kv->mtx, std::try_to_lock);
    if (lock.owns_lock()) h.usage = h.res->kv->cache.usage();
    const auto& u = h.usage;
    r.kv_total_blocks += u.total_blocks;
    r.kv_used_blocks += u.total_blocks - u.free_blocks;
    r.kv_tokens += u.tokens;
    r.weight_bytes += static_cast<std::int64_t>(h.res->model->bytes_per_token());
  }
  for (const auto& [peer, bytes] : data_plane::local().bytes_sent()) {
    r.link_peers.push_back(peer);
    r.link_bytes.push_back(static_cast<std::int64_t>(bytes));
  }
  return r;
}

}  // namespace

node_agent_actor spawn_node_agent(caf::actor_system& sys, node_config cfg) {
  auto impl = [](agent_ptr self, node_config cfg) -> node_agent_actor::behavior_type {
    self->state.cfg = std::move(cfg);
    {
      auto& st = self->state;
      st.probe = measure_device(*context_for(st.cfg.device), st.cfg.memory_limit);
      st.load = std::make_unique<foreign_load>(st.cfg.device.cores);
      logging::of("agent").info(
          "node {}: {} measured in {:.0f} ms: GEMV f32 {:.1f}, f16 {:.1f}, q8_0 {:.1f}, q4_0 "
          "{:.1f} GB/s; GEMM (16 rows) "
          "f32 {:.1f}, f16 {:.1f}, q8_0 {:.1f}, q4_0 {:.1f} GFLOP/s; {:.2f} GiB for troupe",
          st.cfg.name, st.probe.device, st.probe.probe_ms, st.probe.gemv_f32 / 1e9,
          st.probe.gemv_f16 / 1e9, st.probe.gemv_q8_0 / 1e9, st.probe.gemv_q4_0 / 1e9,
          st.probe.gemm_f32 / 1e9, st.probe.gemm_f16 / 1e9, st.probe.gemm_q8_0 / 1e9,
          st.probe.gemm_q4_0 / 1e9, static_cast<double>(st.probe.memory_bytes) / (1 << 30));
    }
    self->set_exit_handler([self](caf::exit_msg& em) {
      drop_stages(self);  // the stage actors go with the agent
      if (self->state.encoder)
        caf::anon_send_exit(self->state.encoder, caf::exit_reason::user_shutdown);
      self->quit(em.reason);
    });
    self->set_down_handler([self](caf::down_msg& dm) {
      auto& st = self->state;
      for (const auto& h : st.stages)
        if (h.shard.address() == dm.source || h.kv.address() == dm.source)
          st.failure = "a stage actor stopped: " + self->system().render(dm.reason);
    });
    return {
        [=](load_atom, const stage_order& o) { return load_stage(self, o); },
        [=](drop_atom) {
          const auto n = static_cast<std::int32_t>(self->state.stages.size());
          drop_stages(self);
          return n;
        },
        [=](ping_atom) { return report_of(self); },
        [=](route_atom, std::int32_t first, const stage_handles& next,
            const std::string& next_node) -> caf::result<bool> {
          auto& st = self->state;
          const std::string what =
              "node " + st.cfg.name + ", re-routing layers from " + std::to_string(first);
          auto it = std::find_if(st.stages.begin(), st.stages.end(), [&](const held_stage& h) {
            return h.res->model->range().first == first;
          });
          if (it == st.stages.end())
            return make_error(error_code::not_found, what + ": no such stage here");
          if (auto e = connect_next(self, what, next, next_node)) return e;
          auto rp = self->make_response_promise<bool>();
          self->request(it->shard, st.cfg.timeout, route_atom::value,
                        caf::actor_cast<caf::strong_actor_ptr>(next.shard))
              .then([rp](bool ok) mutable { rp.deliver(ok); },
                    [rp](caf::error& e) mutable { rp.deliver(std::move(e)); });
          return rp;
        },
        [=](route_atom, const stage_handles& to, const std::string& name) -> caf::result<bool> {
          if (auto e = connect_next(
                  self, "node " + self->state.cfg.name + ", connecting to " + name, to, name))
            return e;
          return true;
        },
        [=](load_atom, const std::string& what,
            const std::vector<std::uint8_t>& head_address) -> caf::result<encoder_actor> {
          auto& st = self->state;
          if (what != "vision")
            return make_error(error_code::invalid_request,
                              "no encoder '" + what.substr(0, 32) + "'");
          const auto& sender = self->current_sender();
          if (!sender) return make_error(error_code::invalid_request, "an anonymous encoder order");
          if (sender->node() != self->node()) {
            if (auto r = data_plane::local().connect(to_string(sender->node()), head_address); !r)
              return make_error(
                  error_code::stage_failed,
                  "node " + st.cfg.name + ", data plane to the head: " + r.error().message);
          }
          if (st.encoder) return st.encoder;
          const auto t0 = steady::now();
          auto enc = make_vision_encoder(context_for(st.cfg.device), st.cfg.model, st.cfg.plan);
          if (!enc)
            return make_error(error_code::stage_failed,
                              "node " + st.cfg.name + ", vision encoder: " + enc.error().message);
          st.encoder = spawn_encoder(self->system(), *enc, encoder_options{});
          logging::of("agent").info("node {}: runs the vision encoder on {} (loaded in {:.0f} ms)",
                                    st.cfg.name, st.cfg.device.name, ms_since(t0));
          return st.encoder;
        },
        [=](drop_atom, const std::string& what) -> std::int32_t {
          auto& st = self->state;
          if (what != "vision" || !st.encoder) return 0;
          caf::anon_send_exit(st.encoder, caf::exit_reason::user_shutdown);
          st.encoder = encoder_actor{};
          return 1;
        },
        [=](drop_atom, std::int32_t first) -> std::int32_t {
          auto& st = self->state;
          std::int32_t n = 0;
          for (auto it = st.stages.begin(); it != st.stages.end();) {
            if (it->res->model->range().first != first) {
              ++it;
              continue;
            }
            self->demonitor(it->shard.address());
            self->demonitor(it->kv.address());
            caf::anon_send_exit(it->shard, caf::exit_reason::user_shutdown);
            caf::anon_send_exit(it->kv, caf::exit_reason::user_shutdown);
            it = st.stages.erase(it);
            ++n;
          }
          logging::of("agent").info("node {}: let go of the stage at layer {} (migrated)",
                                    st.cfg.name, first);
          return n;
        },
        [=](probe_atom, const tensor_ref& ref) -> caf::result<std::int64_t> {
          auto& st = self->state;
          auto t = data_plane::local().take(ref, context_for(st.cfg.device)->ctx->memory());
          if (!t)
            return make_error(error_code::stage_failed,
                              "node " + st.cfg.name + ", link probe: " + t.error().message);
          return static_cast<std::int64_t>(t->nbytes());
        },
        [=](down_atom) {
          logging::of("agent").info("node {}: told to stop", self->state.cfg.name);
          drop_stages(self);
          ::kill(::getpid(), SIGTERM);  // the main thread waits for it
        },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(cfg));
}

// -- the head ------------------------------------------------------------------

namespace {

using head_core_actor =
    frontdoor_actor::extend<caf::reacts_to<tick_atom>,
                            caf::reacts_to<joined_atom, std::string, gate_pass>,
                            caf::reacts_to<joined_atom, std::string, std::string>>;

struct member_rt {
  node_agent_actor agent;
  node_report report;
  bool joining = false;  ///< a join attempt is under way
  std::string why;       ///< the last failed join's reason
  int loading = 0;       ///< loads asked of it and not answered: its agent is busy, not gone
};

struct head_state {
  head_config cfg;
  prompt_setup prompt;
  model_frontend frontend;
  int layers = 0;
  std::optional<cluster::membership> members;
  std::map<std::string, member_rt> rt;
  scheduler_actor scheduler;
  encoder_actor encoder;
  std::string encoder_where;
  std::vector<cluster::stage_slot> plan;
  std::uint64_t epoch = 0;
  bool placing = false, ready = false, draining = false, retry_queued = false, placement_ok = false;
  std::int64_t replacements = 0;
  std::int64_t actor_restarts = 0;  ///< stages loaded again after a loss
  std::int64_t migrations = 0;
  std::int32_t stages_total = 0, stages_loaded = 0;  ///< the placement under way
  std::vector<stage_handles> handles;                ///< the placed stages' actors, in order
  bool migrating = false;                            ///< one live migration at a time
  std::string migration_phase;  ///< what it is doing (troupe migrate's progress bar)
  double migration_done = 0;
  std::string encoder_owner;  ///< the node whose agent spawned the encoder ("": the head did)
  /// Node names by CAF node id (data-plane link labels), kept after a loss.
  std::map<std::string, std::string> node_names;
  std::string last_event;
  double detect_ms = -1, resume_ms = -1;
  std::optional<steady::time_point> lost_at;
  steady::time_point started = steady::now(), last_heartbeat;
  std::vector<caf::typed_response_promise<bool>> drain_waiters;
  steady::time_point last_stats_line = steady::now();
  scheduler_stats last_stats;
  steady::time_point drain_since;
  bool drain_checking = false;

  // -- placement (actors/placement_control.hpp) --
  bool auto_place = false;  ///< pipeline_stages = "auto": the planner places and re-plans
  std::optional<placement::model_profile> model_prof;
  placement::precision precision = placement::precision::f32;
  placement::workload work;
  placement::policy_options policy_opt;
  placement::policy_state policy;
  struct link_state {
    bool measuring = false, done = false;
    caf::node_id of;  ///< the node incarnation it was measured to
    placement::link_profile link;
  };
  std::map<std::string, link_state> links;  ///< head <-> node, by node
  std::vector<placement_decision> decisions;
  struct pending_measure {
    std::size_t index;
    steady::time_point applied;
    /// Requests the scheduler had accepted when it took effect: once as
    /// many have finished, those that were running then (and recomputed
    /// after a re-split) are done.
    std::int64_t accepted = -1;
    std::optional<steady::time_point> settled;
  };
  std::vector<pending_measure> to_measure;
  token_rate tokens;
  /// The scheduler's counters at each heartbeat, the last minute of them
  /// (status: where the pipeline's time went).
  std::deque<std::pair<steady::time_point, scheduler_stats>> stat_samples;
  std::vector<std::string>
      joined_since;  ///< nodes that joined after the first placement, not yet re-planned for
  steady::time_point next_policy = steady::now();
  bool rebalancing = false;  ///< a decision's moves are under way
  std::optional<std::size_t>
      placing_decision;         ///< the decision the placement under way carries out
  std::string want_encoder_on;  ///< the planner's node for the encoder, moved there after placing
  bool resume_after_placement = false;  ///< a re-split paused the scheduler
};

using head_ptr = head_core_actor::stateful_pointer<head_state>;

void event(head_ptr self, const std::string& what, bool warn = false) {
  self->state.last_event = what;
  if (warn)
    logging::of("head").warn("{}", what);
  else
    logging::of("head").info("{}", what);
}

std::shared_ptr<void> loading_on(head_ptr self, const std::string& node) {
  ++self->state.rt[node].loading;
  // The guard lives in the request's handlers, which run in the actor.
  return std::shared_ptr<void>(nullptr, [self, node](void*) {
    auto it = self->state.rt.find(node);
    if (it != self->state.rt.end() && it->second.loading > 0) --it->second.loading;
  });
}

bool from_this_process(head_ptr self) {
  const auto& s = self->current_sender();
  return s && s->node() == self->node();
}

/// Counts a load under way on `node` until the returned guard goes: a node
/// agent busy loading weights (seconds, for a big model) does not answer
/// heartbeats, and is not lost for that while its connection holds.
std::shared_ptr<void> loading_on(head_ptr self, const std::string& node);

void replace(head_ptr self, const std::string& trigger = "retry",
             std::optional<std::vector<cluster::stage_slot>> forced = std::nullopt);
void heartbeat(head_ptr self);

// -- placement: measurements, the planner, the policy ----------------------------
//
// Every node measures its device when it starts (device_probe) and reports
// the load on its cores at each heartbeat; the head measures the link to
// each node (a ping and an 8 MiB push over the data plane). With
// pipeline_stages = "auto" the planner (placement/) chooses the stages
// from these, and every 5 s (at once when a node joins) the policy decides
// whether shards move: whole stages move by live migration, a new layer
// split is placed afresh with the scheduler paused (running requests then
// recompute). Each decision is logged with its predicted step times and
// the throughput measured before and after it.

double since_start_s(head_ptr self) {
  return std::chrono::duration<double>(steady::now() - self->state.started).count();
}

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

/// Every usable node has reported its probe, and every link from the head
/// to one was measured (or failed to be).
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

struct link_run {
  std::string name;
  node_agent_actor agent;
  std::string key;
  int left = 3;
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
  if (run->left-- == 0) return finish("");
  const auto t0 = steady::now();
  self->request(run->agent, st.cfg.node.timeout, ping_atom::value)
      .then(
          [self, run, t0, finish](node_report&) {
            run->rtt_s =
                std::min(run->rtt_s, std::chrono::duration<double>(steady::now() - t0).count());
            auto& st = self->state;
            auto t = kernels::tensor::zeros(context_for(st.cfg.node.device)->ctx->memory(),
                                            kernels::dtype::f32, {std::int64_t{2} << 20});
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

/// Measures the link from the head to `name` once per incarnation of it.
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

/// The throughput after each applied decision: tokens per second over
/// measure_s once it settled. It settles when the requests that were
/// running when it took effect have finished (after a re-split they
/// recompute their context first, a burst that is not the new placement's
/// steady rate), at least 5 s and at most 60 s after it.
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

/// The stages for a placement: the planner's with pipeline_stages =
/// "auto" (recorded as a decision, unless it retries one), else one even
/// split per the manifest.
std::vector<cluster::stage_slot> choose_slots(head_ptr self, const std::string& trigger) {
  auto& st = self->state;
  const auto usable = st.members->usable();
  auto fixed = [&] {
    return cluster::place_pipeline(st.layers, st.cfg.node.m.parallelism.pipeline_stages, usable,
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

void replace(head_ptr self, const std::string& trigger,
             std::optional<std::vector<cluster::stage_slot>> forced);

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

/// Every 5 s, and at once after a node joined: should shards move?
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

void start_join(head_ptr self, const std::string& name) {
  auto& st = self->state;
  auto& r = st.rt[name];
  if (r.joining) return;
  r.joining = true;
  const auto core = caf::actor_cast<head_core_actor>(self);
  self->system().spawn<caf::detached>([core, m = st.cfg.node.m, me = st.cfg.node.name, name,
                                       timeout = st.cfg.node.timeout](caf::blocking_actor* b) {
    auto pass =
        join_node(b->system(), m, me, name, std::min(timeout, std::chrono::milliseconds(5000)));
    if (pass)
      b->send(core, joined_atom::value, name, *pass);
    else
      b->send(core, joined_atom::value, name, pass.error());
  });
}

void on_lost(head_ptr self, const std::string& name, const std::string& why) {
  auto& st = self->state;
  auto& r = st.rt[name];
  if (r.agent) self->demonitor(r.agent.address());
  r.agent = node_agent_actor{};
  {
    auto& reg = joined_nodes();
    std::lock_guard lock(reg.mtx);
    reg.ids.erase(name);
  }
  const auto* m = st.members->find(name);
  st.detect_ms = m && m->last_seen ? ms_since(*m->last_seen) : -1;
  event(self, "node " + name + " lost: " + why, true);
  const bool held =
      std::any_of(st.plan.begin(), st.plan.end(), [&](const auto& s) { return s.node == name; });
  if ((held || st.placing) && !st.draining) {
    st.lost_at = steady::now();
    replace(self, "node " + name + " lost");
  }
}

void finish_placement(head_ptr self, std::uint64_t epoch, std::vector<stage_handles> handles) {
  auto& st = self->state;
  if (epoch != st.epoch) return;
  std::vector<shard_actor> shards;
  std::vector<kv_store_actor> kvs;
  for (const auto& h : handles) {
    shards.push_back(h.shard);
    kvs.push_back(h.kv);
  }
  auto done = [self, epoch, shards, kvs, handles](std::int64_t blocks) {
    auto& st = self->state;
    if (epoch != st.epoch) return;
    st.handles = handles;
    st.placing = false;
    st.placement_ok = true;
    if (!st.scheduler) {
      auto sopts = st.cfg.scheduler;
      sopts.kv = st.cfg.node.kv;
      sopts.kv_blocks = blocks;
      st.scheduler = spawn_scheduler(self->system(), st.frontend, sopts, shards, kvs, st.encoder);
    } else {
      self->send(st.scheduler, reset_atom::value, shards, kvs);
    }
    st.ready = true;
    std::string how =
        "placed " + cluster::describe(st.plan) + " (placement " + std::to_string(epoch) + ")";
    if (st.lost_at) {
      st.resume_ms = ms_since(*st.lost_at);
      ++st.replacements;
      st.actor_restarts += static_cast<std::int64_t>(st.plan.size());
      st.lost_at.reset();
      char buf[64];
      std::snprintf(buf, sizeof buf, "; requests resume %.0f ms after the loss", st.resume_ms);
      how += buf;
    }
    event(self, how);
    decision_applied(self, st.placing_decision);
    st.placing_decision.reset();
    st.rebalancing = false;
    if (st.resume_after_placement) {
      st.resume_after_placement = false;
      self->send(st.scheduler,
                 route_atom::value);  // after the reset: the requests recompute on the new stages
    }
    if (!st.want_encoder_on.empty() && st.encoder && st.want_encoder_on != encoder_node(self)) {
      const auto to = st.want_encoder_on;
      self->request(caf::actor_cast<frontdoor_actor>(self), std::chrono::minutes(10),
                    migrate_atom::value, migrate_request{"vision", to})
          .then([](const migrate_report&) {},
                [self, to](caf::error& e) {
                  event(self,
                        "moving the vision encoder to " + to + ": " + describe(self->system(), e),
                        true);
                });
    }
    st.want_encoder_on.clear();
    heartbeat(self);  // fresh reports: `troupe status` shows the new stages at once
  };
  if (st.scheduler) {
    done(0);
    return;
  }
  self->request(kvs.front(), st.cfg.node.timeout, usage_atom::value)
      .then([done](const kv_usage_info& u) { done(u.total_blocks); },
            [self, epoch](caf::error& e) {
              if (epoch != self->state.epoch) return;
              self->state.placing = false;
              event(self, "placement " + std::to_string(epoch) + ": " + describe(self->system(), e),
                    true);
            });
}

void replace(head_ptr self, const std::string& trigger,
             std::optional<std::vector<cluster::stage_slot>> forced) {
  auto& st = self->state;
  if (st.draining) return;
  const auto epoch = ++st.epoch;
  const auto plan = forced ? std::move(*forced) : choose_slots(self, trigger);
  if (plan.empty()) {
    st.placing = false;
    event(self, "no node can hold the model now (the head is not up)", true);
    return;
  }
  st.placing = true;
  // Nodes left out of the new plan let go of what they hold.
  for (auto& [name, r] : st.rt) {
    const bool in =
        std::any_of(plan.begin(), plan.end(), [&](const auto& s) { return s.node == name; });
    if (!in && r.agent)
      self->request(r.agent, st.cfg.node.timeout, drop_atom::value)
          .then([](std::int32_t) {}, [](caf::error&) {});
  }
  st.plan = plan;
  st.stages_total = static_cast<std::int32_t>(plan.size());
  st.stages_loaded = 0;
  event(self, "placing " + cluster::describe(plan) + " (placement " + std::to_string(epoch) + ")");
  auto handles = std::make_shared<std::vector<stage_handles>>(plan.size());
  auto load = std::make_shared<std::function<void(std::size_t)>>();
  *load = [self, epoch, plan, handles, load](std::size_t i) {
    auto& st = self->state;
    if (epoch != st.epoch) return;
    const auto& slot = plan[i];
    auto agent = st.rt[slot.node].agent;
    auto fail = [self, epoch, slot](const std::string& why) {
      auto& st = self->state;
      if (epoch != st.epoch) return;
      st.placing = false;
      st.placement_ok = false;
      event(self,
            "placing layers [" + std::to_string(slot.first_layer) + "," +
                std::to_string(slot.last_layer) + ") on " + slot.node + " failed: " + why +
                "; trying again",
            true);
      if (!st.retry_queued) {
        st.retry_queued = true;
        self->delayed_send(self, 500ms, tick_atom::value);
      }
    };
    if (!agent) return fail("the node is not up");
    stage_order o;
    o.first_layer = slot.first_layer;
    o.last_layer = slot.last_layer;
    o.embed = i == 0;
    o.head = i + 1 == plan.size();
    o.epoch = epoch;
    if (i + 1 < plan.size()) {
      o.has_next = true;
      o.next = (*handles)[i + 1];
      o.next_node = plan[i + 1].node;
    }
    auto busy = loading_on(self, slot.node);
    self->request(agent, st.cfg.node.timeout, load_atom::value, o)
        .then(
            [self, epoch, handles, load, i, slot, n = plan.size(), busy](stage_handles& h) {
              if (epoch != self->state.epoch) return;
              ++self->state.stages_loaded;
              event(self, "loaded layers [" + std::to_string(slot.first_layer) + "," +
                              std::to_string(slot.last_layer) + ") on " + slot.node + " (" +
                              std::to_string(n - i) + " of " + std::to_string(n) + " stages)");
              (*handles)[i] = std::move(h);
              if (i == 0) {
                auto& st = self->state;
                auto own = st.rt[st.cfg.node.name].agent;
                if (slot.node != st.cfg.node.name && own) {
                  // The first stage is off the head: the scheduler's image
                  // embeddings reach it over the data plane.
                  self->request(own, st.cfg.node.timeout, route_atom::value, (*handles)[0],
                                slot.node)
                      .then(
                          [self, epoch, handles](bool) { finish_placement(self, epoch, *handles); },
                          [self, epoch, slot](caf::error& e) {
                            auto& st = self->state;
                            if (epoch != st.epoch) return;
                            st.placing = false;
                            st.placement_ok = false;
                            event(self,
                                  "connecting the head to " + slot.node + ": " +
                                      describe(self->system(), e) + "; trying again",
                                  true);
                            if (!st.retry_queued) {
                              st.retry_queued = true;
                              self->delayed_send(self, 500ms, tick_atom::value);
                            }
                          });
                } else {
                  finish_placement(self, epoch, *handles);
                }
                *load = nullptr;  // breaks the cycle
              } else {
                (*load)(i - 1);
              }
            },
            [self, fail, busy](caf::error& e) { fail(describe(self->system(), e)); });
  };
  (*load)(plan.size() - 1);
}

// Every 10 s while requests come: one line with the load and the token rates.
void stats_line(head_ptr self) {
  auto& st = self->state;
  if (!st.scheduler || steady::now() - st.last_stats_line < std::chrono::seconds(10)) return;
  const auto since = st.last_stats_line;
  st.last_stats_line = steady::now();
  self->request(st.scheduler, 5s, stats_atom::value)
      .then(
          [self, since](const scheduler_stats& s) {
            auto& st = self->state;
            const auto& p = st.last_stats;
            const double secs = std::chrono::duration<double>(steady::now() - since).count();
            if (s.accepted != p.accepted || s.running > 0 || s.queued > 0) {
              std::int64_t used = 0, total = 0;
              for (const auto& [name, r] : st.rt) {
                used += r.report.kv_used_blocks;
                total += r.report.kv_total_blocks;
              }
              logging::of("head").info(
                  "{} running, {} waiting; KV {:.1f}% ({} of {} blocks); prompt {:.1f} tokens/s, "
                  "generation {:.1f} tokens/s; "
                  "{} finished",
                  s.running, s.queued,
                  total > 0 ? 100.0 * static_cast<double>(used) / static_cast<double>(total) : 0.0,
                  used, total, static_cast<double>(s.prompt_tokens - p.prompt_tokens) / secs,
                  static_cast<double>(s.generated_tokens - p.generated_tokens) / secs, s.finished);
            }
            st.last_stats = s;
          },
          [](caf::error&) {});
}

void heartbeat(head_ptr self) {
  auto& st = self->state;
  const auto now = steady::now();
  stats_line(self);
  // The head's own node is this process; a node loading weights for the
  // head is busy, its connection up (a drop is noticed as such).
  for (const auto& [name, r] : st.rt)
    if (r.agent && (name == st.cfg.node.name || r.loading > 0)) {
      const auto* m = st.members->find(name);
      if (m &&
          (m->state == cluster::member_state::up || m->state == cluster::member_state::suspect))
        st.members->heard(name, now);
    }
  for (auto& t : st.members->tick(now)) {
    if (t.to == cluster::member_state::lost)
      on_lost(self, t.name, t.why);
    else
      event(self, "node " + t.name + " " + cluster::to_string(t.to) + ": " + t.why, true);
  }
  for (const auto& name : st.members->due_for_join(now))
    if (name != st.cfg.node.name) start_join(self, name);
  for (auto& [name, r] : st.rt) {
    if (!r.agent) continue;
    const auto* m = st.members->find(name);
    if (!m || (m->state != cluster::member_state::up && m->state != cluster::member_state::suspect))
      continue;
    self->request(r.agent, st.members->options().lost_after, ping_atom::value)
        .then(
            [self, name, agent = r.agent](node_report& rep) {
              auto& st = self->state;
              auto& r = st.rt[name];
              if (r.agent != agent) return;  // an answer from before a loss
              r.report = std::move(rep);
              if (auto t = st.members->heard(name, steady::now()))
                event(self, "node " + name + " " + cluster::to_string(t->to) + ": " + t->why);
              measure_link(self, name);
            },
            [](caf::error&) {});  // silence is what tick() measures
  }
  if (st.scheduler)
    self->request(st.scheduler, 5s, stats_atom::value)
        .then(
            [self](const scheduler_stats& s) {
              const auto now = steady::now();
              self->state.tokens.add(now, s.tokens_out);
              auto& q = self->state.stat_samples;
              q.emplace_back(now, s);
              while (q.size() > 1 && now - q.front().first > 60s) q.pop_front();
            },
            [](caf::error&) {});
  measure_decisions(self);
  policy_tick(self);
  // The first placement: once every node is up and measured (or, after the
  // grace period, whoever is).
  if (!st.ready && !st.placing && !st.draining) {
    const auto usable = st.members->usable();
    const bool grace_over = steady::now() - st.started > st.cfg.startup_grace;
    if ((usable.size() == st.cfg.node.m.nodes.size() && (measured_all(self) || !st.auto_place)) ||
        (grace_over && !usable.empty()))
      replace(self, "start");
  }
}

// -- live migration --------------------------------------------------------------
//
// Make-before-break (ARCHITECTURE.md): the target node loads the stage from
// its own model files while the old one serves; the KV of every sequence
// is copied in rounds while decoding goes on (whole sequences first, then
// the blocks that changed since); at a step boundary the scheduler holds
// its steps, the last delta is copied, the stage before (or the scheduler)
// is re-routed to the new shard, and steps resume; the old actors go.

struct migration {
  migrate_report rep;
  caf::typed_response_promise<migrate_report> rp;
  std::size_t index = 0;
  std::uint64_t epoch = 0;
  stage_handles old_h, new_h;
  cluster::stage_slot slot;
  std::string target, dest_key;
  std::map<std::int64_t, std::int64_t> copied;  ///< sequence -> tokens copied to the new store
  std::int64_t block_size = 16;
  steady::time_point t0, pause_sent;
  bool paused = false, done = false;
  std::int64_t round_bytes = 0;
};
using migration_ptr = std::shared_ptr<migration>;

void migration_fail(head_ptr self, const migration_ptr& m, const std::string& why) {
  if (m->done) return;
  m->done = true;
  auto& st = self->state;
  st.migrating = false;
  if (m->paused && st.scheduler) self->send(st.scheduler, route_atom::value);  // resume as it was
  // The new actors (if any) go; the old ones kept serving.
  if (m->new_h.shard && st.epoch == m->epoch) {
    auto it = st.rt.find(m->target);
    if (it != st.rt.end() && it->second.agent && !(m->target == m->slot.node))
      self->request(it->second.agent, st.cfg.node.timeout, drop_atom::value, m->slot.first_layer)
          .then([](std::int32_t) {}, [](caf::error&) {});
  }
  event(self, "migrating " + m->rep.what + " to " + m->target + " failed: " + why, true);
  m->rp.deliver(make_error(error_code::stage_failed, "migration of " + m->rep.what + ": " + why));
}

bool migration_stale(head_ptr self, const migration_ptr& m) {
  if (m->done) return true;
  if (self->state.epoch != m->epoch) {
    migration_fail(self, m, "the cluster was placed again meanwhile (a node was lost)");
    return true;
  }
  return false;
}

/// One round: every sequence of the old store whose length differs from
/// what was copied goes (whole the first time, its changed blocks after).
/// In the final round, sequences that ended are dropped from the new store.
void migration_round(head_ptr self, migration_ptr m, bool final, std::function<void()> next) {
  auto& st = self->state;
  self->request(m->old_h.kv, st.cfg.node.timeout, list_atom::value)
      .then(
          [self, m, final, next](const std::vector<std::int64_t>& pairs) {
            if (migration_stale(self, m)) return;
            auto& st = self->state;
            std::map<std::int64_t, std::int64_t> now;
            for (std::size_t i = 0; i + 1 < pairs.size(); i += 2) now[pairs[i]] = pairs[i + 1];
            if (final) {
              std::vector<std::int64_t> gone;
              for (auto it = m->copied.begin(); it != m->copied.end();) {
                if (now.count(it->first)) {
                  ++it;
                  continue;
                }
                gone.push_back(it->first);
                it = m->copied.erase(it);
              }
              if (!gone.empty())
                self->request(m->new_h.kv, st.cfg.node.timeout, free_atom::value, gone)
                    .then([](std::int64_t) {}, [](caf::error&) {});
            }
            struct todo {
              std::int64_t seq;
              std::int32_t from;
            };
            std::vector<todo> work;
            for (const auto& [seq, len] : now) {
              auto it = m->copied.find(seq);
              if (it != m->copied.end() && it->second == len) continue;
              std::int32_t from = 0;
              if (it != m->copied.end() && it->second < len)
                from = static_cast<std::int32_t>(it->second / m->block_size);
              work.push_back({seq, from});
            }
            m->round_bytes = 0;
            if (work.empty()) {
              next();
              return;
            }
            auto pending = std::make_shared<std::size_t>(work.size());
            auto failed = std::make_shared<std::string>();
            auto one_done = [self, m, pending, failed, next] {
              if (--*pending > 0) return;
              if (migration_stale(self, m)) return;
              if (!failed->empty()) return migration_fail(self, m, *failed);
              next();
            };
            const auto timeout = st.cfg.node.timeout;
            for (const auto& w : work) {
              auto copy = std::make_shared<std::function<void(std::int32_t)>>();
              *copy = [self, m, w, timeout, one_done, failed, copy](std::int32_t from) {
                self->request(m->old_h.kv, timeout, export_atom::value, w.seq, from, m->dest_key)
                    .then(
                        [self, m, w, timeout, one_done, failed, copy, from](kv_export& x) {
                          const auto len = x.length;
                          self->request(m->new_h.kv, timeout, import_atom::value, std::move(x),
                                        from)
                              .then(
                                  [m, w, len, one_done, copy](std::int64_t bytes) {
                                    m->copied[w.seq] = len;
                                    m->round_bytes += bytes;
                                    m->rep.kv_bytes += bytes;
                                    *copy = nullptr;
                                    one_done();
                                  },
                                  [self, m, one_done, failed, copy, from](caf::error& e) {
                                    // A delta the store cannot take (a cache with a window):
                                    // the whole sequence instead.
                                    if (from > 0) return (*copy)(0);
                                    *failed = "KV import: " + describe(self->system(), e);
                                    *copy = nullptr;
                                    one_done();
                                  });
                        },
                        [self, m, w, one_done, failed, copy](caf::error& e) {
                          // A sequence that ended meanwhile has nothing to copy.
                          if (troupe_code(e) != static_cast<std::uint8_t>(error_code::not_found))
                            *failed = "KV export: " + describe(self->system(), e);
                          m->copied.erase(w.seq);
                          *copy = nullptr;
                          one_done();
                        });
              };
              (*copy)(w.from);
            }
          },
          [self, m](caf::error& e) {
            if (!migration_stale(self, m))
              migration_fail(self, m,
                             "listing the old store's sequences: " + describe(self->system(), e));
          });
}

void migration_switch(head_ptr self, migration_ptr m) {
  auto& st = self->state;
  auto resume = [self, m] {
    if (migration_stale(self, m)) return;
    auto& st = self->state;
    self->send(st.scheduler, route_atom::value, static_cast<std::int32_t>(m->index), m->new_h.shard,
               m->new_h.kv);
    m->rep.pause_ms = ms_since(m->pause_sent);
    m->paused = false;
    // The old actors go; the head's books follow the new ones.
    st.handles[m->index] = m->new_h;
    st.plan[m->index].node = m->target;
    ++st.migrations;
    auto it = st.rt.find(m->slot.node);
    auto finish = [self, m](bool dropped) {
      auto& st = self->state;
      m->done = true;
      st.migrating = false;
      m->rep.total_ms = ms_since(m->t0);
      m->rep.sequences = static_cast<std::int64_t>(m->copied.size());
      char buf[320];
      std::snprintf(buf, sizeof buf,
                    "migrated %s from %s to %s: pause %.1f ms, %lld sequences, %.2f MiB of KV in "
                    "%d rounds + %.3f MiB in "
                    "the pause, load %.0f ms, %.0f ms in all%s",
                    m->rep.what.c_str(), m->rep.from.c_str(), m->rep.to.c_str(), m->rep.pause_ms,
                    static_cast<long long>(m->rep.sequences),
                    static_cast<double>(m->rep.kv_bytes) / (1 << 20), m->rep.rounds,
                    static_cast<double>(m->rep.final_kv_bytes) / (1 << 20), m->rep.load_ms,
                    m->rep.total_ms,
                    dropped ? "" : " (the old node did not confirm dropping its stage)");
      event(self, buf);
      m->rp.deliver(m->rep);
      heartbeat(self);
    };
    if (it == st.rt.end() || !it->second.agent) return finish(false);
    self->request(it->second.agent, st.cfg.node.timeout, drop_atom::value, m->slot.first_layer)
        .then([finish](std::int32_t) { finish(true); }, [finish](caf::error&) { finish(false); });
  };
  if (m->index == 0) return resume();
  // The stage before forwards to the new shard from now on.
  const auto& prev = st.plan[m->index - 1];
  auto it = st.rt.find(prev.node);
  if (it == st.rt.end() || !it->second.agent)
    return migration_fail(self, m, "the node of the stage before is not up");
  self->request(it->second.agent, st.cfg.node.timeout, route_atom::value,
                static_cast<std::int32_t>(prev.first_layer), m->new_h, m->target)
      .then([resume](bool) { resume(); },
            [self, m](caf::error& e) {
              migration_fail(self, m,
                             "re-routing the stage before: " + describe(self->system(), e));
            });
}

// Debugging aid (TROUPE_MIGRATE_VERIFY=1, stage 0 on the head): before the
// switch, every sequence's KV is exported whole from the old and the new
// store to the head and compared byte for byte.
void migration_verify_now(head_ptr self, migration_ptr m);
void migration_pause(head_ptr self, migration_ptr m);
void migration_verify(head_ptr self, migration_ptr m) {
  auto& st = self->state;
  auto a = st.rt[m->slot.node].agent;
  auto b = st.rt[m->target].agent;
  self->request(a, st.cfg.node.timeout, route_atom::value, st.handles[0], st.cfg.node.name)
      .then(
          [self, m, b](bool) {
            auto& st = self->state;
            self->request(b, st.cfg.node.timeout, route_atom::value, st.handles[0],
                          st.cfg.node.name)
                .then([self, m](bool) { migration_verify_now(self, m); },
                      [self, m](caf::error&) { migration_verify_now(self, m); });
          },
          [self, m](caf::error&) { migration_verify_now(self, m); });
}

void migration_verify_now(head_ptr self, migration_ptr m) {
  auto& st = self->state;
  const auto head_key = to_string(self->node());
  auto pending = std::make_shared<std::size_t>(m->copied.size());
  auto bad = std::make_shared<std::int64_t>(0);
  if (m->copied.empty()) return migration_switch(self, m);
  for (const auto& [seq, len] : m->copied) {
    auto got = std::make_shared<std::vector<std::optional<std::vector<std::byte>>>>(2);
    auto finish = [self, m, pending, bad, got, seq = seq]() {
      if ((*got)[0] && (*got)[1] && *(*got)[0] != *(*got)[1]) {
        ++*bad;
        const auto& a = *(*got)[0];
        const auto& b = *(*got)[1];
        std::size_t i = 0;
        while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
        logging::of("head").error("verify: sequence {} KV differs at byte {} of {} / {}", seq, i,
                                  a.size(), b.size());
      }
      if (--*pending == 0) {
        logging::of("head").warn("verify: {} of {} sequences differ", *bad, m->copied.size());
        migration_switch(self, m);
      }
    };
    auto step = std::make_shared<int>(2);
    for (int w = 0; w < 2; ++w) {
      auto kv = w == 0 ? m->old_h.kv : m->new_h.kv;
      self->request(kv, st.cfg.node.timeout, export_atom::value, seq, std::int32_t{0}, head_key)
          .then(
              [self, got, w, step, finish](kv_export& x) {
                auto t = data_plane::local().take(x.data, *kernels::memory_pool::create());
                if (t) {
                  const auto* p = static_cast<const std::byte*>(t->data());
                  (*got)[static_cast<std::size_t>(w)] = std::vector<std::byte>(p, p + t->nbytes());
                }
                if (--*step == 0) finish();
              },
              [step, finish](caf::error&) {
                if (--*step == 0) finish();
              });
    }
  }
}

void migration_pause(head_ptr self, migration_ptr m) {
  auto& st = self->state;
  m->pause_sent = steady::now();
  m->paused = true;
  st.migration_phase = "steps held: the last KV delta, then the switch";
  st.migration_done = 0.9;
  self->request(st.scheduler, st.cfg.node.timeout, pause_atom::value)
      .then(
          [self, m](std::int64_t) {
            if (migration_stale(self, m)) return;
            const auto before = m->rep.kv_bytes;
            migration_round(self, m, true, [self, m, before] {
              m->rep.final_kv_bytes = m->rep.kv_bytes - before;
              if (std::getenv("TROUPE_MIGRATE_VERIFY")) return migration_verify(self, m);
              migration_switch(self, m);
            });
          },
          [self, m](caf::error& e) {
            if (!migration_stale(self, m))
              migration_fail(self, m, "pausing the scheduler: " + describe(self->system(), e));
          });
}

/// Live rounds until a round moves little (an eighth of the first round's
/// bytes, or one block per sequence), at most 4; then the pause.
void migration_live_rounds(head_ptr self, migration_ptr m, std::int64_t first_round_bytes) {
  self->state.migration_phase =
      "copying KV, round " + std::to_string(m->rep.rounds + 1) + " (decoding goes on)";
  self->state.migration_done = std::min(0.8, 0.3 + 0.15 * m->rep.rounds);
  migration_round(self, m, false, [self, m, first_round_bytes] {
    ++m->rep.rounds;
    const auto first = m->rep.rounds == 1 ? m->round_bytes : first_round_bytes;
    const bool small = m->rep.rounds > 1 && m->round_bytes <= std::max<std::int64_t>(first / 8, 0);
    if (m->rep.rounds >= 4 || small || m->copied.empty()) return migration_pause(self, m);
    migration_live_rounds(self, m, first);
  });
}

/// Moves the vision encoder: the target spawns one (from its own model
/// files) and connects its data plane to the head; the scheduler sends new
/// images there; the old encoder encodes what it holds (flush, then a reply
/// that comes after it) and stops.
caf::result<migrate_report> start_encoder_migration(head_ptr self, const migrate_request& req) {
  auto& st = self->state;
  auto refuse = [](error_code c, const std::string& why) {
    return caf::result<migrate_report>(make_error(c, why));
  };
  if (!st.encoder) return refuse(error_code::invalid_request, "this model has no vision encoder");
  const auto* mem = st.members->find(req.to);
  if (!mem)
    return refuse(error_code::invalid_request,
                  "no node '" + req.to.substr(0, 64) + "' in the manifest");
  if (mem->state != cluster::member_state::up)
    return refuse(error_code::unavailable, "node " + req.to + " is not up");
  const std::string from = st.encoder_where.substr(0, st.encoder_where.find(' '));
  if (from == req.to)
    return refuse(error_code::invalid_request, "the vision encoder already runs on " + req.to);
  auto target = st.rt[req.to].agent;
  if (!target) return refuse(error_code::unavailable, "node " + req.to + " is not joined");
  auto rp = self->make_response_promise<migrate_report>();
  auto rep = std::make_shared<migrate_report>();
  rep->what = "vision encoder";
  rep->from = from;
  rep->to = req.to;
  st.migrating = true;
  st.migration_phase = "loading the vision encoder on " + req.to;
  st.migration_done = 0.1;
  event(self, "migrating the vision encoder from " + from + " to " + req.to);
  const auto t0 = steady::now();
  auto fail = [self, rp, rep](const std::string& why) mutable {
    self->state.migrating = false;
    event(self, "migrating the vision encoder to " + rep->to + " failed: " + why, true);
    rp.deliver(make_error(error_code::stage_failed, "migration of the vision encoder: " + why));
  };
  auto busy = loading_on(self, req.to);
  self->request(target, st.cfg.node.timeout, load_atom::value, std::string("vision"),
                data_plane::local().address())
      .then(
          [self, rp, rep, t0, fail, busy](encoder_actor& fresh) mutable {
            auto& st = self->state;
            rep->load_ms = ms_since(t0);
            auto old = st.encoder;
            // New images go to the new encoder from now on (no pause: the
            // scheduler only switches where it sends).
            // An encoder in another process is reached through a relay here,
            // which receives the embeddings off the scheduler's thread.
            st.encoder =
                fresh->node() == self->node() ? fresh : spawn_encoder_relay(self->system(), fresh);
            st.encoder_where =
                rep->to + " " +
                (st.rt[rep->to].report.devices.empty() ? std::string("cpu")
                                                       : st.rt[rep->to].report.devices);
            const auto owner = st.encoder_owner;
            st.encoder_owner = rep->to;
            auto finish = [self, rp, rep, t0]() mutable {
              auto& st = self->state;
              st.migrating = false;
              ++st.migrations;
              rep->total_ms = ms_since(t0);
              char buf[200];
              std::snprintf(buf, sizeof buf,
                            "migrated the vision encoder from %s to %s: loaded in %.0f ms, %.0f ms "
                            "in all, no pause",
                            rep->from.c_str(), rep->to.c_str(), rep->load_ms, rep->total_ms);
              event(self, buf);
              rp.deliver(*rep);
            };
            // Once nothing more can reach the old one, it stops.
            auto retire = [self, old, owner, finish]() mutable {
              auto& st = self->state;
              if (owner.empty()) {
                caf::anon_send_exit(old, caf::exit_reason::user_shutdown);  // the head spawned it
              } else {
                if (auto a = st.rt[owner].agent)
                  self->request(a, st.cfg.node.timeout, drop_atom::value, std::string("vision"))
                      .then([](std::int32_t) {}, [](caf::error&) {});
                if (owner != st.cfg.node.name)
                  caf::anon_send_exit(old, caf::exit_reason::user_shutdown);  // its relay
              }
              finish();
            };
            // The scheduler switches and drains the old encoder itself (its
            // own encode requests are ordered before its flush), answering
            // once the old one has answered all of them.
            if (st.scheduler) {
              self->request(st.scheduler, st.cfg.node.timeout, reset_atom::value, st.encoder, true)
                  .then([retire](bool) mutable { retire(); },
                        [retire](caf::error&) mutable { retire(); });
            } else {
              retire();
            }
          },
          [self, fail, busy](caf::error& e) mutable {
            fail("loading on the target: " + describe(self->system(), e));
          });
  return rp;
}

/// Which stage `shard` names: "2", "stage2" or "[a,b)" as status prints it.
std::optional<std::size_t> stage_named(const std::vector<cluster::stage_slot>& plan,
                                       const std::string& shard) {
  std::string s = shard;
  if (s.rfind("stage", 0) == 0) s = s.substr(5);
  if (!s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
      s.size() < 6) {
    const auto i = static_cast<std::size_t>(std::stoi(s));
    if (i < plan.size()) return i;
    return std::nullopt;
  }
  for (std::size_t i = 0; i < plan.size(); ++i)
    if (shard == "[" + std::to_string(plan[i].first_layer) + "," +
                     std::to_string(plan[i].last_layer) + ")" ||
        shard == "layers [" + std::to_string(plan[i].first_layer) + "," +
                     std::to_string(plan[i].last_layer) + ")")
      return i;
  return std::nullopt;
}

caf::result<migrate_report> start_migration(head_ptr self, const migrate_request& req) {
  auto& st = self->state;
  auto refuse = [](error_code c, const std::string& why) {
    return caf::result<migrate_report>(make_error(c, why));
  };
  if (!st.ready || st.placing || !st.scheduler)
    return refuse(error_code::unavailable, "the model is not placed yet");
  if (st.draining) return refuse(error_code::unavailable, "the cluster is shutting down");
  if (st.migrating) return refuse(error_code::unavailable, "another migration is under way");
  if (req.shard == "vision" || req.shard == "encoder") return start_encoder_migration(self, req);
  const auto idx = stage_named(st.plan, req.shard);
  if (!idx)
    return refuse(error_code::invalid_request,
                  "no stage '" + req.shard.substr(0, 64) + "' in the placement " +
                      cluster::describe(st.plan) + " (give an index from 0 or a range as printed)");
  if (st.handles.size() != st.plan.size())
    return refuse(error_code::unavailable, "the placement's actors are not known yet");
  const auto* mem = st.members->find(req.to);
  if (!mem)
    return refuse(error_code::invalid_request,
                  "no node '" + req.to.substr(0, 64) + "' in the manifest");
  if (mem->state != cluster::member_state::up)
    return refuse(error_code::unavailable, "node " + req.to + " is not up");
  const auto& slot = st.plan[*idx];
  if (slot.node == req.to)
    return refuse(error_code::invalid_request,
                  "stage " + std::to_string(*idx) + " already runs on " + req.to);
  auto target = st.rt[req.to].agent;
  auto source = st.rt[slot.node].agent;
  if (!target || !source)
    return refuse(error_code::unavailable,
                  "node " + (!target ? req.to : slot.node) + " is not joined");

  auto m = std::make_shared<migration>();
  m->rp = self->make_response_promise<migrate_report>();
  m->index = *idx;
  m->epoch = st.epoch;
  m->old_h = st.handles[*idx];
  m->slot = slot;
  m->target = req.to;
  m->block_size = std::max(1, st.cfg.node.kv.block_size);
  m->t0 = steady::now();
  m->rep.what =
      "layers [" + std::to_string(slot.first_layer) + "," + std::to_string(slot.last_layer) + ")";
  m->rep.from = slot.node;
  m->rep.to = req.to;
  st.migrating = true;
  st.migration_phase = "loading " + m->rep.what + " on " + req.to;
  st.migration_done = 0.05;
  event(self, "migrating " + m->rep.what + " from " + slot.node + " to " + req.to);

  stage_order o;
  o.first_layer = slot.first_layer;
  o.last_layer = slot.last_layer;
  o.embed = *idx == 0;
  o.head = *idx + 1 == st.plan.size();
  o.epoch = st.epoch;
  if (*idx + 1 < st.plan.size()) {
    o.has_next = true;
    o.next = st.handles[*idx + 1];
    o.next_node = st.plan[*idx + 1].node;
  }
  const auto t_load = steady::now();
  auto busy = loading_on(self, req.to);
  self->request(target, st.cfg.node.timeout, load_atom::value, o)
      .then(
          [self, m, t_load, source, busy](stage_handles& h) {
            m->new_h = std::move(h);
            if (migration_stale(self, m)) return;
            m->rep.load_ms = ms_since(t_load);
            m->dest_key = to_string(m->new_h.shard->node());
            auto& st = self->state;
            // The old stage's node pushes the KV to the target, and for
            // the first stage the head's scheduler pushes image embeddings.
            auto connected = [self, m] {
              if (migration_stale(self, m)) return;
              auto& st = self->state;
              self->request(m->new_h.kv, st.cfg.node.timeout, usage_atom::value)
                  .then(
                      [self, m](const kv_usage_info& u) {
                        m->block_size = std::max<std::int64_t>(1, u.block_size);
                        migration_live_rounds(self, m, 0);
                      },
                      [self, m](caf::error& e) {
                        migration_fail(self, m, "the new KV store: " + describe(self->system(), e));
                      });
            };
            self->request(source, st.cfg.node.timeout, route_atom::value, m->new_h, m->target)
                .then(
                    [self, m, connected](bool) {
                      auto& st = self->state;
                      auto own = st.rt[st.cfg.node.name].agent;
                      if (m->index != 0 || !own || m->target == st.cfg.node.name)
                        return connected();
                      self->request(own, st.cfg.node.timeout, route_atom::value, m->new_h,
                                    m->target)
                          .then([connected](bool) { connected(); },
                                [self, m](caf::error& e) {
                                  migration_fail(self, m,
                                                 "connecting the head to " + m->target + ": " +
                                                     describe(self->system(), e));
                                });
                    },
                    [self, m](caf::error& e) {
                      migration_fail(self, m,
                                     "connecting " + m->slot.node + " to " + m->target + ": " +
                                         describe(self->system(), e));
                    });
          },
          [self, m, busy](caf::error& e) {
            if (!migration_stale(self, m))
              migration_fail(self, m,
                             "loading on " + m->target + ": " + describe(self->system(), e));
          });
  return m->rp;
}

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
      v.state = cluster::to_string(m->state);
      v.last_seen_ms = m->last_seen ? ms_since(*m->last_seen) : -1;
      v.joins = m->joins;
    }
    auto it = st.rt.find(n.name);
    if (it != st.rt.end()) {
      v.report = it->second.report;
      if (v.state != "up" && v.state != "suspect" && !it->second.why.empty())
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

// Called on every tick while draining: stops everything once no request
// is queued or running (or after two minutes).
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

}  // namespace

kernels::result<frontdoor_actor> spawn_head(caf::actor_system& sys, head_config cfg,
                                            node_agent_actor own) {
  const auto& m = cfg.node.m;
  if (m.parallelism.tensor_parallel > 1)
    return kernels::make_error(kernels::errc::unsupported_op,
                               m.path + ": parallelism.tensor_parallel = " +
                                   std::to_string(m.parallelism.tensor_parallel) +
                                   ": the cluster places pipeline stages only so far "
                                   "(tensor parallelism runs with troupe worker --tp-rank)");
  auto prompt = load_prompt_setup(cfg.node.model);
  if (!prompt) return std::unexpected(prompt.error());
  model_frontend fe;
  fe.tok = prompt->tok;
  fe.vocab = prompt->text.vocab_size;
  fe.hidden = prompt->text.hidden_size;
  std::shared_ptr<encoder_resources> enc;
  if (prompt->llava) {
    fe.image_token = static_cast<std::int32_t>(prompt->llava->image_token_index);
    fe.tokens_per_image = prompt->llava->tokens_per_image();
    auto e = make_vision_encoder(context_for(cfg.node.device), cfg.node.model, cfg.node.plan);
    if (!e) return std::unexpected(e.error());
    enc = std::move(*e);
  }
  std::vector<std::string> names;
  for (const auto& n : m.nodes) names.push_back(n.name);
  auto impl = [](head_ptr self, head_config cfg, prompt_setup prompt, model_frontend fe,
                 std::shared_ptr<encoder_resources> enc, node_agent_actor own,
                 std::vector<std::string> names) -> head_core_actor::behavior_type {
    auto& st = self->state;
    st.cfg = std::move(cfg);
    st.layers = static_cast<int>(prompt.text.num_layers);
    st.prompt = std::move(prompt);
    st.frontend = std::move(fe);
    st.members.emplace(std::move(names), st.cfg.membership);
    st.auto_place = st.cfg.node.m.parallelism.pipeline_stages == 0;
    {
      // The planner's view of the model: its shapes, and the format the
      // stages will hold the decoder's weights in.
      auto mp = model_profile_of(st.prompt.text, st.prompt.llava, st.cfg.node.m.model.kv_type);
      if (mp)
        st.model_prof = std::move(*mp);
      else
        logging::of("head").warn("placement: the model's profile: {}; stages are split evenly",
                                 mp.error());
      if (auto src = models::weight_source::open(st.cfg.node.model)) {
        if (auto w = (*src)->get("layers.0.down_proj"))
          st.precision = precision_of(st.cfg.node.plan.choose("layers.0.down_proj", w->type()));
      }
      const auto batch = std::clamp<std::int64_t>(st.cfg.scheduler.max_running, 1, 16);
      st.work.batch = static_cast<int>(batch);
      st.work.context_tokens =
          static_cast<int>(std::max<std::int64_t>(16, st.cfg.node.m.model.ctx_tokens / batch));
      st.work.overhead_bytes = 64.0 * 1024 * 1024;
      const auto& pe = st.cfg.node.m.placement;
      st.policy_opt.gain_threshold = pe.gain_threshold;
      st.policy_opt.cooldown = std::chrono::duration_cast<placement::duration>(
          std::chrono::duration<double>(pe.cooldown_s));
      st.policy_opt.memory_pressure = pe.memory_pressure;
      st.policy_opt.load_half_life = std::chrono::duration_cast<placement::duration>(
          std::chrono::duration<double>(pe.load_half_life_s));
      st.policy_opt.planner.preferred = st.precision;
      st.policy_opt.planner.min_precision = st.precision;
      st.policy_opt.planner.allow_tensor_parallel = false;
    }
    if (enc) {
      st.encoder = spawn_encoder(self->system(), enc, st.cfg.encoder);
      st.encoder_where = st.cfg.node.name + " " + enc->device.name;
    }
    st.rt[st.cfg.node.name].agent = own;
    st.members->joined(st.cfg.node.name, steady::now());
    self->set_exit_handler([self](caf::exit_msg& em) {
      // The scheduler and the encoder go with the head.
      auto& st = self->state;
      if (st.scheduler) self->send_exit(st.scheduler, em.reason);
      if (st.encoder) self->send_exit(st.encoder, em.reason);
      self->quit(em.reason);
    });
    self->set_down_handler([self](caf::down_msg& dm) {
      auto& st = self->state;
      for (auto& [name, r] : st.rt) {
        if (!r.agent || r.agent.address() != dm.source) continue;
        if (auto t = st.members->gone(
                name, "its connection closed (" + self->system().render(dm.reason) + ")"))
          on_lost(self, name, t->why);
        return;
      }
    });
    self->send(self, tick_atom::value);
    return {
        [=](submit_atom, job_request& job, client_sink_actor& sink) -> caf::result<submit_ack> {
          auto& st = self->state;
          if (st.draining)
            return make_error(error_code::unavailable, "the cluster is shutting down");
          if (!st.scheduler)
            return make_error(error_code::unavailable,
                              "the cluster is not ready yet: it is placing the model (troupe "
                              "status shows progress)");
          if (job.images.size() > 16)
            return make_error(error_code::invalid_request, "at most 16 images per job");
          prompt_input in;
          in.prompt = job.prompt;
          in.system = job.system;
          in.images = static_cast<int>(job.images.size());
          in.chat = job.chat;
          for (const auto& t : job.turns) in.messages.push_back({t.role, t.content, t.images});
          auto ids = render_prompt(st.prompt, in);
          if (!ids) return make_error(error_code::invalid_request, ids.error().message);
          generate_request req;
          req.id = job.id;
          req.prompt_tokens = std::move(*ids);
          req.images = std::move(job.images);
          req.params = default_sampling(st.prompt, job.max_tokens);
          if (job.has_temperature) req.params.temperature = job.temperature;
          if (job.has_top_p) req.params.top_p = job.top_p;
          req.params.seed = job.seed;
          req.params.stop_strings = std::move(job.stop_strings);
          if (job.ignore_eos) req.params.stop_token_ids.clear();
          if (auto v = req.params.validate(); !v)
            return make_error(error_code::invalid_request, v.error().message);
          req.deadline_ms = job.deadline_ms;
          return self->delegate(st.scheduler, submit_atom::value, std::move(req), std::move(sink));
        },
        [=](cancel_atom, std::uint64_t id) -> caf::result<bool> {
          if (!self->state.scheduler) return false;
          return self->delegate(self->state.scheduler, cancel_atom::value, id);
        },
        [=](status_atom) -> caf::result<cluster_status> {
          auto rp = self->make_response_promise<cluster_status>();
          auto s = status_of(self);
          if (!self->state.scheduler) {
            rp.deliver(std::move(s));
            return rp;
          }
          self->request(self->state.scheduler, 5s, stats_atom::value)
              .then(
                  [rp, s](const scheduler_stats& x) mutable {
                    s.scheduler = x;
                    rp.deliver(std::move(s));
                  },
                  [rp, s](caf::error&) mutable { rp.deliver(std::move(s)); });
          return rp;
        },
        [=](migrate_atom, const migrate_request& req) -> caf::result<migrate_report> {
          return start_migration(self, req);
        },
        [=](down_atom) -> caf::result<bool> {
          auto& st = self->state;
          auto rp = self->make_response_promise<bool>();
          st.drain_waiters.push_back(rp);
          if (!st.draining) {
            st.draining = true;
            st.drain_since = steady::now();
            event(self, "draining: refusing new jobs, finishing the accepted ones");
          }
          check_drain(self);
          return rp;
        },
        [=](tick_atom) {
          if (!from_this_process(self)) return;
          auto& st = self->state;
          st.retry_queued = false;
          if (steady::now() - st.last_heartbeat >= st.members->options().heartbeat_every) {
            st.last_heartbeat = steady::now();
            heartbeat(self);
            check_drain(self);
            self->delayed_send(self, st.members->options().heartbeat_every, tick_atom::value);
          }
          if (!st.placing && !st.draining && st.ready) {
            // A placement that failed: try again with whoever is up.
            const bool complete =
                !st.plan.empty() && std::all_of(st.plan.begin(), st.plan.end(), [&](const auto& s) {
                  const auto* m = st.members->find(s.node);
                  return m && m->state != cluster::member_state::lost;
                });
            if (!complete || !st.placement_ok) replace(self);
          }
        },
        [=](joined_atom, const std::string& name, gate_pass& pass) {
          if (!from_this_process(self)) return;
          auto& st = self->state;
          auto& r = st.rt[name];
          r.joining = false;
          if (!pass.agent) {
            r.why = "its gatekeeper handed out no agent";
            return;
          }
          r.agent = pass.agent;
          r.why.clear();
          self->monitor(r.agent);
          {
            auto& reg = joined_nodes();
            std::lock_guard lock(reg.mtx);
            reg.ids[name] = r.agent->node();
          }
          auto t = st.members->joined(name, steady::now());
          event(self, "node " + name + " " + t.why);
          if (st.auto_place && st.ready &&
              std::find(st.joined_since.begin(), st.joined_since.end(), name) ==
                  st.joined_since.end())
            st.joined_since.push_back(name);  // the policy looks again once it is measured
          // What it may still hold from before it was lost is stale.
          self->request(r.agent, st.cfg.node.timeout, drop_atom::value)
              .then([](std::int32_t) {}, [](caf::error&) {});
        },
        [=](joined_atom, const std::string& name, const std::string& why) {
          if (!from_this_process(self)) return;
          auto& r = self->state.rt[name];
          r.joining = false;
          r.why = why;
          logging::of("head").debug("joining {}: {}", name, why);
        },
    };
  };
  auto core = sys.spawn(impl, std::move(cfg), std::move(*prompt), std::move(fe), std::move(enc),
                        std::move(own), std::move(names));
  return caf::actor_cast<frontdoor_actor>(core);
}

std::expected<frontdoor_actor, std::string> connect_client(caf::actor_system& sys,
                                                           const cluster::manifest& m,
                                                           std::chrono::milliseconds timeout) {
  auto pass = join_node(sys, m, cluster::client_identity, m.head, timeout);
  if (!pass) return std::unexpected(pass.error());
  if (!pass->door)
    return std::unexpected("node " + m.head + " handed out no door (is it the head of cluster " +
                           m.name + "?)");
  return pass->door;
}

std::uint64_t random_job_id() {
  static std::mutex mtx;
  static std::mt19937_64 gen{std::random_device{}()};
  std::lock_guard lock(mtx);
  std::uint64_t id = 0;
  while (id == 0) id = gen();
  return id;
}

std::expected<void, job_refusal> submit_job(
    caf::actor_system& sys, const frontdoor_actor& door, job_request job,
    std::function<void(const token_event&)> on_token,
    std::function<void(std::optional<finish_event>, std::string)> on_finish) {
  const auto id = job.id;
  auto once = std::make_shared<std::once_flag>();
  auto finish = [once, on_finish](std::optional<finish_event> f, std::string why) {
    std::call_once(*once, [&] { on_finish(std::move(f), std::move(why)); });
  };
  auto sink = sys.spawn([door, on_token, finish,
                         id](client_sink_actor::pointer self) -> client_sink_actor::behavior_type {
    self->monitor(door);
    self->set_down_handler([=](caf::down_msg& dm) {
      finish(std::nullopt, "the head went away (" + self->system().render(dm.reason) + ")");
      self->quit();
    });
    return {
        [=](const token_event& e) {
          if (e.id == id && on_token) on_token(e);
        },
        [=](const finish_event& e) {
          if (e.id != id) return;
          finish(e, "");
          self->quit();
        },
    };
  });
  std::optional<job_refusal> refused;
  {
    caf::scoped_actor self{sys};
    self->request(door, caf::infinite, submit_atom::value, std::move(job), sink)
        .receive([](const submit_ack&) {},
                 [&](caf::error& e) {
                   const auto code = troupe_code(e);
                   refused =
                       job_refusal{code ? static_cast<error_code>(code) : error_code::internal,
                                   describe(sys, e)};
                 });
  }
  if (refused) {
    caf::anon_send_exit(sink, caf::exit_reason::user_shutdown);
    return std::unexpected(*refused);
  }
  return {};
}

std::expected<cluster_status, std::string> query_status(caf::actor_system& sys,
                                                        const frontdoor_actor& door,
                                                        std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  std::expected<cluster_status, std::string> out = std::unexpected(std::string("no answer"));
  self->request(door, timeout, status_atom::value)
      .receive([&](cluster_status& s) { out = std::move(s); },
               [&](caf::error& e) { out = std::unexpected(describe(sys, e)); });
  return out;
}

std::expected<migrate_report, std::string> migrate_shard(caf::actor_system& sys,
                                                         const frontdoor_actor& door,
                                                         migrate_request req,
                                                         std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  std::expected<migrate_report, std::string> out = std::unexpected(std::string("no answer"));
  self->request(door, timeout, migrate_atom::value, std::move(req))
      .receive([&](migrate_report& r) { out = std::move(r); },
               [&](caf::error& e) { out = std::unexpected(describe(sys, e)); });
  return out;
}

bool cancel_job(caf::actor_system& sys, const frontdoor_actor& door, std::uint64_t id) {
  caf::scoped_actor self{sys};
  bool found = false;
  self->request(door, std::chrono::seconds(10), cancel_atom::value, id)
      .receive([&](bool b) { found = b; }, [](caf::error&) {});
  return found;
}

std::expected<finish_event, std::string> run_job(caf::actor_system& sys,
                                                 const frontdoor_actor& door, job_request job,
                                                 std::function<void(const token_event&)> on_token) {
  struct waiter {
    std::mutex m;
    std::condition_variable cv;
    bool ended = false;
    std::optional<finish_event> done;
    std::string gone;
  };
  auto w = std::make_shared<waiter>();
  auto ok = submit_job(sys, door, std::move(job), std::move(on_token),
                       [w](std::optional<finish_event> f, std::string why) {
                         std::lock_guard lock(w->m);
                         w->done = std::move(f);
                         w->gone = std::move(why);
                         w->ended = true;
                         w->cv.notify_all();
                       });
  if (!ok) return std::unexpected(ok.error().message);
  std::unique_lock lock(w->m);
  w->cv.wait(lock, [&] { return w->ended; });
  if (w->done) return *w->done;
  return std::unexpected(w->gone);
}

}  // namespace troupe::actors
