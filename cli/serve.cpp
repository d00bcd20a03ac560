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
#include "serve/grpc_server.hpp"

namespace troupe::cli {

namespace {

struct serve_args {
  std::string manifest, host = "127.0.0.1", api_key, model_name;  ///< empty: the model's own
  int port = 8000;
  int max_body_mib = 64;
  bool remote_images = false, private_image_hosts = false;
  int io_threads = 2, keep_alive_s = 5, drain_s = 10, submit_timeout_ms = 10000;
  std::size_t max_connections = 8192;
  std::size_t max_connections_per_client = 2048;
  std::vector<std::string> cors_origins;
  bool no_access_log = false;
  int grpc_port = -1;  ///< -1: no gRPC; 0: any free port
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
  go.model_name = !a.model_name.empty()        ? a.model_name
                  : m->model.path == "bundled" ? serve::default_served_name(bundled_model_path())
                                               : serve::default_served_name(m->model.path);
  go.version = TROUPE_VERSION;
  go.max_body_bytes = static_cast<std::size_t>(a.max_body_mib) << 20;
  go.limits.remote_images = a.remote_images || a.private_image_hosts;
  // The manifest's [media] limits, checked here first (the head checks them again).
  go.limits.max_images = static_cast<std::size_t>(m->media.max_images);
  go.limits.max_audios = static_cast<std::size_t>(m->media.max_audios);
  go.limits.max_videos = static_cast<std::size_t>(m->media.max_videos);
  go.limits.max_video_frames = static_cast<std::int32_t>(m->media.max_video_frames);
  go.fetch.allow_private = a.private_image_hosts;
  go.io_threads = a.io_threads;
  go.keep_alive = std::chrono::seconds(a.keep_alive_s);
  go.drain = std::chrono::seconds(a.drain_s);
  go.submit_timeout = std::chrono::milliseconds(a.submit_timeout_ms);
  go.max_connections = a.max_connections;
  go.max_connections_per_client = a.max_connections_per_client;
  go.cors_origins = a.cors_origins;
  go.access_log = !a.no_access_log;
  // When the head goes away (down and up, a restart), the gateway finds it
  // again through the manifest.
  go.reconnect = [&sys, m = *m]() {
    return actors::connect_client(sys, m, std::chrono::seconds(3));
  };
  if (!m->standby.empty()) go.failover_window = std::chrono::seconds(30);
  if (a.private_image_hosts)
    actors::logging::of("gateway").warn(
        "image URLs may point at private and loopback addresses (--allow-private-image-hosts)");
  serve::gateway gw(sys, *door, go);
  std::string why;
  if (!gw.bind(why)) {
    actors::logging::of("gateway").error("{}", why);
    return 1;
  }
  // The gRPC request layer, beside HTTP: the same checks, limits and key.
  std::unique_ptr<serve::grpc_server> grpc;
  if (a.grpc_port >= 0) {
    serve::grpc_options g;
    g.host = a.host;
    g.port = a.grpc_port;
    g.api_key = a.api_key;
    g.model_name = go.model_name;
    g.limits = go.limits;
    g.limits.remote_images = false;  // no image URLs over gRPC
    g.max_message_bytes = go.max_body_bytes;
    grpc = std::make_unique<serve::grpc_server>(std::make_shared<actors::client>(sys, *door), g);
    if (!grpc->start(why)) {
      actors::logging::of("gateway").error("{}", why);
      return 1;
    }
  }
  std::thread server([&] { gw.serve(); });
  std::printf("troupe serve: OpenAI-compatible API of cluster %s on http://%s:%d/v1 (head %s)\n",
              m->name.c_str(), a.host.c_str(), gw.port(), m->head.c_str());
  if (grpc)
    std::printf("troupe serve: gRPC (troupe.v1.Generation, grpc.health.v1) on %s:%d\n",
                a.host.c_str(), grpc->port());
  std::fflush(stdout);
  wait_for_stop_signal(sigs);
  // Streams in flight end with an error chunk and [DONE], their requests
  // are cancelled on the cluster; then the process ends.
  exit_after(std::chrono::seconds(a.drain_s + 10), "troupe serve");
  if (grpc) grpc->stop();
  gw.stop();
  server.join();
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
  cmd->add_option("--grpc-port", a->grpc_port,
                  "Also serve gRPC (proto/troupe_generate.proto) on this port (0: any free port; "
                  "printed; default: no gRPC)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", a->api_key, "Require Authorization: Bearer KEY");
  cmd->add_option("--served-model-name", a->model_name,
                  "The model's name in the API; requests naming another get 404 (default: the "
                  "model's folder or file name, less .gguf)");
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
  cmd->add_option("--io-threads", a->io_threads,
                  "Threads that serve every connection (a stream costs no thread)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--max-connections", a->max_connections,
                  "Connections open at once; more are answered 503")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  cmd->add_option("--max-connections-per-client", a->max_connections_per_client,
                  "Of them, from one client address (0: no limit); more are answered 503")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 20));
  cmd->add_option("--keep-alive-s", a->keep_alive_s,
                  "An idle keep-alive connection closes after this")
      ->check(CLI::Range(1, 3600));
  cmd->add_option("--submit-timeout-ms", a->submit_timeout_ms,
                  "A request the head does not take within this long is answered 503")
      ->check(CLI::Range(100, 600000));
  cmd->add_option("--drain-s", a->drain_s,
                  "On SIGTERM/SIGINT: time for streams to end (each gets an error chunk and "
                  "[DONE]; its request is cancelled)")
      ->check(CLI::Range(0, 3600));
  cmd->add_option("--cors-origin", a->cors_origins,
                  "An origin browsers may call the API from ('*': any; repeatable; default: none)");
  cmd->add_flag("--no-access-log", a->no_access_log, "No log line per request");
  return [a] { return run_serve(*a); };
}

}  // namespace troupe::cli
