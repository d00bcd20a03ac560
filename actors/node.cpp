#include "actors/node.hpp"
#include "actors/log.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace troupe::actors {

namespace {

struct node_state {
  node_setup setup;
  node_status status;
  std::vector<shard_actor> shards;
  std::vector<kv_store_actor> kv_stores;
  encoder_actor encoder;
};

using self_ptr = node_actor::stateful_pointer<node_state>;

template <class Handle>
void kill_all(std::vector<Handle>& hs) {
  for (auto& h : hs)
    if (h) caf::anon_send_exit(h, caf::exit_reason::kill);
  hs.clear();
}

// The pipeline as the scheduler sees it: the local stages, then the
// remote tail if any.
std::vector<shard_actor> all_shards(const node_state& st) {
  auto v = st.shards;
  if (st.setup.remote_tail && !v.empty()) v.push_back(st.setup.remote_tail->shard);
  return v;
}
std::vector<kv_store_actor> all_kv_stores(const node_state& st) {
  auto v = st.kv_stores;
  if (st.setup.remote_tail && !v.empty()) v.push_back(st.setup.remote_tail->kv);
  return v;
}

void publish(self_ptr self) {
  auto& st = self->state;
  std::lock_guard lock(st.setup.handles->mtx);
  st.setup.handles->shards = all_shards(st);
  st.setup.handles->kv_stores = all_kv_stores(st);
  st.setup.handles->encoder = st.encoder;
}

void spawn_pipeline(self_ptr self) {
  auto& st = self->state;
  auto& sys = self->system();
  // Every stage starts empty: a restarted pipeline has no KV.
  for (auto& r : st.setup.stages) {
    std::lock_guard lock(r->kv->mtx);
    for (auto& [s, l] : r->kv->local) r->kv->cache.release(l);
    r->kv->local.clear();
    ++r->kv->generation;  // shards of an older pipeline may not touch it any more
  }
  st.shards.assign(st.setup.stages.size(), shard_actor{});
  shard_actor next = st.setup.remote_tail ? st.setup.remote_tail->shard : shard_actor{};
  for (std::size_t i = st.setup.stages.size(); i-- > 0;) {
    st.shards[i] = spawn_shard(sys, st.setup.stages[i], next);
    next = st.shards[i];
    self->monitor(st.shards[i]);
  }
  st.kv_stores.clear();
  for (auto& r : st.setup.stages) {
    st.kv_stores.push_back(spawn_kv_store(sys, r));
    self->monitor(st.kv_stores.back());
  }
}

void spawn_encoder_actor(self_ptr self) {
  auto& st = self->state;
  if (!st.setup.encoder) return;
  st.encoder = spawn_encoder(self->system(), st.setup.encoder, st.setup.encoder_opts);
  self->monitor(st.encoder);
}

}  // namespace

