// AVX-512 VNNI inner loops of the integer formats (int8, int4, Q8_0, Q4_0).
// The same packed layout and the same arithmetic as matmul_int_avx2.cpp:
// per output and 32-block an exact integer dot, then the float epilogue
// lane for lane, so every ISA level gives the same bits. What changes is
// the width and the instruction: one zmm holds a block step of both
// 8-column sub-panels (they sit side by side in the layout), and vpdpbusd
// does the u8 x s8 products and their sum of four in one instruction
// (AVX2: vpmaddubsw + vpmaddwd + vpaddd).
//
//  - s8, s8_m: (x + 128) (u8, made with the activations' codes) times w,
//    less 128 times the block's sum of w (one more vpdpbusd per step,
//    shared by the rows): the exact dot, with one instruction per row;
//  - u4: the nibbles (u8) times x, low nibbles with k and high with k + 16.
//
// Intrinsics only, no library templates (this file is built with AVX-512
// flags).
// GCC 12's avx512fintrin.h builds some results from _mm512_undefined_*()
// and then warns that they may be used uninitialized (a false positive in
// the header, not in this code).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include "kernels/cpu/matmul_impl.hpp"

#ifndef TROUPE_MR_512
#define TROUPE_MR_512 8
#endif

namespace troupe::kernels::cpu {

namespace {

inline __m512i bcast4(const std::int8_t* p) {
  std::int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512i ld(const std::byte* p) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// 16 int8 at p as floats.
inline __m512 i8_ps(const std::byte* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

constexpr bool is_super(mm_scale s) {
  return s == mm_scale::super_f16 || s == mm_scale::super_half;
}

inline void prefetch(const std::byte* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + mm_prefetch_bytes), _MM_HINT_T0);
}

// MR rows x one 16-column panel; PF: prefetch the weight stream ahead.
template <mm_kernel K, mm_scale S, mm_zero Z, int MR, bool PF>
void tile(const mm_layout& l, const std::byte* wp, const mm_int_acts& x, std::int64_t r0,
          float* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i ones8 = _mm512_set1_epi8(1);
  const __m512i zero = _mm512_setzero_si512();
  __m512 facc[MR];
  const std::int8_t* xq[MR];
  const std::uint8_t* xu[MR];
  const float* dx[MR];
  const std::int32_t* sx[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    xq[r] = x.q + (r0 + r) * x.kp;
    xu[r] = x.u + (r0 + r) * x.kp;
    dx[r] = x.d + (r0 + r) * x.blocks;
    sx[r] = x.s + (r0 + r) * x.blocks;
    facc[r] = _mm512_setzero_ps();
  }
  __m512i zc = zero;
  if constexpr (Z == mm_zero::col_i32) zc = ld(wp + 64);
  if constexpr (PF) {
    for (std::int64_t o = 0; o < l.panel_header; o += 64) prefetch(wp + o);
  }
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
    // Two chains of dot products per row (is, is2), added at the end: the
    // integer sums are exact in any order, and a few-row tile (decode)
    // would otherwise wait on one chain of 8 vpdpbusd per block.
    __m512i is[MR], is2[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) is[r] = is2[r] = zero;
    if constexpr (is_nibble(K)) {
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        if constexpr (PF) prefetch(blk + 64 * v);
        const __m512i raw = ld(blk + 64 * v);
        __m512i lo = _mm512_and_si512(raw, m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        // Bits 4 and 5 from the planes: bit i of a word is byte i's.
        auto plane = [&](int p) {
          std::uint64_t ml, mh;
          __builtin_memcpy(&ml, blk + 256 + p * 64 + (2 * v) * 8, 8);
          __builtin_memcpy(&mh, blk + 256 + p * 64 + (2 * v + 1) * 8, 8);
          const __m512i bit = _mm512_set1_epi8(static_cast<char>(0x10 << p));
          lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(ml, bit));
          hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(mh, bit));
        };
        if constexpr (high_planes(K) >= 1) plane(0);
        if constexpr (high_planes(K) >= 2) plane(1);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          is[r] = _mm512_dpbusd_epi32(is[r], lo, bcast4(xq[r] + b * 32 + 4 * v));
          is2[r] = _mm512_dpbusd_epi32(is2[r], hi, bcast4(xq[r] + b * 32 + 16 + 4 * v));
        }
      }
      if constexpr (!is_half_scale(S)) {  // halves: is (k < 16) and is2 stay apart
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) is[r] = _mm512_add_epi32(is[r], is2[r]);
      }
    } else {
      __m512i wsum = zero, wsum2 = zero;  // per column, the block's sum of w (two chains)
      // Quad q's codes (k = 4q .. 4q+3 of both sub-panels) into the sums.
      auto quad = [&](int q, const __m512i w) {
        // Chain 1 or 2: alternate quads, or (half_f32) the block's halves.
        const bool first = is_half_scale(S) ? q < 4 : q % 2 == 0;
        if (first)
          wsum = _mm512_dpbusd_epi32(wsum, ones8, w);
        else
          wsum2 = _mm512_dpbusd_epi32(wsum2, ones8, w);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          std::int32_t v;
          __builtin_memcpy(&v, xu[r] + b * 32 + 4 * q, 4);
          if (first)
            is[r] = _mm512_dpbusd_epi32(is[r], _mm512_set1_epi32(v), w);
          else
            is2[r] = _mm512_dpbusd_epi32(is2[r], _mm512_set1_epi32(v), w);
        }
      };
      if constexpr (K == mm_kernel::i4lut) {
        // Nibble v holds quad v (low) and quad v + 4 (high): the table's
        // values through a byte shuffle (the table in each 128-bit lane).
        const __m512i lut =
            _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(l.lut)));
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          if constexpr (PF) prefetch(blk + 64 * v);
          const __m512i raw = ld(blk + 64 * v);
          quad(v, _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, m4)));
          quad(v + 4, _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4)));
        }
      } else {
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          if constexpr (PF) prefetch(blk + 64 * q);
          quad(q, ld(blk + 64 * q));
        }
      }
      if constexpr (is_half_scale(S)) {
        const __m512i off1 = _mm512_slli_epi32(wsum, 7), off2 = _mm512_slli_epi32(wsum2, 7);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          is[r] = _mm512_sub_epi32(is[r], off1);
          is2[r] = _mm512_sub_epi32(is2[r], off2);
        }
      } else {
        const __m512i off = _mm512_slli_epi32(_mm512_add_epi32(wsum, wsum2), 7);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) is[r] = _mm512_sub_epi32(_mm512_add_epi32(is[r], is2[r]), off);
      }
    }
    // Epilogue: the weight scale (and zero point) of the 16 columns, then
    // per row, as the AVX2 path computes each lane.
    __m512 ws, wh = _mm512_setzero_ps(), off = wh, offh = wh;
    __m512i zg;
    if constexpr (S == mm_scale::block_f16)
      ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr + j * 32)));
    else if constexpr (S == mm_scale::group_f32 || S == mm_scale::half_f32)
      ws = _mm512_loadu_ps(reinterpret_cast<const float*>(hdr));
    else
      ws = _mm512_setzero_ps();
    if constexpr (S == mm_scale::half_f32)
      wh = _mm512_loadu_ps(reinterpret_cast<const float*>(hdr + 64));
    if constexpr (Z == mm_zero::offset_f32 && !is_super(S)) {
      off = _mm512_loadu_ps(
          reinterpret_cast<const float*>(hdr + (S == mm_scale::half_f32 ? 128 : 64)));
      if constexpr (S == mm_scale::half_f32)
        offh = _mm512_loadu_ps(reinterpret_cast<const float*>(hdr + 192));
    }
    if constexpr (is_super(S)) {  // d * sc and -(dmin * m): exact products
      constexpr bool o = Z == mm_zero::offset_f32, h = S == mm_scale::super_half;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr)));
      const std::byte* sc = hdr + super_sc_at(o) + (h ? 2 * j : j) * 16;
      ws = _mm512_mul_ps(d, i8_ps(sc));
      if constexpr (h) wh = _mm512_mul_ps(d, i8_ps(sc + 16));
      if constexpr (o) {
        const __m512i neg = _mm512_set1_epi32(static_cast<int>(0x80000000u));
        const __m512 dm =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr + 32)));
        const std::byte* m = hdr + super_m_at(o, h) + (h ? 2 * j : j) * 16;
        off = _mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dm, i8_ps(m))), neg));
        if constexpr (h)
          offh = _mm512_castsi512_ps(
              _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dm, i8_ps(m + 16))), neg));
      }
    }
    if constexpr (Z == mm_zero::group_u8)
      zg = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + 64)));
    else
      zg = zc;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 dxb = _mm512_set1_ps(dx[r][b]);
      const __m512i sxb = _mm512_set1_epi32(sx[r][b]);
      if constexpr (is_half_scale(S)) {
        if constexpr (Z == mm_zero::center) {  // the unsigned codes' zero point, per half
          std::int32_t lo = 0;
          for (int i = 0; i < 16; ++i) lo += xq[r][b * 32 + i];
          is[r] = _mm512_sub_epi32(is[r], _mm512_set1_epi32(l.center * lo));
          is2[r] = _mm512_sub_epi32(is2[r], _mm512_set1_epi32(l.center * (sx[r][b] - lo)));
        }
        facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(ws, dxb), facc[r]);
        facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is2[r]), _mm512_mul_ps(wh, dxb), facc[r]);
        if constexpr (Z == mm_zero::offset_f32) {
          std::int32_t lo = 0;
          for (int i = 0; i < 16; ++i) lo += xq[r][b * 32 + i];
          const __m512 slo = _mm512_set1_ps(static_cast<float>(lo));
          const __m512 shi = _mm512_set1_ps(static_cast<float>(sx[r][b] - lo));
          facc[r] = _mm512_fmadd_ps(slo, _mm512_mul_ps(off, dxb), facc[r]);
          facc[r] = _mm512_fmadd_ps(shi, _mm512_mul_ps(offh, dxb), facc[r]);
        }
      } else {
        __m512i iv = is[r];
        if constexpr (Z == mm_zero::eight) iv = _mm512_sub_epi32(iv, _mm512_slli_epi32(sxb, 3));
        if constexpr (Z == mm_zero::center)
          iv = _mm512_sub_epi32(iv, _mm512_mullo_epi32(_mm512_set1_epi32(l.center), sxb));
        if constexpr (Z == mm_zero::col_i32 || Z == mm_zero::group_u8)
          iv = _mm512_sub_epi32(iv, _mm512_mullo_epi32(zg, sxb));
        const __m512 sc = S == mm_scale::col_end ? dxb : _mm512_mul_ps(ws, dxb);
        facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), sc, facc[r]);
        if constexpr (Z == mm_zero::offset_f32)
          facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sxb), _mm512_mul_ps(off, dxb), facc[r]);
      }
    }
    ++j;
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    __m512 f = facc[r];
    if constexpr (S == mm_scale::col_end)
      f = _mm512_mul_ps(f, _mm512_loadu_ps(reinterpret_cast<const float*>(wp)));
    _mm512_storeu_ps(out + r * 16, f);
  }
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
  constexpr int MR = TROUPE_MR_512;
  alignas(64) float out[MR * 16];
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

