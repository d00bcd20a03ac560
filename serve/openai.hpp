#pragma once

// The OpenAI-compatible API as plain code: parsing and validating request
// bodies (chat completions with text and base64 `data:` image parts,
// completions), and writing responses, stream chunks and errors in
// OpenAI's JSON. No HTTP here: serve/gateway.cpp serves these; the parsers
// see bytes from the network and never throw or assert on them.

#include <cstdint>
#include <expected>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "actors/protocol/jobs.hpp"
#include "models/grammar.hpp"
#include "models/sampling.hpp"

namespace troupe::serve {

/// An error as OpenAI returns it, with its HTTP status.
struct api_error {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string param;  ///< the offending field, if any
  std::string code;
};
/// {"error": {"message", "type", "param", "code"}}
std::string error_json(const api_error& e);

struct request_limits {
  std::size_t max_messages = 256;
  std::size_t max_images = 16;
  std::size_t max_image_bytes = 32u << 20;  ///< decoded
  std::size_t max_audios = 16;              ///< input_audio parts per request
  std::size_t max_audio_bytes = 32u << 20;  ///< decoded (base64 off)
  std::size_t max_videos = 4;               ///< video_url parts per request
  std::size_t max_video_bytes = 64u << 20;  ///< decoded (or fetched)
  std::int32_t max_video_frames = 64;       ///< num_frames a request may ask for
  std::size_t max_text_bytes = 1u << 20;
  std::int64_t max_tokens = 1 << 16;
  std::size_t max_stops = 16;
  std::int64_t max_n = 16;  ///< choices per request (`n`)
  /// The body's JSON, checked while it is parsed (before a value is built
  /// past them): arrays and objects nested this deep at most, and this many
  /// values in all. A chat request nests about 6 deep.
  std::size_t max_json_depth = 32;
  std::size_t max_json_values = 1u << 20;
  /// http(s) image URLs are accepted (and left for the gateway to fetch);
  /// off: only data: URLs.
  bool remote_images = false;
};

/// A parsed request, ready to become a job.
struct api_request {
  bool chat = true;  ///< /v1/chat/completions (else /v1/completions)
  std::string model;
  bool stream = false;
  bool include_usage = false;  ///< stream_options.include_usage
  /// stream_options.continuous_usage_stats (vLLM's): every chunk carries the
  /// usage so far.
  bool continuous_usage = false;
  std::string echo;    ///< /v1/completions with echo: the prompt, sent before the text
  std::int64_t n = 1;  ///< choices: n jobs, seeds seed, seed + 1, ... (a seed given or not)
  /// Chat tools (tool_choice not "none"): the output's <tool_call> blocks
  /// become tool_calls (and a stream sends a choice's message whole at its end).
  std::vector<models::tool_spec> tools;
  bool tools_active = false;
  bool parallel_tool_calls = true;  ///< false: one call at most, also under "auto"
  actors::job_request job;          ///< id left 0
  /// Images still to fetch: index in job.images (an empty placeholder
  /// there), the URL and the request field it came from.
  struct remote_image {
    std::size_t index = 0;
    std::string url, param;
    bool video = false;  ///< index is then in job.videos
  };
  std::vector<remote_image> remote_images;
  /// /v1/audio/transcriptions: how to answer (json, text, verbose_json,
  /// srt, vtt); empty for the completion endpoints.
  std::string transcription_format;
  /// The language a transcription answers in (verbose_json's `language`).
  std::string transcription_language;
};

/// One part of a multipart/form-data body.
struct form_part {
  std::string name;
  std::string filename;      ///< empty: a plain field
  std::string content_type;  ///< the part's own, if it has one
  std::string_view data;     ///< into the body
};

/// Splits a multipart/form-data body (RFC 7578) by the boundary of
/// `content_type`. Bounded: at most `max_parts` parts, part headers of at
/// most 8 KiB; a malformed body (no boundary, an unterminated part, a part
/// without a name) is an error naming what is wrong.
std::expected<std::vector<form_part>, std::string> parse_form_data(std::string_view content_type,
                                                                   std::string_view body,
                                                                   std::size_t max_parts = 32);

/// OpenAI's /v1/audio/transcriptions (a multipart upload): `file` (WAV,
/// MP3 or FLAC, the job's one clip), `model`, `response_format` (json,
/// text, verbose_json, srt, vtt), `temperature`, `language` (this troupe's
/// models transcribe English: "en" only) and `max_tokens` (troupe's). Fields
/// a transcription cannot honour (`prompt`, `stream`,
/// `timestamp_granularities[]` other than segment, `chunking_strategy`,
/// `include[]`) are refused by name. The job asks the model, as a chat turn
/// with the clip, to "Transcribe the audio."
std::expected<api_request, api_error> parse_transcription_request(
    std::string_view content_type, std::string_view body, const request_limits& limits = {});

/// A transcription's answer in its format: the body and its content type.
/// `seconds`: the clip's duration (the one segment's end).
std::pair<std::string, std::string> transcription_body(const api_request& r,
                                                       const actors::finish_event& f,
                                                       double seconds);

std::expected<api_request, api_error> parse_chat_request(std::string_view body,
                                                         const request_limits& limits = {});
/// A clip streamed after a chat's last message (the WebSocket and gRPC
/// doors): the job gains a streamed audio item, which the chat template
/// places in that message. The request must hold a chat (turns).
void add_streamed_clip(api_request& r);
std::expected<api_request, api_error> parse_completion_request(std::string_view body,
                                                               const request_limits& limits = {});

/// vLLM's /tokenize body: {"prompt": text} or {"messages": [...]} (the
/// chat template applied, with the generation prompt), and `model`. Images
/// are refused (their rows are counted at admission, not here).
std::expected<api_request, api_error> parse_tokenize_request(std::string_view body,
                                                             const request_limits& limits = {});
/// vLLM's /detokenize body: {"tokens": [ids]}, and `model`.
struct detokenize_request {
  std::string model;
  std::vector<std::int32_t> tokens;
};
std::expected<detokenize_request, api_error> parse_detokenize_request(
    std::string_view body, const request_limits& limits = {});

/// The bytes of base64 text (at most `max_bytes` of them; `what` names
/// them in errors: "an image").
std::expected<std::vector<std::uint8_t>, std::string> decode_base64(std::string_view b64,
                                                                    std::size_t max_bytes,
                                                                    std::string_view what);

/// The bytes of a base64 `data:image/...;base64,` URL (`media` "video/":
/// of a `data:video/...;base64,` one).
std::expected<std::vector<std::uint8_t>, std::string> decode_data_url(
    std::string_view url, std::size_t max_bytes, std::string_view media = "image/");

/// The name a model is served under without --served-model-name: the
/// name of its folder or file, less ".gguf" ("/m/Llama-3-8B/" ->
/// "Llama-3-8B").
std::string default_served_name(std::string_view model_path);
/// A request that names a model: nothing when it is `served` (or names
/// none), else OpenAI's 404 model_not_found.
std::optional<api_error> check_model(const std::string& requested, const std::string& served);

/// OpenAI's finish_reason for a troupe finish reason.
std::string finish_reason(actors::finish_reason r);

/// One choice of a response: its job's end and, when asked for, the
/// logprobs of its tokens.
struct choice_output {
  actors::finish_event done;
  std::vector<models::token_logprob> logprobs;
};
/// Tokens of a response (all choices).
struct usage_counts {
  std::int64_t prompt = 0;
  std::int64_t completion = 0;
  /// Prompt tokens whose KV came from the prefix cache, once known (the
  /// request's end); shown as prompt_tokens_details.cached_tokens.
  std::optional<std::int64_t> cached;
};

/// A whole (non-streamed) response: choice i is choices[i].
std::string completion_json(const api_request& r, const std::string& id, std::int64_t created,
                            const std::vector<choice_output>& choices);
/// A chat stream's first chunk of choice `index`: the role, no content yet
/// (OpenAI's `{"role": "assistant", "content": ""}` delta).
std::string role_chunk_json(const api_request& r, const std::string& id, std::int64_t created,
                            std::int64_t index = 0);
/// One stream chunk of choice `index`: `text` as the delta (chat) or text
/// (completion) and the logprobs of the tokens it covers; with `finish` the
/// choice's finish_reason; with `usage` (continuous_usage_stats) the usage
/// so far. `text_offset`: where `text` starts in the choice's text (the
/// completions logprobs' text_offset).
std::string chunk_json(const api_request& r, const std::string& id, std::int64_t created,
                       std::int64_t index, const std::string& text, const std::string& finish,
                       std::span<const models::token_logprob> logprobs = {},
                       const usage_counts* usage = nullptr, std::int64_t text_offset = 0);
/// A reply with tools: the text outside <tool_call> blocks (none when only
/// blanks) and each call's name and arguments (JSON text). A block that is
/// not a call of a known tool stays in the text.
struct tool_reply {
  std::optional<std::string> content;
  std::vector<std::pair<std::string, std::string>> calls;
};
tool_reply parse_tool_calls(const std::string& text, const std::vector<models::tool_spec>& tools);
/// A streamed tools reply of choice `index`, sent whole: its content and
/// tool_calls in one delta; `calls` says whether it had any.
std::string tools_chunk_json(const api_request& r, const std::string& id, std::int64_t created,
                             std::int64_t index, const std::string& text, bool& calls);

/// The usage-only chunk (stream_options.include_usage) after the last choice.
std::string usage_chunk_json(const api_request& r, const std::string& id, std::int64_t created,
                             const usage_counts& usage);

}  // namespace troupe::serve
