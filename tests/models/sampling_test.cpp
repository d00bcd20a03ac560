#include <gtest/gtest.h>

#include <cmath>
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
