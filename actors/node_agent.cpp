#include "actors/node_agent.hpp"

#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <expected>
#include <fstream>
#include <memory>
#include <mutex>
#include <vector>

#include "actors/cluster_common.hpp"
#include "actors/data_plane.hpp"
#include "actors/device_probe.hpp"
#include "actors/encoder.hpp"
#include "actors/gatekeeper.hpp"
#include "actors/kv_vault.hpp"
#include "actors/log.hpp"
#include "actors/prompt.hpp"
#include "actors/stage.hpp"
#include "cluster/head_lease.hpp"

namespace troupe::actors {

namespace {

using cluster_detail::device_for;
using cluster_detail::forget_joined_node;
using cluster_detail::joined_node_is;
using cluster_detail::joined_nodes;
using cluster_detail::ms_since;

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

struct held_stage {
  std::shared_ptr<stage_resources> res;
  shard_actor shard;
  kv_store_actor kv;
  models::kv_usage usage;  ///< last read (heartbeat reports)
  /// A tensor-parallel rank: the other ranks' shards it depends on (rank
  /// 0's peers, and the ring's next rank). When one stops, the rank's
  /// all-reduces in flight give up at once.
  std::vector<caf::actor_addr> tp_watch;
  caf::actor_addr ring_watch;
};

struct agent_state {
  node_config cfg;
  std::vector<held_stage> stages;
  encoder_actor encoder;  ///< a vision encoder moved here (live migration)
  kv_vault_actor vault;   ///< the cluster's KV store, when the head put it here
  std::uint64_t epoch = 0;
  /// Whose orders placed what it holds: the ordering process and its term
  /// ("" before any). A new head (a standby that took over, a head that
  /// restarted) numbers its placements from 1 again: what the old one
  /// placed goes first.
  std::string orders_of;
  std::string failure;
  device_probe probe;                            ///< measured at start
  std::unique_ptr<foreign_load> load;            ///< sampled at each heartbeat
  steady::time_point last_trim = steady::now();  ///< of the heap (report_of)
};

using agent_ptr = node_agent_actor::stateful_pointer<agent_state>;

/// Watches `a` instead of `old` for a rank's group (a rank moved).
void rewatch(agent_ptr self, caf::actor_addr& old, const caf::strong_actor_ptr& a) {
  if (old) self->demonitor(old);
  old = caf::actor_cast<caf::actor_addr>(a);
  if (a) self->monitor(a);
}

void drop_stages(agent_ptr self) {
  auto& st = self->state;
  for (auto& h : st.stages) {
    self->demonitor(h.shard.address());
    self->demonitor(h.kv.address());
    for (const auto& a : h.tp_watch) self->demonitor(a);
    if (h.ring_watch) self->demonitor(h.ring_watch);
    // A rank waiting in an all-reduce for a rank that goes too stops now.
    if (h.res->tp) h.res->tp->broken = true;
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
    joined_node_is(next_node, nid);
  }
  if (auto r = data_plane::local().connect(to_string(nid), next.engine_address); !r)
    return make_error(error_code::stage_failed,
                      what + ": data plane to node " + next_node + ": " + r.error().message);
  return {};
}

/// " (tensor-parallel rank 1 of 2)", or "" for a whole stage.
std::string rank_of(std::int32_t rank, std::int32_t size) {
  if (size <= 1) return {};
  return " (tensor-parallel rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
}

/// The tensor-parallel group an order puts this node's stage in (null for
/// a whole stage). Rank 0 reaches its peers (control and data plane) now;
/// every rank's ring is connected later (connect_ring).
std::expected<std::shared_ptr<tp_group>, caf::error> tp_group_of(agent_ptr self,
                                                                 const std::string& what,
                                                                 const stage_order& o) {
  if (o.tp_size <= 1) {
    if (o.tp_rank != 0 || !o.tp_peers.empty())
      return std::unexpected(make_error(error_code::invalid_request,
                                        what + ": tensor-parallel peers for a whole stage"));
    return nullptr;
  }
  const auto k = static_cast<std::size_t>(o.tp_size);
  const auto bad = [&](const std::string& why) {
    return std::unexpected(make_error(error_code::invalid_request, what + ": " + why));
  };
  if (o.tp_size > 256 || o.tp_rank < 0 || o.tp_rank >= o.tp_size)
    return bad("tensor-parallel rank " + std::to_string(o.tp_rank) + " of " +
               std::to_string(o.tp_size));
  if (o.tp_rank > 0 && (o.has_next || !o.tp_peers.empty()))
    return bad("only rank 0 of a tensor-parallel stage forwards and knows the other ranks");
  if (o.tp_rank == 0 && (o.tp_peers.size() != k - 1 || o.tp_peer_nodes.size() != k - 1))
    return bad("rank 0 of " + std::to_string(k) + " tensor-parallel ranks with " +
               std::to_string(o.tp_peers.size()) + " peers");
  auto g = std::make_shared<tp_group>();
  g->rank = o.tp_rank;
  g->size = o.tp_size;
  g->reply_timeout = std::max<std::chrono::milliseconds>(
      g->reply_timeout,
      std::chrono::duration_cast<std::chrono::milliseconds>(self->state.cfg.timeout));
  for (std::size_t i = 0; i < o.tp_peers.size(); ++i) {
    const auto& p = o.tp_peers[i];
    const auto& node = o.tp_peer_nodes[i];
    if (p.tp_rank != static_cast<std::int32_t>(i) + 1 || p.tp_size != o.tp_size ||
        p.first_layer != o.first_layer || p.last_layer != o.last_layer || !p.kv)
      return bad("peer " + std::to_string(i) + " on " + node + " is not rank " +
                 std::to_string(i + 1) + " of this stage");
    if (node == self->state.cfg.name)
      return bad("two ranks of one group on one node (one device per node)");
    if (auto e = connect_next(self, what + ", rank " + std::to_string(i + 1), p, node))
      return std::unexpected(std::move(e));
    g->peer_shards.push_back(p.shard);
    g->peer_kvs.push_back(p.kv);
    g->peer_keys.push_back(to_string(p.shard->node()));
  }
  return g;
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
  auto group = tp_group_of(self, what, o);
  if (!group) return std::move(group.error());
  const auto t0 = steady::now();
  auto dev = device_for(c.device);
  if (!dev) return make_error(error_code::stage_failed, what + ": " + dev.error().message);
  auto res = make_stage(c.device, *dev, c.model, range, c.plan, c.kv, *group);
  if (!res) return make_error(error_code::stage_failed, what + ": " + res.error().message);
  if (c.memory_limit > 0 && resident_bytes() > c.memory_limit)
    return make_error(error_code::stage_failed,
                      what + ": the node now uses " + gib(resident_bytes()) +
                          ", over its memory limit of " + gib(c.memory_limit) + " (manifest)");
  auto shard = spawn_shard(self->system(), *res, o.has_next ? o.next.shard : shard_actor{});
  auto kv = spawn_kv_store(self->system(), *res);
  self->monitor(shard);
  self->monitor(kv);
  held_stage h{*res, shard, kv, {}, {}, {}};
  for (const auto& p : o.tp_peers) {
    self->monitor(p.shard);
    h.tp_watch.push_back(p.shard.address());
  }
  st.stages.push_back(std::move(h));
  logging::of("agent").info(
      "node {}: holds layers [{},{}){} on {} (placement {}, loaded in {:.0f} ms)", c.name,
      o.first_layer, o.last_layer, rank_of(o.tp_rank, o.tp_size), c.device.name, o.epoch,
      ms_since(t0));
  return stage_handles{shard, kv, o.first_layer, o.last_layer, dp.address(), o.tp_rank, o.tp_size};
}

/// Connects the ring of the tensor-parallel rank held here whose stage
/// starts at `first`: its all-reduces go to `next` (the next rank, on node
/// `next_node`).
caf::result<bool> connect_ring(agent_ptr self, std::int32_t first, const stage_handles& next,
                               const std::string& next_node) {
  auto& st = self->state;
  const std::string what = "node " + st.cfg.name + ", the tensor-parallel ring of the stage at " +
                           "layer " + std::to_string(first);
  auto it = std::find_if(st.stages.begin(), st.stages.end(), [&](const held_stage& h) {
    return h.res->model->range().first == first && h.res->tp;
  });
  if (it == st.stages.end())
    return make_error(error_code::not_found, what + ": no such tensor-parallel stage here");
  auto& g = *it->res->tp;
  if (next.tp_size != g.size || next.tp_rank != (g.rank + 1) % g.size || next.first_layer != first)
    return make_error(error_code::invalid_request, what + ": the next rank must be rank " +
                                                       std::to_string((g.rank + 1) % g.size) +
                                                       " of " + std::to_string(g.size) +
                                                       " of the same stage");
  if (next_node == st.cfg.name)
    return make_error(error_code::invalid_request,
                      what + ": two ranks of one group on one node (one device per node)");
  if (auto e = connect_next(self, what, next, next_node)) return e;
  auto& dp = data_plane::local();
  const auto peer = dp.peer(to_string(next.shard->node()));
  if (!peer || !dp.engine())
    return make_error(error_code::stage_failed,
                      what + ": the data plane to " + next_node + " is not connected");
  rewatch(self, it->ring_watch, caf::actor_cast<caf::strong_actor_ptr>(next.shard));
  g.ring.rank = g.rank;
  g.ring.size = g.size;
  g.ring.next = *peer;
  g.ring.abort = &g.broken;
  g.ring.stats = &g.allreduce;
  g.ring.engine = dp.engine().get();
  return true;
}

/// Rank 0 of the tensor-parallel stage held here at `first`: its rank
/// `rank` is now `peer` on node `node` (live migration; the group is
/// paused).
caf::result<bool> repoint_peer(agent_ptr self, std::int32_t first, std::int32_t rank,
                               const stage_handles& peer, const std::string& node) {
  auto& st = self->state;
  const std::string what = "node " + st.cfg.name + ", tensor-parallel rank " +
                           std::to_string(rank) + " of the stage at layer " + std::to_string(first);
  auto it = std::find_if(st.stages.begin(), st.stages.end(), [&](const held_stage& h) {
    return h.res->model->range().first == first && h.res->tp && h.res->tp->rank == 0;
  });
  if (it == st.stages.end())
    return make_error(error_code::not_found, what + ": no rank 0 of such a stage here");
  auto& g = *it->res->tp;
  if (rank < 1 || rank >= g.size || peer.tp_rank != rank || peer.tp_size != g.size ||
      peer.first_layer != first || !peer.shard || !peer.kv)
    return make_error(error_code::invalid_request, what + ": not that rank of this stage");
  if (node == st.cfg.name)
    return make_error(error_code::invalid_request,
                      what + ": two ranks of one group on one node (one device per node)");
  if (auto e = connect_next(self, what, peer, node)) return e;
  const auto p = static_cast<std::size_t>(rank - 1);
  if (p < it->tp_watch.size())
    rewatch(self, it->tp_watch[p], caf::actor_cast<caf::strong_actor_ptr>(peer.shard));
  g.set_peer(rank, peer.shard, peer.kv, to_string(peer.shard->node()));
  logging::of("agent").info("node {}: {} is now on {}", st.cfg.name, what, node);
  return true;
}

node_report report_of(agent_ptr self) {
  auto& st = self->state;
  // glibc keeps freed heap pages (in every thread's arena) until a trim:
  // under load a node's resident memory drifted up and down by about 10
  // MiB while what it had allocated stayed flat (the fifth and sixth chaos
  // soaks). Hand them back every 30 s, from the heartbeat.
  if (const auto now = steady::now(); now - st.last_trim > std::chrono::seconds(30)) {
    st.last_trim = now;
    malloc_trim(0);
  }
  node_report r;
  r.node = st.cfg.name;
  r.devices = st.cfg.device.name;
  r.epoch = st.epoch;
  r.rss_bytes = resident_bytes();
  if (auto dev = device_for(st.cfg.device)) {
    const auto pool = (*dev)->memory().snapshot();
    r.pool_in_use_bytes = static_cast<std::int64_t>(pool.bytes_in_use);
    r.pool_cached_bytes = static_cast<std::int64_t>(pool.bytes_cached);
  }
  const auto mi = mallinfo2();
  r.malloc_bytes = static_cast<std::int64_t>(mi.uordblks + mi.hblkhd);
  r.memory_limit = st.cfg.memory_limit;
  r.failure = st.failure;
  r.probe = st.probe;
  r.load = st.load ? st.load->sample() : 0.0;
  r.engine_address = data_plane::local().address();
  for (auto& h : st.stages) {
    const auto range = h.res->model->range();
    if (!r.stages.empty()) r.stages += ", ";
    r.stages += "layers [" + std::to_string(range.first) + "," + std::to_string(range.last) + ")";
    if (h.res->tp) r.stages += rank_of(h.res->tp->rank, h.res->tp->size);
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

/// Orders come from the head that holds this node's lease
/// (cluster/head_lease.hpp), or from this process (the head's own node).
caf::error refuse_unless_head(agent_ptr self) {
  const auto& s = self->current_sender();
  if (!s) return make_error(error_code::not_the_head, "an order without a sender");
  std::string source = "this process";
  if (s->node() != self->node()) {
    auto& l = cluster::local_head_lease();
    std::lock_guard lk(l.mtx);
    if (!l.lease.holds(to_string(s->node())))
      return make_error(error_code::not_the_head,
                        "node " + self->state.cfg.name + " takes orders from the head of term " +
                            std::to_string(l.lease.term()) + " only: this sender must step down");
    source = to_string(s->node()) + " term " + std::to_string(l.lease.term());
  }
  auto& st = self->state;
  if (st.orders_of != source) {
    if (!st.orders_of.empty()) {
      logging::of("agent").info("node {}: a new head ({}): what the old one placed goes",
                                st.cfg.name, source);
      drop_stages(self);
      if (st.vault) caf::anon_send_exit(st.vault, caf::exit_reason::user_shutdown);
      if (st.encoder) caf::anon_send_exit(st.encoder, caf::exit_reason::user_shutdown);
      st.vault = kv_vault_actor{};
      st.encoder = encoder_actor{};
      st.epoch = 0;
    }
    st.orders_of = std::move(source);
  }
  return {};
}

}  // namespace

node_agent_actor spawn_node_agent(caf::actor_system& sys, node_config cfg) {
  auto impl = [](agent_ptr self, node_config cfg) -> node_agent_actor::behavior_type {
    self->state.cfg = std::move(cfg);
    {
      auto& st = self->state;
      // The node opened its device before the agent (troupe node checks it).
      if (auto dev = device_for(st.cfg.device))
        st.probe = measure_device(**dev, st.cfg.memory_limit);
      else
        logging::of("agent").error("node {}: {}", st.cfg.name, dev.error().message);
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
      if (self->state.vault)
        caf::anon_send_exit(self->state.vault, caf::exit_reason::user_shutdown);
      if (self->state.encoder)
        caf::anon_send_exit(self->state.encoder, caf::exit_reason::user_shutdown);
      self->quit(em.reason);
    });
    self->set_down_handler([self](caf::down_msg& dm) {
      auto& st = self->state;
      for (auto& h : st.stages) {
        if (h.shard.address() == dm.source || h.kv.address() == dm.source)
          st.failure = "a stage actor stopped: " + self->system().render(dm.reason);
        if (h.res->tp &&
            (dm.source == h.ring_watch ||
             std::find(h.tp_watch.begin(), h.tp_watch.end(), dm.source) != h.tp_watch.end())) {
          // Another rank of its group is gone: its all-reduces cannot end.
          h.res->tp->broken = true;
          st.failure = "another rank of the tensor-parallel stage at layer " +
                       std::to_string(h.res->model->range().first) +
                       " is gone: " + self->system().render(dm.reason);
        }
      }
    });
    return {
        [=](load_atom, const stage_order& o) -> caf::result<stage_handles> {
          if (auto e = refuse_unless_head(self)) return e;
          return load_stage(self, o);
        },
        [=](tp_atom, std::int32_t first, const stage_handles& next,
            const std::string& next_node) -> caf::result<bool> {
          if (auto e = refuse_unless_head(self)) return e;
          return connect_ring(self, first, next, next_node);
        },
        [=](tp_atom, std::int32_t first, std::int32_t rank, const stage_handles& peer,
            const std::string& node) -> caf::result<bool> {
          if (auto e = refuse_unless_head(self)) return e;
          return repoint_peer(self, first, rank, peer, node);
        },
        [=](drop_atom) -> caf::result<std::int32_t> {
          if (auto e = refuse_unless_head(self)) return e;
          const auto n = static_cast<std::int32_t>(self->state.stages.size());
          drop_stages(self);  // (a KV store stays: the head's next order replaces it)
          return n;
        },
        [=](load_vault_atom, const vault_order& o) -> caf::result<kv_vault_actor> {
          if (auto e = refuse_unless_head(self)) return e;
          auto& st = self->state;
          if (o.slots <= 0 || o.layers <= 0 || o.layer_bytes <= 0 || o.slots > (1 << 30) ||
              o.layer_bytes > (std::int64_t{1} << 30))
            return make_error(error_code::invalid_request,
                              "node " + st.cfg.name + ": a KV store order of " +
                                  std::to_string(o.slots) + " blocks of " +
                                  std::to_string(o.layers) + " layers x " +
                                  std::to_string(o.layer_bytes) + " bytes");
          const double bytes = static_cast<double>(o.slots) * o.layers * o.layer_bytes;
          if (st.cfg.memory_limit > 0 && static_cast<double>(resident_bytes()) + bytes >
                                             static_cast<double>(st.cfg.memory_limit))
            return make_error(error_code::kv_exhausted,
                              "node " + st.cfg.name + ": a KV store of " +
                                  gib(static_cast<std::int64_t>(bytes)) +
                                  " does not fit its memory limit of " + gib(st.cfg.memory_limit) +
                                  " (manifest; it uses " + gib(resident_bytes()) + " now)");
          if (st.vault) caf::anon_send_exit(st.vault, caf::exit_reason::user_shutdown);
          kv_vault_options vo;
          vo.slots = o.slots;
          vo.layers = o.layers;
          vo.layer_bytes = o.layer_bytes;
          vo.notify = o.notify;
          st.vault = spawn_kv_vault(self->system(), vo);
          logging::of("agent").info("node {}: holds the cluster's KV store ({} blocks, {})",
                                    st.cfg.name, o.slots, gib(static_cast<std::int64_t>(bytes)));
          return st.vault;
        },
        [=](ping_atom) -> caf::result<node_report> {
          if (auto e = refuse_unless_head(self)) return e;
          return report_of(self);
        },
        [=](relink_atom, std::int32_t first, const stage_handles& next,
            const std::string& next_node) -> caf::result<bool> {
          if (auto e = refuse_unless_head(self)) return e;
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
          self->request(it->shard, st.cfg.timeout, forward_atom::value,
                        caf::actor_cast<caf::strong_actor_ptr>(next.shard))
              .then([rp](bool ok) mutable { rp.deliver(ok); },
                    [rp](caf::error& e) mutable { rp.deliver(std::move(e)); });
          return rp;
        },
        [=](connect_atom, const stage_handles& to, const std::string& name) -> caf::result<bool> {
          if (auto e = refuse_unless_head(self)) return e;
          if (auto e = connect_next(
                  self, "node " + self->state.cfg.name + ", connecting to " + name, to, name))
            return e;
          return true;
        },
        [=](load_enc_atom, const encoder_order& order) -> caf::result<encoder_actor> {
          if (auto e = refuse_unless_head(self)) return e;
          auto& st = self->state;
          if (order.kind != encoder_kind::vision)
            return make_error(error_code::invalid_request,
                              "no encoder of kind " + std::to_string(static_cast<int>(order.kind)));
          const auto& head_address = order.head_address;
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
          auto dev = device_for(st.cfg.device);
          if (!dev)
            return make_error(error_code::stage_failed,
                              "node " + st.cfg.name + ", vision encoder: " + dev.error().message);
          auto enc = make_media_encoder(st.cfg.device, *dev, st.cfg.model, st.cfg.plan);
          if (!enc)
            return make_error(error_code::stage_failed,
                              "node " + st.cfg.name + ", vision encoder: " + enc.error().message);
          (*enc)->video_limits = video_limits_of(st.cfg.m.media);
          st.encoder = spawn_encoder(self->system(), *enc, encoder_options{});
          logging::of("agent").info("node {}: runs the vision encoder on {} (loaded in {:.0f} ms)",
                                    st.cfg.name, st.cfg.device.name, ms_since(t0));
          return st.encoder;
        },
        [=](drop_enc_atom, const encoder_order& order) -> caf::result<std::int32_t> {
          if (auto e = refuse_unless_head(self)) return e;
          auto& st = self->state;
          if (order.kind != encoder_kind::vision || !st.encoder) return 0;
          caf::anon_send_exit(st.encoder, caf::exit_reason::user_shutdown);
          st.encoder = encoder_actor{};
          return 1;
        },
        [=](drop_stage_atom, std::int32_t first) -> caf::result<std::int32_t> {
          if (auto e = refuse_unless_head(self)) return e;
          auto& st = self->state;
          std::int32_t n = 0;
          for (auto it = st.stages.begin(); it != st.stages.end();) {
            if (it->res->model->range().first != first) {
              ++it;
              continue;
            }
            self->demonitor(it->shard.address());
            self->demonitor(it->kv.address());
            for (const auto& a : it->tp_watch) self->demonitor(a);
            if (it->ring_watch) self->demonitor(it->ring_watch);
            if (it->res->tp) it->res->tp->broken = true;
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
          if (auto e = refuse_unless_head(self)) return e;
          auto& st = self->state;
          // Into a pool of the probe's own, freed with it (the device's pool
          // would keep the 8 MiB cached for good).
          auto t = data_plane::local().take(ref, *kernels::memory_pool::create());
          if (!t)
            return make_error(error_code::stage_failed,
                              "node " + st.cfg.name + ", link probe: " + t.error().message);
          return static_cast<std::int64_t>(t->nbytes());
        },
        [=](down_atom) {
          if (auto e = refuse_unless_head(self)) {
            logging::of("agent").warn("node {}: ignored a stop: {}", self->state.cfg.name,
                                      describe(self->system(), e));
            return;
          }
          logging::of("agent").info("node {}: told to stop", self->state.cfg.name);
          drop_stages(self);
          ::kill(::getpid(), SIGTERM);  // the main thread waits for it
        },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(cfg));
}

}  // namespace troupe::actors
