// troupe bench: concurrent requests through the actor pipeline in this
// process, `vllm bench serve`'s figures per concurrency level, next to the
// plain loop's (bench_reference.cpp) and with where the pipeline's time
// went.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <random>

#include "actors/pipeline_stats.hpp"
#include "actors/runtime.hpp"
#include "cli/bench.hpp"
#include "models/llava_config.hpp"
#include "models/tokenizer.hpp"

namespace troupe::cli::serve_bench {

namespace {

/// Closed loop: keeps `concurrency` requests in flight until `total` finished.
level_result run_level(actors::client& client, const std::vector<work_item>& items, int concurrency,
                       int total, const models::sampling_params& params,
                       std::map<std::string, std::vector<std::uint8_t>>& image_bytes) {
  level_result out;
  out.concurrency = concurrency;
  struct timing {
    clock::time_point start, last;
    std::vector<double> gaps;
    double ttft = -1;
    std::int64_t tokens = 0, chunks = 0;
  };
  std::mutex m;
  std::condition_variable cv;
  std::map<std::uint64_t, timing> live;
  std::vector<double> ttft, itl, e2e, decode_tps;
  int finished = 0, submitted = 0, in_flight = 0;
  const auto t0 = clock::now();
  auto submit_next = [&](std::unique_lock<std::mutex>& lock) {
    const auto& it = items[static_cast<std::size_t>(submitted) % items.size()];
    ++submitted;
    actors::generate_request req;
    req.id = actors::client::next_id();
    req.prompt_tokens = it.ids;
    req.params = params;
    req.params.seed = params.seed + static_cast<std::uint64_t>(submitted);
    if (!it.image.empty())
      req.media.push_back({it.image, image_bytes[it.image], actors::media_kind::image});
    out.input_tokens += static_cast<std::int64_t>(it.ids.size());
    live[req.id].start = clock::now();
    ++in_flight;
    actors::client::callbacks cb;
    const auto id = req.id;
    cb.on_token = [&, id](const actors::token_event& e) {
      std::lock_guard l(m);
      auto& t = live[id];
      const auto now = clock::now();
      if (t.ttft < 0) {
        t.ttft = ms(now - t.start);
      } else {
        t.gaps.push_back(ms(now - t.last));
      }
      t.last = now;
      t.tokens += static_cast<std::int64_t>(e.tokens.size());
      ++t.chunks;
    };
    cb.on_finish = [&, id](const actors::finish_event& f) {
      std::lock_guard l(m);
      auto t = live[id];
      live.erase(id);
      ++finished;
      --in_flight;
      if (f.reason == actors::finish_reason::error ||
          f.reason == actors::finish_reason::cancelled ||
          f.reason == actors::finish_reason::deadline) {
        ++out.failed;
        spdlog::warn("request {} failed: {} {}", id, to_string(f.reason), f.error);
      } else {
        ++out.completed;
        out.output_tokens += t.tokens;
        out.chunks += t.chunks;
        ttft.push_back(t.ttft);
        itl.insert(itl.end(), t.gaps.begin(), t.gaps.end());
        const double total_ms = ms(clock::now() - t.start);
        e2e.push_back(total_ms);
        if (t.tokens > 1 && total_ms > t.ttft)
          decode_tps.push_back(static_cast<double>(t.tokens - 1) / ((total_ms - t.ttft) / 1e3));
      }
      cv.notify_all();
    };
    lock.unlock();
    auto ack = client.submit(std::move(req), std::move(cb));
    lock.lock();
    if (!ack) {
      live.erase(id);
      --in_flight;
      ++finished;
      ++out.failed;
      spdlog::warn("request rejected: {}", ack.error().message);
    }
  };
  std::unique_lock lock(m);
  while (finished < total) {
    while (in_flight < concurrency && submitted < total) submit_next(lock);
    cv.wait(lock,
            [&] { return finished >= total || (in_flight < concurrency && submitted < total); });
  }
  finish_level(out, t0, ttft, itl, e2e);
  out.single_decode_tps = bench::mean(decode_tps);
  return out;
}

}  // namespace

int run_local_bench(const bench_args& a, const std::vector<int>& levels) {
  using namespace troupe::models;
  auto precision = parse_precision_flags(a.quant, {}, a.kv_type);
  if (!precision) {
    spdlog::error("{}", precision.error().message);
    return 2;
  }
  const quant_plan& plan = precision->plan;
  std::string list = a.devices.empty() ? "cpu" : a.devices;
  auto devices = actors::parse_devices(list);
  if (!devices) {
    spdlog::error("--devices: {}", devices.error().message);
    return 2;
  }
  const std::string dir = std::filesystem::is_directory(a.model)
                              ? a.model
                              : std::filesystem::path(a.model).parent_path().string();
  // The workload: fixed prompts; with a vision model a share of them carry
  // an image from --images.
  auto src = weight_source::open(a.model);
  if (!src) {
    spdlog::error("{}", src.error().message);
    return 1;
  }
  auto tok = (*src)->is_gguf() ? tokenizer::from_gguf(*(*src)->gguf()) : tokenizer::load(dir);
  if (!tok) {
    spdlog::error("tokenizer: {}", tok.error().message);
    return 1;
  }
  std::optional<llava_config> lcfg;
  if (!(*src)->is_gguf()) {
    auto text = read_text_file(dir + "/config.json");
    if (text && is_llava_config(*text)) {
      auto c = parse_llava_config(*text, dir + "/config.json");
      if (c) lcfg = *c;
    }
  }
  std::vector<std::string> image_files;
  if (lcfg && a.image_share > 0) {
    image_files = image_files_in(a.images_dir);
    if (image_files.empty()) {
      spdlog::error(
          "--images {}: no PNG or JPEG files (needed for the image share of the workload)",
          a.images_dir);
      return 2;
    }
  }
  std::map<std::string, std::vector<std::uint8_t>> image_bytes;
  for (const auto& f : image_files) image_bytes[f] = read_file(f);
  const std::vector<std::string> questions = {
      "Describe the image.",        "How many shapes are there?",
      "What shape is on the left?", "What color is the shape at the top?",
      "Is there a red circle?",     "Where is the blue square?"};
  std::vector<work_item> items;
  std::mt19937_64 rng(a.seed);
  for (int i = 0; i < 64; ++i) {
    work_item w;
    const bool with_image =
        lcfg && !image_files.empty() && std::uniform_real_distribution<>(0, 1)(rng) < a.image_share;
    const auto& q = questions[static_cast<std::size_t>(i) % questions.size()];
    std::string text =
        lcfg ? "USER: " + std::string(with_image ? "<image>\n" : "") + q + " ASSISTANT:"
             : "Once upon a time, in a land far away, " + q;
    auto ids = tok->encode(text, true, true);
    if (!ids) {
      spdlog::error("prompt: {}", ids.error().message);
      return 1;
    }
    w.ids = *ids;
    if (with_image) w.image = image_files[static_cast<std::size_t>(i) % image_files.size()];
    items.push_back(std::move(w));
  }
  // Every request generates exactly max_tokens (no stop token), as
  // `vllm bench serve --ignore-eos` does, so levels compare.
  sampling_params params;
  params.max_tokens = a.max_tokens;
  params.temperature = 0.8;
  params.top_k = 40;
  params.seed = a.seed;
  const int max_level = *std::max_element(levels.begin(), levels.end());
  kv_options kv;
  kv.type = precision->kv_type;
  std::int64_t longest = 0;
  for (const auto& w : items)
    longest = std::max<std::int64_t>(
        longest, static_cast<std::int64_t>(w.ids.size()) + (lcfg ? lcfg->tokens_per_image() : 0));
  kv.capacity_tokens = a.ctx_tokens > 0 ? a.ctx_tokens : (longest + a.max_tokens + 32) * max_level;

  // The reference: the plain loop, one request, this process.
  reference_figures ref;
  if (!a.no_reference) {
    auto r =
        measure_reference(**src, lcfg, dir, devices->front(), plan, items, params, kv, max_level);
    if (!r) {
      spdlog::error("{}", r.error().message);
      return 1;
    }
    ref = *r;
  }
  src->reset();

  caf::actor_system_config cfg;
  configure_pipeline_system(cfg, a.pipeline);
  caf::actor_system sys{cfg};
  auto rc = pipeline_config(a.pipeline, a.model, *devices, plan, kv);
  rc.scheduler.balance_micro_batches = a.balance;
  rc.scheduler.queue_limit = std::max<std::int64_t>(64, max_level * 2);
  auto rt = actors::local_runtime::start(sys, rc);
  if (!rt) {
    spdlog::error("{}", rt.error().message);
    return 1;
  }
  actors::client client(sys, (*rt)->scheduler());
  // Warm-up: one request through every actor.
  (void)run_level(client, items, 1, 2, params, image_bytes);
  std::vector<level_result> results;
  std::vector<std::optional<actors::pipeline_breakdown>>
      bubbles;  // per level: where the pipeline's time went
  // Per level, with --tp-peer: this rank's all-reduces, and the steps.
  std::vector<std::optional<transport::allreduce_totals>> reduces;
  std::vector<double> steps;
  for (int c : levels) {
    const int total = a.requests > 0 ? a.requests : std::max(2 * c, 8);
    const auto s0 = client.stats();
    const auto r0 = (*rt)->tp_allreduce();
    const auto t0 = clock::now();
    results.push_back(run_level(client, items, c, total, params, image_bytes));
    const double wall = ms(clock::now() - t0) / 1e3;
    bubbles.push_back(actors::breakdown_between(s0, client.stats(), wall));
    const auto r1 = (*rt)->tp_allreduce();
    reduces.push_back(r0 && r1 ? std::optional(*r1 - *r0) : std::nullopt);
    steps.push_back(bubbles.back() ? bubbles.back()->steps_per_s * wall : 0);
  }
  const int tp_ranks = (*rt)->tp_size();
  // All-reduce figures of level i: per call, per step and their share of the
  // level's wall time.
  auto reduce_json = [&](std::size_t i) -> nlohmann::json {
    if (!reduces[i]) return nullptr;
    const auto b = transport::breakdown_of(*reduces[i]);
    return {{"calls", b.calls},
            {"per_step", steps[i] > 0 ? b.calls / steps[i] : 0},
            {"kib", b.kib},
            {"total_us", b.total_us},
            {"waiting_us", b.waiting_us},
            {"transfer_us", b.transfer_us},
            {"reduce_us", b.reduce_us},
            {"share_of_wall",
             results[i].seconds > 0 ? b.calls * b.total_us / 1e6 / results[i].seconds : 0}};
  };
  const auto stats = client.stats();
  const double base = first_level_tokens_per_s(results);
  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model;
    j["pipeline"] = (*rt)->describe();
    j["max_tokens"] = a.max_tokens;
    j["reference_decode_tokens_per_s"] = ref.decode_tps;
    j["reference_output_tokens_per_s"] = ref.single_out;
    j["reference_batch"] = {{"requests", max_level},
                            {"output_tokens_per_s", ref.batch_out},
                            {"gain", ref.single_out > 0 ? ref.batch_out / ref.single_out : 0}};
    j["preemptions"] = stats.preemptions;
    j["prefix_cache"] = {
        {"queries", stats.prefix_queries},
        {"hits", stats.prefix_hits},
        {"hit_rate", stats.prefix_queries > 0 ? static_cast<double>(stats.prefix_hits) /
                                                    static_cast<double>(stats.prefix_queries)
                                              : 0.0}};
    j["encoder_cache"] = {{"images", stats.images}, {"hits", stats.image_cache_hits}};
    for (const auto& r : results) {
      auto l = level_json(r, base);
      l["decode_tokens_per_s_per_request"] = r.single_decode_tps;
      l["tokens_per_chunk"] =
          r.chunks > 0 ? static_cast<double>(r.output_tokens) / static_cast<double>(r.chunks) : 0;
      l["decode_vs_reference"] = ref.decode_tps > 0 ? r.single_decode_tps / ref.decode_tps : 0;
      if (const auto& b = bubbles[static_cast<std::size_t>(&r - results.data())])
        l["pipeline"] = {{"steps_per_s", b->steps_per_s},
                         {"rows_per_s", b->rows_per_s},
                         {"round_trip_ms", b->round_trip_ms},
                         {"compute_ms", b->compute_ms},
                         {"waiting_and_handoffs_ms", b->other_ms},
                         {"stage_busy", b->stage_busy},
                         {"idle", b->idle},
                         {"scheduler", b->scheduler},
                         {"busy_per_stage", b->busy_per_stage}};
      if (auto rj = reduce_json(static_cast<std::size_t>(&r - results.data())); !rj.is_null())
        l["allreduce"] = std::move(rj);
      j["levels"].push_back(std::move(l));
    }
    std::puts(j.dump(2).c_str());
    std::fflush(stdout);
    return 0;
  }
  std::printf(
      "troupe bench: %s\npipeline: %s\n%lld output tokens per request (no stop token), sampling "
      "T=0.8 top-k 40\n",
      a.model.c_str(), (*rt)->describe().c_str(), static_cast<long long>(a.max_tokens));
  if (ref.decode_tps > 0)
    std::printf(
        "reference (plain loop, 1 text request): decode %.1f tokens/s, output %.1f tokens/s\n",
        ref.decode_tps, ref.single_out);
  if (ref.batch_out > 0)
    std::printf(
        "reference (plain loop, %d text requests in one batch): output %.1f tokens/s, x%.2f of one "
        "request: "
        "the kernels' batching gain on this machine\n",
        max_level, ref.batch_out, ref.batch_out / std::max(1e-9, ref.single_out));
  print_level_table(results, base, "decode/req vs ref", [&](const level_result& r) {
    return ref.decode_tps > 0 ? r.single_decode_tps / ref.decode_tps : 0;
  });
  std::printf("\nITL is the gap between streamed chunks; tokens per chunk (multi-step decode):");
  for (const auto& r : results)
    std::printf(
        " %.1f at %d",
        r.chunks > 0 ? static_cast<double>(r.output_tokens) / static_cast<double>(r.chunks) : 0.0,
        r.concurrency);
  std::printf("\npreemptions: %lld; tokens their KV lost: %lld restored, %lld recomputed\n",
              static_cast<long long>(stats.preemptions),
              static_cast<long long>(stats.restored_tokens),
              static_cast<long long>(stats.recomputed_tokens));
  if (const auto t = actors::describe_kv_tiers(stats); !t.empty()) std::printf("%s\n", t.c_str());
  // The workload repeats its prompts: with prefix caching (the default) most
  // prompt tokens come from the cache (--no-prefix-caching computes them all).
  std::printf(
      "prefix cache: %lld of %lld prompt tokens hit (%.1f%%)%s; encoder cache: %lld of %lld "
      "images\n",
      static_cast<long long>(stats.prefix_hits), static_cast<long long>(stats.prefix_queries),
      stats.prefix_queries > 0 ? 100.0 * static_cast<double>(stats.prefix_hits) /
                                     static_cast<double>(stats.prefix_queries)
                               : 0.0,
      a.pipeline.prefix_caching ? "" : " (off)", static_cast<long long>(stats.image_cache_hits),
      static_cast<long long>(stats.images));
  // The pipeline bubble: a micro-batch's round trip is the stages' compute
  // on it plus waiting behind another micro-batch and the hand-offs.
  std::printf(
      "\nwhere the pipeline's time went (per micro-batch step; busy = a stage's compute / the "
      "level's wall time):\n\n"
      "| conc | steps/s | tokens through/s | round trip ms | compute ms (all stages) | waiting + "
      "hand-offs ms | busy per stage | no step in flight | scheduler |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (!bubbles[i]) continue;
    const auto& b = *bubbles[i];
    std::string busy;
    for (std::size_t k = 0; k < b.busy_per_stage.size(); ++k)
      busy += (k ? " / " : "") + std::to_string(static_cast<int>(100 * b.busy_per_stage[k] + 0.5)) +
              "%";
    if (busy.empty())
      busy = std::to_string(static_cast<int>(100 * b.stage_busy + 0.5)) + "% (mean)";
    std::printf("| %d | %.1f | %.1f | %.2f | %.2f | %.2f | %s | %.0f%% | %.0f%% |\n",
                results[i].concurrency, b.steps_per_s, b.rows_per_s, b.round_trip_ms, b.compute_ms,
                b.other_ms, busy.c_str(), 100 * b.idle, 100 * b.scheduler);
  }
  if (tp_ranks > 1) {
    std::printf(
        "\ntensor parallelism, %d ranks: this rank's all-reduces (per call; transfer = its "
        "exchanges at the pace of its fastest one, waiting = the rest of the exchanges' time, for "
        "a rank that came late; share = all-reduce time / wall time):\n\n"
        "| conc | all-reduces per step | KiB | total us | waiting us | transfer us | reduce us | "
        "share of wall |\n|---|---|---|---|---|---|---|---|\n",
        tp_ranks);
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto j = reduce_json(i);
      if (j.is_null()) continue;
      std::printf("| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f%% |\n",
                  results[i].concurrency, j["per_step"].get<double>(), j["kib"].get<double>(),
                  j["total_us"].get<double>(), j["waiting_us"].get<double>(),
                  j["transfer_us"].get<double>(), j["reduce_us"].get<double>(),
                  100 * j["share_of_wall"].get<double>());
    }
  }
  return 0;
}

}  // namespace troupe::cli::serve_bench
