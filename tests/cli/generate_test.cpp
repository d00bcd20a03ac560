// `troupe generate` end to end: run the binary, compare its tokens with the
// same request run in a batch of mixed requests in this process (batch
// invariance end to end), and check that bad input fails cleanly.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "models/generate.hpp"
#include "models/random_model.hpp"
#include "models/tokenizer.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

struct run_result {
  int exit_code = -1;
  std::string out;
};

// Runs the troupe binary with `args`; stdout and stderr together.
run_result troupe_cli(const std::string& args) {
  const std::string cmd = std::string(TROUPE_CLI) + " " + args + " 2>&1";
  run_result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), p)) r.out += buf.data();
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

std::string tiny_model() {
  static const std::string path = [] {
    const std::string p = ::testing::TempDir() + "/cli_tiny.gguf";
    random_model_spec spec;
    auto& c = spec.config;
    c.vocab_size = 320;
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 16;
    c.max_position_embeddings = 512;
    c.eos_token_ids = {2};
    spec.format = k::weight_format::q8_0;
    spec.stddev = 0.1f;
    EXPECT_TRUE(write_random_gguf(p, spec));
    return p;
  }();
  return path;
}

}  // namespace

TEST(CliGenerate, JsonTokensEqualTheSameRequestInAMixedBatch) {
  const auto model = tiny_model();
  const auto r = troupe_cli("generate -m " + model + " -p 'hello world' -n 12 --temperature 0.9 --top-k 40 --seed 5 --json --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto line = r.out.substr(r.out.rfind('{', r.out.find("\"text\"")));
  const auto j = nlohmann::json::parse(line.substr(0, line.find('\n')), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  const auto cli_tokens = j["tokens"].get<std::vector<std::int32_t>>();
  const auto prompt = j["prompt_tokens"].get<std::vector<std::int32_t>>();
  ASSERT_FALSE(cli_tokens.empty());
  ASSERT_LE(cli_tokens.size(), 12u);
  EXPECT_GT(j["timings"]["decode_tokens_per_s"].get<double>(), 0.0);

  // The same request among others, in this process, one thread.
  auto ctx = k::cpu::context::create(1);
  auto m = llama_model::load(model, *ctx);
  ASSERT_TRUE(m);
  auto g = gguf_file::open(model);
  ASSERT_TRUE(g);
  auto tok = tokenizer::from_gguf(*g);
  ASSERT_TRUE(tok) << tok.error().message;
  auto ids = tok->encode("hello world");
  ASSERT_TRUE(ids);
  EXPECT_EQ(*ids, prompt);
  std::vector<generation_request> reqs(3);
  reqs[0].prompt = {1, 100, 101, 102};
  reqs[0].params.max_tokens = 20;
  reqs[0].params.temperature = 1.2;
  reqs[1].prompt = *ids;
  reqs[1].params.max_tokens = 12;
  reqs[1].params.temperature = 0.9;
  reqs[1].params.top_k = 40;
  reqs[1].params.seed = 5;
  reqs[1].params.stop_token_ids = {2, 2};
  reqs[2].prompt = std::vector<std::int32_t>(37, 7);
  reqs[2].params.max_tokens = 5;
  generate_options opts;
  opts.prefill_chunk = 3;
  auto out = generate_batch(*ctx, **m, reqs, std::vector<piece_fn>(3, [](std::int32_t) { return std::string(); }), nullptr, opts);
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ((*out)[1].tokens, cli_tokens);
}

TEST(CliGenerate, BadInputFailsWithAMessage) {
  auto r = troupe_cli("generate -m /nonexistent/model.gguf -p hi");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/model.gguf"), std::string::npos) << r.out;
  r = troupe_cli("generate -m " + tiny_model() + " -p hi --quant q5_k");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("q5_k"), std::string::npos) << r.out;
  r = troupe_cli("generate -m " + tiny_model() + " -p hi --chat-template nosuch");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  r = troupe_cli("generate -m " + tiny_model() + " -p hi --top-p 7");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  // Every committed corrupt GGUF: a clean error, never a crash.
  for (const char* f : {"bad_magic.gguf", "huge_tensor_count.gguf", "overlapping_tensors.gguf", "offset_wraps.gguf"}) {
    r = troupe_cli(std::string("generate -p hi -m ") + TROUPE_FIXTURES_DIR + "/models/corrupt/" + f);
    EXPECT_EQ(r.exit_code, 1) << f << ": " << r.out;
    EXPECT_NE(r.out.find("error"), std::string::npos) << r.out;
  }
}
