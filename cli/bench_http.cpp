// troupe bench --http: the same levels against an OpenAI-compatible server
// (`troupe serve`, or any other), streamed as `vllm bench serve` sends
// them; with --migrate, live migrations during the last level
// (bench_migrate.cpp).
#include <httplib.h>
#include <openssl/evp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <thread>

#include "actors/client.hpp"
#include "cli/bench.hpp"
#include "cli/cluster_setup.hpp"

namespace troupe::cli::serve_bench {

namespace {

/// One level against an OpenAI-compatible server: `concurrency` clients,
/// each sending streamed chat completions back to back until `total` are
/// done, as `vllm bench serve` does; `during` (if set) runs once every
/// stream is decoding (the migrations of --migrate).
const std::vector<std::string> questions = {"Describe the image.", "How many shapes are there?",
                                            "What shape is on the left?",
                                            "What color is the shape at the top?"};

/// Request `i` of a level: its question and its image (-1: none); the same
/// through HTTP and through the client actor.
std::pair<std::string, int> request_of(int i, std::uint64_t seed, double image_share,
                                       std::size_t images) {
  std::mt19937_64 rng(seed + static_cast<std::uint64_t>(i));
  const bool image = images > 0 && std::uniform_real_distribution<>(0, 1)(rng) < image_share;
  return {questions[static_cast<std::size_t>(i) % questions.size()],
          image ? static_cast<int>(static_cast<std::size_t>(i) % images) : -1};
}

level_result run_http_level(const std::string& url, const std::string& key, int concurrency,
                            int total, std::int64_t max_tokens, double image_share,
                            const std::vector<std::string>& images, std::uint64_t seed,
                            bool completions, bool keep_alive,
                            const std::function<void()>& during = {}) {
  level_result out;
  out.concurrency = concurrency;
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
    cli.set_keep_alive(keep_alive);  // as OpenAI's clients do (one connection per client)
    // A request's header and body go out as two writes: with Nagle's
    // algorithm the body waited for the server's delayed ACK (~40 ms).
    // curl and Python's asyncio set TCP_NODELAY too.
    cli.set_tcp_nodelay(std::getenv("TROUPE_BENCH_NAGLE") == nullptr);
    for (int i = next++; i < total; i = next++) {
      const auto [question, image] = request_of(i, seed, image_share, data_urls.size());
      nlohmann::json content = nlohmann::json::array({{{"type", "text"}, {"text", question}}});
      if (image >= 0)
        content.push_back({{"type", "image_url"},
                           {"image_url", {{"url", data_urls[static_cast<std::size_t>(image)]}}}});
      nlohmann::json body{
          {"max_tokens", max_tokens}, {"ignore_eos", true},
          {"temperature", 0.8},       {"seed", i},
          {"stream", true},           {"stream_options", {{"include_usage", true}}}};
      if (completions)
        body["prompt"] = question;
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
          // A token: text in the chunk (not the role chunk that opens a chat
          // stream, nor the final one).
          const auto* text = completions ? (c0.contains("text") ? &c0["text"] : nullptr)
                             : c0.contains("delta") && c0["delta"].contains("content")
                                 ? &c0["delta"]["content"]
                                 : nullptr;
          if (!text || !text->is_string() || text->get<std::string>().empty()) continue;
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
  finish_level(out, t0, ttft, itl, e2e);
  return out;
}

/// The same level through the cluster's client actor (the head's door,
/// no HTTP): what the gateway's figures are compared with.
level_result run_client_level(client_session& cs, int concurrency, int total,
                              std::int64_t max_tokens, double image_share,
                              const std::vector<std::string>& images, std::uint64_t seed,
                              bool completions) {
  level_result out;
  out.concurrency = concurrency;
  std::vector<std::vector<std::uint8_t>> image_bytes;
  for (const auto& f : images) image_bytes.push_back(read_file(f));
  actors::client jobs(*cs.sys, cs.door);
  std::mutex m;
  std::vector<double> ttft, itl, e2e;
  std::atomic<int> next{0};
  const auto t0 = clock::now();
  auto worker = [&] {
    for (int i = next++; i < total; i = next++) {
      const auto [question, image] = request_of(i, seed, image_share, image_bytes.size());
      actors::job_request job;
      job.id = actors::random_job_id();
      if (completions) {
        job.prompt = question;
      } else {
        job.chat = true;
        job.turns.push_back({"user", question, image >= 0 ? 1 : 0, 0});
        if (image >= 0)
          job.images.push_back({images[static_cast<std::size_t>(image)],
                                image_bytes[static_cast<std::size_t>(image)]});
      }
      job.max_tokens = max_tokens;
      job.ignore_eos = true;
      job.has_temperature = true;
      job.temperature = 0.8;
      job.seed = static_cast<std::uint64_t>(i);
      const auto start = clock::now();
      auto last = start;
      double first = -1;
      std::vector<double> gaps;
      auto f = jobs.run(job, [&](const actors::token_event& e) {
        if (e.text.empty()) return;  // as the gateway sends: a chunk per event with text
        const auto now = clock::now();
        if (first < 0)
          first = ms(now - start);
        else
          gaps.push_back(ms(now - last));
        last = now;
      });
      std::lock_guard lock(m);
      if (!f || f->reason != actors::finish_reason::length || f->tokens.empty()) {
        ++out.failed;
        spdlog::warn("request {} through the client actor failed: {}", i,
                     f ? f->error : f.error().message);
        continue;
      }
      ++out.completed;
      out.output_tokens += static_cast<std::int64_t>(f->tokens.size());
      out.input_tokens += f->prompt_tokens;
      out.chunks += static_cast<std::int64_t>(gaps.size()) + 1;
      ttft.push_back(first);
      itl.insert(itl.end(), gaps.begin(), gaps.end());
      e2e.push_back(ms(clock::now() - start));
    }
  };
  std::vector<std::thread> threads;
  for (int c = 0; c < concurrency; ++c) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  finish_level(out, t0, ttft, itl, e2e);
  return out;
}

}  // namespace

int run_http_bench(const bench_args& a, const std::vector<int>& levels) {
  std::vector<std::string> images;
  if (a.image_share > 0) images = image_files_in(a.images_dir);
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
  std::vector<move_done> moves;
  std::function<void()> during;
  std::unique_ptr<client_session> client;
  if (!a.migrate.empty() || a.compare_client) {
    if (a.manifest.empty()) {
      spdlog::error("--migrate and --compare-client need --manifest (the cluster behind --http)");
      return 2;
    }
    auto m = load_manifest_or_report(a.manifest);
    if (!m) return 2;
    client = open_client(*m, a.compare_client ? "--compare-client" : "--migrate");
    if (!client) return 1;
    if (!a.migrate.empty()) during = [&] { moves = run_moves(*client, a.migrate); };
  }
  std::vector<level_result> results, direct;
  for (std::size_t l = 0; l < levels.size(); ++l) {
    const int c = levels[l];
    const int n = a.requests > 0 ? a.requests : std::max(2 * c, 8);
    results.push_back(run_http_level(a.http, a.api_key, c, n, a.max_tokens, a.image_share, images,
                                     a.seed, a.completions, !a.no_keep_alive,
                                     l + 1 == levels.size() ? during : std::function<void()>{}));
    // The same requests through the client actor, right after (the same
    // cluster state): the gateway's overhead is the difference.
    if (a.compare_client)
      direct.push_back(run_client_level(*client, c, n, a.max_tokens, a.image_share, images, a.seed,
                                        a.completions));
  }
  const double base = first_level_tokens_per_s(results);
  if (a.json) {
    nlohmann::json j;
    j["server"] = a.http;
    j["max_tokens"] = a.max_tokens;
    for (const auto& r : results) j["levels"].push_back(level_json(r, base));
    for (std::size_t l = 0; l < direct.size(); ++l) {
      auto d = level_json(direct[l], first_level_tokens_per_s(direct));
      d["ttft_p50_ratio"] = direct[l].ttft.p50 > 0 ? results[l].ttft.p50 / direct[l].ttft.p50 : 0;
      d["ttft_p99_ratio"] = direct[l].ttft.p99 > 0 ? results[l].ttft.p99 / direct[l].ttft.p99 : 0;
      j["client_actor_levels"].push_back(d);
    }
    std::puts(j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "troupe bench --http %s: streamed %s, %lld output tokens each (ignore_eos), T=0.8, %.0f%% "
      "with an image\n",
      a.http.c_str(), a.completions ? "completions" : "chat completions",
      static_cast<long long>(a.max_tokens),
      images.empty() || a.completions ? 0.0 : a.image_share * 100);
  std::printf("(%s)\n", a.no_keep_alive ? "a new connection per request"
                                        : "keep-alive: one connection per client, reused");
  print_level_table(results, base);
  std::printf("\nITL is the gap between SSE chunks as the client received them.\n");
  if (!direct.empty()) {
    std::printf(
        "\nThe same requests through the cluster's client actor (no HTTP), each level "
        "right after its HTTP run:\n");
    print_level_table(direct, first_level_tokens_per_s(direct));
    std::printf("\n| conc | TTFT p50 http / actor | TTFT p99 http / actor |\n|---|---|---|\n");
    for (std::size_t l = 0; l < direct.size(); ++l)
      std::printf("| %d | %.2f | %.2f |\n", results[l].concurrency,
                  direct[l].ttft.p50 > 0 ? results[l].ttft.p50 / direct[l].ttft.p50 : 0.0,
                  direct[l].ttft.p99 > 0 ? results[l].ttft.p99 / direct[l].ttft.p99 : 0.0);
  }
  if (!moves.empty()) print_moves(results.back(), moves);
  return 0;
}

}  // namespace troupe::cli::serve_bench
