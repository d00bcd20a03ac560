// AVX2 inner loops of the integer formats (int8, int4, Q8_0, Q4_0). Per
// output and 32-block: an exact integer dot, then the same float epilogue as
// mm_int_scalar (see matmul.hpp), so the two paths agree bit for bit.
//
// A tile is MR activation rows x one 16-column panel (two sub-panels of 8
// columns). Each weight vector is loaded (and unpacked) once per tile and
// reused for all MR rows; with MR = 1 the loop streams the panels in order,
// prefetching mm_prefetch_bytes ahead.
#include <immintrin.h>

#include "kernels/cpu/matmul_impl.hpp"

#ifndef TROUPE_MR_U4
#define TROUPE_MR_U4 4
#endif
#ifndef TROUPE_MR_S8
#define TROUPE_MR_S8 4
#endif

namespace troupe::kernels::cpu {

namespace {

inline __m256i bcast4(const std::int8_t* p) {
  std::int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i ld(const std::byte* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 8 int8 at p as floats.
inline __m256 i8_ps(const std::byte* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

constexpr bool is_super(mm_scale s) {
  return s == mm_scale::super_f16 || s == mm_scale::super_half;
}

// 32 bits at p (one sub-panel's share of a bit-plane word) as 32 bytes of
// `value` where the bit is set, else 0: byte i takes bit i.
inline __m256i plane_bytes(const std::byte* p, __m256i value) {
  std::uint32_t bits;
  __builtin_memcpy(&bits, p, 4);
  const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                       2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128,
                                       1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m256i b =
      _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), sel), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), value);
}

inline void prefetch(const std::byte* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + mm_prefetch_bytes), _MM_HINT_T0);
}

