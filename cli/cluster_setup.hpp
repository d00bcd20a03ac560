#pragma once

// What the cluster commands (troupe certs, node, up, status, submit, down)
// share: reading the manifest with its errors reported, and turning a
// node's manifest entry into what its agent loads.

#include <memory>
#include <optional>
#include <string>

#include "actors/cluster.hpp"
#include "cluster/manifest.hpp"
#include "kernels/status.hpp"

namespace troupe::cli {

/// The manifest at `path`, or nothing after printing every error in it
/// (line-numbered) to stderr: the caller exits 2.
std::optional<cluster::manifest> load_manifest_or_report(const std::string& path);

/// Node `name`'s stage configuration: its model (the bundled one for
/// "bundled"), its first device, the precision and KV layout of the
/// manifest. Errors name the manifest key.
kernels::result<actors::node_config> node_config_of(const cluster::manifest& m,
                                                    const std::string& name);

/// A client of a running cluster (the client certificate, the head's door),
/// as `troupe status`, `migrate` and `bench --migrate` use it.
struct client_session {
  caf::actor_system_config cfg;  // before the system, which refers to it until it is gone
  std::unique_ptr<caf::actor_system> sys;
  actors::frontdoor_actor door;
};
/// Connects to the cluster of `m`, or nothing after logging why (prefixed
/// with `what`).
std::unique_ptr<client_session> open_client(const cluster::manifest& m, const std::string& what);

}  // namespace troupe::cli
