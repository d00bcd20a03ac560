#include "actors/cluster_client.hpp"

#include <memory>

#include "actors/gatekeeper.hpp"
#include "cluster/certs.hpp"

namespace troupe::actors {

std::expected<frontdoor_actor, std::string> connect_client(caf::actor_system& sys,
                                                           const cluster::manifest& m,
                                                           std::chrono::milliseconds timeout) {
  // The head, else its standby once it took over (before, it serves
  // nothing: a client waiting for the head to come up keeps waiting).
  std::string why;
  for (const auto& name : {m.head, m.standby}) {
    if (name.empty()) continue;
    auto pass = join_node(sys, m, cluster::client_identity, name, timeout);
    std::string one;
    if (!pass) {
      one = pass.error();
    } else if (!pass->door) {
      one = "node " + name + " handed out no door (is it the head of cluster " + m.name + "?)";
    } else if (m.standby.empty()) {
      return pass->door;
    } else if (auto s = query_status(sys, pass->door, timeout); !s) {
      one = "node " + name + ": " + s.error();
    } else if (s->head != name) {
      // A standby (the manifest's head too, restarted after its standby
      // took over) names the head it follows.
      one = "node " + name + " does not serve as the head (" + s->standby + ")";
    } else {
      return pass->door;
    }
    why += (why.empty() ? "" : "; ") + one;
  }
  return std::unexpected(why);
}

std::expected<cluster_status, std::string> query_status(caf::actor_system& sys,
                                                        const frontdoor_actor& door,
                                                        std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  std::expected<cluster_status, std::string> out = std::unexpected(std::string("no answer"));
  self->request(door, timeout, status_atom::value)
      .receive([&](cluster_status& s) { out = std::move(s); },
               [&](caf::error& e) { out = std::unexpected(describe(sys, e)); });
  return out;
}

std::expected<migrate_report, std::string> migrate_shard(caf::actor_system& sys,
                                                         const frontdoor_actor& door,
                                                         migrate_request req,
                                                         std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  std::expected<migrate_report, std::string> out = std::unexpected(std::string("no answer"));
  self->request(door, timeout, migrate_atom::value, std::move(req))
      .receive([&](migrate_report& r) { out = std::move(r); },
               [&](caf::error& e) { out = std::unexpected(describe(sys, e)); });
  return out;
}

std::expected<std::string, std::string> scale_replicas(caf::actor_system& sys,
                                                       const frontdoor_actor& door,
                                                       std::int32_t replicas,
                                                       std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  std::expected<std::string, std::string> out = std::unexpected(std::string("no answer"));
  self->request(door, timeout, scale_atom::value, replicas)
      .receive([&](std::string& r) { out = std::move(r); },
               [&](caf::error& e) { out = std::unexpected(describe(sys, e)); });
  return out;
}

}  // namespace troupe::actors
