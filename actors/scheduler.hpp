#pragma once

#include <memory>
#include <vector>

#include "actors/protocol.hpp"
#include "models/kv_cache.hpp"
#include "models/tokenizer.hpp"

namespace troupe::actors {

/// What the scheduler knows of the model besides its stages.
struct model_frontend {
  std::shared_ptr<const models::tokenizer> tok;
  std::int64_t vocab = 0;
  std::int64_t hidden = 0;
  std::int32_t image_token = -1;  ///< -1: a text-only model
  std::int64_t tokens_per_image = 0;
};

/// Admission and batching policy.
struct scheduler_options {
  std::int64_t queue_limit = 64;     ///< requests waiting for admission (encoding included)
  std::int64_t max_running = 64;     ///< sequences with KV at once
  std::int64_t token_budget = 512;   ///< tokens per micro-batch (prefill chunks + decode tokens)
  std::int64_t prefill_chunk = 512;  ///< prompt tokens per sequence per step
  int micro_batches = 1;  ///< micro-batches in flight (the pipeline's depth); 0: one per stage,
                          ///< following re-placements
  /// With several micro-batches: size each to an even share of the work
  /// (tokens waiting plus in flight) instead of filling it to token_budget.
  bool balance_micro_batches = true;
  /// Multi-step decode (one stage only): a step of decode tokens alone runs
  /// up to this many passes on the shard, which samples and feeds the tokens
  /// back itself, so the round trip to the scheduler is paid once per step.
  /// 1 turns it off.
  int max_decode_steps = 16;
  /// ... as many passes as fit in this many milliseconds (by the measured
  /// time of a pass), so that a waiting request is admitted, and tokens reach
  /// the clients, at least this often. Long steps (a big model) get 1.
  double multi_step_ms = 2.0;
  models::kv_options kv;       ///< the stages' KV layout (block accounting)
  std::int64_t kv_blocks = 0;  ///< blocks per stage (the smallest stage's pool)
};

/// Spawns the scheduler of one model: admission with a queue limit,
/// continuous batching with chunked prefill, micro-batches through the
/// pipeline `stages` (stages[0] is the entry; the last answers with logits),
/// sampling, streaming to each request's client, cancellation, deadlines
/// and preemption (recompute) when KV blocks run out. `kv_stores` are the
/// stages' KV stores; `encoder` may be invalid for a text-only model.
scheduler_actor spawn_scheduler(caf::actor_system& sys, model_frontend model,
                                scheduler_options opts, std::vector<shard_actor> stages,
                                std::vector<kv_store_actor> kv_stores, encoder_actor encoder);

}  // namespace troupe::actors
