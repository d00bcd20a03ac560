// LLaVA input checking (run under ASan+UBSan): bad configs, missing or
// misshaped tensors, image-token / image count mismatches, bad pixel_values
// and bad image embeddings all give clear errors. Checkpoints are copies of
// tests/fixtures/llava/full rewritten here (renamed, dropped or reshaped
// tensors, edited config.json).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../temp_path.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/generate.hpp"
#include "models/llava.hpp"
#include "models/safetensors.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string fixture_dir() {
  return std::string(TROUPE_FIXTURES_DIR) + "/llava/full";
}

json fixture_config() {
  std::ifstream in(fixture_dir() + "/config.json");
  return json::parse(in);
}

// One tensor to write: name, shape, f32 values.
struct entry {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

std::vector<entry> fixture_tensors() {
  auto m = safetensors_model::open(fixture_dir() + "/model.safetensors");
  EXPECT_TRUE(m);
  std::vector<entry> out;
  for (const auto& t : m->tensors()) {
    auto v = m->view(t);
    EXPECT_TRUE(v);
    entry e{t.name, {}, {}};
    for (int i = 0; i < t.shape.ndim; ++i) e.shape.push_back(t.shape[i]);
    e.data.assign(v->data_as<float>(), v->data_as<float>() + v->numel());
    out.push_back(std::move(e));
  }
  return out;
}

void write_safetensors(const std::string& path, const std::vector<entry>& tensors) {
  json header = json::object();
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    const std::uint64_t bytes = t.data.size() * sizeof(float);
    header[t.name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h += ' ';
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t n = h.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& t : tensors)
    out.write(reinterpret_cast<const char*>(t.data.data()),
              static_cast<std::streamsize>(t.data.size() * sizeof(float)));
}

// A checkpoint folder: the fixture's tensors after `edit`, and its config after `edit_config`.
std::string make_checkpoint(const std::string& name,
                            const std::function<void(std::vector<entry>&)>& edit,
                            const std::function<void(json&)>& edit_config = {}) {
  const std::string d = test::temp_path("llava-" + name);
  fs::create_directories(d);
  auto tensors = fixture_tensors();
  if (edit) edit(tensors);
  write_safetensors(d + "/model.safetensors", tensors);
  json cfg = fixture_config();
  if (edit_config) edit_config(cfg);
  std::ofstream(d + "/config.json") << cfg.dump(2);
  return d;
}

void drop(std::vector<entry>& t, const std::string& name) {
  std::erase_if(t, [&](const entry& e) { return e.name == name; });
}

entry& find(std::vector<entry>& t, const std::string& name) {
  for (auto& e : t)
    if (e.name == name) return e;
  throw std::runtime_error("no tensor " + name);  // tests only
}

// The load error for a checkpoint, "" if it loaded.
std::string load_error(const std::string& path, const quant_plan& plan = {}) {
  auto ctx = k::cpu::cpu_device::with_threads(1);
  auto m = llava_model::load(path, *ctx, plan);
  return m ? std::string() : m.error().message;
}

std::string config_error(const std::function<void(json&)>& edit) {
  json cfg = fixture_config();
  edit(cfg);
  auto c = parse_llava_config(cfg.dump(), "config.json");
  return c ? std::string() : c.error().message;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST(LlavaValidation, BadConfigsNameTheField) {
  struct bad {
    std::function<void(json&)> edit;
    const char* message;
  };
  const bad cases[] = {
      {[](json& c) { c.erase("vision_config"); }, "vision_config is missing"},
      {[](json& c) { c["vision_config"] = 3; }, "vision_config is missing or not an object"},
      {[](json& c) { c.erase("text_config"); }, "text_config is missing"},
      {[](json& c) { c["vision_config"]["patch_size"] = 7; },
       "patch_size = 7 does not divide image_size 32"},
      {[](json& c) { c["vision_config"]["num_attention_heads"] = 5; },
       "num_attention_heads = 5 does not divide hidden_size 32"},
      {[](json& c) { c["vision_config"]["hidden_size"] = "32"; }, "hidden_size must be an integer"},
      {[](json& c) { c["vision_config"]["image_size"] = 0; }, "image_size = 0 is outside"},
      {[](json& c) { c["vision_config"]["patch_size"] = -8; }, "patch_size = -8 is outside"},
      {[](json& c) { c["vision_config"]["num_hidden_layers"] = 0; },
       "num_hidden_layers = 0 is outside"},
      {[](json& c) { c["vision_config"]["layer_norm_eps"] = 0; },
       "layer_norm_eps must be in (0, 1)"},
      {[](json& c) { c["vision_config"]["hidden_act"] = "relu"; },
       "hidden_act 'relu' is not supported"},
      {[](json& c) { c["vision_config"]["model_type"] = "idefics3_vision"; },
       "'idefics3_vision' is not supported"},
      {[](json& c) {
         c["vision_config"]["image_size"] = 16384;
         c["vision_config"]["patch_size"] = 1;
       },
       "more than 2^20"},
      {[](json& c) { c["text_config"]["model_type"] = "gemma2"; },
       "model_type 'gemma2' is not supported"},
      {[](json& c) { c["text_config"]["num_key_value_heads"] = 3; },
       "text_config: num_key_value_heads must divide"},
      {[](json& c) { c["vision_feature_layer"] = 4; },
       "vision_feature_layer = 4 is outside [-4, 3]"},
      {[](json& c) { c["vision_feature_layer"] = -5; }, "vision_feature_layer = -5 is outside"},
      {[](json& c) {
         c["vision_feature_layer"] = json::array({-2, -1});
       },
       "as a list"},
      {[](json& c) { c["vision_feature_select_strategy"] = "cls"; },
       "'cls' is not one of default, full"},
      {[](json& c) { c["projector_hidden_act"] = "silu"; },
       "projector_hidden_act 'silu' is not supported"},
      {[](json& c) { c["image_token_index"] = 320; },
       "image_token_index = 320 is outside the text vocabulary [0, 320)"},
      {[](json& c) { c["image_token_index"] = -1; }, "image_token_index = -1 is outside"},
      {[](json& c) { c["multimodal_projector_bias"] = "yes"; },
       "multimodal_projector_bias must be a boolean"},
      {[](json& c) {
         c["architectures"] = json::array({"LlamaForCausalLM"});
         c["model_type"] = "llama";
       },
       "not a LLaVA config"},
  };
  for (const auto& b : cases) {
    const auto err = config_error(b.edit);
    EXPECT_TRUE(contains(err, b.message)) << "got: '" << err << "', expected: " << b.message;
  }
  EXPECT_FALSE(parse_llava_config("{not json", "x"));
  EXPECT_FALSE(parse_llava_config("[1, 2]", "x"));
  EXPECT_EQ(config_error([](json&) {}), "");
  EXPECT_TRUE(contains(load_error(test::temp_path("no-such-llava")), "no such file"));
}

TEST(LlavaValidation, MissingOrMisshapedTensorsNameTheTensor) {
  struct bad {
    const char* name;
    std::function<void(std::vector<entry>&)> edit;
    const char* message;
  };
  const std::string v = "vision_tower.vision_model.";
  const bad cases[] = {
      {"no-q", [&](auto& t) { drop(t, v + "encoder.layers.0.self_attn.q_proj.weight"); },
       "tensor 'vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight' is missing"},
      {"no-qbias", [&](auto& t) { drop(t, v + "encoder.layers.0.self_attn.q_proj.bias"); },
       "q_proj.bias' is missing"},
      {"no-pos", [&](auto& t) { drop(t, v + "embeddings.position_embedding.weight"); },
       "position_embedding.weight' is missing"},
      {"no-cls", [&](auto& t) { drop(t, v + "embeddings.class_embedding"); },
       "class_embedding' is missing"},
      {"no-prenorm", [&](auto& t) { drop(t, v + "pre_layrnorm.bias"); },
       "pre_layrnorm.bias' is missing"},
      {"no-proj", [&](auto& t) { drop(t, "multi_modal_projector.linear_2.weight"); },
       "linear_2.weight' is missing"},
      {"no-projbias", [&](auto& t) { drop(t, "multi_modal_projector.linear_1.bias"); },
       "linear_1.bias' is missing"},
      {"no-text", [&](auto& t) { drop(t, "language_model.model.layers.1.mlp.down_proj.weight"); },
       "down_proj.weight' is missing"},
      {"pos-shape",
       [&](auto& t) {
         auto& e = find(t, v + "embeddings.position_embedding.weight");
         e.shape[0] -= 1;
         e.data.resize(e.data.size() - 32);
       },
       "position_embedding.weight' has shape [16, 32], the config implies [17, 32]"},
      {"patch-shape",
       [&](auto& t) {
         auto& e = find(t, v + "embeddings.patch_embedding.weight");
         e.shape = {32, 3, 4, 16};
       },
       "patch_embedding.weight' has shape [32, 3, 4, 16]"},
      {"fc1-shape",
       [&](auto& t) {
         auto& e = find(t, v + "encoder.layers.0.mlp.fc1.weight");
         e.shape = {32, 64};
       },
       "fc1.weight' has shape [32, 64], the config implies [64, 32]"},
      {"bias-shape",
       [&](auto& t) {
         auto& e = find(t, "multi_modal_projector.linear_2.bias");
         e.shape = {2, 32};
       },
       "linear_2.bias' has shape [2, 32], the config implies [64]"},
      {"proj-shape",
       [&](auto& t) {
         auto& e = find(t, "multi_modal_projector.linear_1.weight");
         e.shape = {32, 64};
       },
       "linear_1.weight' has shape [32, 64], the config implies [64, 32]"},
  };
  for (const auto& b : cases) {
    const auto err = load_error(make_checkpoint(b.name, b.edit));
    EXPECT_TRUE(contains(err, b.message)) << b.name << ": got '" << err << "'";
  }
  // Layers past vision_feature_layer are never read: dropping them is fine.
  EXPECT_EQ(load_error(make_checkpoint("no-unused",
                                       [&](auto& t) {
                                         std::erase_if(t, [&](const entry& e) {
                                           return e.name.starts_with(v + "encoder.layers.2.");
                                         });
                                       })),
            "");
  // A q4_0 plan on the 32-wide vision tower works; on a width that is not a
  // multiple of 32 it is a clear error naming the tensor.
  quant_plan q4;
  q4.default_format = k::weight_format::q4_0;
  EXPECT_EQ(load_error(fixture_dir(), q4), "");
  const auto odd = std::string(TROUPE_FIXTURES_DIR) + "/llava/odd";
  EXPECT_TRUE(contains(load_error(odd, q4), "needs columns divisible by 32"))
      << load_error(odd, q4);
}

TEST(LlavaValidation, ProjectorWithoutBiasAndNewerTensorNames) {
  auto ctx = k::cpu::cpu_device::with_threads(1);
  auto ref = llava_model::load(fixture_dir(), *ctx);
  ASSERT_TRUE(ref);
  // transformers >= 4.52 names: model.{vision_tower,multi_modal_projector,language_model}.
  const auto renamed = make_checkpoint("renamed", [](std::vector<entry>& t) {
    for (auto& e : t) {
      if (e.name.starts_with("language_model.model."))
        e.name = "model.language_model." + e.name.substr(21);
      else if (e.name.starts_with("language_model."))
        e.name = e.name.substr(15);
      else
        e.name = "model." + e.name;
    }
  });
  auto m = llava_model::load(renamed, *ctx);
  ASSERT_TRUE(m) << m.error().message;
  std::vector<float> px(2 * 3 * 32 * 32);
  for (std::size_t i = 0; i < px.size(); ++i) px[i] = std::cos(0.1f * static_cast<float>(i));
  auto t = k::tensor::view(px.data(), k::dtype::f32, {2, 3, 32, 32});
  ASSERT_TRUE(t);
  auto a = (*ref)->encode_images(*ctx, *t), b = (*m)->encode_images(*ctx, *t);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->nbytes()));
  // multimodal_projector_bias false: the biases are not read; true needs them.
  const auto no_bias = make_checkpoint(
      "nobias",
      [](std::vector<entry>& t) {
        drop(t, "multi_modal_projector.linear_1.bias");
        drop(t, "multi_modal_projector.linear_2.bias");
      },
      [](json& c) { c["multimodal_projector_bias"] = false; });
  auto nb = llava_model::load(no_bias, *ctx);
  ASSERT_TRUE(nb) << nb.error().message;
  EXPECT_TRUE((*nb)->encode_images(*ctx, *t));
}

