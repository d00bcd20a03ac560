// A LLaVA that also hears (tools/make_llava_audio_fixtures.py: the random
// LLaVA and Whisper fixtures joined by a random audio projector): the
// prompt's expansion and the decoder's logits with an image and two clips,
// against transformers' modules in float64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_device.hpp"
#include "models/llava.hpp"
#include "models/safetensors.hpp"
#include "tests/models/logit_agreement.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::test::relative_error;
namespace k = troupe::kernels;

namespace {

const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/llava_audio/odd";

std::vector<float> array(const safetensors_model& f, const std::string& name) {
  const auto* t = f.find(name);
  if (!t) {
    ADD_FAILURE() << "no " << name;
    return {};
  }
  auto v = f.view(*t);
  if (!v) return {};
  return {v->data_as<float>(), v->data_as<float>() + t->shape.numel()};
}

std::vector<std::int32_t> ints(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

// Teacher-forced logits of a prepared prompt.
std::vector<float> logits_of(k::device& ctx, const llava_model& m, const llava_prompt& p) {
  const auto& lm = m.language_model();
  auto cache = lm.make_cache(ctx.memory(), kv_options{.block_size = 16, .capacity_tokens = 256});
  EXPECT_TRUE(cache);
  if (!cache) return {};
  step_input in{cache->add_sequence(), p.tokens, true};
  in.embed_token = p.image_token;
  in.embeddings = p.image_embeds;
  auto logits = lm.forward(ctx, *cache, std::vector<step_input>{in});
  EXPECT_TRUE(logits) << logits.error().message;
  if (!logits) return {};
  return {logits->data_as<float>(), logits->data_as<float>() + logits->numel()};
}

}  // namespace

TEST(LlavaAudio, ConfigAndTokenCounts) {
  auto cfg = load_llava_config(dir + "/config.json");
  ASSERT_TRUE(cfg) << cfg.error().message;
  ASSERT_TRUE(cfg->audio);
  EXPECT_EQ(cfg->audio->token_index, 298);
  EXPECT_EQ(cfg->audio->projector.stack, 3);
  EXPECT_EQ(cfg->audio->projector.hidden, 40);
  EXPECT_EQ(cfg->audio->projector.out, 48);
  EXPECT_EQ(cfg->audio->window_samples(), 48 * 160);
  // 1.1 s: windows of 48, 48 and 14 frames -> 24, 24 and 7 rows -> 8 + 8 + 3.
  EXPECT_EQ(cfg->audio->tokens_for_samples(17600), 19);
  EXPECT_EQ(cfg->audio->tokens_for_samples(3000), 3);
  EXPECT_EQ(cfg->audio->tokens_for_samples(159), 0);         // under one hop
  EXPECT_EQ(cfg->audio->tokens_for_samples(7680 + 100), 8);  // a tail under one hop adds none
}

TEST(LlavaAudio, LogitsWithAnImageAndTwoClipsMatchTransformers) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llava_model::load(dir, *ctx);
  ASSERT_TRUE(m) << m.error().message;
  ASSERT_TRUE((*m)->has_audio());
  auto ref = safetensors_model::open(dir + "/reference.safetensors");
  ASSERT_TRUE(ref) << ref.error().message;
  const auto ids = ints(array(*ref, "ids"));
  const auto px = array(*ref, "pixels");
  const auto a = array(*ref, "clip_a"), b = array(*ref, "clip_b");
  auto pixels = k::tensor::empty(ctx->memory(), k::dtype::f32, {1, 3, 30, 30});
  ASSERT_TRUE(pixels);
  std::copy(px.begin(), px.end(), pixels->data_as<float>());
  auto p = (*m)->prepare(*ctx, ids, *pixels,
                         std::vector<std::span<const float>>{std::span(a), std::span(b)});
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ(p->tokens, ints(array(*ref, "expanded")));
  EXPECT_EQ(p->image_embeds.size(), (25u + 19u + 3u) * 48u);
  const double e = relative_error(logits_of(*ctx, **m, *p), array(*ref, "logits"));
  std::printf("LLaVA + audio, 53 positions (25 image, 22 audio rows): logits %.2e x range\n", e);
  EXPECT_LT(e, 1e-4);
}

TEST(LlavaAudio, PlaceholdersMustMatchTheClips) {
  auto ctx = k::cpu::cpu_device::with_threads(1);
  auto m = llava_model::load(dir, *ctx);
  ASSERT_TRUE(m) << m.error().message;
  const std::vector<float> clip(4000, 0.1f), tiny(100, 0.1f);
  const std::vector<std::int32_t> one = {1, 298, 5};
  auto two = (*m)->prepare(*ctx, one, k::tensor{},
                           std::vector<std::span<const float>>{std::span(clip), std::span(clip)});
  ASSERT_FALSE(two);
  EXPECT_NE(two.error().message.find("1 audio token(s)"), std::string::npos) << two.error().message;
  auto short_clip =
      (*m)->prepare(*ctx, one, k::tensor{}, std::vector<std::span<const float>>{std::span(tiny)});
  ASSERT_FALSE(short_clip);
  EXPECT_NE(short_clip.error().message.find("10 ms"), std::string::npos)
      << short_clip.error().message;
  EXPECT_EQ(expand_media_tokens(one, 297, 25, 0, 298, std::vector<std::int64_t>{4}).value(),
            (std::vector<std::int32_t>{1, 297, 297, 297, 297, 5}));
  // A model without audio_config refuses clips.
  auto plain = llava_model::load(std::string(TROUPE_FIXTURES_DIR) + "/llava/odd", *ctx);
  ASSERT_TRUE(plain) << plain.error().message;
  EXPECT_FALSE((*plain)->has_audio());
  EXPECT_FALSE((*plain)->prepare(*ctx, one, k::tensor{},
                                 std::vector<std::span<const float>>{std::span(clip)}));
}

TEST(LlavaAudio, BadAudioKeysAreRefusedByName) {
  std::ifstream f(dir + "/config.json");
  const std::string good{std::istreambuf_iterator<char>(f), {}};
  ASSERT_TRUE(parse_llava_config(good, "cfg"));
  auto refused = [&](const std::string& from, const std::string& to, const std::string& needle) {
    std::string bad = good;
    const auto at = bad.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    bad.replace(at, from.size(), to);
    auto c = parse_llava_config(bad, "cfg");
    ASSERT_FALSE(c) << to;
    EXPECT_NE(c.error().message.find(needle), std::string::npos) << c.error().message;
  };
  refused(R"("audio_token_index": 298)", R"("audio_token_index": 297)",
          "other than image_token_index");
  refused(R"("audio_token_index": 298)", R"("audio_token_index": -4)", "audio_token_index");
  refused(R"("audio_token_index": 298)", R"("no_audio_token": 298)",
          "audio_token_index must be an integer");
  refused(R"("audio_stack_factor": 3)", R"("audio_stack_factor": 0)", "audio_stack_factor");
  refused(R"("audio_projector_hidden": 40)", R"("audio_projector_hidden": "40")",
          "must be an integer");
}
