#include "actors/kv_store_actor.hpp"

#include <algorithm>
#include <cstring>
#include <expected>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/data_plane.hpp"
#include "actors/stage.hpp"

namespace troupe::actors {

namespace {

using kernels::tensor;

/// A staging buffer of a KV move: host memory from a pool of its own,
/// apart from the device's (whose blocks the stages' steps use), given back
/// to the system when the buffer goes (a shared pool would keep a block of
/// every size a move ever staged, and each migration stages other sizes).
std::shared_ptr<kernels::memory_pool> migration_pool() {
  return kernels::memory_pool::create();  // the buffers made from it hold it
}

/// A copy of sequence `seq`'s KV blocks from `from_block` on: parked here
/// for a receiver in this process, or pushed to the process `dest`.
caf::result<kv_export> export_kv(kv_store_actor::pointer self, stage_resources& res,
                                 std::int64_t seq, std::int32_t from_block,
                                 const std::string& dest) {
  // A tensor-parallel rank exports its share of the KV heads: it moves to
  // the same rank of the same group (the head orders nothing else).
  kernels::tensor t;
  kv_export x;
  {
    std::lock_guard lock(res.kv->mtx);
    auto& kv = *res.kv;
    auto it = kv.local.find(seq);
    if (it == kv.local.end())
      return make_error(error_code::not_found,
                        "sequence " + std::to_string(seq) + " is not on " + res.device.name);
    auto snap = kv.cache.export_sequence(it->second, from_block);
    if (!snap) return make_error(error_code::invalid_request, snap.error().message);
    auto e =
        tensor::empty(*migration_pool(), kernels::dtype::u8,
                      {std::max<std::int64_t>(1, static_cast<std::int64_t>(snap->data.size()))});
    if (!e) return make_error(error_code::internal, e.error().message);
    if (!snap->data.empty()) std::memcpy(e->data(), snap->data.data(), snap->data.size());
    t = std::move(*e);
    x.seq = seq;
    x.length = snap->length;
    x.live = snap->live;
    x.ids = snap->ids;
  }
  auto ref = data_plane::local().send(dest == to_string(self->node()) ? std::string{} : dest,
                                      res.device.name, std::move(t));
  if (!ref)
    return make_error(error_code::peer_lost,
                      "KV of sequence " + std::to_string(seq) + ": " + ref.error().message);
  x.data = std::move(*ref);
  return x;
}

/// Takes in an export: a new sequence (from_block 0; with `replace`, one
/// already here is replaced, else refused) or a delta of one already here.
/// Returns the KV bytes taken in.
std::expected<std::int64_t, caf::error> import_kv(stage_resources& res, const kv_export& x,
                                                  std::int32_t from_block, bool replace) {
  auto data = data_plane::local().take(x.data, *migration_pool());
  if (!data)  // a transfer that failed on the way is the link's fault, a bad ref the sender's
    return std::unexpected(
        make_error(data.error().code == kernels::errc::io_error ? error_code::peer_lost
                                                                : error_code::invalid_request,
                   "KV of sequence " + std::to_string(x.seq) + ": " + data.error().message));
  std::lock_guard lock(res.kv->mtx);
  auto& kv = *res.kv;
  const auto& o = kv.cache.options();
  const auto& l0 = kv.cache.layer(0).config;
  models::kv_snapshot snap;
  snap.layers = kv.cache.layers();
  snap.n_kv_heads = l0.n_kv_heads;
  snap.head_dim = l0.head_dim;
  snap.block_size = o.block_size;
  snap.type = o.type;
  snap.window = o.window;
  snap.sinks = o.sinks;
  snap.length = x.length;
  snap.live = x.live;
  snap.ids = x.ids;
  const auto* p = static_cast<const std::byte*>(data->data());
  const auto want = static_cast<std::size_t>(snap.layers) * snap.live.size() * snap.block_bytes();
  if (static_cast<std::size_t>(data->shape().numel()) < want)
    return std::unexpected(
        make_error(error_code::invalid_request,
                   "KV of sequence " + std::to_string(x.seq) + ": too few bytes"));
  snap.data.assign(p, p + want);
  auto failed = [](const kernels::error& e) {
    return std::unexpected(make_error(e.code == kernels::errc::out_of_memory
                                          ? error_code::kv_exhausted
                                          : error_code::invalid_request,
                                      e.message));
  };
  auto it = kv.local.find(x.seq);
  if (from_block == 0 && it != kv.local.end()) {
    if (!replace)
      return std::unexpected(
          make_error(error_code::invalid_request,
                     "sequence " + std::to_string(x.seq) + " is already on " + res.device.name));
    kv.cache.release(it->second);  // a whole copy replaces an older one
    kv.local.erase(it);
    it = kv.local.end();
  }
  if (it == kv.local.end()) {
    if (from_block != 0)
      return std::unexpected(make_error(error_code::invalid_request,
                                        "a KV delta of sequence " + std::to_string(x.seq) +
                                            ", which is not on " + res.device.name));
    if (!x.ids.empty() && kv.local.empty())
      if (auto r = kv.cache.name_blocks(); !r) return failed(r.error());
    auto s = kv.cache.import_sequence(snap);
    if (!s) return failed(s.error());
    kv.local.emplace(x.seq, *s);
  } else if (auto r = kv.cache.import_tail(it->second, snap, from_block); !r) {
    return failed(r.error());
  }
  return static_cast<std::int64_t>(want);
}

}  // namespace

kv_store_actor spawn_kv_store(caf::actor_system& sys, std::shared_ptr<stage_resources> res) {
  auto impl = [](kv_store_actor::pointer self,
                 std::shared_ptr<stage_resources> res) -> kv_store_actor::behavior_type {
    (void)self;
    pin_current_thread(res->device.cores);
    return {
        [=](usage_atom) {
          std::lock_guard lock(res->kv->mtx);
          const auto& kv = *res->kv;
          const auto u = kv.cache.usage();
          kv_usage_info info;
          info.device = res->device.name;
          info.block_size = kv.cache.options().block_size;
          info.total_blocks = u.total_blocks;
          info.free_blocks = u.free_blocks;
          info.sequences = u.sequences;
          info.tokens = u.tokens;
          info.slot_bytes = static_cast<std::int64_t>(kv.cache.slot_bytes());
          if (kv.tiers) {
            info.host_slots = kv.tiers->host_slots();
            info.disk_slots = kv.tiers->disk_slots();
            info.tier_moves = kv.tiers->moves();
            info.tier_bytes = kv.tiers->bytes_moved();
          }
          return info;
        },
        [=](free_atom, const std::vector<std::int64_t>& seqs) -> std::int64_t {
          if (res->tp)  // the group's other ranks hold the other KV heads of these sequences
            for (auto& p : res->tp->peer_stores()) caf::anon_send(p, free_atom::value, seqs);
          std::lock_guard lock(res->kv->mtx);
          auto& kv = *res->kv;
          const auto before = kv.cache.free_blocks();
          for (auto s : seqs) {
            auto it = kv.local.find(s);
            if (it == kv.local.end()) continue;
            kv.cache.release(it->second);
            kv.local.erase(it);
          }
          return kv.cache.free_blocks() - before;
        },
        [=](export_atom, std::int64_t seq) { return export_kv(self, *res, seq, 0, {}); },
        [=](discard_atom, const tensor_ref& ref) {
          (void)data_plane::local().take(ref, *migration_pool());  // received, then dropped
        },
        [=](import_atom, const kv_export& x) -> caf::result<std::int64_t> {
          auto r = import_kv(*res, x, 0, false);
          if (!r) return std::move(r.error());
          return x.length;
        },
        [=](list_atom) {
          std::lock_guard lock(res->kv->mtx);
          std::vector<std::int64_t> out;
          for (const auto& [seq, local] : res->kv->local) {
            out.push_back(seq);
            out.push_back(res->kv->cache.length(local));
          }
          return out;
        },
        [=](push_kv_atom, std::int64_t seq, std::int32_t from_block, const std::string& dest) {
          return export_kv(self, *res, seq, from_block, dest);
        },
        [=](merge_kv_atom, const kv_export& x,
            std::int32_t from_block) -> caf::result<std::int64_t> {
          auto r = import_kv(*res, x, from_block, true);
          if (!r) return std::move(r.error());
          return *r;
        },
        [=](clear_atom) -> std::int64_t {
          if (res->tp)
            for (auto& p : res->tp->peer_stores()) caf::anon_send(p, clear_atom::value);
          std::lock_guard lock(res->kv->mtx);
          auto& kv = *res->kv;
          const auto n = static_cast<std::int64_t>(kv.local.size());
          for (auto& [s, l] : kv.local) kv.cache.release(l);
          kv.local.clear();
          return n;
        },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(res));
}

}  // namespace troupe::actors
