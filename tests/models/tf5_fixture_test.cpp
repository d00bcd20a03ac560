// Checkpoints saved by transformers 5 (tools/make_tf5_fixtures.py): their
// config holds `rope_parameters` instead of `rope_theta` / `rope_scaling`.
// troupe's f32 logits against transformers' (float64), within 1e-4 of the
// logit range; a reader that ignored rope_parameters (theta 10000, no
// scaling) misses by orders of magnitude more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "../kernels/fixture_reader.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"
#include "models/llama.hpp"
#include "models/llama_config.hpp"
#include "models/llava.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

std::string dir(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/tf5/" + name;
}

class Tf5 : public ::testing::TestWithParam<std::string> {};

TEST_P(Tf5, ConfigReadsRopeParameters) {
  auto c = load_llama_config(dir(GetParam()) + "/config.json");
  ASSERT_TRUE(c) << c.error().message;
  if (GetParam() == "theta") {
    EXPECT_EQ(c->rope_theta, 20000.0);
    EXPECT_EQ(c->scaling.type, rope_scaling::kind::none);
  } else {
    EXPECT_EQ(c->rope_theta, 500000.0);
    EXPECT_EQ(c->scaling.type, rope_scaling::kind::llama3);
    EXPECT_EQ(c->scaling.factor, 8.0);
    EXPECT_EQ(c->scaling.original_max_position_embeddings, 16);
  }
}

