#include "actors/head.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>

#include "actors/core/block_hash.hpp"
#include "actors/core/router.hpp"
#include "actors/data_plane.hpp"
#include "actors/gatekeeper.hpp"
#include "actors/head_placement.hpp"
#include "actors/head_state.hpp"
#include "actors/head_status.hpp"
#include "actors/kv_vault.hpp"
#include "actors/log.hpp"
#include "actors/migration.hpp"
#include "models/llama.hpp"
#include "models/weights.hpp"

namespace troupe::actors {

namespace head_detail {

using namespace std::chrono_literals;

void event(head_ptr self, const std::string& what, bool warn) {
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

namespace {

bool from_this_process(head_ptr self) {
  const auto& s = self->current_sender();
  return s && s->node() == self->node();
}

/// Joins under way at once at most (heartbeat).
constexpr int max_joins_in_flight = 16;

void start_join(head_ptr self, const std::string& name) {
  auto& st = self->state;
  auto& r = st.rt[name];
  if (r.joining) return;
  r.joining = true;
  const auto core = caf::actor_cast<head_core_actor>(self);
  self->system().spawn<caf::detached>([core, m = st.cfg.node.m, me = st.cfg.node.name, name,
                                       timeout = st.cfg.node.timeout,
                                       term = st.cfg.term](caf::blocking_actor* b) {
    auto pass = join_node(b->system(), m, me, name,
                          std::min(timeout, std::chrono::milliseconds(5000)), term);
    if (pass)
      b->send(core, joined_atom::value, name, *pass);
    else
      b->send(core, joined_atom::value, name, pass.error());
  });
}

/// A node follows a head of a higher term (this one was stopped, or cut
/// off, while another took over): this head steps down. Its process stops;
/// the nodes are the newer head's.
void step_down(head_ptr self, const std::string& name, const std::string& why) {
  auto& st = self->state;
  if (st.stepped_down) return;
  st.stepped_down = true;
  st.draining = true;
  logging::of("head").error("head {} (term {}) steps down: node {} refused it: {}",
                            st.cfg.node.name, st.cfg.term, name, why);
  ::kill(::getpid(), SIGTERM);  // the main thread waits for it
}

void ensure_vault(head_ptr self);
void vault_lost(head_ptr self, const std::string& why);

void on_lost(head_ptr self, const std::string& name, const std::string& why) {
  auto& st = self->state;
  auto& r = st.rt[name];
  if (r.agent) self->demonitor(r.agent.address());
  r.agent = node_agent_actor{};
  forget_joined_node(name);
  const auto* m = st.members->find(name);
  const double detect_ms = m && m->last_seen ? ms_since(*m->last_seen) : -1;
  event(self, "node " + name + " lost: " + why, true);
  if (st.vault && st.vault_on == name) vault_lost(self, "node " + name + " lost");
  encoder_node_lost(self, name);
  if (st.encoder && st.encoder_owner == name && st.encoder_home && !st.draining) {
    // The vision encoder ran there: it runs on the head again (its weights
    // stayed loaded here), and the scheduler sends the images it was
    // encoding, or whose rows it held, to this one.
    const auto lost_encoder = st.encoder;
    st.encoder = spawn_encoder(self->system(), st.encoder_home, st.cfg.encoder);
    st.encoder_where = st.cfg.node.name + " " + st.encoder_home->device.name;
    st.encoder_owner.clear();
    ++st.actor_restarts;
    // The lost one and its rows are gone; the other replicas serve on.
    push_encoder_pool(self, {lost_encoder});
    event(self,
          "the vision encoder is re-placed on " + st.cfg.node.name + " (" + name + " held it)",
          true);
  }
  for (auto& p : st.reps) {
    // The replicas that held it (or were placing on it) are placed again;
    // the others serve on.
    const bool held = cluster::plan_uses(p.plan, name);
    if ((held || (p.placing && in_replica(p, name))) && !st.draining) {
      p.detect_ms = detect_ms;
      st.detect_ms = detect_ms;
      p.lost_at = steady::now();
      replace(self, p.index,
              (st.reps.size() > 1 ? "replica " + std::to_string(p.index) + ": node " : "node ") +
                  name + " lost");
    }
  }
}

/// The cluster's KV store: spawned once the scheduler is (and again after
/// its node was lost and came back) on kv.store_node: in this process, or
/// by that node's agent once it is up.
void ensure_vault(head_ptr self) {
  auto& st = self->state;
  // One store serves one pipeline: spawn_head refuses it with replicas.
  if (st.vault || st.vault_loading || st.vault_slots <= 0 || st.reps.size() != 1 ||
      !st.reps[0].scheduler || st.draining || st.vault_layer_bytes <= 0)
    return;
  const auto& named = st.cfg.node.m.kv.store_node;
  const std::string where = named.empty() ? st.cfg.node.name : named;
  vault_order o;
  o.slots = st.vault_slots;
  o.layers = st.layers;
  o.layer_bytes = st.vault_layer_bytes;
  o.notify = st.reps[0].scheduler;
  auto adopt = [self, where, o](kv_vault_actor v, std::vector<std::uint8_t> address) {
    auto& st = self->state;
    st.vault = std::move(v);
    st.vault_on = where;
    ++st.vault_stores;
    self->monitor(st.vault);
    self->send(st.reps[0].scheduler, vault_atom::value, st.vault, std::move(address));
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f MiB",
                  static_cast<double>(o.slots) * o.layers * o.layer_bytes / (1 << 20));
    event(self, "KV store on " + where + ": " + std::to_string(o.slots) + " blocks (" + buf +
                    "), a copy of every full block");
  };
  if (where == st.cfg.node.name) {
    kv_vault_options vo;
    vo.slots = o.slots;
    vo.layers = o.layers;
    vo.layer_bytes = o.layer_bytes;
    vo.notify = o.notify;
    adopt(spawn_kv_vault(self->system(), vo), data_plane::local().address());
    return;
  }
  auto it = st.rt.find(where);
  if (it == st.rt.end() || !it->second.agent || !st.members->is_up(where) ||
      it->second.report.engine_address.empty())
    return;  // once it is up and has reported
  if (steady::now() - st.vault_tried < std::chrono::seconds(5)) return;
  st.vault_tried = steady::now();
  st.vault_loading = true;
  const auto agent = it->second.agent;
  const auto address = it->second.report.engine_address;
  self->request(agent, st.cfg.node.timeout, load_vault_atom::value, o)
      .then(
          [self, where, agent, address, adopt](kv_vault_actor& v) {
            auto& st = self->state;
            st.vault_loading = false;
            if (st.rt[where].agent != agent || st.draining) {
              caf::anon_send_exit(v, caf::exit_reason::user_shutdown);  // its node went meanwhile
              return;
            }
            adopt(std::move(v), address);
          },
          [self, where](caf::error& e) {
            self->state.vault_loading = false;
            event(self, "the KV store on " + where + ": " + describe(self->system(), e), true);
          });
}

/// The KV store is gone (its node lost, or it stopped): the scheduler stops
/// counting on its copies; a new one is ordered when its node is back.
void vault_lost(head_ptr self, const std::string& why) {
  auto& st = self->state;
  if (!st.vault) return;
  self->demonitor(st.vault.address());
  st.vault = kv_vault_actor{};
  for (auto& p : st.reps)
    if (p.scheduler)
      self->send(p.scheduler, vault_atom::value, kv_vault_actor{}, std::vector<std::uint8_t>{});
  event(self, "the KV store on " + st.vault_on + " is gone (" + why + "); its copies with it",
        true);
}

void finish_placement(head_ptr self, int r, std::uint64_t epoch,
                      std::vector<stage_handles> handles) {
  auto& st = self->state;
  if (epoch != rep(self, r).epoch) return;
  std::vector<shard_actor> shards;
  std::vector<kv_store_actor> kvs;
  for (const auto& h : handles) {
    shards.push_back(h.shard);
    kvs.push_back(h.kv);
  }
  auto done = [self, r, epoch, shards, kvs, handles](std::int64_t blocks, std::int64_t slot_bytes) {
    auto& st = self->state;
    auto& p = rep(self, r);
    if (epoch != p.epoch) return;
    p.handles = handles;
    p.placing = false;
    p.placement_ok = true;
    if (!p.scheduler) {
      auto sopts = st.cfg.scheduler;
      sopts.kv = st.cfg.node.kv;
      sopts.kv_blocks = blocks;
      sopts.cache_namespace = cache_namespace(st.cfg.node.model, st.cfg.node.plan, sopts.kv);
      sopts.host_blocks = sopts.kv.tiers.host_tokens / sopts.kv.block_size;
      sopts.disk_blocks = sopts.kv.tiers.disk_tokens / sopts.kv.block_size;
      sopts.kv_slot_bytes = slot_bytes;
      if (st.cfg.node.kv.tiers.store_tokens > 0 && sopts.prefix_caching && st.layers > 0)
        sopts.remote_blocks = st.cfg.node.kv.tiers.store_tokens / sopts.kv.block_size;
      st.cache_ns = sopts.cache_namespace;
      p.held = std::make_shared<std::atomic<std::int64_t>>(0);
      p.answered = p.routed;
      p.scheduler =
          spawn_scheduler(self->system(), st.frontend, sopts, shards, kvs, st.encoder, p.held);
      if (!st.enc_extra.empty())  // the other encoder replicas too
        self->request(p.scheduler, 5s, encoders_atom::value, encoder_pool(self),
                      std::vector<encoder_actor>{})
            .then([](std::int64_t) {}, [](caf::error&) {});
      if (r == 0) {
        st.vault_slots = sopts.remote_blocks;
        st.vault_layer_bytes = slot_bytes / st.layers;  // every layer's block is alike
        ensure_vault(self);
      }
    } else {
      self->send(p.scheduler, pipeline_atom::value, shards, kvs);
    }
    p.ready = true;
    connect_encoders_to(self, r);
    const std::string who = st.reps.size() > 1 ? "replica " + std::to_string(r) + ": " : "";
    std::string how =
        who + "placed " + cluster::describe(p.plan) + " (placement " + std::to_string(epoch) + ")";
    if (p.lost_at) {
      p.resume_ms = ms_since(*p.lost_at);
      st.resume_ms = p.resume_ms;
      ++p.replacements;
      st.actor_restarts += static_cast<std::int64_t>(p.plan.size());
      p.lost_at.reset();
      char buf[64];
      std::snprintf(buf, sizeof buf, "; requests resume %.0f ms after the loss", p.resume_ms);
      how += buf;
    }
    event(self, how);
    decision_applied(self, st.placing_decision);
    st.placing_decision.reset();
    st.rebalancing = false;
    if (p.resume_after_placement) {
      p.resume_after_placement = false;
      self->send(p.scheduler,
                 resume_atom::value);  // after the reset: the requests recompute on the new stages
    }
    if (!st.want_encoder_on.empty() && st.encoder && st.want_encoder_on != encoder_node(self)) {
      const auto to = st.want_encoder_on;
      self->request(caf::actor_cast<frontdoor_actor>(self), std::chrono::minutes(10),
                    migrate_atom::value, migrate_request{"vision", to, 0})
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
  if (rep(self, r).scheduler) {
    done(0, 0);
    return;
  }
  // Every store's block count (the smallest bounds the books) and block
  // bytes (their sum: one block over the whole model, for the tier counters).
  struct gathered {
    std::int64_t blocks = std::numeric_limits<std::int64_t>::max();
    std::int64_t bytes = 0;
    std::size_t left = 0;
    bool failed = false;
  };
  auto g = std::make_shared<gathered>();
  g->left = kvs.size();
  for (const auto& kv : kvs)
    self->request(kv, st.cfg.node.timeout, usage_atom::value)
        .then(
            [done, g](const kv_usage_info& u) {
              g->blocks = std::min(g->blocks, u.total_blocks);
              g->bytes += u.slot_bytes;
              if (--g->left == 0 && !g->failed) done(g->blocks, g->bytes);
            },
            [self, r, epoch, g](caf::error& e) {
              if (g->failed) return;
              g->failed = true;
              auto& p = rep(self, r);
              if (epoch != p.epoch) return;
              p.placing = false;
              event(self, "placement " + std::to_string(epoch) + ": " + describe(self->system(), e),
                    true);
            });
}

// Every 10 s while requests come: one line per replica with the load and
// the token rates.
void stats_line(head_ptr self, int r) {
  auto& p = rep(self, r);
  if (!p.scheduler || steady::now() - p.last_stats_line < std::chrono::seconds(10)) return;
  const auto since = p.last_stats_line;
  p.last_stats_line = steady::now();
  self->request(p.scheduler, 5s, stats_atom::value)
      .then(
          [self, r, since](const scheduler_stats& s) {
            auto& st = self->state;
            auto& p = rep(self, r);
            const auto& prev = p.last_stats;
            const double secs = std::chrono::duration<double>(steady::now() - since).count();
            if (s.accepted != prev.accepted || s.running > 0 || s.queued > 0) {
              std::int64_t used = 0, total = 0;
              for (const auto& [name, n] : st.rt) {
                if (!in_replica(p, name)) continue;
                used += n.report.kv_used_blocks;
                total += n.report.kv_total_blocks;
              }
              logging::of("head").info(
                  "{}{} running, {} waiting; KV {:.1f}% ({} of {} blocks); prompt {:.1f} "
                  "tokens/s, generation {:.1f} tokens/s; {} finished",
                  st.reps.size() > 1 ? "replica " + std::to_string(r) + ": " : std::string{},
                  s.running, s.queued,
                  total > 0 ? 100.0 * static_cast<double>(used) / static_cast<double>(total) : 0.0,
                  used, total, static_cast<double>(s.prompt_tokens - prev.prompt_tokens) / secs,
                  static_cast<double>(s.generated_tokens - prev.generated_tokens) / secs,
                  s.finished);
            }
            p.last_stats = s;
          },
          [](caf::error&) {});
}

/// Connects the ring of each rank of a tensor-parallel stage to the next
/// rank (rank 0's handles `front`, the others' `peers`), all at once;
/// `done` once every rank answered, `fail` at the first error.
void connect_tp_rings(head_ptr self, int r, std::uint64_t epoch, const cluster::stage_slot& slot,
                      const stage_handles& front, const std::vector<stage_handles>& peers,
                      std::function<void(const std::string&)> fail, std::function<void()> done) {
  auto& st = self->state;
  std::vector<stage_handles> ranks{front};
  ranks.insert(ranks.end(), peers.begin(), peers.end());
  std::vector<std::string> nodes{slot.node};
  nodes.insert(nodes.end(), slot.ranks.begin(), slot.ranks.end());
  struct pending_rings {
    std::size_t left = 0;
    bool failed = false;
  };
  auto left = std::make_shared<pending_rings>();
  left->left = ranks.size();
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const auto next = (k + 1) % ranks.size();
    auto agent = st.rt[nodes[k]].agent;
    if (!agent) return fail("node " + nodes[k] + " is not up");
    self->request(agent, st.cfg.node.timeout, tp_atom::value,
                  static_cast<std::int32_t>(slot.first_layer), ranks[next], nodes[next])
        .then(
            [self, r, epoch, left, done](bool) {
              if (left->failed || epoch != rep(self, r).epoch) return;
              if (--left->left == 0) done();
            },
            [self, left, fail, node = nodes[k]](caf::error& e) {
              if (left->failed) return;
              left->failed = true;
              fail("the tensor-parallel ring on " + node + ": " + describe(self->system(), e));
            });
  }
}

}  // namespace

void replace(head_ptr self, int r, const std::string& trigger,
             std::optional<std::vector<cluster::stage_slot>> forced) {
  auto& st = self->state;
  if (st.draining) return;
  auto& p = rep(self, r);
  const auto epoch = ++st.epochs;
  p.epoch = epoch;
  const auto plan = forced ? std::move(*forced) : choose_slots(self, r, trigger);
  const std::string who = st.reps.size() > 1 ? "replica " + std::to_string(r) + ": " : "";
  if (plan.empty()) {
    p.placing = false;
    p.placement_ok = false;
    p.ready = false;  // the router sends it nothing until it is placed again
    p.plan.clear();
    const auto why = st.reps.size() > 1 ? who + "none of its nodes is up; it waits for one"
                                        : "no node can hold the model now (none is up)";
    if (st.last_event != why) event(self, why, true);
    return;
  }
  p.placing = true;
  // Its nodes left out of the new plan let go of what they hold.
  for (auto& [name, n] : st.rt) {
    const bool in = cluster::plan_uses(plan, name);
    if (!in && n.agent && in_replica(p, name))
      self->request(n.agent, st.cfg.node.timeout, drop_atom::value)
          .then([](std::int32_t) {}, [](caf::error&) {});
  }
  p.plan = plan;
  p.rank_handles.assign(plan.size(), {});
  p.stages_total = static_cast<std::int32_t>(plan.size());
  p.stages_loaded = 0;
  event(self,
        who + "placing " + cluster::describe(plan) + " (placement " + std::to_string(epoch) + ")");
  auto handles = std::make_shared<std::vector<stage_handles>>(plan.size());
  auto load = std::make_shared<std::function<void(std::size_t)>>();
  *load = [self, r, epoch, plan, handles, load](std::size_t i) {
    if (epoch != rep(self, r).epoch) return;
    const auto& slot = plan[i];
    auto retry = [self, r, epoch](const std::string& why) {
      auto& st = self->state;
      auto& p = rep(self, r);
      if (epoch != p.epoch) return;
      p.placing = false;
      p.placement_ok = false;
      event(self, why + "; trying again", true);
      if (!st.retry_queued) {
        st.retry_queued = true;
        self->delayed_send(self, 500ms, tick_atom::value);
      }
    };
    auto fail = [retry, slot](const std::string& why) {
      retry("placing layers [" + std::to_string(slot.first_layer) + "," +
            std::to_string(slot.last_layer) + ") on " + slot.node + " failed: " + why);
    };
    const auto k = static_cast<std::int32_t>(slot.ranks.size()) + 1;
    stage_order o;
    o.first_layer = slot.first_layer;
    o.last_layer = slot.last_layer;
    o.embed = i == 0;
    o.head = i + 1 == plan.size();
    o.epoch = epoch;
    o.tp_size = k;
    // The stage (its rank 0) is loaded: on to the one before it, or done.
    auto next_stage = [self, r, epoch, handles, load, i, slot, n = plan.size(),
                       retry](stage_handles h) {
      auto& p = rep(self, r);
      if (epoch != p.epoch) return;
      ++p.stages_loaded;
      event(self, "loaded layers [" + std::to_string(slot.first_layer) + "," +
                      std::to_string(slot.last_layer) + ") on " + slot.node +
                      (slot.ranks.empty() ? std::string{}
                                          : " and " + std::to_string(slot.ranks.size()) +
                                                " more tensor-parallel ranks") +
                      " (" + std::to_string(n - i) + " of " + std::to_string(n) + " stages)");
      (*handles)[i] = std::move(h);
      if (i == 0) {
        auto& st = self->state;
        const auto enc_node = encoder_node(self);
        auto own = st.rt[enc_node].agent;
        if (slot.node != enc_node && own) {
          // The first stage is off the encoder's node: the encoder
          // sends it image rows over the data plane.
          self->request(own, st.cfg.node.timeout, connect_atom::value, (*handles)[0], slot.node)
              .then([self, r, epoch, handles](bool) { finish_placement(self, r, epoch, *handles); },
                    [self, slot, enc_node, retry](caf::error& e) {
                      retry("connecting " + enc_node + " (the encoder) to " + slot.node + ": " +
                            describe(self->system(), e));
                    });
        } else {
          finish_placement(self, r, epoch, *handles);
        }
        *load = nullptr;  // breaks the cycle
      } else {
        (*load)(i - 1);
      }
    };
    // Rank 0 (the stage itself), once the other ranks are loaded.
    auto load_front = [self, r, epoch, slot, o, i, plan, handles, fail,
                       next_stage](std::vector<stage_handles> peers) mutable {
      auto& st = self->state;
      if (epoch != rep(self, r).epoch) return;
      auto agent = st.rt[slot.node].agent;
      if (!agent) return fail("the node is not up");
      if (i + 1 < plan.size()) {
        o.has_next = true;
        o.next = (*handles)[i + 1];
        o.next_node = plan[i + 1].node;
      }
      o.tp_rank = 0;
      o.tp_peers = peers;
      o.tp_peer_nodes = slot.ranks;
      auto busy = loading_on(self, slot.node);
      self->request(agent, st.cfg.node.timeout, load_atom::value, o)
          .then(
              [self, r, epoch, i, slot, peers, fail, next_stage, busy](stage_handles& h) {
                auto& p = rep(self, r);
                if (epoch != p.epoch) return;
                if (i < p.rank_handles.size()) p.rank_handles[i] = peers;
                if (peers.empty()) return next_stage(std::move(h));
                connect_tp_rings(self, r, epoch, slot, h, peers, fail,
                                 [next_stage, h] { next_stage(h); });
              },
              [self, fail, busy](caf::error& e) { fail(describe(self->system(), e)); });
    };
    if (slot.ranks.empty()) return load_front({});
    // The other ranks of a tensor-parallel stage first, one after another.
    auto peers = std::make_shared<std::vector<stage_handles>>();
    auto load_rank = std::make_shared<std::function<void()>>();
    *load_rank = [self, r, epoch, slot, o, peers, load_rank, load_front, fail]() mutable {
      auto& st = self->state;
      if (epoch != rep(self, r).epoch) {
        *load_rank = nullptr;
        return;
      }
      const auto j = peers->size();
      if (j == slot.ranks.size()) {
        auto front = std::move(load_front);
        auto got = std::move(*peers);
        *load_rank = nullptr;  // breaks the cycle
        return front(std::move(got));
      }
      const auto& node = slot.ranks[j];
      auto agent = st.rt[node].agent;
      if (!agent) {
        *load_rank = nullptr;
        return fail("node " + node + " (tensor-parallel rank " + std::to_string(j + 1) +
                    ") is not up");
      }
      o.tp_rank = static_cast<std::int32_t>(j) + 1;
      auto busy = loading_on(self, node);
      self->request(agent, st.cfg.node.timeout, load_atom::value, o)
          .then(
              [peers, load_rank, busy](stage_handles& h) {
                if (!*load_rank) return;
                peers->push_back(std::move(h));
                (*load_rank)();
              },
              [self, fail, load_rank, node, j, busy](caf::error& e) {
                *load_rank = nullptr;
                fail("tensor-parallel rank " + std::to_string(j + 1) + " on " + node + ": " +
                     describe(self->system(), e));
              });
    };
    (*load_rank)();
  };
  (*load)(plan.size() - 1);
}

/// Takes replica `r`'s block events since the last read into its index of
/// cached blocks.
void follow_block_events(head_ptr self, int r) {
  auto& st = self->state;
  auto& p = rep(self, r);
  if (!p.scheduler || p.block_events_asked) return;
  p.block_events_asked = true;
  self->request(p.scheduler, st.cfg.node.timeout, kv_events_atom::value, p.block_events_next)
      .then(
          [self, r](const kv_events& ev) {
            auto& p = rep(self, r);
            p.block_events_asked = false;
            for (const auto& m : ev.events) {
              core::kv_books::event e;
              e.what = static_cast<core::kv_books::event::kind>(m.what);
              e.tier = static_cast<models::kv_tier>(m.tier);
              if (m.what > 2 || m.tier > 3 || (m.what != 2 && m.name.size() != e.name.size()))
                continue;
              std::copy(m.name.begin(), m.name.end(), e.name.begin());
              p.blocks.apply(e);
            }
            p.block_events += ev.events.size();
            p.block_events_next = ev.next;
          },
          [self, r](caf::error&) { rep(self, r).block_events_asked = false; });
}

void heartbeat(head_ptr self) {
  auto& st = self->state;
  const auto now = steady::now();
  for (const auto& p : st.reps) {
    stats_line(self, p.index);
    follow_block_events(self, p.index);
  }
  ensure_vault(self);
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
  // Joins are paced: each is a TLS handshake, and the node checks the
  // head's address with another one back. A thousand at once (a large
  // manifest starting) time each other out; those left wait for their
  // next turn (membership's rejoin_every).
  int room = max_joins_in_flight -
             static_cast<int>(std::count_if(st.rt.begin(), st.rt.end(),
                                            [](const auto& r) { return r.second.joining; }));
  for (const auto& name : st.members->due_for_join(now))
    if (name != st.cfg.node.name && room > 0 && !st.rt[name].joining) {
      start_join(self, name);
      --room;
    }
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
            [self, name](caf::error& e) {
              // Silence is what tick() measures; a refusal is an answer.
              if (troupe_code(e) == static_cast<std::uint8_t>(error_code::not_the_head))
                step_down(self, name, describe(self->system(), e));
            });
  }
  for (auto& p : st.reps)
    if (p.scheduler)
      self->request(p.scheduler, 5s, stats_atom::value)
          .then(
              [self, r = p.index, routed = p.routed](const scheduler_stats& s) {
                const auto now = steady::now();
                auto& p = rep(self, r);
                p.tokens.add(now, s.tokens_out);
                p.routed_at_stats = routed;  // what it had been sent when it answered
                auto& q = p.stat_samples;
                q.emplace_back(now, s);
                while (q.size() > 1 && now - q.front().first > 60s) q.pop_front();
              },
              [](caf::error&) {});
  retire_drained(self);
  journal_tick(self);
  encoder_service_tick(self);
  measure_decisions(self);
  policy_tick(self);
  // The first placement: once every node is up and measured (or, after the
  // grace period, whoever is).
  if (!st.grouped && !st.draining) {
    const auto usable = st.members->usable();
    const bool grace_over = steady::now() - st.started > st.cfg.startup_grace;
    const auto stage_nodes = static_cast<std::size_t>(
        std::count_if(st.cfg.node.m.nodes.begin(), st.cfg.node.m.nodes.end(),
                      [](const auto& n) { return n.holds_stages(); }));
    if ((usable.size() == stage_nodes && (measured_all(self) || !st.auto_place)) ||
        (grace_over && !usable.empty())) {
      group_replicas(self);
      for (const auto& p : st.reps) replace(self, p.index, "start");
    }
  }
}

std::chrono::milliseconds st_timeout(head_ptr self) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(self->state.cfg.node.timeout);
}

