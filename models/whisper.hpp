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
#include "models/whisper_config.hpp"

namespace troupe::models {

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
  whisper_encoder() = default;

  whisper_encoder_config cfg_;
  kernels::matrix conv1_, conv2_;  // [d_model, in_channels * 3], (channel, tap) order
  kernels::tensor conv1_b_, conv2_b_, positions_, norm_w_, norm_b_;
  std::vector<encoder_layer> layers_;
};

/// The audio projector of an audio_projector_config (models/whisper_config.hpp).
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
