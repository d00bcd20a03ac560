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

// The planner's view of the usable nodes (those of `only`, when given)
// and the measured links now.
placement::cluster_profile profile_now(head_ptr self,
                                       const std::vector<std::string>* only = nullptr);

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

// The stages for replica `r`'s placement, on its usable nodes: the
// planner's with pipeline_stages = "auto" (recorded as a decision, unless
// it retries one), else one even split per the manifest.
std::vector<cluster::stage_slot> choose_slots(head_ptr self, int r, const std::string& trigger);

// Replica `r`'s usable nodes now. When none of its own is up it takes a
// node another replica holds spare (not in that one's placement).
std::vector<std::string> replica_usable(head_ptr self, int r);

// At the first placement: how many replicas (parallelism.replicas, or as
// many as the nodes hold for "auto") and which nodes each places on (runs
// of the stage nodes in the manifest's order, the head's node in the first).
void group_replicas(head_ptr self);

// troupe scale: runs `n` replicas. Up: draining replicas serve again,
// then each new one takes nodes that no placement uses (pipeline_stages of
// them, or one with "auto") and is placed; refused when too few are free.
// Down: the newest stop taking jobs and retire once theirs are done
// (retire_drained). Answers what it does.
caf::result<std::string> scale_to(head_ptr self, int n);

// At each heartbeat: a draining replica whose requests are all done
// retires: its stages are dropped, its scheduler stops, its nodes become
// spares of the first replica serving.
void retire_drained(head_ptr self);

// A node no replica has (it was down when "auto" counted the replicas)
// joins the one waiting for a node, else the one with the fewest.
void adopt_node(head_ptr self, const std::string& name);

// Every 5 s, and at once after a node joined: should shards move?
void policy_tick(head_ptr self);

}  // namespace troupe::actors::head_detail
