// troupe write-model: random-weight GGUF models of a given shape (benchmarks).
#include <spdlog/spdlog.h>

#include <memory>
#include <string>

#include "cli/commands.hpp"
#include "models/random_model.hpp"

namespace troupe::cli {

command_runner add_write_model(CLI::App& app) {
  struct args {
    std::string out, format = "f16", shape = "tinyllama";
    std::uint64_t seed = 1;
    std::int64_t layers = 0;
  };
  auto a = std::make_shared<args>();
  auto* cmd =
      app.add_subcommand("write-model", "Write a random-weight llama GGUF (for benchmarks)");
  cmd->add_option("--out,-o", a->out, "Output .gguf path")->required();
  cmd->add_option("--format", a->format, "f32, f16, q8_0 or q4_0 (every matrix)");
  cmd->add_option("--shape", a->shape, "tinyllama");
  cmd->add_option("--layers", a->layers, "Override the layer count");
  cmd->add_option("--seed", a->seed);
  return [a] {
    if (a->shape != "tinyllama") {
      spdlog::error("unknown shape '{}' (tinyllama)", a->shape);
      return 2;
    }
    models::random_model_spec spec;
    spec.config = models::tinyllama_shape();
    if (a->layers > 0) spec.config.num_layers = a->layers;
    auto f = kernels::weight_format_from_string(a->format);
    if (!f) {
      spdlog::error("{}", f.error().message);
      return 2;
    }
    spec.format = *f;
    spec.seed = a->seed;
    if (auto r = models::write_random_gguf(a->out, spec); !r) {
      spdlog::error("{}", r.error().message);
      return 1;
    }
    spdlog::info("wrote {}", a->out);
    return 0;
  };
}

}  // namespace troupe::cli
