// troupe serve MANIFEST [--host H] [--port P] [--api-key KEY]: the
// OpenAI-compatible HTTP gateway in front of a running cluster (a client
// of its head; see serve/gateway.hpp). Runs until SIGINT/SIGTERM.
#include <spdlog/spdlog.h>

#include <caf/io/all.hpp>
#include <cstdio>
#include <thread>

#include "actors/cluster.hpp"
#include "actors/gatekeeper.hpp"
#include "actors/log.hpp"
#include "cli/cluster_setup.hpp"
#include "cli/commands.hpp"
#include "cli/daemon.hpp"
#include "cluster/certs.hpp"
#include "serve/gateway.hpp"

namespace troupe::cli {

namespace {

struct serve_args {
  std::string manifest, host = "127.0.0.1", api_key, model_name = "troupe";
  int port = 8000;
  int max_body_mib = 64;
  bool remote_images = false, private_image_hosts = false;
};

int run_serve(const serve_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  if (a.host == "0.0.0.0" || a.host == "::")
    actors::logging::of("gateway").warn(
        "listening on every interface ({}); anyone who reaches this machine reaches the API{}",
        a.host, a.api_key.empty() ? ", and no --api-key is set" : "");
  const sigset_t sigs = block_stop_signals();
  caf::actor_system_config cfg;
  actors::configure_runtime(cfg);
  if (auto t = actors::configure_cluster_tls(cfg, *m, cluster::client_identity); !t) {
    actors::logging::of("gateway").error("{}", t.error());
    return 1;
  }
  caf::actor_system sys{cfg};
  auto door = actors::connect_client(sys, *m, std::chrono::seconds(10));
  if (!door) {
    actors::logging::of("gateway").error("{}", door.error());
    return 1;
  }
  serve::gateway_options go;
  go.host = a.host;
  go.port = a.port;
  go.api_key = a.api_key;
  go.model_name = a.model_name;
  go.max_body_bytes = static_cast<std::size_t>(a.max_body_mib) << 20;
  go.limits.remote_images = a.remote_images || a.private_image_hosts;
  go.fetch.allow_private = a.private_image_hosts;
  if (a.private_image_hosts)
    actors::logging::of("gateway").warn(
        "image URLs may point at private and loopback addresses (--allow-private-image-hosts)");
  serve::gateway gw(sys, *door, go);
  std::string why;
  if (!gw.bind(why)) {
    actors::logging::of("gateway").error("{}", why);
    return 1;
  }
  std::thread server([&] { gw.serve(); });
  std::printf("troupe serve: OpenAI-compatible API of cluster %s on http://%s:%d/v1 (head %s)\n",
              m->name.c_str(), a.host.c_str(), gw.port(), m->head.c_str());
  std::fflush(stdout);
  wait_for_stop_signal(sigs);
  gw.stop();
  server.join();
  exit_after(std::chrono::seconds(5), "troupe serve");
  return 0;
}

}  // namespace

command_runner add_serve(CLI::App& app) {
  auto a = std::make_shared<serve_args>();
  auto* cmd =
      app.add_subcommand("serve", "OpenAI-compatible HTTP API in front of a running cluster");
  cmd->add_option("manifest", a->manifest, "The cluster's manifest")->required();
  cmd->add_option("--host", a->host, "Address to listen on (default loopback)");
  cmd->add_option("--port", a->port, "Port (0: any free port; printed)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", a->api_key, "Require Authorization: Bearer KEY");
  cmd->add_option("--served-model-name", a->model_name, "The model's name in the API");
  // A job travels to the head as one control-plane message, at most 128 MiB
  // (actors/control_guard.hpp): 96 MiB of body leaves room for it.
  cmd->add_option("--max-body-mib", a->max_body_mib,
                  "Largest request body, MiB, 1 to 96 (larger: 413)")
      ->check(CLI::Range(1, 96));
  cmd->add_flag(
      "--allow-remote-images", a->remote_images,
      "Fetch http(s) image URLs (only from public addresses; off: base64 data: URLs only)");
  cmd->add_flag(
      "--allow-private-image-hosts", a->private_image_hosts,
      "With remote images: also from loopback and private addresses (a trusted intranet only)");
  return [a] { return run_serve(*a); };
}

}  // namespace troupe::cli
