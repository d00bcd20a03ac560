// Structured output on a random-weight model (the hardest case for a
// grammar: nothing in the weights leans towards JSON) with a long context:
// at least 500 sampled generations that end with `stop`, over the 24
// schemas of tests/fixtures/schemas, every one validated by Debian's
// python3-jsonschema, an independent validator. Generations cut by
// max_tokens are counted and reported apart. Also: the same constrained
// request gives the same tokens alone and in a batch, and a request
// without a grammar in the same batch gives what it gives alone.
#include <gtest/gtest.h>

#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "actor_test.hpp"
#include "actors/client.hpp"
#include "actors/device.hpp"
#include "actors/runtime.hpp"
#include "models/grammar.hpp"
#include "models/random_model.hpp"
#include "tests/run_command.hpp"
#include "tests/temp_path.hpp"
#include "tests/tiny_model.hpp"

namespace {

using namespace troupe;
using namespace troupe::actors;
using nlohmann::json;

std::string random_model() {
  static const std::string path = [] {
    const std::string p = test::temp_path("structured_random.gguf");
    models::random_model_spec spec;
    spec.config = test::tiny_llama_config(512, 128);
    spec.config.max_position_embeddings = 4096;
    spec.format = kernels::weight_format::f32;
    spec.stddev = 0.5f;  // peaked, varied distributions
    spec.seed = 7;
    EXPECT_TRUE(models::write_random_gguf(p, spec));
    return p;
  }();
  return path;
}

struct structured : ::testing::Test {
  caf::actor_system sys{test::actor_config()};
  std::unique_ptr<local_runtime> rt;

  void SetUp() override {
    runtime_config cfg;
    cfg.model = random_model();
    auto d = parse_devices("cpu");
    ASSERT_TRUE(d);
    cfg.devices = *d;
    cfg.scheduler.queue_limit = 1024;
    cfg.scheduler.max_running = 64;
    auto r = local_runtime::start(sys, cfg);
    ASSERT_TRUE(r) << r.error().message;
    rt = std::move(*r);
  }
  void TearDown() override {
    if (rt) rt->stop();
  }

  generate_request request(std::uint64_t seed, std::string grammar, std::int64_t max_tokens) {
    generate_request q;
    q.id = client::next_id();
    auto ids = rt->frontend().tok->encode("Answer in JSON:", true, true);
    EXPECT_TRUE(ids);
    q.prompt_tokens = *ids;
    q.params.temperature = 1.0;
    q.params.seed = seed;
    q.params.max_tokens = max_tokens;
    q.params.stop_token_ids = {*rt->frontend().tok->special_ids().eos};
    q.grammar = std::move(grammar);
    return q;
  }

  std::vector<finish_event> run_all(const std::vector<generate_request>& reqs) {
    client c(sys, rt->scheduler());
    return test::run_all(c, reqs);
  }
};

TEST_F(structured, FiveHundredSampledGenerationsValidateAgainstTheirSchemas) {
  std::ifstream f(std::string(TROUPE_FIXTURES_DIR) + "/schemas/schemas.json");
  const auto schemas = json::parse(f);
  ASSERT_GE(schemas.size(), 20u);
  std::vector<std::string> grammars;
  for (const auto& s : schemas) {
    auto g = models::json_schema_to_gbnf(s.dump());
    ASSERT_TRUE(g) << s.dump() << ": " << g.error().message;
    grammars.push_back(*g);
  }
  json report{{"schemas", schemas}, {"outputs", json::array()}};
  std::map<std::size_t, int> stops, cuts;
  int stopped = 0, cut = 0, failed = 0;
  const int per_round = std::getenv("PER_ROUND") ? std::atoi(std::getenv("PER_ROUND")) : 8;
  for (int round = 0; round < 6 && stopped < 500; ++round) {
    std::vector<generate_request> reqs;
    std::vector<std::size_t> which;
    for (std::size_t s = 0; s < grammars.size(); ++s)
      for (int k = 0; k < per_round; ++k) {
        reqs.push_back(
            request(static_cast<std::uint64_t>(round * 1000 + k * 37 + s), grammars[s], 256));
        which.push_back(s);
      }
    const auto ends = run_all(reqs);
    for (std::size_t i = 0; i < ends.size(); ++i) {
      const auto& e = ends[i];
      if (e.reason == finish_reason::stop) {
        ++stopped;
        ++stops[which[i]];
        report["outputs"].push_back({{"schema", which[i]}, {"text", e.text}});
      } else if (e.reason == finish_reason::length) {
        ++cut;
        ++cuts[which[i]];
      } else {
        ++failed;
        ADD_FAILURE() << "schema " << which[i] << ": " << to_string(e.reason) << " " << e.error;
      }
    }
  }
  std::string per_schema;
  for (std::size_t s = 0; s < grammars.size(); ++s)
    per_schema += " " + std::to_string(s) + ":" + std::to_string(stops[s]) + "/" +
                  std::to_string(stops[s] + cuts[s]);
  std::printf(
      "structured output: %d ended with stop, %d cut by max_tokens, %d failed; "
      "per schema (stop/all):%s\n",
      stopped, cut, failed, per_schema.c_str());
  EXPECT_GE(stopped, 500);
  EXPECT_EQ(failed, 0);
  for (std::size_t s = 0; s < grammars.size(); ++s) EXPECT_GT(stops[s], 0) << "schema " << s;

  const std::string path = test::temp_path("structured_outputs.json");
  std::ofstream(path) << report.dump(-1, ' ', false, json::error_handler_t::replace);
  const std::string cmd = "/usr/bin/python3 " + std::string(TROUPE_FIXTURES_DIR) +
                          "/../../tools/validate_json_outputs.py " + path + " 2>&1";
  const auto [rc, out] = test::run_command(cmd);
  std::printf("%s", out.c_str());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("validated " + std::to_string(stopped) + " outputs over " +
                     std::to_string(schemas.size()) + " schemas: 0 invalid"),
            std::string::npos)
      << out;
}

// A constrained request samples the same tokens alone and beside others,
// and an unconstrained one beside constrained ones the same as alone.
TEST_F(structured, MasksKeepBatchInvariance) {
  auto g = models::json_schema_to_gbnf(
      R"({"type":"object","properties":{"n":{"type":"integer"},"s":{"type":"string","maxLength":5}},"required":["n","s"],"additionalProperties":false})");
  ASSERT_TRUE(g);
  auto guided = request(42, *g, 64);
  auto plain = request(43, "", 24);
  const auto guided_alone = run_all({guided}).front();
  const auto plain_alone = run_all({plain}).front();
  ASSERT_EQ(guided_alone.reason, finish_reason::stop) << guided_alone.text;
  EXPECT_TRUE(json::parse(guided_alone.text, nullptr, false).is_object()) << guided_alone.text;
  std::vector<generate_request> batch;
  for (int i = 0; i < 6; ++i) {
    auto a = guided, b = plain;
    a.id = client::next_id();
    b.id = client::next_id();
    batch.push_back(a);
    batch.push_back(b);
  }
  const auto together = run_all(batch);
  for (std::size_t i = 0; i < together.size(); ++i) {
    const auto& want = i % 2 == 0 ? guided_alone : plain_alone;
    EXPECT_EQ(together[i].tokens, want.tokens) << i;
  }
}

}  // namespace
