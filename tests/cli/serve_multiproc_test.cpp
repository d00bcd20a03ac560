// The OpenAI-compatible gateway against a real local cluster, with curl as
// the client (what users run): an image+text chat completion with a data
// URL, the same answer streamed, the errors (401, 413, 400), Prometheus
// metrics that grow with requests, and a client that disconnects
// mid-stream: its request is cancelled and the KV cache returns to its
// baseline.
#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/websocket.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>

#include "cluster_manifest.hpp"
#include "run_cli.hpp"
#include "tests/multiproc.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using namespace troupe;
using nlohmann::json;

struct http_result {
  int status = 0;
  std::string body;
};

// curl with a JSON body from a file; -w appends the status on its own line.
http_result curl(const std::string& args) {
  const std::string cmd = "curl -s -S -w '\\n%{http_code}' " + args + " 2>&1";
  http_result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  std::string out;
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ::pclose(p);
  const auto nl = out.rfind('\n');
  if (nl == std::string::npos) return r;
  r.body = out.substr(0, nl);
  r.status = std::atoi(out.c_str() + nl + 1);
  return r;
}

std::string base64_of(const std::string& path) {
  const std::string cmd = "base64 -w0 " + path;
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (p && std::fgets(buf, sizeof buf, p)) out += buf;
  if (p) ::pclose(p);
  return out;
}

double metric(const std::string& text, const std::string& name) {
  std::regex re("^" + std::regex_replace(name, std::regex(R"([{}\[\]\"\\.+*?()|^$])"), R"(\$&)") +
                    R"( ([0-9.eE+-]+)$)",
                std::regex::multiline);
  std::smatch m;
  if (!std::regex_search(text, m, re)) return -1;
  return std::stod(m[1]);
}

class Gateway : public ::testing::Test {
 protected:
  /// Manifest text for the cluster (a subclass names another model).
  virtual std::string manifest_extra() const { return ""; }
  void SetUp() override {
    // (The disconnect test generates past the bundled model's 256
    // positions: make_manifest lifts the context length.)
    cs_ = test::make_manifest("gw", {"127.0.0.1", "127.0.0.1", "127.0.0.1"}, manifest_extra());
    auto r = test::troupe_cli("up " + cs_.manifest + " --detach --timeout 180");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    started_ = true;
    port_ = test::free_port();
    serve_ = std::make_unique<test::child_process>(
        "serve",
        std::vector<std::string>{TROUPE_CLI, "serve", cs_.manifest, "--port", std::to_string(port_),
                                 "--api-key", "sk-test", "--max-body-mib", "1",
                                 "--allow-remote-images", "--grpc-port", "0"});
    auto line = serve_->expect("troupe serve:", 60000ms);
    ASSERT_TRUE(line) << "troupe serve did not start";
    url_ = "http://127.0.0.1:" + std::to_string(port_);
    const std::string img = base64_of(std::string(TROUPE_FIXTURES_DIR) + "/shapes/shapes_002.png");
    ASSERT_GT(img.size(), 100u);
    image_body_ =
        json{{"messages",
              json::array(
                  {{{"role", "user"},
                    {"content",
                     json::array({{{"type", "text"}, {"text", "Describe the image."}},
                                  {{"type", "image_url"},
                                   {"image_url", {{"url", "data:image/png;base64," + img}}}}})}}})},
             {"temperature", 0}};
  }
  void TearDown() override {
    serve_.reset();
    if (started_) {
      auto r = test::troupe_cli("down " + cs_.manifest + " --timeout 60");
      EXPECT_EQ(r.exit_code, 0) << r.out;
    }
  }
  std::string body_file(const json& j) {
    const std::string path = cs_.dir + "/body" + std::to_string(files_++) + ".json";
    std::ofstream(path) << j.dump();
    return path;
  }
  http_result post(const std::string& path, const json& j, const std::string& key = "sk-test",
                   const std::string& extra = "") {
    return curl(extra + " -H 'Content-Type: application/json' " +
                (key.empty() ? "" : "-H 'Authorization: Bearer " + key + "' ") + "--data-binary @" +
                body_file(j) + " " + url_ + path);
  }
  // /metrics needs the key like the API (a scrape without it gets a 401).
  std::string metrics() {
    return curl("-H 'Authorization: Bearer sk-test' " + url_ + "/metrics").body;
  }

  test::cluster_setup cs_;
  bool started_ = false;
  int port_ = 0, files_ = 0;
  std::string url_;
  json image_body_;
  std::unique_ptr<test::child_process> serve_;
};

// The same gateway in front of a model that hears (the shapes model with a
// random audio tower: tests/fixtures/llava_hears).
class GatewayHears : public Gateway {
 protected:
  std::string manifest_extra() const override {
    return "[model]\npath = \"" + std::string(TROUPE_FIXTURES_DIR) + "/llava_hears\"\n";
  }
};

// `troupe generate --direct`'s answer (leading blanks dropped) with the
// model that hears, a clip and a prompt, in 12 tokens at most.
std::string direct_hears_text(const std::string& clip, const std::string& prompt) {
  const std::string fixtures = TROUPE_FIXTURES_DIR;
  auto d = test::troupe_cli("generate --direct -m " + fixtures + "/llava_hears --audio " + clip +
                                " --prompt '" + prompt + "' -n 12 --json",
                            false);
  EXPECT_EQ(d.exit_code, 0) << d.out;
  const auto at = d.out.find('{');
  const auto j = json::parse(at == std::string::npos ? "" : d.out.substr(at), nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << d.out;
  std::string t = j.is_discarded() ? "" : j.value("text", "");
  while (!t.empty() && t.front() == ' ') t.erase(0, 1);
  return t;
}

// The same gateway in front of a model that sees video (the shapes model
// with troupe's video keys: tests/fixtures/llava_video).
class GatewaySees : public Gateway {
 protected:
  std::string manifest_extra() const override {
    return "[model]\npath = \"" + std::string(TROUPE_FIXTURES_DIR) + "/llava_video\"\n";
  }
};

}  // namespace

