// Fidelity of the Whisper audio encoder and the audio projector against
// transformers (tools/make_whisper_fixtures.py: a random, odd-shaped
// WhisperForConditionalGeneration, references in float64), and their
// refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_device.hpp"
#include "models/safetensors.hpp"
#include "models/whisper.hpp"
#include "tests/models/logit_agreement.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::test::relative_error;
namespace k = troupe::kernels;

namespace {

const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/whisper";

// Issue 29's target: within 1e-4 of the range of transformers' outputs.
constexpr double tolerance = 1e-4;

struct arrays {
  safetensors_model file;
  std::vector<float> get(const std::string& name,
                         std::vector<std::int64_t>* shape = nullptr) const {
    const auto* t = file.find(name);
    if (!t) {
      ADD_FAILURE() << "no " << name;
      return {};
    }
    auto v = file.view(*t);
    EXPECT_TRUE(v);
    if (!v) return {};
    if (shape) {
      shape->clear();
      for (int i = 0; i < t->shape.ndim; ++i) shape->push_back(t->shape[i]);
    }
    return {v->data_as<float>(), v->data_as<float>() + t->shape.numel()};
  }
};

arrays open_arrays(const std::string& path) {
  auto m = safetensors_model::open(path);
  if (!m) {
    ADD_FAILURE() << m.error().message;
    return {};
  }
  return {std::move(*m)};
}

k::tensor input(k::device& dev, const std::vector<float>& v, const std::vector<std::int64_t>& s) {
  auto t = k::tensor::empty(dev.memory(), k::dtype::f32, {s[0], s[1], s[2]});
  EXPECT_TRUE(t);
  std::copy(v.begin(), v.end(), t->data_as<float>());
  return *t;
}

std::vector<float> values(const k::tensor& t) {
  return {t.data_as<float>(), t.data_as<float>() + t.numel()};
}

std::unique_ptr<whisper_encoder> load(k::device& dev) {
  auto cfg = load_whisper_encoder_config(dir + "/odd/config.json");
  EXPECT_TRUE(cfg) << cfg.error().message;
  if (!cfg) return nullptr;
  auto src = weight_source::open(dir + "/odd");
  EXPECT_TRUE(src) << src.error().message;
  if (!src) return nullptr;
  auto enc = whisper_encoder::build(**src, *cfg, dev, {});
  EXPECT_TRUE(enc) << enc.error().message;
  return enc ? std::move(*enc) : nullptr;
}

}  // namespace

TEST(WhisperConfig, ReadsTheEncoderHalf) {
  auto c = load_whisper_encoder_config(dir + "/odd/config.json");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->d_model, 60);
  EXPECT_EQ(c->encoder_layers, 2);
  EXPECT_EQ(c->encoder_attention_heads, 3);
  EXPECT_EQ(c->head_dim(), 20);
  EXPECT_EQ(c->encoder_ffn_dim, 88);
  EXPECT_EQ(c->num_mel_bins, 80);
  EXPECT_EQ(c->max_frames(), 48);
  EXPECT_EQ(c->activation, k::gelu_kind::erf);
  // Nested under audio_config (Ultravox, troupe's audio models).
  auto nested = parse_whisper_encoder_config(
      R"({"audio_config": {"model_type": "whisper", "d_model": 64, "encoder_attention_heads": 4}})",
      "x");
  ASSERT_TRUE(nested) << nested.error().message;
  EXPECT_EQ(nested->d_model, 64);
  auto refused = [](const char* json, const std::string& needle) {
    auto r = parse_whisper_encoder_config(json, "cfg");
    EXPECT_FALSE(r) << json;
    if (!r) {
      EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
    }
  };
  refused(R"({"scale_embedding": true})", "scale_embedding");
  refused(R"({"model_type": "qwen2_audio_encoder"})", "model_type");
  refused(R"({"d_model": 60, "encoder_attention_heads": 7})", "does not divide");
  refused(R"({"activation_function": "relu"})", "activation_function");
  refused(R"({"d_model": "60"})", "must be an integer");
  refused(R"({"num_mel_bins": 0})", "num_mel_bins");
}

