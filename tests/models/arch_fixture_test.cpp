// The decoder families besides LLaMA, on random-weight checkpoints saved by
// transformers 5 (tools/make_arch_fixtures.py): Qwen2 (q/k/v biases), Mistral
// (a window on every layer), Phi-3 (fused projections), Gemma 2 (soft-capping,
// a window on every other layer, sandwich norms), Gemma 3 text (query-key
// norms, per-layer-type RoPE, query_pre_attn_scalar). troupe's f32 logits
// against transformers' (float64), from the safetensors folder and, where
// llama.cpp has the architecture, from an f32 GGUF in llama.cpp's layout
// (whose logits llama.cpp itself also gives, in llamacpp.bin).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../kernels/fixture_reader.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/llama.hpp"
#include "models/llama_config.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

std::string dir(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/arch/" + name;
}

bool has_gguf(const std::string& name) {
  return name == "qwen2" || name == "phi3" || name == "gemma2" || name == "qwen2_yarn" ||
         name == "phi3_longrope";
}

// Worst over positions of max |got - want| / (the position's logit range).
double worst_error(const float* got, const float* want, std::size_t positions, std::int64_t V) {
  double worst = 0;
  for (std::size_t p = 0; p < positions; ++p) {
    const float* w = want + p * V;
    const float* g = got + p * V;
    const auto [lo, hi] = std::minmax_element(w, w + V);
    double err = 0;
    for (std::int64_t v = 0; v < V; ++v) err = std::max(err, std::fabs(double(g[v]) - w[v]));
    worst = std::max(worst, err / (double(*hi) - double(*lo)));
  }
  return worst;
}

std::vector<float> run_all(const llama_model& m, k::device& dev,
                           const std::vector<std::int32_t>& toks) {
  auto cache = m.make_cache(dev.memory(), kv_options{.block_size = 16, .capacity_tokens = 64});
  EXPECT_TRUE(cache);
  if (!cache) return {};
  const auto s = cache->add_sequence();
  auto got = m.forward(dev, *cache, std::vector<step_input>{{s, toks, true}});
  EXPECT_TRUE(got) << (got ? "" : got.error().message);
  if (!got) return {};
  return {got->data_as<float>(), got->data_as<float>() + got->numel()};
}

class Arch : public ::testing::TestWithParam<std::string> {
 protected:
  void check_source(const std::string& path, const std::string& label) {
    const auto ref = test::load_fixture(dir(GetParam()) + "/reference.bin");
    auto dev = k::cpu::cpu_device::with_threads(2);
    quant_plan plan;
    plan.default_format = k::weight_format::f32;
    auto m = llama_model::load(path, *dev, plan);
    ASSERT_TRUE(m) << m.error().message;
    for (int i = 0; i < 2; ++i) {
      const auto t64 = ref.at("tokens." + std::to_string(i)).as<std::int64_t>();
      const std::vector<std::int32_t> toks(t64.begin(), t64.end());
      const auto& la = ref.at("logits." + std::to_string(i));
      const auto want = la.as<float>();
      const auto got = run_all(**m, *dev, toks);
      ASSERT_EQ(got.size(), want.size());
      const double err = worst_error(got.data(), want.data(), toks.size(), la.dims[1]);
      std::printf("%s %s seq %d (%zu tokens): max |diff| %.2e of the logit range\n",
                  GetParam().c_str(), label.c_str(), i, toks.size(), err);
      EXPECT_LE(err, 1e-4) << label;
    }
  }
};

TEST_P(Arch, ConfigNamesTheFamily) {
  auto c = load_llama_config(dir(GetParam()) + "/config.json");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(std::string(to_string(c->family)), GetParam().substr(0, GetParam().find('_')));
  if (GetParam() == "qwen2") {
    EXPECT_TRUE(c->qkv_bias);
    EXPECT_EQ(c->sliding_window, 0);  // layer_types all "full_attention"
    EXPECT_EQ(c->rope_theta, 1e6);
  } else if (GetParam() == "qwen2_yarn") {
    EXPECT_EQ(c->scaling.type, rope_scaling::kind::yarn);
    EXPECT_EQ(c->scaling.factor, 4.0);
    EXPECT_EQ(c->scaling.original_max_position_embeddings, 64);
  } else if (GetParam() == "phi3_longrope") {
    EXPECT_EQ(c->scaling.type, rope_scaling::kind::longrope);
    EXPECT_EQ(c->scaling.short_factor.size(), 12u);
    EXPECT_EQ(c->max_position_embeddings, 512);  // the original context
    EXPECT_NEAR(c->scaling.attention_factor, std::sqrt(1 + std::log(8.0) / std::log(512.0)), 1e-12);
  } else if (GetParam() == "mistral") {
    EXPECT_EQ(c->sliding_window, 16);
    EXPECT_TRUE(c->is_sliding(0) && c->is_sliding(1));
  } else if (GetParam() == "phi3") {
    EXPECT_TRUE(c->fused_qkv);
    EXPECT_EQ(c->sliding_window, 0);
  } else if (GetParam() == "gemma2") {
    EXPECT_EQ(c->attn_softcap, 2.0);
    EXPECT_EQ(c->final_softcap, 3.0);
    EXPECT_TRUE(c->is_sliding(0) && !c->is_sliding(1) && c->is_sliding(2) && !c->is_sliding(3));
    EXPECT_EQ(c->norm_offset, 1.0);
  } else if (GetParam() == "gemma3") {
    EXPECT_EQ(c->rope_theta, 1e6);
    EXPECT_EQ(c->rope_local_theta, 1e4);
    EXPECT_DOUBLE_EQ(c->attn_scale, 1.0 / std::sqrt(48.0));
    for (int l = 0; l < 6; ++l) EXPECT_EQ(c->is_sliding(l), l != 5) << l;
  }
}

