// ggml's reference quantizers for the K-quants (Q2_K .. Q6_K) and the IQ4
// formats, as llama.cpp's quantizer runs them when no importance matrix is
// given (llama_model_quantize without --imatrix). Each searches a scale (and
// a minimum) per sub-block, then quantizes the sub-block scales against a
// superblock scale; they are deterministic, and this file reproduces their
// bytes: every product, sum and division below is done in the order and
// precision ggml's C does it (f32, no fused multiply-add: CMake builds this
// file with -ffp-contract=off), since a last-bit change in a search moves a
// code. tests/models/gguf_quant_fixture_test.cpp compares against files
// written by llama.cpp's own quantizer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/half.hpp"
#include "kernels/quant.hpp"

namespace troupe::kernels {

namespace {

// ggml's GROUP_MAX_EPS: a sub-block whose largest magnitude is below it is zero.
constexpr float group_eps = 1e-15f;

// Round half to even through the float adder (valid for |v| < 2^22), as
// ggml rounds every code and scale of these formats.
int round_even(float v) {
  const float shifted = v + 12582912.0f;  // 1.5 * 2^23: the integer lands in the mantissa
  std::int32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  return (bits & 0x007fffff) - 0x00400000;
}

int clamp_int(int v, int lo, int hi) {
  return std::max(lo, std::min(hi, v));
}

float f16_round_trip(f16 h) {
  return to_f32(h);
}

// The value of largest magnitude, its sign kept (the first of equal
// magnitudes; 0 for all zeros), as ggml's searches pick it.
float largest_magnitude(const float* v, int n) {
  float amax = 0, max = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(v[i]) > amax) {
      amax = std::fabs(v[i]);
      max = v[i];
    }
  return max;
}

// Signed codes in [-nmax, nmax) with one scale, weighted by x^2: the scale
// through the largest magnitude is tried, then 18 scales around it
// (nmax +- 0.1 .. 0.9), keeping the one whose least-squares fit explains most
// of the weighted signal. Codes come back offset by nmax. (make_qx_quants,
// rmse_type 1, no importance weights.)
float fit_signed(int n, int nmax, const float* x, std::int8_t* codes) {
  const float max = largest_magnitude(x, n);
  if (std::fabs(max) < group_eps) {
    std::fill(codes, codes + n, std::int8_t{0});
    return 0.0f;
  }
  const auto sums = [&](float iscale, float& sumlx, float& suml2) {
    sumlx = 0;
    suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = clamp_int(round_even(iscale * x[i]), -nmax, nmax - 1);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * static_cast<float>(l);
      suml2 += w * static_cast<float>(l) * static_cast<float>(l);
    }
  };
  const auto set_codes = [&](float iscale) {
    for (int i = 0; i < n; ++i)
      codes[i] =
          static_cast<std::int8_t>(nmax + clamp_int(round_even(iscale * x[i]), -nmax, nmax - 1));
  };
  float iscale = static_cast<float>(-nmax) / max;
  float sumlx = 0, suml2 = 0;
  sums(iscale, sumlx, suml2);
  set_codes(iscale);
  float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(step)) / max;
    sums(iscale, sumlx, suml2);
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      set_codes(iscale);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Q3_K's sub-block fit: codes in [-nmax, nmax) through the largest
// magnitude, then up to five passes that move one code at a time where that
// raises the x^2-weighted fit. Codes come back offset by nmax.
// (make_q3_quants with do_rmse.)
float fit_signed_refined(int n, int nmax, const float* x, std::int8_t* codes) {
  const float max = largest_magnitude(x, n);
  if (std::fabs(max) < group_eps) {
    std::fill(codes, codes + n, std::int8_t{0});
    return 0.0f;
  }
  const float iscale = static_cast<float>(-nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = clamp_int(round_even(iscale * x[i]), -nmax, nmax - 1);
    codes[i] = static_cast<std::int8_t>(l);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * static_cast<float>(l);
    suml2 += w * static_cast<float>(l) * static_cast<float>(l);
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      const float li = static_cast<float>(codes[i]);
      float slx = sumlx - w * x[i] * li;
      if (slx > 0) {
        float sl2 = suml2 - w * li * li;
        const int moved = clamp_int(round_even(x[i] * sl2 / slx), -nmax, nmax - 1);
        if (moved != codes[i]) {
          const float lm = static_cast<float>(moved);
          slx += w * x[i] * lm;
          sl2 += w * lm * lm;
          if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
            codes[i] = static_cast<std::int8_t>(moved);
            sumlx = slx;
            suml2 = sl2;
            ++changed;
          }
        }
      }
    }
    if (changed == 0) break;
  }
  for (int i = 0; i < n; ++i) codes[i] = static_cast<std::int8_t>(codes[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// Unsigned codes in [0, nmax] with a scale and a minimum (<= 0), weighted:
// the full-range fit, then nstep + 1 rescaled ones, each solved by weighted
// least squares for scale and minimum, keeping the lowest weighted squared
// (or absolute, `absolute`) error. Returns the scale; `neg_min` gets -min.
// (make_qkx2_quants.)
float fit_affine(int n, int nmax, const float* x, const float* weights, std::uint8_t* codes,
                 float& neg_min, float rmin, float rdelta, int nstep, bool absolute) {
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    min = x[i] < min ? x[i] : min;
    max = x[i] > max ? x[i] : max;
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::fill(codes, codes + n, std::uint8_t{0});
    neg_min = -min;
    return 0.0f;
  }
  const auto error_of = [&](float diff) { return absolute ? std::fabs(diff) : diff * diff; };
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    codes[i] = static_cast<std::uint8_t>(clamp_int(round_even(iscale * (x[i] - min)), 0, nmax));
    const float diff = scale * static_cast<float>(codes[i]) + min - x[i];
    best_error += weights[i] * error_of(diff);
  }
  if (nstep < 1) {
    neg_min = -min;
    return scale;
  }
  std::uint8_t trial[32];
  for (int step = 0; step <= nstep; ++step) {
    iscale = (rmin + rdelta * static_cast<float>(step) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = clamp_int(round_even(iscale * (x[i] - min)), 0, nmax);
      trial[i] = static_cast<std::uint8_t>(l);
      const float w = weights[i];
      const float lf = static_cast<float>(l);
      sum_l += w * lf;
      sum_l2 += w * lf * lf;
      sum_xl += w * lf * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float error = 0;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * static_cast<float>(trial[i]) + this_min - x[i];
        error += weights[i] * error_of(diff);
      }
      if (error < best_error) {
        std::copy(trial, trial + n, codes);
        best_error = error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  neg_min = -min;
  return scale;
}

// Two-bit codes of a 256-superblock in ggml's order: byte 32*(j/128) + l
// holds codes j+l, j+l+32, j+l+64, j+l+96 (j a multiple of 128) from the low
// bits up.
void pack_2bit(const std::uint8_t* codes, std::uint8_t* qs) {
  for (int j = 0; j < qk_k; j += 128)
    for (int l = 0; l < 32; ++l)
      qs[j / 4 + l] =
          static_cast<std::uint8_t>(codes[j + l] | (codes[j + l + 32] << 2) |
                                    (codes[j + l + 64] << 4) | (codes[j + l + 96] << 6));
}

// Q4_K's and Q5_K's 12 scale bytes: eight 6-bit scales and eight 6-bit
// minimums (the first four of each whole, the last four split in nibbles
// with their top two bits above the first four's).
void pack_scales_k4(const std::uint8_t* ls, const std::uint8_t* lm, std::uint8_t* out) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      out[j] = ls[j];
      out[j + 4] = lm[j];
    } else {
      out[j + 4] = static_cast<std::uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      out[j - 4] |= static_cast<std::uint8_t>((ls[j] >> 4) << 6);
      out[j] |= static_cast<std::uint8_t>((lm[j] >> 4) << 6);
    }
  }
}