node_actor spawn_node(caf::actor_system& sys, node_setup setup) {
  auto impl = [](self_ptr self, node_setup setup) -> node_actor::behavior_type {
    auto& st = self->state;
    st.setup = std::move(setup);
    spawn_pipeline(self);
    spawn_encoder_actor(self);
    publish(self);
    // The remote worker's shard is not ours to restart: when it goes (the
    // process died, the connection broke) the pipeline cannot go on and the
    // scheduler fails its requests with the reason.
    if (st.setup.remote_tail) self->monitor(st.setup.remote_tail->shard);
    for (const auto& p : st.setup.tp_peers) self->monitor(p.shard);
    self->set_down_handler([=](caf::down_msg& dm) {
      auto& st = self->state;
      const bool tail_gone =
          st.setup.remote_tail && st.setup.remote_tail->shard.address() == dm.source;
      const auto peer =
          std::find_if(st.setup.tp_peers.begin(), st.setup.tp_peers.end(),
                       [&](const stage_handles& p) { return p.shard.address() == dm.source; });
      if (tail_gone || peer != st.setup.tp_peers.end()) {
        st.status.last_failure =
            (tail_gone ? std::string("the remote stage (troupe worker) is gone: ")
                       : "tensor-parallel rank " + std::to_string(peer->tp_rank) +
                             " (troupe worker) is gone: ") +
            self->system().render(dm.reason);
        if (st.status.failed) return;
        // A stage blocked in an all-reduce with the lost rank gives up now.
        for (auto& r : st.setup.stages)
          if (r->tp) r->tp->broken = true;
        logging::of("supervisor").error("{}", st.status.last_failure);
        st.status.failed = true;
        kill_all(st.shards);
        kill_all(st.kv_stores);
        st.setup.remote_tail.reset();
        st.setup.tp_peers.clear();
        publish(self);
        self->send(st.setup.scheduler, pipeline_atom::value, std::vector<shard_actor>{},
                   std::vector<kv_store_actor>{});
        return;
      }
      auto is = [&](const auto& hs) {
        return std::any_of(hs.begin(), hs.end(),
                           [&](const auto& h) { return h && h.address() == dm.source; });
      };
      const bool stage = is(st.shards) || is(st.kv_stores);
      const bool encoder = st.encoder && st.encoder.address() == dm.source;
      if (!stage && !encoder) return;  // an actor this node already replaced
      const std::string why = self->system().render(dm.reason);
      st.status.last_failure =
          (stage ? "a pipeline actor stopped: " : "the vision encoder stopped: ") + why;
      if (st.status.failed) return;
      if (st.status.restarts >= st.setup.opts.max_restarts) {
        logging::of("supervisor")
            .error("{}; {} restarts already, giving up", st.status.last_failure,
                   st.status.restarts);
        st.status.failed = true;
        kill_all(st.shards);
        kill_all(st.kv_stores);
        publish(self);
        self->send(st.setup.scheduler, pipeline_atom::value, std::vector<shard_actor>{},
                   std::vector<kv_store_actor>{});
        return;
      }
      ++st.status.restarts;
      if (stage) {
        logging::of("supervisor")
            .warn("{}; restarting the pipeline ({} of {})", st.status.last_failure,
                  st.status.restarts, st.setup.opts.max_restarts);
        kill_all(st.shards);
        kill_all(st.kv_stores);
        auto respawn = [self] {
          auto& st = self->state;
          if (st.status.failed) return;
          spawn_pipeline(self);
          publish(self);
          self->send(st.setup.scheduler, pipeline_atom::value, all_shards(st), all_kv_stores(st));
        };
        if (st.setup.tp_peers.empty()) {
          respawn();
        } else {
          // The other ranks' KV must be empty before the new pipeline's
          // first step reaches them.
          auto left = std::make_shared<std::size_t>(st.setup.tp_peers.size());
          for (const auto& p : st.setup.tp_peers)
            self->request(p.kv, caf::infinite, clear_atom::value)
                .then(
                    [left, respawn](std::int64_t) {
                      if (--*left == 0) respawn();
                    },
                    [](caf::error&) {});  // a rank that is gone: its down message fails the node
        }
      } else {
        logging::of("supervisor")
            .warn("{}; restarting the encoder ({} of {})", st.status.last_failure,
                  st.status.restarts, st.setup.opts.max_restarts);
        spawn_encoder_actor(self);
        publish(self);
        self->send(st.setup.scheduler, encoder_atom::value, st.encoder);
      }
    });
    // The node stops: so does everything it spawned (the state is gone by
    // then; the published handles are not).
    self->attach_functor(
        [handles = st.setup.handles, tail = st.setup.remote_tail](const caf::error&) {
          std::lock_guard lock(handles->mtx);
          if (tail) {
            // Not ours to stop: another process serves it.
            std::erase(handles->shards, tail->shard);
            std::erase(handles->kv_stores, tail->kv);
          }
          kill_all(handles->shards);
          kill_all(handles->kv_stores);
          if (handles->encoder) caf::anon_send_exit(handles->encoder, caf::exit_reason::kill);
        });
    return {
        [=](stats_atom) { return self->state.status; },
        [=](notify_atom, scheduler_actor& s) { self->state.setup.scheduler = std::move(s); },
    };
  };
  return sys.spawn(impl, std::move(setup));
}

}  // namespace troupe::actors
