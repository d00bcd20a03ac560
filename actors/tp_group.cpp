#include "actors/tp_group.hpp"

#include <span>
#include <vector>

#include "actors/data_plane.hpp"
#include "actors/stage.hpp"

namespace troupe::actors {

namespace {

using kernels::errc;
using kernels::tensor;

}  // namespace

models::tensor_split tp_group::split_of(const std::shared_ptr<tp_group>& g) {
  models::tensor_split s;
  s.rank = g->rank;
  s.size = g->size;
  s.all_reduce = [g](tensor& t) -> kernels::result<void> {
    if (!g->ring.engine)
      return kernels::make_error(errc::internal, "the tensor-parallel ring is not connected");
    if (!t.is_contiguous() || t.type() != kernels::dtype::f32)
      return kernels::make_error(errc::internal,
                                 "all-reduce of a non-contiguous or non-f32 tensor");
    // The collective's id: the step (26 bits) and the all-reduce's number
    // within it (12 bits), the same on every rank.
    const std::uint64_t id =
        ((g->step & ((std::uint64_t{1} << 26) - 1)) << 12) | (g->calls++ & 0xfffu);
    const auto n = static_cast<std::size_t>(t.shape().numel());
    if (kernels::host_readable(t)) {
      auto r = transport::ring_allreduce_sum(g->ring, t.data_as<float>(), n, id);
      if (!r)
        return kernels::make_error(r.error().code,
                                   "tensor-parallel all-reduce: " + r.error().message);
      return {};
    }
    // A device the ring cannot read (a GPU, with Debian's UCX): the sum
    // goes through host memory and back.
    std::vector<float> host(n);
    if (auto c = kernels::copy_to_host(t, std::as_writable_bytes(std::span<float>(host))); !c)
      return std::unexpected(c.error());
    auto r = transport::ring_allreduce_sum(g->ring, host.data(), n, id);
    if (!r)
      return kernels::make_error(r.error().code,
                                 "tensor-parallel all-reduce: " + r.error().message);
    return kernels::pool_of(t)->copy_from_host(t.data(), host.data(), n * sizeof(float));
  };
  return s;
}

namespace stage_detail {

void tp_join::settle(caf::error e) {
  if (settled) return;
  settled = true;
  rp.deliver(std::move(e));
  rp = {};
}

void tp_join::maybe_deliver() {
  if (settled || !own || pending > 0) return;
  for (const auto& [rank, sampled] : peers) {
    if (!compare_sampled) break;
    if (sampled != own->sampled) {
      settle(make_error(error_code::stage_failed,
                        "tensor-parallel rank " + std::to_string(rank) +
                            " sampled other tokens than rank 0 (the ranks diverged)"));
      return;
    }
  }
  settled = true;
  rp.deliver(std::move(*own));
  rp = {};
}

void tp_joins::forget_if_done(const std::shared_ptr<tp_join>& j) {
  if (j->settled && j->pending == 0) open.erase(j->id);
}

tp_forwarder::behavior_type forwarder_impl(tp_forwarder::pointer self, shard_actor peer) {
  return {
      [=](step_atom, step_batch& b) -> caf::result<step_output> {
        auto rp = self->make_response_promise<step_output>();
        self->request(peer, caf::infinite, step_atom::value, std::move(b))
            .then([rp](step_output& o) mutable { rp.deliver(std::move(o)); },
                  [rp](caf::error& e) mutable { rp.deliver(std::move(e)); });
        return rp;
      },
  };
}

tp_forwarder::behavior_type peer_forwarder_impl(tp_forwarder::pointer self,
                                                std::shared_ptr<tp_group> g, std::size_t p) {
  return {
      [=](step_atom, step_batch& b) -> caf::result<step_output> {
        auto rp = self->make_response_promise<step_output>();
        auto peer = g->peer_shard(p);
        if (!peer)
          return make_error(error_code::stage_failed,
                            "tensor-parallel rank " + std::to_string(p + 1) + " is not known");
        self->request(peer, caf::infinite, step_atom::value, std::move(b))
            .then([rp](step_output& o) mutable { rp.deliver(std::move(o)); },
                  [rp](caf::error& e) mutable { rp.deliver(std::move(e)); });
        return rp;
      },
  };
}

kernels::result<std::shared_ptr<tp_join>> forward_step(
    shard_actor::pointer self, tp_joins& joins, stage_resources& res, step_batch& b,
    const std::vector<tp_forwarder>& forwarders) {
  auto& g = *res.tp;
  auto j = std::make_shared<tp_join>();
  j->compare_sampled = res.model->range().head;
  const auto keys = g.peer_addresses();
  std::vector<step_batch> copies(forwarders.size(), b);
  for (auto& c : copies) c.return_logits = false;
  auto& dp = data_plane::local();
  // Host floats (the step's input, read by the model through step_input).
  static const auto host = kernels::memory_pool::create();
  // Rank 0 takes `ref` in, pushes it to every other rank's process (one
  // buffer, read-only) and parks it for itself; `dest(p)` is copy p's.
  auto share = [&](tensor_ref& ref, auto dest, const char* what) -> kernels::result<void> {
    auto t = dp.take(ref, res.dev->memory().host_accessible() ? res.dev->memory() : *host);
    if (!t) return std::unexpected(t.error());
    for (std::size_t p = 0; p < copies.size(); ++p) {
      auto r = dp.push(keys[p], res.device.name, *t);
      if (!r)
        return kernels::make_error(r.error().code,
                                   std::string(what) + " for tensor-parallel rank " +
                                       std::to_string(p + 1) + ": " + r.error().message);
      dest(p) = std::move(*r);
    }
    ref = dp.park(res.device.name, std::move(*t));
    return {};
  };
  if (!b.hidden.empty())
    if (auto r = share(
            b.hidden, [&](std::size_t p) -> tensor_ref& { return copies[p].hidden; },
            "the previous stage's activations");
        !r)
      return std::unexpected(r.error());
  for (std::size_t i = 0; i < b.seqs.size(); ++i) {
    auto& ref = b.seqs[i].embeddings;
    if (ref.empty()) continue;
    if (auto r = share(
            ref, [&](std::size_t p) -> tensor_ref& { return copies[p].seqs[i].embeddings; },
            "image embeddings");
        !r)
      return std::unexpected(r.error());
  }
  j->rp = self->make_response_promise<step_output>();
  j->id = joins.next_id++;
  joins.open.emplace(j->id, j);
  std::weak_ptr<tp_join> wj = j;
  // The handlers run in `self` while it lives, so `joins` (in its state) is
  // there whenever they run.
  auto* js = &joins;
  for (std::size_t p = 0; p < copies.size(); ++p) {
    const int rank = static_cast<int>(p) + 1;
    ++j->pending;
    self->request(forwarders[p], caf::infinite, step_atom::value, std::move(copies[p]))
        .then(
            [wj, js, rank](step_output& o) {
              auto j = wj.lock();
              if (!j) return;
              --j->pending;
              j->peers.emplace_back(rank, std::move(o.sampled));
              j->maybe_deliver();
              js->forget_if_done(j);
            },
            [self, wj, js, rank](caf::error& e) {
              auto j = wj.lock();
              if (!j) return;
              --j->pending;
              j->settle(make_error(error_code::stage_failed, "tensor-parallel rank " +
                                                                 std::to_string(rank) + ": " +
                                                                 describe(self->system(), e)));
              js->forget_if_done(j);
            });
  }
  return j;
}

}  // namespace stage_detail

}  // namespace troupe::actors
