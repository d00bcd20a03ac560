// troupe bench: drives concurrent requests through the actor pipeline (or
// an OpenAI-compatible server) and reports what `vllm bench serve` reports
// (cli/bench.hpp). This file: the command, its concurrency levels, and the
// figures and tables every benchmark prints.
#include "cli/bench.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "cli/commands.hpp"
#include "models/mapped_file.hpp"

namespace troupe::cli {

namespace serve_bench {

namespace {

nlohmann::json to_json(const bench::distribution& d) {
  return {{"mean", d.mean}, {"p50", d.p50}, {"p99", d.p99}};
}

/// A level as a table row, without its closing "|\n".
void print_level_row(const level_result& r, double base) {
  const double tps = tokens_per_s(r);
  std::printf(
      "| %d | %d | %d | %.2f | %.1f | %.2f | %.1f / %.1f / %.1f | %.2f / %.2f / %.2f | %.0f / %.0f "
      "/ %.0f ",
      r.concurrency, r.completed, r.failed, r.completed / std::max(1e-9, r.seconds), tps,
      base > 0 ? tps / base : 0, r.ttft.mean, r.ttft.p50, r.ttft.p99, r.itl.mean, r.itl.p50,
      r.itl.p99, r.e2e.mean, r.e2e.p50, r.e2e.p99);
}

/// --concurrency "1,4,16" as levels; nothing after logging a bad one.
std::optional<std::vector<int>> parse_levels(const std::string& s) {
  std::vector<int> levels;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const auto c = s.find(',', pos);
    const auto item = s.substr(pos, c == std::string::npos ? std::string::npos : c - pos);
    pos = c == std::string::npos ? s.size() + 1 : c + 1;
    try {
      const int v = std::stoi(item);
      if (v < 1 || v > 4096) throw std::out_of_range("");
      levels.push_back(v);
    } catch (...) {
      spdlog::error("--concurrency: '{}' is not a number from 1 to 4096", item);
      return std::nullopt;
    }
  }
  return levels;
}

int run_bench(const bench_args& a) {
  const auto levels = parse_levels(a.concurrency);
  if (!levels) return 2;
  if (a.prefix.on) return run_prefix_bench(a);
  if (!a.http.empty()) return run_http_bench(a, *levels);
  return run_local_bench(a, *levels);
}

}  // namespace

void finish_level(level_result& out, clock::time_point t0, const std::vector<double>& ttft,
                  const std::vector<double>& itl, const std::vector<double>& e2e) {
  out.seconds = ms(clock::now() - t0) / 1e3;
  out.ttft = bench::summarize(ttft);
  out.itl = bench::summarize(itl);
  out.e2e = bench::summarize(e2e);
}

double tokens_per_s(const level_result& r) {
  return static_cast<double>(r.output_tokens) / std::max(1e-9, r.seconds);
}

double first_level_tokens_per_s(const std::vector<level_result>& results) {
  return results.empty() ? 0 : tokens_per_s(results.front());
}

nlohmann::json level_json(const level_result& r, double base) {
  const double tps = tokens_per_s(r);
  return {{"concurrency", r.concurrency},
          {"completed", r.completed},
          {"failed", r.failed},
          {"seconds", r.seconds},
          {"requests_per_s", r.completed / std::max(1e-9, r.seconds)},
          {"output_tokens_per_s", tps},
          {"input_tokens", r.input_tokens},
          {"output_tokens", r.output_tokens},
          {"ttft_ms", to_json(r.ttft)},
          {"itl_ms", to_json(r.itl)},
          {"e2e_ms", to_json(r.e2e)},
          {"speedup_vs_first_level", base > 0 ? tps / base : 0}};
}

void print_level_table(const std::vector<level_result>& results, double base,
                       const char* extra_column,
                       const std::function<double(const level_result&)>& extra) {
  std::printf(
      "\n| conc | done | failed | req/s | out tok/s | x first | TTFT mean/p50/p99 ms | ITL "
      "mean/p50/p99 ms | E2E mean/p50/p99 ms |%s\n",
      extra_column ? (std::string(" ") + extra_column + " |").c_str() : "");
  std::printf("|---|---|---|---|---|---|---|---|---|%s\n", extra_column ? "---|" : "");
  for (const auto& r : results) {
    print_level_row(r, base);
    if (extra_column)
      std::printf("| %.2f |\n", extra(r));
    else
      std::printf("|\n");
  }
}

std::vector<std::uint8_t> read_file(const std::string& path) {
  auto bytes = models::read_file_bytes(path, std::uint64_t{256} << 20);
  if (!bytes) {
    spdlog::error("{}", bytes.error().message);  // the requests with it fail as bad images
    return {};
  }
  return std::move(*bytes);
}

std::vector<std::string> image_files_in(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().extension() == ".png" || e.path().extension() == ".jpg")
      files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace serve_bench

command_runner add_bench(CLI::App& app) {
  auto a = std::make_shared<serve_bench::bench_args>();
  auto* cmd = app.add_subcommand(
      "bench",
      "Serve N concurrent requests through the actor pipeline and report latency and throughput");
  cmd->add_option("--model,-m", a->model,
                  "GGUF file or Hugging Face folder (default: the bundled tiny LLaVA)");
  cmd->add_option("--devices", a->devices,
                  "Devices of the stages (cpu, cpu:N, cpu:A-B, comma-separated)");
  cmd->add_option("--stages", a->pipeline.stages, "Pipeline stages")->check(CLI::Range(1, 1024));
  cmd->add_option("--remote-stage", a->pipeline.remote_stage,
                  "HOST:PORT of a `troupe worker` serving the last layers");
  cmd->add_option("--tp-peer", a->pipeline.tp_peers,
                  "HOST:PORT of a `troupe worker --tp-rank R --tp-size K` (repeat for each of "
                  "ranks 1..K-1): tensor "
                  "parallelism across processes, this process being rank 0");
  cmd->add_option("--micro-batches", a->pipeline.micro_batches,
                  "Micro-batches in flight (default: stages)")
      ->check(CLI::Range(0, 64));
  cmd->add_option("--balance-micro-batches", a->balance,
                  "Size each micro-batch to an even share of the waiting and in-flight tokens "
                  "(default true; false fills "
                  "each to the token budget)");
  cmd->add_option("--decode-steps", a->pipeline.decode_steps,
                  "Multi-step decode on one stage: decode passes per scheduler step at most (sized "
                  "to ~2 ms; 1 = off)")
      ->check(CLI::Range(1, 64));
  add_context_flags(*cmd, a->pipeline.context);
  add_cache_flags(*cmd, a->pipeline);
  cmd->add_option("--concurrency,-c", a->concurrency,
                  "Concurrency levels, comma-separated (default 1,4,16)");
  cmd->add_option("--requests,-n", a->requests,
                  "Requests per level (default: max(2 x concurrency, 8))")
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--max-tokens", a->max_tokens, "Tokens each request generates")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--image-share", a->image_share,
                  "Share of requests with an image (vision models)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--images", a->images_dir, "Folder of PNG/JPEG images for the workload");
  cmd->add_option("--quant", a->quant, "Weight format or llama.cpp file type (as troupe generate)");
  cmd->add_option("--kv-type", a->kv_type, "KV cache type: f32, f16, int8");
  cmd->add_option("--ctx", a->ctx_tokens,
                  "KV capacity per stage in tokens (default: enough for the largest level)");
  cmd->add_option("--seed", a->seed);
  cmd->add_flag("--no-reference", a->no_reference, "Skip the plain-loop reference run");
  cmd->add_flag("--json", a->json, "Print one JSON object");
  cmd->add_flag("--prefix", a->prefix.on,
                "Prefix caching's workloads, with the cache on and off in one run: a long shared "
                "system prompt (TTFT), a multi-turn chat (prompt tokens computed), many users over "
                "a few system prompts (hit rate, throughput)");
  cmd->add_option("--prefix-system", a->prefix.system_tokens,
                  "--prefix: tokens of the shared system prompt")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cmd->add_option("--prefix-question", a->prefix.question_tokens,
                  "--prefix: tokens each request adds to a system prompt")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 16));
  cmd->add_option("--prefix-turns", a->prefix.turns, "--prefix: turns of the chat")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--prefix-turn-tokens", a->prefix.turn_tokens,
                  "--prefix: tokens of each new chat message")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 16));
  cmd->add_option("--prefix-answer-tokens", a->prefix.answer_tokens,
                  "--prefix: tokens of each chat answer")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 16));
  cmd->add_option("--prefix-systems", a->prefix.systems, "--prefix: system prompts the users share")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--prefix-users-system", a->prefix.users_system_tokens,
                  "--prefix: tokens of each users' system prompt")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cmd->add_option("--prefix-users", a->prefix.users, "--prefix: user requests")
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--prefix-concurrency", a->prefix.concurrency,
                  "--prefix: user requests in flight at once")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--prefix-swap-requests", a->prefix.swap_requests,
                  "--prefix: requests at once over a KV pool too small for them (preemption)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--prefix-swap-ctx", a->prefix.swap_ctx,
                  "--prefix: that pool, in tokens (the comparison's is large enough for all)")
      ->check(CLI::Range(std::int64_t{16}, std::int64_t{1} << 24));
  cmd->add_option("--prefix-swap-host", a->prefix.swap_host_tokens,
                  "--prefix: the host tier (tokens) preempted requests' blocks go to")
      ->check(CLI::Range(std::int64_t{16}, std::int64_t{1} << 30));
  cmd->add_option("--http", a->http,
                  "Benchmark an OpenAI-compatible server at this URL (e.g. http://127.0.0.1:8000; "
                  "troupe serve)");
  cmd->add_option("--api-key", a->api_key, "With --http: the server's API key");
  cmd->add_flag("--completions", a->completions,
                "With --http: POST /v1/completions with text prompts instead of chat completions "
                "(models without a chat template)");
  cmd->add_option("--manifest", a->manifest,
                  "With --migrate or --compare-client: the cluster's manifest (its client "
                  "certificate)");
  cmd->add_flag("--no-keep-alive", a->no_keep_alive,
                "With --http: a new connection per request (default: each client keeps one)");
  cmd->add_flag("--compare-client", a->compare_client,
                "With --http and --manifest: run each level again through the cluster's client "
                "actor and print the TTFT ratios (the gateway's overhead)");
  cmd->add_option("--migrate", a->migrate,
                  "With --http: SHARD:NODE moves (troupe migrate) done in turn mid-way through the "
                  "last level; reports "
                  "the pause and the longest inter-token gap each caused");
  return [a] {
    if (a->model.empty()) a->model = bundled_model_path();
    if (a->images_dir.empty()) a->images_dir = TROUPE_SHAPES_IMAGES;
    return serve_bench::run_bench(*a);
  };
}

}  // namespace troupe::cli
