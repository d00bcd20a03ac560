#pragma once

// `troupe bench`: what its benchmarks share. They report what `vllm bench
// serve` reports (completed/failed, requests/s, output tokens/s, TTFT,
// inter-token latency, end-to-end latency) per concurrency level:
// - bench_local.cpp: the actor pipeline in this process, with the plain
//   generation loop of bench_reference.cpp as the reference;
// - bench_http.cpp: an OpenAI-compatible server (--http);
// - bench_migrate.cpp: live migrations during its last level (--migrate).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/common/stats.hpp"
#include "cli/cluster_setup.hpp"
#include "cli/model_setup.hpp"

namespace troupe::cli::serve_bench {

using clock = std::chrono::steady_clock;

struct bench_args {
  std::string model, devices, concurrency = "1,4,16", images_dir, quant, kv_type = "f32";
  pipeline_flags pipeline;
  bool balance = true;  // micro-batches sized to an even share of the work
  int requests = 0;
  std::int64_t max_tokens = 64, ctx_tokens = 0;
  double image_share = 0.5;
  std::uint64_t seed = 1;
  bool json = false, no_reference = false;
  bool completions = false;   ///< --http: /v1/completions with text prompts
  std::string http, api_key;  // --http: an OpenAI-compatible server instead of in-process actors
  std::string manifest;       // --http with --migrate: the cluster behind the server
  std::vector<std::string> migrate;  // SHARD:NODE, done in turn mid-way through the last level
  bool no_keep_alive = false;        ///< --http: a new connection per request
  bool compare_client = false;  ///< --http: each level again through the client actor (--manifest)
  /// --prefix: the prefix-caching workloads (bench_prefix.cpp).
  struct prefix_workload {
    bool on = false;
    std::int64_t system_tokens = 2000, question_tokens = 48;
    int probes = 5;
    int turns = 10;
    std::int64_t turn_tokens = 96, answer_tokens = 32;
    int systems = 8;
    std::int64_t users_system_tokens = 1000;
    int users = 200, concurrency = 16;
    /// Preemption under a KV pool too small for the load: requests at once,
    /// the pool (tokens per stage), and the host tier that takes the blocks.
    int swap_requests = 16;
    std::int64_t swap_prompt_tokens = 256, swap_answer_tokens = 128;
    std::int64_t swap_ctx = 2048, swap_host_tokens = 16384;
  } prefix;
};

inline double ms(clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

/// A chunk's arrival and the gap before it (ms), for gaps during migrations.
struct timed_gap {
  clock::time_point at;
  double gap_ms = 0;
};

/// The figures of one concurrency level.
struct level_result {
  int concurrency = 0;
  int completed = 0, failed = 0;
  double seconds = 0;
  std::int64_t output_tokens = 0, input_tokens = 0;
  bench::distribution ttft, itl, e2e;
  std::vector<timed_gap> gaps;   // --http: every inter-chunk gap with its arrival time
  double single_decode_tps = 0;  // decode tokens/s per request (mean)
  std::int64_t chunks = 0;  // streamed token events (a multi-step event carries several tokens)
};

/// One workload item: a prompt and, for a vision model, maybe an image.
struct work_item {
  std::vector<std::int32_t> ids;
  std::string image;  // file path ("" = text only)
};

// -- what every benchmark reports (bench.cpp) ---------------------------------

/// Sets a level's wall time (since `t0`) and its latency distributions
/// from the samples (ms).
void finish_level(level_result& out, clock::time_point t0, const std::vector<double>& ttft,
                  const std::vector<double>& itl, const std::vector<double>& e2e);

/// Output tokens per second of a level.
double tokens_per_s(const level_result& r);

/// The first level's output tokens/s (0 without levels): what the others
/// are compared with.
double first_level_tokens_per_s(const std::vector<level_result>& results);

/// The figures every level reports, in JSON (`base`: the first level's
/// output tokens/s).
nlohmann::json level_json(const level_result& r, double base);

/// The levels as a Markdown table; with `extra_column`, one more column
/// whose cells `extra` gives.
void print_level_table(const std::vector<level_result>& results, double base,
                       const char* extra_column = nullptr,
                       const std::function<double(const level_result&)>& extra = {});

/// The bytes of the file at `path` (none if it cannot be read).
std::vector<std::uint8_t> read_file(const std::string& path);

/// The PNG and JPEG (.jpg) files of `dir`, sorted; none if it cannot be read.
std::vector<std::string> image_files_in(const std::string& dir);

// -- the benchmarks -----------------------------------------------------------

/// The benchmark of the actor pipeline in this process.
int run_local_bench(const bench_args& a, const std::vector<int>& levels);

/// Prefix caching's workloads, with the cache on and off (--prefix).
int run_prefix_bench(const bench_args& a);

/// The benchmark of an OpenAI-compatible server at a.http.
int run_http_bench(const bench_args& a, const std::vector<int>& levels);

// -- the plain loop's reference (bench_reference.cpp) -------------------------

/// The plain loop's figures in this process, the reference for the
/// pipeline's.
struct reference_figures {
  double decode_tps = 0;  ///< decode tokens/s of one text request
  double single_out = 0;  ///< output tokens/s of one text request
  double batch_out = 0;   ///< output tokens/s of `max_level` text requests in one batch (if > 1)
};

/// Runs the plain loop on `src` with one text request of `items` (best of
/// two runs, the first warming up) and, for `max_level` > 1, with
/// `max_level` of them in one batch, on the cores of `device`.
kernels::result<reference_figures> measure_reference(
    const models::weight_source& src, const std::optional<models::llava_config>& lcfg,
    const std::string& dir, const actors::device_spec& device, const models::quant_plan& plan,
    const std::vector<work_item>& items, const models::sampling_params& params,
    const models::kv_options& kv, int max_level);

// -- live migrations (bench_migrate.cpp) --------------------------------------

/// A --migrate move: what was asked, when it ran, and its report (or why
/// it failed).
struct move_done {
  std::string what;
  clock::time_point start, end;
  std::optional<actors::migrate_report> report;
  std::string error;
};

/// Does each SHARD:NODE of `moves` in turn (troupe migrate), 200 ms apart.
std::vector<move_done> run_moves(client_session& client, const std::vector<std::string>& moves);

/// What each move cost against the inter-token gaps of `level`, the level
/// the moves ran in (a Markdown table and its notes).
void print_moves(const level_result& level, const std::vector<move_done>& moves);

}  // namespace troupe::cli::serve_bench
