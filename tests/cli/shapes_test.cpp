// The bundled tiny LLaVA through the real `troupe generate` binary on the
// committed shapes sample (tests/fixtures/shapes, made by
// tools/make_shapes_sample.py with a seed never used in training).
//
// The issue's targets (>= 95% of the questions, >= 95% of the 1-2-object
// captions and >= 90% of the 3-object captions exactly right) must hold on
// the sample, so a regression in the image path (decode, preprocessing,
// vision tower, projector, image token expansion) or a worse model fails CI.
// The per-type tally is printed; assets/tiny-llava-shapes/README.md has the
// figures on 300 fresh images. Plus clear errors for bad images.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "../temp_path.hpp"
#include "run_cli.hpp"

namespace {

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

// Stdout only: --json output must parse; stderr goes unless `merge`.
troupe::test::run_result troupe_cli(const std::string& args, bool merge = false) {
  return troupe::test::troupe_cli(args, merge);
}

const std::string fixtures = std::string(TROUPE_FIXTURES_DIR) + "/shapes";

// The answer text of a --json run, or an error description.
std::string ask(const std::string& image, const std::string& prompt) {
  const auto r = troupe_cli("generate --image " + quote(image) + " --prompt " + quote(prompt) +
                            " --temperature 0 --json --threads 1");
  if (r.exit_code != 0) return "<exit " + std::to_string(r.exit_code) + ">";
  const auto j = nlohmann::json::parse(r.out, nullptr, false);
  if (j.is_discarded() || !j.contains("text")) return "<bad json: " + r.out + ">";
  std::string t = j["text"].get<std::string>();
  const auto b = t.find_first_not_of(' ');
  const auto e = t.find_last_not_of(' ');
  return b == std::string::npos ? "" : t.substr(b, e - b + 1);
}

struct tally {
  int q_right = 0, q_total = 0, c12_right = 0, c12_total = 0, c3_right = 0, c3_total = 0;
  std::map<std::string, std::pair<int, int>> by_type;  // right, total
  std::string wrong;
};

// Asks the CLI every caption and question of the sample.
tally run_sample() {
  tally t;
  std::ifstream in(fixtures + "/answers.json");
  EXPECT_TRUE(in) << "missing " << fixtures << "/answers.json";
  if (!in) return t;
  const auto spec = nlohmann::json::parse(in);
  const std::string caption_prompt = spec["prompt_caption"].get<std::string>();
  auto& [q_right, q_total, c12_right, c12_total, c3_right, c3_total, by_type, wrong_text] = t;
  std::ostringstream wrong;
  for (const auto& img : spec["images"]) {
    const std::string file = fixtures + "/" + img["file"].get<std::string>();
    const int objects = img["objects"].get<int>();
    const std::string want = img["caption"].get<std::string>();
    const std::string got = ask(file, caption_prompt);
    const bool ok = got == want;
    (objects == 3 ? c3_right : c12_right) += ok;
    (objects == 3 ? c3_total : c12_total) += 1;
    if (!ok)
      wrong << img["file"].get<std::string>() << " caption: want '" << want << "', got '" << got
            << "'\n";
    for (const auto& q : img["questions"]) {
      const std::string a = ask(file, q["question"].get<std::string>());
      const bool qok = a == q["answer"].get<std::string>();
      q_right += qok;
      ++q_total;
      auto& bt = by_type[q["type"].get<std::string>()];
      bt.first += qok;
      ++bt.second;
      if (!qok)
        wrong << img["file"].get<std::string>() << " '" << q["question"].get<std::string>()
              << "': want '" << q["answer"].get<std::string>() << "', got '" << a << "'\n";
    }
  }
  wrong_text = wrong.str();
  std::printf("questions %d/%d, captions 1-2 objects %d/%d, 3 objects %d/%d\n", q_right, q_total,
              c12_right, c12_total, c3_right, c3_total);
  for (const auto& [type, rt] : by_type)
    std::printf("  %-9s %d/%d\n", type.c_str(), rt.first, rt.second);
  return t;
}

}  // namespace

TEST(CliShapes, MeetsTheIssueTargets) {
  const tally t = run_sample();
  ASSERT_GE(t.c3_total, 10);
  ASSERT_GE(t.q_total, 90);
  EXPECT_GE(t.q_right, 0.95 * t.q_total) << t.wrong;
  EXPECT_GE(t.c12_right, 0.95 * t.c12_total) << t.wrong;
  EXPECT_GE(t.c3_right, 0.90 * t.c3_total) << t.wrong;
}

TEST(CliShapes, DefaultModelIsTheBundledOne) {
  // Without --model the CLI loads assets/tiny-llava-shapes; the same run
  // with the path spelled out gives the same tokens.
  const std::string image = fixtures + "/shapes_000.png";
  const auto a = troupe_cli("generate --image " + quote(image) +
                            " --prompt 'Describe the image.' --json --threads 1");
  const auto b =
      troupe_cli("generate --model " + quote(std::string(TROUPE_BUNDLED_MODEL)) + " --image " +
                 quote(image) + " --prompt 'Describe the image.' --json --threads 1");
  ASSERT_EQ(a.exit_code, 0);
  ASSERT_EQ(b.exit_code, 0);
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(ja["tokens"], jb["tokens"]);
  EXPECT_EQ(ja["images"].get<int>(), 1);
  EXPECT_GT(ja["timings"]["image_encode_ms"].get<double>(), 0.0);
  // The image tokens were expanded: 64 patches replace the one <image>.
  EXPECT_GT(ja["prompt_length"].get<std::int64_t>(), ja["prompt_tokens"].size() + 60);
}

TEST(CliShapes, BadImagesFailWithAClearMessage) {
  const std::string dir = troupe::test::temp_path("cli_bad_images");
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir + "/garbage.png") << "this is not an image";
    // A PNG cut in the middle of its pixel data.
    std::ifstream src(fixtures + "/shapes_001.png", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(src)), std::istreambuf_iterator<char>());
    std::ofstream(dir + "/truncated.png", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  struct bad_case {
    std::string args, expect;
  };
  const bad_case cases[] = {
      {"--image " + dir + "/missing.png", "missing.png"},
      {"--image " + dir + "/garbage.png", "garbage.png"},
      {"--image " + dir + "/truncated.png", "truncated.png"},
      {"--image " + fixtures + "/shapes_000.png --prompt-extra", ""},
  };
  for (const auto& c : cases) {
    const auto r = troupe_cli("generate " + c.args + " --prompt 'Describe the image.'", true);
    EXPECT_NE(r.exit_code, 0) << c.args << "\n" << r.out;
    EXPECT_LT(r.exit_code, 128) << "crashed: " << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
  // Two images but one placeholder in a raw prompt: refused before any work.
  const auto r = troupe_cli("generate --image " + fixtures + "/shapes_000.png --image " + fixtures +
                                "/shapes_001.png --prompt 'USER: <image>\nWhat? ASSISTANT:'",
                            true);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("placeholders"), std::string::npos) << r.out;
  std::filesystem::remove_all(dir);
}
