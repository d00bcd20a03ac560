#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "actors/encoder.hpp"
#include "actors/protocol.hpp"
#include "actors/stage.hpp"

namespace troupe::actors {

/// Restart policy of a node.
struct node_options {
  int max_restarts = 3;  ///< pipeline/encoder restarts before the node gives up
};

/// The node's current actors, readable from outside the node's thread.
struct node_handles {
  mutable std::mutex mtx;
  std::vector<shard_actor> shards;
  std::vector<kv_store_actor> kv_stores;
  encoder_actor encoder;
};

/// What a node spawns and supervises.
struct node_setup {
  std::vector<std::shared_ptr<stage_resources>> stages;
  std::shared_ptr<encoder_resources> encoder;  ///< null: text-only model
  encoder_options encoder_opts;
  scheduler_actor scheduler;  ///< told about restarts (or later by a reset message)
  /// The last stages, served by another process (`troupe worker`): the
  /// local shards feed it; the node neither supervises nor stops it.
  std::optional<stage_handles> remote_tail;
  /// The other ranks of the (single) stage's tensor-parallel group, served
  /// by other processes: monitored like the remote tail, and their KV
  /// cleared before a restarted pipeline runs.
  std::vector<stage_handles> tp_peers;
  std::shared_ptr<node_handles> handles;
  node_options opts;
};

/// Spawns the node actor: it spawns the KV stores, the shards (back to
/// front) and the encoder of `setup`, monitors them, and when one dies
/// abnormally restarts the whole pipeline (clearing every stage's KV; the
/// scheduler's running requests recompute) or the encoder, up to
/// max_restarts times; then it tells the scheduler to fail its requests.
/// Stopping the node (exit) stops every actor it spawned.
node_actor spawn_node(caf::actor_system& sys, node_setup setup);

}  // namespace troupe::actors
