#include "actors/shard_actor.hpp"

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/clock.hpp"
#include "actors/data_plane.hpp"
#include "actors/stage.hpp"
#include "actors/stage_compute.hpp"
#include "actors/tp_group.hpp"

namespace troupe::actors {

namespace {

using kernels::errc;
using stage_detail::forward_step;
using stage_detail::forwarder_impl;
using stage_detail::peer_forwarder_impl;
using stage_detail::tp_forwarder;
using stage_detail::tp_join;
using stage_detail::tp_joins;

struct shard_state {
  std::uint64_t steps = 0;
  /// Rank 0 of a tensor-parallel group: the steps waiting for other ranks.
  /// Their response promises hold this actor; keeping them here (and only
  /// weak references in the response handlers) lets them go with the state
  /// when the actor stops with replies outstanding.
  tp_joins joins;
  shard_actor next;  ///< the following stage (invalid on the last); live migration re-points it
  /// Rank 0 of a tensor-parallel stage without the LM head: passes its
  /// steps to `next` (made at the first; a re-point makes a new one).
  tp_forwarder next_forwarder;
};

/// The step's answer: directly, or (delegated) through rank 0's join of
/// its group.
caf::result<step_output> answer(shard_actor::stateful_pointer<shard_state> self,
                                const std::shared_ptr<tp_join>& j, caf::error e) {
  if (!j) return e;
  j->settle(std::move(e));
  self->state.joins.forget_if_done(j);
  return caf::delegated<step_output>{};
}
caf::result<step_output> answer(shard_actor::stateful_pointer<shard_state> self,
                                const std::shared_ptr<tp_join>& j, step_output o) {
  if (!j) return o;
  j->own = std::move(o);
  j->maybe_deliver();
  self->state.joins.forget_if_done(j);
  return caf::delegated<step_output>{};
}

/// The step's remote-tier moves, this stage's side: `in` gets the rows of
/// its layers of each block the step brings back, fetched from the vault
/// now (the step waits for them); `puts` are the blocks it copies out.
struct remote_plan {
  vault_blocks gets, puts;
  bool any = false;
};

remote_plan remote_moves_of(const step_batch& b, const models::layer_range& r) {
  remote_plan p;
  constexpr auto remote = static_cast<std::uint8_t>(models::kv_tier::remote);
  for (const auto& m : b.moves) {
    if (m.from == remote) {
      p.gets.slots.push_back(m.from_index);
      p.gets.names.push_back(m.name);
    } else if (m.to == remote) {
      p.puts.slots.push_back(m.to_index);
      p.puts.names.push_back(m.name);
    } else {
      continue;
    }
    p.any = true;
  }
  for (auto* v : {&p.gets, &p.puts}) {
    v->first_layer = r.first;
    v->layers = r.last - r.first;
  }
  return p;
}

/// Fetches `p.gets` from the vault into `rows` (blocking: the shard is a
/// detached actor, and the step cannot compute before they are in).
std::string fetch_remote(caf::actor_system& sys, const caf::node_id& self_node, const step_batch& b,
                         remote_plan& p, kernels::tensor& rows) {
  if (!b.vault) return "the step restores KV blocks from a remote store it does not name";
  auto& dp = data_plane::local();
  const auto key = data_plane_key(self_node, b.vault->node());
  if (!key.empty() && !dp.reachable(key))
    if (auto c = dp.connect(key, b.vault_address); !c)
      return "the data plane to the KV store: " + c.error().message;
  p.gets.dest = to_string(self_node);
  p.gets.dest_address = dp.address();
  std::string err;
  caf::scoped_actor s{sys};
  s->request(b.vault, std::chrono::seconds(60), vault_get_atom::value, p.gets)
      .receive(
          [&](tensor_ref& ref) {
            static const auto pool = kernels::memory_pool::create();
            auto t = dp.take(ref, *pool);
            if (!t)
              err = "KV rows from the remote store: " + t.error().message;
            else
              rows = std::move(*t);
          },
          [&](caf::error& e) { err = "the remote KV store: " + describe(sys, e); });
  return err;
}

/// Puts the rows a step copied out into the vault (asynchronously: the
/// vault confirms to the scheduler once it holds every layer).
void put_remote(shard_actor::stateful_pointer<shard_state> self, const stage_resources& res,
                const step_batch& b, remote_plan& p, kernels::tensor rows) {
  if (p.puts.slots.empty() || rows.shape().numel() == 0 || !b.vault) return;
  auto& dp = data_plane::local();
  const auto key = data_plane_key(self->node(), b.vault->node());
  if (!key.empty() && !dp.reachable(key))
    if (auto c = dp.connect(key, b.vault_address); !c) return;  // the copies stay unconfirmed
  auto ref = dp.send(key, res.device.name, std::move(rows));
  if (!ref) return;
  p.puts.data = std::move(*ref);
  self->send(b.vault, vault_put_atom::value, std::move(p.puts));
}

}  // namespace

shard_actor spawn_shard(caf::actor_system& sys, std::shared_ptr<stage_resources> res,
                        shard_actor next) {
  auto impl = [](shard_actor::stateful_pointer<shard_state> self,
                 std::shared_ptr<stage_resources> res,
                 shard_actor next) -> shard_actor::behavior_type {
    pin_current_thread(res->device.cores);
    self->state.next = next;
    std::vector<tp_forwarder> forwarders;
    // Every forwarder this shard made goes with it.
    auto made = std::make_shared<std::vector<tp_forwarder>>();
    if (res->tp) {
      const auto peers = res->tp->peer_addresses().size();
      for (std::size_t p = 0; p < peers; ++p)
        forwarders.push_back(self->system().spawn(peer_forwarder_impl, res->tp, p));
      *made = forwarders;
      self->attach_functor([made] {
        for (const auto& f : *made) caf::anon_send_exit(f, caf::exit_reason::user_shutdown);
      });
    }
    std::uint64_t generation = 0;
    {
      std::lock_guard lock(res->kv->mtx);
      generation = res->kv->generation;
    }
    return {
        [=](step_atom, step_batch& b) -> caf::result<step_output> {
          const auto t0 = std::chrono::steady_clock::now();
          // The step ends with an error: its image rows are dropped, and the
          // message names this stage.
          auto end_with = [&](error_code code, const std::string& why) {
            for (auto& w : b.seqs) data_plane::local().drop(w.embeddings);
            return make_error(code, res->device.name + " layers [" +
                                        std::to_string(res->model->range().first) + ", " +
                                        std::to_string(res->model->range().last) + "): " + why);
          };
          auto fail = [&](const std::string& why) {
            return end_with(error_code::stage_failed, why);
          };
          // A peer process is gone: the step may run again on a restored
          // pipeline (the scheduler waits for it), unlike a failed step.
          auto lost = [&](const std::string& why) { return end_with(error_code::peer_lost, why); };
          if (auto c = check_multi_step(*res, b); !c) return fail(c.error().message);
          // Rank 0 of a tensor-parallel group: the other ranks run the same
          // step at the same time (their all-reduces meet ours).
          std::shared_ptr<tp_join> join;
          if (res->tp && !forwarders.empty()) {
            auto j = forward_step(self, self->state.joins, *res, b, forwarders);
            if (!j) return fail(j.error().message);
            join = std::move(*j);
          }
          std::unique_lock device_lock(
              res->dev->run_lock());  // the device's team is ours until the step is done
          if (res->tp) {
            res->tp->step = b.step;
            res->tp->calls = 0;
          }
          // Copies to and from the remote KV tier: this stage's layers.
          auto rp = remote_moves_of(b, res->model->range());
          remote_rows rr;
          kernels::tensor fetched, copied;
          if (rp.any) {
            if (res->tp && res->tp->size > 1)
              return answer(self, join,
                            fail("a remote KV tier with a tensor-parallel stage is not "
                                 "supported yet"));
            if (!rp.gets.slots.empty()) {
              if (auto e = fetch_remote(self->system(), self->node(), b, rp, fetched); !e.empty())
                return answer(self, join, fail(e));
              rr.in = std::span(static_cast<const std::byte*>(fetched.data()),
                                static_cast<std::size_t>(fetched.shape().numel()));
            }
            if (!rp.puts.slots.empty()) {
              // The rows go out as they are read: one buffer, no copy of it.
              static const auto pool = kernels::memory_pool::create();
              auto t =
                  kernels::tensor::empty(*pool, kernels::dtype::u8,
                                         {std::ssize(rp.puts.slots) *
                                          static_cast<std::int64_t>(res->kv->cache.slot_bytes())});
              if (!t) return answer(self, join, fail(t.error().message));
              copied = std::move(*t);
              rr.out = std::span(static_cast<std::byte*>(copied.data()),
                                 static_cast<std::size_t>(copied.shape().numel()));
            }
          }
          auto out = run_stage(*res, b, generation, rp.any ? &rr : nullptr);
          if (out && rp.any) put_remote(self, *res, b, rp, std::move(copied));
          ++self->state.steps;
          // The previous stage's process is gone, or this shard was replaced.
          if (!out &&
              (out.error().code == errc::io_error || out.error().code == errc::device_unavailable))
            return answer(self, join, lost(out.error().message));
          if (!out) return answer(self, join, fail(out.error().message));
          if (res->model->range().head) {
            step_output o;
            o.step = b.step;
            if (auto s = sample_and_continue(*res, b, *out, generation, o); !s)
              return answer(self, join, fail(s.error().message));
            if (b.return_logits)
              o.logits = data_plane::local().park(res->device.name, std::move(*out));
            const double own = ms_between(t0, steady::now());
            o.compute_ms = b.compute_ms + own;
            o.stage_ms = std::move(b.stage_ms);
            o.stage_ms.push_back(own);
            return answer(self, join, std::move(o));
          }
          const double own = ms_between(t0, steady::now());
          if (res->tp && res->tp->rank > 0) {
            // Another rank of a stage without the LM head: rank 0 passes the
            // (all-reduced, identical) activations on; this says it ran.
            step_output o;
            o.step = b.step;
            o.compute_ms = own;
            return o;
          }
          b.compute_ms += own;
          b.stage_ms.push_back(own);
          const auto& next = self->state.next;
          if (!next)
            return answer(self, join,
                          fail("a stage without the head has no next stage to forward to"));
          // In another process, the activations go now, over the transfer
          // engine, while this message travels.
          auto ref = data_plane::local().send(data_plane_key(self->node(), next->node()),
                                              res->device.name, std::move(*out));
          if (!ref)
            return answer(self, join,
                          lost("activations to the next stage: " + ref.error().message));
          b.hidden = std::move(*ref);
          for (auto& w : b.seqs) w.embeddings = {};
          if (!join) return self->delegate(next, step_atom::value, std::move(b));
          // Rank 0 of a tensor-parallel stage: the step is answered with the
          // next stage's answer once the other ranks have run it too.
          auto& fwd = self->state.next_forwarder;
          if (!fwd) {
            fwd = self->system().spawn(forwarder_impl, next);
            made->push_back(fwd);
          }
          std::weak_ptr<tp_join> wj = join;
          self->request(fwd, caf::infinite, step_atom::value, std::move(b))
              .then(
                  [self, wj](step_output& o) {
                    auto j = wj.lock();
                    if (!j) return;
                    j->own = std::move(o);
                    j->maybe_deliver();
                    self->state.joins.forget_if_done(j);
                  },
                  [self, wj](caf::error& e) {
                    auto j = wj.lock();
                    if (!j) return;
                    j->settle(std::move(e));
                    self->state.joins.forget_if_done(j);
                  });
          return caf::delegated<step_output>{};
        },
        [=](info_atom) {
          const auto r = res->model->range();
          const auto& c = res->model->config();
          return shard_info{res->device.name, r.first,       r.last,      r.embed,
                            r.head,           c.hidden_size, c.vocab_size};
        },
        [](version_atom) { return protocol_version; },
        [=](forward_atom, caf::strong_actor_ptr p) -> caf::result<bool> {
          if (res->model->range().head)
            return make_error(error_code::invalid_request, "the last stage forwards to no one");
          auto n = caf::actor_cast<shard_actor>(p);
          if (!n) return make_error(error_code::invalid_request, "route to an invalid shard");
          self->state.next = std::move(n);
          if (auto& fwd = self->state.next_forwarder) {
            caf::anon_send_exit(fwd, caf::exit_reason::user_shutdown);
            fwd = tp_forwarder{};
          }
          return true;
        },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(res), std::move(next));
}

}  // namespace troupe::actors
