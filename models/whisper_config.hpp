#pragma once

// The settings of a Whisper-architecture audio encoder and of the audio
// projector (models/whisper.hpp runs them), apart so that model configs
// (models/llava_config.hpp) can hold them.

#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/ops.hpp"
#include "kernels/status.hpp"

namespace troupe::models {

using kernels::errc;
using kernels::make_error;
using kernels::result;

/// The encoder half of a HF `WhisperConfig`, validated. Absent fields take
/// WhisperConfig's defaults.
struct whisper_encoder_config {
  std::int64_t d_model = 256;
  std::int64_t encoder_layers = 4;
  std::int64_t encoder_attention_heads = 4;
  std::int64_t encoder_ffn_dim = 1536;
  std::int64_t num_mel_bins = 80;
  /// Encoder positions: the features of one window are 2 x this many frames
  /// (the second convolution halves them).
  std::int64_t max_source_positions = 1500;
  kernels::gelu_kind activation = kernels::gelu_kind::erf;  ///< activation_function
  double layer_norm_eps = 1e-5;  ///< torch's LayerNorm default, which Whisper keeps

  std::int64_t head_dim() const { return d_model / encoder_attention_heads; }
  /// Feature frames of a whole window.
  std::int64_t max_frames() const { return 2 * max_source_positions; }
  result<void> validate(const std::string& source) const;
};

/// Parses a Whisper `config.json` (model_type "whisper"), or the
/// `audio_config` object of a model that nests one. Settings the encoder
/// would need and this one does not implement (scale_embedding = true,
/// another model_type) are refused by name.
result<whisper_encoder_config> parse_whisper_encoder_config(std::string_view json_text,
                                                            const std::string& source);
result<whisper_encoder_config> load_whisper_encoder_config(const std::string& path);

/// The audio projector (the Ultravox layout): `stack` consecutive encoder
/// rows concatenated (the last group padded with zero rows), then
/// linear_1 -> activation -> linear_2 into the decoder's hidden size.
struct audio_projector_config {
  std::int64_t stack = 4;   ///< encoder rows per audio token
  std::int64_t hidden = 0;  ///< linear_1's outputs (0: the decoder's hidden size)
  std::int64_t out = 0;     ///< the decoder's hidden size
  kernels::gelu_kind activation = kernels::gelu_kind::erf;
  bool bias = true;

  /// Audio tokens for `rows` encoder rows.
  std::int64_t tokens_for(std::int64_t rows) const { return (rows + stack - 1) / stack; }
  result<void> validate(const std::string& source) const;
};

}  // namespace troupe::models
