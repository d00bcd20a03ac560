// LLaVA pieces: config parsing and defaults, image-token expansion,
// component-aware quant plans and tensor names, the decoder's input
// embeddings, and the vision tower's optional windowed / sparse attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "../kernels/fixture_reader.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/llava.hpp"
#include "tests/remote_memory_device.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

std::string dir(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/llava/" + name;
}

// The layout older transformers (4.36) saved for llava-1.5-7b: nested
// configs hold only the fields that differ from the class defaults.
constexpr const char* sparse_llava15 = R"({
  "architectures": ["LlavaForConditionalGeneration"],
  "image_token_index": 32000,
  "model_type": "llava",
  "pad_token_id": 32001,
  "projector_hidden_act": "gelu",
  "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                  "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                  "torch_dtype": "float16", "vocab_size": 32064},
  "tie_word_embeddings": false,
  "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                    "model_type": "clip_vision_model", "num_attention_heads": 16,
                    "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                    "vocab_size": 32000},
  "vision_feature_layer": -2,
  "vision_feature_select_strategy": "default",
  "vocab_size": 32064
})";

k::tensor pixels(k::device& ctx, std::int64_t n, std::int64_t size, float seed) {
  auto t = k::tensor::empty(ctx.memory(), k::dtype::f32, {n, 3, size, size});
  EXPECT_TRUE(t);
  for (std::int64_t i = 0; i < t->numel(); ++i)
    t->data_as<float>()[i] = std::sin(seed + 0.37f * static_cast<float>(i));
  return *t;
}

std::vector<float> values(const k::tensor& t) {
  return {t.data_as<float>(), t.data_as<float>() + t.numel()};
}

}  // namespace

TEST(LlavaConfig, AbsentFieldsTakeTransformersDefaults) {
  auto c = parse_llava_config(sparse_llava15, "llava15");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->vision.hidden_size, 1024);
  EXPECT_EQ(c->vision.head_dim, 64);
  EXPECT_EQ(c->vision.num_channels, 3);                  // CLIPVisionConfig default
  EXPECT_EQ(c->vision.activation, k::gelu_kind::quick);  // quick_gelu default
  EXPECT_DOUBLE_EQ(c->vision.layer_norm_eps, 1e-5);
  EXPECT_EQ(c->vision.num_patches(), 576);
  EXPECT_EQ(c->tokens_per_image(), 576);
  EXPECT_EQ(c->vision_layers_used(), 23);  // -2 of 24 layers
  EXPECT_EQ(c->text.hidden_size, 4096);    // LlamaConfig defaults
  EXPECT_EQ(c->text.intermediate_size, 11008);
  EXPECT_EQ(c->text.num_layers, 32);
  EXPECT_EQ(c->text.num_kv_heads, 32);
  EXPECT_EQ(c->text.head_dim, 128);
  EXPECT_EQ(c->text.vocab_size, 32064);
  EXPECT_EQ(c->text.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->text.rms_norm_eps, 1e-5);
  EXPECT_EQ(c->text.bos_token_ids, std::vector<std::int64_t>{1});
  EXPECT_EQ(c->text.eos_token_ids, std::vector<std::int64_t>{2});
  EXPECT_EQ(c->image_token_index, 32000);
  EXPECT_EQ(c->projector_activation, k::gelu_kind::erf);
  EXPECT_EQ(c->select, vision_select::drop_cls);
  EXPECT_TRUE(c->projector_bias);
  EXPECT_TRUE(is_llava_config(sparse_llava15));
  EXPECT_FALSE(is_llava_config(R"({"architectures": ["LlamaForCausalLM"]})"));
}

TEST(LlavaConfig, FixtureConfigsAsTransformersSavedThem) {
  auto odd = load_llava_config(dir("odd") + "/config.json");
  auto full = load_llava_config(dir("full") + "/config.json");
  ASSERT_TRUE(odd) << odd.error().message;
  ASSERT_TRUE(full) << full.error().message;
  EXPECT_EQ(odd->vision.head_dim, 14);
  EXPECT_EQ(odd->vision_layers_used(), 2);  // -2 of 3
  EXPECT_EQ(odd->tokens_per_image(), 25);
  EXPECT_EQ(odd->text.num_kv_heads, 2);
  EXPECT_FALSE(odd->text.tie_word_embeddings);
  EXPECT_EQ(full->vision_layers_used(), 1);  // positive index 1 = after layer 0
  EXPECT_EQ(full->select, vision_select::full);
  EXPECT_EQ(full->tokens_per_image(), 17);
  EXPECT_EQ(full->vision.activation, k::gelu_kind::erf);
  EXPECT_DOUBLE_EQ(full->vision.layer_norm_eps, 1e-6);
  EXPECT_TRUE(full->text.tie_word_embeddings);
  EXPECT_EQ(full->image_token_index, 3);
}