void unpack_scale_k4(int j, const std::uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The shared part of Q4_K and Q5_K: eight 32-sub-blocks fitted with
// fit_affine (weights: the sub-block's RMS plus |x|), their scales and
// minimums quantized to 6 bits against the largest of each, then every code
// requantized against the stored (f16-rounded) scales. Codes in [0, nmax].
void superblock_k4(const float* x, int nmax, float rmin, int nstep, std::uint8_t* codes, f16& d,
                   f16& dmin, std::uint8_t* scale_bytes) {
  float scales[8], mins[8], weights[32];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xb = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xb[l] * xb[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xb[l]);
    scales[j] =
        fit_affine(32, nmax, xb, weights, codes + 32 * j, mins[j], rmin, 0.1f, nstep, false);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  std::uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    // ggml stores the rounded value in a uint8_t before clamping to 63.
    ls[j] =
        std::min<std::uint8_t>(63, static_cast<std::uint8_t>(round_even(inv_scale * scales[j])));
    lm[j] = std::min<std::uint8_t>(63, static_cast<std::uint8_t>(round_even(inv_min * mins[j])));
  }
  std::memset(scale_bytes, 0, 12);
  pack_scales_k4(ls, lm, scale_bytes);
  d = to_f16(max_scale / 63.f);
  dmin = to_f16(max_min / 63.f);
  for (int j = 0; j < 8; ++j) {
    int sc = 0, m = 0;
    unpack_scale_k4(j, scale_bytes, sc, m);
    const float dl = f16_round_trip(d) * static_cast<float>(sc);
    if (dl == 0.0f) continue;  // the fit's codes stay
    const float ml = f16_round_trip(dmin) * static_cast<float>(m);
    for (int ii = 0; ii < 32; ++ii)
      codes[32 * j + ii] =
          static_cast<std::uint8_t>(clamp_int(round_even((x[32 * j + ii] + ml) / dl), 0, nmax));
  }
}