/// How long, and how many, block names of prompts just routed count as
/// cached on their replica before its block events confirm them.
constexpr auto sent_blocks_ttl = std::chrono::seconds(10);
constexpr std::size_t max_sent_blocks = 1 << 16;

/// Jobs streaming audio at once (each holds an entry here and a stream on
/// an encoder).
constexpr std::size_t max_open_streams = 1024;

/// The replica for a job (-1: none runs): the router's choice among those
/// serving, from their load and the cached prefix of the job's prompt;
/// while none serves (a re-placement), the least loaded that has a
/// scheduler (its requests wait there).
int route(head_ptr self, const generate_request& req) {
  auto& st = self->state;
  if (st.reps.size() == 1) return st.reps[0].scheduler ? 0 : -1;
  std::vector<core::block_hash> names;
  const auto& m = st.cfg.node.m;
  if (m.router.prefix && !st.cache_ns.empty() && st.cfg.node.kv.block_size > 0 &&
      st.cfg.scheduler.prefix_caching) {
    // The prompt's full blocks up to its first image (an image's blocks
    // are named after its pixels, which only its encoder hashes).
    auto end = req.prompt_tokens.end();
    if (st.frontend.image_token >= 0)
      end = std::find(req.prompt_tokens.begin(), end, st.frontend.image_token);
    if (st.frontend.audio_token >= 0)
      end = std::find(req.prompt_tokens.begin(), end, st.frontend.audio_token);
    if (st.frontend.video_token >= 0)
      end = std::find(req.prompt_tokens.begin(), end, st.frontend.video_token);
    core::block_chain chain(core::root_hash(st.cache_ns, req.cache_salt), st.cfg.node.kv.block_size,
                            -1, 0, {});
    chain.extend(std::span(req.prompt_tokens.begin(), end));
    names = chain.hashes();
  }
  std::vector<core::replica_load> loads(st.reps.size());
  bool any = false;
  for (std::size_t i = 0; i < st.reps.size(); ++i) {
    const auto& p = st.reps[i];
    auto& l = loads[i];
    l.serving = p.serving();
    any = any || l.serving;
    const scheduler_stats last =
        p.stat_samples.empty() ? scheduler_stats{} : p.stat_samples.back().second;
    // The scheduler's own count as of now, and the jobs on their way to
    // it: a sample of the last heartbeat would miss the jobs ended since,
    // and send new ones away from the replica that just freed its slots.
    l.outstanding = p.held ? p.held->load() + (p.routed - p.answered)
                           : last.running + last.queued + (p.routed - p.routed_at_stats);
    l.free_blocks = last.kv_total_blocks - last.kv_used_blocks + last.kv_cached_free;
    l.cached_blocks = names.empty() ? 0 : p.blocks.cached_prefix(names);
    // Blocks of prompts sent there in the last seconds count as cached:
    // its block events name them only once computed and followed.
    std::int64_t sent = 0;
    for (const auto& n : names) {
      auto it = p.sent_blocks.find(n);
      if (it == p.sent_blocks.end() || steady::now() - it->second > sent_blocks_ttl) break;
      ++sent;
    }
    l.cached_blocks = std::max(l.cached_blocks, sent);
  }
  if (!any)
    for (std::size_t i = 0; i < st.reps.size(); ++i)
      loads[i].serving = st.reps[i].scheduler && !st.reps[i].retiring && !st.reps[i].retired;
  core::router_options o;
  o.prefix = m.router.prefix;
  o.max_imbalance = m.router.max_imbalance;
  o.min_share = m.router.min_prefix_share;
  // The prompt's full blocks, its media's rows included (each image token
  // becomes tokens_per_image positions, each audio token its clip's).
  auto positions = static_cast<std::int64_t>(req.prompt_tokens.size());
  if (st.frontend.image_token >= 0 && st.frontend.tokens_per_image > 1)
    positions += (st.frontend.tokens_per_image - 1) *
                 static_cast<std::int64_t>(std::count(
                     req.prompt_tokens.begin(), req.prompt_tokens.end(), st.frontend.image_token));
  for (auto n : req.audio_tokens) positions += n - 1;
  const auto prompt_blocks = positions / std::max(1, st.cfg.node.kv.block_size);
  const auto c = core::choose_replica(loads, o, prompt_blocks, st.route_turn++);
  if (c.replica < 0) return c.replica;
  ++(c.by_prefix ? st.routed_by_prefix : st.routed_by_load);
  auto& p = rep(self, c.replica);
  const auto now = steady::now();
  for (const auto& n : names) {
    p.sent_blocks[n] = now;
    p.sent_order.emplace_back(n, now);
  }
  // Bounded: the oldest go past a size or an age (a name sent again keeps
  // its newer time).
  while (!p.sent_order.empty() && (p.sent_order.size() > max_sent_blocks ||
                                   now - p.sent_order.front().second > sent_blocks_ttl)) {
    const auto& [n, t] = p.sent_order.front();
    auto it = p.sent_blocks.find(n);
    if (it != p.sent_blocks.end() && it->second == t) p.sent_blocks.erase(it);
    p.sent_order.pop_front();
  }
  return c.replica;
}

