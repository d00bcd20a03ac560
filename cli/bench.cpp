// troupe bench: drives concurrent requests through the actor pipeline and
// reports what `vllm bench serve` reports (completed/failed, requests/s,
// output tokens/s, TTFT, inter-token latency, end-to-end latency), plus the
// plain generation loop on one request in the same run as the reference.
#include <spdlog/spdlog.h>

#include <caf/io/all.hpp>

#include <httplib.h>
#include <openssl/evp.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "actors/cluster.hpp"
#include "actors/gatekeeper.hpp"
#include "actors/pipeline_stats.hpp"
#include "actors/runtime.hpp"
#include "cli/cluster_setup.hpp"
#include "cli/commands.hpp"
#include "cli/model_setup.hpp"
#include "cluster/certs.hpp"
#include "models/generate.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"
#include "models/llava.hpp"
#include "models/llava_config.hpp"

namespace troupe::cli {

namespace {

using clock = std::chrono::steady_clock;

struct bench_args {
  std::string model, devices, concurrency = "1,4,16", images_dir, quant, kv_type = "f32";
  std::string remote_stage;           // HOST:PORT of a troupe worker serving the last layers
  std::vector<std::string> tp_peers;  // HOST:PORT of tensor-parallel workers (ranks 1..K-1)
  bool balance = true;                // micro-batches sized to an even share of the work
  int stages = 1, micro_batches = 0, decode_steps = 16, requests = 0, threads = 0;
  std::int64_t max_tokens = 64, ctx_tokens = 0;
  double image_share = 0.5;
  std::uint64_t seed = 1;
  bool json = false, no_reference = false;
  bool completions = false;   ///< --http: /v1/completions with text prompts
  std::string http, api_key;  // --http: an OpenAI-compatible server instead of in-process actors
  std::string manifest;       // --http with --migrate: the cluster behind the server
  std::vector<std::string> migrate;  // SHARD:NODE, done in turn mid-way through the last level
};

/// A chunk's arrival and the gap before it (ms), for gaps during migrations.
struct timed_gap {
  clock::time_point at;
  double gap_ms = 0;
};

double ms(clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

clock::time_point gap_began(const timed_gap& g) {
  return g.at - std::chrono::duration_cast<clock::duration>(
                    std::chrono::duration<double, std::milli>(g.gap_ms));
}

/// The longest gap that overlaps [from, to].
double longest_gap_in(const std::vector<timed_gap>& gaps, clock::time_point from,
                      clock::time_point to) {
  double worst = 0;
  for (const auto& g : gaps)
    if (g.at >= from && gap_began(g) <= to) worst = std::max(worst, g.gap_ms);
  return worst;
}

/// A move's reference from the same run: the longest gap in windows of the
/// move's length placed every 5 ms across the level, leaving out windows
/// within 100 ms of any move. The workload makes long gaps of its own (a
/// wave of requests arriving together prefills at once, images are
/// encoded); these say how long a gap a window of that length meets
/// without a move. Returns each window's longest gap, sorted.
std::vector<double> longest_gap_without_moves(
    const std::vector<timed_gap>& gaps, clock::duration length,
    const std::vector<std::pair<clock::time_point, clock::time_point>>& moves) {
  if (gaps.empty()) return {};
  auto first = gap_began(gaps.front()), last = gaps.front().at;
  for (const auto& g : gaps) {
    first = std::min(first, gap_began(g));
    last = std::max(last, g.at);
  }
  const auto margin = std::chrono::milliseconds(100);
  std::vector<double> worst;
  for (auto t = first; t + length <= last; t += std::chrono::milliseconds(5)) {
    bool near_a_move = false;
    for (const auto& [a, b] : moves) near_a_move |= t <= b + margin && t + length >= a - margin;
    if (!near_a_move) worst.push_back(longest_gap_in(gaps, t, t + length));
  }
  std::sort(worst.begin(), worst.end());
  return worst;
}

struct distribution {
  double mean = 0, p50 = 0, p99 = 0;
};

distribution summarize(std::vector<double> v) {
  distribution d;
  if (v.empty()) return d;
  std::sort(v.begin(), v.end());
  d.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  auto at = [&](double q) {
    const double pos = q * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<std::size_t>(pos);
    const auto hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
  };
  d.p50 = at(0.5);
  d.p99 = at(0.99);
  return d;
}

nlohmann::json to_json(const distribution& d) {
  return {{"mean", d.mean}, {"p50", d.p50}, {"p99", d.p99}};
}

/// One workload item: a prompt and, for a vision model, maybe an image.
struct work_item {
  std::vector<std::int32_t> ids;
  std::string image;  // file path ("" = text only)
};

struct level_result {
  int concurrency = 0;
  int completed = 0, failed = 0;
  double seconds = 0;
  std::int64_t output_tokens = 0, input_tokens = 0;
  distribution ttft, itl, e2e;
  std::vector<timed_gap> gaps;   // --http: every inter-chunk gap with its arrival time
  double single_decode_tps = 0;  // decode tokens/s per request (mean)
  std::int64_t chunks = 0;  // streamed token events (a multi-step event carries several tokens)
};

double tokens_per_s(const level_result& r) {
  return static_cast<double>(r.output_tokens) / std::max(1e-9, r.seconds);
}

/// The figures every level reports, in JSON (`base`: the first level's
/// output tokens/s).
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

/// The same as a table row, without its closing "|\n".
void print_level_row(const level_result& r, double base) {
  const double tps = tokens_per_s(r);
  std::printf(
      "| %d | %d | %d | %.2f | %.1f | %.2f | %.1f / %.1f / %.1f | %.2f / %.2f / %.2f | %.0f / %.0f "
      "/ %.0f ",
      r.concurrency, r.completed, r.failed, r.completed / std::max(1e-9, r.seconds), tps,
      base > 0 ? tps / base : 0, r.ttft.mean, r.ttft.p50, r.ttft.p99, r.itl.mean, r.itl.p50,
      r.itl.p99, r.e2e.mean, r.e2e.p50, r.e2e.p99);
}

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

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
    if (!it.image.empty()) req.images.push_back({it.image, image_bytes[it.image]});
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
      if (f.reason == "error" || f.reason == "cancelled" || f.reason == "deadline") {
        ++out.failed;
        spdlog::warn("request {} failed: {} {}", id, f.reason, f.error);
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
  out.seconds = ms(clock::now() - t0) / 1e3;
  out.ttft = summarize(ttft);
  out.itl = summarize(itl);
  out.e2e = summarize(e2e);
  out.single_decode_tps = decode_tps.empty()
                              ? 0
                              : std::accumulate(decode_tps.begin(), decode_tps.end(), 0.0) /
                                    static_cast<double>(decode_tps.size());
  return out;
}

/// One level against an OpenAI-compatible server (`troupe serve`, or any
/// other): `concurrency` clients, each sending streamed chat completions
/// back to back until `total` are done, as `vllm bench serve` does.
/// One level of `--http`; `during` (if set) runs once every stream is
/// decoding (the migrations of --migrate).
level_result run_http_level(const std::string& url, const std::string& key, int concurrency,
                            int total, std::int64_t max_tokens, double image_share,
                            const std::vector<std::string>& images, std::uint64_t seed,
                            bool completions, const std::function<void()>& during = {}) {
  level_result out;
  out.concurrency = concurrency;
  const std::vector<std::string> questions = {"Describe the image.", "How many shapes are there?",
                                              "What shape is on the left?",
                                              "What color is the shape at the top?"};
  std::vector<std::string> data_urls;
  for (const auto& f : images) {
    const auto bytes = read_file(f);
    std::string b64(4 * ((bytes.size() + 2) / 3), '\0');
    EVP_EncodeBlock(reinterpret_cast<unsigned char*>(b64.data()), bytes.data(),
                    static_cast<int>(bytes.size()));
    data_urls.push_back(std::string("data:image/") + (f.ends_with(".png") ? "png" : "jpeg") +
                        ";base64," + b64);
  }
  std::mutex m;
  std::vector<double> ttft, itl, e2e;
  std::atomic<int> next{0};
  std::atomic<std::int64_t> chunks_seen{0};
  const auto t0 = clock::now();
  auto worker = [&] {
    httplib::Client cli(url);
    cli.set_read_timeout(600, 0);
    cli.set_write_timeout(60, 0);
    for (int i = next++; i < total; i = next++) {
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(i));
      nlohmann::json content = nlohmann::json::array(
          {{{"type", "text"},
            {"text", questions[static_cast<std::size_t>(i) % questions.size()]}}});
      if (!data_urls.empty() && std::uniform_real_distribution<>(0, 1)(rng) < image_share)
        content.push_back(
            {{"type", "image_url"},
             {"image_url", {{"url", data_urls[static_cast<std::size_t>(i) % data_urls.size()]}}}});
      nlohmann::json body{
          {"max_tokens", max_tokens}, {"ignore_eos", true},
          {"temperature", 0.8},       {"seed", i},
          {"stream", true},           {"stream_options", {{"include_usage", true}}}};
      if (completions)
        body["prompt"] = questions[static_cast<std::size_t>(i) % questions.size()];
      else
        body["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", content}}});
      httplib::Request req;
      req.method = "POST";
      req.path = completions ? "/v1/completions" : "/v1/chat/completions";
      req.set_header("Content-Type", "application/json");
      if (!key.empty()) req.set_header("Authorization", "Bearer " + key);
      req.body = body.dump();
      const auto start = clock::now();
      auto last = start;
      double first = -1;
      std::vector<double> gaps;
      std::vector<clock::time_point> gap_at;
      std::int64_t prompt = 0, completion = 0;
      std::string buffer;
      bool done = false;
      req.content_receiver = [&](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
        buffer.append(data, n);
        for (auto nl = buffer.find("\n\n"); nl != std::string::npos; nl = buffer.find("\n\n")) {
          const auto event = buffer.substr(0, nl);
          buffer.erase(0, nl + 2);
          if (event.rfind("data: ", 0) != 0) continue;
          const auto payload = event.substr(6);
          if (payload == "[DONE]") {
            done = true;
            continue;
          }
          auto j = nlohmann::json::parse(payload, nullptr, false);
          if (j.is_discarded()) continue;
          if (j.contains("usage") && j["usage"].is_object()) {
            prompt = j["usage"].value("prompt_tokens", 0);
            completion = j["usage"].value("completion_tokens", 0);
          }
          if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) continue;
          const auto& c0 = j["choices"][0];
          if (completions ? !c0.contains("text")
                          : (!c0.contains("delta") || !c0["delta"].contains("content")))
            continue;
          const auto now = clock::now();
          if (first < 0)
            first = ms(now - start);
          else {
            gaps.push_back(ms(now - last));
            gap_at.push_back(now);
          }
          last = now;
          ++chunks_seen;
        }
        return true;
      };
      httplib::Response res;
      httplib::Error err = httplib::Error::Success;
      const bool ok = cli.send(req, res, err) && res.status == 200 && done && completion > 0;
      std::lock_guard lock(m);
      if (!ok) {
        ++out.failed;
        // An error answer is JSON, not events: what the server said.
        spdlog::warn("request {} failed: {} (status {}){}", i, httplib::to_string(err), res.status,
                     buffer.empty() ? std::string{} : ": " + buffer.substr(0, 300));
        continue;
      }
      ++out.completed;
      out.output_tokens += completion;
      out.input_tokens += prompt;
      out.chunks += static_cast<std::int64_t>(gaps.size()) + 1;
      ttft.push_back(first);
      itl.insert(itl.end(), gaps.begin(), gaps.end());
      for (std::size_t g = 0; g < gaps.size(); ++g) out.gaps.push_back({gap_at[g], gaps[g]});
      e2e.push_back(ms(clock::now() - start));
    }
  };
  std::vector<std::thread> threads;
  for (int c = 0; c < concurrency; ++c) threads.emplace_back(worker);
  if (during) {
    // Mid-decode: once every stream has sent a few chunks.
    const auto until = clock::now() + std::chrono::seconds(120);
    while (chunks_seen < static_cast<std::int64_t>(concurrency) * 8 && clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    during();
  }
  for (auto& t : threads) t.join();
  out.seconds = ms(clock::now() - t0) / 1e3;
  out.ttft = summarize(ttft);
  out.itl = summarize(itl);
  out.e2e = summarize(e2e);
  return out;
}