TEST(WhisperEncoder, MatchesTransformersOnAWholeWindow) {
  auto dev = k::cpu::cpu_device::with_threads(2);
  auto enc = load(*dev);
  ASSERT_TRUE(enc);
  const auto ref = open_arrays(dir + "/odd/reference.safetensors");
  std::vector<std::int64_t> shape;
  const auto feats = ref.get("features", &shape);
  ASSERT_EQ(shape, (std::vector<std::int64_t>{2, 80, 48}));
  auto out = enc->forward(*dev, input(*dev, feats, shape));
  ASSERT_TRUE(out) << out.error().message;
  ASSERT_EQ(out->shape().to_string(), "[2, 24, 60]");
  const double e = relative_error(values(*out), ref.get("encoder"));
  std::printf("Whisper encoder, 2 x 48 frames: %.2e x range (f32 vs transformers float64)\n", e);
  EXPECT_LT(e, tolerance);
  // Each clip alone gives the bits it gave in the batch.
  const std::vector<float> second(feats.begin() + 80 * 48, feats.end());
  auto alone = enc->forward(*dev, input(*dev, second, {1, 80, 48}));
  ASSERT_TRUE(alone) << alone.error().message;
  const auto all = values(*out);
  EXPECT_EQ(values(*alone), std::vector<float>(all.begin() + 24 * 60, all.end()));
}

TEST(WhisperEncoder, ShorterInputUsesTheFirstPositions) {
  auto dev = k::cpu::cpu_device::with_threads(1);
  auto enc = load(*dev);
  ASSERT_TRUE(enc);
  const auto ref = open_arrays(dir + "/odd/reference.safetensors");
  std::vector<std::int64_t> shape;
  const auto feats = ref.get("short_features", &shape);
  ASSERT_EQ(shape, (std::vector<std::int64_t>{1, 80, 21}));
  auto out = enc->forward(*dev, input(*dev, feats, shape));
  ASSERT_TRUE(out) << out.error().message;
  ASSERT_EQ(out->shape().to_string(), "[1, 11, 60]");
  const double e = relative_error(values(*out), ref.get("short_encoder"));
  std::printf("Whisper encoder, 21 frames: %.2e x range\n", e);
  EXPECT_LT(e, tolerance);
}

TEST(WhisperEncoder, RefusesWhatItCannotTake) {
  auto dev = k::cpu::cpu_device::with_threads(1);
  auto enc = load(*dev);
  ASSERT_TRUE(enc);
  std::vector<float> v(80 * 49, 0.5f);
  auto too_long = enc->forward(*dev, input(*dev, v, {1, 80, 49}));
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.error().message.find("1..48"), std::string::npos) << too_long.error().message;
  std::vector<float> w(64 * 10, 0.5f);
  EXPECT_FALSE(enc->forward(*dev, input(*dev, w, {1, 64, 10})));
  std::vector<float> nan(80 * 10, 0.5f);
  nan[123] = std::nanf("");
  auto bad = enc->forward(*dev, input(*dev, nan, {1, 80, 10}));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("element 123"), std::string::npos) << bad.error().message;
  // A checkpoint missing a tensor names it.
  whisper_encoder_config more;
  more.d_model = 60;
  more.encoder_attention_heads = 3;
  more.encoder_ffn_dim = 88;
  more.max_source_positions = 24;
  more.encoder_layers = 3;
  auto src = weight_source::open(dir + "/odd");
  ASSERT_TRUE(src);
  auto missing = whisper_encoder::build(**src, more, *dev, {});
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("model.encoder.layers.2."), std::string::npos)
      << missing.error().message;
}

TEST(AudioProjector, StacksFramesThenMatchesTorch) {
  auto dev = k::cpu::cpu_device::with_threads(2);
  auto src = weight_source::open(dir + "/projector");
  ASSERT_TRUE(src) << src.error().message;
  audio_projector_config cfg;
  cfg.stack = 3;
  cfg.hidden = 44;
  cfg.out = 36;
  auto p = audio_projector::build(**src, cfg, 60, *dev, {});
  ASSERT_TRUE(p) << p.error().message;
  const auto ref = open_arrays(dir + "/projector/reference.safetensors");
  std::vector<std::int64_t> shape;
  const auto rows = ref.get("rows", &shape);
  ASSERT_EQ(shape, (std::vector<std::int64_t>{1, 11, 60}));
  auto out = (*p)->forward(*dev, input(*dev, rows, shape));
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ(out->shape().to_string(), "[1, 4, 36]");
  EXPECT_EQ(cfg.tokens_for(11), 4);
  const double e = relative_error(values(*out), ref.get("out"));
  std::printf("audio projector: %.2e x range\n", e);
  EXPECT_LT(e, tolerance);
  // Rows of another width are refused; so is a stack the weights do not fit.
  std::vector<float> narrow(11 * 59, 0.1f);
  EXPECT_FALSE((*p)->forward(*dev, input(*dev, narrow, {1, 11, 59})));
  cfg.stack = 4;
  EXPECT_FALSE(audio_projector::build(**src, cfg, 60, *dev, {}));
}