TEST_F(Gateway, ChatStreamErrorsAndMetrics) {
  auto ready = curl(url_ + "/ready");
  EXPECT_EQ(ready.status, 200) << ready.body;
  EXPECT_EQ(curl(url_ + "/live").status, 200);
  EXPECT_EQ(curl(url_ + "/metrics").status, 401) << "the figures without the key";
  const auto before = metrics();
  ASSERT_EQ(metric(before, "troupe:generation_tokens_total{model_name=\"tiny-llava-shapes\"}"), 0)
      << before;

  // The answer of the plain generation loop for the same image and prompt.
  const std::string img = std::string(TROUPE_FIXTURES_DIR) + "/shapes/shapes_002.png";
  auto direct = test::troupe_cli(
      "generate --direct --image " + img + " --prompt 'Describe the image.' --json", false);
  ASSERT_EQ(direct.exit_code, 0) << direct.out;
  const auto want = json::parse(direct.out.substr(direct.out.find('{')))["text"].get<std::string>();
  ASSERT_FALSE(want.empty());

  auto r = post("/v1/chat/completions", image_body_);
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["content"].get<std::string>(), want) << r.body;
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 0);
  EXPECT_EQ(j["usage"]["total_tokens"].get<int>(),
            j["usage"]["prompt_tokens"].get<int>() + j["usage"]["completion_tokens"].get<int>());

  // Streamed: the same text in chunks, then [DONE].
  auto sb = image_body_;
  sb["stream"] = true;
  auto s = post("/v1/chat/completions", sb, "sk-test", "-N");
  ASSERT_EQ(s.status, 200) << s.body;
  std::string streamed;
  int chunks = 0;
  bool done = false, finished = false;
  std::istringstream lines(s.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    const auto data = line.substr(6);
    ASSERT_FALSE(done) << "data after [DONE]";
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    auto c = json::parse(data);
    ASSERT_EQ(c["object"], "chat.completion.chunk") << data;
    const auto& ch = c["choices"][0];
    if (ch["delta"].contains("content")) {
      streamed += ch["delta"]["content"].get<std::string>();
      ++chunks;
    }
    if (!ch["finish_reason"].is_null()) finished = true;
  }
  EXPECT_TRUE(done);
  EXPECT_TRUE(finished);
  EXPECT_GT(chunks, 1);
  EXPECT_EQ(streamed, want);

  // Errors in OpenAI's shape with their status codes.
  auto bad_key = post("/v1/chat/completions", image_body_, "sk-wrong");
  EXPECT_EQ(bad_key.status, 401) << bad_key.body;
  EXPECT_EQ(json::parse(bad_key.body)["error"]["type"], "authentication_error");
  EXPECT_EQ(post("/v1/chat/completions", image_body_, "").status, 401);
  json big = image_body_;
  big["messages"][0]["content"][0]["text"] = std::string(2u << 20, 'a');
  auto too_big = post("/v1/chat/completions", big);
  EXPECT_EQ(too_big.status, 413) << too_big.body.substr(0, 300);
  const std::string broken = cs_.dir + "/broken.json";
  std::ofstream(broken) << "{\"messages\": [";
  auto malformed = curl(
      "-H 'Content-Type: application/json' -H 'Authorization: Bearer sk-test' --data-binary @" +
      broken + " " + url_ + "/v1/chat/completions");
  EXPECT_EQ(malformed.status, 400) << malformed.body;
  EXPECT_NE(json::parse(malformed.body)["error"]["message"].get<std::string>().find("JSON"),
            std::string::npos);
  // Too many headers: 431 before any handler.
  std::string headers;
  for (int i = 0; i < 100; ++i) headers += " -H 'X-Filler-" + std::to_string(i) + ": x'";
  auto many = post("/v1/chat/completions", image_body_, "sk-test", headers);
  EXPECT_EQ(many.status, 431) << many.body;
  // A remote image URL that points at this machine is refused, naming the field.
  json local_url = image_body_;
  local_url["messages"][0]["content"][1]["image_url"]["url"] = url_ + "/live";
  auto ssrf = post("/v1/chat/completions", local_url);
  EXPECT_EQ(ssrf.status, 400) << ssrf.body;
  EXPECT_NE(ssrf.body.find("loopback"), std::string::npos) << ssrf.body;
  EXPECT_EQ(json::parse(ssrf.body)["error"]["param"], "messages[0].content[1].image_url");
  auto no_messages = post("/v1/chat/completions", json{{"model", "x"}});
  EXPECT_EQ(no_messages.status, 400);
  EXPECT_EQ(json::parse(no_messages.body)["error"]["param"], "messages");
  json bad_image = image_body_;
  bad_image["messages"][0]["content"][1]["image_url"]["url"] =
      "data:image/png;base64,aGVsbG8gd29ybGQh";
  auto undecodable = post("/v1/chat/completions", bad_image);
  EXPECT_EQ(undecodable.status, 400) << undecodable.body;

  // /v1/completions and /v1/models.
  auto c =
      post("/v1/completions", json{{"prompt", "A red"}, {"max_tokens", 4}, {"temperature", 0}});
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(json::parse(c.body)["object"], "text_completion");
  EXPECT_LE(json::parse(c.body)["usage"]["completion_tokens"].get<int>(), 4);
  auto models = curl("-H 'Authorization: Bearer sk-test' " + url_ + "/v1/models");
  EXPECT_EQ(models.status, 200);
  EXPECT_EQ(json::parse(models.body)["data"][0]["object"], "model");

  // The counters grew by what was served.
  const auto after = metrics();
  EXPECT_GT(metric(after, "troupe:generation_tokens_total{model_name=\"tiny-llava-shapes\"}"), 0)
      << after;
  EXPECT_GT(metric(after, "troupe:prompt_tokens_total{model_name=\"tiny-llava-shapes\"}"), 0);
  EXPECT_GE(
      metric(after, "troupe:e2e_request_latency_seconds_count{model_name=\"tiny-llava-shapes\"}"),
      3);
  EXPECT_GE(
      metric(after, "troupe:time_to_first_token_seconds_count{model_name=\"tiny-llava-shapes\"}"),
      3);
  // vLLM's per-request histograms, with the served name as model_name.
  EXPECT_GE(metric(after, "troupe:request_prompt_tokens_count{model_name=\"tiny-llava-shapes\"}"),
            3)
      << after;
  EXPECT_GT(metric(after, "troupe:request_generation_tokens_sum{model_name=\"tiny-llava-shapes\"}"),
            0)
      << after;
  EXPECT_GE(
      metric(after, "troupe:request_prefill_time_seconds_count{model_name=\"tiny-llava-shapes\"}"),
      3)
      << after;
  EXPECT_GE(
      metric(after, "troupe:request_decode_time_seconds_count{model_name=\"tiny-llava-shapes\"}"),
      3)
      << after;
  EXPECT_GE(metric(after,
                   "troupe:request_success_total{model_name=\"tiny-llava-shapes\",finished_reason="
                   "\"stop\"}"),
            2);
  EXPECT_GE(metric(after, "troupe:http_errors_total{status=\"401\"}"), 2);
  // The undecodable image failed after it was accepted: a failure, not a
  // success; and every response is counted by its status.
  EXPECT_GE(metric(after,
                   "troupe:request_failure_total{model_name=\"tiny-llava-shapes\",code=\"invalid "
                   "request\"}"),
            1)
      << after;
  EXPECT_EQ(metric(after,
                   "troupe:request_success_total{model_name=\"tiny-llava-shapes\",finished_reason="
                   "\"error\"}"),
            -1)
      << after;
  EXPECT_GE(metric(after, "troupe:http_requests_total{status=\"200\"}"), 3) << after;
  EXPECT_GE(metric(after, "troupe:http_requests_total{status=\"400\"}"), 2) << after;
  EXPECT_EQ(metric(after, "troupe:node_up{node=\"n1\"}"), 1);
  EXPECT_EQ(metric(after, "troupe:actor_restarts_total"), 0) << after;  // no node was lost
  EXPECT_EQ(metric(after, "troupe:shard_migrations_total"), 0) << after;
  // The audio and video queues are there (the requests had images alone).
  for (const char* name :
       {"audio_clips_total", "audio_cache_hits_total", "audio_clips_waiting", "audio_encodes_total",
        "audio_encode_wait_seconds_total", "video_items_total", "video_cache_hits_total",
        "videos_waiting", "video_encodes_total", "video_encode_wait_seconds_total"})
    EXPECT_EQ(metric(after, std::string("troupe:") + name + "{model_name=\"tiny-llava-shapes\"}"),
              0)
        << name << "\n"
        << after;
  // Activations went n0 -> n1 -> n2 over the data plane; the nodes report
  // their byte counts with each heartbeat (every 500 ms).
  for (const std::string link : {"n0->n1", "n1->n2"}) {
    const std::string name = "troupe:transfer_bytes_total{link=\"" + link + "\"}";
    const double was = std::max(0.0, metric(before, name));
    double now = metric(after, name);
    for (int i = 0; i < 30 && now <= was; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      now = metric(metrics(), name);
    }
    EXPECT_GT(now, was) << link << "\n" << metrics();
  }
  // promtool (Debian's prometheus; scripts/install-deps installs it). Its
  // linter flags every name with a colon, as it flags vLLM's `vllm:` names;
  // that convention warning is the only finding allowed, and with the
  // prefix written `troupe_` the text passes every check.
  ASSERT_EQ(test::shell("command -v promtool"), 0)
      << "promtool is missing: scripts/install-deps installs it (Debian's prometheus package)";
  const std::string file = cs_.dir + "/metrics.txt";
  std::ofstream(file) << after;
  EXPECT_EQ(test::shell("sed 's/troupe:/troupe_/g' " + file + " | promtool check metrics"), 0)
      << after;
  EXPECT_EQ(test::shell("promtool check metrics < " + file +
                        " 2>&1 | grep -v \"metric names should not contain ':'\" | grep ."),
            1)
      << "promtool found more than the colon convention";
}

