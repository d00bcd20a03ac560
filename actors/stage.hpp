#pragma once

// A pipeline stage: a shard actor (a range of decoder layers) and its
// kv_store actor (the paged KV blocks of those layers) on one device. Both
// run on detached threads pinned to the device's cores and share the
// stage's KV cache under a mutex (same device, same process).

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

/// What a stage's actors run on.
struct stage_resources {
  device_spec device;
  std::shared_ptr<device_context> dev;      ///< the device's team and lock (shared with its other actors)
  std::shared_ptr<kernels::cpu::context> ctx;  ///< dev->ctx
  std::shared_ptr<const models::llama_model> model;  ///< this stage's layers
  std::shared_ptr<stage_kv> kv;
  kernels::attention_options attention;
};

/// The decoder config of a LLaMA/LLaVA folder or a GGUF file.
kernels::result<models::llama_config> model_text_config(const std::string& path);

/// Builds a stage: a context over the device's cores, the model's layers
/// [range.first, range.last) from `path` (a LLaMA or LLaVA folder, or a
/// GGUF file) and a KV cache of `kv` for them.
kernels::result<std::shared_ptr<stage_resources>> make_stage(std::shared_ptr<device_context> device,
                                                             const std::string& path, const models::layer_range& range,
                                                             const models::quant_plan& plan,
                                                             const models::kv_options& kv);
/// The same on a device of its own.
kernels::result<std::shared_ptr<stage_resources>> make_stage(const device_spec& device, const std::string& path,
                                                             const models::layer_range& range,
                                                             const models::quant_plan& plan,
                                                             const models::kv_options& kv);

/// Spawns the shard of `res` (detached, pinned). `next` is the following
/// stage's shard, or invalid for the last stage (which answers with logits).
shard_actor spawn_shard(caf::actor_system& sys, std::shared_ptr<stage_resources> res, shard_actor next);

/// Spawns the KV store of `res` (detached, pinned).
kv_store_actor spawn_kv_store(caf::actor_system& sys, std::shared_ptr<stage_resources> res);

}  // namespace troupe::actors
