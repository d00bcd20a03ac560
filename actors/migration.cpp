#include "actors/migration.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "actors/core/migration_phases.hpp"
#include "actors/data_plane.hpp"
#include "actors/encoder.hpp"
#include "actors/head_placement.hpp"
#include "actors/head_status.hpp"
#include "actors/log.hpp"

namespace troupe::actors::head_detail {

namespace {

struct migration {
  migrate_report rep;
  caf::typed_response_promise<migrate_report> rp;
  core::migration_phases phases;  ///< where it is (what `troupe status` shows)
  std::size_t index = 0;
  std::size_t replica = 0;  ///< the stage's replica
  std::uint64_t epoch = 0;
  stage_handles old_h, new_h;
  cluster::stage_slot slot;
  /// Of a tensor-parallel stage: the rank that moves, from node `from`
  /// (slot.node for a whole stage and rank 0).
  int rank = 0;
  std::string from;
  bool rewiring = false;  ///< the group's other ranks were told of the new one
  std::string target, dest_key;
  std::map<std::int64_t, std::int64_t> copied;  ///< sequence -> tokens copied to the new store
  std::int64_t block_size = 16;
  steady::time_point t0, pause_sent;
  bool paused = false;  ///< the scheduler holds its steps for it
  std::int64_t round_bytes = 0;
};
using migration_ptr = std::shared_ptr<migration>;

// What `troupe status` and `troupe migrate`'s progress bar say for the
// phase `m` is in.
std::string phase_text(const migration& m) {
  switch (m.phases.current()) {
    case core::migration_phase::loading:
      return "loading " + m.rep.what + " on " + m.target;
    case core::migration_phase::kv_rounds:
      return "copying KV, round " + std::to_string(m.phases.kv_rounds()) + " (decoding goes on)";
    case core::migration_phase::paused:
    case core::migration_phase::verifying:
    case core::migration_phase::switching:
    case core::migration_phase::dropping:
      return "steps held: the last KV delta, then the switch";
    case core::migration_phase::done:
    case core::migration_phase::failed:
      break;
  }
  return {};
}

// Shows the phase `m` is in (while it runs; once it ended, the status
// shows no migration).
void show_phase(head_ptr self, const migration& m) {
  if (m.phases.finished()) return;
  auto& st = self->state;
  st.migration_phase = phase_text(m);
  st.migration_done = m.phases.progress();
}

// Moves `m` on to phase `to` and shows it. The code below takes only legal
// steps: one the machine refuses is a bug, logged, and the migration goes
// on as before.
void enter(head_ptr self, migration& m, core::migration_phase to) {
  if (auto r = m.phases.advance(to); !r) {
    logging::of("head").error("migrating {}: {}", m.rep.what, r.error().message);
    return;
  }
  show_phase(self, m);
}

void migration_fail(head_ptr self, const migration_ptr& m, const std::string& why) {
  if (m->phases.finished()) return;
  enter(self, *m, core::migration_phase::failed);
  auto& st = self->state;
  auto& pipe = st.reps[m->replica];
  st.migrating = false;
  if (m->paused && pipe.scheduler)
    self->send(pipe.scheduler, resume_atom::value);  // resume as it was
  // The new actors (if any) go; the old ones kept serving.
  if (m->new_h.shard && pipe.epoch == m->epoch) {
    auto it = st.rt.find(m->target);
    if (it != st.rt.end() && it->second.agent && !m->slot.holds(m->target))
      self->request(it->second.agent, st.cfg.node.timeout, drop_stage_atom::value,
                    m->slot.first_layer)
          .then([](std::int32_t) {}, [](caf::error&) {});
  }
  event(self, "migrating " + m->rep.what + " to " + m->target + " failed: " + why, true);
  m->rp.deliver(make_error(error_code::stage_failed, "migration of " + m->rep.what + ": " + why));
  // Some ranks of the group know the new rank, which is gone: the replica
  // is placed again (its requests recompute).
  if (m->rewiring && pipe.epoch == m->epoch)
    replace(self, static_cast<int>(m->replica), "a tensor-parallel rank's move failed");
}

bool migration_stale(head_ptr self, const migration_ptr& m) {
  if (m->phases.finished()) return true;
  if (self->state.reps[m->replica].epoch != m->epoch) {
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
                self->request(m->old_h.kv, timeout, push_kv_atom::value, w.seq, from, m->dest_key)
                    .then(
                        [self, m, w, timeout, one_done, failed, copy, from](kv_export& x) {
                          const auto len = x.length;
                          self->request(m->new_h.kv, timeout, merge_kv_atom::value, std::move(x),
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
  enter(self, *m, core::migration_phase::switching);
  auto& st = self->state;
  auto resume = [self, m] {
    if (migration_stale(self, m)) return;
    auto& st = self->state;
    auto& pipe = st.reps[m->replica];
    // The stage's face (its rank 0) to the scheduler: the new one, or the
    // same when another rank moved. Either way the stage's store now holds
    // only the live sequences' blocks (the scheduler forgets its cached
    // ones), and steps go on.
    const auto& front = m->rank == 0 ? m->new_h : pipe.handles[m->index];
    self->send(pipe.scheduler, reroute_atom::value, static_cast<std::int32_t>(m->index),
               front.shard, front.kv);
    m->rep.pause_ms = ms_since(m->pause_sent);
    m->paused = false;
    // The old actors go; the head's books follow the new ones.
    if (m->rank == 0) {
      pipe.handles[m->index] = m->new_h;
      pipe.plan[m->index].node = m->target;
    } else {
      pipe.rank_handles[m->index][static_cast<std::size_t>(m->rank - 1)] = m->new_h;
      pipe.plan[m->index].ranks[static_cast<std::size_t>(m->rank - 1)] = m->target;
    }
    if (!in_replica(pipe, m->target)) pipe.nodes.push_back(m->target);
    ++st.migrations;
    enter(self, *m, core::migration_phase::dropping);
    auto it = st.rt.find(m->from);
    auto finish = [self, m](bool dropped) {
      auto& st = self->state;
      enter(self, *m, core::migration_phase::done);
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
    self->request(it->second.agent, st.cfg.node.timeout, drop_stage_atom::value,
                  m->slot.first_layer)
        .then([finish](std::int32_t) { finish(true); }, [finish](caf::error&) { finish(false); });
  };
  // What changes before the steps go on, one after another: a new rank's
  // group learns of it (rank 0 of its peers, the rank before it of its
  // ring, the new rank of its own ring's next); a new face is where the
  // stage before forwards.
  using step = std::function<void(std::function<void()>)>;
  auto steps = std::make_shared<std::vector<step>>();
  auto ask = [self, m](node_agent_actor agent, const std::string& what, auto... xs) -> step {
    return [self, m, agent, what, xs...](std::function<void()> next) {
      if (migration_stale(self, m)) return;
      if (!agent) return migration_fail(self, m, what + ": the node is not up");
      m->rewiring = m->rewiring || m->slot.ranks.size() > 0;
      self->request(agent, self->state.cfg.node.timeout, xs...)
          .then([next](bool) { next(); },
                [self, m, what](caf::error& e) {
                  migration_fail(self, m, what + ": " + describe(self->system(), e));
                });
    };
  };
  const auto& pipe = st.reps[m->replica];
  const auto& slot = m->slot;
  const int k = static_cast<int>(slot.ranks.size()) + 1;
  const auto first = static_cast<std::int32_t>(slot.first_layer);
  if (k > 1) {
    // Rank r's node and actors as the group has them now.
    auto node_of = [&](int r) {
      return r == 0 ? slot.node : slot.ranks[static_cast<std::size_t>(r - 1)];
    };
    auto handles_of = [&](int r) {
      return r == 0 ? pipe.handles[m->index]
                    : pipe.rank_handles[m->index][static_cast<std::size_t>(r - 1)];
    };
    auto agent_of = [&](const std::string& n) { return st.rt[n].agent; };
    if (m->rank > 0)
      steps->push_back(ask(agent_of(slot.node), "telling rank 0 on " + slot.node, tp_atom::value,
                           first, static_cast<std::int32_t>(m->rank), m->new_h, m->target));
    const int before = (m->rank + k - 1) % k, after = (m->rank + 1) % k;
    steps->push_back(ask(agent_of(node_of(before)),
                         "the ring of rank " + std::to_string(before) + " on " + node_of(before),
                         tp_atom::value, first, m->new_h, m->target));
    steps->push_back(ask(agent_of(m->target), "the new rank's ring on " + m->target, tp_atom::value,
                         first, handles_of(after), node_of(after)));
  }
  if (m->rank == 0 && m->index > 0) {
    // The stage before forwards to the new face from now on.
    const auto& prev = pipe.plan[m->index - 1];
    steps->push_back(ask(st.rt[prev.node].agent, "re-routing the stage before", relink_atom::value,
                         static_cast<std::int32_t>(prev.first_layer), m->new_h, m->target));
  }
  // Each step's continuation holds the runner while its request is out
  // (a failed step lets it go).
  auto run = std::make_shared<std::function<void(std::size_t)>>();
  *run = [steps, weak = std::weak_ptr(run), resume](std::size_t i) {
    if (i == steps->size()) return resume();
    auto me = weak.lock();
    (*steps)[i]([me, i] { (*me)(i + 1); });
  };
  (*run)(0);
}

// Debugging aid (TROUPE_MIGRATE_VERIFY=1, stage 0 on the head): before the
// switch, every sequence's KV is exported whole from the old and the new
// store to the head and compared byte for byte.
void migration_verify_now(head_ptr self, migration_ptr m);
void migration_pause(head_ptr self, migration_ptr m);
void migration_verify(head_ptr self, migration_ptr m) {
  enter(self, *m, core::migration_phase::verifying);
  auto& st = self->state;
  auto a = st.rt[m->from].agent;
  auto b = st.rt[m->target].agent;
  self->request(a, st.cfg.node.timeout, connect_atom::value, st.reps[m->replica].handles[0],
                st.cfg.node.name)
      .then(
          [self, m, b](bool) {
            auto& st = self->state;
            self->request(b, st.cfg.node.timeout, connect_atom::value,
                          st.reps[m->replica].handles[0], st.cfg.node.name)
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
      self->request(kv, st.cfg.node.timeout, push_kv_atom::value, seq, std::int32_t{0}, head_key)
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
  enter(self, *m, core::migration_phase::paused);
  self->request(st.reps[m->replica].scheduler, st.cfg.node.timeout, pause_atom::value)
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
  enter(self, *m, core::migration_phase::kv_rounds);
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
/// Why node `to` cannot take a migrated actor (not in the manifest, not
/// up), if it cannot.
std::optional<caf::error> target_refusal(const head_state& st, const std::string& to) {
  const auto* mem = st.members->find(to);
  if (!mem)
    return make_error(error_code::invalid_request,
                      "no node '" + to.substr(0, 64) + "' in the manifest");
  if (mem->state != cluster::member_state::up)
    return make_error(error_code::unavailable, "node " + to + " is not up");
  return std::nullopt;
}

caf::result<migrate_report> start_encoder_migration(head_ptr self, const migrate_request& req) {
  auto& st = self->state;
  auto refuse = [](error_code c, const std::string& why) {
    return caf::result<migrate_report>(make_error(c, why));
  };
  if (!st.encoder) return refuse(error_code::invalid_request, "this model has no vision encoder");
  if (auto why = target_refusal(st, req.to)) return caf::result<migrate_report>(std::move(*why));
  const std::string from = st.encoder_where.substr(0, st.encoder_where.find(' '));
  if (from == req.to)
    return refuse(error_code::invalid_request, "the vision encoder already runs on " + req.to);
  if (hosts_encoder_replica(self, req.to))
    return refuse(error_code::invalid_request,
                  "node " + req.to + " runs another replica of the vision encoder");
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
  self->request(target, st.cfg.node.timeout, load_enc_atom::value,
                encoder_order{encoder_kind::vision, data_plane::local().address()})
      .then(
          [self, rp, rep, t0, fail, busy, target](encoder_actor& fresh) mutable {
            auto switch_over = [self, rp, rep, t0, fail, busy](encoder_actor fresh) mutable {
              auto& st = self->state;
              rep->load_ms = ms_since(t0);
              auto old = st.encoder;
              // New images go to the new encoder from now on (no pause: the
              // scheduler only switches where it sends).
              // Wherever it runs, it sends image rows straight to the first
              // stage's process when the scheduler asks: nothing passes here.
              st.encoder = fresh;
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
                std::snprintf(
                    buf, sizeof buf,
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
                    self->request(a, st.cfg.node.timeout, drop_enc_atom::value,
                                  encoder_order{encoder_kind::vision, {}})
                        .then([](std::int32_t) {}, [](caf::error&) {});
                }
                finish();
              };
              // The scheduler switches and drains the old encoder itself (its
              // own encode requests are ordered before its flush), answering
              // once the old one has answered all of them.
              // Every replica's scheduler does so; the old one retires once
              // all have answered.
              const auto schedulers = schedulers_of(self);
              if (schedulers.empty()) return retire();
              auto left = std::make_shared<std::size_t>(schedulers.size());
              for (const auto& sch : schedulers)
                self->request(sch, st.cfg.node.timeout, handover_atom::value, old, st.encoder, true)
                    .then(
                        [retire, left](bool) mutable {
                          if (--*left == 0) retire();
                        },
                        [retire, left](caf::error&) mutable {
                          if (--*left == 0) retire();
                        });
            };
            // The new encoder sends image rows to each replica's first
            // stage's process: its node reaches those first.
            auto& st = self->state;
            const auto firsts = first_stages_away_from(self, rep->to);
            if (firsts.empty()) return switch_over(fresh);
            auto left = std::make_shared<std::size_t>(firsts.size());
            auto failed = std::make_shared<bool>(false);
            for (const auto& f : firsts)
              self->request(target, st.cfg.node.timeout, connect_atom::value, f.first, f.second)
                  .then(
                      [switch_over, fresh, left, failed](bool) mutable {
                        if (--*left == 0 && !*failed) switch_over(fresh);
                      },
                      [self, fail, first = f.second, failed](caf::error& e) mutable {
                        if (*failed) return;
                        *failed = true;
                        fail("connecting it to " + first +
                             " (a first stage): " + describe(self->system(), e));
                      });
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

}  // namespace

caf::result<migrate_report> start_migration(head_ptr self, const migrate_request& req) {
  auto& st = self->state;
  auto refuse = [](error_code c, const std::string& why) {
    return caf::result<migrate_report>(make_error(c, why));
  };
  if (req.replica < 0 || static_cast<std::size_t>(req.replica) >= st.reps.size())
    return refuse(error_code::invalid_request, "no replica " + std::to_string(req.replica) +
                                                   " (the cluster runs " +
                                                   std::to_string(st.reps.size()) + ")");
  auto& pipe = st.reps[static_cast<std::size_t>(req.replica)];
  if (!pipe.ready || pipe.placing || !pipe.scheduler)
    return refuse(error_code::unavailable, "the model is not placed yet");
  if (st.draining) return refuse(error_code::unavailable, "the cluster is shutting down");
  if (st.migrating) return refuse(error_code::unavailable, "another migration is under way");
  if (req.shard == "vision" || req.shard == "encoder") return start_encoder_migration(self, req);
  // A node is one replica's: its agent holds one placement at a time.
  for (const auto& other : st.reps)
    if (other.index != pipe.index && !other.nodes.empty() && in_replica(other, req.to))
      return refuse(error_code::invalid_request,
                    "node " + req.to + " belongs to replica " + std::to_string(other.index));
  const auto& plan = pipe.plan;
  const auto idx = stage_named(plan, req.shard);
  if (!idx)
    return refuse(error_code::invalid_request, "no stage '" + req.shard.substr(0, 64) +
                                                   "' in the placement " + cluster::describe(plan) +
                                                   " (give an index from 0 or a range as printed)");
  if (pipe.handles.size() != plan.size())
    return refuse(error_code::unavailable, "the placement's actors are not known yet");
  if (auto why = target_refusal(st, req.to)) return caf::result<migrate_report>(std::move(*why));
  const auto& slot = plan[*idx];
  const int k = static_cast<int>(slot.ranks.size()) + 1;
  int rank = req.rank;
  if (k == 1) {
    if (rank > 0)
      return refuse(error_code::invalid_request, "stage " + std::to_string(*idx) +
                                                     " is not tensor-parallel: it has no rank " +
                                                     std::to_string(rank));
    rank = 0;
  } else if (rank < 0 || rank >= k) {
    return refuse(error_code::invalid_request,
                  "stage " + std::to_string(*idx) + " is tensor-parallel over " +
                      cluster::describe({slot}) + ": name the rank that moves (--rank 0 to " +
                      std::to_string(k - 1) + ")");
  }
  if (slot.holds(req.to))
    return refuse(error_code::invalid_request,
                  k == 1 ? "stage " + std::to_string(*idx) + " already runs on " + req.to
                         : "node " + req.to + " holds a rank of stage " + std::to_string(*idx) +
                               " already (one rank per node)");
  if (k > 1 && (pipe.rank_handles.size() != plan.size() ||
                pipe.rank_handles[*idx].size() != static_cast<std::size_t>(k - 1)))
    return refuse(error_code::unavailable, "the stage's ranks are not known yet");
  const std::string from = rank == 0 ? slot.node : slot.ranks[static_cast<std::size_t>(rank - 1)];
  auto target = st.rt[req.to].agent;
  auto source = st.rt[from].agent;
  if (!target || !source)
    return refuse(error_code::unavailable, "node " + (!target ? req.to : from) + " is not joined");

  auto m = std::make_shared<migration>();
  m->rp = self->make_response_promise<migrate_report>();
  m->index = *idx;
  m->replica = static_cast<std::size_t>(pipe.index);
  m->epoch = pipe.epoch;
  m->old_h =
      rank == 0 ? pipe.handles[*idx] : pipe.rank_handles[*idx][static_cast<std::size_t>(rank - 1)];
  m->slot = slot;
  m->rank = rank;
  m->from = from;
  m->target = req.to;
  m->block_size = std::max(1, st.cfg.node.kv.block_size);
  m->t0 = steady::now();
  m->rep.what =
      "layers [" + std::to_string(slot.first_layer) + "," + std::to_string(slot.last_layer) + ")" +
      (k > 1 ? " rank " + std::to_string(rank) + " of " + std::to_string(k) : std::string{});
  m->rep.from = from;
  m->rep.to = req.to;
  st.migrating = true;
  show_phase(self, *m);  // loading
  event(self, "migrating " + m->rep.what + " from " + from + " to " + req.to);

  stage_order o;
  o.first_layer = slot.first_layer;
  o.last_layer = slot.last_layer;
  o.embed = *idx == 0;
  o.head = *idx + 1 == plan.size();
  o.epoch = pipe.epoch;
  o.tp_size = k;
  o.tp_rank = rank;
  if (rank == 0 && *idx + 1 < plan.size()) {
    o.has_next = true;
    o.next = pipe.handles[*idx + 1];
    o.next_node = plan[*idx + 1].node;
  }
  if (rank == 0 && k > 1) {
    o.tp_peers = pipe.rank_handles[*idx];
    o.tp_peer_nodes = slot.ranks;
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
            self->request(source, st.cfg.node.timeout, connect_atom::value, m->new_h, m->target)
                .then(
                    [self, m, connected](bool) {
                      auto& st = self->state;
                      // A new first stage gets image rows from the encoder.
                      const auto enc_node = encoder_node(self);
                      auto own = st.rt[enc_node].agent;
                      if (m->index != 0 || m->rank != 0 || !own || m->target == enc_node)
                        return connected();
                      self->request(own, st.cfg.node.timeout, connect_atom::value, m->new_h,
                                    m->target)
                          .then([connected](bool) { connected(); },
                                [self, m, enc_node](caf::error& e) {
                                  migration_fail(self, m,
                                                 "connecting " + enc_node + " (the encoder) to " +
                                                     m->target + ": " +
                                                     describe(self->system(), e));
                                });
                    },
                    [self, m](caf::error& e) {
                      migration_fail(self, m,
                                     "connecting " + m->from + " to " + m->target + ": " +
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

}  // namespace troupe::actors::head_detail
