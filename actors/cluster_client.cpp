#include "actors/cluster_client.hpp"

#include <memory>

#include "actors/gatekeeper.hpp"
#include "cluster/certs.hpp"

namespace troupe::actors {

std::expected<frontdoor_actor, std::string> connect_client(caf::actor_system& sys,
                                                           const cluster::manifest& m,
                                                           std::chrono::milliseconds timeout) {
  auto pass = join_node(sys, m, cluster::client_identity, m.head, timeout);
  if (!pass) return std::unexpected(pass.error());
  if (!pass->door)
    return std::unexpected("node " + m.head + " handed out no door (is it the head of cluster " +
                           m.name + "?)");
  return pass->door;
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