// The index of the table value nearest to v (ties to the upper one only
// where strictly nearer), by bisection as ggml does (best_index_int8).
int nearest_table_index(const std::int8_t* table, float v) {
  constexpr int n = 16;
  if (v <= table[0]) return 0;
  if (v >= table[n - 1]) return n - 1;
  int lo = 0, hi = n - 1;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (v < table[mid])
      hi = mid;
    else
      lo = mid;
  }
  return v - table[hi - 1] < table[hi] - v ? hi - 1 : hi;
}

// IQ4's scale search for one 32-sub-block, weighted by x^2: the scale
// through the largest magnitude, then 15 scales putting it at table[0] +
// -7 .. 7, keeping the best weighted least-squares fit.
// (quantize_row_iq4_nl_impl's per-block search, ntry 7.)
float iq4_block_scale(const float* xb) {
  const std::int8_t* table = kvalues_iq4nl;
  float weight[32];
  for (int j = 0; j < 32; ++j) weight[j] = xb[j] * xb[j];
  const float max = largest_magnitude(xb, 32);
  if (std::fabs(max) < group_eps) return 0.0f;
  const auto sums = [&](float id, float& sumqx, float& sumq2) {
    sumqx = 0;
    sumq2 = 0;
    for (int j = 0; j < 32; ++j) {
      const float q = table[nearest_table_index(table, id * xb[j])];
      sumqx += weight[j] * q * xb[j];
      sumq2 += weight[j] * q * q;
    }
  };
  float d = -max / static_cast<float>(table[0]);
  float sumqx = 0, sumq2 = 0;
  sums(1 / d, sumqx, sumq2);
  d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
  float best = d * sumqx;
  for (int t = -7; t <= 7; ++t) {
    const float id = static_cast<float>(t + table[0]) / max;
    sums(id, sumqx, sumq2);
    if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
      d = sumqx / sumq2;
      best = d * sumqx;
    }
  }
  return d;
}

// Q4_0's nibble order over 32-runs: byte 16*i + j holds indices 32*i + j
// (low) and 32*i + 16 + j (high).
void pack_nibbles32(const std::uint8_t* idx, int n, std::uint8_t* qs) {
  for (int i = 0; i < n / 32; ++i)
    for (int j = 0; j < 16; ++j)
      qs[16 * i + j] = static_cast<std::uint8_t>(idx[32 * i + j] | (idx[32 * i + 16 + j] << 4));
}

}  // namespace

void quantize_row_q2_k(const float* x, block_q2_k* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk_k; ++i, x += qk_k) {
    std::uint8_t codes[qk_k];
    float scales[16], mins[16], weights[16];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; ++j) {
      for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
      scales[j] =
          fit_affine(16, 3, x + 16 * j, weights, codes + 16 * j, mins[j], -0.5f, 0.1f, 15, true);
      if (scales[j] > max_scale) max_scale = scales[j];
      if (mins[j] > max_min) max_min = mins[j];
    }
    block_q2_k& b = y[i];
    if (max_scale > 0) {
      const float iscale = 15.f / max_scale;
      for (int j = 0; j < 16; ++j)
        b.scales[j] = static_cast<std::uint8_t>(round_even(iscale * scales[j]));
      b.d = to_f16(max_scale / 15.f);
    } else {
      std::memset(b.scales, 0, sizeof b.scales);
      b.d = to_f16(0.f);
    }
    if (max_min > 0) {
      const float iscale = 15.f / max_min;
      for (int j = 0; j < 16; ++j)
        b.scales[j] |= static_cast<std::uint8_t>(round_even(iscale * mins[j]) << 4);
      b.dmin = to_f16(max_min / 15.f);
    } else {
      b.dmin = to_f16(0.f);
    }
    for (int j = 0; j < 16; ++j) {
      const float dl = f16_round_trip(b.d) * static_cast<float>(b.scales[j] & 0xF);
      if (dl == 0.0f) continue;
      const float ml = f16_round_trip(b.dmin) * static_cast<float>(b.scales[j] >> 4);
      for (int ii = 0; ii < 16; ++ii)
        codes[16 * j + ii] =
            static_cast<std::uint8_t>(clamp_int(round_even((x[16 * j + ii] + ml) / dl), 0, 3));
    }
    pack_2bit(codes, b.qs);
  }
}

