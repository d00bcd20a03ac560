#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <vector>

#include "models/sampling.hpp"

using namespace troupe::models;

namespace {

std::vector<double> softmax(const std::vector<float>& l, double t) {
  double m = *std::max_element(l.begin(), l.end());
  std::vector<double> p(l.size());
  double s = 0;
  for (std::size_t i = 0; i < l.size(); ++i) s += p[i] = std::exp((l[i] - m) / t);
  for (auto& v : p) v /= s;
  return p;
}

std::vector<int> histogram(sampler& s, const std::vector<float>& logits, int draws) {
  std::vector<int> h(logits.size());
  for (int i = 0; i < draws; ++i) h[static_cast<std::size_t>(s.sample(logits, {}))]++;
  return h;
}

const std::vector<float> logits = {1.0f, 2.5f, 0.3f, 2.5f, -1.0f, 0.9f};

}  // namespace

TEST(Sampling, GreedyTakesTheLargestLowestIdOnTies) {
  auto s = sampler::create({});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->sample(logits, {}), 1);
}

TEST(Sampling, TemperatureFollowsTheSoftmax) {
  sampling_params p;
  p.temperature = 0.7;
  p.seed = 42;
  auto s = sampler::create(p);
  ASSERT_TRUE(s);
  const int n = 40000;
  const auto h = histogram(*s, logits, n);
  const auto want = softmax(logits, 0.7);
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const double sd = std::sqrt(want[i] * (1 - want[i]) / n);
    EXPECT_NEAR(h[i] / double(n), want[i], 5 * sd + 1e-4) << "token " << i;
  }
}

TEST(Sampling, TopKTopPAndMinPRestrictTheSupport) {
  sampling_params p;
  p.temperature = 1.0;
  p.top_k = 3;
  auto s = sampler::create(p);
  auto h = histogram(*s, logits, 5000);
  // Top 3 logits: ids 1, 3 (2.5) and 0 (1.0).
  EXPECT_GT(h[0], 0);
  EXPECT_GT(h[1], 0);
  EXPECT_GT(h[3], 0);
  EXPECT_EQ(h[2] + h[4] + h[5], 0);

  p.top_k = 0;
  // A nucleus just past ids 1 and 3 needs id 0 (the next largest) as well.
  const auto pr = softmax(logits, 1.0);
  p.top_p = pr[1] + pr[3] + pr[0] / 2;
  s = sampler::create(p);
  h = histogram(*s, logits, 5000);
  EXPECT_GT(h[0], 0);
  EXPECT_EQ(h[2] + h[4] + h[5], 0);

  p.top_p = 1.0;
  p.min_p = 0.5;  // keep p >= 0.5 * p_max: only ids 1 and 3
  s = sampler::create(p);
  h = histogram(*s, logits, 5000);
  EXPECT_EQ(h[0] + h[2] + h[4] + h[5], 0);
  EXPECT_GT(h[1], 1500);
  EXPECT_GT(h[3], 1500);
}

TEST(Sampling, RepetitionPenaltyFollowsHfRule) {
  sampling_params p;
  p.repetition_penalty = 2.0;
  auto s = sampler::create(p);
  // id 1 and 3 seen: 2.5 -> 1.25 each, so greedy picks id 0 (1.0)? No: 1.25 > 1.0.
  EXPECT_EQ(s->sample(logits, std::vector<std::int64_t>{1, 3}), 1);
  // Penalise 1, 3 and 0: 1.25, 1.25, 0.5 -> id 1 still; add 5 (0.9 -> 0.45) changes nothing.
  std::vector<float> neg = {-1.0f, -0.2f, -0.3f};
  // -0.2 seen -> -0.4, so -0.3 (id 2) wins.
  EXPECT_EQ(s->sample(neg, std::vector<std::int64_t>{1, 1, 1}), 2);
}

TEST(Sampling, SameSeedSameTokensWhateverElseRuns) {
  sampling_params p;
  p.temperature = 1.3;
  p.seed = 7;
  auto a = sampler::create(p);
  auto b = sampler::create(p);
  auto other = sampler::create(sampling_params{.temperature = 1.0, .seed = 99});
  for (int i = 0; i < 200; ++i) {
    (void)other->sample(logits, {});  // interleaved work must not disturb a or b
    ASSERT_EQ(a->sample(logits, {}), b->sample(logits, {}));
  }
  p.seed = 8;
  auto c = sampler::create(p);
  auto d = sampler::create(sampling_params{.temperature = 1.3, .seed = 7});
  int differ = 0;
  for (int i = 0; i < 200; ++i) differ += c->sample(logits, {}) != d->sample(logits, {});
  EXPECT_GT(differ, 20);
}

