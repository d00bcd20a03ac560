#include "cli/cluster_setup.hpp"

#include <spdlog/spdlog.h>

#include <cstdio>

#include "actors/gatekeeper.hpp"
#include "actors/runtime.hpp"
#include "cli/commands.hpp"
#include "cli/model_setup.hpp"
#include "cluster/certs.hpp"

namespace troupe::cli {

std::optional<cluster::manifest> load_manifest_or_report(const std::string& path) {
  auto m = cluster::load_manifest(path);
  if (!m) {
    std::fprintf(stderr, "%s", m.error().text().c_str());
    return std::nullopt;
  }
  return std::move(*m);
}

kernels::result<actors::node_config> node_config_of(const cluster::manifest& m,
                                                    const std::string& name) {
  using kernels::errc;
  const auto* n = m.node(name);
  if (!n)
    return kernels::make_error(errc::invalid_argument, "'" + name + "' is not a node of " + m.path);
  actors::node_config c;
  c.m = m;
  c.name = name;
  c.model = m.model_path_of(*n);
  if (c.model == "bundled") c.model = bundled_model_path();
  if (n->devices.empty())
    return kernels::make_error(errc::invalid_argument,
                               m.path + ": node " + name + " has no devices");
  const auto& d = n->devices.front();
  auto devs = actors::parse_devices(d.spec());
  if (!devs || devs->size() != 1)
    return kernels::make_error(errc::invalid_argument,
                               m.path + ":" + std::to_string(d.line) + ": node " + name +
                                   ": device " + d.spec() + ": " +
                                   (devs ? std::string("not one device") : devs.error().message));
  c.device = devs->front();
  c.memory_limit = static_cast<std::int64_t>(d.memory_bytes);
  std::vector<std::string> overrides;
  for (const auto& [pattern, format] : m.model.overrides)
    overrides.push_back(pattern + "=" + format);
  auto plan = parse_quant_flags(m.model.quant, overrides);
  if (!plan)
    return kernels::make_error(errc::invalid_argument,
                               m.path + ": model.quant / model.overrides: " + plan.error().message);
  c.plan = *plan;
  auto kv = parse_kv_type(m.model.kv_type);
  if (!kv)
    return kernels::make_error(errc::invalid_argument,
                               m.path + ": model.kv_type: " + kv.error().message);
  c.kv.type = *kv;
  c.kv.capacity_tokens = m.model.ctx_tokens;
  c.kv.tiers = {m.kv.host_tokens, m.kv.disk_tokens, m.kv.disk_dir, m.kv.store_tokens};
  c.timeout = std::chrono::milliseconds(m.transport.timeout_ms);
  return c;
}

std::unique_ptr<client_session> open_client(const cluster::manifest& m, const std::string& what) {
  auto c = std::make_unique<client_session>();
  actors::configure_runtime(c->cfg);
  if (auto t = actors::configure_cluster_tls(c->cfg, m, cluster::client_identity); !t) {
    spdlog::error("{}: {} (make them with `troupe certs {}`)", what, t.error(), m.path);
    return nullptr;
  }
  c->sys = std::make_unique<caf::actor_system>(c->cfg);
  auto door = actors::connect_client(*c->sys, m, std::chrono::seconds(5));
  if (!door) {
    spdlog::error("{}: {}", what, door.error());
    return nullptr;
  }
  c->door = *door;
  return c;
}

}  // namespace troupe::cli
