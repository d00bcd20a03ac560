// troupe worker: serves the last layers of a model to another process's
// pipeline. It loads layers [first, L) as one stage (shard + KV store) on
// its device, attaches a UCX transfer engine (activations arrive there)
// and publishes a stage host actor over CAF; `troupe run --remote-stage
// HOST:PORT` feeds it. It runs until SIGINT or SIGTERM.
#include <signal.h>
#include <spdlog/spdlog.h>

#include <caf/io/all.hpp>
#include <cstdio>

#include "actors/data_plane.hpp"
#include "actors/device.hpp"
#include "actors/device_spec.hpp"
#include "actors/protocol.hpp"
#include "actors/stage.hpp"
#include "cli/commands.hpp"
#include "cli/model_setup.hpp"
#include "transport/ucx_engine.hpp"

namespace troupe::cli {

namespace {

struct worker_args {
  std::string model, device = "cpu", quant, kv_type = "f32", tls, net_devices;
  std::vector<std::string> overrides;
  int first_layer = -1;
  int port = 0;
  std::int64_t ctx_tokens = 8192;
};

int run_worker(const worker_args& a) {
  const std::string model = a.model.empty() ? bundled_model_path() : a.model;
  auto plan = parse_quant_flags(a.quant, a.overrides);
  auto kv_type = parse_kv_type(a.kv_type);
  auto devs = actors::parse_devices(a.device);
  if (!plan || !kv_type || !devs || devs->size() != 1) {
    spdlog::error("worker: {}", !plan ? plan.error().message : !kv_type ? kv_type.error().message
                                                          : !devs ? devs.error().message : "--device takes one device");
    return 2;
  }
  auto cfg = actors::model_text_config(model);
  if (!cfg) {
    spdlog::error("worker: {}", cfg.error().message);
    return 1;
  }
  const int L = static_cast<int>(cfg->num_layers);
  if (a.first_layer < 1 || a.first_layer >= L) {
    spdlog::error("worker: --first-layer must be in [1, {}) for this {}-layer model", L, L);
    return 2;
  }
  models::layer_range range;
  range.first = a.first_layer;
  range.last = L;
  range.embed = false;
  range.head = true;
  models::kv_options kv;
  kv.type = *kv_type;
  kv.capacity_tokens = a.ctx_tokens;
  auto res = actors::make_stage(actors::device_context::create(devs->front()), model, range, *plan, kv);
  if (!res) {
    spdlog::error("worker: layers [{},{}): {}", range.first, range.last, res.error().message);
    return 1;
  }
  transport::ucx_options uo;
  uo.tls = a.tls;
  uo.net_devices = a.net_devices;
  auto engine = transport::ucx_engine::create(uo);
  if (!engine) {
    spdlog::error("worker: {}", engine.error().message);
    return 1;
  }
  auto& dp = actors::data_plane::local();
  dp.attach(std::shared_ptr<transport::transfer_engine>(std::move(*engine)));

  // SIGINT/SIGTERM end the worker: block them in every thread, wait below.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  caf::actor_system_config cc;
  actors::configure_runtime(cc);
  cc.load<caf::io::middleman>();
  caf::actor_system sys{cc};
  auto kv_store = actors::spawn_kv_store(sys, *res);
  auto shard = actors::spawn_shard(sys, *res, actors::shard_actor{});
  actors::stage_handles handles{shard, kv_store, range.first, range.last, dp.address()};
  auto host = sys.spawn([handles]() -> actors::stage_host_actor::behavior_type {
    return {
        [=](actors::stage_atom) {
          // A front joined: said on stdout too, so scripts can wait for it.
          std::printf("troupe worker: serving layers [%d,%d) to a front\n", handles.first_layer, handles.last_layer);
          std::fflush(stdout);
          return handles;
        },
        [](actors::version_atom) { return actors::protocol_version; },
    };
  });
  auto port = sys.middleman().publish(host, static_cast<std::uint16_t>(a.port), nullptr, true);
  if (!port) {
    spdlog::error("worker: cannot listen on port {}: {}", a.port, sys.render(port.error()));
    caf::anon_send_exit(shard, caf::exit_reason::kill);
    caf::anon_send_exit(kv_store, caf::exit_reason::kill);
    caf::anon_send_exit(host, caf::exit_reason::kill);
    return 1;
  }
  // Connections accepted from the listening socket inherit TCP_NODELAY.
  actors::enable_tcp_nodelay_everywhere();
  std::printf("troupe worker: layers [%d,%d) on %s, listening on port %u\n", range.first, range.last,
              devs->front().name.c_str(), static_cast<unsigned>(*port));
  std::fflush(stdout);
  int sig = 0;
  sigwait(&sigs, &sig);
  std::printf("troupe worker: stopping (signal %d)\n", sig);
  caf::anon_send_exit(host, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(shard, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(kv_store, caf::exit_reason::user_shutdown);
  return 0;
}

}  // namespace

command_runner add_worker(CLI::App& app) {
  auto a = std::make_shared<worker_args>();
  auto* cmd = app.add_subcommand("worker", "Serve the last layers of a model to another process's pipeline (troupe run --remote-stage)");
  cmd->add_option("--model,-m", a->model, "GGUF file or Hugging Face folder (default: the bundled tiny LLaVA)");
  cmd->add_option("--first-layer", a->first_layer, "First decoder layer this worker serves (it serves the rest)")->required();
  cmd->add_option("--port", a->port, "TCP port for CAF (0: any free port; printed)")->check(CLI::Range(0, 65535));
  cmd->add_option("--device", a->device, "Device: cpu, cpu:N or cpu:A-B");
  cmd->add_option("--quant", a->quant, "Weight format (as troupe generate)");
  cmd->add_option("--quant-override", a->overrides, "PATTERN=FORMAT on tensor names");
  cmd->add_option("--kv-type", a->kv_type, "KV cache type: f32, f16, int8");
  cmd->add_option("--ctx", a->ctx_tokens, "KV cache capacity in tokens")->check(CLI::Range(16, 1 << 24));
  cmd->add_option("--tls", a->tls, "UCX transports for activations (e.g. tcp; default: UCX's choice)");
  cmd->add_option("--net-devices", a->net_devices, "UCX network devices (e.g. eth0)");
  return [a] { return run_worker(*a); };
}

}  // namespace troupe::cli