TEST(LlavaConfig, FeatureLayerIndexAndActivations) {
  llava_config c;
  c.vision.num_layers = 4;
  for (auto [layer, used] : {std::pair{-1, 4}, std::pair{-2, 3}, std::pair{-5, 0}, std::pair{0, 0},
                             std::pair{4, 4}, std::pair{2, 2}}) {
    c.vision_feature_layer = layer;
    EXPECT_EQ(c.vision_layers_used(), used) << layer;
  }
  for (auto [name, kind] :
       {std::pair{"gelu", k::gelu_kind::erf}, std::pair{"gelu_python", k::gelu_kind::erf},
        std::pair{"gelu_new", k::gelu_kind::tanh},
        std::pair{"gelu_pytorch_tanh", k::gelu_kind::tanh},
        std::pair{"quick_gelu", k::gelu_kind::quick}}) {
    auto g = gelu_from_hf_name(name, "act");
    ASSERT_TRUE(g) << name;
    EXPECT_EQ(*g, kind) << name;
  }
  auto bad = gelu_from_hf_name("relu", "cfg: hidden_act");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("'relu' is not supported"), std::string::npos);
}

TEST(Llava, ExpandImageTokens) {
  const std::vector<std::int32_t> ids{1, 9, 5, 7, 5, 5, 8};
  auto e = expand_image_tokens(ids, 5, 3, 3);
  ASSERT_TRUE(e);
  EXPECT_EQ(*e, (std::vector<std::int32_t>{1, 9, 5, 5, 5, 7, 5, 5, 5, 5, 5, 5, 8}));
  auto none = expand_image_tokens(std::vector<std::int32_t>{1, 2}, 5, 3, 0);
  ASSERT_TRUE(none);
  EXPECT_EQ(*none, (std::vector<std::int32_t>{1, 2}));
  EXPECT_FALSE(expand_image_tokens(ids, 5, 3, 2));
  EXPECT_FALSE(expand_image_tokens(ids, 5, 3, 4));
}

TEST(Llava, QuantPlanComponentPatterns) {
  quant_plan plan;
  plan.default_format = k::weight_format::q8_0;
  ASSERT_TRUE(plan.add_override("vision.*=int8"));
  ASSERT_TRUE(plan.add_override("projector.*=f16"));
  ASSERT_TRUE(plan.add_override("text.layers.1.*=q4_0"));
  const auto f32 = k::dtype::f32;
  EXPECT_EQ(plan.choose("vision.layers.1.q_proj", f32, 256), k::weight_format::int8_sym);
  EXPECT_EQ(plan.choose("projector.linear_2", f32, 256), k::weight_format::f16);
  EXPECT_EQ(plan.choose("layers.1.q_proj", f32, 256), k::weight_format::q4_0);  // via text.
  EXPECT_EQ(plan.choose("layers.0.q_proj", f32, 256), k::weight_format::q8_0);  // default
  EXPECT_EQ(plan.choose("embed_tokens", f32, 256), k::weight_format::q8_0);
  quant_plan text_only;
  ASSERT_TRUE(text_only.add_override("text.*=q4_0"));
  EXPECT_EQ(text_only.choose("lm_head", f32, 256), k::weight_format::q4_0);
  EXPECT_EQ(text_only.choose("vision.layers.0.fc1", f32, 256), k::weight_format::f32);
  EXPECT_EQ(text_only.choose("projector.linear_1", k::dtype::f16, 256), k::weight_format::f16);
}

TEST(Llava, CanonicalNamesOfEveryComponent) {
  auto src = weight_source::open(dir("full"));
  ASSERT_TRUE(src) << src.error().message;
  const auto& s = **src;
  EXPECT_EQ(s.file_name("vision.layers.2.o_proj.bias"),
            "vision_tower.vision_model.encoder.layers.2.self_attn.out_proj.bias");
  EXPECT_EQ(s.file_name("vision.layers.0.norm1"),
            "vision_tower.vision_model.encoder.layers.0.layer_norm1.weight");
  EXPECT_EQ(s.file_name("vision.layers.0.fc2"),
            "vision_tower.vision_model.encoder.layers.0.mlp.fc2.weight");
  EXPECT_EQ(s.file_name("vision.pre_norm.bias"), "vision_tower.vision_model.pre_layrnorm.bias");
  EXPECT_EQ(s.file_name("vision.class_embedding"),
            "vision_tower.vision_model.embeddings.class_embedding");
  EXPECT_EQ(s.file_name("projector.linear_1.bias"), "multi_modal_projector.linear_1.bias");
  EXPECT_EQ(s.file_name("layers.1.up_proj"), "language_model.model.layers.1.mlp.up_proj.weight");
  EXPECT_EQ(s.file_name("lm_head"), "language_model.lm_head.weight");
  for (const char* name : {"vision.patch_embedding", "vision.position_embedding", "vision.pre_norm",
                           "vision.layers.2.q_proj", "vision.layers.2.norm2.bias",
                           "projector.linear_2", "embed_tokens", "norm"})
    EXPECT_TRUE(s.has(name)) << name;
  EXPECT_FALSE(s.has("lm_head"));  // tied
}

