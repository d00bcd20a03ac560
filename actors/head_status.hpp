#pragma once

// The head's status (`troupe status`) and drain (`troupe down`):
// head_status.cpp.

#include "actors/head_state.hpp"

namespace troupe::actors::head_detail {

// The head's view of the cluster, less the scheduler's counters (the door
// adds those).
cluster_status status_of(head_ptr self);

// The load figures of a replica's view from its scheduler's counters.
void fill_replica_view(replica_view& v, const scheduler_stats& x);

// Every replica's scheduler that runs.
std::vector<scheduler_actor> schedulers_of(head_ptr self);

// Called on every tick while draining: stops everything once no request
// is queued or running (or after two minutes).
void check_drain(head_ptr self);

}  // namespace troupe::actors::head_detail