// A vocabulary of a few thousand tokens: the whole-vocabulary paths order
// the most likely tokens lazily, in blocks; the draws must still follow the
// softmax restricted to the nucleus (top-p) or the min-p support, which
// reach past several blocks here.
std::vector<float> wide_logits(std::size_t n) {
  std::vector<float> l(n);
  for (std::size_t i = 0; i < n; ++i)
    l[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)) * 2.0);
  l[17] = -std::numeric_limits<float>::infinity();  // a masked token is never drawn
  l[900] = 6.0f;
  return l;
}

/// Each token's share of `draws` against `want` (0 outside the support).
void expect_follows(sampler& s, const std::vector<float>& l, const std::vector<double>& want,
                    int draws) {
  const auto h = histogram(s, l, draws);
  double chi = 0, dof = 0;
  double rare_seen = 0, rare_want = 0;  // tokens expected fewer than 5 times share one bin
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (want[i] == 0) {
      ASSERT_EQ(h[i], 0) << "token " << i << " is outside the support";
      continue;
    }
    const double e = want[i] * draws;
    if (e < 5) {
      rare_seen += h[i];
      rare_want += e;
      continue;
    }
    chi += (h[i] - e) * (h[i] - e) / e;
    dof += 1;
  }
  if (rare_want > 0) {
    chi += (rare_seen - rare_want) * (rare_seen - rare_want) / rare_want;
    dof += 1;
  }
  ASSERT_GT(dof, 100) << "too few tokens to test against";
  // Chi-square with dof - 1 degrees of freedom: mean dof - 1, sd sqrt(2 dof).
  EXPECT_LT(chi, dof + 6 * std::sqrt(2 * dof))
      << "chi-square " << chi << " over " << dof << " tokens";
}

TEST(Sampling, WholeVocabularyPathsFollowTheirDistributions) {
  const auto l = wide_logits(3000);
  const double t = 0.8;
  const auto pr = softmax(l, t);
  ASSERT_EQ(pr[17], 0);
  std::vector<std::size_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](auto a, auto b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  const int draws = 60000;
  {
    sampling_params p;
    p.temperature = t;
    p.seed = 5;
    auto s = sampler::create(p);
    expect_follows(*s, l, pr, draws);
  }
  {
    // Top-p: the nucleus is the shortest prefix of the order reaching p.
    sampling_params p;
    p.temperature = t;
    p.top_p = 0.6;
    p.seed = 6;
    std::vector<double> want(l.size());
    double cum = 0, kept = 0;
    std::size_t k = 0;
    while (k < order.size()) {
      cum += pr[order[k++]];
      if (cum >= p.top_p) break;
    }
    ASSERT_GT(k, 256u) << "the nucleus should reach past several blocks";
    for (std::size_t i = 0; i < k; ++i) kept += pr[order[i]];
    for (std::size_t i = 0; i < k; ++i) want[order[i]] = pr[order[i]] / kept;
    auto s = sampler::create(p);
    expect_follows(*s, l, want, draws);
  }
  {
    // Min-p: tokens at least min_p times the most likely one.
    sampling_params p;
    p.temperature = t;
    p.min_p = 0.002;
    p.seed = 7;
    const double top = pr[order[0]];
    std::vector<double> want(l.size());
    double kept = 0;
    std::size_t support = 0;
    for (std::size_t i = 0; i < l.size(); ++i)
      if (pr[i] >= p.min_p * top) {
        want[i] = pr[i];
        kept += pr[i];
        ++support;
      }
    ASSERT_GT(support, 256u);
    ASSERT_LT(support, l.size() - 100);
    for (auto& w : want) w /= kept;
    auto s = sampler::create(p);
    expect_follows(*s, l, want, draws);
  }
}

