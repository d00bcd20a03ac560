#pragma once

// A client of the cluster (the CLI's run, status, migrate and down; the
// HTTP gateway): joins the head's gatekeeper and talks to its door. Jobs go
// through actors::client (client.hpp), as requests to a local scheduler do.

#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <optional>
#include <string>

#include "actors/client.hpp"
#include "actors/protocol.hpp"
#include "cluster/manifest.hpp"

namespace troupe::actors {

/// Joins the head's gatekeeper as a client and returns its door.
std::expected<frontdoor_actor, std::string> connect_client(caf::actor_system& sys,
                                                           const cluster::manifest& m,
                                                           std::chrono::milliseconds timeout);

/// The head's view of the cluster (`troupe status`), or why there is none.
std::expected<cluster_status, std::string> query_status(caf::actor_system& sys,
                                                        const frontdoor_actor& door,
                                                        std::chrono::milliseconds timeout);

/// Asks the head to migrate a shard live (`troupe migrate`); the report, or why not.
std::expected<migrate_report, std::string> migrate_shard(caf::actor_system& sys,
                                                         const frontdoor_actor& door,
                                                         migrate_request req,
                                                         std::chrono::milliseconds timeout);

/// Asks the head to run `replicas` replicas (`troupe scale`): what it
/// does, or why not.
std::expected<std::string, std::string> scale_replicas(caf::actor_system& sys,
                                                       const frontdoor_actor& door,
                                                       std::int32_t replicas,
                                                       std::chrono::milliseconds timeout);

}  // namespace troupe::actors
