#pragma once

// The f32 source of the "kq" GGUF fixtures (tools/make_gguf_quant_fixtures.py
// writes it with `troupe write-model --format f32 --layers 2 --hidden 256
// --ffn 256 --heads 4 --kv-heads 2 --vocab 512 --seed 25`), rebuilt for the
// tests that quantize it and compare with llama.cpp's files.
#include <string>

#include "models/random_model.hpp"

namespace troupe::test {

/// tests/fixtures/gguf_quants: llama.cpp's quantized files and their figures.
inline std::string gguf_quants_dir() {
  return std::string(TROUPE_FIXTURES_DIR) + "/gguf_quants";
}

inline models::llama_config kq_config() {
  auto c = models::tinyllama_shape();
  c.num_layers = 2;
  c.hidden_size = 256;
  c.intermediate_size = 256;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.vocab_size = 512;
  c.head_dim = 64;
  return c;
}

/// Writes the kq source to `path`; false on failure.
inline bool write_kq_source(const std::string& path) {
  models::random_model_spec spec;
  spec.config = kq_config();
  spec.format = kernels::weight_format::f32;
  spec.seed = 25;
  return static_cast<bool>(models::write_random_gguf(path, spec));
}

}  // namespace troupe::test