TEST_P(Tf5, LogitsMatchTransformers) {
  const auto ref = test::load_fixture(dir(GetParam()) + "/reference.bin");
  auto dev = k::cpu::cpu_device::with_threads(2);
  quant_plan plan;
  plan.default_format = k::weight_format::f32;
  auto m = llama_model::load(dir(GetParam()), *dev, plan);
  ASSERT_TRUE(m) << m.error().message;
  for (int i = 0; i < 2; ++i) {
    const auto t64 = ref.at("tokens." + std::to_string(i)).as<std::int64_t>();
    const std::vector<std::int32_t> toks(t64.begin(), t64.end());
    const auto& la = ref.at("logits." + std::to_string(i));
    const auto want = la.as<float>();
    const std::int64_t V = la.dims[1];
    auto cache =
        (*m)->make_cache(dev->memory(), kv_options{.block_size = 16, .capacity_tokens = 64});
    ASSERT_TRUE(cache);
    const auto s = cache->add_sequence();
    auto got = (*m)->forward(*dev, *cache, std::vector<step_input>{{s, toks, true}});
    ASSERT_TRUE(got) << got.error().message;
    ASSERT_EQ(static_cast<std::size_t>(got->numel()), want.size());
    double worst = 0;
    for (std::size_t p = 0; p < toks.size(); ++p) {
      const float* w = want.data() + p * V;
      const float* g = got->data_as<float>() + p * V;
      const auto [lo, hi] = std::minmax_element(w, w + V);
      double err = 0;
      for (std::int64_t v = 0; v < V; ++v) err = std::max(err, std::fabs(double(g[v]) - w[v]));
      worst = std::max(worst, err / (double(*hi) - double(*lo)));
    }
    std::printf("%s seq %d (%zu tokens): max |diff| %.2e of the logit range\n", GetParam().c_str(),
                i, toks.size(), worst);
    EXPECT_LE(worst, 1e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, Tf5, ::testing::Values("theta", "llama3"));

double worst_relative(const float* got, const std::vector<float>& want, std::int64_t cols) {
  double worst = 0;
  for (std::size_t r = 0; r * cols < want.size(); ++r) {
    const float* w = want.data() + r * cols;
    const float* g = got + r * cols;
    const auto [lo, hi] = std::minmax_element(w, w + cols);
    double err = 0;
    for (std::int64_t v = 0; v < cols; ++v) err = std::max(err, std::fabs(double(g[v]) - w[v]));
    worst = std::max(worst, err / (double(*hi) - double(*lo)));
  }
  return worst;
}

// The reference's pixel_values through `m`: worst image-feature and logit
// errors (relative to each row's range) against transformers', and the
// expanded prompt checked against the one transformers was fed.
void features_and_logits(const llava_model& m, k::device& dev,
                         const std::map<std::string, test::fixture_array>& ref, double& ef,
                         double& el) {
  const auto& px = ref.at("pixel_values");
  auto pixels = k::tensor::empty(dev.memory(), k::dtype::f32,
                                 {px.dims[0], px.dims[1], px.dims[2], px.dims[3]});
  ASSERT_TRUE(pixels);
  const auto pv = px.as<float>();
  std::copy(pv.begin(), pv.end(), pixels->data_as<float>());
  auto feats = m.encode_images(dev, *pixels);
  ASSERT_TRUE(feats) << feats.error().message;
  const auto want_feats = ref.at("image_features").as<float>();
  ASSERT_EQ(static_cast<std::size_t>(feats->numel()), want_feats.size());
  ef = worst_relative(feats->data_as<float>(), want_feats, feats->dim(1));
  const auto i64 = ref.at("ids").as<std::int64_t>();
  const std::vector<std::int32_t> ids(i64.begin(), i64.end());
  auto prompt = m.prepare(dev, ids, *pixels);
  ASSERT_TRUE(prompt) << prompt.error().message;
  const auto e64 = ref.at("expanded").as<std::int64_t>();
  EXPECT_EQ(prompt->tokens, std::vector<std::int32_t>(e64.begin(), e64.end()));
  const auto& lm = m.language_model();
  auto cache = lm.make_cache(dev.memory(), kv_options{.block_size = 16, .capacity_tokens = 64});
  ASSERT_TRUE(cache);
  step_input in{cache->add_sequence(), prompt->tokens, true};
  in.embed_token = prompt->image_token;
  in.embeddings = prompt->image_embeds;
  auto logits = lm.forward(dev, *cache, std::vector<step_input>{in});
  ASSERT_TRUE(logits) << logits.error().message;
  const auto& la = ref.at("logits");
  el = worst_relative(logits->data_as<float>(), la.as<float>(), la.dims[1]);
}

// transformers 5 saves LLaVA's CLIP tower without its "vision_model." level
// (vision_tower.embeddings.*) and its decoder as language_model.model.*.
TEST(Tf5Llava, LoadsAndMatchesTransformers) {
  const auto ref = test::load_fixture(dir("llava") + "/reference.bin");
  auto dev = k::cpu::cpu_device::with_threads(2);
  auto m = llava_model::load(dir("llava"), *dev);
  ASSERT_TRUE(m) << m.error().message;
  double ef = 1, el = 1;
  features_and_logits(**m, *dev, ref, ef, el);
  std::printf("LLaVA (transformers 5 names): image features %.2e, logits %.2e of the range\n", ef,
              el);
  EXPECT_LE(ef, 1e-4);
  EXPECT_LE(el, 1e-4);
}

// LLaVA-Interleave's layout (llava-hf/llava-interleave-qwen-*-hf): a SigLIP
// tower (no class token, a biased patch convolution that drops the pixels
// past the last whole patch, no pre-LayerNorm), the LLaVA projector over
// every row of the last layer, and a Qwen2 decoder; the image through the
// SiglipImageProcessor config saved beside it.
TEST(Tf5Llava, SiglipQwen2LoadsAndMatchesTransformers) {
  const auto ref = test::load_fixture(dir("llava_siglip") + "/reference.bin");
  auto dev = k::cpu::cpu_device::with_threads(2);
  auto m = llava_model::load(dir("llava_siglip"), *dev);
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_TRUE((*m)->config().vision.siglip);
  EXPECT_EQ((*m)->config().text.family, decoder_family::qwen2);
  EXPECT_EQ((*m)->config().tokens_per_image(), 4);
  // The processor: image.png -> pixel_values, as transformers' (PIL) gives them.
  auto proc = load_image_processor_config(dir("llava_siglip"));
  ASSERT_TRUE(proc) << proc.error().message;
  EXPECT_FALSE(proc->do_center_crop);
  auto img = load_image(dir("llava_siglip") + "/image.png");
  ASSERT_TRUE(img) << img.error().message;
  auto pv = preprocess_image(*img, *proc);
  ASSERT_TRUE(pv) << pv.error().message;
  const auto& px = ref.at("pixel_values");
  const auto want_px = px.as<float>();
  ASSERT_EQ(pv->data.size(), want_px.size());
  float px_err = 0;
  for (std::size_t i = 0; i < want_px.size(); ++i)
    px_err = std::max(px_err, std::fabs(pv->data[i] - want_px[i]));
  EXPECT_LE(px_err, 1e-6f);

  double ef = 1, el = 1;
  features_and_logits(**m, *dev, ref, ef, el);
  std::printf("LLaVA SigLIP + Qwen2: pixels %.2e, image features %.2e, logits %.2e of the range\n",
              px_err, ef, el);
  EXPECT_LE(ef, 1e-4);
  EXPECT_LE(el, 1e-4);
}

}  // namespace