void quantize_row_q3_k(const float* x, block_q3_k* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk_k; ++i, x += qk_k) {
    std::int8_t codes[qk_k];
    float scales[16];
    for (int j = 0; j < 16; ++j) scales[j] = fit_signed_refined(16, 4, x + 16 * j, codes + 16 * j);
    const float max_scale = largest_magnitude(scales, 16);
    block_q3_k& b = y[i];
    std::memset(b.scales, 0, sizeof b.scales);
    if (max_scale != 0.0f) {
      const float iscale = -32.f / max_scale;
      for (int j = 0; j < 16; ++j) {
        // ggml keeps the rounded scale in an int8_t; it lies in [-32, 32].
        const int l =
            clamp_int(static_cast<std::int8_t>(round_even(iscale * scales[j])), -32, 31) + 32;
        if (j < 8)
          b.scales[j] = static_cast<std::uint8_t>(l & 0xF);
        else
          b.scales[j - 8] |= static_cast<std::uint8_t>((l & 0xF) << 4);
        b.scales[j % 4 + 8] |= static_cast<std::uint8_t>((l >> 4) << (2 * (j / 4)));
      }
      b.d = to_f16(1 / iscale);
    } else {
      b.d = to_f16(0.f);
    }
    for (int j = 0; j < 16; ++j) {
      const int low = j < 8 ? b.scales[j] & 0xF : b.scales[j - 8] >> 4;
      const int sc = (low | (((b.scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
      const float dl = f16_round_trip(b.d) * static_cast<float>(sc);
      if (dl == 0.0f) continue;
      for (int ii = 0; ii < 16; ++ii)
        codes[16 * j + ii] =
            static_cast<std::int8_t>(clamp_int(round_even(x[16 * j + ii] / dl), -4, 3) + 4);
    }
    // The high bit of code j goes to bit j / 32 of hmask[j % 32]; qs keeps
    // the low two.
    std::memset(b.hmask, 0, sizeof b.hmask);
    std::uint8_t low[qk_k];
    for (int j = 0; j < qk_k; ++j) {
      int c = codes[j];
      if (c > 3) {
        b.hmask[j % 32] |= static_cast<std::uint8_t>(1u << (j / 32));
        c -= 4;
      }
      low[j] = static_cast<std::uint8_t>(c);
    }
    pack_2bit(low, b.qs);
  }
}

void quantize_row_q4_k(const float* x, block_q4_k* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk_k; ++i, x += qk_k) {
    std::uint8_t codes[qk_k];
    block_q4_k& b = y[i];
    superblock_k4(x, 15, -1.f, 20, codes, b.d, b.dmin, b.scales);
    for (int j = 0; j < qk_k; j += 64)
      for (int l = 0; l < 32; ++l)
        b.qs[j / 2 + l] = static_cast<std::uint8_t>(codes[j + l] | (codes[j + l + 32] << 4));
  }
}

void quantize_row_q5_k(const float* x, block_q5_k* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk_k; ++i, x += qk_k) {
    std::uint8_t codes[qk_k];
    block_q5_k& b = y[i];
    superblock_k4(x, 31, -0.5f, 15, codes, b.d, b.dmin, b.scales);
    // Low nibbles as Q4_K; the fifth bit of codes n + j and n + j + 32 (n a
    // multiple of 64) at bits 2n/64 and 2n/64 + 1 of qh[j].
    std::memset(b.qh, 0, sizeof b.qh);
    for (int n = 0, pair = 0; n < qk_k; n += 64, ++pair)
      for (int j = 0; j < 32; ++j) {
        const int c1 = codes[n + j], c2 = codes[n + j + 32];
        b.qh[j] |=
            static_cast<std::uint8_t>(((c1 >> 4) << (2 * pair)) | ((c2 >> 4) << (2 * pair + 1)));
        b.qs[n / 2 + j] = static_cast<std::uint8_t>((c1 & 0xF) | ((c2 & 0xF) << 4));
      }
  }
}

void quantize_row_q6_k(const float* x, block_q6_k* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk_k; ++i, x += qk_k) {
    std::int8_t codes[qk_k];
    float scales[16];
    for (int j = 0; j < 16; ++j) scales[j] = fit_signed(16, 32, x + 16 * j, codes + 16 * j);
    const float max_scale = largest_magnitude(scales, 16);
    block_q6_k& b = y[i];
    if (std::fabs(max_scale) < group_eps) {
      b = block_q6_k{};
      b.d = to_f16(0.f);
      continue;
    }
    const float iscale = -128.f / max_scale;
    b.d = to_f16(1 / iscale);
    for (int j = 0; j < 16; ++j)
      b.scales[j] = static_cast<std::int8_t>(std::min(127, round_even(iscale * scales[j])));
    for (int j = 0; j < 16; ++j) {
      const float dl = f16_round_trip(b.d) * static_cast<float>(b.scales[j]);
      if (dl == 0.0f) continue;
      for (int ii = 0; ii < 16; ++ii)
        codes[16 * j + ii] =
            static_cast<std::int8_t>(clamp_int(round_even(x[16 * j + ii] / dl), -32, 31) + 32);
    }
    // Per 128-half: ql[l] holds the low nibbles of codes l and l + 64,
    // ql[l + 32] those of l + 32 and l + 96, qh[l] the top two bits of all four.
    for (int half = 0; half < 2; ++half) {
      const std::int8_t* c = codes + 128 * half;
      std::uint8_t* ql = b.ql + 64 * half;
      std::uint8_t* qh = b.qh + 32 * half;
      for (int l = 0; l < 32; ++l) {
        ql[l] = static_cast<std::uint8_t>((c[l] & 0xF) | ((c[l + 64] & 0xF) << 4));
        ql[l + 32] = static_cast<std::uint8_t>((c[l + 32] & 0xF) | ((c[l + 96] & 0xF) << 4));
        qh[l] = static_cast<std::uint8_t>((c[l] >> 4) | ((c[l + 32] >> 4) << 2) |
                                          ((c[l + 64] >> 4) << 4) | ((c[l + 96] >> 4) << 6));
      }
    }
  }
}

