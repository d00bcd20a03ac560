#include <gtest/gtest.h>

#include "../temp_path.hpp"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "models/llama_config.hpp"

using namespace troupe::models;

namespace {

// Llama-3.2-1B's config.json (public), abridged to the fields read.
const char* llama32 = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
  "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 16,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "vocab_size": 128256})";

// TinyLlama-1.1B's shape, no head_dim (derived), eos as an integer.
const char* tinyllama =
    R"({"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_hidden_layers": 22,
  "num_key_value_heads": 4, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "vocab_size": 32000,
  "tie_word_embeddings": false, "rope_scaling": null})";

}  // namespace

TEST(LlamaConfig, ParsesLlama32WithLlama3Scaling) {
  auto c = parse_llama_config(llama32, "llama32.json");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->scaling.type, rope_scaling::kind::llama3);
  EXPECT_DOUBLE_EQ(c->scaling.factor, 32.0);
  EXPECT_EQ(c->scaling.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, (std::vector<std::int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(c->layout, rope_layout::halves);
}

TEST(LlamaConfig, DerivesHeadDimAndDefaults) {
  auto c = parse_llama_config(tinyllama, "tiny.json");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->scaling.type, rope_scaling::kind::none);
  EXPECT_EQ(c->eos_token_ids, (std::vector<std::int64_t>{2}));
  EXPECT_FALSE(c->tie_word_embeddings);
}

TEST(LlamaConfig, ReadsLlavaTextConfig) {
  const std::string llava =
      std::string(R"({"architectures": ["LlavaForConditionalGeneration"], "text_config": )") +
      tinyllama + R"(, "vision_config": {}})";
  auto c = parse_llama_config(llava, "llava.json");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->architecture, "LlavaForConditionalGeneration");
  EXPECT_EQ(c->num_layers, 22);
}

TEST(LlamaConfig, GenerationDefaults) {
  auto g = parse_generation_config(
      R"({"do_sample": true, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]})", "g.json");
  ASSERT_TRUE(g) << g.error().message;
  EXPECT_DOUBLE_EQ(*g->temperature, 0.6);
  EXPECT_DOUBLE_EQ(*g->top_p, 0.9);
  EXPECT_FALSE(g->top_k.has_value());
  EXPECT_EQ(g->eos_token_ids.size(), 2u);
  auto missing = load_generation_config("/nonexistent/generation_config.json");
  ASSERT_TRUE(missing);
  EXPECT_FALSE(missing->temperature.has_value());
}

TEST(LlamaConfig, FromGgufMetadata) {
  gguf_writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.embedding_length", 256);
  w.set_u32("llama.feed_forward_length", 688);
  w.set_u32("llama.block_count", 3);
  w.set_u32("llama.attention.head_count", 8);
  w.set_u32("llama.attention.head_count_kv", 2);
  w.set_u32("llama.context_length", 512);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.set_f32("llama.rope.freq_base", 500000.0f);
  w.set_strings("tokenizer.ggml.tokens", std::vector<std::string>(300, "x"));
  const std::string path = troupe::test::temp_path("cfg.gguf");
  ASSERT_TRUE(w.write(path));
  auto f = gguf_file::open(path);
  ASSERT_TRUE(f);
  auto c = llama_config_from_gguf(*f);
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->vocab_size, 300);
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->layout, rope_layout::adjacent_pairs);
  EXPECT_TRUE(c->tie_word_embeddings);  // no output.weight tensor
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
}

