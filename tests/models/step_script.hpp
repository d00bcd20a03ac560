#pragma once
// A scripted run of several sequences through a decoder: chunked prefill of
// prompts of different lengths, then one decode token a step, with the
// sequences sitting out different steps so that every batch mixes prefill
// chunks and decode tokens differently. The token ids are fixed in advance,
// so two runs (a whole model and its pipeline stages, or a run with a KV
// swap and one without) feed exactly the same steps.
#include <algorithm>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "models/llama.hpp"

namespace troupe::test {

struct scripted_sequence {
  std::vector<std::int32_t> tokens;  ///< prompt, then the decode tokens
  std::int64_t prompt = 0;           ///< fed in chunks; the rest one a step
  bool all_logits = false;
  std::int32_t embed_token = -1;  ///< its occurrences take rows of `embeddings`
  std::vector<float> embeddings;
};

/// One sequence's share of a step: tokens [begin, begin + count).
struct scripted_item {
  std::size_t seq = 0;
  std::int64_t begin = 0;
  std::int64_t count = 0;
};
using scripted_step = std::vector<scripted_item>;

/// Random prompts of `prompt_lengths`, `decode` more tokens each; sequence
/// 0 carries input embeddings at `embed_token` (if >= 0), sequence 1 asks
/// for all logits.
inline std::vector<scripted_sequence> make_sequences(std::int64_t vocab, std::int64_t hidden,
                                                     const std::vector<int>& prompt_lengths,
                                                     int decode, std::int32_t embed_token,
                                                     unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> tok(0, static_cast<std::int32_t>(vocab - 1));
  std::uniform_real_distribution<float> val(-0.1f, 0.1f);
  std::vector<scripted_sequence> out;
  for (std::size_t i = 0; i < prompt_lengths.size(); ++i) {
    scripted_sequence s;
    s.prompt = prompt_lengths[i];
    for (int j = 0; j < prompt_lengths[i] + decode; ++j) {
      std::int32_t t = tok(rng);
      if (t == embed_token) t = (t + 1) % static_cast<std::int32_t>(vocab);
      s.tokens.push_back(t);
    }
    if (i == 0 && embed_token >= 0) {
      s.embed_token = embed_token;
      for (int j = 2; j < prompt_lengths[i] && j < 9; ++j)
        s.tokens[static_cast<std::size_t>(j)] = embed_token;
      const auto n = std::count(s.tokens.begin(), s.tokens.end(), embed_token);
      for (std::int64_t r = 0; r < n * hidden; ++r) s.embeddings.push_back(val(rng));
    }
    s.all_logits = i == 1;
    out.push_back(std::move(s));
  }
  return out;
}

/// Prefill in chunks of `chunk`, then decode; sequence i skips the steps
/// where (step + i) % 4 == 3. Every step has at least one item.
inline std::vector<scripted_step> make_schedule(const std::vector<scripted_sequence>& seqs,
                                                std::int64_t chunk) {
  std::vector<std::int64_t> fed(seqs.size(), 0);
  std::vector<scripted_step> steps;
  for (std::size_t step = 0;; ++step) {
    scripted_step s;
    bool left = false;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const auto total = static_cast<std::int64_t>(seqs[i].tokens.size());
      if (fed[i] >= total) continue;
      left = true;
      if ((step + i) % 4 == 3) continue;
      const std::int64_t n = fed[i] < seqs[i].prompt ? std::min(chunk, seqs[i].prompt - fed[i]) : 1;
      s.push_back({i, fed[i], n});
      fed[i] += n;
    }
    if (!left) break;
    if (!s.empty()) steps.push_back(std::move(s));
  }
  return steps;
}

/// The step_input of `item` for the sequence that has id `id` in a cache.
inline models::step_input to_input(const scripted_sequence& s, const scripted_item& item,
                                   models::seq_id id, std::int64_t hidden) {
  models::step_input in;
  in.seq = id;
  in.tokens = std::span<const std::int32_t>(s.tokens).subspan(static_cast<std::size_t>(item.begin),
                                                              static_cast<std::size_t>(item.count));
  in.all_logits = s.all_logits;
  if (s.embed_token >= 0) {
    const auto before = s.tokens.begin() + item.begin;
    const auto rows_before = std::count(s.tokens.begin(), before, s.embed_token);
    const auto rows = std::count(before, before + item.count, s.embed_token);
    in.embed_token = s.embed_token;
    in.embeddings = std::span<const float>(s.embeddings)
                        .subspan(static_cast<std::size_t>(rows_before * hidden),
                                 static_cast<std::size_t>(rows * hidden));
  }
  return in;
}

}  // namespace troupe::test
