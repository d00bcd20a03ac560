// A LLaVA that sees video (tools/make_video_model_fixture.py: the bundled
// shapes model with troupe's video keys and a random newline row): the
// frames' pooling, their rows and the decoder's logits with a video in the
// prompt, against transformers' CLIP tower, LlavaNextVideoPooler and
// projector in float64; and the frames this project decodes from the same
// file against PyAV's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "../kernels/fixture_reader.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/image_processor.hpp"
#include "models/llava.hpp"
#include "models/video.hpp"
#include "tests/models/logit_agreement.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::test::relative_error;
namespace k = troupe::kernels;

namespace {

const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/llava_video";
const std::string clip = std::string(TROUPE_FIXTURES_DIR) + "/video/square.mp4";

const std::map<std::string, test::fixture_array>& ref() {
  static const auto f = test::load_fixture(dir + "/reference.bin");
  return f;
}

std::vector<float> floats(const std::string& name) {
  return ref().at(name).as<float>();
}

std::vector<float> host(const k::tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  EXPECT_TRUE(k::copy_to_host(t, std::as_writable_bytes(std::span<float>(out))));
  return out;
}

k::tensor on(k::device& ctx, const std::vector<float>& v, k::shape_t shape) {
  auto t = k::tensor::empty(ctx.memory(), k::dtype::f32, shape);
  EXPECT_TRUE(t);
  std::copy(v.begin(), v.end(), t->data_as<float>());
  return *t;
}

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
  return host(*logits);
}

std::string text_of(const std::string& path) {
  std::ifstream f(path);
  return {std::istreambuf_iterator<char>(f), {}};
}

}  // namespace

TEST(LlavaVideo, ConfigAndTokensPerFrame) {
  auto cfg = load_llava_config(dir + "/config.json");
  ASSERT_TRUE(cfg) << cfg.error().message;
  ASSERT_TRUE(cfg->video);
  EXPECT_EQ(cfg->video->token_index, 397);
  EXPECT_EQ(cfg->video->pool_stride, 2);
  EXPECT_EQ(cfg->video->pool, video_pool::average);
  EXPECT_TRUE(cfg->video->frame_newline);
  EXPECT_EQ(cfg->patch_grid(), 8);
  // 8 x 8 patches pooled 2 x 2 -> 16 rows, and the newline.
  EXPECT_EQ(cfg->tokens_per_frame(), ref().at("tokens_per_frame").as<std::int64_t>()[0]);
  EXPECT_EQ(cfg->tokens_per_frame(), 17);
  // The bundled model takes no video.
  auto plain = load_llava_config(std::string(TROUPE_FIXTURES_DIR) + "/llava/odd/config.json");
  ASSERT_TRUE(plain);
  EXPECT_FALSE(plain->video);
  EXPECT_EQ(plain->tokens_per_frame(), 0);
}

TEST(LlavaVideo, BadVideoKeysAreRefusedByName) {
  const std::string good = text_of(dir + "/config.json");
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const auto at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) s.replace(at, from.size(), to);
    return parse_llava_config(s, "config.json");
  };
  auto conv = with("\"average\"", "\"conv\"");
  ASSERT_FALSE(conv);
  EXPECT_NE(conv.error().message.find("spatial_pool_mode"), std::string::npos);
  auto wide = with("\"spatial_pool_stride\": 2", "\"spatial_pool_stride\": 9");
  ASSERT_FALSE(wide);
  EXPECT_NE(wide.error().message.find("spatial_pool_stride"), std::string::npos)
      << wide.error().message;
  auto same = with("\"video_token_index\": 397", "\"video_token_index\": 3");
  ASSERT_FALSE(same);
  EXPECT_NE(same.error().message.find("video_token_index"), std::string::npos);
  auto orphan = with("\"video_token_index\": 397,", "");
  ASSERT_FALSE(orphan);
  EXPECT_NE(orphan.error().message.find("video_token_index is not"), std::string::npos)
      << orphan.error().message;
  auto full = with("\"vision_feature_select_strategy\": \"default\"",
                   "\"vision_feature_select_strategy\": \"full\"");
  ASSERT_FALSE(full);
  EXPECT_NE(full.error().message.find("without CLS"), std::string::npos) << full.error().message;
}

