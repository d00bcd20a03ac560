#include "models/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace troupe::models {

result<void> sampling_params::validate() const {
  if (!(temperature >= 0 && temperature <= 100))
    return make_error(errc::invalid_argument, "temperature must be in [0, 100]");
  if (top_k < 0) return make_error(errc::invalid_argument, "top_k must be >= 0");
  if (!(top_p > 0 && top_p <= 1))
    return make_error(errc::invalid_argument, "top_p must be in (0, 1]");
  if (!(min_p >= 0 && min_p < 1))
    return make_error(errc::invalid_argument, "min_p must be in [0, 1)");
  if (!(repetition_penalty > 0 && repetition_penalty <= 10))
    return make_error(errc::invalid_argument, "repetition_penalty must be in (0, 10]");
  if (max_tokens < 1) return make_error(errc::invalid_argument, "max_tokens must be >= 1");
  if (!(presence_penalty >= -2 && presence_penalty <= 2))
    return make_error(errc::invalid_argument, "presence_penalty must be in [-2, 2]");
  if (!(frequency_penalty >= -2 && frequency_penalty <= 2))
    return make_error(errc::invalid_argument, "frequency_penalty must be in [-2, 2]");
  if (bias_ids.size() != bias_values.size())
    return make_error(errc::invalid_argument, "logit_bias: ids and values differ in number");
  for (double b : bias_values)
    if (!(b >= -100 && b <= 100))
      return make_error(errc::invalid_argument, "logit_bias values must be in [-100, 100]");
  for (auto id : bias_ids)
    if (id < 0) return make_error(errc::invalid_argument, "logit_bias token ids must be >= 0");
  for (auto id : stop_token_ids)
    if (id < 0) return make_error(errc::invalid_argument, "stop token ids must be >= 0");
  if (min_tokens < 0 || min_tokens > max_tokens)
    return make_error(errc::invalid_argument, "min_tokens must be in [0, max_tokens]");
  for (const auto& s : stop_strings)
    if (s.empty()) return make_error(errc::invalid_argument, "stop strings must not be empty");
  if (logprobs < -1 || logprobs > max_top_logprobs)
    return make_error(errc::invalid_argument,
                      "top logprobs must be in [0, " + std::to_string(max_top_logprobs) + "]");
  return {};
}

token_logprob logprobs_of(std::span<const float> logits, std::int32_t token, std::int32_t top) {
  token_logprob out;
  out.token = token;
  if (logits.empty()) return out;
  float mx = -std::numeric_limits<float>::infinity();
  for (float v : logits) mx = std::max(mx, v);
  double sum = 0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  const double log_z = static_cast<double>(mx) + std::log(sum);
  auto lp = [&](std::int64_t id) {
    return static_cast<float>(static_cast<double>(logits[static_cast<std::size_t>(id)]) - log_z);
  };
  const auto n = static_cast<std::int64_t>(logits.size());
  if (token >= 0 && token < n) out.logprob = lp(token);
  const auto k = std::min<std::int64_t>(std::max<std::int32_t>(top, 0), n);
  if (k == 0) return out;
  // The k largest by a sequential scan (k is small): higher logit first,
  // the lower id on a tie.
  std::vector<std::int64_t> best;
  best.reserve(static_cast<std::size_t>(k) + 1);
  auto before = [&](std::int64_t a, std::int64_t b) {
    const float x = logits[static_cast<std::size_t>(a)], y = logits[static_cast<std::size_t>(b)];
    return x > y || (x == y && a < b);
  };
  for (std::int64_t id = 0; id < n; ++id) {
    if (static_cast<std::int64_t>(best.size()) == k && !before(id, best.back())) continue;
    auto at = std::upper_bound(best.begin(), best.end(), id, before);
    best.insert(at, id);
    if (static_cast<std::int64_t>(best.size()) > k) best.pop_back();
  }
  for (auto id : best) {
    out.top_ids.push_back(static_cast<std::int32_t>(id));
    out.top_logprobs.push_back(lp(id));
  }
  return out;
}

double counter_uniform(std::uint64_t seed, std::uint64_t counter) {
  auto mix = [](std::uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const std::uint64_t r = mix(mix(seed) ^ counter);
  return static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);
}

