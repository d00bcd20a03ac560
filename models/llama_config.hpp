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
  enum class kind : std::uint8_t { none, linear, llama3, yarn, longrope };
  kind type = kind::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;                          ///< llama3
  double high_freq_factor = 4.0;                         ///< llama3
  std::int64_t original_max_position_embeddings = 8192;  ///< llama3, yarn
  // YaRN (transformers' _compute_yarn_parameters; Qwen2.5's long context):
  // frequencies ramp from interpolated (divided by factor) to extrapolated
  // between the dims the two beta rotation counts give, and cos/sin are
  // multiplied by the attention factor.
  double attention_factor = 0;  ///< 0: from factor (and mscale / mscale_all_dim)
  double beta_fast = 32, beta_slow = 1;
  double mscale = 0, mscale_all_dim = 0;
  bool truncate = true;
  // longrope (Phi-3.5, Phi-3 128k): per-frequency divisors for sequences
  // within the original context (short) and past it (long), and the
  // attention factor (in attention_factor, resolved at parse). troupe runs
  // the short ones and refuses positions past the original context:
  // transformers switches every position's rotation to the long factors
  // once a sequence crosses it, which keys already in a KV cache cannot
  // follow.
  std::vector<float> short_factor, long_factor;
};

/// YaRN's per-frequency divisors of the plain inverse frequencies
/// (theta^(-2i/d) / divisor[i] = YaRN's inv_freq[i]; head_dim / 2 of them)
/// and its attention factor, which multiplies cos and sin (so scores by its
/// square).
struct yarn_rope {
  std::vector<float> divisors;
  double attention_factor = 1.0;
};
yarn_rope compute_yarn(const rope_scaling& s, double theta, std::int64_t head_dim);

/// How a checkpoint lays out the two halves RoPE rotates together.
enum class rope_layout : std::uint8_t {
  halves,          ///< HF / neox: x[i] with x[i + d/2]
  adjacent_pairs,  ///< GGUF / Meta: x[2i] with x[2i+1]
};

/// The decoder families troupe runs. LLaMA and the ones that differ from it
/// only in switches of llama_config: Mistral (a sliding window on every
/// layer), Qwen2 (biases on q, k and v), Phi-3 (q, k, v in one matrix and
/// gate, up in another), Gemma 2 (GeGLU, norms on the attention and FFN
/// outputs too, scaled embeddings, soft-capped attention scores and logits,
/// a window on every other layer) and Gemma 3 text (Gemma 2 without the
/// soft-capping, with RMSNorm on each head of q and k, and windowed layers
/// with their own RoPE base between global ones).
enum class decoder_family : std::uint8_t { llama, mistral, qwen2, phi3, gemma2, gemma3 };

/// The family's name as troupe prints it ("llama", "gemma3", ...).
const char* to_string(decoder_family f);

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
  /// Which layers use the window, from transformers' `layer_types` (1 =
  /// "sliding_attention"); when empty, sliding_pattern decides.
  std::vector<std::uint8_t> sliding_layers;
  // Qwen2, Phi-3, Gemma 2 (all off for LLaMA).
  bool qkv_bias = false;     ///< q, k and v projections have biases
  bool fused_qkv = false;    ///< one [q; k; v] matrix and one [gate; up] matrix (Phi-3)
  double attn_scale = 0;     ///< attention score scale; 0: 1/sqrt(head_dim)
  double attn_softcap = 0;   ///< scores become c * tanh(s / c) (0: off)
  double final_softcap = 0;  ///< logits become c * tanh(l / c) (0: off)
  /// Added to every RMSNorm weight at load: HF's Gemma norms multiply by
  /// (1 + w); llama.cpp's converter has already added the 1.
  double norm_offset = 0;

  /// Whether layer `l` attends through the sliding window.
  bool is_sliding(std::int64_t l) const {
    if (sliding_window <= 0) return false;
    if (!sliding_layers.empty())
      return l >= 0 && l < static_cast<std::int64_t>(sliding_layers.size()) &&
             sliding_layers[static_cast<std::size_t>(l)] != 0;
    return sliding_pattern == 0 || l % sliding_pattern != sliding_pattern - 1;
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

/// Parses a Hugging Face `config.json`: LlamaForCausalLM, MistralForCausalLM,
/// Qwen2ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM,
/// or the `text_config` of a LLaVA config. transformers 4.x and 5.x layouts.
result<llama_config> parse_llama_config(std::string_view json_text, const std::string& source);
result<llama_config> load_llama_config(const std::string& path);

/// Reads the metadata of a GGUF file of architecture llama, qwen2, phi3,
/// gemma2 or gemma3, the way llama.cpp reads it.
result<llama_config> llama_config_from_gguf(const gguf_file& f);

result<generation_defaults> parse_generation_config(std::string_view json_text,
                                                    const std::string& source);
/// Missing file = all defaults unset.
result<generation_defaults> load_generation_config(const std::string& path);

/// Reads a whole (small, < 64 MiB) text file.
result<std::string> read_text_file(const std::string& path, std::size_t max_bytes = 64u << 20);

}  // namespace troupe::models