TEST_P(Arch, SafetensorsLogitsMatchTransformers) {
  check_source(dir(GetParam()), "safetensors");
}

TEST_P(Arch, GgufLogitsMatchTransformers) {
  if (!has_gguf(GetParam()))         // llama.cpp writes Mistral as "llama" (and drops the
    GTEST_SKIP() << "no GGUF here";  // window); Gemma 3 GGUF: gguf_quant_fixture_test
  check_source(dir(GetParam()) + "/model.gguf", "gguf");
  // llama.cpp on the same file (a check of the file's layout, printed).
  const auto ref = test::load_fixture(dir(GetParam()) + "/reference.bin");
  const auto cpp = test::load_fixture(dir(GetParam()) + "/llamacpp.bin");
  for (int i = 0; i < 2; ++i) {
    const auto& want = ref.at("logits." + std::to_string(i));
    const auto got = cpp.at("logits." + std::to_string(i)).as<float>();
    const auto w = want.as<float>();
    const double err =
        worst_error(got.data(), w.data(), static_cast<std::size_t>(want.dims[0]), want.dims[1]);
    std::printf("%s llama.cpp seq %d: max |diff| %.2e of the logit range\n", GetParam().c_str(), i,
                err);
    EXPECT_LE(err, 1e-3);
  }
}

// Decoding one token at a time through the paged cache (windows crossing
// block boundaries) gives the bits of the one-shot prefill.
TEST_P(Arch, DecodeStepsEqualPrefill) {
  const auto ref = test::load_fixture(dir(GetParam()) + "/reference.bin");
  const auto t64 = ref.at("tokens.1").as<std::int64_t>();
  const std::vector<std::int32_t> toks(t64.begin(), t64.end());
  auto dev = k::cpu::cpu_device::with_threads(2);
  quant_plan plan;
  plan.default_format = k::weight_format::f32;
  auto m = llama_model::load(dir(GetParam()), *dev, plan);
  ASSERT_TRUE(m) << m.error().message;
  const auto whole = run_all(**m, *dev, toks);
  const std::int64_t V = (*m)->config().vocab_size;
  auto cache = (*m)->make_cache(dev->memory(), kv_options{.block_size = 16, .capacity_tokens = 64});
  ASSERT_TRUE(cache);
  const auto s = cache->add_sequence();
  const std::size_t first = 5;
  auto pre = (*m)->forward(
      *dev, *cache,
      std::vector<step_input>{{s, std::span<const std::int32_t>(toks.data(), first), true}});
  ASSERT_TRUE(pre) << pre.error().message;
  for (std::size_t p = 0; p < first; ++p)
    ASSERT_EQ(0, std::memcmp(pre->data_as<float>() + p * V, whole.data() + p * V, V * 4)) << p;
  for (std::size_t p = first; p < toks.size(); ++p) {
    auto one = (*m)->forward(
        *dev, *cache, std::vector<step_input>{{s, std::span<const std::int32_t>(&toks[p], 1)}});
    ASSERT_TRUE(one) << one.error().message;
    ASSERT_EQ(0, std::memcmp(one->data_as<float>(), whole.data() + p * V, V * 4)) << "token " << p;
  }
}

// longrope runs within the original context only (transformers re-rotates
// every position with the long factors past it): position 512 is refused,
// with the reason, and the cache keeps what it had.
TEST(ArchLongrope, PastTheOriginalContextIsRefused) {
  auto dev = k::cpu::cpu_device::with_threads(2);
  quant_plan plan;
  plan.default_format = k::weight_format::f32;
  auto m = llama_model::load(dir("phi3_longrope"), *dev, plan);
  ASSERT_TRUE(m) << m.error().message;
  auto cache =
      (*m)->make_cache(dev->memory(), kv_options{.block_size = 16, .capacity_tokens = 600});
  ASSERT_TRUE(cache);
  const auto s = cache->add_sequence();
  std::vector<std::int32_t> toks(512);
  for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<std::int32_t>(3 + i % 290);
  auto full = (*m)->forward(*dev, *cache, std::vector<step_input>{{s, toks}});
  ASSERT_TRUE(full) << full.error().message;  // positions 0..511: the original context
  const std::int32_t one = 7;
  auto past = (*m)->forward(*dev, *cache,
                            std::vector<step_input>{{s, std::span<const std::int32_t>(&one, 1)}});
  ASSERT_FALSE(past);
  EXPECT_NE(past.error().message.find("original context of 512"), std::string::npos)
      << past.error().message;
  EXPECT_EQ(cache->length(s), 512);
}

INSTANTIATE_TEST_SUITE_P(Families, Arch,
                         ::testing::Values("qwen2", "mistral", "phi3", "gemma2", "gemma3",
                                           "qwen2_yarn", "phi3_longrope"),
                         [](const auto& info) { return info.param; });

}  // namespace
