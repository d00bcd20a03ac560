#pragma once

#include <string>

#include "kernels/quant.hpp"
#include "models/llama_config.hpp"

namespace troupe::models {

/// A LLaMA shape for a random-weight model.
struct random_model_spec {
  llama_config config;
  kernels::weight_format format = kernels::weight_format::f16;  ///< f32, f16, q8_0 or q4_0
  std::uint64_t seed = 1;
  float stddev = 0.02f;
  /// Threads generating the matrices (0 = every hardware thread); the file
  /// is the same whatever the count.
  int threads = 0;
};

/// TinyLlama-1.1B's shape: dim 2048, 22 layers, 32 heads, 4 KV heads, FFN
/// 5632, vocab 32000, untied.
llama_config tinyllama_shape();
/// LLaMA-2-7B's shape: dim 4096, 32 layers, 32 heads (no GQA), FFN 11008,
/// vocab 32000.
llama_config llama2_7b_shape();

/// Writes a random-weight llama GGUF (every matrix in `format`, norms f32)
/// with an SPM vocabulary (<unk>, <s>, </s>, 256 byte tokens, then pieces),
/// so the file loads and tokenizes like a real one. Needs no Python.
result<void> write_random_gguf(const std::string& path, const random_model_spec& spec);

}  // namespace troupe::models
