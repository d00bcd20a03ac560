#pragma once

// A pipeline stage: a shard actor (a range of decoder layers) and its
// kv_store actor (the paged KV blocks of those layers) on one device. Both
// run on detached threads pinned to the device's cores and share the
// stage's KV cache under a mutex (same device, same process).

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "actors/device.hpp"
#include "actors/device_spec.hpp"
#include "actors/protocol.hpp"
#include "kernels/cpu/context.hpp"
#include "models/kv_cache.hpp"
#include "models/llama.hpp"
#include "transport/collectives.hpp"

namespace troupe::actors {

/// The KV cache of one stage and the map from the scheduler's sequence ids
/// to the cache's own.
struct stage_kv {
  std::mutex mtx;
  models::kv_cache cache;
  std::unordered_map<std::int64_t, models::seq_id> local;
  std::uint64_t generation = 0;  ///< bumped when a restarted pipeline takes over

  explicit stage_kv(models::kv_cache c) : cache(std::move(c)) {}
};

/// A tensor-parallel group as one rank sees it. Every rank holds slice
/// `rank` of every layer of the stage and runs every step; the ranks' steps
/// meet in the all-reduces over `ring` (to rank (rank + 1) % size). Rank 0
/// is the group's face to the scheduler: its shard forwards each step to
/// the other ranks' shards and answers once all agree; its KV store passes
/// frees on to theirs. Embedding, norms and LM head are replicated and the
/// all-reduce leaves every rank with the same bits, so every rank samples
/// the same tokens (rank 0 checks).
struct tp_group {
  int rank = 0;
  int size = 1;
  transport::ring ring;                  ///< engine null until the ring is connected
  std::vector<shard_actor> peer_shards;  ///< rank 0: ranks 1..size-1
  std::vector<kv_store_actor> peer_kvs;  ///< rank 0: ranks 1..size-1
  std::vector<std::string>
      peer_keys;  ///< rank 0: their data-plane keys (image embeddings go there)
  std::chrono::milliseconds reply_timeout{120000};
  /// Set when a rank is gone: all-reduces in flight give up at once
  /// (ring.abort points here).
  std::atomic<bool> broken{false};
  /// Set by the shard before each step (under the device lock): the
  /// all-reduces of a step are numbered from its step number, the same on
  /// every rank.
  std::uint64_t step = 0;
  std::uint32_t calls = 0;

  /// The split to build this rank's model with (its all-reduce runs over
  /// `ring`).
  static models::tensor_split split_of(const std::shared_ptr<tp_group>& g);
};

/// What a stage's actors run on.
struct stage_resources {
  device_spec device;
  std::shared_ptr<device_context>
      dev;  ///< the device's team and lock (shared with its other actors)
  std::shared_ptr<kernels::cpu::context> ctx;        ///< dev->ctx
  std::shared_ptr<const models::llama_model> model;  ///< this stage's layers
  std::shared_ptr<stage_kv> kv;
  kernels::attention_options attention;
  std::shared_ptr<tp_group> tp;  ///< null: not tensor-parallel
};

/// The decoder config of a LLaMA/LLaVA folder or a GGUF file.
kernels::result<models::llama_config> model_text_config(const std::string& path);

/// Builds a stage: a context over the device's cores, the model's layers
/// [range.first, range.last) from `path` (a LLaMA or LLaVA folder, or a
/// GGUF file) and a KV cache of `kv` for them. With `tp`, the stage is
/// rank tp->rank of a tensor-parallel group: it holds that slice of each
/// layer (and a KV cache of its KV heads only).
kernels::result<std::shared_ptr<stage_resources>> make_stage(
    std::shared_ptr<device_context> device, const std::string& path,
    const models::layer_range& range, const models::quant_plan& plan, const models::kv_options& kv,
    std::shared_ptr<tp_group> tp = nullptr);
/// The same on a device of its own.
kernels::result<std::shared_ptr<stage_resources>> make_stage(const device_spec& device,
                                                             const std::string& path,
                                                             const models::layer_range& range,
                                                             const models::quant_plan& plan,
                                                             const models::kv_options& kv);

/// Spawns the shard of `res` (detached, pinned). `next` is the following
/// stage's shard, or invalid for the last stage (which answers with logits).
shard_actor spawn_shard(caf::actor_system& sys, std::shared_ptr<stage_resources> res,
                        shard_actor next);

/// Spawns the KV store of `res` (detached, pinned).
kv_store_actor spawn_kv_store(caf::actor_system& sys, std::shared_ptr<stage_resources> res);

}  // namespace troupe::actors