// MR rows x one 16-column panel; PF: prefetch the weight stream ahead (the
// first pass over the panels).
template <mm_kernel K, mm_scale S, mm_zero Z, int MR, bool PF>
void tile(const mm_layout& l, const std::byte* wp, const mm_int_acts& x, std::int64_t r0,
          float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  alignas(32) float facc[MR][16];
  const std::int8_t* xq[MR];
  const std::int8_t* xa[MR];
  const float* dx[MR];
  const std::int32_t* sx[MR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    xq[r] = x.q + (r0 + r) * x.kp;
    xa[r] = x.a + (r0 + r) * x.kp;
    dx[r] = x.d + (r0 + r) * x.blocks;
    sx[r] = x.s + (r0 + r) * x.blocks;
    _mm256_store_ps(facc[r], _mm256_setzero_ps());
    _mm256_store_ps(facc[r] + 8, _mm256_setzero_ps());
  }
  __m256i zc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  if constexpr (Z == mm_zero::col_i32) {
    zc[0] = ld(wp + 64);
    zc[1] = ld(wp + 96);
  }
  if constexpr (PF) {
    for (std::int64_t o = 0; o < l.panel_header; o += 64) prefetch(wp + o);
  }
  // Walk superblocks with running pointers (no divisions in the loop).
  const std::byte* hdr = wp + l.panel_header;
  const std::byte* blk = hdr + l.sb_header;
  if constexpr (PF) prefetch(hdr);
  std::int64_t j = 0;  // block index inside the superblock
  for (std::int64_t b = 0; b < l.blocks; ++b, blk += l.block_bytes) {
    if (j == l.sb_blocks) {
      hdr = blk;
      blk += l.sb_header;
      j = 0;
      if constexpr (PF) prefetch(hdr);
    }
    __m256i is[MR][2];
    __m256i ih[is_half_scale(S) ? MR : 1][2];  // second halves (half_f32, super_half)
    if constexpr (is_nibble(K) && (K != mm_kernel::u4 || is_half_scale(S))) {
      // Codes past 4 bits (their bit planes ORed in), or halves kept apart:
      // each step's pair sums go to 32 bits at once (16-bit sums of 6-bit
      // codes could overflow over the four steps).
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        is[r][0] = is[r][1] = _mm256_setzero_si256();
        if constexpr (is_half_scale(S)) ih[r][0] = ih[r][1] = _mm256_setzero_si256();
      }
      const __m256i b16 = _mm256_set1_epi8(0x10), b32 = _mm256_set1_epi8(0x20);
#pragma GCC unroll 1
      for (int v = 0; v < 4; ++v) {
        if constexpr (PF) prefetch(blk + 64 * v);
        __m256i lo[2], hi[2];
#pragma GCC unroll 2
        for (int s = 0; s < 2; ++s) {
          const __m256i raw = ld(blk + (2 * v + s) * 32);
          lo[s] = _mm256_and_si256(raw, m4);
          hi[s] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
          if constexpr (high_planes(K) >= 1) {
            const std::byte* pl = blk + 256 + (2 * v) * 8 + s * 4;
            lo[s] = _mm256_or_si256(lo[s], plane_bytes(pl, b16));
            hi[s] = _mm256_or_si256(hi[s], plane_bytes(pl + 8, b16));
          }
          if constexpr (high_planes(K) >= 2) {
            const std::byte* pl = blk + 256 + 64 + (2 * v) * 8 + s * 4;
            lo[s] = _mm256_or_si256(lo[s], plane_bytes(pl, b32));
            hi[s] = _mm256_or_si256(hi[s], plane_bytes(pl + 8, b32));
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256i xl = bcast4(xq[r] + b * 32 + 4 * v);
          const __m256i xh = bcast4(xq[r] + b * 32 + 16 + 4 * v);
#pragma GCC unroll 2
          for (int s = 0; s < 2; ++s) {
            const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[s], xl), ones);
            const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[s], xh), ones);
            is[r][s] = _mm256_add_epi32(is[r][s], pl);
            if constexpr (is_half_scale(S))
              ih[r][s] = _mm256_add_epi32(ih[r][s], ph);
            else
              is[r][s] = _mm256_add_epi32(is[r][s], ph);
          }
        }
      }
    } else if constexpr (K == mm_kernel::u4) {
      __m256i s16[MR][2];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
      auto step = [&](int v) {
        if constexpr (PF) prefetch(blk + 64 * v);
        const __m256i raw0 = ld(blk + (2 * v) * 32), raw1 = ld(blk + (2 * v + 1) * 32);
        const __m256i lo0 = _mm256_and_si256(raw0, m4);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), m4);
        const __m256i lo1 = _mm256_and_si256(raw1, m4);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), m4);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256i xl = bcast4(xq[r] + b * 32 + 4 * v);
          const __m256i xh = bcast4(xq[r] + b * 32 + 16 + 4 * v);
          s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                   _mm256_maddubs_epi16(hi0, xh)));
          s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                   _mm256_maddubs_epi16(hi1, xh)));
        }
      };
      if constexpr (MR == 1) {  // short chains: unrolling does not spill
        step(0), step(1), step(2), step(3);
      } else {  // unrolled, GCC reassociates the sums and spills them
#pragma GCC unroll 1
        for (int v = 0; v < 4; ++v) step(v);
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        is[r][0] = _mm256_madd_epi16(s16[r][0], ones);
        is[r][1] = _mm256_madd_epi16(s16[r][1], ones);
      }
    } else {
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        is[r][0] = is[r][1] = _mm256_setzero_si256();
        if constexpr (is_half_scale(S)) ih[r][0] = ih[r][1] = _mm256_setzero_si256();
      }
      // acc: where quad q's sums go (half_f32: quads 4..7, the block's
      // second half, in ih).
      // Quad q's codes of the two sub-panels (w0, w1) into acc.
      auto quad = [&](int q, const __m256i w0, const __m256i w1, auto& acc) {
        if constexpr (K == mm_kernel::s8 || K == mm_kernel::i4lut) {  // no code is -128
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i xs = bcast4(xq[r] + b * 32 + 4 * q);
            const __m256i xab = bcast4(xa[r] + b * 32 + 4 * q);
            const __m256i p0 = _mm256_maddubs_epi16(xab, _mm256_sign_epi8(w0, xs));
            const __m256i p1 = _mm256_maddubs_epi16(xab, _mm256_sign_epi8(w1, xs));
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
          }
        } else {
          const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i xs = bcast4(xq[r] + b * 32 + 4 * q);
            const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xs, w0));
            const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xs, w1));
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
          }
        }
      };
      auto step = [&](int q, auto& acc) {
        if constexpr (PF) prefetch(blk + 64 * q);
        quad(q, ld(blk + (2 * q) * 32), ld(blk + (2 * q + 1) * 32), acc);
      };
      if constexpr (K == mm_kernel::i4lut) {
        // Nibble v holds quad v (low) and quad v + 4 (high): the table's
        // values through a byte shuffle (the table in both 128-bit lanes).
        const __m256i lut =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(l.lut)));
        auto nib = [&](int v, auto& acc_lo, auto& acc_hi) {
          if constexpr (PF) prefetch(blk + 64 * v);
          const __m256i raw0 = ld(blk + (2 * v) * 32), raw1 = ld(blk + (2 * v + 1) * 32);
          quad(v, _mm256_shuffle_epi8(lut, _mm256_and_si256(raw0, m4)),
               _mm256_shuffle_epi8(lut, _mm256_and_si256(raw1, m4)), acc_lo);
          quad(v + 4, _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw0, 4), m4)),
               _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw1, 4), m4)), acc_hi);
        };
        if constexpr (is_half_scale(S)) {
          nib(0, is, ih), nib(1, is, ih), nib(2, is, ih), nib(3, is, ih);
        } else {
          nib(0, is, is), nib(1, is, is), nib(2, is, is), nib(3, is, is);
        }
      } else if constexpr (is_half_scale(S)) {
        step(0, is), step(1, is), step(2, is), step(3, is);
        step(4, ih), step(5, ih), step(6, ih), step(7, ih);
      } else if constexpr (MR == 1) {
        step(0, is), step(1, is), step(2, is), step(3, is);
        step(4, is), step(5, is), step(6, is), step(7, is);
      } else {
#pragma GCC unroll 1
        for (int q = 0; q < 8; ++q) step(q, is);
      }
    }
    // Epilogue: per sub-panel weight scale (and zero point), then per row.
    __m256 ws[2], wh[2], off[2], offh[2];
    __m256i zg[2];
