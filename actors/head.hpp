#pragma once

// The head: membership, placement, the scheduler, the vision encoder and
// the door for clients, in one actor. Its files: head.cpp (membership,
// heartbeats, placing the stages), head_placement.cpp (measurements, the
// planner and the policy), migration.cpp (live migration), head_status.cpp
// (`troupe status` and the drain); head_state.hpp is what they share.
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

#include "actors/encoder.hpp"
#include "actors/node_agent.hpp"
#include "actors/prompt_worker.hpp"
#include "actors/protocol.hpp"
#include "actors/scheduler.hpp"
#include "cluster/membership.hpp"
#include "kernels/status.hpp"

namespace troupe::actors {

/// What the head runs with: its own node, the encoder, the scheduler and
/// membership's timing.
struct head_config {
  node_config node;  ///< the head's own node (its model path, device, plan)
  encoder_options encoder;
  scheduler_options scheduler;  ///< queue_limit, max_running, token_budget (kv filled in)
  cluster::membership_options membership;
  /// Before every node is up, place on whatever is up after this long.
  std::chrono::milliseconds startup_grace{60000};
  /// How jobs' prompts become tokens (empty: render_prompt). Each job is
  /// rendered on a prompt worker of its own, off the head's thread.
  prompt_renderer render;
  /// Jobs being rendered at once; past it, jobs are refused as overloaded.
  std::int64_t max_rendering = 64;
  /// The head's term (cluster/head_lease.hpp); 0: its start time in
  /// milliseconds since the epoch, so a later head has a higher one.
  std::uint64_t term = 0;
  /// Start as the manifest's standby head ([cluster] standby): follow the
  /// head's jobs, serve nothing, and take over (a higher term, a fresh
  /// placement) once the head is lost: its connection closed, or no answer
  /// for membership.lost_after.
  bool standby = false;
  /// The manifest's head with a standby: how long it waits at start for
  /// the standby to say whether it took over (a restart after a takeover)
  /// before it serves as the head.
  std::chrono::milliseconds probe_partner{3000};
  /// After a takeover: place on the nodes up after this long.
  std::chrono::milliseconds takeover_grace{1500};
  /// After a takeover: how long a job waits for its client to attach
  /// before it is dropped, and an attach for a replica to serve.
  std::chrono::milliseconds attach_wait{60000};
};

/// The head: its door (also the actor that runs membership and placement).
/// `own` is the head node's agent. Fails when the model cannot be read.
kernels::result<frontdoor_actor> spawn_head(caf::actor_system& sys, head_config cfg,
                                            node_agent_actor own);

}  // namespace troupe::actors