void mm_int_avx512_vnni(const mm_layout& l, const std::byte* w, const mm_int_acts& x,
                        std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0,
                        std::int64_t p1) {
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
      run_panels<K::s8_m, S::super_half, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8_m, S::super_half, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::super_f16) {
    if (l.zero == Z::offset_f32)
      run_panels<K::s8_m, S::super_f16, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8_m, S::super_f16, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::half_f32) {
    if (l.zero == Z::offset_f32)
      run_panels<K::s8_m, S::half_f32, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8_m, S::half_f32, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::group_f32) {
    if (l.zero == Z::offset_f32)
      run_panels<K::s8_m, S::group_f32, Z::offset_f32>(l, w, x, m, y, ldy, p0, p1);
    else
      run_panels<K::s8_m, S::group_f32, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.scale == S::block_f16) {
    // s8 and s8_m run the same loop here ((x + 128) times w, less 128 sum(w)).
    run_panels<K::s8_m, S::block_f16, Z::none>(l, w, x, m, y, ldy, p0, p1);
  } else if (l.zero == Z::col_i32) {
    run_panels<K::s8_m, S::col_end, Z::col_i32>(l, w, x, m, y, ldy, p0, p1);
  } else {
    run_panels<K::s8_m, S::col_end, Z::none>(l, w, x, m, y, ldy, p0, p1);
  }
}

}  // namespace troupe::kernels::cpu
