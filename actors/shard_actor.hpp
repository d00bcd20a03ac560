#pragma once

// The shard actor of a pipeline stage: runs each step on the stage's layers
// and passes the activations on to the next stage, or (on the last stage)
// samples and answers. Rank 0 of a tensor-parallel group also runs the
// step on the group's other ranks (actors/tp_group.hpp).

#include <memory>

#include "actors/protocol.hpp"

namespace troupe::actors {

struct stage_resources;

/// Spawns the shard of `res` (detached, pinned). `next` is the following
/// stage's shard, or invalid for the last stage (which answers with logits).
shard_actor spawn_shard(caf::actor_system& sys, std::shared_ptr<stage_resources> res,
                        shard_actor next);

}  // namespace troupe::actors
