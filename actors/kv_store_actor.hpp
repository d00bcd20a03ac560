#pragma once

// The KV-store actor of a pipeline stage: reports, frees, lists and resets
// the stage's sequences and moves their KV blocks out (export) and in
// (import) for migrations.

#include <memory>

#include "actors/protocol.hpp"

namespace troupe::actors {

struct stage_resources;

/// Spawns the KV store of `res` (detached, pinned).
kv_store_actor spawn_kv_store(caf::actor_system& sys, std::shared_ptr<stage_resources> res);

}  // namespace troupe::actors