// gemma3 metadata: the family's switches, llama.cpp's layer pattern, and
// refusals by name for what troupe does not implement.
TEST(LlamaConfig, FromGemma3GgufMetadata) {
  auto write = [](const std::function<void(gguf_writer&)>& extra) {
    gguf_writer w;
    w.set_string("general.architecture", "gemma3");
    w.set_u32("gemma3.embedding_length", 640);
    w.set_u32("gemma3.feed_forward_length", 2048);
    w.set_u32("gemma3.block_count", 12);
    w.set_u32("gemma3.attention.head_count", 4);
    w.set_u32("gemma3.attention.head_count_kv", 1);
    w.set_u32("gemma3.attention.key_length", 256);
    w.set_u32("gemma3.attention.value_length", 256);
    w.set_u32("gemma3.attention.sliding_window", 512);
    w.set_f32("gemma3.rope.freq_base", 1e6f);
    std::vector<std::string> toks(300, "x");
    toks[106] = "<end_of_turn>";
    w.set_strings("tokenizer.ggml.tokens", toks);
    w.set_u32("tokenizer.ggml.eos_token_id", 1);
    extra(w);
    const std::string path = troupe::test::temp_path("gemma.gguf");
    EXPECT_TRUE(w.write(path));
    auto f = gguf_file::open(path);
    EXPECT_TRUE(f);
    return llama_config_from_gguf(*f);
  };
  auto c = write([](gguf_writer&) {});
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->family, decoder_family::gemma3);
  EXPECT_EQ(c->head_dim, 256);  // key_length, not 640 / 4
  EXPECT_EQ(c->layout, rope_layout::halves);
  EXPECT_TRUE(c->qk_norm && c->sandwich_norms && c->gelu_ffn);
  EXPECT_DOUBLE_EQ(c->embed_scale, std::sqrt(640.0));
  EXPECT_EQ(c->rope_local_theta, 10000.0);
  for (int l = 0; l < 12; ++l) EXPECT_EQ(c->is_sliding(l), l % 6 != 5) << l;
  EXPECT_EQ(c->eos_token_ids, (std::vector<std::int64_t>{1, 106}));
  struct bad {
    std::function<void(gguf_writer&)> set;
    const char* says;
  };
  const bad cases[] = {
      {[](gguf_writer& w) { w.set_f32("gemma3.final_logit_softcapping", 30.0f); }, "soft-capping"},
      {[](gguf_writer& w) { w.set_string("gemma3.rope.scaling.type", "longrope"); }, "'longrope'"},
      {[](gguf_writer& w) { w.set_u32("gemma3.attention.value_length", 128); }, "value_length"},
      {[](gguf_writer& w) { w.set_u64("gemma3.attention.sliding_window", 1ull << 40); },
       "sliding_window"},
  };
  for (const auto& b : cases) {
    auto r = write(b.set);
    ASSERT_FALSE(r) << b.says;
    EXPECT_NE(r.error().message.find(b.says), std::string::npos) << r.error().message;
  }
}

namespace {

// A config of `arch` with `extra` JSON members appended.
std::string hf_config(const std::string& arch, const std::string& extra) {
  return R"({"architectures": [")" + arch +
         R"("], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
  "num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 300)" +
         (extra.empty() ? "" : ", " + extra) + "}";
}

}  // namespace

