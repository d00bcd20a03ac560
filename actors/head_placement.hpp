#pragma once

// The head's placement (head_placement.cpp).
//
// Every node measures its device when it starts (device_probe) and reports
// the load on its cores at each heartbeat; the head measures the link to
// each node (a ping and an 8 MiB push over the data plane). With
// pipeline_stages = "auto" the planner (placement/) chooses the stages
// from these, and every 5 s (at once when a node joins) the policy decides
// whether shards move: whole stages move by live migration, a new layer
// split is placed afresh with the scheduler paused (running requests then
// recompute). Each decision is logged with its predicted step times and
// the throughput measured before and after it.

#include <optional>
#include <string>
#include <vector>

#include "actors/head_state.hpp"

namespace troupe::actors::head_detail {

// The node that runs the vision encoder (the head's, unless it moved).
std::string encoder_node(head_ptr self);

// The planner's view of the usable nodes and the measured links now.
placement::cluster_profile profile_now(head_ptr self);

// Every usable node has reported its probe, and every link from the head
// to one was measured (or failed to be).
bool measured_all(head_ptr self);

// Measures the link from the head to `name` once per incarnation of it.
void measure_link(head_ptr self, const std::string& name);

// Decision `index` took effect: its throughput is measured from now on.
void decision_applied(head_ptr self, std::optional<std::size_t> index);

// The throughput after each applied decision: tokens per second over
// measure_s once it settled. It settles when the requests that were
// running when it took effect have finished (after a re-split they
// recompute their context first, a burst that is not the new placement's
// steady rate), at least 5 s and at most 60 s after it.
void measure_decisions(head_ptr self);

// The stages for a placement: the planner's with pipeline_stages =
// "auto" (recorded as a decision, unless it retries one), else one even
// split per the manifest.
std::vector<cluster::stage_slot> choose_slots(head_ptr self, const std::string& trigger);

// Every 5 s, and at once after a node joined: should shards move?
void policy_tick(head_ptr self);

}  // namespace troupe::actors::head_detail