TEST(Sampling, WholeVocabularyEdgeCases) {
  const float inf = std::numeric_limits<float>::infinity();
  for (double top_p : {1.0, 0.9}) {
    sampling_params p;
    p.temperature = 1.0;
    p.top_p = top_p;
    auto s = sampler::create(p);
    // Every token masked: the lowest id, as greedy would choose.
    EXPECT_EQ(s->sample(std::vector<float>(300, -inf), {}), 0);
    // One token at +inf: that one.
    std::vector<float> l(300, 0.0f);
    l[123] = inf;
    l[200] = inf;
    EXPECT_EQ(s->sample(l, {}), 123);
    // One finite token among masked ones: always that one.
    std::vector<float> m(300, -inf);
    m[250] = -3.0f;
    for (int i = 0; i < 50; ++i) EXPECT_EQ(s->sample(m, {}), 250);
  }
}

TEST(Sampling, BadParamsAreErrors) {
  EXPECT_FALSE(sampler::create(sampling_params{.temperature = -1}));
  EXPECT_FALSE(sampler::create(sampling_params{.top_p = 0}));
  EXPECT_FALSE(sampler::create(sampling_params{.top_k = -2}));
  EXPECT_FALSE(sampler::create(sampling_params{.min_p = 1.5}));
  EXPECT_FALSE(sampler::create(sampling_params{.repetition_penalty = 0}));
  EXPECT_FALSE(sampler::create(sampling_params{.max_tokens = 0}));
  sampling_params p;
  p.stop_strings = {""};
  EXPECT_FALSE(sampler::create(p));
}

TEST(StopChecker, StopStringsAcrossPiecesNeverReachTheClient) {
  sampling_params p;
  p.stop_strings = {"</end>"};
  p.max_tokens = 100;
  stop_checker c(p);
  std::string out;
  for (const char* piece : {"Hello", " wor", "ld<", "/e", "nd>", "more"}) out += c.feed(1, piece);
  EXPECT_EQ(out, "Hello world");
  EXPECT_EQ(c.reason(), stop_reason::stop_string);
  EXPECT_EQ(c.feed(1, "x"), "");
}

TEST(StopChecker, HeldTextIsReleasedWhenItIsNotAStop) {
  sampling_params p;
  p.stop_strings = {"STOP"};
  p.stop_token_ids = {2};
  p.max_tokens = 100;
  stop_checker c(p);
  EXPECT_EQ(c.feed(5, "ab S"), "ab ");
  EXPECT_EQ(c.feed(5, "T"), "");
  EXPECT_EQ(c.feed(5, "x"), "STx");
  EXPECT_EQ(c.feed(5, "ST"), "");
  EXPECT_EQ(c.feed(2, "ignored"), "ST");
  EXPECT_EQ(c.reason(), stop_reason::stop_token);
}

TEST(StopChecker, MaxTokens) {
  sampling_params p;
  p.max_tokens = 3;
  stop_checker c(p);
  EXPECT_EQ(c.feed(1, "a") + c.feed(1, "b"), "ab");
  EXPECT_EQ(c.reason(), stop_reason::none);
  EXPECT_EQ(c.feed(1, "c"), "c");
  EXPECT_EQ(c.reason(), stop_reason::max_tokens);
}

// OpenAI's penalties: logit -= count * frequency + (count > 0) * presence,
// counted over the generated tokens (the last draws() of the history),
// never the prompt's.
TEST(Sampling, PresenceAndFrequencyPenaltiesCountGeneratedTokensOnly) {
  const std::vector<float> l = {1.0f, 0.5f, 0.0f};
  auto pick = [&](sampling_params p, std::uint64_t draws, std::vector<std::int64_t> history) {
    auto s = sampler::resume(p, draws);
    EXPECT_TRUE(s);
    return s->sample(l, history);
  };
  sampling_params presence;
  presence.presence_penalty = 0.4;
  EXPECT_EQ(pick(presence, 1, {0, 0}), 0) << "1.0 - 0.4 = 0.6 is still above 0.5";
  presence.presence_penalty = 0.6;
  EXPECT_EQ(pick(presence, 1, {0, 0}), 1) << "1.0 - 0.6 = 0.4";
  EXPECT_EQ(pick(presence, 1, {0, 0, 0, 0, 2}), 0) << "presence counts once; the last is 2";
  EXPECT_EQ(pick(presence, 0, {0, 0, 0}), 0) << "the prompt's tokens are not penalized";
  sampling_params frequency;
  frequency.frequency_penalty = 0.1;
  EXPECT_EQ(pick(frequency, 3, {1, 0, 0, 0}), 0) << "1.0 - 3 x 0.1 = 0.7";
  frequency.frequency_penalty = 0.2;
  EXPECT_EQ(pick(frequency, 3, {1, 0, 0, 0}), 1) << "1.0 - 3 x 0.2 = 0.4";
  EXPECT_EQ(pick(frequency, 2, {0, 1, 0}), 0) << "one 0 generated: 0.8";
  // Negative values reward repetition.
  sampling_params reward;
  reward.presence_penalty = -1.2;  // 0.0 + 1.2 passes 1.0
  EXPECT_EQ(pick(reward, 1, {2, 2}), 2);
  EXPECT_TRUE(sampling_params{}.needs_history() == false);
  EXPECT_TRUE(presence.needs_history());
  EXPECT_FALSE(sampler::create(sampling_params{.presence_penalty = 2.5}));
  EXPECT_FALSE(sampler::create(sampling_params{.frequency_penalty = -3}));
}