TEST(LlavaVideo, PoolingMatchesLlavaNextVideoPooler) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llava_model::load(dir, *ctx);
  ASSERT_TRUE(m) << m.error().message;
  ASSERT_TRUE((*m)->has_video());
  const auto features = floats("vision_features");
  auto pooled = (*m)->pool_frames(*ctx, on(*ctx, features, {4 * 64, 128}));
  ASSERT_TRUE(pooled) << pooled.error().message;
  ASSERT_EQ(pooled->dim(0), 4 * 16);
  const double avg = relative_error(host(*pooled), floats("pooled"));
  // The max pool, from the same folder with spatial_pool_mode "max".
  auto cfg = load_llava_config(dir + "/config.json");
  ASSERT_TRUE(cfg);
  cfg->video->pool = video_pool::max;
  auto src = weight_source::open(dir);
  ASSERT_TRUE(src);
  auto mx = llava_model::build(**src, *cfg, *ctx, {});
  ASSERT_TRUE(mx) << mx.error().message;
  auto maxed = (*mx)->pool_frames(*ctx, on(*ctx, features, {4 * 64, 128}));
  ASSERT_TRUE(maxed);
  const double max = relative_error(host(*maxed), floats("pooled_max"));
  std::printf("video pooling against LlavaNextVideoPooler: average %.2e, max %.2e x range\n", avg,
              max);
  EXPECT_LT(avg, 1e-6);
  EXPECT_LT(max, 1e-6);
  // Not a copy of its input: the pools differ.
  EXPECT_GT(relative_error(host(*pooled), floats("pooled_max")), 1e-2);
}

TEST(LlavaVideo, FrameRowsAndLogitsMatchTransformers) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llava_model::load(dir, *ctx);
  ASSERT_TRUE(m) << m.error().message;
  const auto px = floats("pixel_values");
  const auto pixels = on(*ctx, px, {4, 3, 64, 64});
  auto rows = (*m)->encode_frames(*ctx, pixels);
  ASSERT_TRUE(rows) << rows.error().message;
  ASSERT_EQ(rows->dim(0), 4 * 17);
  const auto got = host(*rows);
  const double e = relative_error(got, floats("video_features"));
  // Each frame's rows do not depend on the other frames: frame 2 alone.
  auto one = (*m)->encode_frames(
      *ctx, on(*ctx, std::vector<float>(px.begin() + 2 * 3 * 64 * 64, px.begin() + 3 * 3 * 64 * 64),
               {1, 3, 64, 64}));
  ASSERT_TRUE(one);
  const auto alone = host(*one);
  EXPECT_TRUE(std::equal(alone.begin(), alone.end(), got.begin() + 2 * 17 * 128));
  // The prompt: one <video> -> 4 x 17 rows, and the decoder's logits.
  const auto ids64 = ref().at("prompt.ids").as<std::int64_t>();
  const std::vector<std::int32_t> ids(ids64.begin(), ids64.end());
  auto p = (*m)->prepare(*ctx, ids, k::tensor{}, {}, std::vector<k::tensor>{pixels});
  ASSERT_TRUE(p) << p.error().message;
  const auto expanded = ref().at("prompt.expanded").as<std::int64_t>();
  EXPECT_EQ(p->tokens, std::vector<std::int32_t>(expanded.begin(), expanded.end()));
  const double l = relative_error(logits_of(*ctx, **m, *p), floats("prompt.logits"));
  std::printf("video rows (4 frames x 17) %.2e x range; logits over %zu positions %.2e x range\n",
              e, p->tokens.size(), l);
  EXPECT_LT(e, 1e-4);
  EXPECT_LT(l, 1e-4);
  // Placeholders must match the videos.
  auto two = (*m)->prepare(*ctx, ids, k::tensor{}, {}, std::vector<k::tensor>{pixels, pixels});
  ASSERT_FALSE(two);
  EXPECT_NE(two.error().message.find("1 video token(s)"), std::string::npos) << two.error().message;
}

TEST(LlavaVideo, FramesDecodedHereAreThoseOfPyAV) {
  // square.mp4 sampled to 4 frames as vLLM does, preprocessed as images:
  // the pixel values transformers was given, from this project's decoder.
  std::ifstream f(clip, std::ios::binary);
  const std::vector<std::uint8_t> bytes{std::istreambuf_iterator<char>(f), {}};
  video_sampling s;
  s.num_frames = 4;
  auto v = decode_video(bytes, s);
  ASSERT_TRUE(v) << v.error().message;
  const auto idx = ref().at("frame_index").as<std::int64_t>();
  EXPECT_EQ(v->index, idx);
  auto probed = probe_video(bytes, s);
  ASSERT_TRUE(probed) << probed.error().message;
  EXPECT_EQ(probed->index, idx);
  EXPECT_TRUE(probed->frames.empty());
  auto pc = load_image_processor_config(dir);
  ASSERT_TRUE(pc);
  std::vector<float> px;
  for (const auto& img : v->frames) {
    auto p = preprocess_image(img, *pc);
    ASSERT_TRUE(p);
    px.insert(px.end(), p->data.begin(), p->data.end());
  }
  const auto want = floats("pixel_values");
  ASSERT_EQ(px.size(), want.size());
  double worst = 0;
  for (std::size_t i = 0; i < px.size(); ++i)
    worst = std::max(worst, static_cast<double>(std::fabs(px[i] - want[i])));
  std::printf("frames decoded here against PyAV's, preprocessed: max |diff| %.3g\n", worst);
  // The same H.264 decode; the YUV -> RGB conversions may round apart by a
  // few levels (a level is 1 / 255 / std, about 0.016 here).
  EXPECT_LT(worst, 0.1);
}
