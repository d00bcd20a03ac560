// `troupe run` (the actor pipeline over several devices) and `troupe bench`
// end to end through the real binary.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "run_cli.hpp"

namespace {

using troupe::test::troupe_cli;

const std::string image = std::string(TROUPE_FIXTURES_DIR) + "/shapes/shapes_005.png";

nlohmann::json last_json(const std::string& out) {
  const auto at = out.rfind("\n{");
  return nlohmann::json::parse(at == std::string::npos ? out : out.substr(at + 1));
}

TEST(CliRun, TwoStagesGiveTheTokensOfThePlainLoop) {
  const std::string args =
      " -i " + image +
      " -p 'Describe the image.' -n 20 --temperature 0.8 --top-k 20 --seed 11 --json";
  const auto direct = troupe_cli("generate --direct" + args, false);
  ASSERT_EQ(direct.exit_code, 0) << direct.out;
  const auto run = troupe_cli("run --stages 2 --devices cpu:0-0,cpu:1-1" + args, false);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto a = last_json(direct.out), b = last_json(run.out);
  EXPECT_EQ(a["tokens"], b["tokens"]);
  EXPECT_EQ(a["text"], b["text"]);
  EXPECT_EQ(a["prompt_length"], b["prompt_length"]);
  EXPECT_NE(b["pipeline"].get<std::string>().find("layers [2,4)"), std::string::npos)
      << b["pipeline"];
  // One stage (troupe generate's default path) agrees as well.
  const auto one = troupe_cli("generate" + args, false);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  EXPECT_EQ(last_json(one.out)["tokens"], a["tokens"]);
}

TEST(CliRun, BadDevicesAndStagesFailWithAMessage) {
  auto r = troupe_cli("run -p hi --devices cpu:4096");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("core 4096"), std::string::npos) << r.out;
  r = troupe_cli("run -p hi --devices cpu:0,cpu:0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("another device"), std::string::npos) << r.out;
  r = troupe_cli("run -p hi --devices cuda:7");  // no machine of this project has eight GPUs
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("device 'cuda:7'"), std::string::npos) << r.out;
  r = troupe_cli("run -p hi --devices npu:0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("NPU"), std::string::npos) << r.out;
  r = troupe_cli("run -p hi --stages 9");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("9 stages for a model of 4 layers"), std::string::npos) << r.out;
  r = troupe_cli("run -p 'Describe the image.' -i /nonexistent.png");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("/nonexistent.png"), std::string::npos) << r.out;
}

TEST(CliBench, ReportsEveryLevel) {
  const auto r = troupe_cli("bench -c 1,3 -n 6 --max-tokens 8 --json", false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["levels"].size(), 2u);
  for (const auto& l : j["levels"]) {
    EXPECT_EQ(l["completed"], 6);
    EXPECT_EQ(l["failed"], 0);
    EXPECT_EQ(l["output_tokens"], 6 * 8);
    EXPECT_GT(l["output_tokens_per_s"].get<double>(), 0);
    EXPECT_GT(l["ttft_ms"]["p50"].get<double>(), 0);
    EXPECT_LE(l["ttft_ms"]["p50"].get<double>(), l["ttft_ms"]["p99"].get<double>());
    EXPECT_GE(l["e2e_ms"]["mean"].get<double>(), l["ttft_ms"]["mean"].get<double>());
  }
  EXPECT_EQ(j["levels"][1]["concurrency"], 3);
  EXPECT_GT(j["reference_decode_tokens_per_s"].get<double>(), 0);
  EXPECT_EQ(j["reference_batch"]["requests"], 3);
  EXPECT_GT(j["reference_batch"]["output_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(j["reference_batch"]["gain"].get<double>(), 0);
}

}  // namespace
