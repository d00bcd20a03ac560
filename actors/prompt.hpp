#pragma once

// Turning a user's prompt into the model's tokens, where the model is: the
// chat template (with one image placeholder per image), BOS, and the
// sampling defaults of generation_config.json with every stop token. Used
// by the cluster's head for jobs that clients submit (a client holds no
// model) and by `troupe generate`.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cluster/manifest.hpp"
#include "kernels/status.hpp"
#include "models/audio.hpp"
#include "models/chat_template.hpp"
#include "models/llama_config.hpp"
#include "models/llava_config.hpp"
#include "models/sampling.hpp"
#include "models/tokenizer.hpp"
#include "models/video.hpp"

namespace troupe::actors {

struct prompt_setup {
  std::shared_ptr<const models::tokenizer> tok;
  std::optional<models::llava_config> llava;  ///< set for a vision model
  models::generation_defaults defaults;       ///< generation_config.json (HF folders)
  std::vector<std::int64_t>
      stop_ids;               ///< every end-of-sequence id (config, generation config, tokenizer)
  std::string image_text;     ///< the image placeholder's text ("<image>")
  std::string audio_text;     ///< the audio placeholder's text ("<audio>"; empty: deaf model)
  std::string video_text;     ///< the video placeholder's text ("<video>"; empty: no video)
  models::llama_config text;  ///< the decoder's config
  /// What an audio clip may be (checked before decoding, when the prompt
  /// worker counts a clip's tokens).
  models::audio_limits audio_limits;
  /// What a video may be (checked on its headers when the prompt worker
  /// counts its frames).
  models::video_limits video_limits;
  /// Frames sampled from a video whose request names none (the manifest's
  /// [media] video_frames).
  std::int32_t video_frames = 8;
  /// Media a request may hold ([media] max_images, max_audios, max_videos;
  /// vLLM's limit_mm_per_prompt): more is refused by name.
  std::int64_t max_images = 1 << 20, max_audios = 1 << 20, max_videos = 1 << 20;
};

/// The manifest's [media] limits on a prompt setup (and the video limits an
/// encoder applies).
void apply_media_limits(prompt_setup& s, const cluster::media_entry& m);
models::video_limits video_limits_of(const cluster::media_entry& m);

/// Reads the tokenizer, configs and generation defaults of a model (a HF
/// folder or GGUF file).
kernels::result<prompt_setup> load_prompt_setup(const std::string& model);

struct prompt_input {
  std::string prompt;
  std::string system;
  std::string chat_template;  ///< a template name; empty: the model's own
  int images = 0;
  int audios = 0;  ///< audio clips (the model's audio placeholder in the prompt, or the template's)
  int videos = 0;  ///< videos (likewise)
  bool chat =
      false;  ///< apply the chat template (always with images and no placeholder in the prompt)
  bool no_bos = false;
  /// A whole chat instead of prompt/system (the template always applies;
  /// `images`, `audios` and `videos` are then the sums of the messages').
  std::vector<models::chat_message> messages;
};

/// The prompt's token ids. Errors (invalid_argument) are the user's: a
/// placeholder count that does not match the images, images for a text
/// model, an unknown template, an empty prompt.
/// With `text`, the prompt's text (after the template) goes there too.
kernels::result<std::vector<std::int32_t>> render_prompt(const prompt_setup& s,
                                                         const prompt_input& in,
                                                         std::string* text = nullptr);

/// Greedy-or-as-configured sampling: generation_config.json's defaults
/// (temperature only where it samples), max_tokens, and the stop ids.
models::sampling_params default_sampling(const prompt_setup& s, std::int64_t max_tokens);

}  // namespace troupe::actors