int run_http_bench(const bench_args& a, const std::vector<int>& levels) {
  std::vector<std::string> images;
  if (a.image_share > 0) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(a.images_dir, ec))
      if (e.path().extension() == ".png" || e.path().extension() == ".jpg")
        images.push_back(e.path().string());
    std::sort(images.begin(), images.end());
  }
  {
    httplib::Client probe(a.http);
    auto r =
        probe.Get("/v1/models", a.api_key.empty()
                                    ? httplib::Headers{}
                                    : httplib::Headers{{"Authorization", "Bearer " + a.api_key}});
    if (!r || r->status != 200) {
      spdlog::error("--http {}: {}", a.http,
                    r ? "status " + std::to_string(r->status) + ": " + r->body
                      : httplib::to_string(r.error()));
      return 1;
    }
  }
  // --migrate: the moves, through the cluster's client certificate, during
  // the last level; each move's window is kept to find the gaps it caused.
  struct move_done {
    std::string what;
    clock::time_point start, end;
    std::optional<actors::migrate_report> report;
    std::string error;
  };
  std::vector<move_done> moves;
  std::function<void()> during;
  std::unique_ptr<client_session> client;
  if (!a.migrate.empty()) {
    auto m = load_manifest_or_report(a.manifest);
    if (!m) return 2;
    client = open_client(*m, "--migrate");
    if (!client) return 1;
    during = [&] {
      for (const auto& mv : a.migrate) {
        const auto colon = mv.rfind(':');
        move_done r;
        r.what = mv;
        r.start = clock::now();
        auto rep = actors::migrate_shard(
            *client->sys, client->door,
            actors::migrate_request{mv.substr(0, colon), mv.substr(colon + 1)},
            std::chrono::seconds(120));
        r.end = clock::now();
        if (rep)
          r.report = *rep;
        else
          r.error = rep.error();
        moves.push_back(std::move(r));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    };
  }
  std::vector<level_result> results;
  for (std::size_t l = 0; l < levels.size(); ++l) {
    const int c = levels[l];
    results.push_back(run_http_level(a.http, a.api_key, c,
                                     a.requests > 0 ? a.requests : std::max(2 * c, 8), a.max_tokens,
                                     a.image_share, images, a.seed, a.completions,
                                     l + 1 == levels.size() ? during : std::function<void()>{}));
  }
  const double base = results.front().output_tokens / std::max(1e-9, results.front().seconds);
  if (a.json) {
    nlohmann::json j;
    j["server"] = a.http;
    j["max_tokens"] = a.max_tokens;
    for (const auto& r : results) j["levels"].push_back(level_json(r, base));
    std::puts(j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "troupe bench --http %s: streamed %s, %lld output tokens each (ignore_eos), T=0.8, %.0f%% "
      "with an image\n",
      a.http.c_str(), a.completions ? "completions" : "chat completions",
      static_cast<long long>(a.max_tokens),
      images.empty() || a.completions ? 0.0 : a.image_share * 100);
  std::printf(
      "\n| conc | done | failed | req/s | out tok/s | x first | TTFT mean/p50/p99 ms | ITL "
      "mean/p50/p99 ms | E2E mean/p50/p99 ms |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : results) {
    print_level_row(r, base);
    std::printf("|\n");
  }
  std::printf("\nITL is the gap between SSE chunks as the client received them.\n");
  if (!moves.empty()) {
    const auto& last = results.back();
    std::vector<double> all;
    for (const auto& g : last.gaps) all.push_back(g.gap_ms);
    const double median = summarize(all).p50;
    std::printf("\nLive migrations during the concurrency-%d level (median ITL %.2f ms there):\n\n",
                last.concurrency, median);
    std::printf(
        "| move | result | pause ms | KV MiB (in the pause) | load ms | total ms | longest gap "
        "during it, ms | x median ITL "
        "| same-length windows without a move: longest gap p50 / p90 ms | of those, with a longer "
        "gap |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
    std::vector<std::pair<clock::time_point, clock::time_point>> windows;
    for (const auto& mv : moves) windows.emplace_back(mv.start, mv.end);
    for (const auto& mv : moves) {
      const double worst = longest_gap_in(last.gaps, mv.start, mv.end);
      const auto ref = longest_gap_without_moves(last.gaps, mv.end - mv.start, windows);
      if (!mv.report) {
        std::printf("| %s | failed: %s | | | | | %.1f | | | |\n", mv.what.c_str(), mv.error.c_str(),
                    worst);
        continue;
      }
      const auto& r = *mv.report;
      char without[64] = "(no window)", longer[32] = "";
      if (!ref.empty()) {
        std::snprintf(without, sizeof without, "%.1f / %.1f", ref[ref.size() / 2],
                      ref[ref.size() * 9 / 10]);
        const auto above =
            static_cast<double>(ref.end() - std::upper_bound(ref.begin(), ref.end(), worst));
        std::snprintf(longer, sizeof longer, "%.0f%%",
                      100.0 * above / static_cast<double>(ref.size()));
      }
      std::printf(
          "| %s %s -> %s | ok | %.2f | %.3f (%.3f) | %.0f | %.0f | %.1f | %.1f | %s | %s |\n",
          r.what.c_str(), r.from.c_str(), r.to.c_str(), r.pause_ms,
          static_cast<double>(r.kv_bytes) / (1 << 20),
          static_cast<double>(r.final_kv_bytes) / (1 << 20), r.load_ms, r.total_ms, worst,
          median > 0 ? worst / median : 0.0, without, longer);
    }
    std::printf(
        "\nThe same-length windows are placed every 5 ms across the level, 100 ms or more away "
        "from the moves: "
        "the gaps the workload makes by itself (waves of requests prefilling together, images "
        "encoded). A move "
        "that adds nothing lands at a random rank among them.\n");
    std::printf(
        "\nThe aim (issue 8) is a longest gap of at most 3x the median inter-token latency.\n");
  }
  return 0;
}

int run_bench(const bench_args& a) {
  using namespace troupe::models;
  std::vector<int> levels;
  {
    std::string s = a.concurrency;
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
        return 2;
      }
    }
  }
  if (!a.http.empty()) return run_http_bench(a, levels);
  auto plan_r = parse_quant_flags(a.quant, {});
  if (!plan_r) {
    spdlog::error("{}", plan_r.error().message);
    return 2;
  }
  const quant_plan plan = *plan_r;
  auto kv_type = parse_kv_type(a.kv_type);
  if (!kv_type) {
    spdlog::error("{}", kv_type.error().message);
    return 2;
  }
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
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(a.images_dir, ec))
      if (e.path().extension() == ".png" || e.path().extension() == ".jpg")
        image_files.push_back(e.path().string());
    std::sort(image_files.begin(), image_files.end());
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
  kv.type = *kv_type;
  std::int64_t longest = 0;
  for (const auto& w : items)
    longest = std::max<std::int64_t>(
        longest, static_cast<std::int64_t>(w.ids.size()) + (lcfg ? lcfg->tokens_per_image() : 0));
  kv.capacity_tokens = a.ctx_tokens > 0 ? a.ctx_tokens : (longest + a.max_tokens + 32) * max_level;

  // The reference: the plain loop, one request, this process.
  double reference_tps = 0;
  double reference_single_out = 0,
         reference_batch_out = 0;  // output tokens/s of the plain loop, 1 and max_level requests
  if (!a.no_reference) {
    const int threads = devices->front().cores.empty()
                            ? static_cast<int>(std::thread::hardware_concurrency())
                            : static_cast<int>(devices->front().cores.size());
    auto ctx = kernels::cpu::context::create(threads, devices->front().cores);
    auto text = lcfg                ? kernels::result<llama_config>(lcfg->text)
                : (*src)->is_gguf() ? llama_config_from_gguf(*(*src)->gguf())
                                    : load_llama_config(dir + "/config.json");
    if (!text) {
      spdlog::error("{}", text.error().message);
      return 1;
    }
    auto loaded = load_direct_model(**src, lcfg, *text, *ctx, plan);
    if (!loaded) {
      spdlog::error("{}", loaded.error().message);
      return 1;
    }
    const llava_model* llava = loaded->llava.get();
    const llama_model& model = loaded->text();
    generation_request req;
    req.prompt = items.back().ids;  // a text-only prompt
    if (lcfg) {
      auto p = llava->prepare(*ctx, req.prompt, kernels::tensor());
      if (p) req.prompt = p->tokens;
    }
    req.params = params;
    generate_options opts;
    opts.kv = kv;
    opts.kv.capacity_tokens = static_cast<std::int64_t>(req.prompt.size()) + a.max_tokens + 32;
    double best = 0;
    for (int run = 0; run < 2; ++run) {  // the first run warms up
      const auto t_run = clock::now();
      auto out = generate_batch(*ctx, model, {req}, {[](std::int32_t) { return std::string(); }},
                                {}, opts);
      if (!out) {
        spdlog::error("reference: {}", out.error().message);
        return 1;
      }
      const auto& r = (*out)[0];
      if (r.decode_seconds > 0)
        best = std::max(best, static_cast<double>(r.tokens.size() - 1) / r.decode_seconds);
      reference_single_out = std::max(reference_single_out, static_cast<double>(r.tokens.size()) /
                                                                (ms(clock::now() - t_run) / 1e3));
    }
    reference_tps = best;
    // The kernels' own batching gain: the plain loop with max_level text
    // requests in one batch (prefill and decode together, as the scheduler
    // does), against the same loop with one. What the actor pipeline can at
    // best reach at that concurrency on this machine.
    if (max_level > 1) {
      std::vector<generation_request> batch;
      std::vector<models::piece_fn> pieces;
      std::size_t next = 0;
      for (int k = 0; k < max_level; ++k) {
        generation_request r = req;
        for (std::size_t tries = 0; tries < items.size(); ++tries, ++next) {
          const auto& it = items[next % items.size()];
          if (it.image.empty()) {
            r.prompt = it.ids;
            ++next;
            break;
          }
        }
        r.params.seed = params.seed + static_cast<std::uint64_t>(k) + 1;
        batch.push_back(std::move(r));
        pieces.push_back([](std::int32_t) { return std::string(); });
      }
      generate_options bo = opts;
      bo.kv.capacity_tokens = opts.kv.capacity_tokens * max_level;
      const auto t_batch = clock::now();
      auto out = generate_batch(*ctx, model, batch, pieces, {}, bo);
      if (!out) {
        spdlog::error("batched reference: {}", out.error().message);
        return 1;
      }
      std::int64_t produced = 0;
      for (const auto& r : *out) produced += static_cast<std::int64_t>(r.tokens.size());
      reference_batch_out = static_cast<double>(produced) / (ms(clock::now() - t_batch) / 1e3);
    }
  }
  src->reset();

  caf::actor_system_config cfg;
  actors::configure_runtime(cfg);
  if (!a.remote_stage.empty() || !a.tp_peers.empty()) cfg.load<caf::io::middleman>();
  caf::actor_system sys{cfg};
  actors::runtime_config rc;
  rc.model = a.model;
  rc.remote_tail = a.remote_stage;
  rc.tp_peers = a.tp_peers;
  rc.devices = *devices;
  rc.stages = a.stages;
  rc.plan = plan;
  rc.kv = kv;
  rc.scheduler.micro_batches = a.micro_batches;
  rc.scheduler.max_decode_steps = a.decode_steps;
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
  for (int c : levels) {
    const int total = a.requests > 0 ? a.requests : std::max(2 * c, 8);
    const auto s0 = client.stats();
    const auto t0 = clock::now();
    results.push_back(run_level(client, items, c, total, params, image_bytes));
    bubbles.push_back(actors::breakdown_between(s0, client.stats(), ms(clock::now() - t0) / 1e3));
  }
  const auto stats = client.stats();
  const double base =
      results.empty() ? 0 : results.front().output_tokens / std::max(1e-9, results.front().seconds);
  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model;
    j["pipeline"] = (*rt)->describe();
    j["max_tokens"] = a.max_tokens;
    j["reference_decode_tokens_per_s"] = reference_tps;
    j["reference_output_tokens_per_s"] = reference_single_out;
    j["reference_batch"] = {
        {"requests", max_level},
        {"output_tokens_per_s", reference_batch_out},
        {"gain", reference_single_out > 0 ? reference_batch_out / reference_single_out : 0}};
    j["preemptions"] = stats.preemptions;
    for (const auto& r : results) {
      auto l = level_json(r, base);
      l["decode_tokens_per_s_per_request"] = r.single_decode_tps;
      l["tokens_per_chunk"] =
          r.chunks > 0 ? static_cast<double>(r.output_tokens) / static_cast<double>(r.chunks) : 0;
      l["decode_vs_reference"] = reference_tps > 0 ? r.single_decode_tps / reference_tps : 0;
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
  if (reference_tps > 0)
    std::printf(
        "reference (plain loop, 1 text request): decode %.1f tokens/s, output %.1f tokens/s\n",
        reference_tps, reference_single_out);
  if (reference_batch_out > 0)
    std::printf(
        "reference (plain loop, %d text requests in one batch): output %.1f tokens/s, x%.2f of one "
        "request: "
        "the kernels' batching gain on this machine\n",
        max_level, reference_batch_out, reference_batch_out / std::max(1e-9, reference_single_out));
  std::printf(
      "\n| conc | done | failed | req/s | out tok/s | x first | TTFT mean/p50/p99 ms | ITL "
      "mean/p50/p99 ms | E2E mean/p50/p99 ms | decode/req vs ref |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : results) {
    print_level_row(r, base);
    std::printf("| %.2f |\n", reference_tps > 0 ? r.single_decode_tps / reference_tps : 0);
  }
  std::printf("\nITL is the gap between streamed chunks; tokens per chunk (multi-step decode):");
  for (const auto& r : results)
    std::printf(
        " %.1f at %d",
        r.chunks > 0 ? static_cast<double>(r.output_tokens) / static_cast<double>(r.chunks) : 0.0,
        r.concurrency);
  std::printf("\npreemptions: %lld\n", static_cast<long long>(stats.preemptions));
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
  return 0;
}

}  // namespace

