#pragma once

// The job a client submits and the end it gets back, as plain structs
// (no CAF: serve/openai.cpp and its fuzz target use them). Their inspect
// functions, and everything else of the protocol, are in
// actors/protocol/messages.hpp and cluster.hpp.

#include <cstdint>
#include <string>
#include <vector>

#include "actors/core/errors.hpp"

namespace troupe::actors {

using core::error_code;
using core::finish_reason;
using core::to_string;

/// What a media file of a request holds.
enum class media_kind : std::uint8_t { image = 0, audio = 1, video = 2 };
inline const char* to_string(media_kind k) {
  return k == media_kind::image   ? "image"
         : k == media_kind::audio ? "audio clip"
         : k == media_kind::video ? "video"
                                  : "?";
}

/// One encoded media file of a request: an image (PNG or JPEG), an audio
/// clip (WAV, FLAC or MP3) or a video (MP4, WebM, AVI), as its file's bytes.
struct media_data {
  std::string name;  ///< for error messages (a file name)
  std::vector<std::uint8_t> bytes;
  media_kind kind = media_kind::image;
  /// A video's sampling (models::video_sampling): frames spread uniformly
  /// (0: the default, 8), or with fps > 0 one per 1 / fps seconds, at most
  /// num_frames.
  std::int32_t num_frames = 0;
  double fps = 0;
  /// A video's audio track too, through the audio tower: its rows follow
  /// the frames' (vLLM's use_audio_in_video).
  bool audio = false;
  /// An audio clip streamed while the request runs: `bytes` is empty and
  /// the clip comes in audio_chunk messages. At most one per request, the
  /// last of its media; its rows are prefilled as its windows are encoded.
  bool stream = false;
  bool operator==(const media_data&) const = default;
};

/// One message of a chat (OpenAI's messages): its role, text and how many
/// of the job's images, audio clips and videos belong to it (in order; the
/// template puts a turn's images first, then its videos, then its clips,
/// then its text).
struct chat_turn {
  std::string role;
  std::string content;
  std::int32_t images = 0;
  std::int32_t audios = 0;
  std::int32_t videos = 0;
  bool operator==(const chat_turn&) const = default;
};

/// A job as a client submits it: the user's prompt (the head applies the
/// model's chat template when there are images or clips and the prompt has
/// no placeholders, or `chat` is set), its images, audio clips and
/// sampling. `id` is the client's (random; unique per cluster).
struct job_request {
  std::uint64_t id = 0;
  std::string prompt;
  std::string system;
  std::vector<media_data> images;  ///< kind image, one per <image>
  std::vector<media_data> audios;  ///< kind audio, one per <audio>
  std::vector<media_data> videos;  ///< kind video, one per <video>
  bool chat = false;
  bool ignore_eos = false;       ///< decode max_tokens tokens whatever they are
  bool has_temperature = false;  ///< else the model's generation_config decides
  double temperature = 0.0;
  std::int64_t max_tokens = 128;  ///< 0: as many as the context length leaves
  std::uint64_t seed = 0;
  std::vector<std::string> stop_strings;
  std::int64_t deadline_ms = 0;
  /// A whole chat instead of prompt/system (always through the template).
  std::vector<chat_turn> turns;
  bool has_top_p = false;
  double top_p = 1.0;
  bool has_repetition_penalty = false;  ///< else the model's generation_config decides
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;  ///< OpenAI's, over the generated tokens
  double frequency_penalty = 0.0;
  std::vector<std::int64_t> logit_bias_ids;  ///< OpenAI's logit_bias, token by token
  std::vector<double> logit_bias_values;
  std::int64_t min_tokens = 0;               ///< no stop before this many tokens
  std::vector<std::int64_t> stop_token_ids;  ///< stop tokens besides the model's
  /// Logprobs of each sampled token: -1 none; k >= 0: with its k most likely
  /// alternatives (token_event.logprobs).
  std::int32_t logprobs = -1;
  /// The prompt as token ids (/v1/completions), used as they are instead of
  /// `prompt` (no template, no BOS added); no media with them.
  std::vector<std::int32_t> prompt_ids;
  /// The output follows this grammar (GBNF; the gateway compiles JSON
  /// schemas, regexes and choices into it); empty: free text.
  std::string grammar;
  /// Requests with different salts never share cached KV (tenants).
  std::string cache_salt;
  /// vLLM's priority: a lower value is admitted first, and may preempt a
  /// running request of a higher one.
  std::int32_t priority = 0;
  bool operator==(const job_request&) const = default;
};

/// The end of a request: why it ended and what it produced.
struct finish_event {
  std::uint64_t id = 0;
  finish_reason reason = finish_reason::stop;
  /// With reason == error: what kind of failure (invalid_request: the
  /// request's fault, e.g. an image that does not decode; else the server's).
  error_code code = error_code::internal;
  std::string error;  ///< message when reason == error
  std::vector<std::int32_t> tokens;
  std::string text;
  std::int64_t prompt_tokens = 0;
  std::int64_t preemptions = 0;
  std::int64_t cached_tokens = 0;  ///< prompt tokens whose KV came from the prefix cache
  double queue_ms = 0;             ///< submission to admission
  double ttft_ms = 0;              ///< submission to first token
  double total_ms = 0;             ///< submission to end
  bool stop_string = false;        ///< reason == stop because of a stop string (not a stop token)
  double preprocess_ms = 0;        ///< media decoding and preprocessing (all items)
  double encode_ms = 0;            ///< encoder batches this request's media were in
  bool operator==(const finish_event&) const = default;
};

}  // namespace troupe::actors
