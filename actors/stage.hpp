#pragma once

// A pipeline stage: a shard actor (a range of decoder layers) and its
// kv_store actor (the paged KV blocks of those layers) on one device. Both
// run on detached threads pinned to the device's cores and share the
// stage's KV cache under a mutex (same device, same process). This header
// holds what a stage is and how it is built; the step's compute is in
// actors/stage_compute.hpp, the actors in actors/shard_actor.hpp and
// actors/kv_store_actor.hpp, tensor parallelism in actors/tp_group.hpp.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "actors/device.hpp"
#include "actors/device_spec.hpp"
#include "actors/kv_store_actor.hpp"
#include "actors/protocol.hpp"
#include "actors/shard_actor.hpp"
#include "actors/tp_group.hpp"
#include "models/kv_cache.hpp"
#include "models/kv_tiers.hpp"
#include "models/llama.hpp"

namespace troupe::actors {

/// The KV cache of one stage and the map from the scheduler's sequence ids
/// to the cache's own.
struct stage_kv {
  std::mutex mtx;
  models::kv_cache cache;
  std::unique_ptr<models::kv_tiers> tiers;  ///< host and disk tiers; null: none
  std::unordered_map<std::int64_t, models::seq_id> local;
  std::uint64_t generation = 0;  ///< bumped when a restarted pipeline takes over

  explicit stage_kv(models::kv_cache c) : cache(std::move(c)) {}
};

/// What a stage's actors run on.
struct stage_resources {
  device_spec device;                                ///< as the manifest names it
  std::shared_ptr<kernels::device> dev;              ///< its compute (shared with its other actors)
  std::shared_ptr<const models::llama_model> model;  ///< this stage's layers
  std::shared_ptr<stage_kv> kv;
  kernels::attention_options attention;
  std::shared_ptr<tp_group> tp;  ///< null: not tensor-parallel

  stage_resources() = default;
  stage_resources(const stage_resources&) = delete;
  stage_resources& operator=(const stage_resources&) = delete;
  /// Releases the layers and the cache, then gives the device pool's
  /// cached blocks back to the system: a node whose stages are re-placed
  /// again and again (losses, rejoins, migrations) would otherwise keep the
  /// union of every placement's buffers.
  ~stage_resources();
};

/// The decoder config of a LLaMA/LLaVA folder or a GGUF file.
kernels::result<models::llama_config> model_text_config(const std::string& path);

/// Builds a stage: a context over the device's cores, the model's layers
/// [range.first, range.last) from `path` (a LLaMA or LLaVA folder, or a
/// GGUF file) and a KV cache of `kv` for them. With `tp`, the stage is
/// rank tp->rank of a tensor-parallel group: it holds that slice of each
/// layer (and a KV cache of its KV heads only).
kernels::result<std::shared_ptr<stage_resources>> make_stage(
    const device_spec& spec, std::shared_ptr<kernels::device> device, const std::string& path,
    const models::layer_range& range, const models::quant_plan& plan, const models::kv_options& kv,
    std::shared_ptr<tp_group> tp = nullptr);
/// The same on a device of its own.
kernels::result<std::shared_ptr<stage_resources>> make_stage(const device_spec& device,
                                                             const std::string& path,
                                                             const models::layer_range& range,
                                                             const models::quant_plan& plan,
                                                             const models::kv_options& kv);

}  // namespace troupe::actors
