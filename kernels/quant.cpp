#include "kernels/quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

namespace troupe::kernels {

std::string_view to_string(weight_format f) {
  switch (f) {
    case weight_format::f32:
      return "f32";
    case weight_format::f16:
      return "f16";
    case weight_format::bf16:
      return "bf16";
    case weight_format::int8_sym:
      return "int8";
    case weight_format::int8_asym:
      return "int8_asym";
    case weight_format::int4_sym:
      return "int4";
    case weight_format::int4_asym:
      return "int4_asym";
    case weight_format::q8_0:
      return "q8_0";
    case weight_format::q4_0:
      return "q4_0";
    case weight_format::q4_1:
      return "q4_1";
    case weight_format::q5_0:
      return "q5_0";
    case weight_format::q5_1:
      return "q5_1";
    case weight_format::q2_k:
      return "q2_k";
    case weight_format::q3_k:
      return "q3_k";
    case weight_format::q4_k:
      return "q4_k";
    case weight_format::q5_k:
      return "q5_k";
    case weight_format::q6_k:
      return "q6_k";
    case weight_format::iq4_nl:
      return "iq4_nl";
    case weight_format::iq4_xs:
      return "iq4_xs";
  }
  return "unknown";
}

result<weight_format> weight_format_from_string(std::string_view name) {
  for (int i = 0; i <= static_cast<int>(weight_format::iq4_xs); ++i) {
    const auto f = static_cast<weight_format>(i);
    if (to_string(f) == name) return f;
  }
  return make_error(errc::unsupported_dtype,
                    "unknown weight format '" + std::string(name) +
                        "' (f32, f16, bf16, int8, int8_asym, int4, int4_asym, q8_0, q4_0, q4_1, "
                        "q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs)");
}

result<weight_format> quant_target_from_string(std::string_view name) {
  auto f = weight_format_from_string(name);
  if (!f) return f;
  if (!quantizable(*f))
    return make_error(errc::unsupported_dtype, "troupe does not quantize to " + std::string(name));
  return f;
}

namespace {

constexpr std::pair<weight_format, dtype> block_formats[] = {
    {weight_format::q8_0, dtype::q8_0},     {weight_format::q4_0, dtype::q4_0},
    {weight_format::q4_1, dtype::q4_1},     {weight_format::q5_0, dtype::q5_0},
    {weight_format::q5_1, dtype::q5_1},     {weight_format::q2_k, dtype::q2_k},
    {weight_format::q3_k, dtype::q3_k},     {weight_format::q4_k, dtype::q4_k},
    {weight_format::q5_k, dtype::q5_k},     {weight_format::q6_k, dtype::q6_k},
    {weight_format::iq4_nl, dtype::iq4_nl}, {weight_format::iq4_xs, dtype::iq4_xs}};

}  // namespace

std::optional<dtype> block_dtype(weight_format f) {
  for (const auto& [bf, dt] : block_formats)
    if (bf == f) return dt;
  return std::nullopt;
}

std::optional<weight_format> block_format(dtype t) {
  for (const auto& [bf, dt] : block_formats)
    if (dt == t) return bf;
  return std::nullopt;
}

double bits_per_weight(weight_format f, int group) {
  switch (f) {
    case weight_format::f32:
      return 32;
    case weight_format::f16:
    case weight_format::bf16:
      return 16;
    case weight_format::int8_sym:
    case weight_format::int8_asym:
      return 8;
    case weight_format::int4_sym:
      return 4 + 32.0 / group;
    case weight_format::int4_asym:
      return 4 + 40.0 / group;
    case weight_format::q8_0:
      return 8.5;
    case weight_format::q4_0:
    case weight_format::q4_k:
    case weight_format::iq4_nl:
      return 4.5;
    case weight_format::q4_1:
      return 5;
    case weight_format::q5_0:
    case weight_format::q5_k:
      return 5.5;
    case weight_format::q5_1:
      return 6;
    case weight_format::q2_k:
      return 2.625;
    case weight_format::q3_k:
      return 3.4375;
    case weight_format::q6_k:
      return 6.5625;
    case weight_format::iq4_xs:
      return 4.25;
  }
  return 0;
}

double held_bits_per_weight(weight_format f, int group) {
  switch (f) {
    case weight_format::q4_1:
      return 6;  // f32 scale and offset per 32
    case weight_format::q5_1:
      return 7;
    case weight_format::q2_k:
      return 5.125;  // 2-bit codes in nibbles, int8 scale and min per 16
    case weight_format::q3_k:
      return 4.5625;
    case weight_format::q4_k:
    case weight_format::q5_k:
      return bits_per_weight(f) + 0.125;  // int8 scale and min per 32
    case weight_format::iq4_xs:
      return 4.3125;
    default:
      return bits_per_weight(f, group);
  }
}

std::size_t weight_matrix::storage_bytes() const {
  std::size_t n = data.empty_view() ? 0 : data.nbytes();
  if (!scales.empty_view()) n += scales.nbytes();
  if (!zeros.empty_view()) n += zeros.nbytes();
  return n;
}

namespace {

bool is_int4(weight_format f) {
  return f == weight_format::int4_sym || f == weight_format::int4_asym;
}

result<void> check_part(const tensor& t, dtype want, std::int64_t r, std::int64_t c,
                        const char* what) {
  if (t.empty_view())
    return make_error(errc::invalid_argument, std::string("weight ") + what + " missing");
  if (t.type() != want || t.ndim() != 2 || t.dim(0) != r || t.dim(1) != c || !t.is_contiguous())
    return make_error(errc::shape_mismatch,
                      std::string("weight ") + what + " must be " + std::string(to_string(want)) +
                          " [" + std::to_string(r) + ", " + std::to_string(c) + "], got " +
                          std::string(to_string(t.type())) + " " + t.shape().to_string());
  return {};
}

}  // namespace

result<void> weight_matrix::validate() const {
  if (rows <= 0 || cols <= 0)
    return make_error(errc::invalid_argument, "weight matrix must be non-empty");
  switch (format) {
    case weight_format::f32:
      return check_part(data, dtype::f32, rows, cols, "data");
    case weight_format::f16:
      return check_part(data, dtype::f16, rows, cols, "data");
    case weight_format::bf16:
      return check_part(data, dtype::bf16, rows, cols, "data");
    case weight_format::int8_sym:
      if (auto r = check_part(data, dtype::i8, rows, cols, "data"); !r) return r;
      return check_part(scales, dtype::f32, rows, 1, "scales");
    case weight_format::int8_asym:
      if (auto r = check_part(data, dtype::u8, rows, cols, "data"); !r) return r;
      if (auto r = check_part(scales, dtype::f32, rows, 1, "scales"); !r) return r;
      return check_part(zeros, dtype::u8, rows, 1, "zeros");
    case weight_format::int4_sym:
    case weight_format::int4_asym: {
      if (group != 32 && group != 64 && group != 128)
        return make_error(errc::invalid_argument, "int4 group must be 32, 64 or 128");
      if (cols % group != 0)
        return make_error(errc::shape_mismatch,
                          "int4 columns must be a multiple of the group size");
      if (auto r = check_part(data, dtype::u8, rows, cols / 2, "data"); !r) return r;
      if (auto r = check_part(scales, dtype::f32, rows, cols / group, "scales"); !r) return r;
      if (format == weight_format::int4_asym)
        return check_part(zeros, dtype::u8, rows, cols / group, "zeros");
      return {};
    }
    default:
      break;
  }
  if (auto dt = block_dtype(format)) {
    if (cols % block_elems(*dt) != 0)
      return make_error(errc::shape_mismatch,
                        std::string(to_string(format)) + " needs columns " + "divisible by " +
                            std::to_string(block_elems(*dt)) + ", got " + std::to_string(cols));
    return check_part(data, *dt, rows, cols, "data");
  }
  return make_error(errc::unsupported_dtype, "unknown weight format");
}

// --- ggml reference quantizers (ggml-quants.c: quantize_row_q8_0_ref, ...) ---

void quantize_row_q8_0(const float* x, block_q8_0* y, std::int64_t k) {
  const std::int64_t nb = k / qk;
  for (std::int64_t i = 0; i < nb; ++i) {
    float amax = 0.0f;
    for (int j = 0; j < qk; ++j) amax = std::max(amax, std::fabs(x[i * qk + j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = to_f16(d);
    for (int j = 0; j < qk; ++j)
      y[i].qs[j] = static_cast<std::int8_t>(std::roundf(x[i * qk + j] * id));
  }
}

void quantize_row_q4_0(const float* x, block_q4_0* y, std::int64_t k) {
  const std::int64_t nb = k / qk;
  for (std::int64_t i = 0; i < nb; ++i) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < qk; ++j) {
      const float v = x[i * qk + j];
      if (amax < std::fabs(v)) {
        amax = std::fabs(v);
        max = v;
      }
    }
    const float d = max / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = to_f16(d);
    for (int j = 0; j < qk / 2; ++j) {
      const float x0 = x[i * qk + j] * id;
      const float x1 = x[i * qk + qk / 2 + j] * id;
      const auto xi0 = std::min<std::int8_t>(15, static_cast<std::int8_t>(x0 + 8.5f));
      const auto xi1 = std::min<std::int8_t>(15, static_cast<std::int8_t>(x1 + 8.5f));
      y[i].qs[j] = static_cast<std::uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

namespace {

// The smallest and largest value of a 32-run (ggml starts from +-FLT_MAX).
void min_max(const float* x, float& lo, float& hi) {
  lo = std::numeric_limits<float>::max();
  hi = -std::numeric_limits<float>::max();
  for (int j = 0; j < qk; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
}

// The value of largest magnitude of a 32-run, its sign kept (the first of
// equal magnitudes).
float signed_absmax(const float* x) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < qk; ++j)
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

}  // namespace

// Q4_1: scale (max - min) / 15 and offset min, codes rounded half up.
void quantize_row_q4_1(const float* x, block_q4_1* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk; ++i) {
    const float* b = x + i * qk;
    float lo = 0, hi = 0;
    min_max(b, lo, hi);
    const float d = (hi - lo) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = to_f16(d);
    y[i].m = to_f16(lo);
    for (int j = 0; j < qk / 2; ++j) {
      const auto q0 = std::min<std::uint8_t>(
          15, static_cast<std::uint8_t>(static_cast<std::int8_t>((b[j] - lo) * id + 0.5f)));
      const auto q1 = std::min<std::uint8_t>(
          15,
          static_cast<std::uint8_t>(static_cast<std::int8_t>((b[qk / 2 + j] - lo) * id + 0.5f)));
      y[i].qs[j] = static_cast<std::uint8_t>(q0 | (q1 << 4));
    }
  }
}

// Q5_0: Q4_0's rule over 5 bits (the extreme maps to -16), the fifth bits in qh.
void quantize_row_q5_0(const float* x, block_q5_0* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk; ++i) {
    const float* b = x + i * qk;
    const float d = signed_absmax(b) / -16;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = to_f16(d);
    std::uint32_t qh = 0;
    for (int j = 0; j < qk / 2; ++j) {
      const auto q0 = static_cast<std::uint8_t>(
          std::min<std::int8_t>(31, static_cast<std::int8_t>(b[j] * id + 16.5f)));
      const auto q1 = static_cast<std::uint8_t>(
          std::min<std::int8_t>(31, static_cast<std::int8_t>(b[qk / 2 + j] * id + 16.5f)));
      y[i].qs[j] = static_cast<std::uint8_t>((q0 & 0x0f) | ((q1 & 0x0f) << 4));
      qh |= static_cast<std::uint32_t>((q0 & 0x10u) >> 4) << j;
      qh |= static_cast<std::uint32_t>((q1 & 0x10u) >> 4) << (j + qk / 2);
    }
    std::memcpy(y[i].qh, &qh, sizeof(qh));
  }
}

// Q5_1: Q4_1's rule over 5 bits (no clamp: (max - min) / 31 keeps codes <= 31).
void quantize_row_q5_1(const float* x, block_q5_1* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk; ++i) {
    const float* b = x + i * qk;
    float lo = 0, hi = 0;
    min_max(b, lo, hi);
    const float d = (hi - lo) / 31.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = to_f16(d);
    y[i].m = to_f16(lo);
    std::uint32_t qh = 0;
    for (int j = 0; j < qk / 2; ++j) {
      const auto q0 = static_cast<std::uint8_t>((b[j] - lo) * id + 0.5f);
      const auto q1 = static_cast<std::uint8_t>((b[qk / 2 + j] - lo) * id + 0.5f);
      y[i].qs[j] = static_cast<std::uint8_t>((q0 & 0x0f) | ((q1 & 0x0f) << 4));
      qh |= static_cast<std::uint32_t>((q0 & 0x10u) >> 4) << j;
      qh |= static_cast<std::uint32_t>((q1 & 0x10u) >> 4) << (j + qk / 2);
    }
    std::memcpy(y[i].qh, &qh, sizeof(qh));
  }
}

void dequantize_row_q8_0(const block_q8_0* x, float* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk; ++i) {
    const float d = to_f32(x[i].d);
    for (int j = 0; j < qk; ++j) y[i * qk + j] = x[i].qs[j] * d;
  }
}

void dequantize_row_q4_0(const block_q4_0* x, float* y, std::int64_t k) {
  for (std::int64_t i = 0; i < k / qk; ++i) {
    const float d = to_f32(x[i].d);
    for (int j = 0; j < qk / 2; ++j) {
      y[i * qk + j] = static_cast<float>((x[i].qs[j] & 0x0f) - 8) * d;
      y[i * qk + j + qk / 2] = static_cast<float>((x[i].qs[j] >> 4) - 8) * d;
    }
  }
}

// --- GGUF block formats as 32-element runs (ggml-quants.c's dequantize_row_*) ---

namespace {

template <class B>
const B& block_at(const std::byte* row, std::int64_t i) {
  return reinterpret_cast<const B*>(row)[i];
}

// Q4_K / Q5_K: 6-bit scale and min of sub-block j from the 12 packed bytes.
void scale_min_k4(int j, const std::uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q3_K: the 16 6-bit scales (0..63) from the 12 packed bytes.
void q3_k_scales(const std::uint8_t* packed, int* out) {
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? (packed[i] & 0x0f) : (packed[i - 8] >> 4);
    const int hi = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
    out[i] = lo | (hi << 4);
  }
}

std::uint32_t load_u32(const std::uint8_t* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

void decode_block32(dtype t, const std::byte* row, std::int64_t b, block32& o) {
  o.has_offset = false;
  o.offset[0] = o.offset[1] = 0.0f;
  auto same = [&](float sc) { o.scale[0] = o.scale[1] = sc; };
  auto nibbles = [&](const std::uint8_t* qs, int bias) {  // Q4_0's order
    for (int j = 0; j < 16; ++j) {
      o.code[j] = static_cast<std::int8_t>((qs[j] & 0x0f) - bias);
      o.code[j + 16] = static_cast<std::int8_t>((qs[j] >> 4) - bias);
    }
  };
  auto fives = [&](const std::uint8_t* qs, const std::uint8_t* qh, int bias) {
    const std::uint32_t h = load_u32(qh);
    for (int j = 0; j < 16; ++j) {
      const int x0 = (qs[j] & 0x0f) | static_cast<int>(((h >> j) << 4) & 0x10);
      const int x1 = (qs[j] >> 4) | static_cast<int>((h >> (j + 12)) & 0x10);
      o.code[j] = static_cast<std::int8_t>(x0 - bias);
      o.code[j + 16] = static_cast<std::int8_t>(x1 - bias);
    }
  };
  const std::int64_t sb = b / 8;  // superblock of the K formats
  const int sub = static_cast<int>(b % 8);
  switch (t) {
    case dtype::q8_0: {
      const auto& x = block_at<block_q8_0>(row, b);
      same(to_f32(x.d));
      std::memcpy(o.code, x.qs, 32);
      return;
    }
    case dtype::q4_0: {
      const auto& x = block_at<block_q4_0>(row, b);
      same(to_f32(x.d));
      nibbles(x.qs, 8);
      return;
    }
    case dtype::q4_1: {
      const auto& x = block_at<block_q4_1>(row, b);
      same(to_f32(x.d));
      o.has_offset = true;
      o.offset[0] = o.offset[1] = to_f32(x.m);
      nibbles(x.qs, 0);
      return;
    }
    case dtype::q5_0: {
      const auto& x = block_at<block_q5_0>(row, b);
      same(to_f32(x.d));
      fives(x.qs, x.qh, 16);
      return;
    }
    case dtype::q5_1: {
      const auto& x = block_at<block_q5_1>(row, b);
      same(to_f32(x.d));
      o.has_offset = true;
      o.offset[0] = o.offset[1] = to_f32(x.m);
      fives(x.qs, x.qh, 0);
      return;
    }
    case dtype::iq4_nl: {
      const auto& x = block_at<block_iq4_nl>(row, b);
      same(to_f32(x.d));
      for (int j = 0; j < 16; ++j) {
        o.code[j] = kvalues_iq4nl[x.qs[j] & 0x0f];
        o.code[j + 16] = kvalues_iq4nl[x.qs[j] >> 4];
      }
      return;
    }
    case dtype::iq4_xs: {
      const auto& x = block_at<block_iq4_xs>(row, sb);
      const int ls = ((x.scales_l[sub / 2] >> (4 * (sub % 2))) & 0x0f) |
                     (((x.scales_h >> (2 * sub)) & 3) << 4);
      same(to_f32(x.d) * static_cast<float>(ls - 32));
      const std::uint8_t* qs = x.qs + 16 * sub;
      for (int j = 0; j < 16; ++j) {
        o.code[j] = kvalues_iq4nl[qs[j] & 0x0f];
        o.code[j + 16] = kvalues_iq4nl[qs[j] >> 4];
      }
      return;
    }
    case dtype::q2_k: {
      const auto& x = block_at<block_q2_k>(row, sb);
      const int n = sub / 4, shift = 2 * (sub % 4);
      const std::uint8_t* q = x.qs + 32 * n;
      const float d = to_f32(x.d), dmin = to_f32(x.dmin);
      o.has_offset = true;
      for (int h = 0; h < 2; ++h) {
        const int sc = x.scales[8 * n + 2 * (sub % 4) + h];
        o.scale[h] = d * static_cast<float>(sc & 0x0f);
        o.offset[h] = -(dmin * static_cast<float>(sc >> 4));
        for (int l = 0; l < 16; ++l)
          o.code[16 * h + l] = static_cast<std::int8_t>((q[16 * h + l] >> shift) & 3);
      }
      return;
    }
    case dtype::q3_k: {
      const auto& x = block_at<block_q3_k>(row, sb);
      int scales[16];
      q3_k_scales(x.scales, scales);
      const int n = sub / 4, shift = 2 * (sub % 4);
      const std::uint8_t* q = x.qs + 32 * n;
      const std::uint8_t m = static_cast<std::uint8_t>(1u << (4 * n + sub % 4));
      const float d = to_f32(x.d);
      for (int h = 0; h < 2; ++h) {
        o.scale[h] = d * static_cast<float>(scales[8 * n + 2 * (sub % 4) + h] - 32);
        for (int l = 0; l < 16; ++l) {
          const int i = 16 * h + l;
          o.code[i] = static_cast<std::int8_t>(((q[i] >> shift) & 3) - ((x.hmask[i] & m) ? 0 : 4));
        }
      }
      return;
    }
    case dtype::q4_k:
    case dtype::q5_k: {
      const bool five = t == dtype::q5_k;
      const auto* k4 = five ? nullptr : &block_at<block_q4_k>(row, sb);
      const auto* k5 = five ? &block_at<block_q5_k>(row, sb) : nullptr;
      const f16 dh = five ? k5->d : k4->d, mh = five ? k5->dmin : k4->dmin;
      const std::uint8_t* scales = five ? k5->scales : k4->scales;
      const std::uint8_t* q = (five ? k5->qs : k4->qs) + 32 * (sub / 2);
      int sc = 0, m = 0;
      scale_min_k4(sub, scales, sc, m);
      same(to_f32(dh) * static_cast<float>(sc));
      o.has_offset = true;
      o.offset[0] = o.offset[1] = -(to_f32(mh) * static_cast<float>(m));
      const int shift = 4 * (sub % 2);
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 0x0f;
        if (five && (k5->qh[l] & (1u << sub))) v += 16;
        o.code[l] = static_cast<std::int8_t>(v);
      }
      return;
    }
    case dtype::q6_k: {
      const auto& x = block_at<block_q6_k>(row, sb);
      const int n = sub / 4, g = sub % 4;
      const std::uint8_t* ql = x.ql + 64 * n + (g % 2) * 32;
      const std::uint8_t* qh = x.qh + 32 * n;
      const int lshift = g < 2 ? 0 : 4, hshift = 2 * g;
      const float d = to_f32(x.d);
      for (int h = 0; h < 2; ++h) o.scale[h] = d * static_cast<float>(x.scales[8 * n + 2 * g + h]);
      for (int l = 0; l < 32; ++l)
        o.code[l] = static_cast<std::int8_t>(
            (((ql[l] >> lshift) & 0x0f) | (((qh[l] >> hshift) & 3) << 4)) - 32);
      return;
    }
    default:
      break;
  }
  std::memset(o.code, 0, sizeof o.code);
  same(0.0f);
}

bool superblock_scales(dtype t, const std::byte* row, std::int64_t sb, float& d, float& dmin) {
  dmin = 0.0f;
  switch (t) {
    case dtype::q2_k:
      d = to_f32(block_at<block_q2_k>(row, sb).d);
      dmin = to_f32(block_at<block_q2_k>(row, sb).dmin);
      return true;
    case dtype::q3_k:
      d = to_f32(block_at<block_q3_k>(row, sb).d);
      return true;
    case dtype::q4_k:
      d = to_f32(block_at<block_q4_k>(row, sb).d);
      dmin = to_f32(block_at<block_q4_k>(row, sb).dmin);
      return true;
    case dtype::q5_k:
      d = to_f32(block_at<block_q5_k>(row, sb).d);
      dmin = to_f32(block_at<block_q5_k>(row, sb).dmin);
      return true;
    case dtype::q6_k:
      d = to_f32(block_at<block_q6_k>(row, sb).d);
      return true;
    case dtype::iq4_xs:
      d = to_f32(block_at<block_iq4_xs>(row, sb).d);
      return true;
    default:
      return false;
  }
}

void dequantize_row_blocks(dtype t, const std::byte* row, float* y, std::int64_t k) {
  block32 blk;
  for (std::int64_t b = 0; b < k / 32; ++b) {
    decode_block32(t, row, b, blk);
    for (int j = 0; j < 32; ++j) {
      const float v = blk.scale[j / 16] * static_cast<float>(blk.code[j]);
      y[b * 32 + j] = blk.has_offset ? v + blk.offset[j / 16] : v;
    }
  }
}

namespace {

// int4 group quantizers; codes use Q4_0's nibble order within each 32-run.
void put_nibble(std::uint8_t* row, std::int64_t c, std::uint8_t q) {
  const std::int64_t base = c / 32 * 16, j = c % 32;
  std::uint8_t& b = row[base + (j % 16)];
  if (j < 16)
    b = static_cast<std::uint8_t>((b & 0xf0) | q);
  else
    b = static_cast<std::uint8_t>((b & 0x0f) | (q << 4));
}

std::uint8_t get_nibble(const std::uint8_t* row, std::int64_t c) {
  const std::int64_t base = c / 32 * 16, j = c % 32;
  const std::uint8_t b = row[base + (j % 16)];
  return j < 16 ? (b & 0x0f) : (b >> 4);
}

// The reference quantizer of a GGUF block format, over a row's bytes.
using row_quantizer = void (*)(const float*, std::byte*, std::int64_t);

template <class Block, void (*Fn)(const float*, Block*, std::int64_t)>
void quantize_into(const float* x, std::byte* row, std::int64_t k) {
  Fn(x, reinterpret_cast<Block*>(row), k);
}

row_quantizer gguf_row_quantizer(weight_format f) {
  switch (f) {
    case weight_format::q8_0:
      return quantize_into<block_q8_0, quantize_row_q8_0>;
    case weight_format::q4_0:
      return quantize_into<block_q4_0, quantize_row_q4_0>;
    case weight_format::q4_1:
      return quantize_into<block_q4_1, quantize_row_q4_1>;
    case weight_format::q5_0:
      return quantize_into<block_q5_0, quantize_row_q5_0>;
    case weight_format::q5_1:
      return quantize_into<block_q5_1, quantize_row_q5_1>;
    case weight_format::q2_k:
      return quantize_into<block_q2_k, quantize_row_q2_k>;
    case weight_format::q3_k:
      return quantize_into<block_q3_k, quantize_row_q3_k>;
    case weight_format::q4_k:
      return quantize_into<block_q4_k, quantize_row_q4_k>;
    case weight_format::q5_k:
      return quantize_into<block_q5_k, quantize_row_q5_k>;
    case weight_format::q6_k:
      return quantize_into<block_q6_k, quantize_row_q6_k>;
    case weight_format::iq4_nl:
      return quantize_into<block_iq4_nl, quantize_row_iq4_nl>;
    default:
      return quantize_into<block_iq4_xs, quantize_row_iq4_xs>;
  }
}

}  // namespace

result<weight_matrix> quantize(memory_pool& pool, const tensor& src, weight_format format,
                               int group) {
  if (auto r = expect_tensor(src, dtype::f32, 2, "quantize source"); !r)
    return std::unexpected(r.error());
  weight_matrix w;
  w.format = format;
  w.rows = src.dim(0);
  w.cols = src.dim(1);
  if (w.rows <= 0 || w.cols <= 0)
    return make_error(errc::invalid_argument, "cannot quantize an empty matrix");
  const std::int64_t R = w.rows, C = w.cols;
  auto alloc = [&](tensor& t, dtype dt, std::int64_t r, std::int64_t c) -> result<void> {
    auto made = tensor::zeros(pool, dt, {r, c});
    if (!made) return std::unexpected(made.error());
    t = std::move(*made);
    return {};
  };
  if (const auto dt = block_dtype(format)) {  // GGUF blocks: ggml's row quantizers
    if (C % block_elems(*dt) != 0)
      return make_error(errc::shape_mismatch,
                        std::string(to_string(format)) + " needs columns divisible by " +
                            std::to_string(block_elems(*dt)) + ", got " + std::to_string(C));
    if (auto r = alloc(w.data, *dt, R, C); !r) return std::unexpected(r.error());
    const auto quantize_row = gguf_row_quantizer(format);
    for (std::int64_t i = 0; i < R; ++i) quantize_row(src.row_as<float>(i), w.data.row(i), C);
    return w;
  }
  if (is_int4(format)) {
    if (group != 32 && group != 64 && group != 128)
      return make_error(errc::invalid_argument,
                        "int4 group must be 32, 64 or 128, got " + std::to_string(group));
    if (C % group != 0)
      return make_error(errc::shape_mismatch,
                        "int4 needs columns divisible by the group size " + std::to_string(group));
    w.group = group;
  }
  switch (format) {
    case weight_format::f32:
      if (auto r = alloc(w.data, dtype::f32, R, C); !r) return std::unexpected(r.error());
      std::memcpy(w.data.data(), src.data(), src.nbytes());
      break;
    case weight_format::f16:
      if (auto r = alloc(w.data, dtype::f16, R, C); !r) return std::unexpected(r.error());
      for (std::int64_t i = 0; i < R * C; ++i)
        w.data.data_as<f16>()[i] = to_f16(src.data_as<float>()[i]);
      break;
    case weight_format::bf16:
      if (auto r = alloc(w.data, dtype::bf16, R, C); !r) return std::unexpected(r.error());
      for (std::int64_t i = 0; i < R * C; ++i)
        w.data.data_as<bf16>()[i] = to_bf16(src.data_as<float>()[i]);
      break;
    case weight_format::int8_sym: {
      if (auto r = alloc(w.data, dtype::i8, R, C); !r) return std::unexpected(r.error());
      if (auto r = alloc(w.scales, dtype::f32, R, 1); !r) return std::unexpected(r.error());
      for (std::int64_t i = 0; i < R; ++i) {
        const float* x = src.row_as<float>(i);
        float amax = 0;
        for (std::int64_t j = 0; j < C; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
        w.scales.data_as<float>()[i] = d;
        for (std::int64_t j = 0; j < C; ++j)
          w.data.row_as<std::int8_t>(i)[j] =
              static_cast<std::int8_t>(std::clamp(std::roundf(x[j] * id), -127.0f, 127.0f));
      }
      break;
    }
    case weight_format::int8_asym: {
      if (auto r = alloc(w.data, dtype::u8, R, C); !r) return std::unexpected(r.error());
      if (auto r = alloc(w.scales, dtype::f32, R, 1); !r) return std::unexpected(r.error());
      if (auto r = alloc(w.zeros, dtype::u8, R, 1); !r) return std::unexpected(r.error());
      for (std::int64_t i = 0; i < R; ++i) {
        const float* x = src.row_as<float>(i);
        float lo = 0, hi = 0;  // the range always holds 0, so 0 is exact
        for (std::int64_t j = 0; j < C; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
        const float d = (hi - lo) / 255.0f, id = d != 0 ? 1.0f / d : 0.0f;
        const float z = std::clamp(std::roundf(-lo * id), 0.0f, 255.0f);
        w.scales.data_as<float>()[i] = d;
        w.zeros.data_as<std::uint8_t>()[i] = static_cast<std::uint8_t>(z);
        for (std::int64_t j = 0; j < C; ++j)
          w.data.row_as<std::uint8_t>(i)[j] =
              static_cast<std::uint8_t>(std::clamp(std::roundf(x[j] * id) + z, 0.0f, 255.0f));
      }
      break;
    }
    case weight_format::int4_sym:
    case weight_format::int4_asym: {
      const std::int64_t G = C / group;
      if (auto r = alloc(w.data, dtype::u8, R, C / 2); !r) return std::unexpected(r.error());
      if (auto r = alloc(w.scales, dtype::f32, R, G); !r) return std::unexpected(r.error());
      if (format == weight_format::int4_asym)
        if (auto r = alloc(w.zeros, dtype::u8, R, G); !r) return std::unexpected(r.error());
      for (std::int64_t i = 0; i < R; ++i) {
        const float* x = src.row_as<float>(i);
        auto* q = w.data.row_as<std::uint8_t>(i);
        for (std::int64_t g = 0; g < G; ++g) {
          const float* xg = x + g * group;
          if (format == weight_format::int4_sym) {  // Q4_0's rule: the extreme maps to -8
            float amax = 0, max = 0;
            for (int j = 0; j < group; ++j)
              if (amax < std::fabs(xg[j])) amax = std::fabs(xg[j]), max = xg[j];
            const float d = max / -8, id = d != 0 ? 1.0f / d : 0.0f;
            w.scales.row_as<float>(i)[g] = d;
            for (int j = 0; j < group; ++j)
              put_nibble(
                  q, g * group + j,
                  static_cast<std::uint8_t>(std::min(15, static_cast<int>(xg[j] * id + 8.5f))));
          } else {
            float lo = 0, hi = 0;
            for (int j = 0; j < group; ++j) lo = std::min(lo, xg[j]), hi = std::max(hi, xg[j]);
            const float d = (hi - lo) / 15.0f, id = d != 0 ? 1.0f / d : 0.0f;
            const float z = std::clamp(std::roundf(-lo * id), 0.0f, 15.0f);
            w.scales.row_as<float>(i)[g] = d;
            w.zeros.row_as<std::uint8_t>(i)[g] = static_cast<std::uint8_t>(z);
            for (int j = 0; j < group; ++j)
              put_nibble(
                  q, g * group + j,
                  static_cast<std::uint8_t>(std::clamp(std::roundf(xg[j] * id) + z, 0.0f, 15.0f)));
          }
        }
      }
      break;
    }
    default:
      return make_error(errc::unsupported_dtype, "unknown weight format");
  }
  return w;
}

result<void> dequantize_row(const weight_matrix& w, std::int64_t r, std::span<float> out) {
  if (r < 0 || r >= w.rows)
    return make_error(errc::invalid_argument, "row " + std::to_string(r) + " out of range");
  if (static_cast<std::int64_t>(out.size()) != w.cols)
    return make_error(errc::shape_mismatch,
                      "dequantize_row output must hold " + std::to_string(w.cols) + " floats");
  float* y = out.data();
  const std::int64_t C = w.cols;
  switch (w.format) {
    case weight_format::f32:
      std::memcpy(y, w.data.row(r), sizeof(float) * static_cast<std::size_t>(C));
      break;
    case weight_format::f16:
      for (std::int64_t j = 0; j < C; ++j) y[j] = to_f32(w.data.row_as<f16>(r)[j]);
      break;
    case weight_format::bf16:
      for (std::int64_t j = 0; j < C; ++j) y[j] = to_f32(w.data.row_as<bf16>(r)[j]);
      break;
    case weight_format::int8_sym: {
      const float d = w.scales.data_as<float>()[r];
      for (std::int64_t j = 0; j < C; ++j)
        y[j] = d * static_cast<float>(w.data.row_as<std::int8_t>(r)[j]);
      break;
    }
    case weight_format::int8_asym: {
      const float d = w.scales.data_as<float>()[r];
      const int z = w.zeros.data_as<std::uint8_t>()[r];
      for (std::int64_t j = 0; j < C; ++j)
        y[j] = d * static_cast<float>(w.data.row_as<std::uint8_t>(r)[j] - z);
      break;
    }
    case weight_format::int4_sym:
    case weight_format::int4_asym: {
      const auto* q = w.data.row_as<std::uint8_t>(r);
      for (std::int64_t j = 0; j < C; ++j) {
        const std::int64_t g = j / w.group;
        const float d = w.scales.row_as<float>(r)[g];
        const int z = w.format == weight_format::int4_asym ? w.zeros.row_as<std::uint8_t>(r)[g] : 8;
        y[j] = d * static_cast<float>(get_nibble(q, j) - z);
      }
      break;
    }
    case weight_format::q8_0:
      dequantize_row_q8_0(w.data.row_as<block_q8_0>(r), y, C);
      break;
    case weight_format::q4_0:
      dequantize_row_q4_0(w.data.row_as<block_q4_0>(r), y, C);
      break;
    default:
      dequantize_row_blocks(w.data.type(), w.data.row(r), y, C);
      break;
  }
  return {};
}

result<tensor> dequantize(memory_pool& pool, const weight_matrix& w) {
  if (auto r = w.validate(); !r) return std::unexpected(r.error());
  auto out = tensor::empty(pool, dtype::f32, {w.rows, w.cols});
  if (!out) return out;
  for (std::int64_t i = 0; i < w.rows; ++i)
    if (auto r = dequantize_row(w, i, {out->row_as<float>(i), static_cast<std::size_t>(w.cols)});
        !r)
      return std::unexpected(r.error());
  return out;
}

}  // namespace troupe::kernels