command_runner add_bench(CLI::App& app) {
  auto a = std::make_shared<bench_args>();
  auto* cmd = app.add_subcommand(
      "bench",
      "Serve N concurrent requests through the actor pipeline and report latency and throughput");
  cmd->add_option("--model,-m", a->model,
                  "GGUF file or Hugging Face folder (default: the bundled tiny LLaVA)");
  cmd->add_option("--devices", a->devices,
                  "Devices of the stages (cpu, cpu:N, cpu:A-B, comma-separated)");
  cmd->add_option("--stages", a->stages, "Pipeline stages")->check(CLI::Range(1, 1024));
  cmd->add_option("--remote-stage", a->remote_stage,
                  "HOST:PORT of a `troupe worker` serving the last layers");
  cmd->add_option("--tp-peer", a->tp_peers,
                  "HOST:PORT of a `troupe worker --tp-rank R --tp-size K` (repeat for each of "
                  "ranks 1..K-1): tensor "
                  "parallelism across processes, this process being rank 0");
  cmd->add_option("--micro-batches", a->micro_batches, "Micro-batches in flight (default: stages)")
      ->check(CLI::Range(0, 64));
  cmd->add_option("--balance-micro-batches", a->balance,
                  "Size each micro-batch to an even share of the waiting and in-flight tokens "
                  "(default true; false fills "
                  "each to the token budget)");
  cmd->add_option("--decode-steps", a->decode_steps,
                  "Multi-step decode on one stage: decode passes per scheduler step at most (sized "
                  "to ~2 ms; 1 = off)")
      ->check(CLI::Range(1, 64));
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
  cmd->add_option("--quant", a->quant, "Weight format for every matrix");
  cmd->add_option("--kv-type", a->kv_type, "KV cache type: f32, f16, int8");
  cmd->add_option("--ctx", a->ctx_tokens,
                  "KV capacity per stage in tokens (default: enough for the largest level)");
  cmd->add_option("--seed", a->seed);
  cmd->add_flag("--no-reference", a->no_reference, "Skip the plain-loop reference run");
  cmd->add_flag("--json", a->json, "Print one JSON object");
  cmd->add_option("--http", a->http,
                  "Benchmark an OpenAI-compatible server at this URL (e.g. http://127.0.0.1:8000; "
                  "troupe serve)");
  cmd->add_option("--api-key", a->api_key, "With --http: the server's API key");
  cmd->add_flag("--completions", a->completions,
                "With --http: POST /v1/completions with text prompts instead of chat completions "
                "(models without a chat template)");
  cmd->add_option("--manifest", a->manifest,
                  "With --migrate: the cluster's manifest (its client certificate)");
  cmd->add_option("--migrate", a->migrate,
                  "With --http: SHARD:NODE moves (troupe migrate) done in turn mid-way through the "
                  "last level; reports "
                  "the pause and the longest inter-token gap each caused");
  return [a] {
    if (a->model.empty()) a->model = bundled_model_path();
    if (a->images_dir.empty()) a->images_dir = TROUPE_SHAPES_IMAGES;
    return run_bench(*a);
  };
}

}  // namespace troupe::cli
