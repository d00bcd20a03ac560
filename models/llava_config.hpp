#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <optional>

#include "kernels/ops.hpp"
#include "models/llama_config.hpp"
#include "models/log_mel.hpp"
#include "models/whisper_config.hpp"

namespace troupe::models {

/// The vision tower hyper-parameters of a CLIP ViT (HF `CLIPVisionConfig`)
/// or a SigLIP one (`SiglipVisionConfig`), validated. Absent fields take the
/// class's defaults.
struct clip_vision_config {
  /// SigLIP: no class token, no pre-LayerNorm, a bias on the patch
  /// embedding, tanh-GELU and LayerNorm eps 1e-6 by default.
  bool siglip = false;
  std::int64_t hidden_size = 768;
  std::int64_t intermediate_size = 3072;
  std::int64_t num_layers = 12;
  std::int64_t num_heads = 12;
  std::int64_t head_dim = 64;  ///< hidden_size / num_heads
  std::int64_t image_size = 224;
  std::int64_t patch_size = 32;
  std::int64_t num_channels = 3;
  kernels::gelu_kind activation = kernels::gelu_kind::quick;  ///< hidden_act
  double layer_norm_eps = 1e-5;

  /// Patches along one side of the image.
  std::int64_t patches_per_side() const { return image_size / patch_size; }
  /// Patches of one image (the class token not included).
  std::int64_t num_patches() const { return patches_per_side() * patches_per_side(); }
  /// Rows the tower gives per image: the class token (CLIP) and the patches.
  std::int64_t positions() const { return num_patches() + (siglip ? 0 : 1); }
  /// Checks ranges and divisibility; the message names `source` and the field.
  result<void> validate(const std::string& source) const;
};

/// Which vision-tower rows become image tokens.
enum class vision_select : std::uint8_t {
  drop_cls,  ///< "default": the first row dropped (CLIP's class token; SigLIP's first patch, as
             ///< transformers does)
  full,      ///< "full": every row
};

/// The audio side of a LLaVA config that also hears (troupe's extension:
/// `audio_config`, a Whisper encoder config, plus `audio_token_index`,
/// `audio_stack_factor`, `audio_projector_hidden`,
/// `audio_projector_hidden_act` and `audio_projector_bias` at the top level;
/// weights `audio_tower.*` and `audio_projector.linear_{1,2}`).
struct audio_tower_config {
  whisper_encoder_config encoder;
  audio_projector_config projector;  ///< out: the text hidden size
  std::int64_t token_index = -1;     ///< the `<audio>` placeholder's id
  /// The features: Whisper's extractor (16 kHz, n_fft 400, hop 160) with
  /// num_mel_bins bins, on each window's own samples (no padding).
  mel_options features;

  /// Samples of one encoder window (2 x max_source_positions frames).
  std::int64_t window_samples() const {
    return encoder.max_frames() * static_cast<std::int64_t>(features.hop_length);
  }
  /// Audio tokens for a clip of `samples` samples at 16 kHz: each window's
  /// ceil(ceil(frames / 2) / stack), the clip cut into whole windows and a
  /// last, shorter one (a tail under one hop gives none).
  std::int64_t tokens_for_samples(std::int64_t samples) const;
};

/// How a model sees video (troupe's keys in a LLaVA config.json, named
/// after transformers' LlavaNextVideoConfig where it has them): each
/// sampled frame through the vision tower (with the images of the same
/// batch), its patch grid pooled (LlavaNextVideoPooler: spatial_pool_stride
/// x spatial_pool_stride windows, floor), then the projector; with
/// `frame_newline`, the learned row `image_newline` after each frame's rows
/// (LLaVA-NeXT's mm_newline_position "frame") separates the frames.
enum class video_pool { average, max };
struct video_config {
  std::int64_t token_index = -1;          ///< video_token_index: the <video> placeholder
  std::int64_t pool_stride = 2;           ///< spatial_pool_stride
  video_pool pool = video_pool::average;  ///< spatial_pool_mode
  bool frame_newline = false;             ///< video_frame_newline
};

/// A `LlavaForConditionalGeneration` config: CLIP or SigLIP vision tower,
/// projector and a LLaMA, Mistral or Qwen2 text model, validated.
struct llava_config {
  clip_vision_config vision;
  llama_config text;
  std::int64_t image_token_index = 32000;
  kernels::gelu_kind projector_activation = kernels::gelu_kind::erf;
  /// Index into the vision tower's hidden states (hidden_states[0] is the
  /// embeddings after pre_layrnorm, [i] the output of encoder layer i-1);
  /// negative counts from the end (-1 = the last layer's output).
  std::int64_t vision_feature_layer = -2;
  vision_select select = vision_select::drop_cls;
  bool projector_bias = true;               ///< multimodal_projector_bias
  std::optional<audio_tower_config> audio;  ///< with `audio_config`
  std::optional<video_config> video;        ///< with `video_token_index`

  /// Encoder layers the features need (layers past them are never run).
  std::int64_t vision_layers_used() const;
  /// Rows (LLM tokens) one image becomes.
  std::int64_t tokens_per_image() const;
  /// The side of the vision tower's patch grid (tokens_per_image = side^2
  /// without CLS).
  std::int64_t patch_grid() const;
  /// Rows one video frame becomes: the pooled grid, plus the newline row
  /// (0 when the model takes no video).
  std::int64_t tokens_per_frame() const;
  result<void> validate(const std::string& source) const;
};

/// Maps a Hugging Face activation name (`hidden_act`,
/// `projector_hidden_act`) to a GELU variant: gelu / gelu_python (erf),
/// gelu_new / gelu_pytorch_tanh / gelu_fast / gelu_accurate (tanh),
/// quick_gelu. Anything else is unsupported_op naming `field`.
result<kernels::gelu_kind> gelu_from_hf_name(std::string_view name, const std::string& field);

/// Parses a Hugging Face LLaVA `config.json` (architectures
/// LlavaForConditionalGeneration or model_type llava). Absent fields take
/// transformers' defaults (LlavaConfig, CLIPVisionConfig, LlamaConfig);
/// vision_config and text_config must be present.
result<llava_config> parse_llava_config(std::string_view json_text, const std::string& source);
result<llava_config> load_llava_config(const std::string& path);

/// Whether a config.json text names a LLaVA model (for callers choosing a loader).
bool is_llava_config(std::string_view json_text);

}  // namespace troupe::models