result<sampler> sampler::create(const sampling_params& params) {
  if (auto r = params.validate(); !r) return std::unexpected(r.error());
  return sampler(params);
}

result<sampler> sampler::resume(const sampling_params& params, std::uint64_t draws) {
  auto s = create(params);
  if (s) s->step_ = draws;
  return s;
}

std::int64_t sampler::sample(std::span<const float> logits, std::span<const std::int64_t> history) {
  const auto n = static_cast<std::int64_t>(logits.size());
  const std::uint64_t draw = step_++;
  if (n == 0) return -1;
  adjusted_.assign(logits.begin(), logits.end());
  for (auto& v : adjusted_)
    if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();
  if (params_.repetition_penalty != 1.0) {
    const auto p = static_cast<float>(params_.repetition_penalty);
    // Each distinct id once, as HF's gather/scatter does.
    std::vector<std::int64_t> seen(history.begin(), history.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (auto id : seen) {
      if (id < 0 || id >= n) continue;
      float& v = adjusted_[static_cast<std::size_t>(id)];
      v = v > 0 ? v / p : v * p;
    }
  }
  if (params_.presence_penalty != 0.0 || params_.frequency_penalty != 0.0) {
    // OpenAI's rule over the generated tokens (the last `draw` of history):
    // logit -= count * frequency + (count > 0) * presence.
    const auto gen = std::min<std::size_t>(draw, history.size());
    counted_.assign(history.end() - static_cast<std::ptrdiff_t>(gen), history.end());
    std::sort(counted_.begin(), counted_.end());
    for (std::size_t i = 0; i < counted_.size();) {
      std::size_t j = i;
      while (j < counted_.size() && counted_[j] == counted_[i]) ++j;
      const auto id = counted_[i];
      if (id >= 0 && id < n)
        adjusted_[static_cast<std::size_t>(id)] -= static_cast<float>(
            static_cast<double>(j - i) * params_.frequency_penalty + params_.presence_penalty);
      i = j;
    }
  }
  for (std::size_t i = 0; i < params_.bias_ids.size(); ++i) {
    const auto id = params_.bias_ids[i];
    if (id >= 0 && id < n)
      adjusted_[static_cast<std::size_t>(id)] += static_cast<float>(params_.bias_values[i]);
  }
  if (static_cast<std::int64_t>(draw) < params_.min_tokens)
    for (auto id : params_.stop_token_ids)
      if (id >= 0 && id < n)
        adjusted_[static_cast<std::size_t>(id)] = -std::numeric_limits<float>::infinity();
  // Greedy: the largest logit, lowest id on ties.
  if (params_.temperature == 0.0) {
    std::int64_t best = 0;
    for (std::int64_t i = 1; i < n; ++i)
      if (adjusted_[static_cast<std::size_t>(i)] > adjusted_[static_cast<std::size_t>(best)])
        best = i;
    return best;
  }
  scratch_.clear();
  scratch_.reserve(static_cast<std::size_t>(n));
  const double inv_t = 1.0 / params_.temperature;
  for (std::int64_t i = 0; i < n; ++i)
    scratch_.emplace_back(static_cast<float>(adjusted_[static_cast<std::size_t>(i)] * inv_t), i);
  // Sort by logit descending, id ascending: a total order, so the result is
  // deterministic whatever the sort's stability.
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  // scratch_[0, sorted) holds the most likely tokens, in order. Top-p and
  // min-p need them first, but only as far as they reach: past it the order
  // is built lazily, in blocks that double. (Sorting all of a 32000-token
  // vocabulary cost ~4 ms per row, more than a decode step's matrix
  // products for a small model.)
  std::size_t sorted = 0;
  auto order_upto = [&](std::size_t k) {
    if (k <= sorted) return;
    const std::size_t end = std::min(scratch_.size(), std::max({k, sorted * 2, std::size_t{64}}));
    const auto b = scratch_.begin() + static_cast<std::ptrdiff_t>(sorted);
    const auto e = scratch_.begin() + static_cast<std::ptrdiff_t>(end);
    if (e != scratch_.end()) std::nth_element(b, e - 1, scratch_.end(), by_logit);
    std::sort(b, e, by_logit);
    sorted = end;
  };
  float max_logit = -std::numeric_limits<float>::infinity();
  double sum = 0;  // the softmax's denominator over the candidates
  if (params_.top_k > 0 && params_.top_k < n) {
    // The candidates are the top k, ordered (the sum in that order).
    order_upto(static_cast<std::size_t>(params_.top_k));
    scratch_.resize(static_cast<std::size_t>(params_.top_k));
    sorted = scratch_.size();
    max_logit = scratch_.front().first;
    if (!std::isfinite(max_logit)) return scratch_.front().second;
    for (const auto& c : scratch_) sum += std::exp(static_cast<double>(c.first) - max_logit);
  } else {
    // The whole vocabulary: its sum needs no order.
    std::int64_t arg = 0;
    for (std::int64_t i = 0; i < n; ++i)
      if (scratch_[static_cast<std::size_t>(i)].first > max_logit) {
        max_logit = scratch_[static_cast<std::size_t>(i)].first;
        arg = i;
      }
    if (!std::isfinite(max_logit))
      return arg;  // all -inf (the lowest id), or the lowest id at +inf
    weights_.resize(scratch_.size());
    for (std::size_t i = 0; i < scratch_.size(); ++i)
      sum += weights_[i] = std::exp(static_cast<double>(scratch_[i].first) - max_logit);
    if (params_.top_p >= 1.0 && params_.min_p <= 0) {
      // Plain temperature: the inverse CDF in id order, no sort.
      const double u = counter_uniform(params_.seed, draw) * sum;
      double cum = 0;
      std::size_t last = static_cast<std::size_t>(arg);
      for (std::size_t i = 0; i < weights_.size(); ++i) {
        if (weights_[i] <= 0) continue;
        cum += weights_[i];
        last = i;
        if (u < cum) return static_cast<std::int64_t>(i);
      }
      return static_cast<std::int64_t>(last);  // rounding left u past the sum
    }
  }
  // Below, scratch_ is reordered: a token's weight follows from its logit.
  auto prob = [&](std::size_t i) {
    return std::exp(static_cast<double>(scratch_[i].first) - max_logit) / sum;
  };
  std::size_t keep = scratch_.size();
  if (params_.top_p < 1.0) {
    double cum = 0;
    std::size_t k = 0;
    while (k < keep) {
      order_upto(k + 1);
      cum += prob(k++);
      if (cum >= params_.top_p) break;
    }
    keep = std::max<std::size_t>(1, k);
  }
  if (params_.min_p > 0) {
    order_upto(1);
    const double floor = params_.min_p * prob(0);
    std::size_t k = 1;
    while (k < keep) {
      order_upto(k + 1);
      if (prob(k) < floor) break;
      ++k;
    }
    keep = k;
  }
  order_upto(keep);
  double total = 0;
  for (std::size_t i = 0; i < keep; ++i) total += prob(i);
  const double u = counter_uniform(params_.seed, draw) * total;
  double cum = 0;
  for (std::size_t i = 0; i < keep; ++i) {
    cum += prob(i);
    if (u < cum) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;
}

std::string stop_checker::feed(std::int64_t token, const std::string& piece) {
  if (reason_ != stop_reason::none) return {};
  ++generated_;
  // Before min_tokens nothing stops it but max_tokens (vLLM's rule).
  const bool may_stop = generated_ > params_->min_tokens;
  for (auto id : params_->stop_token_ids)
    if (may_stop && id == token) {
      reason_ = stop_reason::stop_token;
      return flush();
    }
  pending_ += piece;
  for (const auto& s : params_->stop_strings) {
    if (!may_stop) break;
    const auto at = pending_.find(s);
    if (at != std::string::npos) {
      reason_ = stop_reason::stop_string;
      std::string out = pending_.substr(0, at);
      pending_.clear();
      return out;
    }
  }
  if (generated_ >= params_->max_tokens) reason_ = stop_reason::max_tokens;
  // Hold back the longest suffix that is a prefix of some stop string.
  std::size_t hold = 0;
  for (const auto& s : params_->stop_strings)
    for (std::size_t len = std::min(s.size() - 1, pending_.size()); len > hold; --len)
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
  if (reason_ != stop_reason::none) hold = 0;
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string stop_checker::flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace troupe::models
