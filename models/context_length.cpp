#include "models/context_length.hpp"

namespace troupe::models {

result<std::int64_t> serving_context_length(std::int64_t model_positions,
                                            const context_options& opts, const std::string& what) {
  if (model_positions < 1)
    return make_error(errc::invalid_argument,
                      "the model declares " + std::to_string(model_positions) + " positions");
  if (opts.max_model_len < 0)
    return make_error(errc::invalid_argument, what + ": max_model_len must be positive, not " +
                                                  std::to_string(opts.max_model_len));
  if (opts.max_model_len == 0) {
    if (opts.allow_long)  // a switch with nothing to switch: refused, not ignored
      return make_error(errc::invalid_argument,
                        what + ": allow_long_context without a max_model_len past the model's " +
                            std::to_string(model_positions) + " positions");
    return model_positions;
  }
  if (opts.max_model_len > model_positions && !opts.allow_long)
    return make_error(errc::invalid_argument,
                      what + ": max_model_len " + std::to_string(opts.max_model_len) +
                          " is past the " + std::to_string(model_positions) +
                          " positions the model was trained on (max_position_embeddings); its "
                          "output there is out of distribution. Lower it, or allow it with "
                          "allow_long_context");
  return opts.max_model_len;
}

std::optional<std::string> context_overflow(std::int64_t context, std::int64_t prompt,
                                            std::int64_t max_tokens) {
  if (context <= 0 || prompt + max_tokens <= context) return std::nullopt;
  if (prompt >= context)
    return "this model's maximum context length is " + std::to_string(context) +
           " tokens; the prompt alone holds " + std::to_string(prompt) + ". Shorten the prompt";
  return "this model's maximum context length is " + std::to_string(context) +
         " tokens; the request needs " + std::to_string(prompt + max_tokens) + " (" +
         std::to_string(prompt) + " in the prompt, " + std::to_string(max_tokens) +
         " to generate). Shorten the prompt or lower max_tokens";
}

}  // namespace troupe::models
