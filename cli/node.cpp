// troupe node --manifest M --name N: the node daemon. It refuses to start
// without its certificate, key and the cluster CA (caf_openssl would
// otherwise fall back to anonymous TLS), publishes only its gatekeeper,
// over mutual TLS, on the manifest's address for it, and runs until
// SIGINT/SIGTERM (or the head's `down`). Behind the gatekeeper: its agent
// (stages the head places here) and, on the head node, the head (see
// actors/cluster.hpp). With --ping T it instead acts as node N once: it
// joins node T's gatekeeper and says whether T let it in.
#include <signal.h>
#include <spdlog/spdlog.h>

#include <caf/io/all.hpp>
#include <caf/openssl/all.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "actors/cluster.hpp"
#include "actors/cluster_common.hpp"
#include "actors/data_plane.hpp"
#include "actors/gatekeeper.hpp"
#include "actors/log.hpp"
#include "actors/protocol.hpp"
#include "cli/cluster_setup.hpp"
#include "cli/commands.hpp"
#include "cli/daemon.hpp"
#include "cluster/certs.hpp"
#include "cluster/manifest.hpp"
#include "transport/fault_engine.hpp"
#include "transport/ucx_engine.hpp"

namespace troupe::cli {

namespace {

/// The fault rules TROUPE_DATA_PLANE_FAULTS gives node `name` ("NODE=RULES"
/// entries separated by ';'); none when it names other nodes only.
transport::result<std::vector<transport::fault_rule>> faults_for(std::string_view env,
                                                                 const std::string& name) {
  while (!env.empty()) {
    const auto end = env.find(';');
    const auto entry = env.substr(0, end);
    const auto eq = entry.find('=');
    if (eq == std::string_view::npos)
      return kernels::make_error(kernels::errc::invalid_argument,
                                 "expected NODE=RULES entries separated by ';'");
    if (entry.substr(0, eq) == name) return transport::parse_fault_rules(entry.substr(eq + 1));
    if (end == std::string_view::npos) break;
    env.remove_prefix(end + 1);
  }
  return std::vector<transport::fault_rule>{};
}

struct node_args {
  std::string manifest, name, ping;
};

int run_node(const node_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  const auto* me = m->node(a.name);
  if (!me) {
    spdlog::error("node: '{}' is not a node of {}", a.name, a.manifest);
    return 2;
  }
  actors::logging::set_node(a.name);  // every line of this process carries its name
  const sigset_t sigs = block_stop_signals();

  caf::actor_system_config cfg;
  actors::configure_runtime(cfg);
  if (auto t = actors::configure_cluster_tls(cfg, *m, a.name); !t) {
    spdlog::error("node {}: refusing to start: {}", a.name, t.error());
    return 1;
  }
  if (!a.ping.empty()) {
    caf::actor_system sys{cfg};
    auto pass = actors::join_node(sys, *m, a.name, a.ping,
                                  std::chrono::milliseconds(m->transport.timeout_ms));
    if (!pass) {
      spdlog::error("node {}: {}", a.name, pass.error());
      return 1;
    }
    std::printf("node %s: joined node %s of cluster %s (protocol %u)\n", a.name.c_str(),
                pass->node.c_str(), pass->cluster.c_str(), pass->version);
    return 0;
  }
  auto nc = node_config_of(*m, a.name);
  if (!nc) {
    spdlog::error("node {}: {}", a.name, nc.error().message);
    return 2;
  }
  // The node's device, opened once for every actor placed on it: a GPU the
  // manifest names but this machine lacks is refused here, at start.
  if (auto dev = actors::cluster_detail::device_for(nc->device); !dev) {
    spdlog::error("node {}: refusing to start: {}", a.name, dev.error().message);
    return 2;
  }
  // The data plane: activations between stages go over UCX, to peers whose
  // addresses came over the authenticated control plane.
  // Only holders of the cluster's data-plane key get to speak UCP to this
  // process (transport/ucx_gate.hpp), and UCX's TCP transport listens on
  // the interface of the manifest's address only, unless the manifest
  // names the devices itself.
  transport::ucx_options uo;
  uo.tls = m->transport.tls;
  uo.net_devices = m->transport.net_devices;
  if (uo.net_devices.empty()) {
    auto dev = transport::net_device_for_host(me->host);
    if (!dev) {
      spdlog::error("node {}: refusing to start: the data plane: {}", a.name, dev.error().message);
      return 1;
    }
    uo.net_devices = *dev;
  }
  auto key = cluster::read_data_plane_key(*m);
  if (!key) {
    spdlog::error("node {}: refusing to start: {}", a.name, key.error());
    return 1;
  }
  uo.access_key = *key;
  auto engine = transport::ucx_engine::create(uo);
  if (!engine) {
    spdlog::error("node {}: {}", a.name, engine.error().message);
    return 1;
  }
  std::shared_ptr<transport::transfer_engine> plane(std::move(*engine));
  // A testing aid: TROUPE_DATA_PLANE_FAULTS="NODE=RULES;NODE=RULES" wraps
  // this node's engine in transport::fault_engine with its RULES
  // (transport/fault_engine.hpp), for tests of migration and failover.
  if (const char* env = std::getenv("TROUPE_DATA_PLANE_FAULTS")) {
    auto rules = faults_for(env, a.name);
    if (!rules) {
      spdlog::error("node {}: TROUPE_DATA_PLANE_FAULTS: {}", a.name, rules.error().message);
      return 2;
    }
    if (!rules->empty()) {
      auto faulty = std::make_shared<transport::fault_engine>(plane);
      for (const auto& r : *rules) faulty->inject(r);
      plane = std::move(faulty);
      spdlog::warn("node {}: {} data-plane fault rule(s) injected (a testing aid)", a.name,
                   rules->size());
    }
  }
  actors::data_plane::local().attach(std::move(plane));

  caf::actor_system sys{cfg};
  auto agent = actors::spawn_node_agent(sys, *nc);
  actors::frontdoor_actor door;
  // The head, and the standby head ([cluster] standby), which follows it
  // and takes over when it is lost.
  const bool standby = !m->standby.empty() && a.name == m->standby;
  if (a.name == m->head || standby) {
    actors::head_config hc;
    hc.standby = standby;
    hc.node = *nc;
    hc.scheduler.queue_limit = m->scheduler.queue_limit;
    hc.scheduler.max_running = m->scheduler.max_running;
    hc.scheduler.token_budget = m->scheduler.token_budget;
    hc.scheduler.micro_batches = m->scheduler.micro_batches;
    hc.scheduler.context.max_model_len = m->scheduler.max_model_len;
    hc.scheduler.context.allow_long = m->scheduler.allow_long_context;
    hc.scheduler.prefix_caching = m->scheduler.prefix_caching;
    hc.scheduler.stream_idle_ms =
        static_cast<std::int64_t>(std::llround(m->scheduler.stream_idle_s * 1000));
    hc.startup_grace =
        std::chrono::milliseconds(static_cast<std::int64_t>(m->placement.wait_for_nodes_s * 1000));
    auto d = actors::spawn_head(sys, hc, agent);
    if (!d) {
      spdlog::error("node {} (head): {}", a.name, d.error().message);
      caf::anon_send_exit(agent, caf::exit_reason::kill);
      return 1;
    }
    door = *d;
  }
  auto gk = actors::spawn_gatekeeper(sys, *m, a.name, agent, door);
  auto stop = [&](caf::exit_reason why) {
    caf::anon_send_exit(gk, why);
    if (door) caf::anon_send_exit(door, why);
    caf::anon_send_exit(agent, why);
  };
  auto port =
      caf::openssl::publish(gk, static_cast<std::uint16_t>(me->port), me->host.c_str(), true);
  if (!port) {
    spdlog::error("node {}: cannot listen on {}:{}: {}", a.name, me->host, me->port,
                  sys.render(port.error()));
    stop(caf::exit_reason::kill);
    return 1;
  }
  actors::enable_tcp_nodelay_everywhere();  // step messages must not wait for Nagle
  std::printf("troupe node %s: cluster %s, listening on %s:%u (mutual TLS)%s\n", a.name.c_str(),
              m->name.c_str(), me->host.c_str(), static_cast<unsigned>(*port),
              standby ? ", standby head"
              : door  ? ", head"
                      : "");
  std::fflush(stdout);
  const int sig = wait_for_stop_signal(sigs);
  std::printf("troupe node %s: stopping (signal %d)\n", a.name.c_str(), sig);
  std::fflush(stdout);
  stop(caf::exit_reason::user_shutdown);
  exit_after(std::chrono::seconds(5), "troupe node " + a.name);
  return 0;
}

}  // namespace

command_runner add_node(CLI::App& app) {
  auto a = std::make_shared<node_args>();
  auto* cmd = app.add_subcommand("node", "Run a cluster node (mutual TLS; see docs/manifest.md)");
  cmd->add_option("--manifest", a->manifest, "The cluster's manifest")->required();
  cmd->add_option("--name", a->name, "This node's name in the manifest")->required();
  cmd->add_option("--ping", a->ping, "Act as --name once: join node PING's gatekeeper and report");
  return [a] { return run_node(*a); };
}

}  // namespace troupe::cli
