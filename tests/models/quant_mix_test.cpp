// llama.cpp's per-tensor format choice under its K-quant and IQ4 file
// types, against the choices its own quantizer made
// (tools/make_quant_mix_fixtures.py -> mix_types.json: 5 inputs x 11 file
// types, every 2-D tensor's name, row length and ggml type), and troupe's
// --quant q4_k_m end to end: the f32 source quantized through the plan
// gives llama.cpp's file, byte for byte.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "../temp_path.hpp"
#include "kernels/quant.hpp"
#include "kq_source.hpp"
#include "models/gguf.hpp"
#include "models/llama.hpp"
#include "models/llama_config.hpp"
#include "models/quant_mix.hpp"
#include "models/random_model.hpp"
#include "models/weights.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

std::string dir() {
  return test::gguf_quants_dir();
}

// A GGUF tensor name -> troupe's canonical one (the LLaMA-layout names
// these files hold).
std::string canonical_of(const std::string& gguf) {
  if (gguf == "token_embd.weight") return "embed_tokens";
  if (gguf == "output.weight") return "lm_head";
  static const std::map<std::string, std::string> leaves{
      {"attn_q", "q_proj"},      {"attn_k", "k_proj"},      {"attn_v", "v_proj"},
      {"attn_output", "o_proj"}, {"ffn_gate", "gate_proj"}, {"ffn_up", "up_proj"},
      {"ffn_down", "down_proj"}};
  const auto first = gguf.find('.'), second = gguf.find('.', first + 1);
  const std::string leaf = gguf.substr(second + 1, gguf.rfind('.') - second - 1);
  const auto it = leaves.find(leaf);
  if (gguf.rfind("blk.", 0) != 0 || it == leaves.end()) return "";
  return "layers." + gguf.substr(first + 1, second - first - 1) + "." + it->second;
}

k::weight_format format_of_ggml(int ggml_type) {
  const auto dt = dtype_from_ggml(static_cast<std::uint32_t>(ggml_type));
  if (!dt) return k::weight_format::f32;
  if (*dt == k::dtype::f16) return k::weight_format::f16;
  if (*dt == k::dtype::f32) return k::weight_format::f32;
  return *k::block_format(*dt);
}

}  // namespace

TEST(QuantMix, ChoosesLlamaCppsFormatForEveryTensor) {
  std::ifstream in(dir() + "/mix_types.json");
  ASSERT_TRUE(in) << "mix_types.json";
  const auto doc = nlohmann::json::parse(in);
  std::map<std::string, int> per_mix;
  std::map<k::weight_format, int> seen;
  for (const auto& file : doc.at("files")) {
    const std::string input = file.at("input"), ftype = file.at("ftype");
    SCOPED_TRACE(input + " " + ftype);
    const auto& facts = doc.at("inputs").at(input);
    const mix_model model{.num_layers = facts.at("layers"),
                          .num_heads = facts.at("heads"),
                          .num_kv_heads = facts.at("kv_heads"),
                          .tied_output = facts.at("tied")};
    const auto mix = gguf_mix_from_string(ftype);
    ASSERT_TRUE(mix);
    quant_plan plan;
    plan.mix = *mix;
    for (const auto& t : file.at("tensors")) {
      const std::string name = t.at(0);
      const std::int64_t cols = t.at(1);
      const auto want = format_of_ggml(t.at(2));
      const auto canonical = canonical_of(name);
      ASSERT_FALSE(canonical.empty()) << name;
      EXPECT_EQ(k::to_string(plan.choose(canonical, k::dtype::f32, cols, &model)),
                k::to_string(want))
          << name << " (" << cols << " columns)";
      ++per_mix[ftype];
      ++seen[want];
    }
  }
  EXPECT_EQ(per_mix.size(), 11u);
  // The rules and fallbacks these inputs reach: every K-quant, both IQ4s,
  // and the fallbacks Q4_0, Q5_0, Q5_1, Q8_0.
  for (const auto f : {k::weight_format::q2_k, k::weight_format::q3_k, k::weight_format::q4_k,
                       k::weight_format::q5_k, k::weight_format::q6_k, k::weight_format::iq4_nl,
                       k::weight_format::iq4_xs, k::weight_format::q4_0, k::weight_format::q5_0,
                       k::weight_format::q5_1, k::weight_format::q8_0})
    EXPECT_GT(seen[f], 0) << k::to_string(f);
}