// OpenAI's and vLLM's sampling fields reach the sampler on the cluster's
// last stage: each changes what the model generates as its rule says.
TEST_F(Gateway, SamplingFieldsChangeTheGeneration) {
  auto complete = [&](json extra) {
    json body{{"prompt", "A red circle and a blue"}, {"max_tokens", 12}, {"temperature", 0}};
    for (auto& [k, v] : extra.items()) body[k] = v;
    auto r = post("/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
    auto j = json::parse(r.body, nullptr, false);
    return j.is_discarded() ? json::object() : j;
  };
  auto text = [](const json& j) { return j["choices"][0]["text"].get<std::string>(); };
  auto used = [](const json& j) { return j["usage"]["completion_tokens"].get<int>(); };
  const auto plain = complete({});
  // logit_bias +100 on one token: every token is that token.
  const auto forced = complete({{"logit_bias", {{"300", 100}}}, {"ignore_eos", true}});
  ASSERT_EQ(used(forced), 12) << forced;
  const auto piece = text(complete({{"logit_bias", {{"300", 100}}}, {"max_tokens", 1}}));
  ASSERT_FALSE(piece.empty());
  std::string twelve;
  for (int i = 0; i < 12; ++i) twelve += piece;
  EXPECT_EQ(text(forced), twelve);
  // stop_token_ids: the forced token ends the request at once.
  const auto stopped = complete({{"logit_bias", {{"300", 100}}}, {"stop_token_ids", {300}}});
  EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop") << stopped;
  EXPECT_EQ(text(stopped), "");
  // min_tokens: the same stop token is masked until then.
  const auto at_least =
      complete({{"logit_bias", {{"300", 100}}}, {"stop_token_ids", {300}}, {"min_tokens", 5}});
  // Five other tokens, then 300 (its bias wins once it may be sampled),
  // which stops it: six generated, the stop token among them.
  EXPECT_EQ(used(at_least), 6) << at_least;
  EXPECT_EQ(at_least["choices"][0]["finish_reason"], "stop") << at_least;
  // The penalties change a greedy generation (the plain one repeats).
  EXPECT_NE(text(complete({{"frequency_penalty", 2}, {"ignore_eos", true}})),
            text(complete({{"ignore_eos", true}})));
  EXPECT_NE(text(complete({{"presence_penalty", 2}, {"ignore_eos", true}})),
            text(complete({{"ignore_eos", true}})));
  EXPECT_NE(text(complete({{"repetition_penalty", 3}, {"ignore_eos", true}})),
            text(complete({{"ignore_eos", true}})));
  // echo: the prompt, then the completion.
  EXPECT_EQ(text(complete({{"echo", true}})), "A red circle and a blue" + text(plain));
  // Token ids outside the vocabulary are a 400 naming them.
  auto outside = post("/v1/completions", json{{"prompt", "A"}, {"logit_bias", {{"999999", 1}}}});
  EXPECT_EQ(outside.status, 400) << outside.body;
  EXPECT_NE(outside.body.find("outside the vocabulary"), std::string::npos) << outside.body;
}

// logprobs, n, token-id prompts and /tokenize against the real cluster:
// logprobs are the model's raw distribution (the chosen greedy token is
// its top alternative, a logit_bias does not show in them), n choices are
// seeds seed, seed + 1, ..., and a prompt's ids from /tokenize complete as
// its text does.
TEST_F(Gateway, LogprobsChoicesTokenPromptsAndTokenize) {
  auto complete = [&](json body) {
    const json defaults{{"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true}};
    for (auto& [k, v] : defaults.items())
      if (!body.contains(k)) body[k] = v;
    if (!body.contains("prompt")) body["prompt"] = "A red circle and a blue";
    auto r = post("/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
    auto j = json::parse(r.body, nullptr, false);
    return j.is_discarded() ? json::object() : j;
  };
  auto tk = post("/tokenize", {{"prompt", "A red circle and a blue"}});
  ASSERT_EQ(tk.status, 200) << tk.body;
  const auto ids = json::parse(tk.body)["tokens"];
  ASSERT_GE(ids.size(), 5u) << tk.body;
  EXPECT_EQ(json::parse(tk.body)["count"], ids.size());
  auto dt = post("/detokenize", {{"tokens", ids}});
  ASSERT_EQ(dt.status, 200) << dt.body;
  EXPECT_NE(json::parse(dt.body)["prompt"].get<std::string>().find("A red circle and a blue"),
            std::string::npos)
      << dt.body;
  const auto plain = complete({});
  const auto by_ids = complete({{"prompt", ids}});
  EXPECT_EQ(by_ids["choices"][0]["text"], plain["choices"][0]["text"]) << by_ids;
  EXPECT_EQ(by_ids["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"]);
  // Prefix caching: a repeated prompt's full blocks (all but the one with
  // its last token) come from the cache; after /reset_prefix_cache none do,
  // then they are cached again; another cache_salt shares nothing. The
  // answers never change.
  const json long_prompt =
      "A red circle and a blue square sit above a green triangle, left of a yellow star, and "
      "the picture has a white background with a thin black frame around it";
  const auto first = complete({{"prompt", long_prompt}});
  const auto prompt_len = first["usage"]["prompt_tokens"].get<std::int64_t>();
  ASSERT_GT(prompt_len, 16) << "the test needs a full block of 16";
  const std::int64_t full = (prompt_len - 1) / 16 * 16;
  const auto repeated = complete({{"prompt", long_prompt}});
  EXPECT_EQ(repeated["usage"]["prompt_tokens_details"]["cached_tokens"], full) << repeated;
  EXPECT_EQ(repeated["choices"][0]["text"], first["choices"][0]["text"]);
  auto reset = post("/reset_prefix_cache", json::object());
  ASSERT_EQ(reset.status, 200) << reset.body;
  EXPECT_GE(json::parse(reset.body)["freed_blocks"].get<std::int64_t>(), full / 16) << reset.body;
  const auto cold = complete({{"prompt", long_prompt}});
  EXPECT_EQ(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0) << cold;
  EXPECT_EQ(cold["choices"][0]["text"], first["choices"][0]["text"]);
  const auto salted = complete({{"prompt", long_prompt}, {"cache_salt", "tenant-a"}});
  EXPECT_EQ(salted["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
      << "another salt shares nothing";
  const auto salted_again = complete({{"prompt", long_prompt}, {"cache_salt", "tenant-a"}});
  EXPECT_EQ(salted_again["usage"]["prompt_tokens_details"]["cached_tokens"], full) << salted_again;
  EXPECT_EQ(salted_again["choices"][0]["text"], first["choices"][0]["text"]);
  auto outside = post("/v1/completions", json{{"prompt", json::array({1, 99999999})}});
  EXPECT_EQ(outside.status, 400) << outside.body;
  auto dt_outside = post("/detokenize", {{"tokens", {99999999}}});
  EXPECT_EQ(dt_outside.status, 400) << dt_outside.body;

  // Greedy with logprobs: each token is its own top alternative, their
  // mass is at most 1, and the tokens' bytes are the text.
  const auto lp = complete({{"logprobs", 3}});
  const auto& l = lp["choices"][0]["logprobs"];
  ASSERT_EQ(l["tokens"].size(), 10u) << lp;
  EXPECT_EQ(lp["choices"][0]["text"], plain["choices"][0]["text"]);
  std::string joined;
  for (std::size_t i = 0; i < 10; ++i) {
    joined += l["tokens"][i].get<std::string>();
    const double chosen = l["token_logprobs"][i].get<double>();
    EXPECT_LE(chosen, 0.0);
    double best = -1e30, mass = 0;
    for (auto& [piece, v] : l["top_logprobs"][i].items()) {
      best = std::max(best, v.get<double>());
      mass += std::exp(v.get<double>());
    }
    EXPECT_NEAR(chosen, best, 1e-6) << i;
    EXPECT_LE(mass, 1.0 + 1e-5);
  }
  // (The text leaves out special tokens; logprobs name every token.)
  for (auto at = joined.find("</s>"); at != std::string::npos; at = joined.find("</s>"))
    joined.erase(at, 4);
  EXPECT_EQ(joined, plain["choices"][0]["text"].get<std::string>());
  // A bias forces token 300; its logprob stays the model's own (below 0
  // by more than rounding somewhere: 300 is not the model's top choice at
  // every step).
  const auto forced = complete({{"logprobs", 0}, {"logit_bias", {{"300", 100}}}});
  double lowest = 0;
  for (const auto& v : forced["choices"][0]["logprobs"]["token_logprobs"])
    lowest = std::min(lowest, v.get<double>());
  EXPECT_LT(lowest, -0.01) << forced;

  // n = 3 sampled choices: choice i is the request alone with seed + i.
  const auto three = complete({{"n", 3}, {"temperature", 1.0}, {"seed", 7}});
  ASSERT_EQ(three["choices"].size(), 3u) << three;
  std::set<std::string> texts;
  for (int i = 0; i < 3; ++i) texts.insert(three["choices"][i]["text"].get<std::string>());
  EXPECT_GE(texts.size(), 2u) << three;
  EXPECT_EQ(three["usage"]["completion_tokens"], 30);
  for (int i = 0; i < 3; ++i) {
    const auto alone = complete({{"temperature", 1.0}, {"seed", 7 + i}});
    EXPECT_EQ(alone["choices"][0]["text"], three["choices"][i]["text"]) << i;
  }

  // Chat, streamed: one logprob per generated token.
  json chat{{"messages", json::array({{{"role", "user"}, {"content", "Name a shape."}}})},
            {"max_tokens", 8},
            {"temperature", 0},
            {"logprobs", true},
            {"top_logprobs", 2},
            {"stream", true},
            {"stream_options", {{"include_usage", true}}}};
  auto st = post("/v1/chat/completions", chat);
  ASSERT_EQ(st.status, 200) << st.body;
  int entries = 0, completion = -1;
  for (std::size_t at = st.body.find("data: {"); at != std::string::npos;
       at = st.body.find("data: {", at + 1)) {
    auto e = json::parse(st.body.substr(at + 6, st.body.find('\n', at) - at - 6));
    if (!e["choices"].empty() && !e["choices"][0]["logprobs"].is_null())
      for (const auto& c : e["choices"][0]["logprobs"]["content"]) {
        ++entries;
        EXPECT_EQ(c["top_logprobs"].size(), 2u);
      }
    if (e.contains("usage") && e["usage"].is_object()) completion = e["usage"]["completion_tokens"];
  }
  EXPECT_GT(completion, 0) << st.body;
  EXPECT_EQ(entries, completion) << st.body;
}

// Structured output through the real cluster: sampled (not greedy) output
// constrained by a JSON schema parses and follows it, a regex's output
// matches std::regex, a choice is one of the choices; conflicts and
// keywords troupe cannot enforce are 400s that name them.
TEST_F(Gateway, StructuredOutputFollowsItsSchemaRegexOrChoice) {
  const json schema = json::parse(R"({"type": "object",
      "properties": {"shape": {"enum": ["circle", "square", "triangle"]},
                     "count": {"type": "integer"},
                     "label": {"type": "string", "maxLength": 8}},
      "required": ["shape", "count"], "additionalProperties": false})");
  int stopped = 0, cut = 0;
  for (int seed = 0; seed < 8; ++seed) {
    json body{{"messages", json::array({{{"role", "user"}, {"content", "Describe a shape."}}})},
              {"temperature", 1.0},
              {"seed", seed},
              {"max_tokens", 120},
              {"response_format",
               {{"type", "json_schema"},
                {"json_schema", {{"name", "shape"}, {"schema", schema}, {"strict", true}}}}}};
    auto r = post("/v1/chat/completions", body);
    ASSERT_EQ(r.status, 200) << r.body;
    const auto j = json::parse(r.body);
    const auto& choice = j["choices"][0];
    if (choice["finish_reason"] != "stop") {
      ++cut;
      continue;
    }
    ++stopped;
    const auto content = choice["message"]["content"].get<std::string>();
    auto out = json::parse(content, nullptr, false);
    ASSERT_FALSE(out.is_discarded()) << content;
    ASSERT_TRUE(out.is_object()) << content;
    EXPECT_TRUE(out["shape"] == "circle" || out["shape"] == "square" || out["shape"] == "triangle")
        << content;
    EXPECT_TRUE(out["count"].is_number_integer()) << content;
    if (out.contains("label")) {
      EXPECT_TRUE(out["label"].is_string()) << content;
    }
    for (const auto& [k, v] : out.items())
      EXPECT_TRUE(k == "shape" || k == "count" || k == "label") << content;
  }
  EXPECT_GE(stopped, 4) << "cut by max_tokens: " << cut;

  auto complete = [&](json body) {
    body["prompt"] = "A red circle and a blue";
    body["max_tokens"] = 40;
    body["temperature"] = 1.0;
    return post("/v1/completions", body);
  };
  for (int seed = 0; seed < 4; ++seed) {
    auto re = complete({{"guided_regex", "(red|blue) [a-z]{2,6}\\.[0-9]"}, {"seed", seed}});
    ASSERT_EQ(re.status, 200) << re.body;
    const auto text = json::parse(re.body)["choices"][0]["text"].get<std::string>();
    EXPECT_TRUE(std::regex_match(text, std::regex("(red|blue) [a-z]{2,6}\\.[0-9]"))) << text;
    auto ch = complete({{"guided_choice", {"circle", "square"}}, {"seed", seed}});
    ASSERT_EQ(ch.status, 200) << ch.body;
    const auto pick = json::parse(ch.body)["choices"][0]["text"].get<std::string>();
    EXPECT_TRUE(pick == "circle" || pick == "square") << pick;
  }
  auto obj = post("/v1/chat/completions",
                  {{"messages", json::array({{{"role", "user"}, {"content", "JSON please"}}})},
                   {"max_tokens", 150},
                   {"seed", 3},
                   {"temperature", 0.7},
                   {"response_format", {{"type", "json_object"}}}});
  ASSERT_EQ(obj.status, 200) << obj.body;
  const auto oj = json::parse(obj.body)["choices"][0];
  if (oj["finish_reason"] == "stop") {
    EXPECT_TRUE(json::parse(oj["message"]["content"].get<std::string>()).is_object()) << oj;
  }

  // Refusals, by name.
  auto both = complete({{"guided_regex", "a"}, {"guided_choice", {"b"}}});
  EXPECT_EQ(both.status, 400) << both.body;
  EXPECT_EQ(json::parse(both.body)["error"]["param"], "guided_choice") << both.body;
  auto keyword = post(
      "/v1/chat/completions",
      {{"messages", json::array({{{"role", "user"}, {"content", "x"}}})},
       {"response_format",
        {{"type", "json_schema"},
         {"json_schema", {{"name", "n"}, {"schema", {{"type", "number"}, {"minimum", 1}}}}}}}});
  EXPECT_EQ(keyword.status, 400) << keyword.body;
  EXPECT_NE(keyword.body.find("minimum"), std::string::npos) << keyword.body;
  auto no_end = complete({{"guided_choice", {"b"}}, {"ignore_eos", true}});
  EXPECT_EQ(no_end.status, 400) << no_end.body;
  auto bad_grammar = complete({{"grammar", "root ::= root \"a\""}});
  EXPECT_EQ(bad_grammar.status, 400) << bad_grammar.body;
  EXPECT_NE(bad_grammar.body.find("left-recursive"), std::string::npos) << bad_grammar.body;
}

// Tools through the real cluster: "required" and a named function give
// OpenAI tool_calls whose arguments follow the tool's schema (whole and
// streamed); a reply to a tool's answer is accepted.
TEST_F(Gateway, RequiredToolCallsFollowTheToolsSchema) {
  const json tool = json::parse(R"({"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
      "days": {"type": "integer"}}, "required": ["city"], "additionalProperties": false}}})");
  const json clock = json::parse(R"({"type": "function", "function": {"name": "get_time"}})");
  auto ask = [&](json extra) {
    json body{{"messages", json::array({{{"role", "user"}, {"content", "Weather in Oslo?"}}})},
              {"tools", json::array({tool, clock})},
              {"max_tokens", 120},
              {"temperature", 1.0}};
    for (auto& [k, v] : extra.items()) body[k] = v;
    return post("/v1/chat/completions", body);
  };
  int calls = 0;
  for (int seed = 0; seed < 6; ++seed) {
    auto r = ask({{"tool_choice", "required"}, {"seed", seed}, {"parallel_tool_calls", false}});
    ASSERT_EQ(r.status, 200) << r.body;
    const auto c = json::parse(r.body)["choices"][0];
    if (c["finish_reason"] == "length") continue;
    EXPECT_EQ(c["finish_reason"], "tool_calls") << c;
    ASSERT_EQ(c["message"]["tool_calls"].size(), 1u) << c;
    const auto& fn = c["message"]["tool_calls"][0]["function"];
    const auto args = json::parse(fn["arguments"].get<std::string>());
    ASSERT_TRUE(args.is_object());
    if (fn["name"] == "get_weather") {
      EXPECT_TRUE(args["city"].is_string()) << args;
      for (const auto& [k, v] : args.items()) EXPECT_TRUE(k == "city" || k == "days") << args;
    } else {
      EXPECT_EQ(fn["name"], "get_time");
    }
    ++calls;
  }
  EXPECT_GE(calls, 3);
  // A named function, streamed: the calls come in one delta at the end.
  auto st = ask({{"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}},
                 {"stream", true},
                 {"seed", 1}});
  ASSERT_EQ(st.status, 200) << st.body;
  int deltas = 0;
  std::string finish;
  for (std::size_t at = st.body.find("data: {"); at != std::string::npos;
       at = st.body.find("data: {", at + 1)) {
    auto e = json::parse(st.body.substr(at + 6, st.body.find('\n', at) - at - 6));
    const auto& ch = e["choices"][0];
    if (ch["delta"].contains("tool_calls")) {
      ++deltas;
      EXPECT_EQ(ch["delta"]["tool_calls"][0]["function"]["name"], "get_weather") << e;
      EXPECT_EQ(ch["delta"]["tool_calls"][0]["index"], 0);
    }
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  if (finish != "length") {
    EXPECT_EQ(deltas, 1) << st.body;
    EXPECT_EQ(finish, "tool_calls") << st.body;
  }
  // The conversation goes on after the tool's answer.
  json history{
      {"messages",
       json::array({{{"role", "user"}, {"content", "Weather in Oslo?"}},
                    {{"role", "assistant"},
                     {"content", nullptr},
                     {"tool_calls", json::array({{{"id", "call_1"},
                                                  {"type", "function"},
                                                  {"function",
                                                   {{"name", "get_weather"},
                                                    {"arguments", "{\"city\": \"Oslo\"}"}}}}})}},
                    {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny"}}})},
      {"tools", json::array({tool})},
      {"max_tokens", 8}};
  auto next = post("/v1/chat/completions", history);
  EXPECT_EQ(next.status, 200) << next.body;
}

// Every parameter of tests/fixtures/api/parameters.json (the table
// tools/openai_suite.py drives through the openai client), with curl:
// each works, with the values its row expects, or gets its row's error
// naming the field. None is silently ignored.
TEST_F(Gateway, EveryParameterInTheTableWorksOrIsRefusedByName) {
  std::ifstream f(std::string(TROUPE_FIXTURES_DIR) + "/api/parameters.json");
  const auto table = json::parse(f);
  ASSERT_GE(table["rows"].size(), 40u);
  for (const auto& row : table["rows"]) {
    const std::string endpoint = row["endpoint"];
    SCOPED_TRACE(row["name"].get<std::string>());
    json body = table["base"][endpoint];
    for (auto& [k, v] : row["body"].items())
      body[k] = v == "<served>" ? json("tiny-llava-shapes") : v;
    auto r = post(endpoint == "chat" ? "/v1/chat/completions" : "/v1/completions", body);
    EXPECT_EQ(r.status, row["status"].get<int>()) << r.body;
    if (r.status != row["status"].get<int>()) continue;
    if (row.value("stream", false)) {
      EXPECT_NE(r.body.find("data: [DONE]"), std::string::npos) << r.body;
      EXPECT_EQ(r.body.find("\"error\""), std::string::npos) << r.body;
      continue;
    }
    const auto j = json::parse(r.body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.body;
    if (row["status"] != 200) {
      if (row.contains("param")) {
        EXPECT_EQ(j["error"]["param"], row["param"]) << r.body;
      }
      if (row.contains("code")) {
        EXPECT_EQ(j["error"]["code"], row["code"]) << r.body;
      }
      continue;
    }
    if (!row.contains("expect")) continue;
    for (const auto& [pointer, want] : row["expect"].items()) {
      const json::json_pointer at(pointer);
      ASSERT_TRUE(j.contains(at)) << pointer << " missing: " << r.body;
      if (want == "<exists>") {
        EXPECT_FALSE(j[at].is_null()) << pointer << ": " << r.body;
      } else {
        EXPECT_EQ(j[at], want) << pointer << ": " << r.body;
      }
    }
  }
}

// gRPC beside HTTP: a real client (Debian's python3-grpcio) checks
// health, the key, unary and streamed generation, input in chunks, errors
// and structured output (tests/serve/grpc_client.py).
TEST_F(Gateway, GrpcServesGenerationWithHealthAuthAndChunkedInput) {
  auto line = serve_->expect("troupe serve: gRPC", 10000ms);
  ASSERT_TRUE(line) << "no gRPC line";
  const auto colon = line->rfind(':');
  const std::string port = line->substr(colon + 1);
  const std::string cmd = "/usr/bin/python3 " + std::string(TROUPE_FIXTURES_DIR) +
                          "/../serve/grpc_client.py " + port + " sk-test " + TROUPE_PROTO_PY +
                          " 2>&1";
  const auto [rc, out] = test::run_command(cmd);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("grpc client: all checks passed"), std::string::npos) << out;
}

TEST_F(Gateway, ADisconnectCancelsTheRequestAndFreesItsKv) {
  // Baseline: nothing held.
  auto base = metrics();
  ASSERT_EQ(metric(base, "troupe:kv_cache_usage_perc{model_name=\"tiny-llava-shapes\"}"), 0)
      << base;
  auto sb = image_body_;
  sb["stream"] = true;
  sb["max_tokens"] = 4000;
  sb["ignore_eos"] = true;
  // curl gives up after 1.5 s, mid-stream.
  auto s = post("/v1/chat/completions", sb, "sk-test", "-N --max-time 1.5");
  EXPECT_NE(s.body.find("data: "), std::string::npos) << "no token arrived before the disconnect";
  EXPECT_EQ(s.body.find("[DONE]"), std::string::npos) << "the request ended before the disconnect";
  // The gateway notices at its next write, cancels, and the head frees the
  // blocks; node reports refresh every 500 ms.
  double kv = -1, running = -1, cancelled = -1;
  for (int i = 0; i < 100; ++i) {
    const auto m = metrics();
    kv = metric(m, "troupe:kv_cache_usage_perc{model_name=\"tiny-llava-shapes\"}");
    running = metric(m, "troupe:num_requests_running{model_name=\"tiny-llava-shapes\"}");
    cancelled = metric(m,
                       "troupe:request_success_total{model_name=\"tiny-llava-shapes\",finished_"
                       "reason=\"cancelled\"}");
    if (kv == 0 && running == 0 && cancelled >= 1) break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(cancelled, 1);
  EXPECT_EQ(running, 0);
  EXPECT_EQ(kv, 0) << "the KV blocks were not freed";
}

TEST(GatewayUp, UpWithHttpStartsTheGatewayAndDownStopsIt) {
  // The model's own context length (256 positions) and name.
  auto cs = test::make_manifest("gwup", {"127.0.0.1", "127.0.0.1", "127.0.0.1"},
                                "[scheduler]\nmax_running = 32\n");
  const int port = test::free_port();
  // With JSON logs, which the node processes inherit.
  auto r =
      test::troupe_cli("--log-format json up " + cs.manifest + " --detach --timeout 180 --http " +
                       std::to_string(port) + " --api-key k1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("troupe serve: OpenAI-compatible API of cluster gwup on http://127.0.0.1:" +
                       std::to_string(port)),
            std::string::npos)
      << r.out;
  const std::string url = "http://127.0.0.1:" + std::to_string(port);
  EXPECT_EQ(curl(url + "/live").status, 200);
  EXPECT_EQ(curl(url + "/v1/models").status, 401);
  auto models = curl("-H 'Authorization: Bearer k1' " + url + "/v1/models");
  EXPECT_EQ(models.status, 200);
  EXPECT_EQ(json::parse(models.body)["data"][0]["id"], "tiny-llava-shapes") << models.body;
  EXPECT_EQ(curl("-H 'Authorization: Bearer k1' " + url + "/v1/models/tiny-llava-shapes").status,
            200);
  EXPECT_EQ(curl("-H 'Authorization: Bearer k1' " + url + "/v1/models/gpt-4o").status, 404);
  EXPECT_EQ(curl(url + "/health").status, 200);
  EXPECT_NE(curl(url + "/version").body.find("\"version\""), std::string::npos);
  auto post = [&](const json& body) {
    const std::string file = cs.dir + "/body.json";
    std::ofstream(file) << body.dump();
    return curl(
        "-H 'Authorization: Bearer k1' -H 'Content-Type: application/json' --data-binary @" + file +
        " " + url + "/v1/chat/completions");
  };
  // Another model's name: OpenAI's 404.
  auto other = post({{"model", "gpt-4o"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  EXPECT_EQ(other.status, 404) << other.body;
  EXPECT_EQ(json::parse(other.body)["error"]["code"], "model_not_found") << other.body;
  // Past the context length: OpenAI's 400 with the numbers.
  std::string longer;
  for (int i = 0; i < 2000; ++i) longer += "red circle ";
  auto too_long =
      post({{"messages", {{{"role", "user"}, {"content", longer}}}}, {"max_tokens", 16}});
  EXPECT_EQ(too_long.status, 400) << too_long.body;
  auto e = json::parse(too_long.body)["error"];
  EXPECT_EQ(e["code"], "context_length_exceeded") << too_long.body;
  EXPECT_EQ(e["param"], "messages") << too_long.body;
  EXPECT_NE(e["message"].get<std::string>().find("maximum context length is 256 tokens"),
            std::string::npos)
      << too_long.body;
  // No max_tokens: what the context leaves, never past it.
  auto fits = post({{"model", "tiny-llava-shapes"},
                    {"messages", {{{"role", "user"}, {"content", "Describe the image."}}}},
                    {"ignore_eos", true}});
  ASSERT_EQ(fits.status, 200) << fits.body;
  auto usage = json::parse(fits.body)["usage"];
  EXPECT_EQ(usage["total_tokens"], 256) << fits.body;
  EXPECT_EQ(json::parse(fits.body)["choices"][0]["finish_reason"], "length");
  auto d = test::troupe_cli("down " + cs.manifest + " --timeout 60");
  EXPECT_EQ(d.exit_code, 0) << d.out;
  EXPECT_EQ(curl("--max-time 2 " + url + "/live").status, 0)
      << "the gateway still answers after troupe down";
  // Every log line of every node is one JSON object tagged with its node
  // and actor (stdout's plain banner lines aside).
  std::map<std::string, std::set<std::string>> actors_by_node;
  for (const std::string node : {"n0", "n1", "n2"}) {
    std::ifstream in(cs.dir + "/certs/run/" + node + ".log");
    ASSERT_TRUE(in) << node;
    std::string line;
    while (std::getline(in, line)) {
      EXPECT_NE(line.rfind("[20", 0), 0u) << "a text log line in " << node << ".log: " << line;
      if (line.empty() || line[0] != '{') continue;
      auto j = json::parse(line, nullptr, false);
      ASSERT_FALSE(j.is_discarded()) << line;
      for (const char* k : {"time", "level", "node", "actor", "msg"})
        EXPECT_TRUE(j.contains(k)) << k << " in " << line;
      EXPECT_EQ(j["node"], node) << line;
      actors_by_node[node].insert(j["actor"].get<std::string>());
    }
  }
  EXPECT_TRUE(actors_by_node["n0"].count("head")) << "the head's lines on n0";
  EXPECT_TRUE(actors_by_node["n1"].count("agent")) << "the agent's lines on n1";
}

// Audio through the API (issue 29): /v1/audio/transcriptions (a multipart
// upload, curl -F) and a chat's input_audio part answer as `troupe generate
// --direct` does with the same clip and prompt; the formats with times
// carry the clip's duration; what cannot be honoured is refused by name.
TEST_F(GatewayHears, TranscriptionsAndInputAudioAnswerAsTheDirectLoop) {
  const std::string fixtures = TROUPE_FIXTURES_DIR;
  const std::string clip = fixtures + "/audio/speech16k.wav";  // 3.3 s
  auto direct_text = [&](const std::string& prompt) { return direct_hears_text(clip, prompt); };
  const auto upload = [&](const std::string& fields) {
    return curl("-H 'Authorization: Bearer sk-test' -F file=@" + clip + " -F max_tokens=12 " +
                fields + " " + url_ + "/v1/audio/transcriptions");
  };
  const std::string want = direct_text("Transcribe the audio.");
  ASSERT_FALSE(want.empty());
  auto r = upload("");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.body;
  EXPECT_EQ(j["text"], want) << r.body;
  EXPECT_GT(j["usage"]["input_tokens"].get<int>(), 20);
  auto srt = upload("-F response_format=srt");
  ASSERT_EQ(srt.status, 200) << srt.body;
  EXPECT_EQ(srt.body, "1\n00:00:00,000 --> 00:00:03,300\n" + want + "\n\n");
  auto verbose = upload("-F response_format=verbose_json -F language=en");
  ASSERT_EQ(verbose.status, 200) << verbose.body;
  EXPECT_DOUBLE_EQ(json::parse(verbose.body)["duration"].get<double>(), 3.3);
  // Refused by name.
  auto fr = upload("-F language=fr");
  EXPECT_EQ(fr.status, 400) << fr.body;
  EXPECT_NE(fr.body.find("\"param\":\"language\""), std::string::npos) << fr.body;
  auto streamed = upload("-F stream=true");
  EXPECT_EQ(streamed.status, 400) << streamed.body;
  auto no_key = curl("-F file=@" + clip + " " + url_ + "/v1/audio/transcriptions");
  EXPECT_EQ(no_key.status, 401) << no_key.body;
  auto not_audio = curl("-H 'Authorization: Bearer sk-test' -F file=@" + fixtures +
                        "/shapes/shapes_002.png " + url_ + "/v1/audio/transcriptions");
  EXPECT_EQ(not_audio.status, 400) << not_audio.body;
  EXPECT_NE(not_audio.body.find("shapes_002.png"), std::string::npos) << not_audio.body;
  // A chat with the clip as an input_audio part.
  json chat{
      {"messages",
       json::array(
           {{{"role", "user"},
             {"content",
              json::array({{{"type", "text"}, {"text", "What is said?"}},
                           {{"type", "input_audio"},
                            {"input_audio", {{"data", base64_of(clip)}, {"format", "wav"}}}}})}}})},
      {"max_tokens", 12},
      {"temperature", 0}};
  auto c = post("/v1/chat/completions", chat);
  ASSERT_EQ(c.status, 200) << c.body;
  std::string said = json::parse(c.body)["choices"][0]["message"]["content"];
  while (!said.empty() && said.front() == ' ') said.erase(0, 1);
  EXPECT_EQ(said, direct_text("What is said?")) << c.body;
}

// A clip streamed into a request over gRPC (GenerateFromChunks with
// start.audio_stream and `audio` pieces) answers as the direct loop does
// with the whole clip; misuse is refused by name
// (tests/serve/grpc_audio_client.py, a real client: Debian's python3-grpcio).
TEST_F(GatewayHears, GrpcStreamsAudioIntoTheRequest) {
  const std::string fixtures = TROUPE_FIXTURES_DIR;
  const std::string clip = fixtures + "/audio/speech16k.wav";
  const std::string want = direct_hears_text(clip, "What is said?");
  ASSERT_FALSE(want.empty());
  ASSERT_EQ(want.find('\''), std::string::npos) << "the text goes in single quotes: " << want;
  auto line = serve_->expect("troupe serve: gRPC", 10000ms);
  ASSERT_TRUE(line) << "no gRPC line";
  const std::string port = line->substr(line->rfind(':') + 1);
  const std::string cmd = "/usr/bin/python3 " + fixtures + "/../serve/grpc_audio_client.py " +
                          port + " sk-test " + TROUPE_PROTO_PY + " " + clip + " '" + want +
                          "' 2>&1";
  const auto [rc, out] = test::run_command(cmd);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("grpc audio client: all checks passed"), std::string::npos) << out;
}

// The audio socket (/v1/audio/stream, a WebSocket; Beast's own client
// here): a chat, then the clip in 0.5 s binary pieces, each acknowledged
// with the tokens it added, then audio.end; the answer comes as chat
// completion chunks and is the direct loop's for the whole clip. Misuse
// gets an error message (or, without the key, no socket).
TEST_F(GatewayHears, TheAudioSocketStreamsAClipIntoAChat) {
  namespace beast = boost::beast;
  namespace websocket = beast::websocket;
  const std::string fixtures = TROUPE_FIXTURES_DIR;
  const std::string clip = fixtures + "/audio/speech16k.wav";
  const std::string want = direct_hears_text(clip, "What is said?");
  ASSERT_FALSE(want.empty());
  // The WAV's samples as the PCM the socket carries (16-bit, 16 kHz, mono:
  // the data after the 44-byte header).
  std::ifstream f(clip, std::ios::binary);
  std::string wav{std::istreambuf_iterator<char>(f), {}};
  ASSERT_GT(wav.size(), 44u);
  const std::string pcm = wav.substr(44);
  boost::asio::io_context io;
  auto open = [&](const std::string& key, std::string* refused) {
    auto ws = std::make_unique<websocket::stream<boost::asio::ip::tcp::socket>>(io);
    ws->next_layer().connect(
        {boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port_)});
    ws->set_option(websocket::stream_base::decorator([key](websocket::request_type& r) {
      if (!key.empty()) r.set(beast::http::field::authorization, "Bearer " + key);
    }));
    websocket::response_type res;
    beast::error_code ec;
    ws->handshake(res, "127.0.0.1", "/v1/audio/stream", ec);
    if (ec) {
      if (refused) *refused = ec.message();
      return std::unique_ptr<websocket::stream<boost::asio::ip::tcp::socket>>{};
    }
    return ws;
  };
  auto read = [](websocket::stream<boost::asio::ip::tcp::socket>& ws) {
    beast::flat_buffer b;
    beast::error_code ec;
    ws.read(b, ec);
    return ec ? json() : json::parse(beast::buffers_to_string(b.data()), nullptr, false);
  };
  auto ws = open("sk-test", nullptr);
  ASSERT_TRUE(ws);
  ws->text(true);
  ws->write(boost::asio::buffer(json{
      {"messages", {{{"role", "user"}, {"content", "What is said?"}}}},
      {"max_tokens", 12},
      {"temperature", 0},
      {"stream_options",
       {{"include_usage", true}}}}.dump()));
  std::vector<json> acks;
  ws->binary(true);
  for (std::size_t at = 0; at < pcm.size(); at += 16000) {
    ws->write(boost::asio::buffer(pcm.data() + at, std::min<std::size_t>(16000, pcm.size() - at)));
    acks.push_back(read(*ws));
  }
  ws->text(true);
  ws->write(boost::asio::buffer(std::string(R"({"type": "audio.end"})")));
  acks.push_back(read(*ws));
  ASSERT_EQ(acks.size(), 8u);  // 3.3 s in 0.5 s pieces, and the end
  EXPECT_EQ(acks[2]["tokens"], 0) << "1.5 s of the clip: no whole window yet";
  EXPECT_EQ(acks[3]["tokens"], 13) << "2 s: the first whole window (100 rows, stacked by 8)";
  EXPECT_EQ(acks[6]["tokens"], 13) << "the last piece waits for audio.end";
  EXPECT_EQ(acks[7]["samples"], static_cast<int>(pcm.size() / 2)) << acks[7].dump();
  EXPECT_EQ(acks[7]["done"], true) << acks[7].dump();
  std::string text;
  json last, usage;
  for (json m = read(*ws); !m.is_null(); m = read(*ws)) {
    ASSERT_FALSE(m.contains("error")) << m.dump();
    if (!m["choices"].empty()) {
      text += m["choices"][0]["delta"].value("content", "");
      last = m;
    } else {
      usage = m;
    }
  }
  while (!text.empty() && text.front() == ' ') text.erase(0, 1);
  EXPECT_EQ(text, want);
  const std::string finish = last["choices"][0].value("finish_reason", "");
  EXPECT_TRUE(finish == "stop" || finish == "length") << last.dump();
  EXPECT_GT(usage["usage"]["prompt_tokens"].get<int>(), 20) << usage.dump();
  // No key: no socket (the gateway answers the upgrade with a 401).
  std::string refused;
  EXPECT_FALSE(open("", &refused));
  EXPECT_NE(refused.find("declined"), std::string::npos) << refused;
  EXPECT_FALSE(open("sk-wrong", &refused));
  // A first message that is not a chat: an error naming it, then a close.
  auto bad = open("sk-test", nullptr);
  ASSERT_TRUE(bad);
  bad->text(true);
  bad->write(boost::asio::buffer(std::string(R"({"messages": [], "max_tokens": 4})")));
  auto e = read(*bad);
  EXPECT_TRUE(e.contains("error")) << e.dump();
  EXPECT_TRUE(read(*bad).is_null()) << "the socket closes after the error";
  // Without the upgrade, the endpoint says what it is.
  auto plain = curl("-H 'Authorization: Bearer sk-test' " + url_ + "/v1/audio/stream");
  EXPECT_EQ(plain.status, 400) << plain.body;
  EXPECT_NE(plain.body.find("WebSocket"), std::string::npos) << plain.body;
}

// Video through the API (issue 29): a chat's video_url part (a data: URL)
// with vLLM's media_io_kwargs answers as `troupe generate --direct --video`
// does with the same file, frames and prompt; bad sampling is refused by
// name.
TEST_F(GatewaySees, VideoUrlAnswersAsTheDirectLoop) {
  const std::string fixtures = TROUPE_FIXTURES_DIR;
  const std::string video = fixtures + "/video/square.mp4";
  auto d = test::troupe_cli("generate --direct -m " + fixtures + "/llava_video --video " + video +
                                " --num-frames 4 --prompt 'What moves?' -n 12 --json",
                            false);
  ASSERT_EQ(d.exit_code, 0) << d.out;
  auto dj = json::parse(d.out.substr(d.out.find('{')), nullptr, false);
  ASSERT_FALSE(dj.is_discarded()) << d.out;
  std::string want = dj.value("text", "");
  while (!want.empty() && want.front() == ' ') want.erase(0, 1);
  ASSERT_FALSE(want.empty());
  auto chat = [&](int frames) {
    return json{
        {"messages",
         json::array(
             {{{"role", "user"},
               {"content",
                json::array(
                    {{{"type", "text"}, {"text", "What moves?"}},
                     {{"type", "video_url"},
                      {"video_url", {{"url", "data:video/mp4;base64," + base64_of(video)}}}}})}}})},
        {"media_io_kwargs", {{"video", {{"num_frames", frames}}}}},
        {"max_tokens", 12},
        {"temperature", 0}};
  };
  auto c = post("/v1/chat/completions", chat(4));
  ASSERT_EQ(c.status, 200) << c.body;
  const auto j = json::parse(c.body);
  std::string said = j["choices"][0]["message"]["content"];
  while (!said.empty() && said.front() == ' ') said.erase(0, 1);
  EXPECT_EQ(said, want) << c.body;
  // 4 frames of 17 tokens in the prompt.
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 4 * 17);
  auto other = post("/v1/chat/completions", chat(2));
  ASSERT_EQ(other.status, 200) << other.body;
  EXPECT_LT(json::parse(other.body)["usage"]["prompt_tokens"].get<int>(),
            j["usage"]["prompt_tokens"].get<int>());
  auto many = post("/v1/chat/completions", chat(65));
  EXPECT_EQ(many.status, 400) << many.body;
  EXPECT_NE(many.body.find("media_io_kwargs.video.num_frames"), std::string::npos) << many.body;
}
