#pragma once
// Summary statistics of measured samples, for the benchmarks under bench/
// and `troupe bench` (cli/bench*.cpp). Header-only and without troupe
// dependencies, so that it needs no library (bench/ is optional in the
// build; `troupe bench` is not).

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

namespace troupe::bench {

/// The mean; 0 for no samples.
inline double mean(const std::vector<double>& v) {
  if (v.empty()) return 0;
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

/// The `q` quantile (0 to 1) of sorted samples, linear between the two
/// nearest ranks (numpy's default); 0 for no samples.
inline double quantile_of_sorted(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const auto hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

/// The median: the middle sample, or the mean of the two middle ones (the
/// 0.5 quantile, up to rounding); 0 for no samples.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// What a latency table reports of a set of samples.
struct distribution {
  double mean = 0, p50 = 0, p99 = 0;
};

inline distribution summarize(std::vector<double> v) {
  distribution d;
  if (v.empty()) return d;
  std::sort(v.begin(), v.end());
  d.mean = mean(v);
  d.p50 = quantile_of_sorted(v, 0.5);
  d.p99 = quantile_of_sorted(v, 0.99);
  return d;
}

}  // namespace troupe::bench
