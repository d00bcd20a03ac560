// Packing of weight matrices into the column-panel layout (matmul_layout.hpp)
// and the per-call activation quantizer shared by every ISA path.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/cpu/matmul_impl.hpp"
#include "kernels/matmul.hpp"

namespace troupe::kernels {

namespace {

using cpu::mm_kernel;
using cpu::mm_layout;
using cpu::mm_scale;
using cpu::mm_zero;

std::int64_t round_up(std::int64_t v, std::int64_t m) {
  return (v + m - 1) / m * m;
}

// int4 code of (row r, column c) in quant.hpp's nibble order.
std::uint8_t int4_code(const weight_matrix& w, std::int64_t r, std::int64_t c) {
  const auto* row = w.data.row_as<std::uint8_t>(r);
  const std::uint8_t b = row[c / 32 * 16 + (c % 32) % 16];
  return (c % 32) < 16 ? (b & 0x0f) : (b >> 4);
}

bool has_minus_128(const weight_matrix& w) {
  if (w.format == weight_format::int8_sym) {
    const auto* p = w.data.data_as<std::int8_t>();
    for (std::int64_t i = 0; i < w.rows * w.cols; ++i)
      if (p[i] == -128) return true;
  } else if (w.format == weight_format::q8_0) {
    for (std::int64_t r = 0; r < w.rows; ++r) {
      const auto* blk = w.data.row_as<block_q8_0>(r);
      for (std::int64_t b = 0; b < w.cols / qk; ++b)
        for (int j = 0; j < qk; ++j)
          if (blk[b].qs[j] == -128) return true;
    }
  }
  return false;
}

// Whether every 32-block of a K-quant / IQ4_XS matrix has its scale (and
// offset) as superblock d (dmin) times an int8, exactly: always so for what
// the formats can encode, unless d itself is not finite. Then the compact
// super_* layout holds the same values as the f32 one.
bool compact_scales(const weight_matrix& w) {
  const dtype dt = w.data.type();
  float d = 0, dmin = 0;
  if (!superblock_scales(dt, w.data.row(0), 0, d, dmin)) return false;
  block32 blk;
  auto factor = [](float v, float base, std::int8_t& out) {
    if (v == 0.0f) return out = 0, true;
    if (!std::isfinite(base) || base == 0.0f) return false;
    const float q = v / base;
    if (!(q >= -128.0f && q <= 127.0f) || q != std::nearbyint(q)) return false;
    out = static_cast<std::int8_t>(q);
    return base * static_cast<float>(out) == v;
  };
  for (std::int64_t r = 0; r < w.rows; ++r) {
    const std::byte* row = w.data.row(r);
    for (std::int64_t b = 0; b < w.cols / 32; ++b) {
      if (b % 8 == 0) superblock_scales(dt, row, b / 8, d, dmin);
      decode_block32(dt, row, b, blk);
      std::int8_t q = 0;
      for (int h = 0; h < 2; ++h) {
        if (!factor(blk.scale[h], d, q)) return false;
        if (blk.has_offset && !factor(-blk.offset[h], dmin, q)) return false;
      }
    }
  }
  return true;
}

mm_layout make_layout(const weight_matrix& w) {
  mm_layout l;
  l.n = w.rows;
  l.k = w.cols;
  switch (w.format) {
    case weight_format::f32:
    case weight_format::f16:
    case weight_format::bf16:
      l.kernel = w.format == weight_format::f32   ? mm_kernel::f32
                 : w.format == weight_format::f16 ? mm_kernel::f16
                                                  : mm_kernel::bf16;
      l.elem_bytes = w.format == weight_format::f32 ? 4 : 2;
      l.panel_cols = 32;
      l.kp = l.k;
      l.panels = (l.n + 31) / 32;
      l.panel_bytes = l.kp * 32 * l.elem_bytes;
      return l;
    case weight_format::int8_sym:
      l.kernel = has_minus_128(w) ? mm_kernel::s8_m : mm_kernel::s8;
      l.scale = mm_scale::col_end;
      l.panel_header = 64;
      l.block_bytes = 512;
      break;
    case weight_format::int8_asym:
      l.kernel = mm_kernel::s8_m;  // codes are stored as q - 128
      l.scale = mm_scale::col_end;
      l.zero = mm_zero::col_i32;
      l.panel_header = 128;
      l.block_bytes = 512;
      break;
    case weight_format::q8_0:
      l.kernel = has_minus_128(w) ? mm_kernel::s8_m : mm_kernel::s8;
      l.scale = mm_scale::block_f16;
      l.sb_blocks = 2;
      l.sb_header = 64;
      l.block_bytes = 512;
      break;
    case weight_format::q4_0:
      l.kernel = mm_kernel::u4;
      l.scale = mm_scale::block_f16;
      l.zero = mm_zero::eight;
      l.sb_blocks = 2;
      l.sb_header = 64;
      l.block_bytes = 256;
      break;
    case weight_format::int4_sym:
    case weight_format::int4_asym:
      l.kernel = mm_kernel::u4;
      l.scale = mm_scale::group_f32;
      l.zero = w.format == weight_format::int4_sym ? mm_zero::eight : mm_zero::group_u8;
      l.sb_blocks = w.group / 32;
      l.sb_header = w.format == weight_format::int4_sym ? 64 : 80;
      l.block_bytes = 256;
      break;
    default: {  // the other GGUF formats, as decode_block32 gives them
      const auto f = w.format;
      using wf = weight_format;
      const bool half = f == wf::q2_k || f == wf::q3_k || f == wf::q6_k;
      const bool offset =
          f == wf::q4_1 || f == wf::q5_1 || f == wf::q2_k || f == wf::q4_k || f == wf::q5_k;
      const bool kquant = f == wf::q2_k || f == wf::q3_k || f == wf::q4_k || f == wf::q5_k ||
                          f == wf::q6_k || f == wf::iq4_xs;
      const bool compact = kquant && compact_scales(w);
      // The code width as stored: nibbles (and bit planes) for the formats
      // with unsigned codes of at most 6 bits (signed ones shifted up by
      // `center`); int8 codes for IQ4 (a table of values) and for a K-quant
      // whose scales do not factor (then f32 scales per block).
      int bits = 8;
      if (f == wf::q4_1 || f == wf::q4_k) bits = 4;
      const bool lut = f == wf::iq4_nl || (f == wf::iq4_xs && compact);
      if ((f == wf::q2_k || f == wf::q3_k) && compact) bits = 4;
      if (f == wf::q5_0 || f == wf::q5_1 || (f == wf::q5_k && compact)) bits = 5;
      if (f == wf::q6_k && compact) bits = 6;
      l.center = f == wf::q5_0 ? 16 : f == wf::q6_k ? 32 : f == wf::q3_k ? 4 : 0;
      l.kernel = bits == 4   ? mm_kernel::u4
                 : bits == 5 ? mm_kernel::u5
                 : bits == 6 ? mm_kernel::u6
                             : mm_kernel::s8;  // no code is -128
      if (bits == 8) l.center = 0;             // int8 codes stay signed
      if (lut) {                               // IQ4: nibble indices into its table
        l.kernel = mm_kernel::i4lut;
        std::copy(std::begin(kvalues_iq4nl), std::end(kvalues_iq4nl), l.lut);
      }
      l.zero = offset ? mm_zero::offset_f32 : l.center ? mm_zero::center : mm_zero::none;
      l.block_bytes = stores_nibbles(l.kernel) ? 256 + 64 * high_planes(l.kernel) : 512;
      if (f == wf::q5_0 || f == wf::iq4_nl) {  // an f16 scale per block, as Q8_0
        l.scale = mm_scale::block_f16;
        l.sb_blocks = 2;
        l.sb_header = 64;
      } else if (compact) {  // the K-quants' d * sc, as the file has them
        l.scale = half ? mm_scale::super_half : mm_scale::super_f16;
        l.sb_blocks = 8;
        l.sb_header = cpu::super_m_at(offset, half) + (offset ? (half ? 256 : 128) : 0);
      } else if (half) {
        l.scale = mm_scale::half_f32;
        l.sb_header = offset ? 256 : 128;
      } else {
        l.scale = mm_scale::group_f32;
        l.sb_header = offset ? 128 : 64;
      }
      break;
    }
  }
  l.panel_cols = 16;
  l.panels = (l.n + 15) / 16;
  l.kp = round_up(l.k, 32);
  l.blocks = l.kp / 32;
  const std::int64_t full = l.blocks / l.sb_blocks, rem = l.blocks % l.sb_blocks;
  l.panel_bytes = l.panel_header + full * (l.sb_header + l.sb_blocks * l.block_bytes) +
                  (rem ? l.sb_header + rem * l.block_bytes : 0);
  l.panel_bytes = round_up(l.panel_bytes, 64);
  return l;
}

void pack_float_panel(const mm_layout& l, const weight_matrix& w, std::int64_t p, std::byte* dst) {
  const std::int64_t eb = l.elem_bytes;
  for (std::int64_t c = 0; c < 32; ++c) {
    const std::int64_t n = p * 32 + c;
    if (n >= l.n) break;  // padding stays zero
    const std::byte* src = w.data.row(n);
    for (std::int64_t k = 0; k < l.k; ++k)
      std::memcpy(dst + (k * 32 + c) * eb, src + k * eb, static_cast<std::size_t>(eb));
  }
}

template <class T>
void store(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// The GGUF formats past Q4_0: each 32-block decoded into codes, scales and
// offsets (decode_block32), stored as the layout says.
void pack_block_panel(const mm_layout& l, const weight_matrix& w, std::int64_t p, std::byte* dst) {
  const dtype dt = w.data.type();
  block32 blk;
  for (std::int64_t cc = 0; cc < 16; ++cc) {
    const std::int64_t n = p * 16 + cc;
    if (n >= l.n) break;
    const std::int64_t s = cc / 8, c = cc % 8;
    const std::byte* row = w.data.row(n);
    for (std::int64_t b = 0; b < l.blocks; ++b) {
      decode_block32(dt, row, b, blk);
      std::byte* hdr = dst + l.header_offset(b);
      std::byte* out = dst + l.block_offset(b);
      const bool off = l.zero == mm_zero::offset_f32;
      if (l.scale == mm_scale::super_f16 || l.scale == mm_scale::super_half) {
        // compact_scales() checked that these quotients are exact int8s.
        const bool half = l.scale == mm_scale::super_half;
        float d = 0, dmin = 0;
        superblock_scales(dt, row, b / 8, d, dmin);
        const std::int64_t j = b % 8;
        if (j == 0) {
          store(hdr + cc * 2, to_f16(d).bits);
          if (off) store(hdr + 32 + cc * 2, to_f16(dmin).bits);
        }
        auto q = [](float v, float base) {
          return static_cast<std::int8_t>(v == 0.0f ? 0.0f : v / base);
        };
        const std::int64_t sc_at = cpu::super_sc_at(off), m_at = cpu::super_m_at(off, half);
        for (int h = 0; h < (half ? 2 : 1); ++h) {
          const std::int64_t sub = half ? 2 * j + h : j;
          store(hdr + sc_at + sub * 16 + cc, q(blk.scale[h], d));
          if (off) store(hdr + m_at + sub * 16 + cc, q(-blk.offset[h], dmin));
        }
      } else if (l.scale == mm_scale::block_f16) {
        store(hdr + (b % l.sb_blocks) * 32 + cc * 2, to_f16(blk.scale[0]).bits);  // exact
      } else if (l.scale == mm_scale::half_f32) {
        store(hdr + cc * 4, blk.scale[0]);
        store(hdr + 64 + cc * 4, blk.scale[1]);
        if (off) store(hdr + 128 + cc * 4, blk.offset[0]), store(hdr + 192 + cc * 4, blk.offset[1]);
      } else {
        store(hdr + cc * 4, blk.scale[0]);
        if (off) store(hdr + 64 + cc * 4, blk.offset[0]);
      }
      for (std::int64_t j = 0; j < 32; ++j) {
        if (stores_nibbles(l.kernel)) {
          auto code = static_cast<std::uint8_t>(blk.code[j] + l.center);
          if (l.kernel == mm_kernel::i4lut)  // the table value's index
            code = static_cast<std::uint8_t>(std::find(l.lut, l.lut + 16, blk.code[j]) - l.lut);
          const std::int64_t v = (j % 16) / 4;
          auto* byte = reinterpret_cast<std::uint8_t*>(out + (v * 2 + s) * 32 + c * 4 + j % 4);
          *byte = static_cast<std::uint8_t>(j < 16 ? (*byte & 0xf0) | (code & 0x0f)
                                                   : (*byte & 0x0f) | (code << 4));
          const std::int64_t bit = s * 32 + c * 4 + j % 4;  // byte of vector v
          for (int pl = 0; pl < high_planes(l.kernel); ++pl)
            if ((code >> (4 + pl)) & 1) {
              auto* word = out + 256 + pl * 64 + (v * 2 + j / 16) * 8;
              std::uint64_t bits = 0;
              std::memcpy(&bits, word, 8);
              bits |= std::uint64_t{1} << bit;
              std::memcpy(word, &bits, 8);
            }
        } else {
          store(out + ((j / 4) * 2 + s) * 32 + c * 4 + j % 4, blk.code[j]);
        }
      }
    }
  }
}

void pack_int_panel(const mm_layout& l, const weight_matrix& w, std::int64_t p, std::byte* dst) {
  for (std::int64_t cc = 0; cc < 16; ++cc) {
    const std::int64_t n = p * 16 + cc;
    if (n >= l.n) break;  // padding columns: codes, scales and zeros all 0
    const std::int64_t s = cc / 8, c = cc % 8;
    // Panel header: per-column scale (and zero point).
    if (l.scale == mm_scale::col_end) store(dst + cc * 4, w.scales.data_as<float>()[n]);
    if (l.zero == mm_zero::col_i32)
      store(dst + 64 + cc * 4, static_cast<std::int32_t>(w.zeros.data_as<std::uint8_t>()[n]) - 128);
    for (std::int64_t b = 0; b < l.blocks; ++b) {
      std::byte* hdr = dst + l.header_offset(b);
      std::byte* blk = dst + l.block_offset(b);
      if (l.scale == mm_scale::block_f16) {
        const f16 d = w.format == weight_format::q8_0 ? w.data.row_as<block_q8_0>(n)[b].d
                                                      : w.data.row_as<block_q4_0>(n)[b].d;
        store(hdr + (b % l.sb_blocks) * 32 + cc * 2, d.bits);
      }
      if (l.scale == mm_scale::group_f32 && b % l.sb_blocks == 0) {
        const std::int64_t g = b / l.sb_blocks;
        store(hdr + cc * 4, w.scales.row_as<float>(n)[g]);
        if (l.zero == mm_zero::group_u8) store(hdr + 64 + cc, w.zeros.row_as<std::uint8_t>(n)[g]);
      }
      for (std::int64_t j = 0; j < 32; ++j) {
        const std::int64_t k = b * 32 + j;
        if (l.kernel == mm_kernel::u4) {
          std::uint8_t code = 0;
          if (w.format == weight_format::q4_0) {
            const auto& blk4 = w.data.row_as<block_q4_0>(n)[b];
            code = j < 16 ? (blk4.qs[j] & 0x0f) : (blk4.qs[j - 16] >> 4);
          } else {
            code = int4_code(w, n, k);
          }
          const std::int64_t v = (j % 16) / 4;
          auto* byte = reinterpret_cast<std::uint8_t*>(blk + (v * 2 + s) * 32 + c * 4 + j % 4);
          *byte = static_cast<std::uint8_t>(j < 16 ? (*byte & 0xf0) | code
                                                   : (*byte & 0x0f) | (code << 4));
        } else {
          std::int8_t code = 0;
          if (k < l.k) {
            if (w.format == weight_format::q8_0)
              code = w.data.row_as<block_q8_0>(n)[b].qs[j];
            else if (w.format == weight_format::int8_sym)
              code = w.data.row_as<std::int8_t>(n)[k];
            else
              code = static_cast<std::int8_t>(static_cast<int>(w.data.row_as<std::uint8_t>(n)[k]) -
                                              128);
          }
          store(blk + ((j / 4) * 2 + s) * 32 + c * 4 + j % 4, code);
        }
      }
    }
  }
}

}  // namespace

result<packed_matrix> packed_matrix::pack(cpu::context& ctx, const weight_matrix& w) {
  if (auto r = w.validate(); !r) return std::unexpected(r.error());
  if (auto dt = block_dtype(w.format); dt && w.cols % block_elems(*dt) != 0)
    return make_error(errc::shape_mismatch, std::string(to_string(w.format)) +
                                                " needs columns divisible by " +
                                                std::to_string(block_elems(*dt)));
  packed_matrix out;
  out.layout_ = make_layout(w);
  out.format_ = w.format;
  out.group_ = w.group;
  const mm_layout& l = out.layout_;
  const auto total = static_cast<std::size_t>(l.panels * l.panel_bytes);
  auto buf = ctx.memory().allocate(total);
  if (!buf) return std::unexpected(buf.error());
  out.storage_ = std::move(*buf);
  out.data_ = static_cast<std::byte*>(out.storage_->data());
  ctx.pool().parallel_for(l.panels, 1, [&](std::int64_t p0, std::int64_t p1, int) {
    for (std::int64_t p = p0; p < p1; ++p) {
      std::byte* dst = out.data_ + p * l.panel_bytes;
      std::memset(dst, 0, static_cast<std::size_t>(l.panel_bytes));
      if (l.is_float())
        pack_float_panel(l, w, p, dst);
      else if (w.format > weight_format::q4_0)
        pack_block_panel(l, w, p, dst);
      else
        pack_int_panel(l, w, p, dst);
    }
  });
  return out;
}

result<packed_matrix> packed_matrix::clone(cpu::context& ctx) const {
  packed_matrix out = *this;
  if (empty()) return out;
  auto buf = ctx.memory().allocate(bytes());
  if (!buf) return std::unexpected(buf.error());
  out.storage_ = std::move(*buf);
  out.data_ = static_cast<std::byte*>(out.storage_->data());
  std::memcpy(out.data_, data_, bytes());
  return out;
}

namespace cpu {

void mm_quantize_block(const float* x, std::int64_t valid, std::int8_t* q, std::int8_t* a, float* d,
                       std::int32_t* s) {
  float amax = 0.0f;
  for (std::int64_t j = 0; j < valid; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float dx = amax / 127.0f;
  const float id = dx != 0.0f ? 1.0f / dx : 0.0f;
  std::int32_t sum = 0;
  for (std::int64_t j = 0; j < 32; ++j) {
    float t = j < valid ? x[j] * id : 0.0f;
    t = t >= -127.0f ? (t <= 127.0f ? t : 127.0f) : -127.0f;  // NaN -> -127, no UB
    // Round half to even: exact for |t| < 2^22 (vroundps / nearbyint do the same).
    t = (t + 12582912.0f) - 12582912.0f;
    const int v = static_cast<int>(t);
    q[j] = static_cast<std::int8_t>(v);
    a[j] = static_cast<std::int8_t>(v < 0 ? -v : v);
    sum += v;
  }
  *d = dx;
  *s = sum;
}

void mm_quantize_rows(const float* x, std::int64_t ldx, std::int64_t k, std::int64_t r0,
                      std::int64_t r1, std::int8_t* q, std::int8_t* a, float* d, std::int32_t* s,
                      std::int64_t kp) {
  const std::int64_t blocks = kp / 32;
  for (std::int64_t r = r0; r < r1; ++r)
    for (std::int64_t b = 0; b < blocks; ++b)
      mm_quantize_block(x + r * ldx + b * 32, std::min<std::int64_t>(32, k - b * 32),
                        q + r * kp + b * 32, a + r * kp + b * 32, d + r * blocks + b,
                        s + r * blocks + b);
}

}  // namespace cpu

}  // namespace troupe::kernels
