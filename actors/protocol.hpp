#pragma once

// Every message and every typed actor interface of troupe's runtime, in one
// place. Messages are small control structs; tensors never travel inside
// them: a message carries a `tensor_ref` that names a buffer held by the
// data plane (actors/data_plane.hpp: parked in this process, pushed to others).
//
// Bump `protocol_version` whenever a message's fields or an interface change.
//
// The parts, each message's `inspect` beside its struct:
// - protocol/base.hpp: version, atoms, errors;
// - protocol/messages.hpp: requests, steps, KV, encoders and their actors;
// - protocol/cluster.hpp: gatekeeper, nodes, head, clients.

#include "actors/protocol/cluster.hpp"

namespace troupe::actors {

/// Registers every message type above (needed to serialize them: between
/// processes, and in the round-trip test).
void register_protocol(caf::actor_system_config& cfg);

/// register_protocol plus the runtime's scheduler settings: one CAF worker
/// thread (the scheduler and client sinks are light; compute runs on the
/// device actors' own pinned threads) that polls briefly before sleeping, so
/// idle CAF workers do not take cycles from the devices' cores.
void configure_runtime(caf::actor_system_config& cfg);

}  // namespace troupe::actors
