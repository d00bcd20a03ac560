#include "actors/stage_compute.hpp"

#include <algorithm>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "actors/data_plane.hpp"

namespace troupe::actors {

namespace {

using kernels::errc;
using kernels::tensor;

/// Host memory for a step's input embeddings: the device's pool where host
/// code can use it, else one of the process's.
kernels::memory_pool& input_pool(kernels::device& dev) {
  static const auto host = kernels::memory_pool::create();
  return dev.memory().host_accessible() ? dev.memory() : *host;
}

}  // namespace

namespace {

bool remote_move(const models::kv_move& m) {
  return m.from == static_cast<std::uint8_t>(models::kv_tier::remote) ||
         m.to == static_cast<std::uint8_t>(models::kv_tier::remote);
}

/// Carries out a step's moves in order: runs between the local tiers go
/// to kv_tiers, the remote tier's rows come from and go to `remote`.
kernels::result<void> apply_moves(stage_kv& kv, std::span<const models::kv_move> moves,
                                  remote_rows* remote) {
  const auto slot = kv.cache.slot_bytes();
  std::size_t in_at = 0, out_at = 0;
  for (std::size_t i = 0; i < moves.size();) {
    if (!remote_move(moves[i])) {
      auto j = i;
      while (j < moves.size() && !remote_move(moves[j])) ++j;
      if (!kv.tiers)
        return kernels::make_error(
            errc::invalid_argument,
            "the step moves KV blocks between tiers, and this stage has none "
            "(the stages' [kv] tiers differ from the scheduler's)");
      if (auto r = kv.tiers->apply(kv.cache, moves.subspan(i, j - i)); !r) return r;
      i = j;
      continue;
    }
    const auto& m = moves[i++];
    if (!remote)
      return kernels::make_error(errc::invalid_argument,
                                 "the step moves KV blocks to or from a remote store this stage "
                                 "was not given");
    if (m.to == static_cast<std::uint8_t>(models::kv_tier::device)) {
      if (in_at + slot > remote->in.size())
        return kernels::make_error(errc::invalid_argument,
                                   "fewer KV rows from the remote store than the step restores");
      if (auto r = kv.cache.write_block(m.to_index, remote->in.subspan(in_at, slot)); !r) return r;
      in_at += slot;
    } else if (m.from == static_cast<std::uint8_t>(models::kv_tier::device)) {
      if (out_at + slot > remote->out.size())
        return kernels::make_error(errc::invalid_argument,
                                   "more KV blocks to copy out than room was made for");
      if (auto r = kv.cache.read_block(m.from_index, remote->out.subspan(out_at, slot)); !r)
        return r;
      out_at += slot;
    } else {
      return kernels::make_error(errc::invalid_argument,
                                 "a remote KV move that neither starts nor ends on the device");
    }
  }
  return {};
}

}  // namespace

kernels::result<tensor> run_stage(stage_resources& res, step_batch& b, std::uint64_t generation,
                                  remote_rows* remote) {
  const auto& model = *res.model;
  const auto range = model.range();
  std::vector<models::step_input> inputs(b.seqs.size());
  std::vector<tensor> embeds(b.seqs.size());
  tensor x;
  if (!range.embed) {
    if (b.hidden.empty())
      return kernels::make_error(errc::invalid_argument, "a middle stage got no activations");
    auto h = data_plane::local().take(b.hidden, *res.dev);
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
  // Block copies between the tiers come first: a block written below may
  // be the one another is copied out of.
  if (!b.moves.empty())
    if (auto r = apply_moves(kv, b.moves, remote); !r) return std::unexpected(r.error());
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
    // Blocks named by the scheduler (prefix caching): the cache switches
    // to them while it holds nothing (a new pipeline, or every sequence gone).
    if (w.blocks_from >= 0 && !kv.cache.blocks_named() && kv.local.empty())
      if (auto r = kv.cache.name_blocks(); !r) {
        undo();
        return std::unexpected(r.error());
      }
    if (it == kv.local.end() && w.blocks_from >= 0) {
      // A new sequence, possibly starting after a cached prefix.
      it = kv.local.emplace(w.seq, kv.cache.add_sequence()).first;
      created.push_back(w.seq);
      if (auto r = kv.cache.assign(it->second, w.blocks_from, w.blocks, w.start); !r) {
        undo();
        return std::unexpected(r.error());
      }
    } else if (it != kv.local.end() && w.blocks_from >= 0) {
      if (auto r = kv.cache.assign(it->second, w.blocks_from, w.blocks, w.start); !r) {
        undo();
        return std::unexpected(r.error());
      }
    }
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
      // Host floats: the model writes them into its rows (step_input).
      auto e = data_plane::local().take(w.embeddings, input_pool(*res.dev));
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
  auto& dev = *res.dev;
  if (range.embed) {
    auto e = model.embed(dev, inputs);
    if (!e) {
      undo();
      return std::unexpected(e.error());
    }
    x = std::move(*e);
  }
  if (auto r = model.run_layers(dev, kv.cache, inputs, x, res.attention); !r) {
    undo();
    return std::unexpected(r.error());
  }
  if (range.head) return model.head(dev, inputs, x);
  return x;
}

kernels::result<void> check_multi_step(const stage_resources& res, const step_batch& b) {
  if (b.decode_steps <= 1) return {};
  const auto range = res.model->range();
  if (!range.embed || !range.head)
    return kernels::make_error(errc::invalid_argument,
                               "multi-step decode needs a stage that holds the whole model");
  for (const auto& w : b.seqs)
    if (!w.sample || w.tokens.size() != 1 || !w.embeddings.empty() || w.all_logits ||
        w.sampling.max_new < 1 || !w.sampling.allowed.empty())
      return kernels::make_error(errc::invalid_argument,
                                 "multi-step decode of sequence " + std::to_string(w.seq) +
                                     ": every sequence must sample from a one-token input");
  return {};
}

kernels::result<void> sample_and_continue(stage_resources& res, step_batch& b, const tensor& logits,
                                          std::uint64_t generation, step_output& o) {
  const auto vocab = res.model->config().vocab_size;
  const auto n = b.seqs.size();
  o.sampled.assign(n, {});
  o.logprobs.clear();
  if (std::any_of(b.seqs.begin(), b.seqs.end(),
                  [](const seq_work& w) { return w.sample && w.sampling.params.logprobs >= 0; }))
    o.logprobs.assign(n, {});
  std::vector<std::optional<models::sampler>> samplers(n);
  // Samples sequence idx[k] from row rows[k] of `l`, the sequences in
  // parallel on the stage's workers (each sampler and output is its own).
  std::vector<std::size_t> idx;
  std::vector<std::int64_t> rows;
  std::vector<std::byte> host_logits;  // where host code cannot read the device's memory
  auto sample_all = [&](const tensor& on_device) -> kernels::result<void> {
    auto l = kernels::host_view(*res.dev, on_device, host_logits);
    if (!l) return std::unexpected(l.error());
    res.dev->host_parallel_for(
        static_cast<std::int64_t>(idx.size()), 1, [&](std::int64_t lo, std::int64_t hi, int) {
          for (auto k = lo; k < hi; ++k) {
            const auto i = idx[static_cast<std::size_t>(k)];
            auto& w = b.seqs[i];
            const std::span<const float> r(l->row_as<float>(rows[static_cast<std::size_t>(k)]),
                                           static_cast<std::size_t>(vocab));
            std::int32_t tok = 0;
            if (const auto& mask = w.sampling.allowed; !mask.empty()) {
              // A grammar's mask: the tokens it refuses cannot be drawn.
              std::vector<float> masked(r.begin(), r.end());
              for (std::size_t id = 0; id < masked.size(); ++id)
                if (id / 64 >= mask.size() || !((mask[id / 64] >> (id % 64)) & 1))
                  masked[id] = -std::numeric_limits<float>::infinity();
              tok = static_cast<std::int32_t>(samplers[i]->sample(masked, w.sampling.history));
            } else {
              tok = static_cast<std::int32_t>(samplers[i]->sample(r, w.sampling.history));
            }
            o.sampled[i].push_back(tok);
            if (const auto top = w.sampling.params.logprobs; top >= 0)
              o.logprobs[i].push_back(models::logprobs_of(r, tok, top));
            if (!w.sampling.history.empty()) w.sampling.history.push_back(tok);
          }
        });
    return {};
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
  if (auto r = sample_all(logits); !r) return r;
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
    if (auto r = sample_all(*out); !r) return r;
    ++o.passes;
  }
  return {};
}

}  // namespace troupe::actors
