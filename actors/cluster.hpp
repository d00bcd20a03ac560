#pragma once

// The cluster's actors: every node's agent (it holds the stages the head
// places on its node) and the head (membership, placement, the scheduler,
// the vision encoder and the door for clients). The plain logic they act
// on (the membership state machine, the placement rule) is in cluster/.
//
// Placement: the head joins every node's gatekeeper (mutual TLS, node
// certificate, challenge) and gets its agent; once all nodes are up it
// splits the decoder into contiguous stages over them (head first) and
// orders each agent, last stage first, to load its layers with the next
// stage's handles (the agent joins that node itself, so steps and
// activations go straight from stage to stage). Heartbeats (ping) every
// 500 ms; a node that closes its connection, or answers none for 2.5 s, is
// lost: its stages are placed again on the nodes left, and the scheduler
// resets onto the new pipeline, where every running request recomputes
// from the tokens it already produced (it sees a delay, no error). A lost
// node is tried again every second and rejoins when it answers.

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "actors/device_spec.hpp"
#include "actors/encoder.hpp"
#include "actors/protocol.hpp"
#include "actors/scheduler.hpp"
#include "cluster/manifest.hpp"
#include "cluster/membership.hpp"
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

struct head_config {
  node_config node;  ///< the head's own node (its model path, device, plan)
  encoder_options encoder;
  scheduler_options scheduler;  ///< queue_limit, max_running, token_budget (kv filled in)
  cluster::membership_options membership;
  /// Before every node is up, place on whatever is up after this long.
  std::chrono::milliseconds startup_grace{60000};
};

/// The head: its door (also the actor that runs membership and placement).
/// `own` is the head node's agent. Fails when the model cannot be read.
kernels::result<frontdoor_actor> spawn_head(caf::actor_system& sys, head_config cfg,
                                            node_agent_actor own);

/// Joins the head's gatekeeper as a client and returns its door.
std::expected<frontdoor_actor, std::string> connect_client(caf::actor_system& sys,
                                                           const cluster::manifest& m,
                                                           std::chrono::milliseconds timeout);

/// Submits `job` through the door and waits for its end; `on_token` sees
/// the stream (on another thread). The error is the refusal's message, or
/// that the head went away.
std::expected<finish_event, std::string> run_job(
    caf::actor_system& sys, const frontdoor_actor& door, job_request job,
    std::function<void(const token_event&)> on_token = {});

/// Submits `job` and returns once the head accepted it; the events arrive
/// on another thread. `on_finish` is called exactly once: with the finish
/// event, or with nothing and the reason when the head went away. A
/// refusal is the error (and no callback follows).
/// Why the head refused a job: its code (overloaded, unavailable, invalid
/// request, ...; internal when the head did not answer) and message.
struct job_refusal {
  error_code code = error_code::internal;
  std::string message;
};

std::expected<void, job_refusal> submit_job(
    caf::actor_system& sys, const frontdoor_actor& door, job_request job,
    std::function<void(const token_event&)> on_token,
    std::function<void(std::optional<finish_event>, std::string)> on_finish);

/// The head's view of the cluster (`troupe status`), or why there is none.
std::expected<cluster_status, std::string> query_status(caf::actor_system& sys,
                                                        const frontdoor_actor& door,
                                                        std::chrono::milliseconds timeout);

/// Asks the head to migrate a shard live (`troupe migrate`); the report, or why not.
std::expected<migrate_report, std::string> migrate_shard(caf::actor_system& sys,
                                                         const frontdoor_actor& door,
                                                         migrate_request req,
                                                         std::chrono::milliseconds timeout);

/// Cancels a job; false when the head does not know it (any more).
bool cancel_job(caf::actor_system& sys, const frontdoor_actor& door, std::uint64_t id);

/// A random job id (the head's scheduler refuses a duplicate).
std::uint64_t random_job_id();

}  // namespace troupe::actors
