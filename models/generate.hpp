#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/llama.hpp"
#include "models/sampling.hpp"

namespace troupe::models {

/// One generation request: prompt token ids and sampling parameters.
struct generation_request {
  std::vector<std::int32_t> prompt;
  sampling_params params;
  /// Optional image features (e.g. llava_prompt): the prompt tokens equal to
  /// `image_token` take, in order, consecutive rows of `image_embeds`
  /// (hidden_size floats each) as their input embeddings. -1 = none.
  std::int32_t image_token = -1;
  std::vector<float> image_embeds{};
};

/// What came out, with llama.cpp-style timings.
struct generation_result {
  std::vector<std::int32_t> tokens;  ///< generated ids (stop token included if hit)
  std::string text;                  ///< generated text, stop string removed
  stop_reason reason = stop_reason::none;
  std::int64_t prompt_tokens = 0;
  double prompt_seconds = 0;  ///< until the first token's logits
  double decode_seconds = 0;  ///< the rest
};

/// Turns token ids into text pieces, statefully (a streaming detokenizer).
using piece_fn = std::function<std::string(std::int32_t)>;
/// Receives text as soon as it is safe to show (request index, text).
using text_fn = std::function<void(std::size_t, const std::string&)>;

/// Options of the batch loop.
struct generate_options {
  std::int64_t prefill_chunk = 512;  ///< prompt tokens per sequence per step
  kv_options kv;
  kernels::attention_options attention;
};

/// Runs several requests together with continuous batching: each step
/// carries every unfinished sequence (a prefill chunk or one decode token).
/// A request's tokens do not depend on the others (batch-invariant kernels,
/// per-request random streams). `pieces[i]` decodes request i's tokens.
result<std::vector<generation_result>> generate_batch(
    kernels::device& dev, const llama_model& model, const std::vector<generation_request>& requests,
    std::vector<piece_fn> pieces, const text_fn& on_text, const generate_options& opts = {});

}  // namespace troupe::models