void quantize_row_iq4_nl(const float* x, block_iq4_nl* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk; ++i, x += qk) {
    std::uint8_t idx[32];
    const float d = iq4_block_scale(x);
    y[i].d = to_f16(d);
    const float id = d != 0.0f ? 1 / d : 0.0f;
    for (int j = 0; j < 32; ++j)
      idx[j] = static_cast<std::uint8_t>(nearest_table_index(kvalues_iq4nl, id * x[j]));
    pack_nibbles32(idx, 32, y[i].qs);
  }
}

void quantize_row_iq4_xs(const float* x, block_iq4_xs* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk_k; ++i, x += qk_k) {
    std::uint8_t idx[qk_k];
    float scales[8];
    for (int ib = 0; ib < 8; ++ib) scales[ib] = iq4_block_scale(x + 32 * ib);
    const float max_scale = largest_magnitude(scales, 8);
    block_iq4_xs& b = y[i];
    // The sub-block scales in 6 bits against d = -max / 32; the codes are
    // chosen against the unrounded d (ggml rounds only the stored copy).
    const float d = -max_scale / 32;
    b.d = to_f16(d);
    const float id = d != 0.0f ? 1 / d : 0.f;
    std::uint16_t scales_h = 0;
    std::memset(b.scales_l, 0, sizeof b.scales_l);
    for (int ib = 0; ib < 8; ++ib) {
      const int l = clamp_int(round_even(id * scales[ib]), -32, 31);
      const float dl = d * static_cast<float>(l);
      const float idl = dl != 0.0f ? 1 / dl : 0.f;
      for (int j = 0; j < 32; ++j)
        idx[32 * ib + j] =
            static_cast<std::uint8_t>(nearest_table_index(kvalues_iq4nl, idl * x[32 * ib + j]));
      const int stored = l + 32;
      b.scales_l[ib / 2] |= static_cast<std::uint8_t>((stored & 0xF) << (4 * (ib % 2)));
      scales_h |= static_cast<std::uint16_t>((stored >> 4) << (2 * (ib % 8)));
    }
    b.scales_h = scales_h;
    pack_nibbles32(idx, qk_k, b.qs);
  }
}

}  // namespace troupe::kernels
