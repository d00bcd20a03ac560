#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "actors/core/scheduler_core.hpp"
#include "actors/protocol.hpp"
#include "models/weights.hpp"

namespace troupe::actors {

// The policy and its options live in the pure core (actors/core/).
using core::model_frontend;
using core::scheduler_options;

/// Spawns the scheduler of one model: admission with a queue limit,
/// continuous batching with chunked prefill, micro-batches through the
/// pipeline `stages` (stages[0] is the entry; the last answers with logits),
/// sampling, streaming to each request's client, cancellation, deadlines
/// and preemption (recompute) when KV blocks run out. `kv_stores` are the
/// stages' KV stores; `encoder` may be invalid for a text-only model.
/// The prefix cache's namespace for a model (scheduler_options::
/// cache_namespace): its path, its weight formats and the KV layout.
std::string cache_namespace(const std::string& model, const models::quant_plan& plan,
                            const models::kv_options& kv);

/// The requests a scheduler holds (waiting, encoding, running), as it
/// last planned: the head's router reads it at each job, in its process,
/// instead of a sample of the last heartbeat's.
using load_gauge = std::shared_ptr<std::atomic<std::int64_t>>;

/// `held`, when given, follows the requests it holds.
scheduler_actor spawn_scheduler(caf::actor_system& sys, model_frontend model,
                                scheduler_options opts, std::vector<shard_actor> stages,
                                std::vector<kv_store_actor> kv_stores, encoder_actor encoder,
                                load_gauge held = {});

}  // namespace troupe::actors
