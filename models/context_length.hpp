#pragma once

// The context length a model is served with, and the check every entry
// point makes against it: a request's prompt plus the tokens it may
// generate must fit in the positions the model was trained on (its
// max_position_embeddings, GGUF context_length), or in a shorter limit
// the operator chose (vLLM's --max-model-len).

#include <cstdint>
#include <optional>
#include <string>

#include "models/mapped_file.hpp"

namespace troupe::models {

/// The operator's choice; both default to the model's own length.
struct context_options {
  /// 0: the model's positions. Larger than them is refused unless
  /// `allow_long` is set.
  std::int64_t max_model_len = 0;
  /// Serve past the positions the model was trained on (its output there
  /// is out of distribution): vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN.
  bool allow_long = false;
};

/// The context length to serve a model of `model_positions` positions with.
/// `what` names where the options came from in an error (a flag, a key).
result<std::int64_t> serving_context_length(std::int64_t model_positions,
                                            const context_options& opts, const std::string& what);

/// Nothing when `prompt` tokens plus `max_tokens` fit in `context`; else
/// the sentence that says by how much (OpenAI's context_length_exceeded).
std::optional<std::string> context_overflow(std::int64_t context, std::int64_t prompt,
                                            std::int64_t max_tokens);

}  // namespace troupe::models
