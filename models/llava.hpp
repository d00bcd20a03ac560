#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/device.hpp"
#include "models/clip.hpp"
#include "models/llama.hpp"
#include "models/llava_config.hpp"
#include "models/weights.hpp"
#include "models/whisper.hpp"

namespace troupe::models {

/// A prompt ready for the decoder: image and audio tokens expanded, their
/// features computed. Feed `tokens` with `image_embeds` (as a
/// generation_request's prompt / image_embeds / image_token, or a
/// step_input's tokens / embeddings / embed_token). Audio positions are
/// marked with `image_token` too: the rows of every image and clip, in
/// prompt order, replace the marked positions' embeddings.
struct llava_prompt {
  std::vector<std::int32_t> tokens;
  std::vector<float> image_embeds;  ///< [media rows, text hidden], row-major, in prompt order
  std::int32_t image_token = -1;
};

/// Replaces each `image_token` of `ids` by `tokens_per_image` copies and
/// audio token k (`audio_token`, -1: none) by `audio_tokens[k]` copies of
/// `image_token` (the one marker of media rows). The counts of placeholders
/// must equal the images and clips given (else invalid_argument naming
/// both).
result<std::vector<std::int32_t>> expand_media_tokens(
    std::span<const std::int32_t> ids, std::int32_t image_token, std::int64_t tokens_per_image,
    std::int64_t n_images, std::int32_t audio_token, std::span<const std::int64_t> audio_tokens);
/// The same with videos: video token k (`video_token`, -1: none) becomes
/// `video_tokens[k]` copies of `image_token` (its frames' rows).
result<std::vector<std::int32_t>> expand_media_tokens(
    std::span<const std::int32_t> ids, std::int32_t image_token, std::int64_t tokens_per_image,
    std::int64_t n_images, std::int32_t audio_token, std::span<const std::int64_t> audio_tokens,
    std::int32_t video_token, std::span<const std::int64_t> video_tokens);

/// Replaces each `image_token` of `ids` by `tokens_per_image` copies. The
/// count of image tokens must equal `n_images` (else invalid_argument
/// naming both counts).
result<std::vector<std::int32_t>> expand_image_tokens(std::span<const std::int32_t> ids,
                                                      std::int32_t image_token,
                                                      std::int64_t tokens_per_image,
                                                      std::int64_t n_images);

/// `LlavaForConditionalGeneration`: a CLIP vision tower, the multi-modal
/// projector (linear -> GELU -> linear) and a LLaMA decoder whose input
/// embeddings at the image tokens are the projected image features.
class llava_model {
 public:
  /// Loads a Hugging Face folder (config.json + safetensors), converting
  /// matrices per `plan` (component patterns "vision.*", "projector.*",
  /// "text.*"; see quant_plan).
  static result<std::unique_ptr<llava_model>> load(const std::string& path, kernels::device& dev,
                                                   const quant_plan& plan = {});
  /// Builds from an open source and a parsed config.
  static result<std::unique_ptr<llava_model>> build(const weight_source& src,
                                                    const llava_config& cfg, kernels::device& dev,
                                                    const quant_plan& plan);

  const llava_config& config() const { return cfg_; }
  /// The decoder (for forward / generate_batch / make_cache).
  const llama_model& language_model() const { return *text_; }
  const clip_vision_tower& vision_tower() const { return *vision_; }
  std::int64_t tokens_per_image() const { return cfg_.tokens_per_image(); }
  std::int32_t image_token() const { return static_cast<std::int32_t>(cfg_.image_token_index); }
  /// Expected pixel_values extents: [N, channels(), image_size(), image_size()].
  std::int64_t image_size() const { return cfg_.vision.image_size; }
  std::int64_t channels() const { return cfg_.vision.num_channels; }

  /// The selected vision features: hidden_states[vision_feature_layer] with
  /// the select strategy applied, f32 [N * tokens_per_image, vision hidden].
  result<kernels::tensor> vision_features(kernels::device& dev, const kernels::tensor& pixel_values,
                                          const clip_options& opts = {}) const;
  /// The projector: f32 [rows, vision hidden] -> f32 [rows, text hidden].
  result<kernels::tensor> project(kernels::device& dev, const kernels::tensor& features) const;
  /// vision_features then project: pixel_values f32 [N, 3, H, W] ->
  /// f32 [N * tokens_per_image, text hidden], image n at rows
  /// [n * tokens_per_image, (n + 1) * tokens_per_image). Each image's rows
  /// are bit-identical whatever its batch-mates.
  result<kernels::tensor> encode_images(kernels::device& dev, const kernels::tensor& pixel_values,
                                        const clip_options& opts = {}) const;
  /// expand_image_tokens with this model's image token and tokens per image.
  result<std::vector<std::int32_t>> expand_image_tokens(std::span<const std::int32_t> ids,
                                                        std::int64_t n_images) const;
  /// Expands `ids` (one image token per image, in order) and encodes
  /// `pixel_values` (one image per image token; N = 0 is allowed when `ids`
  /// hold no image token: pass an empty tensor).
  result<llava_prompt> prepare(kernels::device& dev, std::span<const std::int32_t> ids,
                               const kernels::tensor& pixel_values,
                               const clip_options& opts = {}) const;

