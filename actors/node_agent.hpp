#pragma once

// Every node's agent: it holds the stages the head places on its node
// (and the vision encoder, when a live migration moves it there), and
// answers the head's heartbeats with a report of the node.

#include <chrono>
#include <cstdint>
#include <string>

#include "actors/device_spec.hpp"
#include "actors/protocol.hpp"
#include "cluster/manifest.hpp"
#include "models/kv_cache.hpp"
#include "models/weights.hpp"

namespace troupe::actors {

/// What a node's stages are made of (from the manifest, resolved by the CLI).
struct node_config {
  cluster::manifest m;
  std::string name;    ///< this node
  std::string model;   ///< resolved model path on this node
  device_spec device;  ///< the device its stages run on
  std::int64_t memory_limit = 0;
  models::quant_plan plan;
  models::kv_options kv;
  std::chrono::milliseconds timeout{30000};
};

/// The node's agent (detached: loading weights and joining another node
/// block it, not the other actors). `down` stops the node's process
/// (SIGTERM to itself, which its main thread waits for).
node_agent_actor spawn_node_agent(caf::actor_system& sys, node_config cfg);

}  // namespace troupe::actors
