#include "actors/stage.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <optional>

#include "actors/clock.hpp"
#include "actors/data_plane.hpp"
#include "actors/tensor_registry.hpp"
#include "models/llava_config.hpp"

namespace troupe::actors {

namespace {

using kernels::errc;
using kernels::tensor;

/// The decoder config of a LLaMA/LLaVA folder or a GGUF file.
kernels::result<models::llama_config> text_config(const models::weight_source& src,
                                                  const std::string& path) {
  if (src.is_gguf()) return models::llama_config_from_gguf(*src.gguf());
  const std::string dir = std::filesystem::is_directory(path)
                              ? path
                              : std::filesystem::path(path).parent_path().string();
  auto text = models::read_text_file(dir + "/config.json");
  if (!text) return std::unexpected(text.error());
  if (models::is_llava_config(*text)) {
    auto cfg = models::parse_llava_config(*text, dir + "/config.json");
    if (!cfg) return std::unexpected(cfg.error());
    return cfg->text;
  }
  return models::load_llama_config(dir + "/config.json");
}

struct tp_join;

/// Staging buffers of KV moves: a pool of their own, apart from the
/// device's (whose blocks the stages' steps use).
kernels::memory_pool& migration_pool() {
  static auto pool = kernels::memory_pool::create();
  return *pool;
}

struct shard_state {
  std::uint64_t steps = 0;
  /// Rank 0 of a tensor-parallel group: the steps waiting for other ranks.
  /// Their response promises hold this actor; keeping them here (and only
  /// weak references in the response handlers) lets them go with the state
  /// when the actor stops with replies outstanding.
  std::unordered_map<std::uint64_t, std::shared_ptr<tp_join>> joins;
  std::uint64_t next_join = 0;
  shard_actor next;  ///< the following stage (invalid on the last); live migration re-points it
};

/// Runs this stage's part of a step; returns the activations (or logits on
/// the last stage).
kernels::result<tensor> run_stage(stage_resources& res, step_batch& b, std::uint64_t generation) {
  const auto& model = *res.model;
  const auto range = model.range();
  std::vector<models::step_input> inputs(b.seqs.size());
  std::vector<tensor> embeds(b.seqs.size());
  tensor x;
  if (!range.embed) {
    if (b.hidden.empty())
      return kernels::make_error(errc::invalid_argument, "a middle stage got no activations");
    auto h = data_plane::local().take(b.hidden, res.ctx->memory());
    if (!h)
      return kernels::make_error(errc::io_error,
                                 "activations from the previous stage: " + h.error().message);
    x = std::move(*h);
  }
  std::lock_guard lock(res.kv->mtx);
  auto& kv = *res.kv;
  if (kv.generation != generation)
    // The node restarted the pipeline while this step waited: the scheduler
    // resets onto the new one and runs it again there (not a failed step).
    return kernels::make_error(errc::device_unavailable,
                               "this shard was replaced by a restarted pipeline");
  // Resolve sequences: a sequence starts with start == 0; every later step
  // must agree with the cache on where it continues.
  std::vector<std::int64_t> created;
  auto undo = [&] {
    for (auto s : created) {
      kv.cache.release(kv.local[s]);
      kv.local.erase(s);
    }
  };
  for (std::size_t i = 0; i < b.seqs.size(); ++i) {
    auto& w = b.seqs[i];
    auto it = kv.local.find(w.seq);
    if (it == kv.local.end()) {
      if (w.start != 0) {
        undo();
        return kernels::make_error(errc::invalid_argument,
                                   "sequence " + std::to_string(w.seq) +
                                       " is not on this stage but the step continues it at " +
                                       std::to_string(w.start));
      }
      it = kv.local.emplace(w.seq, kv.cache.add_sequence()).first;
      created.push_back(w.seq);
    } else if (kv.cache.length(it->second) != w.start) {
      undo();
      return kernels::make_error(errc::invalid_argument,
                                 "sequence " + std::to_string(w.seq) + " holds " +
                                     std::to_string(kv.cache.length(it->second)) +
                                     " tokens on this stage but the step continues it at " +
                                     std::to_string(w.start));
    }
    inputs[i].seq = it->second;
    inputs[i].tokens = w.tokens;
    inputs[i].all_logits = w.all_logits;
    if (!w.embeddings.empty()) {
      auto e = data_plane::local().take(w.embeddings, res.ctx->memory());
      if (!e) {
        undo();
        return std::unexpected(e.error());
      }
      embeds[i] = std::move(*e);
      inputs[i].embed_token = w.embed_token;
      inputs[i].embeddings = std::span<const float>(
          embeds[i].data_as<float>(), static_cast<std::size_t>(embeds[i].shape().numel()));
    }
  }
  auto& ctx = *res.ctx;
  if (range.embed) {
    auto e = model.embed(ctx, inputs);
    if (!e) {
      undo();
      return std::unexpected(e.error());
    }
    x = std::move(*e);
  }
  if (auto r = model.run_layers(ctx, kv.cache, inputs, x, res.attention); !r) {
    undo();
    return std::unexpected(r.error());
  }
  if (range.head) return model.head(ctx, inputs, x);
  return x;
}

/// Checks a multi-step batch: only a whole-model stage runs one, and every
/// sequence must sample from a one-token input without embeddings.
kernels::result<void> check_multi_step(const stage_resources& res, const step_batch& b) {
  if (b.decode_steps <= 1) return {};
  const auto range = res.model->range();
  if (!range.embed || !range.head)
    return kernels::make_error(errc::invalid_argument,
                               "multi-step decode needs a stage that holds the whole model");
  for (const auto& w : b.seqs)
    if (!w.sample || w.tokens.size() != 1 || !w.embeddings.empty() || w.all_logits ||
        w.sampling.max_new < 1)
      return kernels::make_error(errc::invalid_argument,
                                 "multi-step decode of sequence " + std::to_string(w.seq) +
                                     ": every sequence must sample from a one-token input");
  return {};
}

/// On the last stage: samples the sequences that ask for it from `logits`
/// (the first pass), then, for a multi-step batch, runs the further passes,
/// each feeding the tokens just sampled back in, until every sequence has
/// its max_new tokens or sampled a stop token. Fills `o.sampled`.
kernels::result<void> sample_and_continue(stage_resources& res, step_batch& b, const tensor& logits,
                                          std::uint64_t generation, step_output& o) {
  const auto vocab = res.model->config().vocab_size;
  const auto n = b.seqs.size();
  o.sampled.assign(n, {});
  std::vector<std::optional<models::sampler>> samplers(n);
  // Samples sequence idx[k] from row rows[k] of `l`, the sequences in
  // parallel on the stage's workers (each sampler and output is its own).
  std::vector<std::size_t> idx;
  std::vector<std::int64_t> rows;
  auto sample_all = [&](const tensor& l) {
    res.ctx->pool().parallel_for(
        static_cast<std::int64_t>(idx.size()), 1, [&](std::int64_t lo, std::int64_t hi, int) {
          for (auto k = lo; k < hi; ++k) {
            const auto i = idx[static_cast<std::size_t>(k)];
            auto& w = b.seqs[i];
            const std::span<const float> r(l.row_as<float>(rows[static_cast<std::size_t>(k)]),
                                           static_cast<std::size_t>(vocab));
            const auto tok = static_cast<std::int32_t>(samplers[i]->sample(r, w.sampling.history));
            o.sampled[i].push_back(tok);
            if (!w.sampling.history.empty()) w.sampling.history.push_back(tok);
          }
        });
  };
  std::int64_t row = 0;
  for (std::size_t i = 0; i < n; ++i) {
    auto& w = b.seqs[i];
    row += w.all_logits ? static_cast<std::int64_t>(w.tokens.size()) : 1;
    if (!w.sample) continue;
    auto s = models::sampler::resume(w.sampling.params, w.sampling.draws);
    if (!s) return std::unexpected(s.error());
    samplers[i].emplace(std::move(*s));
    idx.push_back(i);
    rows.push_back(row - 1);
  }
  if (row != logits.shape()[0])
    return kernels::make_error(errc::internal, "the head returned " +
                                                   std::to_string(logits.shape()[0]) +
                                                   " logits rows for " + std::to_string(row));
  sample_all(logits);
  auto stopped = [&](std::size_t i) {
    const auto& ids = b.seqs[i].sampling.params.stop_token_ids;
    return std::find(ids.begin(), ids.end(), o.sampled[i].back()) != ids.end();
  };
  for (std::int32_t pass = 1; pass < b.decode_steps; ++pass) {
    step_batch nb;
    nb.step = b.step;
    idx.clear();
    rows.clear();
    for (std::size_t i = 0; i < n; ++i) {
      const auto& w = b.seqs[i];
      const auto have = static_cast<std::int64_t>(o.sampled[i].size());
      if (have >= w.sampling.max_new || stopped(i)) continue;
      seq_work x;
      x.seq = w.seq;
      x.start = w.start + static_cast<std::int64_t>(w.tokens.size()) + have - 1;
      x.tokens = {o.sampled[i].back()};
      nb.seqs.push_back(std::move(x));
      rows.push_back(static_cast<std::int64_t>(idx.size()));
      idx.push_back(i);
    }
    if (idx.empty()) break;
    auto out = run_stage(res, nb, generation);
    if (!out) return std::unexpected(out.error());
    sample_all(*out);
    ++o.passes;
  }
  return {};
}

/// Rank 0's view of one step of its tensor-parallel group: its own
/// output and the other ranks' answers; the step is answered once all are
/// in (or at the first error).
struct tp_join {
  std::uint64_t id = 0;
  caf::typed_response_promise<step_output> rp;
  std::size_t pending = 0;
  std::optional<step_output> own;
  std::vector<std::pair<int, std::vector<std::vector<std::int32_t>>>> peers;  // rank, sampled
  bool settled = false;