// transformers 4.x layouts of the families (5.x ones are in the fixtures of
// arch_fixture_test.cpp): Qwen2's use_sliding_window / max_window_layers,
// Gemma 2's implied alternation, Gemma 3's rope_local_base_freq and linear
// scaling on the global layers.
TEST(LlamaConfig, FamiliesInTransformers4Layouts) {
  auto q = parse_llama_config(
      hf_config("Qwen2ForCausalLM",
                R"("use_sliding_window": true, "max_window_layers": 2, "sliding_window": 8)"),
      "qwen.json");
  ASSERT_TRUE(q) << q.error().message;
  EXPECT_TRUE(q->qkv_bias);
  EXPECT_EQ(q->sliding_window, 8);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(q->is_sliding(l), l >= 2) << l;
  auto q_off = parse_llama_config(
      hf_config("Qwen2ForCausalLM", R"("use_sliding_window": false, "sliding_window": 4096)"),
      "qwen.json");
  ASSERT_TRUE(q_off) << q_off.error().message;
  EXPECT_EQ(q_off->sliding_window, 0);  // written but unused

  auto g2 = parse_llama_config(
      hf_config(
          "Gemma2ForCausalLM",
          R"("sliding_window": 16, "query_pre_attn_scalar": 144, "hidden_activation": "gelu_pytorch_tanh",
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": null)"),
      "gemma2.json");
  ASSERT_TRUE(g2) << g2.error().message;
  for (int l = 0; l < 4; ++l) EXPECT_EQ(g2->is_sliding(l), l % 2 == 0) << l;
  EXPECT_DOUBLE_EQ(g2->attn_scale, 1.0 / 12.0);
  EXPECT_EQ(g2->attn_softcap, 50.0);
  EXPECT_EQ(g2->final_softcap, 0.0);
  EXPECT_TRUE(g2->tie_word_embeddings);  // Gemma's default

  auto g3 = parse_llama_config(
      hf_config("Gemma3ForCausalLM",
                R"("sliding_window": 16, "sliding_window_pattern": 2, "rope_theta": 1000000.0,
                   "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0})"),
      "gemma3.json");
  ASSERT_TRUE(g3) << g3.error().message;
  EXPECT_EQ(g3->rope_local_theta, 10000.0);
  EXPECT_EQ(g3->scaling.type, rope_scaling::kind::linear);
  EXPECT_EQ(g3->scaling.factor, 8.0);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(g3->is_sliding(l), l % 2 == 0) << l;
  EXPECT_DOUBLE_EQ(g3->attn_scale, 1.0 / std::sqrt(32.0));  // query_pre_attn_scalar absent
}

// What the new families refuse, by name.
TEST(LlamaConfig, FamilyRefusals) {
  struct bad {
    std::string json;
    const char* says;
  };
  const bad cases[] = {
      {hf_config("Phi3ForCausalLM", R"("partial_rotary_factor": 0.5)"), "partial_rotary_factor"},
      {hf_config(
           "Phi3ForCausalLM",
           R"("rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})"),
       "partial_rotary_factor"},
      {hf_config(
           "Phi3ForCausalLM",
           R"("rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]})"),
       "short_factor"},
      {hf_config("Qwen2ForCausalLM", R"("rope_scaling": {"type": "dynamic", "factor": 4.0})"),
       "'dynamic'"},
      {hf_config("Gemma2ForCausalLM", R"("sliding_window": 8, "hidden_activation": "gelu")"),
       "gelu_pytorch_tanh"},
      {hf_config("Gemma2ForCausalLM", R"("sliding_window": null)"), "sliding_window"},
      {hf_config("Gemma3ForCausalLM",
                 R"("sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"])"),
       "layer_types"},
      {hf_config(
           "Gemma3ForCausalLM",
           R"("sliding_window": 8, "layer_types": ["chunked_attention", "full_attention", "full_attention", "full_attention"])"),
       "chunked_attention"},
      {hf_config("MistralForCausalLM", R"("hidden_act": "gelu")"), "silu"},
      {hf_config(
           "LlamaForCausalLM",
           R"("rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})"),
       "per-layer-type"},
      {hf_config("Qwen3ForCausalLM", ""), "Qwen3ForCausalLM is not supported"},
      {hf_config(
           "Qwen2ForCausalLM",
           R"("rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0})"),
       "original_max_position_embeddings"},
      {hf_config("Qwen2ForCausalLM", R"("rope_scaling": {"type": "yarn", "factor": 0.5})"),
       "rope_scaling.factor"},
      {hf_config(
           "Phi3ForCausalLM",
           R"("rope_scaling": {"type": "longrope", "short_factor": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],
                    "long_factor": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,-1], "original_max_position_embeddings": 64})"),
       "positive numbers"},
      {hf_config("Gemma3ForCausalLM", R"("sliding_window": 8, "query_pre_attn_scalar": 0)"),
       "query_pre_attn_scalar"},
  };
  for (const auto& b : cases) {
    auto r = parse_llama_config(b.json, "c.json");
    ASSERT_FALSE(r) << b.says;
    EXPECT_NE(r.error().message.find(b.says), std::string::npos) << r.error().message;
  }
}