// A step's input embeddings replace the table rows at the chosen token: fed
// the table's own rows they must give the same logits bit for bit, and
// other rows must change them.
TEST(Llava, DecoderInputEmbeddingsReplaceTableRows) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llava_model::load(dir("odd"), *ctx);
  ASSERT_TRUE(m) << m.error().message;
  const auto& lm = (*m)->language_model();
  auto src = weight_source::open(dir("odd"));
  ASSERT_TRUE(src);
  auto table = (*src)->get("embed_tokens");
  ASSERT_TRUE(table);
  const std::int64_t H = lm.config().hidden_size;
  const std::vector<std::int32_t> toks{1, 40, 7, 7, 12, 7, 99};
  std::vector<float> rows;
  for (int i = 0; i < 3; ++i)
    rows.insert(rows.end(), table->row_as<float>(7), table->row_as<float>(7) + H);
  auto logits = [&](std::int32_t embed_token, std::span<const float> e) {
    auto cache = lm.make_cache(ctx->memory(), kv_options{.block_size = 16, .capacity_tokens = 64});
    EXPECT_TRUE(cache);
    step_input in{cache->add_sequence(), toks, true};
    in.embed_token = embed_token;
    in.embeddings = e;
    auto l = lm.forward(*ctx, *cache, std::vector<step_input>{in});
    EXPECT_TRUE(l) << l.error().message;
    return l ? values(*l) : std::vector<float>{};
  };
  const auto plain = logits(-1, {});
  ASSERT_FALSE(plain.empty());
  EXPECT_EQ(logits(7, rows), plain);
  rows[static_cast<std::size_t>(H) + 3] += 0.5f;  // the second 7 only
  const auto changed = logits(7, rows);
  const auto V = static_cast<std::size_t>(lm.config().vocab_size);
  EXPECT_TRUE(std::equal(plain.begin(), plain.begin() + static_cast<std::ptrdiff_t>(3 * V),
                         changed.begin()));
  EXPECT_NE(
      std::vector<float>(plain.begin() + static_cast<std::ptrdiff_t>(3 * V), plain.end()),
      std::vector<float>(changed.begin() + static_cast<std::ptrdiff_t>(3 * V), changed.end()));
}

// The kernels' windowed / sparse attention are causal only; configured on the
// vision tower they keep every image independent of its batch-mates, and
// sparse attention keeping every block equals causal dense attention.
TEST(Llava, VisionTowerWindowedAndSparseAttention) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llava_model::load(dir("odd"), *ctx);
  ASSERT_TRUE(m) << m.error().message;
  const auto& tower = (*m)->vision_tower();
  const std::int64_t T = tower.positions();  // 26
  const auto two = pixels(*ctx, 2, 30, 0.0f);
  auto run = [&](const k::tensor& px, const k::attention_options& a, int block = 8) {
    clip_options o;
    o.attention = a;
    o.kv_block_size = block;
    auto r = tower.forward(*ctx, px, o);
    EXPECT_TRUE(r) << r.error().message;
    return r ? values(*r) : std::vector<float>{};
  };
  const auto dense = run(two, {.causal = false});
  const auto causal = run(two, {.causal = true});
  const auto everything = run(two, {.causal = true, .window = static_cast<int>(T), .top_k = 100});
  const auto window = run(two, {.causal = true, .window = 8, .sinks = 1});
  const auto sparse = run(two, {.causal = true, .window = 8, .sinks = 1, .top_k = 1});
  ASSERT_FALSE(dense.empty() || causal.empty() || everything.empty() || window.empty() ||
               sparse.empty());
  EXPECT_NE(dense, causal);
  EXPECT_EQ(everything, causal);
  EXPECT_NE(window, causal);
  EXPECT_NE(sparse, window);
  EXPECT_NE(sparse, causal);
  for (float v : sparse) ASSERT_TRUE(std::isfinite(v));
  // The second image alone gives its rows of the pair, for each mode.
  auto second = two.slice_rows(1, 1);
  ASSERT_TRUE(second);
  const auto half = static_cast<std::ptrdiff_t>(sparse.size() / 2);
  for (const auto& [opts, pair] :
       {std::pair{k::attention_options{.causal = true, .window = 8, .sinks = 1, .top_k = 1},
                  &sparse},
        std::pair{k::attention_options{.causal = true, .window = 8, .sinks = 1}, &window}}) {
    const auto alone = run(*second, opts);
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), pair->begin() + half));
  }
}