  void settle(caf::error e) {
    if (settled) return;
    settled = true;
    rp.deliver(std::move(e));
    rp = {};
  }
  void maybe_deliver() {
    if (settled || !own || pending > 0) return;
    for (const auto& [rank, sampled] : peers) {
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
};

/// Forgets a join that needs nothing more.
void forget_if_done(shard_actor::stateful_pointer<shard_state> self,
                    const std::shared_ptr<tp_join>& j) {
  if (j->settled && j->pending == 0) self->state.joins.erase(j->id);
}

/// Passes one step to another rank's shard and its answer back. Rank 0's
/// shard talks to the other ranks through these (event-based, not detached)
/// actors rather than itself: when the detached shard sent its requests to
/// the other node itself, about 1 run in 10 of `troupe bench --tp-peer`
/// left it with one strong reference after it stopped (found with a
/// refcount dump), and CAF's shutdown waits for every detached actor's
/// last reference, so the process never exited. With these in between, 25
/// runs of 25 exited.
using tp_forwarder = caf::typed_actor<caf::replies_to<step_atom, step_batch>::with<step_output>>;

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

/// Sends the step to the other ranks of rank 0's group (their copies
/// without the logits; image embeddings pushed to each rank's process).
kernels::result<std::shared_ptr<tp_join>> forward_step(
    shard_actor::stateful_pointer<shard_state> self, stage_resources& res, step_batch& b,
    const std::vector<tp_forwarder>& forwarders) {
  auto& g = *res.tp;
  const auto range = res.model->range();
  if (!range.embed || !range.head)
    return kernels::make_error(errc::invalid_argument,
                               "a tensor-parallel group must hold the whole model");
  auto j = std::make_shared<tp_join>();
  std::vector<step_batch> copies(g.peer_shards.size(), b);
  for (auto& c : copies) c.return_logits = false;
  auto& dp = data_plane::local();
  for (std::size_t i = 0; i < b.seqs.size(); ++i) {
    auto& ref = b.seqs[i].embeddings;
    if (ref.empty()) continue;
    auto t = dp.take(ref, res.ctx->memory());
    if (!t) return std::unexpected(t.error());
    for (std::size_t p = 0; p < copies.size(); ++p) {
      auto r = dp.push(g.peer_keys[p], res.device.name, *t);  // shares the buffer; read-only
      if (!r)
        return kernels::make_error(r.error().code, "image embeddings for tensor-parallel rank " +
                                                       std::to_string(p + 1) + ": " +
                                                       r.error().message);
      copies[p].seqs[i].embeddings = std::move(*r);
    }
    ref = dp.park(res.device.name, std::move(*t));
  }
  j->rp = self->make_response_promise<step_output>();
  j->id = self->state.next_join++;
  self->state.joins.emplace(j->id, j);
  std::weak_ptr<tp_join> wj = j;
  for (std::size_t p = 0; p < copies.size(); ++p) {
    const int rank = static_cast<int>(p) + 1;
    ++j->pending;
    self->request(forwarders[p], caf::infinite, step_atom::value, std::move(copies[p]))
        .then(
            [self, wj, rank](step_output& o) {
              auto j = wj.lock();
              if (!j) return;
              --j->pending;
              j->peers.emplace_back(rank, std::move(o.sampled));
              j->maybe_deliver();
              forget_if_done(self, j);
            },
            [self, wj, rank](caf::error& e) {
              auto j = wj.lock();
              if (!j) return;
              --j->pending;
              j->settle(make_error(error_code::stage_failed, "tensor-parallel rank " +
                                                                 std::to_string(rank) + ": " +
                                                                 describe(self->system(), e)));
              forget_if_done(self, j);
            });
  }
  return j;
}

/// The step's answer: directly, or (delegated) through rank 0's join of
/// its group.
caf::result<step_output> answer(shard_actor::stateful_pointer<shard_state> self,
                                const std::shared_ptr<tp_join>& j, caf::error e) {
  if (!j) return e;
  j->settle(std::move(e));
  forget_if_done(self, j);
  return caf::delegated<step_output>{};
}
caf::result<step_output> answer(shard_actor::stateful_pointer<shard_state> self,
                                const std::shared_ptr<tp_join>& j, step_output o) {
  if (!j) return o;
  j->own = std::move(o);
  j->maybe_deliver();
  forget_if_done(self, j);
  return caf::delegated<step_output>{};
}

/// A copy of sequence `seq`'s KV blocks from `from_block` on: parked here
/// for a receiver in this process, or pushed to the process `dest`.
caf::result<kv_export> export_kv(kv_store_actor::pointer self, stage_resources& res,
                                 std::int64_t seq, std::int32_t from_block,
                                 const std::string& dest) {
  if (res.tp && res.tp->size > 1)
    return make_error(error_code::invalid_request,
                      "moving the KV of a tensor-parallel stage is not supported yet");
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
        tensor::empty(migration_pool(), kernels::dtype::u8,
                      {std::max<std::int64_t>(1, static_cast<std::int64_t>(snap->data.size()))});
    if (!e) return make_error(error_code::internal, e.error().message);
    if (!snap->data.empty()) std::memcpy(e->data(), snap->data.data(), snap->data.size());
    t = std::move(*e);
    x.seq = seq;
    x.length = snap->length;
    x.live = snap->live;
  }
  if (dest.empty() || dest == to_string(self->node())) {
    x.data = tensor_registry::local().put(res.device.name, std::move(t));
  } else {
    auto ref = data_plane::local().push(dest, res.device.name, std::move(t));
    if (!ref)
      return make_error(error_code::peer_lost,
                        "KV of sequence " + std::to_string(seq) + ": " + ref.error().message);
    x.data = std::move(*ref);
  }
  return x;
}

/// Takes in an export: a new sequence (from_block 0; with `replace`, one
/// already here is replaced, else refused) or a delta of one already here.
/// Returns the KV bytes taken in.
std::expected<std::int64_t, caf::error> import_kv(stage_resources& res, const kv_export& x,
                                                  std::int32_t from_block, bool replace) {
  if (res.tp && res.tp->size > 1) {
    tensor_registry::local().drop(x.data);
    return std::unexpected(
        make_error(error_code::invalid_request,
                   "moving the KV of a tensor-parallel stage is not supported yet"));
  }
  auto data = data_plane::local().take(x.data, migration_pool());
  if (!data)
    return std::unexpected(
        make_error(error_code::invalid_request,
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
    auto s = kv.cache.import_sequence(snap);
    if (!s) return failed(s.error());
    kv.local.emplace(x.seq, *s);
  } else if (auto r = kv.cache.import_tail(it->second, snap, from_block); !r) {
    return failed(r.error());
  }
  return static_cast<std::int64_t>(want);
}

}  // namespace

kernels::result<models::llama_config> model_text_config(const std::string& path) {
  auto src = models::weight_source::open(path);
  if (!src) return std::unexpected(src.error());
  return text_config(**src, path);
}

kernels::result<std::shared_ptr<stage_resources>> make_stage(const device_spec& device,
                                                             const std::string& path,
                                                             const models::layer_range& range,
                                                             const models::quant_plan& plan,
                                                             const models::kv_options& kv) {
  return make_stage(device_context::create(device), path, range, plan, kv);
}

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
    auto r = transport::ring_allreduce_sum(g->ring, t.data_as<float>(),
                                           static_cast<std::size_t>(t.shape().numel()), id);
    if (!r)
      return kernels::make_error(r.error().code,
                                 "tensor-parallel all-reduce: " + r.error().message);
    return {};
  };
  return s;
}

kernels::result<std::shared_ptr<stage_resources>> make_stage(std::shared_ptr<device_context> device,
                                                             const std::string& path,
                                                             const models::layer_range& range,
                                                             const models::quant_plan& plan,
                                                             const models::kv_options& kv,
                                                             std::shared_ptr<tp_group> tp) {
  auto res = std::make_shared<stage_resources>();
  res->tp = tp;
  res->device = device->spec;
  res->ctx = device->ctx;
  res->dev = std::move(device);
  auto src = models::weight_source::open(path);
  if (!src) return std::unexpected(src.error());
  auto cfg = text_config(**src, path);
  if (!cfg) return std::unexpected(cfg.error());
  // Building packs the weights on the device's team, so it holds the
  // device like a step does: a stage loaded next to one that is serving (a
  // live migration to a node that already holds a stage) would otherwise
  // call parallel_for on the team while that stage's step does, and the
  // team (one loop at a time) would mix the two loops' ranges: wrong
  // activations or packed weights, or a crash.
  auto model = [&] {
    std::lock_guard device_lock(res->dev->run);
    return models::llama_model::build(**src, *cfg, *res->ctx, plan, range,
                                      tp ? tp_group::split_of(tp) : models::tensor_split{});
  }();
  if (!model) return std::unexpected(model.error());
  auto cache = (*model)->make_cache(res->ctx->memory(), kv);
  if (!cache) return std::unexpected(cache.error());
  res->model = std::move(*model);
  res->kv = std::make_shared<stage_kv>(std::move(*cache));
  return res;
}

shard_actor spawn_shard(caf::actor_system& sys, std::shared_ptr<stage_resources> res,
                        shard_actor next) {
  auto impl = [](shard_actor::stateful_pointer<shard_state> self,
                 std::shared_ptr<stage_resources> res,
                 shard_actor next) -> shard_actor::behavior_type {
    pin_current_thread(res->device.cores);
    self->state.next = next;
    std::vector<tp_forwarder> forwarders;
    if (res->tp) {
      for (const auto& p : res->tp->peer_shards)
        forwarders.push_back(self->system().spawn(forwarder_impl, p));
      self->attach_functor([forwarders] {
        for (const auto& f : forwarders) caf::anon_send_exit(f, caf::exit_reason::user_shutdown);
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
          auto fail = [&](const std::string& why) {
            for (auto& w : b.seqs) tensor_registry::local().drop(w.embeddings);
            return make_error(error_code::stage_failed,
                              res->device.name + " layers [" +
                                  std::to_string(res->model->range().first) + ", " +
                                  std::to_string(res->model->range().last) + "): " + why);
          };
          // A peer process is gone: the step may run again on a restored
          // pipeline (the scheduler waits for it), unlike a failed step.
          auto lost = [&](const std::string& why) {
            for (auto& w : b.seqs) tensor_registry::local().drop(w.embeddings);
            return make_error(error_code::peer_lost,
                              res->device.name + " layers [" +
                                  std::to_string(res->model->range().first) + ", " +
                                  std::to_string(res->model->range().last) + "): " + why);
          };
          if (auto c = check_multi_step(*res, b); !c) return fail(c.error().message);
          // Rank 0 of a tensor-parallel group: the other ranks run the same
          // step at the same time (their all-reduces meet ours).
          std::shared_ptr<tp_join> join;
          if (res->tp && !res->tp->peer_shards.empty()) {
            auto j = forward_step(self, *res, b, forwarders);
            if (!j) return fail(j.error().message);
            join = std::move(*j);
          }
          std::unique_lock device_lock(
              res->dev->run);  // the device's team is ours until the step is done
          if (res->tp) {
            res->tp->step = b.step;
            res->tp->calls = 0;
          }
          auto out = run_stage(*res, b, generation);
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
              o.logits = tensor_registry::local().put(res->device.name, std::move(*out));
            const double own = ms_between(t0, steady::now());
            o.compute_ms = b.compute_ms + own;
            o.stage_ms = std::move(b.stage_ms);
            o.stage_ms.push_back(own);
            return answer(self, join, std::move(o));
          }
          const double own = ms_between(t0, steady::now());
          b.compute_ms += own;
          b.stage_ms.push_back(own);
          const auto& next = self->state.next;
          if (next && next->node() != self->node()) {
            // The next stage is in another process: the activations go now,
            // over the transfer engine, while this message travels.
            auto ref = data_plane::local().push(to_string(next->node()), res->device.name,
                                                std::move(*out));
            if (!ref) return lost("activations to the next stage: " + ref.error().message);
            b.hidden = std::move(*ref);
          } else {
            b.hidden = tensor_registry::local().put(res->device.name, std::move(*out));
          }
          for (auto& w : b.seqs) w.embeddings = {};
          return self->delegate(next, step_atom::value, std::move(b));
        },
        [=](info_atom) {
          const auto r = res->model->range();
          const auto& c = res->model->config();
          return shard_info{res->device.name, r.first,       r.last,      r.embed,
                            r.head,           c.hidden_size, c.vocab_size};
        },
        [](version_atom) { return protocol_version; },
        [=](route_atom, caf::strong_actor_ptr p) -> caf::result<bool> {
          if (res->model->range().head)
            return make_error(error_code::invalid_request, "the last stage forwards to no one");
          auto n = caf::actor_cast<shard_actor>(p);
          if (!n) return make_error(error_code::invalid_request, "route to an invalid shard");
          self->state.next = std::move(n);
          return true;
        },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(res), std::move(next));
}

kv_store_actor spawn_kv_store(caf::actor_system& sys, std::shared_ptr<stage_resources> res) {
  auto impl = [](kv_store_actor::pointer self,
                 std::shared_ptr<stage_resources> res) -> kv_store_actor::behavior_type {
    (void)self;
    pin_current_thread(res->device.cores);
    return {
        [=](usage_atom) {
          std::lock_guard lock(res->kv->mtx);
          const auto u = res->kv->cache.usage();
          return kv_usage_info{res->device.name, res->kv->cache.options().block_size,
                               u.total_blocks,   u.free_blocks,
                               u.sequences,      u.tokens};
        },
        [=](free_atom, const std::vector<std::int64_t>& seqs) -> std::int64_t {
          if (res->tp)  // the group's other ranks hold the other KV heads of these sequences
            for (auto& p : res->tp->peer_kvs) caf::anon_send(p, free_atom::value, seqs);
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
        [=](export_atom, std::int64_t seq, std::int32_t from_block, const std::string& dest) {
          return export_kv(self, *res, seq, from_block, dest);
        },
        [=](import_atom, const kv_export& x, std::int32_t from_block) -> caf::result<std::int64_t> {
          auto r = import_kv(*res, x, from_block, true);
          if (!r) return std::move(r.error());
          return *r;
        },
        [=](reset_atom) -> std::int64_t {
          if (res->tp)
            for (auto& p : res->tp->peer_kvs) caf::anon_send(p, reset_atom::value);
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