// The other GGUF architectures llama.cpp writes: what each reads and what
// llama.cpp hard-codes for it.
TEST(LlamaConfig, FromQwen2Phi3Gemma2GgufMetadata) {
  auto write = [](const std::string& arch, std::uint32_t layers,
                  const std::function<void(gguf_writer&)>& extra) {
    gguf_writer w;
    w.set_string("general.architecture", arch);
    w.set_u32(arch + ".embedding_length", 256);
    w.set_u32(arch + ".feed_forward_length", 512);
    w.set_u32(arch + ".block_count", layers);
    w.set_u32(arch + ".attention.head_count", 4);
    w.set_u32(arch + ".attention.head_count_kv", 2);
    w.set_u32(arch + ".attention.sliding_window", 16);
    std::vector<std::string> toks(300, "x");
    toks[200] = "<|end|>";
    w.set_strings("tokenizer.ggml.tokens", toks);
    w.set_u32("tokenizer.ggml.eos_token_id", 2);
    w.set_u32("tokenizer.ggml.eot_token_id", 7);
    extra(w);
    const std::string path = troupe::test::temp_path(arch + ".gguf");
    EXPECT_TRUE(w.write(path));
    auto f = gguf_file::open(path);
    EXPECT_TRUE(f);
    return llama_config_from_gguf(*f);
  };
  auto none = [](gguf_writer&) {};
  auto q = write("qwen2", 4, none);
  ASSERT_TRUE(q) << q.error().message;
  EXPECT_EQ(q->family, decoder_family::qwen2);
  EXPECT_TRUE(q->qkv_bias);
  EXPECT_EQ(q->layout, rope_layout::halves);
  EXPECT_EQ(q->sliding_window, 0);  // llama.cpp's qwen2 has no window
  EXPECT_EQ(q->eos_token_ids, (std::vector<std::int64_t>{2, 7}));

  auto p = write("phi3", 4, none);
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_TRUE(p->fused_qkv);
  EXPECT_EQ(p->sliding_window, 16);  // applied, as transformers applies it
  EXPECT_EQ(p->eos_token_ids, (std::vector<std::int64_t>{2, 7, 200}));  // <|end|> too
  auto partial =
      write("phi3", 4, [](gguf_writer& w) { w.set_u32("phi3.rope.dimension_count", 32); });
  ASSERT_FALSE(partial);
  EXPECT_NE(partial.error().message.find("partial RoPE"), std::string::npos);

  auto g = write("gemma2", 4, [](gguf_writer& w) {
    w.set_u32("gemma2.attention.key_length", 128);
    w.set_u32("gemma2.attention.value_length", 128);
    w.set_f32("gemma2.attn_logit_softcapping", 50.0f);
    w.set_f32("gemma2.final_logit_softcapping", 30.0f);
  });
  ASSERT_TRUE(g) << g.error().message;
  EXPECT_EQ(g->family, decoder_family::gemma2);
  EXPECT_EQ(g->attn_softcap, 50.0);
  EXPECT_EQ(g->final_softcap, 30.0);
  EXPECT_EQ(g->attn_scale, 0.0);  // 1/sqrt(head_dim)
  EXPECT_FALSE(g->qk_norm);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(g->is_sliding(l), l % 2 == 0) << l;
  // The 27B (46 layers): llama.cpp scales by 1/sqrt(hidden / heads).
  auto big = write("gemma2", 46, [](gguf_writer& w) {
    w.set_u32("gemma2.attention.key_length", 128);
    w.set_u32("gemma2.attention.value_length", 128);
  });
  ASSERT_TRUE(big) << big.error().message;
  EXPECT_DOUBLE_EQ(big->attn_scale, 1.0 / 8.0);
  auto l =
      write("llama", 4, [](gguf_writer& w) { w.set_f32("llama.attn_logit_softcapping", 5.0f); });
  ASSERT_FALSE(l);
  EXPECT_NE(l.error().message.find("soft-capping"), std::string::npos);
}
