// Lightweight simulated nodes for the head's load test (issue 28, item 7;
// bench/head_load.sh): each is a CAF node of its own (an actor system with
// one scheduler thread, the manifest's TLS identity) publishing the real
// gatekeeper on its manifest port, behind which a small agent answers the
// head's heartbeats with a fixed report and refuses every order. Several
// hundred run in one process, so that a real head can be driven by 1,000
// of them from a few processes over loopback.
//
//   bench_head_load [--shared] MANIFEST FIRST COUNT
// runs nodes FIRST .. FIRST + COUNT - 1 of the manifest's [[nodes]] (the
// head is never one of them) until SIGINT or SIGTERM. With --shared the
// process is one CAF node: its simulated nodes share one actor system
// (the first one's TLS identity; the head checks a node by its gatekeeper's
// answer, not its TLS name), each still with its own gatekeeper on its own
// port and its own agent, and CAF carries them all over one connection to
// the head. A thousand actor systems (a scheduler, a multiplexer and timers
// each) are more than a 2-core machine runs.
//   bench_head_load --certs MANIFEST
// makes the certificates every node of the manifest needs, and exits.

#include <signal.h>

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <caf/openssl/all.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "actors/gatekeeper.hpp"
#include "actors/protocol.hpp"
#include "cluster/certs.hpp"
#include "cluster/manifest.hpp"

namespace {

using namespace troupe;

actors::node_agent_actor fake_agent(caf::actor_system& sys, const std::string& name) {
  return sys.spawn([name]() -> actors::node_agent_actor::behavior_type {
    auto no = [](const char* what) {
      return actors::make_error(actors::error_code::invalid_request,
                                std::string("a simulated node does not ") + what);
    };
    actors::node_report rep;
    rep.node = name;
    rep.devices = "cpu:0-0 (sim)";
    rep.rss_bytes = 40 << 20;
    rep.probe.device = "cpu:0-0";
    rep.probe.cores = 1;
    rep.probe.gemv_f32 = 10e9;
    rep.probe.gemv_f16 = rep.probe.gemv_q8_0 = rep.probe.gemv_q4_0 = 30e9;
    rep.probe.gemm_f32 = rep.probe.gemm_f16 = rep.probe.gemm_q8_0 = rep.probe.gemm_q4_0 = 100e9;
    rep.probe.memory_bytes = std::int64_t{4} << 30;
    return {
        [no](actors::load_atom, const actors::stage_order&) -> caf::result<actors::stage_handles> {
          return no("hold stages");
        },
        [](actors::drop_atom) { return std::int32_t{0}; },
        [rep](actors::ping_atom) { return rep; },
        [](actors::down_atom) {},
        [no](actors::relink_atom, std::int32_t, const actors::stage_handles&,
             const std::string&) -> caf::result<bool> { return no("hold stages"); },
        [no](actors::connect_atom, const actors::stage_handles&,
             const std::string&) -> caf::result<bool> { return no("have a data plane"); },
        [](actors::drop_stage_atom, std::int32_t) { return std::int32_t{0}; },
        [no](actors::load_enc_atom, const actors::encoder_order&)
            -> caf::result<actors::encoder_actor> { return no("run encoders"); },
        [](actors::drop_enc_atom, const actors::encoder_order&) { return std::int32_t{0}; },
        [no](actors::probe_atom, const actors::tensor_ref&) -> caf::result<std::int64_t> {
          return no("have a data plane");
        },
        [no](actors::load_vault_atom, const actors::vault_order&)
            -> caf::result<actors::kv_vault_actor> { return no("hold a KV store"); },
        [no](actors::tp_atom, std::int32_t, const actors::stage_handles&, const std::string&)
            -> caf::result<bool> { return no("connect a tensor-parallel ring"); },
        [no](actors::tp_atom, std::int32_t, std::int32_t, const actors::stage_handles&,
             const std::string&) -> caf::result<bool> { return no("move a tensor-parallel rank"); },
    };
  });
}

struct sim_node {
  std::unique_ptr<caf::actor_system_config> cfg;
  std::unique_ptr<caf::actor_system> sys;
  actors::node_agent_actor agent;
  actors::gatekeeper_actor gate;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--certs") {
    auto m = cluster::load_manifest(argv[2]);
    if (!m) {
      std::fprintf(stderr, "%s\n", m.error().text().c_str());
      return 2;
    }
    auto made = cluster::ensure_certificates(*m);
    if (!made) {
      std::fprintf(stderr, "certificates: %s\n", made.error().c_str());
      return 1;
    }
    std::printf("made %zu certificate file(s)\n", made->size());
    return 0;
  }
  const bool shared = argc == 5 && std::string(argv[1]) == "--shared";
  if (shared) {
    --argc;
    ++argv;
  }
  if (argc != 4) {
    std::fprintf(stderr,
                 "usage: bench_head_load [--shared] MANIFEST FIRST COUNT | --certs MANIFEST\n");
    return 2;
  }
  auto m = cluster::load_manifest(argv[1]);
  if (!m) {
    std::fprintf(stderr, "%s\n", m.error().text().c_str());
    return 2;
  }
  const auto first = static_cast<std::size_t>(std::atoi(argv[2]));
  const auto count = static_cast<std::size_t>(std::atoi(argv[3]));
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  std::vector<sim_node> nodes;
  // --shared: the one actor system every node of this process uses.
  std::unique_ptr<caf::actor_system_config> one_cfg;
  std::unique_ptr<caf::actor_system> one_sys;
  for (std::size_t i = first; i < first + count && i < m->nodes.size(); ++i) {
    const auto& e = m->nodes[i];
    if (e.name == m->head) continue;
    sim_node n;
    if (!shared || !one_sys) {
      n.cfg = std::make_unique<caf::actor_system_config>();
      actors::configure_runtime(*n.cfg);
      if (auto t = actors::configure_cluster_tls(*n.cfg, *m, e.name); !t) {
        std::fprintf(stderr, "node %s: %s\n", e.name.c_str(), t.error().c_str());
        return 1;
      }
      n.sys = std::make_unique<caf::actor_system>(*n.cfg);
      if (shared) {
        one_cfg = std::move(n.cfg);
        one_sys = std::move(n.sys);
      }
    }
    auto& sys = shared ? *one_sys : *n.sys;
    n.agent = fake_agent(sys, e.name);
    n.gate = actors::spawn_gatekeeper(sys, *m, e.name, n.agent);
    auto port =
        caf::openssl::publish(n.gate, static_cast<std::uint16_t>(e.port), e.host.c_str(), true);
    if (!port) {
      std::fprintf(stderr, "node %s: cannot listen on %s:%d: %s\n", e.name.c_str(), e.host.c_str(),
                   e.port, sys.render(port.error()).c_str());
      return 1;
    }
    nodes.push_back(std::move(n));
  }
  std::printf("bench_head_load: %zu simulated nodes listening%s\n", nodes.size(),
              shared ? " (one actor system)" : "");
  std::fflush(stdout);
  int sig = 0;
  sigwait(&sigs, &sig);
  for (auto& n : nodes) {
    caf::anon_send_exit(n.gate, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(n.agent, caf::exit_reason::user_shutdown);
  }
  std::_Exit(0);  // hundreds of actor systems: no orderly teardown needed
}