/// Renders a job's prompt on a worker thread of its own (the head keeps
/// answering heartbeats and other jobs meanwhile), at most max_rendering at
/// once; `done` gets the request and the promise, a failure goes to the
/// promise.
template <class T, class F>
caf::result<T> render_prompt_of(head_ptr self, job_request job, F done) {
  auto& st = self->state;
  if (st.rendering >= st.cfg.max_rendering)
    return make_error(
        error_code::overloaded,
        std::to_string(st.rendering) + " jobs are having their prompts prepared; retry later");
  ++st.rendering;
  auto rp = self->make_response_promise<T>();
  auto worker = spawn_prompt_worker(self->system(), st.prompt, st.cfg.render);
  self->request(worker, caf::infinite, render_atom::value, std::move(job))
      .then(
          [=](generate_request& req) mutable {
            --self->state.rendering;
            done(req, rp);
          },
          [=](caf::error& e) mutable {
            --self->state.rendering;
            rp.deliver(std::move(e));
          });
  return rp;
}

}  // namespace head_detail

kernels::result<frontdoor_actor> spawn_head(caf::actor_system& sys, head_config cfg,
                                            node_agent_actor own) {
  using namespace head_detail;
  if (cfg.term == 0)
    cfg.term = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                              std::chrono::system_clock::now().time_since_epoch())
                                              .count());
  const auto& m = cfg.node.m;
  auto prompt = load_prompt_setup(cfg.node.model);
  if (!prompt) return std::unexpected(prompt.error());
  apply_media_limits(*prompt, m.media);
  if (const int k = m.parallelism.tensor_parallel; k > 1) {
    // Each rank holds 1/k of every layer's heads and FFN rows.
    const auto& t = prompt->text;
    if (t.num_heads % k || t.num_kv_heads % k || t.intermediate_size % k)
      return kernels::make_error(kernels::errc::invalid_argument,
                                 m.path + ": parallelism.tensor_parallel = " + std::to_string(k) +
                                     " does not divide " + cfg.node.model + "'s " +
                                     std::to_string(t.num_heads) + " attention heads, " +
                                     std::to_string(t.num_kv_heads) + " KV heads and " +
                                     std::to_string(t.intermediate_size) + " FFN rows evenly");
  }
  if (!prompt->llava && (m.encoders.vision.min > 1 || m.encoders.vision.max > 1))
    return kernels::make_error(
        kernels::errc::invalid_argument,
        m.path + ": [encoders.vision] asks for " + std::to_string(m.encoders.vision.max) +
            " vision encoder replicas, but " + cfg.node.model + " has no vision encoder");
  model_frontend fe;
  fe.tok = prompt->tok;
  fe.vocab = prompt->text.vocab_size;
  fe.hidden = prompt->text.hidden_size;
  auto ctx = models::serving_context_length(prompt->text.max_position_embeddings,
                                            cfg.scheduler.context, m.path + ": [scheduler]");
  if (!ctx) return std::unexpected(ctx.error());
  fe.context_length = *ctx;
  std::shared_ptr<encoder_resources> enc;
  if (prompt->llava) {
    fe.image_token = static_cast<std::int32_t>(prompt->llava->image_token_index);
    fe.tokens_per_image = prompt->llava->tokens_per_image();
    if (prompt->llava->audio)
      fe.audio_token = static_cast<std::int32_t>(prompt->llava->audio->token_index);
    if (prompt->llava->video)
      fe.video_token = static_cast<std::int32_t>(prompt->llava->video->token_index);
    auto dev = device_for(cfg.node.device);
    if (!dev) return std::unexpected(dev.error());
    auto e = make_media_encoder(cfg.node.device, *dev, cfg.node.model, cfg.node.plan);
    if (!e) return std::unexpected(e.error());
    (*e)->video_limits = video_limits_of(m.media);
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
    st.prompt = std::make_shared<const prompt_setup>(std::move(prompt));
    st.frontend = std::move(fe);
    st.members.emplace(std::move(names), st.cfg.membership);
    st.reps.resize(1);  // more once the nodes are grouped (group_replicas)
    for (const auto& n : st.cfg.node.m.nodes)
      if (!n.holds_stages()) st.members->holds_no_stages(n.name);
    st.auto_place = st.cfg.node.m.parallelism.pipeline_stages == 0;
    {
      // The planner's view of the model: its shapes, and the format the
      // stages will hold the decoder's weights in.
      auto mp = model_profile_of(st.prompt->text, st.prompt->llava, st.cfg.node.m.model.kv_type);
      if (mp)
        st.model_prof = std::move(*mp);
      else
        logging::of("head").warn("placement: the model's profile: {}; stages are split evenly",
                                 mp.error());
      if (auto src = models::weight_source::open(st.cfg.node.model)) {
        // One tier for the decoder: the most precise any of its matrices
        // is held at (a mix such as Q4_K_M holds some in Q6_K), so the
        // planner never counts too little memory.
        const auto held = models::decoder_formats(st.prompt->text, **src, st.cfg.node.plan);
        if (!held.empty()) {
          auto tier = placement::precision::q4_0;
          for (const auto& h : held) tier = placement::most_precise(tier, precision_of(h.format));
          st.precision = tier;
          // ... and at that tier, the bytes each layer is held in, exactly.
          if (st.model_prof) hold_as_stored(*st.model_prof, held, tier);
        }
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
      st.encoder_home = enc;
      auto sc = st.cfg.node.m.encoders.vision;
      core::encoder_scaling o;
      o.min = sc.min;
      o.max = sc.max;
      o.up_queue = sc.up_queue;
      o.up_latency_ms = sc.up_latency_ms;
      o.up_after_s = sc.up_after_s;
      o.down_after_s = sc.down_after_s;
      st.enc_clock.emplace(self->clock());
      st.enc_scaler.emplace(o, *st.enc_clock);
    }
    st.rt[st.cfg.node.name].agent = own;
    st.members->joined(st.cfg.node.name, steady::now());
    {
      const auto& m = st.cfg.node.m;
      if (!m.standby.empty())
        st.partner = st.cfg.node.name == m.head      ? m.standby
                     : st.cfg.node.name == m.standby ? m.head
                                                     : std::string{};
      // Both start as standbys: the manifest's head only until it learns
      // that its partner does not serve (at a start, it is a standby) or
      // does not answer; if the partner serves (it took over while this
      // node was down), this node is its standby from now on.
      st.standby_mode = !st.partner.empty();
      st.probing = st.standby_mode && !st.cfg.standby;
      st.probe_until = steady::now() + st.cfg.probe_partner;
      if (st.cfg.standby && st.standby_mode)
        event(self, "standby head: following head " + st.partner);
      else if (st.probing)
        event(self, "head: asking standby " + st.partner + " whether it took over");
    }
    self->set_exit_handler([self](caf::exit_msg& em) {
      // The scheduler and the encoder go with the head.
      auto& st = self->state;
      for (auto& p : st.reps)
        if (p.scheduler) self->send_exit(p.scheduler, em.reason);
      if (st.vault) self->send_exit(st.vault, em.reason);
      if (st.encoder) self->send_exit(st.encoder, em.reason);
      for (const auto& e : st.enc_extra)
        if (e.actor) self->send_exit(e.actor, em.reason);
      self->quit(em.reason);
    });
    self->set_down_handler([self](caf::down_msg& dm) {
      auto& st = self->state;
      if (standby_partner_down(self, dm.source)) return;
      if (st.follower && st.follower.address() == dm.source) {
        st.follower = frontdoor_actor{};
        event(self, "standby " + st.partner + " no longer follows", true);
        return;
      }
      if (st.vault && st.vault.address() == dm.source)
        return vault_lost(self, self->system().render(dm.reason));
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
          if (st.standby_mode)
            return make_error(
                error_code::unavailable,
                "node " + st.cfg.node.name + " is the standby head: submit to head " + st.partner);
          if (st.draining)
            return make_error(error_code::unavailable, "the cluster is shutting down");
          if (std::none_of(st.reps.begin(), st.reps.end(),
                           [](const replica_rt& p) { return p.scheduler; }))
            return make_error(error_code::unavailable,
                              "the cluster is not ready yet: it is placing the model (troupe "
                              "status shows progress)");
          if (job.images.size() > 16)
            return make_error(error_code::invalid_request, "at most 16 images per job");
          if (job.audios.size() > 16)
            return make_error(error_code::invalid_request, "at most 16 audio clips per job");
          if (!job.audios.empty() && job.audios.back().stream) {
            // Streams whose jobs ended without their last chunk are let go
            // after a while (their schedulers failed them long before).
            auto& ss = st.streams;
            std::erase_if(ss, [](const auto& e) {
              return steady::now() - e.second.touched > std::chrono::minutes(10);
            });
            if (ss.size() >= max_open_streams)
              return make_error(
                  error_code::overloaded,
                  std::to_string(ss.size()) + " jobs are streaming audio; retry later");
          }
          return render_prompt_of<submit_ack>(
              self, std::move(job), [=](generate_request& req, auto& rp) {
                const auto r = route(self, req);
                if (r < 0) {
                  rp.deliver(make_error(error_code::unavailable,
                                        "the cluster stopped serving while the prompt was "
                                        "prepared"));
                  return;
                }
                auto& p = rep(self, r);
                ++p.routed;
                journal_begin(self, req);  // (with a standby) before its scheduler has it
                const auto id = req.id;
                if (!req.media.empty() && req.media.back().stream)
                  self->state.streams[id] = {p.scheduler, steady::now()};
                self->request(p.scheduler, caf::infinite, submit_atom::value, std::move(req), sink)
                    .then(
                        [self, r, rp](submit_ack& a) mutable {
                          answered(self, r);
                          rp.deliver(a);
                        },
                        [self, r, id, rp](caf::error& e) mutable {
                          answered(self, r);
                          journal_end(self, id);
                          rp.deliver(std::move(e));
                        });
              });
        },
        [=](tokenize_atom, job_request& job) -> caf::result<tokenize_reply> {
          job.images.clear();  // rendering needs their number only (turns.images)
          return render_prompt_of<tokenize_reply>(
              self, std::move(job), [=](generate_request& req, auto& rp) {
                tokenize_reply out;
                out.tokens = std::move(req.prompt_tokens);
                out.context_length = self->state.frontend.context_length;
                rp.deliver(std::move(out));
              });
        },
        [=](detokenize_atom, const std::vector<std::int32_t>& ids) -> caf::result<std::string> {
          const auto& tok = self->state.frontend.tok;
          if (!tok) return make_error(error_code::unavailable, "no tokenizer loaded");
          const auto vocab = static_cast<std::int64_t>(tok->vocab_size());
          for (auto id : ids)
            if (id < 0 || id >= vocab)
              return make_error(error_code::invalid_request,
                                "token " + std::to_string(id) + " is outside the vocabulary (" +
                                    std::to_string(vocab) + " tokens)");
          return tok->decode(ids);
        },
        [=](reset_cache_atom) -> caf::result<std::int64_t> {
          // Every replica's cache: the blocks freed, summed.
          auto schedulers = schedulers_of(self);
          if (schedulers.empty())
            return make_error(error_code::unavailable, "the model is not placed yet");
          if (schedulers.size() == 1)
            return self->delegate(schedulers.front(), reset_cache_atom::value);
          auto rp = self->make_response_promise<std::int64_t>();
          auto sum = std::make_shared<std::pair<std::int64_t, std::size_t>>(0, schedulers.size());
          for (const auto& s : schedulers)
            self->request(s, st_timeout(self), reset_cache_atom::value)
                .then(
                    [rp, sum](std::int64_t n) mutable {
                      sum->first += n;
                      if (--sum->second == 0) rp.deliver(sum->first);
                    },
                    [rp, sum](caf::error& e) mutable {
                      if (sum->second == 0) return;
                      sum->second = 0;
                      rp.deliver(std::move(e));
                    });
          return rp;
        },
        [=](chunk_atom, audio_chunk& ch) -> caf::result<stream_progress> {
          auto& ss = self->state.streams;
          auto it = ss.find(ch.id);
          if (it == ss.end())
            return make_error(error_code::not_found,
                              "job " + std::to_string(ch.id) + " has no open audio stream");
          it->second.touched = steady::now();
          const auto sched = it->second.scheduler;
          const auto id = ch.id;
          if (ch.last) ss.erase(it);
          auto rp = self->make_response_promise<stream_progress>();
          self->request(sched, caf::infinite, chunk_atom::value, std::move(ch))
              .then([rp](stream_progress& p) mutable { rp.deliver(p); },
                    [self, rp, id](caf::error& e) mutable {
                      self->state.streams.erase(id);
                      rp.deliver(std::move(e));
                    });
          return rp;
        },
        [=](cancel_atom, std::uint64_t id) -> caf::result<bool> {
          // The job is on one replica; each is asked (a cancel is rare).
          auto schedulers = schedulers_of(self);
          if (schedulers.empty()) return false;
          if (schedulers.size() == 1)
            return self->delegate(schedulers.front(), cancel_atom::value, id);
          auto rp = self->make_response_promise<bool>();
          auto left = std::make_shared<std::pair<bool, std::size_t>>(false, schedulers.size());
          for (const auto& s : schedulers) {
            auto one = [rp, left](bool found) mutable {
              left->first = left->first || found;
              if (--left->second == 0) rp.deliver(left->first);
            };
            self->request(s, st_timeout(self), cancel_atom::value, id)
                .then([one](bool found) mutable { one(found); },
                      [one](caf::error&) mutable { one(false); });
          }
          return rp;
        },
        [=](status_atom) -> caf::result<cluster_status> {
          auto rp = self->make_response_promise<cluster_status>();
          auto s = std::make_shared<cluster_status>(status_of(self));
          auto& st = self->state;
          auto left = std::make_shared<std::size_t>(0);
          for (const auto& p : st.reps)
            if (p.scheduler) ++*left;
          if (*left == 0) {
            rp.deliver(std::move(*s));
            return rp;
          }
          // Each replica's counters now; the cluster's are their sum.
          for (const auto& p : st.reps) {
            if (!p.scheduler) continue;
            auto one = [rp, s, left,
                        i = static_cast<std::size_t>(p.index)](const scheduler_stats* x) mutable {
              if (x) {
                s->scheduler += *x;
                if (i < s->replicas.size()) fill_replica_view(s->replicas[i], *x);
              }
              if (--*left == 0) rp.deliver(std::move(*s));
            };
            self->request(p.scheduler, 5s, stats_atom::value)
                .then([one](const scheduler_stats& x) mutable { one(&x); },
                      [one](caf::error&) mutable { one(nullptr); });
          }
          return rp;
        },
        [=](migrate_atom, const migrate_request& req) -> caf::result<migrate_report> {
          return start_migration(self, req);
        },
        [=](scale_atom, std::int32_t n) -> caf::result<std::string> { return scale_to(self, n); },
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
        [=](follow_atom, bool first) -> caf::result<journal_state> {
          return on_follow(self, first);
        },
        [=](journal_atom, std::vector<journal_entry>& entries) { on_journal(self, entries); },
        [=](attach_atom, std::uint64_t id, std::vector<std::int32_t>& tokens,
            client_sink_actor& sink) -> caf::result<submit_ack> {
          return on_attach(self, id, tokens, sink);
        },
        [=](follow_atom, gate_pass& pass) {
          if (from_this_process(self)) follow_joined(self, &pass, {});
        },
        [=](follow_atom, const std::string& why) {
          if (from_this_process(self)) follow_joined(self, nullptr, why);
        },
        [=](tick_atom) {
          if (!from_this_process(self)) return;
          auto& st = self->state;
          if (st.standby_mode) {
            if (steady::now() - st.last_heartbeat >= st.members->options().heartbeat_every) {
              st.last_heartbeat = steady::now();
              standby_tick(self);
              self->delayed_send(self, st.members->options().heartbeat_every, tick_atom::value);
            }
            return;
          }
          st.retry_queued = false;
          if (steady::now() - st.last_heartbeat >= st.members->options().heartbeat_every) {
            st.last_heartbeat = steady::now();
            heartbeat(self);
            check_drain(self);
            self->delayed_send(self, st.members->options().heartbeat_every, tick_atom::value);
          }
          for (auto& p : st.reps) {
            if (p.placing || p.retired || st.draining || !st.grouped) continue;
            // A placement that failed: try again with whoever is up.
            const bool complete =
                !p.plan.empty() && std::all_of(p.plan.begin(), p.plan.end(), [&](const auto& s) {
                  auto alive = [&](const std::string& n) {
                    const auto* m = st.members->find(n);
                    return m && m->state != cluster::member_state::lost;
                  };
                  return alive(s.node) && std::all_of(s.ranks.begin(), s.ranks.end(), alive);
                });
            if (complete && p.placement_ok) continue;
            // A replica none of whose nodes is up (nor a spare of another's) waits.
            if (st.reps.size() > 1 && replica_usable(self, p.index).empty()) {
              p.ready = false;
              p.plan.clear();
              continue;
            }
            replace(self, p.index);
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
          joined_node_is(name, r.agent->node());
          auto t = st.members->joined(name, steady::now());
          event(self, "node " + name + " " + t.why);
          if (st.auto_place && st.grouped && st.reps.size() == 1 &&
              std::find(st.joined_since.begin(), st.joined_since.end(), name) ==
                  st.joined_since.end())
            st.joined_since.push_back(name);       // the policy looks again once it is measured
          if (st.grouped) adopt_node(self, name);  // a node no replica has yet
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
          if (why.find("must step down") != std::string::npos) step_down(self, name, why);
        },
    };
  };
  auto core = sys.spawn(impl, std::move(cfg), std::move(*prompt), std::move(fe), std::move(enc),
                        std::move(own), std::move(names));
  return caf::actor_cast<frontdoor_actor>(core);
}

}  // namespace troupe::actors