#pragma GCC unroll 2
    for (int s = 0; s < 2; ++s) {
      if constexpr (S == mm_scale::block_f16)
        ws[s] = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + j * 32 + s * 16)));
      else if constexpr (S == mm_scale::group_f32 || S == mm_scale::half_f32)
        ws[s] = _mm256_loadu_ps(reinterpret_cast<const float*>(hdr + s * 32));
      else
        ws[s] = _mm256_setzero_ps();
      if constexpr (S == mm_scale::half_f32)
        wh[s] = _mm256_loadu_ps(reinterpret_cast<const float*>(hdr + 64 + s * 32));
      if constexpr (Z == mm_zero::offset_f32 && !is_super(S)) {
        constexpr int at = S == mm_scale::half_f32 ? 128 : 64;
        off[s] = _mm256_loadu_ps(reinterpret_cast<const float*>(hdr + at + s * 32));
        if constexpr (S == mm_scale::half_f32)
          offh[s] = _mm256_loadu_ps(reinterpret_cast<const float*>(hdr + 192 + s * 32));
      }
      if constexpr (is_super(S)) {  // d * sc and -(dmin * m): exact products
        constexpr bool o = Z == mm_zero::offset_f32, h = S == mm_scale::super_half;
        const __m256 d =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + s * 16)));
        const std::byte* sc = hdr + super_sc_at(o) + (h ? 2 * j : j) * 16 + s * 8;
        ws[s] = _mm256_mul_ps(d, i8_ps(sc));
        if constexpr (h) wh[s] = _mm256_mul_ps(d, i8_ps(sc + 16));
        if constexpr (o) {
          const __m256 neg = _mm256_set1_ps(-0.0f);
          const __m256 dm =
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + 32 + s * 16)));
          const std::byte* m = hdr + super_m_at(o, h) + (h ? 2 * j : j) * 16 + s * 8;
          off[s] = _mm256_xor_ps(_mm256_mul_ps(dm, i8_ps(m)), neg);
          if constexpr (h) offh[s] = _mm256_xor_ps(_mm256_mul_ps(dm, i8_ps(m + 16)), neg);
        }
      }
      if constexpr (Z == mm_zero::group_u8)
        zg[s] = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hdr + 64 + s * 8)));
      else
        zg[s] = zc[s];
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 dxb = _mm256_set1_ps(dx[r][b]);
      const __m256i sxb = _mm256_set1_epi32(sx[r][b]);
      __m256 slo = _mm256_setzero_ps(), shi = slo;
      __m256i clo = _mm256_setzero_si256(), chi = clo;  // center * each half's sum(x)
      if constexpr (is_half_scale(S) && (Z == mm_zero::offset_f32 || Z == mm_zero::center)) {
        std::int32_t lo = 0;
        for (int i = 0; i < 16; ++i) lo += xq[r][b * 32 + i];
        slo = _mm256_set1_ps(static_cast<float>(lo));
        shi = _mm256_set1_ps(static_cast<float>(sx[r][b] - lo));
        clo = _mm256_set1_epi32(l.center * lo);
        chi = _mm256_set1_epi32(l.center * (sx[r][b] - lo));
      }
