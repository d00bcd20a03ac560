// troupe worker: serves part of a model to another process.
// - Pipeline (--first-layer N): it loads layers [N, L) as one stage (shard
//   + KV store) on its device; `troupe run --remote-stage HOST:PORT` feeds
//   it activations.
// - Tensor parallel (--tp-rank R --tp-size K): it loads slice R of K of
//   every layer; `troupe run --tp-peer HOST:PORT` (rank 0) sends it every
//   step and the ring of the group's all-reduces.
// Either way it attaches a UCX transfer engine (tensors arrive there) and
// publishes a stage host actor over CAF. It runs until SIGINT or SIGTERM.
#include <signal.h>
#include <spdlog/spdlog.h>

#include <caf/io/all.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "actors/data_plane.hpp"
#include "actors/device.hpp"
#include "actors/device_spec.hpp"
#include "actors/protocol.hpp"
#include "actors/stage.hpp"
#include "cli/commands.hpp"
#include "cli/daemon.hpp"
#include "cli/model_setup.hpp"
#include "transport/ucx_engine.hpp"

namespace troupe::cli {

namespace {

struct worker_args {
  std::string model, device = "cpu", quant, kv_type = "f32", tls, net_devices;
  std::vector<std::string> overrides;
  int first_layer = -1;
  int tp_rank = -1, tp_size = 0;
  int port = 0;
  std::int64_t ctx_tokens = 8192;
};

int run_worker(const worker_args& a) {
  const std::string model = a.model.empty() ? bundled_model_path() : a.model;
  auto precision = parse_precision_flags(a.quant, a.overrides, a.kv_type);
  auto devs = actors::parse_devices(a.device);
  if (!precision || !devs || devs->size() != 1) {
    spdlog::error("worker: {}", !precision ? precision.error().message
                                : !devs    ? devs.error().message
                                           : "--device takes one device");
    return 2;
  }
  auto cfg = actors::model_text_config(model);
  if (!cfg) {
    spdlog::error("worker: {}", cfg.error().message);
    return 1;
  }
  const int L = static_cast<int>(cfg->num_layers);
  const bool tp = a.tp_size > 0 || a.tp_rank >= 0;
  std::shared_ptr<actors::tp_group> group;
  models::layer_range range;
  if (tp) {
    if (a.first_layer >= 0) {
      spdlog::error(
          "worker: --first-layer (a pipeline stage) and --tp-rank (a tensor-parallel rank) exclude "
          "each other");
      return 2;
    }
    if (a.tp_size < 2 || a.tp_rank < 1 || a.tp_rank >= a.tp_size) {
      spdlog::error(
          "worker: a tensor-parallel worker needs --tp-size K >= 2 and --tp-rank in [1, K) (rank 0 "
          "is the front)");
      return 2;
    }
    group = std::make_shared<actors::tp_group>();
    group->rank = a.tp_rank;
    group->size = a.tp_size;
  } else {
    if (a.first_layer < 1 || a.first_layer >= L) {
      spdlog::error("worker: --first-layer must be in [1, {}) for this {}-layer model", L, L);
      return 2;
    }
    range.first = a.first_layer;
    range.embed = false;
  }
  range.last = L;
  models::kv_options kv;
  kv.type = precision->kv_type;
  kv.capacity_tokens = a.ctx_tokens;
  auto dev = actors::open_device(devs->front());
  if (!dev) {
    spdlog::error("worker: {}", dev.error().message);
    return 1;
  }
  auto res = actors::make_stage(devs->front(), *dev, model, range, precision->plan, kv, group);
  if (!res) {
    if (tp)
      spdlog::error("worker: tensor-parallel rank {} of {}: {}", a.tp_rank, a.tp_size,
                    res.error().message);
    else
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

  // SIGINT/SIGTERM end the worker: blocked in every thread, waited for below.
  const sigset_t sigs = block_stop_signals();

  caf::actor_system_config cc;
  actors::configure_runtime(cc);
  cc.load<caf::io::middleman>();
  caf::actor_system sys{cc};
  auto kv_store = actors::spawn_kv_store(sys, *res);
  auto shard = actors::spawn_shard(sys, *res, actors::shard_actor{});
  actors::stage_handles handles{shard,        kv_store,           range.first,       range.last,
                                dp.address(), tp ? a.tp_rank : 0, tp ? a.tp_size : 1};
  auto host = sys.spawn([handles, group,
                         stage = *res]() -> actors::stage_host_actor::behavior_type {
    return {
        [=](actors::stage_atom) {
          // A front joined: said on stdout too, so scripts can wait for it.
          std::printf("troupe worker: serving layers [%d,%d) to a front\n", handles.first_layer,
                      handles.last_layer);
          std::fflush(stdout);
          return handles;
        },
        [=](actors::tp_atom, const actors::tp_ring_addresses& ring) -> caf::result<std::int32_t> {
          if (!group)
            return actors::make_error(
                actors::error_code::invalid_request,
                "this worker is a pipeline stage, not a tensor-parallel rank");
          if (static_cast<int>(ring.size()) != group->size)
            return actors::make_error(actors::error_code::invalid_request,
                                      "a ring of " + std::to_string(ring.size()) +
                                          " ranks for a group of " + std::to_string(group->size));
          // A (new) front: the next rank's address, and an empty KV cache
          // (what an earlier front left is of no use).
          auto& dp = actors::data_plane::local();
          const auto& next = ring[static_cast<std::size_t>((group->rank + 1) % group->size)];
          const std::string key = "tp-next:" + std::string(next.begin(), next.end());
          if (auto c = dp.connect(key, next); !c)
            return actors::make_error(actors::error_code::stage_failed,
                                      "connecting the all-reduce ring: " + c.error().message);
          {
            std::lock_guard lock(stage->kv->mtx);
            for (auto& [s, l] : stage->kv->local) stage->kv->cache.release(l);
            stage->kv->local.clear();
          }
          group->ring.engine = dp.engine().get();
          group->ring.rank = group->rank;
          group->ring.size = group->size;
          group->ring.next = *dp.peer(key);
          group->ring.abort = &group->broken;
          group->ring.stats = &group->allreduce;
          group->broken = false;
          std::printf("troupe worker: tensor-parallel rank %d of %d joined its ring\n", group->rank,
                      group->size);
          std::fflush(stdout);
          return static_cast<std::int32_t>(group->rank);
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
  if (tp)
    std::printf(
        "troupe worker: tensor-parallel rank %d of %d, layers [%d,%d) on %s, listening on port "
        "%u\n",
        a.tp_rank, a.tp_size, range.first, range.last, devs->front().name.c_str(),
        static_cast<unsigned>(*port));
  else
    std::printf("troupe worker: layers [%d,%d) on %s, listening on port %u\n", range.first,
                range.last, devs->front().name.c_str(), static_cast<unsigned>(*port));
  std::fflush(stdout);
  const int sig = wait_for_stop_signal(sigs);
  std::printf("troupe worker: stopping (signal %d)\n", sig);
  caf::anon_send_exit(host, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(shard, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(kv_store, caf::exit_reason::user_shutdown);
  exit_after(std::chrono::seconds(5), "troupe worker");
  return 0;
}

}  // namespace

command_runner add_worker(CLI::App& app) {
  auto a = std::make_shared<worker_args>();
  auto* cmd = app.add_subcommand(
      "worker",
      "Serve the last layers (--first-layer) or a tensor-parallel slice (--tp-rank) of a model to "
      "another process (troupe run --remote-stage / --tp-peer)");
  cmd->add_option("--model,-m", a->model,
                  "GGUF file or Hugging Face folder (default: the bundled tiny LLaVA)");
  cmd->add_option("--first-layer", a->first_layer,
                  "Pipeline: first decoder layer this worker serves (it serves the rest)");
  cmd->add_option("--tp-rank", a->tp_rank,
                  "Tensor parallel: this worker's rank (1..K-1; the front is rank 0)");
  cmd->add_option("--tp-size", a->tp_size, "Tensor parallel: ranks in the group (K)");
  cmd->add_option("--port", a->port, "TCP port for CAF (0: any free port; printed)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--device", a->device, "Device: cpu, cpu:N or cpu:A-B");
  cmd->add_option("--quant", a->quant, "Weight format (as troupe generate)");
  cmd->add_option("--quant-override", a->overrides, "PATTERN=FORMAT on tensor names");
  cmd->add_option("--kv-type", a->kv_type, "KV cache type: f32, f16, int8");
  cmd->add_option("--ctx", a->ctx_tokens, "KV cache capacity in tokens")
      ->check(CLI::Range(16, 1 << 24));
  cmd->add_option("--tls", a->tls,
                  "UCX transports for activations (e.g. tcp; default: UCX's choice)");
  cmd->add_option("--net-devices", a->net_devices, "UCX network devices (e.g. eth0)");
  return [a] { return run_worker(*a); };
}

}  // namespace troupe::cli
