// The `troupe` command. Subcommands arrive with their issues; this one
// lists devices and runs the kernel benchmark.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "actors/log.hpp"
#include "cli/commands.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cpu/isa.hpp"
#include "kernels/cuda/probe.hpp"
#include "kernels/device.hpp"

namespace {

int cmd_devices() {
  auto reg = troupe::kernels::device_registry::discover();
  if (!reg) {
    spdlog::error("device discovery failed: {}", reg.error().message);
    return 1;
  }
  for (const auto& d : (*reg)->devices()) {
    const auto& i = d->info();
    std::printf("%-8s kind=%s cores=%d memory=%.1f GiB isa=%s\n", i.name.c_str(),
                std::string(troupe::kernels::to_string(i.kind)).c_str(), i.cores,
                static_cast<double>(i.memory_bytes) / (1ull << 30), i.detail.c_str());
  }
  std::printf("cuda: %s\n",
              (*reg)->cuda_status().empty() ? "available" : (*reg)->cuda_status().c_str());
  return 0;
}

}  // namespace

std::string troupe::cli::bundled_model_path() {
  if (const char* env = std::getenv("TROUPE_MODEL"); env && *env) return env;
  return TROUPE_BUNDLED_MODEL;
}

int main(int argc, char** argv) {
  // Logs go to stderr: stdout carries the answer (and --json) for scripts.
  spdlog::set_default_logger(spdlog::stderr_color_mt("troupe"));
  namespace logging = troupe::actors::logging;
  logging::configure(logging::format::text, "");
  CLI::App app{"troupe: distributed multimodal LLM inference on actors"};
  app.set_version_flag("--version", std::string("troupe ") + TROUPE_VERSION);
  app.get_formatter()->label("REQUIRED", "(required)");
  // --help shows every option's default (subcommands inherit this).
  app.option_defaults()->always_capture_default();
  app.require_subcommand(1);
  std::string log_format;
  if (const char* env = std::getenv("TROUPE_LOG_FORMAT"); env && *env) log_format = env;
  app.add_option("--log-format", log_format,
                 "Logs on stderr as 'text' or 'json' (one object per line; env TROUPE_LOG_FORMAT; "
                 "nodes started by "
                 "`troupe up` inherit it)");
  auto* devices = app.add_subcommand("devices", "List the compute devices of this machine");
  auto* bench = app.add_subcommand("bench-kernels", "Run the kernel benchmark (bench_kernels)");
  std::vector<std::string> bench_args;
  auto generate = troupe::cli::add_generate(app);
  auto run = troupe::cli::add_generate(app, true);
  auto serve_bench = troupe::cli::add_bench(app);
  auto write_model = troupe::cli::add_write_model(app);
  auto score = troupe::cli::add_score(app);
  auto worker = troupe::cli::add_worker(app);
  auto certs = troupe::cli::add_certs(app);
  auto node = troupe::cli::add_node(app);
  auto up = troupe::cli::add_cluster(app, "up");
  auto status = troupe::cli::add_cluster(app, "status");
  auto submit = troupe::cli::add_cluster(app, "submit");
  auto migrate = troupe::cli::add_cluster(app, "migrate");
  auto scale = troupe::cli::add_cluster(app, "scale");
  auto down = troupe::cli::add_cluster(app, "down");
  auto serve = troupe::cli::add_serve(app);
  bench->allow_extras();  // everything after `bench-kernels` goes to bench_kernels
  bench->prefix_command();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (!log_format.empty()) {
    auto f = logging::parse_format(log_format);
    if (!f) {
      std::fprintf(stderr, "troupe: %s\n", f.error().c_str());
      return 2;
    }
    logging::configure(*f, "");
    ::setenv("TROUPE_LOG_FORMAT", log_format.c_str(), 1);  // for the processes this one starts
  }
  if (*devices) return cmd_devices();
  if (app.got_subcommand("generate")) return generate();
  if (app.got_subcommand("run")) return run();
  if (app.got_subcommand("bench")) return serve_bench();
  if (app.got_subcommand("write-model")) return write_model();
  if (app.got_subcommand("score")) return score();
  if (app.got_subcommand("worker")) return worker();
  if (app.got_subcommand("certs")) return certs();
  if (app.got_subcommand("node")) return node();
  if (app.got_subcommand("up")) return up();
  if (app.got_subcommand("status")) return status();
  if (app.got_subcommand("submit")) return submit();
  if (app.got_subcommand("down")) return down();
  if (app.got_subcommand("migrate")) return migrate();
  if (app.got_subcommand("scale")) return scale();
  if (app.got_subcommand("serve")) return serve();
  if (*bench) {
    // bench_kernels lives next to this binary in the build tree.
    std::string self = argv[0];
    const auto slash = self.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : self.substr(0, slash);
    std::string path = dir + "/../bench/bench_kernels";
    std::vector<char*> args{path.data()};
    bench_args = bench->remaining();
    for (auto& a : bench_args) args.push_back(a.data());
    args.push_back(nullptr);
    execv(path.c_str(), args.data());
    spdlog::error("cannot run {}: bench_kernels not built", path);
    return 1;
  }
  return 0;
}