#pragma GCC unroll 2
      for (int s = 0; s < 2; ++s) {
        __m256 f = _mm256_load_ps(facc[r] + 8 * s);
        if constexpr (is_half_scale(S)) {
          __m256i a = is[r][s], c = ih[r][s];
          if constexpr (Z == mm_zero::center) {
            a = _mm256_sub_epi32(a, clo);
            c = _mm256_sub_epi32(c, chi);
          }
          f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(ws[s], dxb), f);
          f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_mul_ps(wh[s], dxb), f);
          if constexpr (Z == mm_zero::offset_f32) {
            f = _mm256_fmadd_ps(slo, _mm256_mul_ps(off[s], dxb), f);
            f = _mm256_fmadd_ps(shi, _mm256_mul_ps(offh[s], dxb), f);
          }
        } else {
          __m256i iv = is[r][s];
          if constexpr (Z == mm_zero::eight) iv = _mm256_sub_epi32(iv, _mm256_slli_epi32(sxb, 3));
          if constexpr (Z == mm_zero::center)
            iv = _mm256_sub_epi32(iv, _mm256_mullo_epi32(_mm256_set1_epi32(l.center), sxb));
          if constexpr (Z == mm_zero::col_i32 || Z == mm_zero::group_u8)
            iv = _mm256_sub_epi32(iv, _mm256_mullo_epi32(zg[s], sxb));
          const __m256 sc = S == mm_scale::col_end ? dxb : _mm256_mul_ps(ws[s], dxb);
          f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), sc, f);
          if constexpr (Z == mm_zero::offset_f32)
            f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sxb), _mm256_mul_ps(off[s], dxb), f);
        }
        _mm256_store_ps(facc[r] + 8 * s, f);
      }
    }
    ++j;
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int s = 0; s < 2; ++s) {
      __m256 f = _mm256_load_ps(facc[r] + 8 * s);
      if constexpr (S == mm_scale::col_end)
        f = _mm256_mul_ps(f, _mm256_loadu_ps(reinterpret_cast<const float*>(wp + s * 32)));
      _mm256_storeu_ps(out + r * 16 + s * 8, f);
    }
  }
}

// Rows per register tile: as many as fit the 16 ymm registers without spills
// (half_f32 keeps twice the integer sums).
template <mm_kernel K, mm_scale S>
constexpr int tile_rows() {
  return is_half_scale(S) ? 2 : is_nibble(K) ? TROUPE_MR_U4 : TROUPE_MR_S8;
}

// tile<R> for rows == R, R = MR, MR-1, ..., 1.
template <mm_kernel K, mm_scale S, mm_zero Z, int R>
inline void tile_n(std::int64_t rows, const mm_layout& l, const std::byte* wp, const mm_int_acts& x,
                   std::int64_t r0, float* out, bool prefetch) {
  if (rows == R) {
    if (prefetch)
      tile<K, S, Z, R, true>(l, wp, x, r0, out);
    else
      tile<K, S, Z, R, false>(l, wp, x, r0, out);
  } else if constexpr (R > 1) {
    tile_n<K, S, Z, R - 1>(rows, l, wp, x, r0, out, prefetch);
  }
}

// Activation rows per chunk: a chunk's codes stay in L2 while the thread's
// panels stream past it.
constexpr std::int64_t chunk_rows = 64;

