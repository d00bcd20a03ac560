#pragma once

// Index and dequantization math of the CUDA backend, written once for host
// and device: the kernels in cuda_device.cu call these, and the unit tests
// (tests/kernels/cuda_math_test.cpp) run them on the CPU against the storage
// contract of kernels/quant.hpp, so the layouts are checked on a machine
// without a GPU. No CUDA header is needed to include this file.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TROUPE_HD __host__ __device__ __forceinline__
#else
#define TROUPE_HD inline
#endif

namespace troupe::kernels::cuda {

/// The weight formats, in kernels::weight_format's order (a static_assert
/// in cuda_device.cu keeps the two in step).
enum class wfmt : std::uint8_t {
  f32,
  f16,
  bf16,
  int8_sym,
  int8_asym,
  int4_sym,
  int4_asym,
  q8_0,
  q4_0,
};

/// A weight matrix [rows, cols] in its storage layout (kernels/quant.hpp),
/// wherever its bytes are (device memory in the kernels, host memory in
/// the tests).
struct weight_view {
  wfmt format = wfmt::f32;
  std::int64_t rows = 0, cols = 0;
  int group = 0;  ///< int4: columns per scale
  const std::uint8_t* data = nullptr;
  const float* scales = nullptr;        ///< int8: [rows]; int4: [rows, cols / group]
  const std::uint8_t* zeros = nullptr;  ///< int8_asym: [rows]; int4_asym: [rows, cols / group]
};

TROUPE_HD float bits_to_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/// IEEE binary16 bits -> float, exact (subnormals, infinities, NaN).
TROUPE_HD float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3ffu;
    return bits_to_float(sign | (exp << 23) | (mant << 13));
  }
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

TROUPE_HD float bf16_to_float(std::uint16_t b) {
  return bits_to_float(static_cast<std::uint32_t>(b) << 16);
}

/// Two little-endian bytes (the f16 scale of a GGUF block, which is only
/// 2-byte aligned).
TROUPE_HD std::uint16_t load_u16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}

/// Bytes of one stored row.
TROUPE_HD std::int64_t row_bytes(wfmt f, std::int64_t cols) {
  switch (f) {
    case wfmt::f32:
      return cols * 4;
    case wfmt::f16:
    case wfmt::bf16:
      return cols * 2;
    case wfmt::int8_sym:
    case wfmt::int8_asym:
      return cols;
    case wfmt::int4_sym:
    case wfmt::int4_asym:
      return cols / 2;
    case wfmt::q8_0:
      return cols / 32 * 34;
    case wfmt::q4_0:
      return cols / 32 * 18;
  }
  return 0;
}

/// Byte offset of column k's nibble within a row of an int4 or Q4_0 run of
/// 32 columns: column j of a run sits in the low nibble of byte j, column
/// j + 16 in its high nibble.
TROUPE_HD std::int64_t nibble_byte(std::int64_t k) {
  return (k / 32) * 16 + (k % 32 & 15);
}
TROUPE_HD int nibble_of(std::uint8_t byte, std::int64_t k) {
  return (k % 32) < 16 ? (byte & 15) : (byte >> 4);
}

/// w[n, k] as the storage contract defines it: the same float operations,
/// in the same order, as kernels::dequantize_row, so host and device agree
/// bit for bit.
TROUPE_HD float weight_at(const weight_view& w, std::int64_t n, std::int64_t k) {
  const std::uint8_t* row = w.data + n * row_bytes(w.format, w.cols);
  switch (w.format) {
    case wfmt::f32:
      return reinterpret_cast<const float*>(row)[k];
    case wfmt::f16:
      return half_to_float(reinterpret_cast<const std::uint16_t*>(row)[k]);
    case wfmt::bf16:
      return bf16_to_float(reinterpret_cast<const std::uint16_t*>(row)[k]);
    case wfmt::int8_sym:
      return w.scales[n] * static_cast<float>(static_cast<std::int8_t>(row[k]));
    case wfmt::int8_asym:
      return w.scales[n] *
             static_cast<float>(static_cast<int>(row[k]) - static_cast<int>(w.zeros[n]));
    case wfmt::int4_sym: {
      const std::int64_t g = n * (w.cols / w.group) + k / w.group;
      return w.scales[g] * static_cast<float>(nibble_of(row[nibble_byte(k)], k) - 8);
    }
    case wfmt::int4_asym: {
      const std::int64_t g = n * (w.cols / w.group) + k / w.group;
      return w.scales[g] *
             static_cast<float>(nibble_of(row[nibble_byte(k)], k) - static_cast<int>(w.zeros[g]));
    }
    case wfmt::q8_0: {
      const std::uint8_t* b = row + (k / 32) * 34;
      return half_to_float(load_u16(b)) *
             static_cast<float>(static_cast<std::int8_t>(b[2 + k % 32]));
    }
    case wfmt::q4_0: {
      const std::uint8_t* b = row + (k / 32) * 18;
      return half_to_float(load_u16(b)) *
             static_cast<float>(nibble_of(b[2 + (k % 32 & 15)], k) - 8);
    }
  }
  return 0.0f;
}

/// Whether query row position p sees key j (kernels/attention.hpp): causal
/// rows see keys <= p; a window keeps the first `sinks` keys and the last
/// `window` ones.
TROUPE_HD bool key_visible(bool causal, int window, int sinks, std::int64_t p, std::int64_t j) {
  if (!causal) return true;
  if (j > p) return false;
  if (window > 0) return j < sinks || j >= p + 1 - window;
  return true;
}

}  // namespace troupe::kernels::cuda
