// `troupe generate` end to end: run the binary, compare its tokens with the
// same request run in a batch of mixed requests in this process (batch
// invariance end to end), and check that bad input fails cleanly.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include "../temp_path.hpp"
#include "../tiny_model.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "run_cli.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "models/generate.hpp"
#include "models/random_model.hpp"
#include "models/tokenizer.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

using troupe::test::troupe_cli;

std::string tiny_model() {
  static const std::string path = [] {
    const std::string p = troupe::test::temp_path("cli_tiny.gguf");
    random_model_spec spec;
    spec.config = troupe::test::tiny_llama_config(320, 128);
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
  const auto r = troupe_cli(
      "generate -m " + model +
      " -p 'hello world' -n 12 --temperature 0.9 --top-k 40 --seed 5 --json --threads 2");
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
  auto ctx = k::cpu::cpu_device::with_threads(1);
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
  auto out = generate_batch(*ctx, **m, reqs,
                            std::vector<piece_fn>(3, [](std::int32_t) { return std::string(); }),
                            nullptr, opts);
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ((*out)[1].tokens, cli_tokens);
}

TEST(CliGenerate, BadInputFailsWithAMessage) {
  auto r = troupe_cli("generate -m /nonexistent/model.gguf -p hi");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/model.gguf"), std::string::npos) << r.out;
  r = troupe_cli("generate -m " + tiny_model() + " -p hi --quant q5_k_x");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("q5_k_x"), std::string::npos) << r.out;
  r = troupe_cli("generate -m " + tiny_model() + " -p hi --chat-template nosuch");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  r = troupe_cli("generate -m " + tiny_model() + " -p hi --top-p 7");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  // Every committed corrupt GGUF: a clean error, never a crash.
  for (const char* f : {"bad_magic.gguf", "huge_tensor_count.gguf", "overlapping_tensors.gguf",
                        "offset_wraps.gguf"}) {
    r = troupe_cli(std::string("generate -p hi -m ") + TROUPE_FIXTURES_DIR + "/models/corrupt/" +
                   f);
    EXPECT_EQ(r.exit_code, 1) << f << ": " << r.out;
    EXPECT_NE(r.out.find("error"), std::string::npos) << r.out;
  }
}

// Inputs a user names that are not what they claim: a directory or a device
// given as --image used to abort the process (an uncaught ios_failure); a
// file that is no image fails the request, and the prompt is not echoed
// before the error (it used to be).
TEST(CliGenerate, ImagesThatAreNoImagesFailWithAMessage) {
  const auto dir = std::filesystem::temp_directory_path() / "troupe-image-dir";
  std::filesystem::create_directories(dir);
  for (const std::string& bad : {dir.string(), std::string("/dev/zero")}) {
    auto r = troupe_cli("generate --image " + bad + " -p 'Describe the image.' -n 4");
    EXPECT_EQ(r.exit_code, 1) << bad << ": " << r.out;
    EXPECT_NE(r.out.find("not a regular file"), std::string::npos) << r.out;
  }
  const auto text = dir / "notes.png";
  std::ofstream(text) << "these are notes, not a PNG";
  auto r = troupe_cli("generate --image " + text.string() + " -p 'Describe the image.' -n 4");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("notes.png"), std::string::npos) << r.out;
  auto out = troupe_cli("generate --image " + text.string() + " -p 'Describe the image.' -n 4",
                        /*merge_stderr=*/false);
  EXPECT_EQ(out.out.find("Describe the image."), std::string::npos)
      << "the prompt was echoed before the error: " << out.out;
  std::filesystem::remove_all(dir);
}

// A Hugging Face folder (config.json + safetensors + tokenizer.json): the
// llama3 fidelity checkpoint with a byte-level tokenizer of exactly its 257
// ids (256 byte tokens and one special end token), written here.
TEST(CliGenerate, RunsAHuggingFaceFolder) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(TROUPE_FIXTURES_DIR) / "llama" / "llama3";
  const fs::path dir = fs::path(troupe::test::temp_path("hf_llama3"));
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors", "generation_config.json"})
    fs::copy_file(src / f, dir / f, fs::copy_options::overwrite_existing);
  // GPT-2's byte -> unicode map: printable bytes stand for themselves.
  auto byte_char = [](int b) {
    static std::vector<int> map = [] {
      std::vector<int> bs, cs;
      for (int i = 33; i <= 126; ++i) bs.push_back(i);
      for (int i = 161; i <= 172; ++i) bs.push_back(i);
      for (int i = 174; i <= 255; ++i) bs.push_back(i);
      cs = bs;
      int n = 0;
      for (int i = 0; i < 256; ++i)
        if (std::find(bs.begin(), bs.end(), i) == bs.end())
          bs.push_back(i), cs.push_back(256 + n++);
      std::vector<int> m(256);
      for (std::size_t i = 0; i < bs.size(); ++i) m[static_cast<std::size_t>(bs[i])] = cs[i];
      return m;
    }();
    const int cp = map[static_cast<std::size_t>(b)];
    std::string s;
    if (cp < 0x80)
      s += static_cast<char>(cp);
    else
      s += static_cast<char>(0xC0 | (cp >> 6)), s += static_cast<char>(0x80 | (cp & 0x3F));
    return s;
  };
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  nlohmann::json tok = {{"version", "1.0"},
                        {"added_tokens",
                         {{{"id", 256},
                           {"content", "<|end|>"},
                           {"special", true},
                           {"single_word", false},
                           {"lstrip", false},
                           {"rstrip", false},
                           {"normalized", false}}}},
                        {"normalizer", nullptr},
                        {"pre_tokenizer",
                         {{"type", "ByteLevel"},
                          {"add_prefix_space", false},
                          {"trim_offsets", true},
                          {"use_regex", true}}},
                        {"post_processor", nullptr},
                        {"decoder",
                         {{"type", "ByteLevel"},
                          {"add_prefix_space", true},
                          {"trim_offsets", true},
                          {"use_regex", true}}},
                        {"model",
                         {{"type", "BPE"},
                          {"dropout", nullptr},
                          {"unk_token", nullptr},
                          {"continuing_subword_prefix", nullptr},
                          {"end_of_word_suffix", nullptr},
                          {"fuse_unk", false},
                          {"byte_fallback", false},
                          {"vocab", vocab},
                          {"merges", nlohmann::json::array()}}}};
  std::ofstream(dir / "tokenizer.json") << tok.dump();
  const auto r = troupe_cli("generate -m " + dir.string() + " -p 'Hi!' -n 6 --json --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto start = r.out.rfind("\n{") == std::string::npos ? 0 : r.out.rfind("\n{") + 1;
  const auto j = nlohmann::json::parse(r.out.substr(start), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["prompt_tokens"].get<std::vector<int>>(), (std::vector<int>{'H', 'i', '!'}));
  EXPECT_FALSE(j["tokens"].empty());
}
