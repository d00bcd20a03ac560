#pragma once
// The vector kernels' arithmetic, one lane at a time: the scalar path runs
// the very operations the AVX2 code runs (the same polynomial for e^x, the
// same fused multiply-adds, the same accumulator lanes and the same order
// of the final horizontal sum), so every instruction set gives the same
// bits (issue 24: a migration between an AVX2 node and an AVX-512 node must
// stay token-identical). Each function names the vector code it mirrors in
// avx2_math.hpp / ops_avx2.cpp; a change there changes it here, and the
// SameBits test (tests/kernels/backend_ops_test.cpp) checks the pair.
//
// Plain C++: std::fma is the fused operation (exact, as vfmadd), products
// and sums are written out one rounding at a time. Files including this
// must not let the compiler contract a * b + c (they are built without FMA
// instructions, or with fp-contract=off).

#include <bit>
#include <cmath>
#include <cstdint>

namespace troupe::kernels::cpu::lane {

inline constexpr float exp_lo = -87.33654475f;  ///< avx2_exp_lo
inline constexpr float exp_hi = 88.72283935f;   ///< avx2_exp_hi

/// avx2_exp_clamped, for xc in [exp_lo, exp_hi].
inline float exp_clamped(float xc) {
  float fx = std::nearbyint(xc * 1.44269504088896341f);  // round to nearest even
  fx = fx < 127.0f ? fx : 127.0f;
  float r = std::fma(-fx, 0.693359375f, xc);
  r = std::fma(-fx, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float rr = r * r;
  const float r1 = r + 1.0f;
  p = std::fma(p, rr, r1);
  const auto e = static_cast<std::uint32_t>(static_cast<std::int32_t>(fx) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

/// avx2_exp: 0 below exp_lo, +inf above exp_hi, NaN stays NaN.
inline float exp(float x) {
  if (std::isnan(x)) return x;
  if (x < exp_lo) return 0.0f;
  if (x > exp_hi) return INFINITY;
  return exp_clamped(x);
}

/// avx2_exp_fast: 0 below exp_lo (and for NaN), clamped above exp_hi.
inline float exp_fast(float x) {
  if (!(x >= exp_lo)) return 0.0f;
  return exp_clamped(x < exp_hi ? x : exp_hi);
}

/// x_sigmoid (ops_avx2.cpp): x / (1 + e^(-k x)).
inline float x_sigmoid(float x, float k) {
  const float nk = 0.0f - k;
  const float e = lane::exp(nk * x);
  return x / (1.0f + e);
}

/// erfc_ps (ops_avx2.cpp).
inline float erfc(float z) {
  const float a = std::fabs(z);
  const float t = 1.0f / std::fma(0.5f, a, 1.0f);
  float p = 0.17087277f;
  p = std::fma(p, t, -0.82215223f);
  p = std::fma(p, t, 1.48851587f);
  p = std::fma(p, t, -1.13520398f);
  p = std::fma(p, t, 0.27886807f);
  p = std::fma(p, t, -0.18628806f);
  p = std::fma(p, t, 0.09678418f);
  p = std::fma(p, t, 0.37409196f);
  p = std::fma(p, t, 1.00002368f);
  p = std::fma(p, t, -1.26551223f);
  const float arg = std::fma(-a, a, p);
  const float r = t * lane::exp(arg);
  return z < 0.0f ? 2.0f - r : r;
}

/// gelu_ps (ops_avx2.cpp); kind 0 tanh, 1 erf, 2 quick.
inline float gelu(float x, int kind) {
  if (kind == 0) {
    const float x3 = (x * x) * x;
    const float inner = std::fma(0.044715f, x3, x);
    const float u2 = static_cast<float>(2.0f * 0.7978845608028654f) * inner;
    const float e = lane::exp(0.0f - u2);
    return x / (1.0f + e);
  }
  if (kind == 1) {
    const float z = x * -0.70710678118654752f;
    return (0.5f * x) * lane::erfc(z);
  }
  return x_sigmoid(x, 1.702f);
}

/// hsum (ops_avx2.cpp) of eight lanes: (l0+l4 + l2+l6) + (l1+l5 + l3+l7),
/// in the order the shuffles add them.
inline float hsum8(const float* l) {
  const float s0 = l[0] + l[4], s1 = l[1] + l[5], s2 = l[2] + l[6], s3 = l[3] + l[7];
  return (s0 + s2) + (s1 + s3);
}

/// sum_squares_avx2: four accumulators of eight lanes over blocks of 32
/// (fused), the tail's blocks of eight into accumulators 0, 1, 2 in turn,
/// then (a0 + a1) + (a2 + a3) lane by lane and hsum8.
inline float sum_squares(const float* x, std::int64_t n) {
  float acc[4][8] = {};
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < 8; ++j) {
        const float v = x[i + 8 * k + j];
        acc[k][j] = std::fma(v, v, acc[k][j]);
      }
  for (int k = 0; i < n; i += 8, ++k)
    for (int j = 0; j < 8 && i + j < n; ++j) {
      const float v = x[i + j];
      acc[k][j] = std::fma(v, v, acc[k][j]);
    }
  float lanes[8];
  for (int j = 0; j < 8; ++j) lanes[j] = (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
  return hsum8(lanes);
}

/// softmax_row_avx2: the max of x * scale, e^(x * scale - max) (avx2_exp),
/// their sum in eight lanes and hsum8, then each times 1 / sum.
inline void softmax_row(const float* x, float* y, std::int64_t n, float scale) {
  float mx = -INFINITY;
  for (std::int64_t i = 0; i < n; ++i) {
    const float z = x[i] * scale;
    mx = mx > z ? mx : z;  // as _mm256_max_ps(mx, z)
  }
  if (mx == -INFINITY) {
    for (std::int64_t i = 0; i < n; ++i) y[i] = 0.0f;
    return;
  }
  float acc[8] = {};
  for (std::int64_t i = 0; i < n; ++i) {
    const float z = x[i] * scale;
    const float e = lane::exp(z - mx);
    acc[i % 8] += e;
    y[i] = e;
  }
  const float inv = 1.0f / hsum8(acc);
  for (std::int64_t i = 0; i < n; ++i) y[i] = y[i] * inv;
}

}  // namespace troupe::kernels::cpu::lane
