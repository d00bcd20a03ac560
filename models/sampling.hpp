#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "models/mapped_file.hpp"

namespace troupe::models {

/// Sampling parameters of one request (OpenAI / llama.cpp meanings).
struct sampling_params {
  double temperature = 0.0;  ///< 0 = greedy
  std::int64_t top_k = 0;    ///< 0 = off
  double top_p = 1.0;        ///< 1 = off
  double min_p = 0.0;        ///< 0 = off
  double repetition_penalty =
      1.0;  ///< 1 = off (HF rule: divide positive logits, multiply negative)
  /// OpenAI's penalties over the tokens generated so far (not the
  /// prompt): a token's logit loses `presence_penalty` once if it was
  /// generated, and `frequency_penalty` times its count ([-2, 2]; 0 = off).
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::uint64_t seed = 0;
  std::int64_t max_tokens = 256;
  std::vector<std::int64_t> stop_token_ids{};
  std::vector<std::string> stop_strings{};
  /// OpenAI's logit_bias: added to these tokens' logits ([-100, 100]).
  std::vector<std::int64_t> bias_ids{};
  std::vector<double> bias_values{};
  /// Stop tokens and stop strings do not end a sequence before it has this
  /// many tokens (vLLM's min_tokens): stop tokens cannot be sampled.
  std::int64_t min_tokens = 0;
  /// Log-probabilities of the sampled tokens (OpenAI's logprobs): -1 off;
  /// k >= 0: each sampled token's and its k most likely alternatives'
  /// (at most max_top_logprobs).
  std::int32_t logprobs = -1;
  static constexpr std::int32_t max_top_logprobs = 20;

  result<void> validate() const;
  /// Whether the sampler needs the sequence's history (prompt and
  /// generated ids).
  bool needs_history() const {
    return repetition_penalty != 1.0 || presence_penalty != 0.0 || frequency_penalty != 0.0;
  }
};

/// A sampled token's log-probability and its most likely alternatives,
/// from the model's raw distribution (log-softmax of the logits, before
/// penalties, bias and temperature: vLLM's raw_logprobs). `piece` and
/// `top_pieces` are the tokens' bytes, filled in by whoever holds the
/// tokenizer.
struct token_logprob {
  std::int32_t token = 0;
  float logprob = 0;
  std::vector<std::int32_t> top_ids;  ///< most likely first (ties: lower id first)
  std::vector<float> top_logprobs;
  std::string piece;
  std::vector<std::string> top_pieces;
  bool operator==(const token_logprob&) const = default;
};

/// `token`'s log-probability under `logits` and the `top` most likely
/// tokens' (a deterministic, sequential sum: the same bits in any batch).
token_logprob logprobs_of(std::span<const float> logits, std::int32_t token, std::int32_t top);

/// Picks tokens for one request. The random draw for the n-th generated
/// token depends only on (seed, n), never on other requests or on timing,
/// so a request samples the same tokens alone or in any batch.
class sampler {
 public:
  static result<sampler> create(const sampling_params& params);
  /// A sampler whose draw counter starts at `draws` (one that continues
  /// where another, which made `draws` draws, left off: the same tokens).
  static result<sampler> resume(const sampling_params& params, std::uint64_t draws);

  /// Chooses the next token from `logits` (vocab floats); `history` holds the
  /// prompt and generated ids (for the penalties; the last `draws()` of
  /// them are the generated ones). Advances the draw counter.
  std::int64_t sample(std::span<const float> logits, std::span<const std::int64_t> history);

  const sampling_params& params() const { return params_; }
  std::uint64_t draws() const { return step_; }

 private:
  explicit sampler(sampling_params p) : params_(std::move(p)) {}
  sampling_params params_;
  std::uint64_t step_ = 0;
  std::vector<std::pair<float, std::int64_t>> scratch_;
  std::vector<float> adjusted_;
  std::vector<double> weights_;        // exp(logit - max) per id (whole-vocabulary sampling)
  std::vector<std::int64_t> counted_;  // generated ids, sorted (presence/frequency penalties)
};

/// A uniform double in [0, 1) from (seed, counter): splitmix64 of both.
double counter_uniform(std::uint64_t seed, std::uint64_t counter);

/// Why a sequence stopped.
enum class stop_reason : std::uint8_t { none, stop_token, stop_string, max_tokens };

/// Tracks generated text against stop tokens, stop strings and max tokens.
/// Text that could still be the start of a stop string is held back, so
/// a stop string never reaches the client.
class stop_checker {
 public:
  explicit stop_checker(const sampling_params& params) : params_(&params) {}
  /// Feeds one token and its decoded text piece; returns text now safe to
  /// emit.
  std::string feed(std::int64_t token, const std::string& piece);
  /// Text still held back (emit it when the sequence ends without a stop string).
  std::string flush();
  stop_reason reason() const { return reason_; }
  std::int64_t generated() const { return generated_; }

 private:
  const sampling_params* params_;
  std::string pending_;
  std::int64_t generated_ = 0;
  stop_reason reason_ = stop_reason::none;
};

}  // namespace troupe::models
