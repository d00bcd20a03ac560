#pragma once

// Weight matrices in the GGUF block formats past Q4_0 (Q4_1 .. IQ4_XS):
// random codes with scale fields set to sane f16 values, for kernel tests
// whose reference is the dequantized matrix (kernels::dequantize, checked
// against an independent implementation by the GGUF fixture tests). Random
// codes reach every code and scale pattern, where a quantizer's output
// reaches only the ones it picks.
#include <cstring>
#include <random>

#include "kernels/half.hpp"
#include "kernels/quant.hpp"

namespace troupe::test {

/// True for the formats the kernel tests make with random_block_weights
/// (the others are quantized from f32).
inline bool is_random_block_format(kernels::weight_format f) {
  return f > kernels::weight_format::q4_0;
}

/// rows x cols weights of format f (cols a whole number of its blocks) with
/// magnitudes around `scale`.
inline kernels::weight_matrix random_block_weights(kernels::memory_pool& pool,
                                                   kernels::weight_format f, std::int64_t rows,
                                                   std::int64_t cols, std::uint32_t seed,
                                                   float scale = 0.05f) {
  using namespace kernels;
  const dtype dt = *block_dtype(f);
  auto t = tensor::empty(pool, dt, {rows, cols});
  weight_matrix w;
  if (!t) return w;
  std::mt19937 rng(seed);
  auto* bytes = static_cast<std::uint8_t*>(t->data());
  for (std::size_t i = 0; i < t->nbytes(); ++i) bytes[i] = static_cast<std::uint8_t>(rng());
  std::uniform_real_distribution<float> mag(0.5f, 1.5f);
  auto put = [&](std::uint8_t* at, float v) {
    const std::uint16_t h = to_f16(v).bits;
    std::memcpy(at, &h, 2);
  };
  // d such that |d * code-range| is about `scale`; offsets negative (as a
  // min is subtracted) and of the same order.
  const std::size_t bb = block_bytes(dt);
  for (std::size_t off = 0; off < t->nbytes(); off += bb) {
    std::uint8_t* b = bytes + off;
    const float sign = (rng() & 1) ? 1.0f : -1.0f;
    switch (dt) {
      case dtype::q4_1:
      case dtype::q5_1:
        put(b, scale / (dt == dtype::q4_1 ? 8 : 16) * mag(rng));
        put(b + 2, -scale * mag(rng));
        break;
      case dtype::q5_0:
        put(b, sign * scale / 16 * mag(rng));
        break;
      case dtype::iq4_nl:
      case dtype::iq4_xs:
        put(b, sign * scale / 100 * mag(rng) / (dt == dtype::iq4_xs ? 16 : 1));
        break;
      case dtype::q2_k:
        put(b + 80, scale / 20 * mag(rng));
        put(b + 82, scale / 15 * mag(rng));
        break;
      case dtype::q3_k:
        put(b + 108, sign * scale / 64 * mag(rng));
        break;
      case dtype::q4_k:
      case dtype::q5_k:
        put(b, scale / (dt == dtype::q4_k ? 300 : 600) * mag(rng));
        put(b + 2, scale / 60 * mag(rng));
        break;
      case dtype::q6_k:
        put(b + 208, sign * scale / 2000 * mag(rng));
        break;
      default:
        break;
    }
  }
  w.format = f;
  w.rows = rows;
  w.cols = cols;
  w.data = std::move(*t);
  return w;
}

}  // namespace troupe::test
