#include <gtest/gtest.h>

#include <string>

#include "models/llama_config.hpp"

using namespace troupe::models;

namespace {

std::string with(const std::string& extra) {
  return R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100)" +
         extra + "}";
}

}  // namespace

TEST(LlamaConfigValidation, BadConfigsNameTheField) {
  ASSERT_TRUE(parse_llama_config(with(""), "c.json"));
  struct bad {
    std::string text;
    std::string field;
  };
  const bad cases[] = {
      {"not json", "c.json"},
      {"[1, 2]", "c.json"},
      {R"({"architectures": ["GPT2LMHeadModel"], "hidden_size": 64})", "GPT2LMHeadModel"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})", "is missing"},
      {with(R"(, "num_key_value_heads": 3)"), "num_key_value_heads"},
      {with(R"(, "num_key_value_heads": 0)"), "num_key_value_heads"},
      {with(R"(, "hidden_size": "64")"), "hidden_size"},
      {with(R"(, "rms_norm_eps": -1)"), "rms_norm_eps"},
      {with(R"(, "rope_theta": 0.5)"), "rope_theta"},
      {with(R"(, "rope_scaling": {"rope_type": "dynamic", "factor": 4})"), "rope_scaling"},
      {with(
           R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1})"),
       "rope_scaling"},
      {with(R"(, "rope_scaling": 7)"), "rope_scaling"},
      {with(R"(, "eos_token_id": 100)"), "eos_token_id"},
      {with(R"(, "bos_token_id": "one")"), "bos_token_id"},
      {with(R"(, "hidden_act": "gelu")"), "hidden_act"},
      {with(R"(, "attention_bias": true)"), "attention_bias"},
      {with(R"(, "head_dim": 7)"), "head_dim"},
      {with(R"(, "num_hidden_layers": 100000)"), "num_hidden_layers"},
      {with(R"(, "vocab_size": -5)"), "vocab_size"},
      {with(R"(, "tie_word_embeddings": "yes")"), "tie_word_embeddings"},
      {R"({"architectures": ["LlavaForConditionalGeneration"]})", "text_config"},
      // transformers 5's rope_parameters: an unknown type is refused by name,
      // never read as "no scaling".
      {with(R"(, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4})"),
       "'dynamic' is not supported"},
      {with(R"(, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4})"),
       "short_factor"},
      {with(R"(, "rope_parameters": {"rope_type": 3, "rope_theta": 1e4})"), "rope_type"},
      {with(R"(, "rope_parameters": {"rope_type": "default"})"), "rope_theta"},
      {with(R"(, "rope_parameters": {"rope_theta": 0.5})"), "rope_theta"},
      {with(R"(, "rope_parameters": [1])"), "rope_parameters"},
      {with(
           R"(, "rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 2e4})"),
       "differ"},
      {with(R"(, "rope_parameters": {"full_attention": {"rope_theta": 1e6}})"), "per-layer"},
      {with(R"(, "rope_scaling": {"factor": 2})"), "rope_scaling"},
  };
  for (const auto& c : cases) {
    auto r = parse_llama_config(c.text, "c.json");
    ASSERT_FALSE(r) << c.text;
    EXPECT_NE(r.error().message.find(c.field), std::string::npos) << r.error().message;
  }
}

TEST(LlamaConfigValidation, BadGenerationConfigs) {
  EXPECT_FALSE(parse_generation_config("{", "g.json"));
  EXPECT_FALSE(parse_generation_config(R"({"temperature": -1})", "g.json"));
  EXPECT_FALSE(parse_generation_config(R"({"top_p": 1.5})", "g.json"));
  EXPECT_FALSE(parse_generation_config(R"({"top_k": "5"})", "g.json"));
  EXPECT_FALSE(load_llama_config("/nonexistent/config.json"));
}