TEST(LlavaValidation, ImageCountsPixelValuesAndEmbeddingsAreChecked) {
  auto ctx = k::cpu::cpu_device::with_threads(1);
  auto loaded = llava_model::load(fixture_dir(), *ctx);
  ASSERT_TRUE(loaded);
  const auto& m = **loaded;
  const std::int32_t img = m.image_token();
  std::vector<float> buf(3 * 3 * 32 * 32, 0.25f);
  auto px = [&](k::shape_t s, k::dtype dt = k::dtype::f32) {
    auto t = k::tensor::view(buf.data(), dt, s);
    EXPECT_TRUE(t);
    return *t;
  };
  // image tokens vs images
  const std::vector<std::int32_t> one{1, img, 9}, two{1, img, 9, img};
  for (auto [ids, n] : {std::pair{&one, 2}, std::pair{&two, 1}, std::pair{&one, 3}}) {
    auto p = m.prepare(*ctx, *ids, px({n, 3, 32, 32}));
    ASSERT_FALSE(p);
    EXPECT_TRUE(contains(p.error().message, "image token(s)") &&
                contains(p.error().message, "image(s) were given"))
        << p.error().message;
  }
  auto no_images = m.prepare(*ctx, one, k::tensor());
  ASSERT_FALSE(no_images);
  EXPECT_TRUE(contains(no_images.error().message, "holds 1 image token(s)"))
      << no_images.error().message;
  EXPECT_TRUE(m.prepare(*ctx, std::vector<std::int32_t>{1, 5}, k::tensor()));
  EXPECT_FALSE(m.expand_image_tokens(two, 3));
  // pixel_values shape, dtype and values
  for (const auto& s :
       {k::shape_t{1, 3, 32, 31}, k::shape_t{1, 1, 32, 32}, k::shape_t{1, 3, 16, 16},
        k::shape_t{0, 3, 32, 32}, k::shape_t{3, 32, 32}, k::shape_t{1, 3 * 32 * 32}}) {
    auto r = m.encode_images(*ctx, px(s));
    ASSERT_FALSE(r) << s.to_string();
    EXPECT_TRUE(contains(r.error().message, "pixel_values must be")) << r.error().message;
  }
  EXPECT_FALSE(m.encode_images(*ctx, px({1, 3, 32, 32}, k::dtype::i32)));
  EXPECT_FALSE(m.prepare(*ctx, one, px({3, 32, 32})));
  buf[100] = std::numeric_limits<float>::quiet_NaN();
  auto nan = m.encode_images(*ctx, px({1, 3, 32, 32}));
  ASSERT_FALSE(nan);
  EXPECT_TRUE(contains(nan.error().message, "non-finite value at element 100"))
      << nan.error().message;
  buf[100] = 0.25f;
  // vision attention options the kernels cannot run
  clip_options window;
  window.attention.window = 4;  // with causal = false
  auto w = m.encode_images(*ctx, px({1, 3, 32, 32}), window);
  ASSERT_FALSE(w);
  EXPECT_TRUE(contains(w.error().message, "window needs causal")) << w.error().message;
  clip_options block;
  block.attention = {.causal = true, .window = 8, .top_k = 1};
  block.kv_block_size = 0;
  EXPECT_FALSE(m.encode_images(*ctx, px({1, 3, 32, 32}), block));
  // the projector's input width
  std::vector<float> feats(17 * 31);
  auto f = k::tensor::view(feats.data(), k::dtype::f32, {17, 31});
  ASSERT_TRUE(f);
  EXPECT_FALSE(m.project(*ctx, *f));
  // decoder input embeddings
  const auto& lm = m.language_model();
  const auto H = static_cast<std::size_t>(lm.config().hidden_size);
  std::vector<float> rows(2 * H, 0.5f);
  auto cache = lm.make_cache(ctx->memory(), kv_options{.block_size = 16, .capacity_tokens = 64});
  ASSERT_TRUE(cache);
  const seq_id s = cache->add_sequence();
  auto step = [&](std::int32_t token, std::span<const float> e) {
    step_input in{s, one, false};
    in.embed_token = token;
    in.embeddings = e;
    return lm.forward(*ctx, *cache, std::vector<step_input>{in});
  };
  auto count = step(img, rows);  // 1 image token, 2 rows
  ASSERT_FALSE(count);
  EXPECT_TRUE(contains(count.error().message, "1 embedding token(s)")) << count.error().message;
  EXPECT_FALSE(step(img, std::span(rows).first(H - 1)));
  EXPECT_FALSE(step(-1, std::span(rows).first(H)));
  EXPECT_FALSE(step(320, std::span(rows).first(H)));
  EXPECT_FALSE(step(-7, {}));
  EXPECT_EQ(cache->length(s), 0);  // nothing ran
  EXPECT_TRUE(step(img, std::span(rows).first(H)));
  // generation requests
  generation_request r;
  r.prompt = two;
  r.image_token = img;
  r.image_embeds.assign(H, 0.5f);  // 2 image tokens, 1 row
  r.params.max_tokens = 2;
  auto g = generate_batch(*ctx, lm, {r}, {[](std::int32_t) { return std::string(); }}, nullptr);
  ASSERT_FALSE(g);
  EXPECT_TRUE(contains(g.error().message, "holds 2 image token(s) but")) << g.error().message;
  r.image_token = -1;
  EXPECT_FALSE(
      generate_batch(*ctx, lm, {r}, {[](std::int32_t) { return std::string(); }}, nullptr));
  r.image_token = img;
  r.image_embeds.assign(2 * H, 0.5f);
  EXPECT_TRUE(generate_batch(*ctx, lm, {r}, {[](std::int32_t) { return std::string(); }}, nullptr));
}
