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
    std::int64_t layers = 0, hidden = 0, ffn = 0, heads = 0, kv_heads = 0, vocab = 0;
    int threads = 0;
  };
  auto a = std::make_shared<args>();
  auto* cmd =
      app.add_subcommand("write-model", "Write a random-weight llama GGUF (for benchmarks)");
  cmd->add_option("--out,-o", a->out, "Output .gguf path")->required();
  cmd->add_option("--format", a->format, "f32, f16, q8_0 or q4_0 (every matrix)");
  cmd->add_option("--shape", a->shape, "tinyllama or llama2-7b");
  cmd->add_option("--layers", a->layers, "Override the layer count");
  cmd->add_option("--hidden", a->hidden, "Override the hidden size");
  cmd->add_option("--ffn", a->ffn, "Override the FFN width");
  cmd->add_option("--heads", a->heads, "Override the attention heads");
  cmd->add_option("--kv-heads", a->kv_heads, "Override the KV heads");
  cmd->add_option("--vocab", a->vocab, "Override the vocabulary size");
  cmd->add_option("--threads", a->threads, "Threads generating weights (0 = all)");
  cmd->add_option("--seed", a->seed);
  return [a] {
    models::random_model_spec spec;
    if (a->shape == "tinyllama") {
      spec.config = models::tinyllama_shape();
    } else if (a->shape == "llama2-7b") {
      spec.config = models::llama2_7b_shape();
    } else {
      spdlog::error("unknown shape '{}' (tinyllama, llama2-7b)", a->shape);
      return 2;
    }
    auto& c = spec.config;
    for (auto v : {a->layers, a->hidden, a->ffn, a->heads, a->kv_heads, a->vocab})
      if (v < 0) {
        spdlog::error("shape overrides must be positive");
        return 2;
      }
    if (a->layers > 0) c.num_layers = a->layers;
    if (a->hidden > 0) c.hidden_size = a->hidden;
    if (a->ffn > 0) c.intermediate_size = a->ffn;
    if (a->heads > 0) c.num_heads = a->heads;
    if (a->kv_heads > 0) c.num_kv_heads = a->kv_heads;
    if (a->vocab > 0) c.vocab_size = a->vocab;
    if (c.num_heads > 0 && c.hidden_size % c.num_heads == 0)
      c.head_dim = c.hidden_size / c.num_heads;
    if (a->threads < 0) {
      spdlog::error("--threads must be >= 0");
      return 2;
    }
    spec.threads = a->threads;
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