// logit_bias adds to a token's logit; min_tokens keeps stop tokens from
// being sampled, and stop tokens and stop strings from ending the
// sequence, until that many tokens exist.
TEST(Sampling, LogitBiasAndMinTokens) {
  const std::vector<float> l = {1.0f, 0.5f, 0.0f};
  sampling_params up;
  up.bias_ids = {2};
  up.bias_values = {1.5};
  EXPECT_EQ(sampler::create(up)->sample(l, {}), 2);
  sampling_params down;
  down.bias_ids = {0, 9999};  // ids past the vocabulary: nothing to bias
  down.bias_values = {-100, 100};
  EXPECT_EQ(sampler::create(down)->sample(l, {}), 1);
  down.bias_values = {-100};
  EXPECT_FALSE(sampler::create(down)) << "ids and values differ in number";
  sampling_params min;
  min.stop_token_ids = {0};
  min.min_tokens = 2;
  auto s = sampler::create(min);
  EXPECT_EQ(s->sample(l, {}), 1) << "draw 0: the stop token is masked";
  EXPECT_EQ(s->sample(l, {}), 1) << "draw 1: still";
  EXPECT_EQ(s->sample(l, {}), 0) << "draw 2: allowed";
  EXPECT_FALSE(sampler::create(sampling_params{.max_tokens = 3, .min_tokens = 4}));

  sampling_params p;
  p.stop_token_ids = {2};
  p.stop_strings = {"END"};
  p.min_tokens = 2;
  p.max_tokens = 10;
  stop_checker c(p);
  EXPECT_EQ(c.feed(2, "END"), "END");  // the first token: neither stops it
  EXPECT_EQ(c.reason(), stop_reason::none);
  EXPECT_EQ(c.feed(5, "x"), "x");
  EXPECT_EQ(c.feed(2, "y"), "");  // the third may stop: the stop token does
  EXPECT_EQ(c.reason(), stop_reason::stop_token);
}

// Logprobs are the log-softmax of the raw logits (in long double here),
// the top alternatives ordered by logit then id, whatever the sampling.
TEST(Logprobs, AreTheLogSoftmaxAndTheTopAlternatives) {
  long double z = 0;
  for (float v : logits) z += std::exp(static_cast<long double>(v));
  const auto lp = logprobs_of(logits, 5, 3);
  EXPECT_EQ(lp.token, 5);
  EXPECT_NEAR(lp.logprob, static_cast<double>(logits[5] - std::log(z)), 1e-6);
  // 2.5 twice (ids 1 and 3: the lower id first), then 1.0 (id 0).
  EXPECT_EQ(lp.top_ids, (std::vector<std::int32_t>{1, 3, 0}));
  ASSERT_EQ(lp.top_logprobs.size(), 3u);
  EXPECT_NEAR(lp.top_logprobs[2], static_cast<double>(logits[0] - std::log(z)), 1e-6);
  double total = 0;
  for (std::int32_t id = 0; id < 6; ++id) total += std::exp(logprobs_of(logits, id, 0).logprob);
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_TRUE(logprobs_of(logits, 2, 0).top_ids.empty());
  EXPECT_EQ(logprobs_of(logits, 2, 50).top_ids.size(), 6u);  // no more than the vocabulary
  // Large logits do not overflow.
  const std::vector<float> big = {1000.0f, 999.0f};
  EXPECT_NEAR(logprobs_of(big, 1, 0).logprob, -1.0 - std::log1p(std::exp(-1.0)), 1e-5);
  sampling_params p;
  p.logprobs = 21;
  EXPECT_FALSE(p.validate());
  p.logprobs = 20;
  EXPECT_TRUE(p.validate());
}
