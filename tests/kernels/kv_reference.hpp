#pragma once

// Reference helpers the kernel tests share, computed independently of the
// kernel code.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include "kernels/dtype.hpp"
#include "kernels/half.hpp"

namespace troupe::test {

inline std::vector<float> randn(std::mt19937& rng, std::size_t n, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

// What a paged KV cache holds after storing x (rows of d values): f16
// round-to-nearest-even; int8 symmetric, scale max|x| / 127 per token and
// head.
inline std::vector<float> as_stored(const std::vector<float>& x, kernels::dtype t, int d) {
  std::vector<float> out(x.size());
  for (std::size_t r = 0; r < x.size() / static_cast<std::size_t>(d); ++r) {
    const float* src = x.data() + r * static_cast<std::size_t>(d);
    float* dst = out.data() + r * static_cast<std::size_t>(d);
    if (t == kernels::dtype::f32) {
      std::copy(src, src + d, dst);
    } else if (t == kernels::dtype::f16) {
      for (int c = 0; c < d; ++c) dst[c] = kernels::to_f32(kernels::to_f16(src[c]));
    } else {
      float amax = 0;
      for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(src[c]));
      const float s = amax / 127.0f;
      for (int c = 0; c < d; ++c) dst[c] = s > 0 ? std::nearbyint(src[c] / s) * s : 0.0f;
    }
  }
  return out;
}

}  // namespace troupe::test
