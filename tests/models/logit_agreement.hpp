// Agreement of two logit tables (troupe vs a reference), shared by the
// fidelity tests of the decoder, LLaVA and the audio encoder.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

namespace troupe::test {

/// max |got - want| / (max(want) - min(want)) over the whole array: the
/// fidelity tests' "x range" (1e9 when the sizes differ or want is empty).
inline double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  if (got.size() != want.size() || want.empty()) return 1e9;
  const auto [lo, hi] = std::minmax_element(want.begin(), want.end());
  double err = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    err = std::max(err, std::fabs(double(got[i]) - double(want[i])));
  return err / double(*hi - *lo);
}

struct agreement {
  double mean_kl = 0, max_kl = 0;
  int top1_agree = 0, top1_checked = 0;
};

/// KL(reference || troupe) of the softmaxes, per position [n, vocab], and
/// top-1 agreement at positions whose reference top-2 gap exceeds `margin`.
inline agreement compare_logits(const std::vector<float>& got, const std::vector<float>& want,
                                std::int64_t vocab, double margin) {
  agreement a;
  const std::size_t V = static_cast<std::size_t>(vocab), n = want.size() / V;
  for (std::size_t p = 0; p < n; ++p) {
    const float* w = want.data() + p * V;
    const float* g = got.data() + p * V;
    const double mw = *std::max_element(w, w + V), mg = *std::max_element(g, g + V);
    double zw = 0, zg = 0;
    for (std::size_t v = 0; v < V; ++v) zw += std::exp(w[v] - mw), zg += std::exp(g[v] - mg);
    double kl = 0;
    for (std::size_t v = 0; v < V; ++v) {
      const double lw = w[v] - mw - std::log(zw), lg = g[v] - mg - std::log(zg);
      kl += std::exp(lw) * (lw - lg);
    }
    a.mean_kl += kl / double(n);
    a.max_kl = std::max(a.max_kl, kl);
    std::vector<float> sorted(w, w + V);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    if (sorted[0] - sorted[1] > margin) {
      ++a.top1_checked;
      a.top1_agree += std::max_element(w, w + V) - w == std::max_element(g, g + V) - g;
    }
  }
  return a;
}

}  // namespace troupe::test
