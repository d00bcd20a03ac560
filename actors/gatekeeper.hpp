#pragma once

// A node's gatekeeper and the client side of its handshake. Every
// control-plane connection is mutual TLS (caf_openssl) against the
// cluster CA, but CAF accepts any certificate of that CA and tells actors
// nothing about it. So the gatekeeper, the one actor a node publishes,
// asks every connecting node for a signature over a fresh challenge with
// the key of the certificate that names it (cluster::verify_identity),
// checks the name against the manifest and the protocol version, and only
// then answers with a pass.

#include <chrono>
#include <expected>
#include <string>

#include "actors/protocol.hpp"
#include "cluster/manifest.hpp"

namespace troupe::actors {

/// The gatekeeper of node `self_node` of manifest `m`. A node that passes
/// gets `agent`; a client (cluster::client_identity) gets `door`, and only
/// where `door` is valid (the head).
gatekeeper_actor spawn_gatekeeper(caf::actor_system& sys, const cluster::manifest& m,
                                  const std::string& self_node, node_agent_actor agent = {},
                                  frontdoor_actor door = {});

/// Arms the control plane's guard in this process (actors/control_guard.hpp:
/// BASP lengths bounded before CAF allocates, unfinished TLS handshakes
/// capped per address and in all, and shut down after their deadline).
/// configure_cluster_tls calls it.
void arm_control_guard();

struct control_guard_counters {
  std::uint64_t refused_connections = 0;  ///< over the caps of unfinished handshakes
  std::uint64_t refused_messages = 0;     ///< headers announcing too much
  std::uint64_t expired_handshakes = 0;   ///< shut down past their deadline
  std::size_t pending_handshakes = 0;
  /// This process's own connections to other nodes whose handshake stalled
  /// past join_node's first try: shut down so the node can be joined again.
  std::uint64_t abandoned_connects = 0;
};
control_guard_counters control_guard_stats();

/// Configures `cfg` for mutual TLS as node `node` of `m` (certificate, key
/// and CA from the manifest's certificate directory, checked first: a node
/// refuses to run without them, since caf_openssl would otherwise fall back
/// to anonymous TLS), loads the middleman and caf_openssl's manager, and
/// keeps automatic connections off. Heartbeats detect a hung peer.
std::expected<void, std::string> configure_cluster_tls(caf::actor_system_config& cfg,
                                                       const cluster::manifest& m,
                                                       const std::string& node);

/// Connects (over TLS) to node `target`'s gatekeeper as node `self_node`
/// (or as cluster::client_identity) and passes its handshake. The head
/// passes its `term` (cluster/head_lease.hpp); a node refuses a head that
/// is not the process at the manifest's head address, or whose term is
/// lower than the one it follows (error_code::not_the_head).
std::expected<gate_pass, std::string> join_node(caf::actor_system& sys, const cluster::manifest& m,
                                                const std::string& self_node,
                                                const std::string& target,
                                                std::chrono::milliseconds timeout,
                                                std::uint64_t term = 0);

}  // namespace troupe::actors
