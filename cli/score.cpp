// troupe score: teacher-forced logits of a token sequence (perplexity, and
// the raw logits for comparisons with other runtimes).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "actors/prompt.hpp"
#include "cli/commands.hpp"
#include "cli/model_setup.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/llama.hpp"

namespace troupe::cli {

namespace {

// "1,2,3" -> ids; an error names the bad entry.
kernels::result<std::vector<std::int32_t>> parse_ids(const std::string& s) {
  std::vector<std::int32_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 0 || v > (1L << 30))
      return kernels::make_error(kernels::errc::invalid_argument,
                                 "--tokens: '" + item + "' is not a token id");
    out.push_back(static_cast<std::int32_t>(v));
  }
  if (out.empty()) return kernels::make_error(kernels::errc::invalid_argument, "--tokens is empty");
  return out;
}

}  // namespace

command_runner add_score(CLI::App& app) {
  struct args {
    std::string model, prompt, tokens, out, quant;
    bool no_bos = false;
    int threads = 0;
  };
  auto a = std::make_shared<args>();
  auto* cmd = app.add_subcommand(
      "score", "Teacher-forced logits of a text or token ids: perplexity, and the raw logits");
  cmd->add_option("-m,--model", a->model, "GGUF file or Hugging Face folder")->required();
  auto* p = cmd->add_option("-p,--prompt", a->prompt, "Text to score (tokenized with BOS)");
  auto* t = cmd->add_option("--tokens", a->tokens, "Token ids to score, comma-separated");
  p->excludes(t);
  cmd->add_flag("--no-bos", a->no_bos, "Do not add the tokenizer's special prefix (-p)");
  cmd->add_option("--quant", a->quant, "Convert the weights to this format first (as generate)");
  cmd->add_option("--out", a->out, "Write the logits there: f32 [tokens, vocab], little-endian");
  cmd->add_option("-t,--threads", a->threads, "Worker threads (default: all cores)")
      ->check(CLI::Range(1, 1024));
  return [a] {
    if (a->prompt.empty() == a->tokens.empty()) {
      spdlog::error("score needs -p TEXT or --tokens IDS");
      return 2;
    }
    std::vector<std::int32_t> ids;
    if (!a->tokens.empty()) {
      auto parsed = parse_ids(a->tokens);
      if (!parsed) {
        spdlog::error("{}", parsed.error().message);
        return 2;
      }
      ids = std::move(*parsed);
    } else {
      auto setup = actors::load_prompt_setup(a->model);
      if (!setup) {
        spdlog::error("{}", setup.error().message);
        return 1;
      }
      auto enc = setup->tok->encode(a->prompt, !a->no_bos, false);
      if (!enc) {
        spdlog::error("{}", enc.error().message);
        return 2;
      }
      ids.assign(enc->begin(), enc->end());
    }
    const int threads = a->threads > 0
                            ? a->threads
                            : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    auto dev = kernels::cpu::cpu_device::with_threads(threads);
    auto plan = parse_quant_flags(a->quant, {});
    if (!plan) {
      spdlog::error("{}", plan.error().message);
      return 2;
    }
    auto m = models::llama_model::load(a->model, *dev, *plan);
    if (!m) {
      spdlog::error("{}", m.error().message);
      return 1;
    }
    auto cache = (*m)->make_cache(
        dev->memory(),
        models::kv_options{.block_size = 16,
                           .capacity_tokens = static_cast<std::int64_t>(ids.size())});
    if (!cache) {
      spdlog::error("{}", cache.error().message);
      return 1;
    }
    const auto s = cache->add_sequence();
    auto logits = (*m)->forward(*dev, *cache, std::vector<models::step_input>{{s, ids, true}});
    if (!logits) {
      spdlog::error("{}", logits.error().message);
      return logits.error().code == kernels::errc::invalid_argument ? 2 : 1;
    }
    const std::int64_t V = logits->dim(1), n = logits->dim(0);
    double nll = 0;
    for (std::int64_t i = 0; i + 1 < n; ++i) {
      const float* row = logits->row_as<float>(i);
      const double mx = *std::max_element(row, row + V);
      double z = 0;
      for (std::int64_t v = 0; v < V; ++v) z += std::exp(double(row[v]) - mx);
      nll += mx + std::log(z) - row[ids[static_cast<std::size_t>(i + 1)]];
    }
    const double mean = n > 1 ? nll / double(n - 1) : 0.0;
    std::printf("%lld tokens, vocab %lld: mean NLL %.6f, perplexity %.4f\n",
                static_cast<long long>(n), static_cast<long long>(V), mean, std::exp(mean));
    if (!a->out.empty()) {
      std::ofstream f(a->out, std::ios::binary);
      f.write(static_cast<const char*>(logits->data()),
              static_cast<std::streamsize>(logits->nbytes()));
      if (!f) {
        spdlog::error("{}: cannot write", a->out);
        return 1;
      }
    }
    return 0;
  };
}

}  // namespace troupe::cli
