#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/gguf.hpp"
#include "models/mapped_file.hpp"

namespace troupe::models {

/// RoPE frequency scaling (HF `rope_scaling`).
struct rope_scaling {
  enum class kind : std::uint8_t { none, linear, llama3 };
  kind type = kind::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;                          ///< llama3
  double high_freq_factor = 4.0;                         ///< llama3
  std::int64_t original_max_position_embeddings = 8192;  ///< llama3
};

/// How a checkpoint lays out the two halves RoPE rotates together.
enum class rope_layout : std::uint8_t {
  halves,          ///< HF / neox: x[i] with x[i + d/2]
  adjacent_pairs,  ///< GGUF / Meta: x[2i] with x[2i+1]
};

/// The decoder families troupe runs: LLaMA and its relatives, and Gemma 3
/// (text): GeGLU, RMSNorm on each head of q and k, norms on the attention
/// and FFN outputs too, scaled embeddings, and sliding-window layers with
/// their own RoPE base between global ones.
enum class decoder_family : std::uint8_t { llama, gemma3 };

/// The decoder hyper-parameters of a LLaMA-family model, validated.
struct llama_config {
  std::string architecture = "LlamaForCausalLM";
  decoder_family family = decoder_family::llama;
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  rope_scaling scaling;
  rope_layout layout = rope_layout::halves;
  bool tie_word_embeddings = false;
  std::vector<std::int64_t> bos_token_ids;
  std::vector<std::int64_t> eos_token_ids;
  // Gemma 3 (all off for LLaMA).
  double embed_scale = 1.0;  ///< embedding rows multiplied by this (Gemma: sqrt(hidden))
  bool qk_norm = false;      ///< RMSNorm over each head of q and of k, before RoPE
  bool sandwich_norms =
      false;              ///< RMSNorm on the attention and FFN outputs before each residual add
  bool gelu_ffn = false;  ///< GeGLU (gelu_tanh(gate) * up) instead of SwiGLU
  std::int64_t sliding_window = 0;  ///< keys a windowed layer sees, itself included (0: none)
  std::int64_t sliding_pattern =
      0;                        ///< every n-th layer (n-1, 2n-1, ...) is global; 0: all windowed
  double rope_local_theta = 0;  ///< RoPE base of the windowed layers (0: rope_theta)

  /// Whether layer `l` attends through the sliding window.
  bool is_sliding(std::int64_t l) const {
    return sliding_window > 0 &&
           (sliding_pattern == 0 || l % sliding_pattern != sliding_pattern - 1);
  }

  /// Checks ranges and divisibility; the message names `source` and the field.
  result<void> validate(const std::string& source) const;
};

/// Sampling defaults of `generation_config.json`.
struct generation_defaults {
  std::optional<double> temperature, top_p, min_p, repetition_penalty;
  std::optional<std::int64_t> top_k, max_new_tokens;
  std::optional<bool> do_sample;
  std::vector<std::int64_t> eos_token_ids;
};

/// Parses a Hugging Face `config.json` (LlamaForCausalLM, or the
/// `text_config` of a LLaVA config).
result<llama_config> parse_llama_config(std::string_view json_text, const std::string& source);
result<llama_config> load_llama_config(const std::string& path);

/// Reads the llama.* metadata of a GGUF file.
result<llama_config> llama_config_from_gguf(const gguf_file& f);

result<generation_defaults> parse_generation_config(std::string_view json_text,
                                                    const std::string& source);
/// Missing file = all defaults unset.
result<generation_defaults> load_generation_config(const std::string& path);

/// Reads a whole (small, < 64 MiB) text file.
result<std::string> read_text_file(const std::string& path, std::size_t max_bytes = 64u << 20);

}  // namespace troupe::models
