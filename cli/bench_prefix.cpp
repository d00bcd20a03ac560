// troupe bench --prefix: what prefix caching buys, with the cache on and
// off in the same run (two pipelines in this process, one after the
// other, the same model and prompts):
// - a long shared system prompt: time to first token of a request that
//   extends it, against the first request's;
// - a multi-turn chat: the prompt tokens computed against the tokens each
//   turn adds;
// - many users over a few long system prompts: hit rate and throughput;
// - preemption under a KV pool too small for the load: without a host tier
//   (recomputed tokens), with one (none recomputed), against a pool large
//   enough for all (the answers must be the same).
// Prompts are random token ids (no special tokens): the cache works on ids,
// and a random-weight model has no text worth reading.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>

#include "actors/runtime.hpp"
#include "cli/bench.hpp"
#include "models/tokenizer.hpp"

namespace troupe::cli::serve_bench {

namespace {

/// One request's times and what the cache gave it.
struct one_run {
  double ttft_ms = -1, total_ms = 0;
  std::int64_t prompt = 0, cached = 0, generated = 0;
  std::vector<std::int32_t> tokens;
  bool ok = false;
};

/// Runs `reqs` with at most `concurrency` in flight; their results in order.
std::vector<one_run> run_requests(actors::client& client,
                                  std::vector<actors::generate_request> reqs, int concurrency) {
  std::vector<one_run> out(reqs.size());
  std::mutex m;
  std::condition_variable cv;
  std::size_t next = 0, done = 0;
  int in_flight = 0;
  std::vector<clock::time_point> start(reqs.size());
  std::unique_lock lock(m);
  while (done < reqs.size()) {
    while (in_flight < concurrency && next < reqs.size()) {
      const auto i = next++;
      ++in_flight;
      start[i] = clock::now();
      actors::client::callbacks cb;
      cb.on_token = [&, i](const actors::token_event&) {
        std::lock_guard l(m);
        if (out[i].ttft_ms < 0) out[i].ttft_ms = ms(clock::now() - start[i]);
      };
      cb.on_finish = [&, i](const actors::finish_event& f) {
        std::lock_guard l(m);
        auto& r = out[i];
        r.total_ms = ms(clock::now() - start[i]);
        r.prompt = f.prompt_tokens;
        r.cached = f.cached_tokens;
        r.generated = static_cast<std::int64_t>(f.tokens.size());
        r.tokens = f.tokens;
        r.ok = f.reason == actors::finish_reason::stop || f.reason == actors::finish_reason::length;
        if (!r.ok) spdlog::warn("request failed: {} {}", to_string(f.reason), f.error);
        ++done;
        --in_flight;
        cv.notify_all();
      };
      auto req = std::move(reqs[i]);
      req.id = actors::client::next_id();
      lock.unlock();
      auto ack = client.submit(std::move(req), std::move(cb));
      lock.lock();
      if (!ack) {
        spdlog::warn("request refused: {}", ack.error().message);
        ++done;
        --in_flight;
      }
    }
    cv.wait(lock,
            [&] { return done == reqs.size() || (in_flight < concurrency && next < reqs.size()); });
  }
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct prefix_figures {
  // A shared system prompt.
  double cold_ttft = 0, warm_ttft = 0;
  std::int64_t warm_cached = 0;
  // A multi-turn chat.
  std::int64_t chat_computed = 0, chat_new = 0;
  // Many users.
  double users_seconds = 0, users_out_tps = 0, users_mean_ttft = 0;
  std::int64_t users_queries = 0, users_hits = 0;
  int users_failed = 0;
  std::vector<std::vector<std::int32_t>> answers;  // every answer, to compare on and off
};

}  // namespace

int run_prefix_bench(const bench_args& a) {
  using namespace troupe::models;
  auto precision = parse_precision_flags(a.quant, {}, a.kv_type);
  if (!precision) {
    spdlog::error("{}", precision.error().message);
    return 2;
  }
  auto devices = actors::parse_devices(a.devices.empty() ? "cpu" : a.devices);
  if (!devices) {
    spdlog::error("--devices: {}", devices.error().message);
    return 2;
  }
  auto src = weight_source::open(a.model);
  if (!src) {
    spdlog::error("{}", src.error().message);
    return 1;
  }
  const std::string dir = std::filesystem::is_directory(a.model)
                              ? a.model
                              : std::filesystem::path(a.model).parent_path().string();
  auto tok = (*src)->is_gguf() ? tokenizer::from_gguf(*(*src)->gguf()) : tokenizer::load(dir);
  if (!tok) {
    spdlog::error("tokenizer: {}", tok.error().message);
    return 1;
  }
  src->reset();
  // Random ordinary tokens.
  std::vector<std::int32_t> ordinary;
  for (std::int32_t id = 0; id < static_cast<std::int32_t>(tok->vocab_size()); ++id)
    if (!tok->is_special(id)) ordinary.push_back(id);
  if (ordinary.empty()) {
    spdlog::error("the tokenizer has no ordinary tokens");
    return 1;
  }
  std::mt19937_64 rng(a.seed);
  auto random_tokens = [&](std::int64_t n) {
    std::vector<std::int32_t> t(static_cast<std::size_t>(n));
    for (auto& x : t) x = ordinary[rng() % ordinary.size()];
    return t;
  };
  const auto& p = a.prefix;
  const auto system = random_tokens(p.system_tokens);
  std::vector<std::vector<std::int32_t>> questions;
  for (int i = 0; i < p.probes + 1; ++i) questions.push_back(random_tokens(p.question_tokens));
  std::vector<std::vector<std::int32_t>> turns;
  for (int i = 0; i < p.turns; ++i) turns.push_back(random_tokens(p.turn_tokens));
  std::vector<std::vector<std::int32_t>> systems;
  for (int i = 0; i < p.systems; ++i) systems.push_back(random_tokens(p.users_system_tokens));
  std::vector<std::vector<std::int32_t>> user_questions;
  for (int i = 0; i < p.users; ++i) user_questions.push_back(random_tokens(p.question_tokens));

  sampling_params params;  // greedy, no stop token: answers of exactly max_tokens
  params.temperature = 0;
  const std::int64_t longest = std::max<std::int64_t>(p.system_tokens + p.question_tokens,
                                                      p.turns * (p.turn_tokens + p.answer_tokens)) +
                               std::max(a.max_tokens, p.answer_tokens) + 64;
  kv_options kv;
  kv.type = precision->kv_type;
  kv.capacity_tokens =
      a.ctx_tokens > 0 ? a.ctx_tokens
                       : std::max<std::int64_t>(longest * p.concurrency,
                                                p.systems * p.users_system_tokens * 2 + longest);
  auto run_all = [&](bool caching) -> std::optional<prefix_figures> {
    caf::actor_system_config cfg;
    auto flags = a.pipeline;
    flags.prefix_caching = caching;
    if (flags.context.max_model_len == 0) flags.context = {longest + 64, true};
    configure_pipeline_system(cfg, flags);
    caf::actor_system sys{cfg};
    auto rc = pipeline_config(flags, a.model, *devices, precision->plan, kv);
    rc.scheduler.queue_limit = std::max<std::int64_t>(64, p.users);
    auto rt = actors::local_runtime::start(sys, rc);
    if (!rt) {
      spdlog::error("{}", rt.error().message);
      return std::nullopt;
    }
    actors::client client(sys, (*rt)->scheduler());
    auto request = [&](std::vector<std::int32_t> ids, std::int64_t max_tokens) {
      actors::generate_request r;
      r.prompt_tokens = std::move(ids);
      r.params = params;
      r.params.max_tokens = max_tokens;
      return r;
    };
    auto concat = [](std::vector<std::int32_t> x, const std::vector<std::int32_t>& y) {
      x.insert(x.end(), y.begin(), y.end());
      return x;
    };
    prefix_figures f;
    // Warm-up: one short request through every actor.
    (void)run_requests(client, {request(random_tokens(8), 2)}, 1);
    // 1. The shared system prompt: the first request, then the probes one at a time.
    auto cold = run_requests(client, {request(concat(system, questions[0]), a.max_tokens)}, 1);
    if (cold.empty() || !cold[0].ok) return std::nullopt;
    f.cold_ttft = cold[0].ttft_ms;
    f.answers.push_back(cold[0].tokens);
    std::vector<double> warm;
    for (int i = 1; i <= p.probes; ++i) {
      auto w = run_requests(
          client, {request(concat(system, questions[static_cast<std::size_t>(i)]), a.max_tokens)},
          1);
      if (w.empty() || !w[0].ok) return std::nullopt;
      warm.push_back(w[0].ttft_ms);
      f.warm_cached = w[0].cached;
      f.answers.push_back(w[0].tokens);
    }
    f.warm_ttft = median(warm);
    // 2. A multi-turn chat: each turn's prompt is the last one, its answer
    // and the new message.
    std::vector<std::int32_t> chat;
    for (int t = 0; t < p.turns; ++t) {
      chat = concat(chat, turns[static_cast<std::size_t>(t)]);
      auto r = run_requests(client, {request(chat, p.answer_tokens)}, 1);
      if (r.empty() || !r[0].ok) return std::nullopt;
      f.chat_computed += r[0].prompt - r[0].cached;
      f.chat_new += p.turn_tokens;
      f.answers.push_back(r[0].tokens);
      chat = concat(chat, r[0].tokens);
    }
    // 3. Many users over a few system prompts.
    std::vector<actors::generate_request> reqs;
    for (int u = 0; u < p.users; ++u)
      reqs.push_back(request(concat(systems[static_cast<std::size_t>(u % p.systems)],
                                    user_questions[static_cast<std::size_t>(u)]),
                             a.max_tokens));
    const auto s0 = client.stats();
    const auto t0 = clock::now();
    auto users = run_requests(client, std::move(reqs), p.concurrency);
    f.users_seconds = ms(clock::now() - t0) / 1e3;
    const auto s1 = client.stats();
    f.users_queries = s1.prefix_queries - s0.prefix_queries;
    f.users_hits = s1.prefix_hits - s0.prefix_hits;
    std::int64_t out = 0;
    std::vector<double> ttfts;
    for (const auto& r : users) {
      if (!r.ok) {
        ++f.users_failed;
        continue;
      }
      out += r.generated;
      ttfts.push_back(r.ttft_ms);
      f.answers.push_back(r.tokens);
    }
    f.users_out_tps = f.users_seconds > 0 ? static_cast<double>(out) / f.users_seconds : 0;
    f.users_mean_ttft = bench::mean(ttfts);
    return f;
  };
  // 4. Preemption: every request at once over a pool too small for them.
  struct swap_figures {
    double seconds = 0, out_tps = 0;
    actors::scheduler_stats stats;
    std::vector<std::vector<std::int32_t>> answers;
    int failed = 0;
  };
  std::vector<std::vector<std::int32_t>> swap_prompts;
  for (int i = 0; i < p.swap_requests; ++i)
    swap_prompts.push_back(random_tokens(p.swap_prompt_tokens));
  auto run_swap = [&](std::int64_t ctx, std::int64_t host) -> std::optional<swap_figures> {
    caf::actor_system_config cfg;
    auto flags = a.pipeline;
    flags.prefix_caching = true;
    flags.tiers = {host, 0, {}};
    if (flags.context.max_model_len == 0)
      flags.context = {p.swap_prompt_tokens + p.swap_answer_tokens + 64, true};
    configure_pipeline_system(cfg, flags);
    caf::actor_system sys{cfg};
    auto skv = kv;
    skv.capacity_tokens = ctx;
    auto rc = pipeline_config(flags, a.model, *devices, precision->plan, skv);
    rc.scheduler.queue_limit = std::max(64, p.swap_requests);
    auto rt = actors::local_runtime::start(sys, rc);
    if (!rt) {
      spdlog::error("{}", rt.error().message);
      return std::nullopt;
    }
    actors::client client(sys, (*rt)->scheduler());
    std::vector<actors::generate_request> reqs;
    for (const auto& prompt : swap_prompts) {
      actors::generate_request r;
      r.prompt_tokens = prompt;
      r.params = params;
      r.params.max_tokens = p.swap_answer_tokens;
      reqs.push_back(std::move(r));
    }
    swap_figures f;
    const auto t0 = clock::now();
    auto got = run_requests(client, std::move(reqs), p.swap_requests);
    f.seconds = ms(clock::now() - t0) / 1e3;
    f.stats = client.stats();
    std::int64_t out = 0;
    for (const auto& r : got) {
      f.failed += r.ok ? 0 : 1;
      out += r.generated;
      f.answers.push_back(r.tokens);
    }
    f.out_tps = f.seconds > 0 ? static_cast<double>(out) / f.seconds : 0;
    return f;
  };
  spdlog::info("prefix bench: preemption, a pool of {} tokens without a host tier", p.swap_ctx);
  auto swap_none = run_swap(p.swap_ctx, 0);
  spdlog::info("prefix bench: preemption, with a host tier of {} tokens", p.swap_host_tokens);
  auto swap_host = run_swap(p.swap_ctx, p.swap_host_tokens);
  spdlog::info("prefix bench: the same requests over a pool that holds them all");
  auto swap_big = run_swap(p.swap_requests * (p.swap_prompt_tokens + p.swap_answer_tokens + 32), 0);
  if (!swap_none || !swap_host || !swap_big) {
    spdlog::error("the preemption workload could not start (the log says why)");
    return 1;
  }
  const bool swap_same =
      swap_none->answers == swap_big->answers && swap_host->answers == swap_big->answers;
  spdlog::info("prefix bench: the pipeline with the cache on");
  auto on = run_all(true);
  spdlog::info("prefix bench: the pipeline with the cache off");
  auto off = run_all(false);
  if (!on || !off) {
    spdlog::error("a request failed (the log says which)");
    return 1;
  }
  const bool same = on->answers == off->answers;
  const double ttft_ratio = on->warm_ttft > 0 ? on->cold_ttft / on->warm_ttft : 0;
  const double chat_ratio =
      on->chat_new > 0 ? static_cast<double>(on->chat_computed) / static_cast<double>(on->chat_new)
                       : 0;
  const double hit_rate = on->users_queries > 0 ? static_cast<double>(on->users_hits) /
                                                      static_cast<double>(on->users_queries)
                                                : 0;
  const double speedup = off->users_out_tps > 0 ? on->users_out_tps / off->users_out_tps : 0;
  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model;
    j["same_answers_on_and_off"] = same;
    j["system_prompt"] = {{"tokens", p.system_tokens},
                          {"question_tokens", p.question_tokens},
                          {"cold_ttft_ms", on->cold_ttft},
                          {"warm_ttft_ms", on->warm_ttft},
                          {"warm_ttft_ms_cache_off", off->warm_ttft},
                          {"cached_tokens", on->warm_cached},
                          {"cold_over_warm", ttft_ratio}};
    j["chat"] = {{"turns", p.turns},
                 {"new_tokens", on->chat_new},
                 {"computed_tokens", on->chat_computed},
                 {"computed_tokens_cache_off", off->chat_computed},
                 {"computed_over_new", chat_ratio}};
    j["users"] = {{"systems", p.systems},
                  {"system_tokens", p.users_system_tokens},
                  {"users", p.users},
                  {"concurrency", p.concurrency},
                  {"hit_rate", hit_rate},
                  {"output_tokens_per_s", on->users_out_tps},
                  {"output_tokens_per_s_cache_off", off->users_out_tps},
                  {"mean_ttft_ms", on->users_mean_ttft},
                  {"mean_ttft_ms_cache_off", off->users_mean_ttft},
                  {"speedup", speedup},
                  {"failed", on->users_failed + off->users_failed}};
    auto swap_json = [](const swap_figures& f) {
      return nlohmann::json{{"seconds", f.seconds},
                            {"output_tokens_per_s", f.out_tps},
                            {"preemptions", f.stats.preemptions},
                            {"restored_tokens", f.stats.restored_tokens},
                            {"recomputed_tokens", f.stats.recomputed_tokens},
                            {"blocks_to_host", f.stats.kv_to_host},
                            {"blocks_from_host", f.stats.kv_from_host},
                            {"failed", f.failed}};
    };
    j["preemption"] = {{"requests", p.swap_requests},
                       {"prompt_tokens", p.swap_prompt_tokens},
                       {"answer_tokens", p.swap_answer_tokens},
                       {"pool_tokens", p.swap_ctx},
                       {"host_tier_tokens", p.swap_host_tokens},
                       {"same_answers_as_a_pool_that_holds_all", swap_same},
                       {"no_tier", swap_json(*swap_none)},
                       {"host_tier", swap_json(*swap_host)},
                       {"large_pool", swap_json(*swap_big)}};
    std::puts(j.dump(2).c_str());
    return same && swap_same ? 0 : 1;
  }
  std::printf("troupe bench --prefix: %s, %lld tokens per answer (greedy, no stop token)\n",
              a.model.c_str(), static_cast<long long>(a.max_tokens));
  std::printf("answers with the cache on and off: %s\n\n",
              same ? "identical" : "DIFFERENT (a defect)");
  std::printf("| workload | cache on | cache off | figure |\n|---|---|---|---|\n");
  std::printf(
      "| system prompt of %lld tokens + %lld: TTFT of the first request | %.1f ms | %.1f ms | |\n",
      static_cast<long long>(p.system_tokens), static_cast<long long>(p.question_tokens),
      on->cold_ttft, off->cold_ttft);
  std::printf(
      "| ... TTFT of a request extending it (median of %d) | %.1f ms (%lld tokens cached) | %.1f "
      "ms | first / extending = %.1fx |\n",
      p.probes, on->warm_ttft, static_cast<long long>(on->warm_cached), off->warm_ttft, ttft_ratio);
  std::printf(
      "| chat of %d turns (+%lld tokens a turn, answers of %lld): prompt tokens computed | %lld | "
      "%lld | %.2fx the %lld new |\n",
      p.turns, static_cast<long long>(p.turn_tokens), static_cast<long long>(p.answer_tokens),
      static_cast<long long>(on->chat_computed), static_cast<long long>(off->chat_computed),
      chat_ratio, static_cast<long long>(on->chat_new));
  std::printf(
      "| %d users over %d system prompts of %lld tokens, %d at a time: output tokens/s | %.1f | "
      "%.1f | %.2fx; hit rate %.1f%% |\n",
      p.users, p.systems, static_cast<long long>(p.users_system_tokens), p.concurrency,
      on->users_out_tps, off->users_out_tps, speedup, 100 * hit_rate);
  std::printf("| ... mean TTFT | %.1f ms | %.1f ms | |\n", on->users_mean_ttft,
              off->users_mean_ttft);
  if (on->users_failed + off->users_failed > 0)
    std::printf("\nfailed requests: %d\n", on->users_failed + off->users_failed);
  std::printf(
      "\npreemption: %d requests of %lld + %lld tokens at once over a pool of %lld tokens per "
      "stage\nanswers without a tier, with a host tier and over a pool that holds them all: %s\n\n",
      p.swap_requests, static_cast<long long>(p.swap_prompt_tokens),
      static_cast<long long>(p.swap_answer_tokens), static_cast<long long>(p.swap_ctx),
      swap_same ? "identical" : "DIFFERENT (a defect)");
  std::printf(
      "| pool | preemptions | tokens restored | tokens recomputed | blocks to / from host | "
      "output tokens/s | failed |\n|---|---|---|---|---|---|---|\n");
  for (const auto& [name, f] :
       {std::pair<std::string, const swap_figures*>{"small, no tier", &*swap_none},
        {"small, host tier of " + std::to_string(p.swap_host_tokens) + " tokens", &*swap_host},
        {"large enough for all", &*swap_big}})
    std::printf("| %s | %lld | %lld | %lld | %lld / %lld | %.1f | %d |\n", name.c_str(),
                static_cast<long long>(f->stats.preemptions),
                static_cast<long long>(f->stats.restored_tokens),
                static_cast<long long>(f->stats.recomputed_tokens),
                static_cast<long long>(f->stats.kv_to_host),
                static_cast<long long>(f->stats.kv_from_host), f->out_tps, f->failed);
  return same && swap_same ? 0 : 1;
}

}  // namespace troupe::cli::serve_bench