  // -- audio (a config with audio_config) ----------------------------------

  bool has_audio() const { return audio_ != nullptr; }
  /// The `<audio>` placeholder's id (-1: the model does not hear).
  std::int32_t audio_token() const {
    return cfg_.audio ? static_cast<std::int32_t>(cfg_.audio->token_index) : -1;
  }
  /// Rows (LLM tokens) a clip of `samples` samples at 16 kHz becomes.
  std::int64_t audio_tokens(std::int64_t samples) const {
    return cfg_.audio ? cfg_.audio->tokens_for_samples(samples) : 0;
  }
  const whisper_encoder& audio_encoder() const { return *audio_; }
  /// A clip (mono, 16 kHz) -> f32 [audio_tokens(samples), text hidden]:
  /// the clip in windows of 2 x max_source_positions frames, each window's
  /// log-mel features (its own, unpadded), the encoder, the projector. A
  /// clip shorter than one hop (10 ms) is refused.
  result<kernels::tensor> encode_audio(kernels::device& dev, std::span<const float> samples) const;
  /// What encode_audio does in parts, for an encoder that batches windows
  /// of many clips: a clip's windows (each at least one frame long; the
  /// rows of the clip are theirs in order) ...
  std::vector<std::span<const float>> audio_windows(std::span<const float> samples) const;
  /// ... a window's frames and its log-mel features, f32 [num_mel_bins,
  /// frames] row-major ...
  std::int64_t audio_frames(std::int64_t window_samples) const;
  std::vector<float> audio_features(std::span<const float> window) const;
  /// ... and N windows of one frame count, features f32 [N, num_mel_bins,
  /// frames] on the host, through the encoder and the projector: f32 [N,
  /// tokens, text hidden]. A window's rows do not depend on its batch-mates.
  result<kernels::tensor> encode_audio_windows(kernels::device& dev,
                                               const kernels::tensor& features) const;
  /// prepare() with clips too: `ids` hold one image token per image and one
  /// audio token per clip, in any order.
  result<llava_prompt> prepare(kernels::device& dev, std::span<const std::int32_t> ids,
                               const kernels::tensor& pixel_values,
                               const std::vector<std::span<const float>>& clips,
                               const clip_options& opts = {}) const;

  // -- video (a config with video_token_index) -----------------------------

  bool has_video() const { return cfg_.video.has_value(); }
  /// The `<video>` placeholder's id (-1: the model takes no video).
  std::int32_t video_token() const {
    return cfg_.video ? static_cast<std::int32_t>(cfg_.video->token_index) : -1;
  }
  /// Rows one frame becomes (its pooled grid and, with
  /// video_frame_newline, the newline row).
  std::int64_t tokens_per_frame() const { return cfg_.tokens_per_frame(); }
  /// Pools frames' vision features (f32 [F * tokens_per_image, vision
  /// hidden], vision_features' layout) over spatial_pool_stride windows of
  /// each frame's patch grid: f32 [F * pooled, vision hidden] on `dev`.
  result<kernels::tensor> pool_frames(kernels::device& dev, const kernels::tensor& features) const;
  /// Frames' vision features -> their rows: pooled, projected, each
  /// frame's rows followed by the newline row: f32 [F * tokens_per_frame,
  /// text hidden]. A frame's rows do not depend on the other frames.
  result<kernels::tensor> frame_rows(kernels::device& dev, const kernels::tensor& features) const;
  /// vision_features then frame_rows: pixel_values f32 [F, 3, H, W] (a
  /// video's sampled frames, preprocessed as images) -> f32 [F *
  /// tokens_per_frame, text hidden].
  result<kernels::tensor> encode_frames(kernels::device& dev, const kernels::tensor& pixel_values,
                                        const clip_options& opts = {}) const;
  /// prepare() with clips and videos: `ids` hold one image, audio or video
  /// token per item, in any order; `videos` holds each video's frames as
  /// pixel_values [F, 3, H, W]; `video_sounds` (empty, or one per video)
  /// each video's audio track to hear too (mono, 16 kHz; an empty span:
  /// none), whose rows follow its frames'.
  result<llava_prompt> prepare(kernels::device& dev, std::span<const std::int32_t> ids,
                               const kernels::tensor& pixel_values,
                               const std::vector<std::span<const float>>& clips,
                               const std::vector<kernels::tensor>& videos,
                               const clip_options& opts = {},
                               const std::vector<std::span<const float>>& video_sounds = {}) const;

  /// Summary of each component's precision.
  std::string describe() const;

 private:
  llava_model() = default;
  /// Images in `pixel_values` ([N, C, S, S]; empty: 0), or an error.
  result<std::int64_t> count_images(const kernels::tensor& pixel_values) const;
  llava_config cfg_;
  std::unique_ptr<clip_vision_tower> vision_;
  linear_layer proj1_, proj2_;
  std::unique_ptr<llama_model> text_;
  std::unique_ptr<whisper_encoder> audio_;
  std::unique_ptr<audio_projector> audio_proj_;
  std::unique_ptr<log_mel> mel_;
  kernels::tensor newline_;  ///< f32 [1, text hidden] on the device (video_frame_newline)
};

}  // namespace troupe::models