TEST(QuantMix, NamesAndFallbacks) {
  EXPECT_EQ(gguf_mix_from_string("Q4_K_M"), gguf_mix::q4_k_m);
  EXPECT_EQ(gguf_mix_from_string("iq4_xs"), gguf_mix::iq4_xs);
  EXPECT_FALSE(gguf_mix_from_string("q4_k"));  // a format, not a file type
  EXPECT_FALSE(gguf_mix_from_string("q4_0"));
  EXPECT_EQ(to_string(gguf_mix::q5_k_m), "q5_k_m");
  EXPECT_EQ(base_format(gguf_mix::q3_k_l), k::weight_format::q3_k);
  // A pure K-quant falls back as llama.cpp does; F16 where 32 does not divide.
  EXPECT_EQ(shape_fallback(k::weight_format::q4_k, 512), k::weight_format::q4_k);
  EXPECT_EQ(shape_fallback(k::weight_format::q4_k, 640), k::weight_format::q5_0);
  EXPECT_EQ(shape_fallback(k::weight_format::q6_k, 640), k::weight_format::q8_0);
  EXPECT_EQ(shape_fallback(k::weight_format::q2_k, 160), k::weight_format::q4_0);
  EXPECT_EQ(shape_fallback(k::weight_format::iq4_xs, 96), k::weight_format::iq4_nl);
  EXPECT_EQ(shape_fallback(k::weight_format::q5_k, 100), k::weight_format::f16);
  EXPECT_EQ(shape_fallback(k::weight_format::q4_0, 100),
            k::weight_format::q4_0);  // quantize refuses
  // LLaMA 70B's value projection gets Q5_K where Q4_K_M leaves it at Q4_K
  // (layer 13; layer 12 is one of the "more bits" layers: Q6_K).
  const mix_model l70{.num_layers = 80, .num_heads = 64, .num_kv_heads = 8, .llama_70b = true};
  EXPECT_EQ(mix_format(gguf_mix::q4_k_m, "layers.13.v_proj", 8192, l70), k::weight_format::q5_k);
  EXPECT_EQ(mix_format(gguf_mix::q4_k_m, "layers.12.v_proj", 8192, l70), k::weight_format::q6_k);
  // Phi-3's fused projections are judged as llama.cpp's attn_qkv / ffn_up.
  const mix_model phi{.num_layers = 32, .num_heads = 32, .num_kv_heads = 32};
  EXPECT_EQ(mix_format(gguf_mix::q4_k_m, "layers.0.qkv_proj", 3072, phi), k::weight_format::q6_k);
  EXPECT_EQ(mix_format(gguf_mix::q4_k_m, "layers.5.qkv_proj", 3072, phi), k::weight_format::q4_k);
  // Outside the decoder, the mix's base format.
  quant_plan plan;
  plan.mix = gguf_mix::q4_k_m;
  EXPECT_EQ(plan.choose("vision.layers.0.fc1", k::dtype::f16, 1024), k::weight_format::q4_k);
  EXPECT_EQ(plan.choose("vision.layers.0.fc1", k::dtype::f16, 1152), k::weight_format::q5_0);
  // An override still wins.
  ASSERT_TRUE(plan.add_override("layers.*.down_proj=q8_0"));
  const mix_model m{.num_layers = 2, .num_heads = 4, .num_kv_heads = 2};
  EXPECT_EQ(plan.choose("layers.0.down_proj", k::dtype::f32, 256, &m), k::weight_format::q8_0);
}