// The vision tower and projector on a device whose memory host code cannot
// touch (a GPU's situation; tests/remote_memory_device.hpp) give the CPU
// device's bits: weights, pixels, class and position embeddings, biases
// and the selected rows all go through the device, for both patch
// embeddings and for dense and sparse attention.
TEST(Llava, ImagesOnADeviceWhoseMemoryIsNotTheHostsGiveTheCpusBits) {
  auto cpu = k::cpu::cpu_device::with_threads(2);
  test::remote_memory_device remote(2);
  for (const char* name : {"odd", "full"}) {
    auto on_cpu = llava_model::load(dir(name), *cpu);
    auto on_remote = llava_model::load(dir(name), remote);
    ASSERT_TRUE(on_cpu) << on_cpu.error().message;
    ASSERT_TRUE(on_remote) << on_remote.error().message;
    const auto size = (*on_cpu)->image_size();
    const auto px = pixels(*cpu, 2, size, 0.5f);  // host pixels, as the encoder actor has them
    for (const bool onednn : {true, false})
      for (const auto& attn :
           {k::attention_options{.causal = false},
            k::attention_options{.causal = true, .window = 8, .sinks = 1, .top_k = 1}}) {
        clip_options o;
        o.onednn_patch_embedding = onednn;
        o.attention = attn;
        o.kv_block_size = 8;
        auto want = (*on_cpu)->encode_images(*cpu, px, o);
        auto got = (*on_remote)->encode_images(remote, px, o);
        ASSERT_TRUE(want) << want.error().message;
        ASSERT_TRUE(got) << got.error().message;
        ASSERT_TRUE(test::remote_memory_device::remote(got->data()));
        std::vector<float> host(static_cast<std::size_t>(got->numel()));
        ASSERT_TRUE(k::copy_to_host(*got, std::as_writable_bytes(std::span<float>(host))));
        EXPECT_EQ(host, values(*want))
            << name << (onednn ? " conv" : " gather") << " top_k " << attn.top_k;
      }
    // prepare (what the single-process path uses) hands the embeddings to the host.
    const std::vector<std::int32_t> ids{1, (*on_cpu)->image_token(), 5};
    auto one = px.slice_rows(0, 1);
    ASSERT_TRUE(one);
    auto a = (*on_cpu)->prepare(*cpu, ids, *one);
    auto b = (*on_remote)->prepare(remote, ids, *one);
    ASSERT_TRUE(a && b);
    EXPECT_EQ(a->image_embeds, b->image_embeds);
    EXPECT_EQ(a->tokens, b->tokens);
  }
}

// The vision tower and projector give the scalar path's bits at every ISA
// level this machine has (issue 24), with the gathered patch matmul the
// runtime uses. (The opt-in oneDNN patch convolution is not covered: oneDNN
// picks its kernel by the machine's ISA, process-wide, below the device's
// level, so its bits may differ between an AVX2 and an AVX-512 machine.)
TEST(Llava, EveryIsaLevelGivesTheScalarPathsImageBits) {
  const auto top = k::cpu::cpu_device::with_threads(1)->ctx().hardware_level();
  for (const char* name : {"odd", "full"})
    for (const bool onednn : {false}) {
      SCOPED_TRACE(name);
      auto at = [&](k::cpu::isa level) {
        auto dev = k::cpu::cpu_device::with_threads(2);
        dev->ctx().set_level(level);
        auto m = llava_model::load(dir(name), *dev);
        EXPECT_TRUE(m) << m.error().message;
        const auto px = pixels(*dev, 2, (*m)->image_size(), 0.25f);
        clip_options o;
        o.onednn_patch_embedding = onednn;
        auto e = (*m)->encode_images(*dev, px, o);
        EXPECT_TRUE(e) << e.error().message;
        return values(*e);
      };
      const auto want = at(k::cpu::isa::scalar);
      for (auto level = k::cpu::isa::avx2; level <= top;
           level = static_cast<k::cpu::isa>(static_cast<int>(level) + 1)) {
        const auto got = at(level);
        ASSERT_EQ(got.size(), want.size());
        std::size_t differ = 0;
        for (std::size_t i = 0; i < got.size(); ++i)
          differ += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
        EXPECT_EQ(differ, 0u) << k::cpu::to_string(level) << ": " << differ << " of " << got.size()
                              << " values differ";
      }
    }
}
