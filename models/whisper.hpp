#pragma once

// A Whisper-architecture audio encoder (HF `WhisperEncoder`) and the audio
// projector that maps its frames into a decoder's embedding space.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kernels/device.hpp"
#include "kernels/ops.hpp"
#include "models/clip.hpp"
#include "models/weights.hpp"

namespace troupe::models {

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

/// Whisper's encoder: two convolutions over the log-mel frames (kernel 3,
/// padding 1; the second of stride 2), each followed by the activation,
/// plus the learned (sinusoid-initialized) positions, then pre-LN
/// transformer layers (LayerNorm -> self-attention with biased q/v/out and
/// an unbiased k projection -> residual -> LayerNorm -> fc1 -> activation
/// -> fc2 -> residual) and a final LayerNorm.
///
/// Unlike transformers' WhisperEncoder, which takes exactly
/// 2 x max_source_positions frames, any frame count up to that is taken:
/// the output has ceil(frames / 2) rows, at positions 0, 1, ... (a shorter
/// clip, or a chunk of a stream). With the whole window both agree. Each
/// clip's output is bit-identical whatever its batch-mates.
class whisper_encoder {
 public:
  /// Loads the encoder's tensors (canonical names "audio.*"); matrices are
  /// converted as `plan` chooses, convolutions, positions, norms and biases
  /// stay f32.
  static result<std::unique_ptr<whisper_encoder>> build(const weight_source& src,
                                                        const whisper_encoder_config& cfg,
                                                        kernels::device& dev,
                                                        const quant_plan& plan);

  const whisper_encoder_config& config() const { return cfg_; }

  /// Output rows for `frames` input frames.
  static std::int64_t rows_for(std::int64_t frames) { return (frames + 1) / 2; }

  /// features f32 [N, num_mel_bins, frames] (contiguous, finite; 1 <=
  /// frames <= max_frames()) -> f32 [N, rows_for(frames), d_model].
  result<kernels::tensor> forward(kernels::device& dev, const kernels::tensor& features) const;

  std::string describe() const;

 private:
  struct layer {
    linear_layer q, k, v, o, fc1, fc2;
    kernels::tensor norm1_w, norm1_b, norm2_w, norm2_b;
  };
  whisper_encoder() = default;

  whisper_encoder_config cfg_;
  kernels::matrix conv1_, conv2_;  // [d_model, in_channels * 3], (channel, tap) order
  kernels::tensor conv1_b_, conv2_b_, positions_, norm_w_, norm_b_;
  std::vector<layer> layers_;
};

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

class audio_projector {
 public:
  /// Loads "audio_projector.linear_{1,2}" for encoder rows of `in` features.
  static result<std::unique_ptr<audio_projector>> build(const weight_source& src,
                                                        const audio_projector_config& cfg,
                                                        std::int64_t in, kernels::device& dev,
                                                        const quant_plan& plan);
  const audio_projector_config& config() const { return cfg_; }
  /// rows f32 [N, R, in] -> [N, tokens_for(R), out].
  result<kernels::tensor> forward(kernels::device& dev, const kernels::tensor& rows) const;

 private:
  audio_projector() = default;
  audio_projector_config cfg_;
  std::int64_t in_ = 0;
  linear_layer l1_, l2_;
};

}  // namespace troupe::models