// --quant q4_k_m of the f32 source: for every 2-D tensor of llama.cpp's
// Q4_K_M file of the same source, the plan picks its format and the
// quantizer writes its bytes (and likewise for the other mixes the fixtures
// hold for this input).
TEST(QuantMix, QuantizingTheSourceGivesLlamaCppsFiles) {
  const std::string src_path = test::temp_path("kq-f32-mix.gguf");
  ASSERT_TRUE(test::write_kq_source(src_path));
  auto src = gguf_file::open(src_path);
  ASSERT_TRUE(src) << src.error().message;
  const mix_model model{.num_layers = 2, .num_heads = 4, .num_kv_heads = 2};
  auto pool = k::memory_pool::create();
  int files = 0;
  for (const char* key : {"q2_k", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs"}) {
    SCOPED_TRACE(key);
    auto ref = gguf_file::open(dir() + "/kq-" + key + ".gguf");
    ASSERT_TRUE(ref) << ref.error().message;
    quant_plan plan;
    plan.mix = *gguf_mix_from_string(key);
    int compared = 0;
    for (const auto& t : ref->tensors()) {
      if (t.ne.size() != 2) continue;
      SCOPED_TRACE(t.name);
      const auto* s = src->find_tensor(t.name);
      ASSERT_NE(s, nullptr);
      auto f32 = src->view(*s);
      auto want = ref->view(t);
      ASSERT_TRUE(f32 && want);
      const auto format = plan.choose(canonical_of(t.name), k::dtype::f32, f32->dim(1), &model);
      ASSERT_EQ(k::block_dtype(format), t.type) << k::to_string(format);
      auto got = convert_weight(*pool, *f32, format, plan.int4_group);
      ASSERT_TRUE(got) << got.error().message;
      ASSERT_EQ(got->data.nbytes(), want->nbytes());
      EXPECT_EQ(0, std::memcmp(got->data.data(), want->data(), want->nbytes()));
      ++compared;
    }
    EXPECT_GE(compared, 16);
    ++files;
  }
  EXPECT_EQ(files, 7);
}

// What the head plans memory with: every decoder matrix's held format. A
// llama.cpp Q4_K_M file as stored, and the f32 source under --quant q4_k_m,
// give the same list (with Q6_K where llama.cpp put it); a pure format
// gives that format everywhere.
TEST(QuantMix, DecoderFormatsAreWhatTheStagesHold) {
  auto ref = weight_source::open(dir() + "/kq-q4_k_m.gguf");
  ASSERT_TRUE(ref) << ref.error().message;
  auto cfg = llama_config_from_gguf(*(*ref)->gguf());
  ASSERT_TRUE(cfg) << cfg.error().message;
  const auto stored = decoder_formats(*cfg, **ref, quant_plan{});
  ASSERT_EQ(stored.size(), 2u + 7u * 2u);  // embedding, output, 7 matrices x 2 layers
  std::map<k::weight_format, int> count;
  for (const auto& [name, f, rows, cols] : stored) {
    const auto* t = (*ref)->gguf()->find_tensor((*ref)->file_name(name));
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(k::block_dtype(f), t->type) << name;
    ASSERT_EQ(t->ne.size(), 2u);
    EXPECT_EQ(rows, static_cast<std::int64_t>(t->ne[1])) << name;
    EXPECT_EQ(cols, static_cast<std::int64_t>(t->ne[0])) << name;
    ++count[f];
  }
  EXPECT_GT(count[k::weight_format::q6_k], 0);
  EXPECT_GT(count[k::weight_format::q4_k], 0);

  random_model_spec spec;
  spec.config = *cfg;
  spec.format = k::weight_format::f32;
  spec.seed = 25;
  const std::string src_path = test::temp_path("kq-f32-formats.gguf");
  ASSERT_TRUE(write_random_gguf(src_path, spec));
  auto src = weight_source::open(src_path);
  ASSERT_TRUE(src);
  quant_plan mix;
  mix.mix = gguf_mix::q4_k_m;
  EXPECT_EQ(decoder_formats(*cfg, **src, mix), stored);
  quant_plan pure;
  pure.default_format = k::weight_format::q4_k;
  for (const auto& h : decoder_formats(*cfg, **src, pure))
    EXPECT_EQ(h.format, k::weight_format::q4_k) << h.name;
}
