#pragma once

#include <bit>
#include <cstdint>

namespace troupe::kernels {

/// IEEE 754 binary16 bits.
struct f16 {
  std::uint16_t bits = 0;
};
/// bfloat16 bits.
struct bf16 {
  std::uint16_t bits = 0;
};

/// binary16 -> binary32, exact (subnormals, infinities and NaN kept).
inline float to_f32(f16 h) {
  const std::uint32_t sign = std::uint32_t(h.bits & 0x8000u) << 16;
  std::uint32_t exp = (h.bits >> 10) & 0x1fu;
  std::uint32_t mant = h.bits & 0x3ffu;
  std::uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      out = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);
  } else {
    out = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(out);
}

/// binary32 -> binary16 with round-to-nearest-even, as F16C's vcvtps2ph does
/// (and so as ggml's GGML_FP32_TO_FP16 does on x86).
inline f16 to_f16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN (NaN stays quiet NaN)
    return f16{
        std::uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0u))};
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
    return f16{std::uint16_t(sign | 0x7c00u)};
  }
  if (abs < 0x38800000u) {                                   // result is subnormal or zero
    if (abs < 0x33000000u) return f16{std::uint16_t(sign)};  // < 2^-25 rounds to 0
    const std::uint32_t e = abs >> 23;
    const std::uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - e;  // 14 + (113 - e) - 1 ... aligns to 2^-24 units
    std::uint32_t q = m >> (shift - 0);
    // m * 2^(e-150) / 2^-24 = m >> (126 - e)
    const std::uint32_t rem = m & ((1u << shift) - 1);
    const std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return f16{std::uint16_t(sign | q)};
  }
  std::uint32_t h = ((abs >> 13) - ((127 - 15) << 10));
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return f16{std::uint16_t(sign | h)};
}

/// bfloat16 -> binary32, exact.
inline float to_f32(bf16 b) {
  return std::bit_cast<float>(std::uint32_t(b.bits) << 16);
}

/// binary32 -> bfloat16 with round-to-nearest-even (NaN stays NaN).
inline bf16 to_bf16(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16{std::uint16_t((x >> 16) | 0x40u)};
  x += 0x7fffu + ((x >> 16) & 1u);
  return bf16{std::uint16_t(x >> 16)};
}

}  // namespace troupe::kernels
