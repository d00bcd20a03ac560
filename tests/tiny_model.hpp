#pragma once
// The small llama shape the model and CLI tests write as random GGUFs.
#include <cstdint>

#include "models/llama_config.hpp"

namespace troupe::test {

/// 2 layers, hidden 64, 4 heads of 16, 2 KV heads (GQA).
inline models::llama_config tiny_llama_config(std::int64_t vocab, std::int64_t ffn) {
  models::llama_config c;
  c.vocab_size = vocab;
  c.hidden_size = 64;
  c.intermediate_size = ffn;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 512;
  return c;
}

}  // namespace troupe::test