template <mm_kernel K, mm_scale S, mm_zero Z>
void run_panels(const mm_layout& l, const std::byte* w, const mm_int_acts& x, std::int64_t m,
                float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1) {
  constexpr int MR = tile_rows<K, S>();
  alignas(32) float out[MR * 16];
  for (std::int64_t c0 = 0; c0 < m; c0 += chunk_rows) {
    const std::int64_t c1 = m - c0 < chunk_rows ? m : c0 + chunk_rows;
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::byte* wp = w + p * l.panel_bytes;
      const std::int64_t col0 = p * 16;
      const std::int64_t ncols = l.n - col0 < 16 ? l.n - col0 : 16;
      for (std::int64_t r0 = c0; r0 < c1; r0 += MR) {
        const std::int64_t rows = c1 - r0 < MR ? c1 - r0 : MR;
        const bool first = r0 == 0;  // prefetch only on the first pass over the weights
        tile_n<K, S, Z, MR>(rows, l, wp, x, r0, out, first);
        for (std::int64_t i = 0; i < rows; ++i)
          for (std::int64_t c = 0; c < ncols; ++c) y[(r0 + i) * ldy + col0 + c] = out[i * 16 + c];
      }
    }
  }
}

}  // namespace

void mm_int_avx2(const mm_layout& l, const std::byte* w, const mm_int_acts& x, std::int64_t m,
                 float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1) {
  using K = mm_kernel;
  using S = mm_scale;
  using Z = mm_zero;
  if (l.kernel == K::i4lut) {
    if (l.scale == S::block_f16)  // IQ4_NL
      run_panels<K::i4lut, S::block_f16, Z::none>(l, w, x, m, y, ldy, p0, p1);
    else  // IQ4_XS
      run_panels<K::i4lut, S::super_f16, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.kernel == K::u6) {
    run_panels<K::u6, S::super_half, Z::center>(l, w, x, m, y, ldy, p0, p1);  // Q6_K
  } else if (l.kernel == K::u5) {
    if (l.scale == S::block_f16)  // Q5_0
      run_panels<K::u5, S::block_f16, Z::center>(l, w, x, m, y, ldy, p0, p1);
    else if (l.scale == S::super_f16)  // Q5_K
      run_panels<K::u5, S::super_f16, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else  // Q5_1
      run_panels<K::u5, S::group_f32, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.kernel == K::u4 && l.scale == S::super_half) {
    if (l.zero == Z::offset_f32)  // Q2_K
      run_panels<K::u4, S::super_half, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else  // Q3_K
      run_panels<K::u4, S::super_half, Z::center>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.kernel == K::u4) {
    if (l.scale == S::block_f16)
      run_panels<K::u4, S::block_f16, Z::eight>(l, w, x, m, y, ldy, p0, p1);
    else if (l.zero == Z::eight)
      run_panels<K::u4, S::group_f32, Z::eight>(l, w, x, m, y, ldy, p0, p1);
    else if (l.scale == S::super_f16)
      run_panels<K::u4, S::super_f16, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else if (l.zero == Z::offset_f32)
      run_panels<K::u4, S::group_f32, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::u4, S::group_f32, Z::group_u8>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::super_half) {
    if (l.zero == Z::offset_f32)
      run_panels<K::s8, S::super_half, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8, S::super_half, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::super_f16) {
    if (l.zero == Z::offset_f32)
      run_panels<K::s8, S::super_f16, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8, S::super_f16, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::half_f32) {
    if (l.zero == Z::offset_f32)
      run_panels<K::s8, S::half_f32, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8, S::half_f32, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::group_f32) {
    if (l.zero == Z::offset_f32)
      run_panels<K::s8, S::group_f32, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8, S::group_f32, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::block_f16) {
    if (l.kernel == K::s8)
      run_panels<K::s8, S::block_f16, Z::none>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8_m, S::block_f16, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.zero == Z::col_i32) {
    run_panels<K::s8_m, S::col_end, Z::col_i32>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.kernel == K::s8) {
    run_panels<K::s8, S::col_end, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else {
    run_panels<K::s8_m, S::col_end, Z::none>(l, w, x, m, y, ldy, p0, p1);
  }
}

}  // namespace troupe::kernels::cpu
