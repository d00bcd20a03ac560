// Portable matmul inner loops: the reference the AVX2 path must equal bit
// for bit (same operations in the same order, see matmul.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/matmul_impl.hpp"
#include "kernels/half.hpp"

namespace troupe::kernels::cpu {

namespace {

template <class T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

float float_elem(const mm_layout& l, const std::byte* p) {
  switch (l.kernel) {
    case mm_kernel::f16:
      return to_f32(f16{load<std::uint16_t>(p)});
    case mm_kernel::bf16:
      return to_f32(bf16{load<std::uint16_t>(p)});
    default:
      return load<float>(p);
  }
}

// Code of column cc (0..15) at k = j (0..31) of a block.
int int_code(const mm_layout& l, const std::byte* blk, std::int64_t cc, std::int64_t j) {
  const std::int64_t s = cc / 8, c = cc % 8;
  if (stores_nibbles(l.kernel)) {
    const std::int64_t v = (j % 16) / 4;
    const auto byte = load<std::uint8_t>(blk + (v * 2 + s) * 32 + c * 4 + j % 4);
    int code = j < 16 ? (byte & 0x0f) : (byte >> 4);
    if (l.kernel == mm_kernel::i4lut) return l.lut[code];
    for (int p = 0; p < high_planes(l.kernel); ++p) {
      const auto word = load<std::uint64_t>(blk + 256 + p * 64 + (v * 2 + j / 16) * 8);
      code |= static_cast<int>((word >> (s * 32 + c * 4 + j % 4)) & 1) << (4 + p);
    }
    return code;
  }
  return load<std::int8_t>(blk + ((j / 4) * 2 + s) * 32 + c * 4 + j % 4);
}

}  // namespace

void mm_float_scalar(const mm_layout& l, const std::byte* w, const float* x, std::int64_t ldx,
                     std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1) {
  const std::int64_t eb = l.elem_bytes;
  for (std::int64_t p = p0; p < p1; ++p) {
    const std::byte* wp = w + p * l.panel_bytes;
    const std::int64_t ncols = std::min<std::int64_t>(32, l.n - p * 32);
    for (std::int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * ldx;
      for (std::int64_t c = 0; c < ncols; ++c) {
        float acc = 0.0f;
        for (std::int64_t k = 0; k < l.k; ++k)
          acc = std::fma(xr[k], float_elem(l, wp + (k * 32 + c) * eb), acc);
        y[r * ldy + p * 32 + c] = acc;
      }
    }
  }
}

void mm_int_scalar(const mm_layout& l, const std::byte* w, const mm_int_acts& x, std::int64_t m,
                   float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1) {
  for (std::int64_t p = p0; p < p1; ++p) {
    const std::byte* wp = w + p * l.panel_bytes;
    const std::int64_t ncols = std::min<std::int64_t>(16, l.n - p * 16);
    for (std::int64_t r = 0; r < m; ++r) {
      const std::int8_t* xq = x.q + r * x.kp;
      const float* dx = x.d + r * x.blocks;
      const std::int32_t* sx = x.s + r * x.blocks;
      for (std::int64_t cc = 0; cc < ncols; ++cc) {
        float acc = 0.0f;
        for (std::int64_t b = 0; b < l.blocks; ++b) {
          const std::byte* hdr = wp + l.header_offset(b);
          const std::byte* blk = wp + l.block_offset(b);
          std::int32_t ilo = 0, ihi = 0;  // the dot over each half of the block
          for (std::int64_t j = 0; j < 16; ++j) ilo += xq[b * 32 + j] * int_code(l, blk, cc, j);
          for (std::int64_t j = 16; j < 32; ++j) ihi += xq[b * 32 + j] * int_code(l, blk, cc, j);
          // The compact K-quant scales: d * sc and -(dmin * m), exact products.
          float sw[2] = {0, 0}, so[2] = {0, 0};
          const bool super = l.scale == mm_scale::super_f16 || l.scale == mm_scale::super_half;
          const bool half = is_half_scale(l.scale), off = l.zero == mm_zero::offset_f32;
          if (super) {
            const std::int64_t j = b % l.sb_blocks;
            const float d = to_f32(f16{load<std::uint16_t>(hdr + cc * 2)});
            const float dmin = off ? to_f32(f16{load<std::uint16_t>(hdr + 32 + cc * 2)}) : 0.0f;
            for (int h = 0; h < 2; ++h) {
              const std::int64_t sub = half ? 2 * j + h : j;
              sw[h] =
                  d * static_cast<float>(load<std::int8_t>(hdr + super_sc_at(off) + sub * 16 + cc));
              if (off)
                so[h] = -(dmin * static_cast<float>(load<std::int8_t>(hdr + super_m_at(off, half) +
                                                                      sub * 16 + cc)));
            }
          } else if (l.scale == mm_scale::half_f32) {
            sw[0] = load<float>(hdr + cc * 4);
            sw[1] = load<float>(hdr + 64 + cc * 4);
            if (off)
              so[0] = load<float>(hdr + 128 + cc * 4), so[1] = load<float>(hdr + 192 + cc * 4);
          } else if (l.scale == mm_scale::group_f32) {
            sw[0] = load<float>(hdr + cc * 4);
            if (off) so[0] = load<float>(hdr + 64 + cc * 4);
          }
          if (half) {
            const float d = dx[b];
            if (l.zero == mm_zero::center) {  // the unsigned codes' zero point, per half
              std::int32_t slo = 0;
              for (std::int64_t j = 0; j < 16; ++j) slo += xq[b * 32 + j];
              ilo -= l.center * slo;
              ihi -= l.center * (sx[b] - slo);
            }
            acc = std::fma(static_cast<float>(ilo), sw[0] * d, acc);
            acc = std::fma(static_cast<float>(ihi), sw[1] * d, acc);
            if (off) {
              std::int32_t slo = 0;
              for (std::int64_t j = 0; j < 16; ++j) slo += xq[b * 32 + j];
              acc = std::fma(static_cast<float>(slo), so[0] * d, acc);
              acc = std::fma(static_cast<float>(sx[b] - slo), so[1] * d, acc);
            }
            continue;
          }
          std::int32_t isum = ilo + ihi;
          switch (l.zero) {
            case mm_zero::none:
            case mm_zero::offset_f32:
              break;
            case mm_zero::eight:
              isum -= 8 * sx[b];
              break;
            case mm_zero::center:
              isum -= l.center * sx[b];
              break;
            case mm_zero::col_i32:
              isum -= load<std::int32_t>(wp + 64 + cc * 4) * sx[b];
              break;
            case mm_zero::group_u8:
              isum -= load<std::uint8_t>(hdr + 64 + cc) * sx[b];
              break;
          }
          float sc = dx[b];
          if (l.scale == mm_scale::block_f16)
            sc = to_f32(f16{load<std::uint16_t>(hdr + (b % l.sb_blocks) * 32 + cc * 2)}) * dx[b];
          else if (l.scale == mm_scale::group_f32 || super)
            sc = sw[0] * dx[b];
          acc = std::fma(static_cast<float>(isum), sc, acc);
          if (off) acc = std::fma(static_cast<float>(sx[b]), so[0] * dx[b], acc);
        }
        if (l.scale == mm_scale::col_end) acc = acc * load<float>(wp + cc * 4);
        y[r * ldy + p * 16 + cc] = acc;
      }
    }
  }
}

}  // namespace troupe::kernels::cpu
