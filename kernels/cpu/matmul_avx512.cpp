// AVX-512 inner loops of the float formats (f32, f16, bf16). The packed
// layout of matmul_avx2.cpp (panels of 32 columns, k-major); one panel row
// is two zmm. Each output is still one FMA chain over k = 0..K-1 from 0, the
// order mm_float_scalar uses with std::fma, so every level gives the same
// bits; what changes is the tile: up to 12 rows by the whole panel (24
// accumulators), against 6 rows by half a panel with ymm.
//
// bf16 weights are widened to f32 (a shift) rather than multiplied with
// vdpbf16ps: that instruction rounds the activations to bf16 and sums pairs,
// which would give other bits than the other levels.
//
// Intrinsics only, no library templates (this file is built with AVX-512
// flags).
// GCC 12's avx512fintrin.h builds some results from _mm512_undefined_*()
// and then warns that they may be used uninitialized (a false positive in
// the header, not in this code).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include "kernels/cpu/matmul_impl.hpp"

namespace troupe::kernels::cpu {

namespace {

template <mm_kernel K>
inline __m512 load16(const std::byte* p) {
  if constexpr (K == mm_kernel::f32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (K == mm_kernel::f16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    const __m512i v =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
}

template <mm_kernel K>
constexpr std::int64_t elem_bytes() {
  return K == mm_kernel::f32 ? 4 : 2;
}

// MR rows x the whole 32-column panel into out (row stride ldo); PF:
// prefetch the weight stream ahead (the few-row tiles of decode, which read
// each weight once).
template <mm_kernel K, int MR, bool PF>
void tile(const std::byte* wp, std::int64_t kp, const float* x, std::int64_t ldx, float* out,
          std::int64_t ldo) {
  constexpr std::int64_t eb = elem_bytes<K>();
  constexpr std::int64_t row_bytes = 32 * eb;
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = _mm512_setzero_ps();
    acc[r][1] = _mm512_setzero_ps();
  }
  for (std::int64_t k = 0; k < kp; ++k) {
    const std::byte* wk = wp + k * row_bytes;
    if constexpr (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + mm_prefetch_bytes), _MM_HINT_T0);
      if constexpr (row_bytes > 64)
        _mm_prefetch(reinterpret_cast<const char*>(wk + mm_prefetch_bytes + 64), _MM_HINT_T0);
    }
    const __m512 w0 = load16<K>(wk), w1 = load16<K>(wk + 16 * eb);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(out + r * ldo, acc[r][0]);
    _mm512_storeu_ps(out + r * ldo + 16, acc[r][1]);
  }
}

template <mm_kernel K>
using tile_fn = void (*)(const std::byte*, std::int64_t, const float*, std::int64_t, float*,
                         std::int64_t);

// The tile for `rows` (1..12) rows; prefetching for the decode sizes.
template <mm_kernel K>
tile_fn<K> tile_for(std::int64_t rows) {
  switch (rows) {
    case 1:
      return tile<K, 1, true>;
    case 2:
      return tile<K, 2, true>;
    case 3:
      return tile<K, 3, true>;
    case 4:
      return tile<K, 4, true>;
    case 5:
      return tile<K, 5, false>;
    case 6:
      return tile<K, 6, false>;
    case 7:
      return tile<K, 7, false>;
    case 8:
      return tile<K, 8, false>;
    case 9:
      return tile<K, 9, false>;
    case 10:
      return tile<K, 10, false>;
    case 11:
      return tile<K, 11, false>;
    default:
      return tile<K, 12, false>;
  }
}

template <mm_kernel K>
void run_panels(const mm_layout& l, const std::byte* w, const float* x, std::int64_t ldx,
                std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1) {
  alignas(64) float part[12 * 32];
  for (std::int64_t p = p0; p < p1; ++p) {
    const std::byte* wp = w + p * l.panel_bytes;
    const std::int64_t col0 = p * 32;
    const std::int64_t ncols = l.n - col0 < 32 ? l.n - col0 : 32;
    for (std::int64_t r = 0; r < m;) {
      // Tiles of 12, the last ones balanced (13 rows: 7 + 6, not 12 + 1).
      const std::int64_t left = m - r;
      const std::int64_t rows = left <= 12 ? left : left < 24 ? (left + 1) / 2 : 12;
      const tile_fn<K> fn = tile_for<K>(rows);
      if (ncols == 32) {
        fn(wp, l.kp, x + r * ldx, ldx, y + r * ldy + col0, ldy);
      } else {
        fn(wp, l.kp, x + r * ldx, ldx, part, 32);
        for (std::int64_t i = 0; i < rows; ++i)
          for (std::int64_t c = 0; c < ncols; ++c) y[(r + i) * ldy + col0 + c] = part[i * 32 + c];
      }
      r += rows;
    }
  }
}

}  // namespace

void mm_float_avx512(const mm_layout& l, const std::byte* w, const float* x, std::int64_t ldx,
                     std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1) {
  on_float_kernel(l.kernel,
                  [&](auto k) { run_panels<decltype(k)::value>(l, w, x, ldx, m, y, ldy, p0, p1); });
}

}  // namespace troupe::kernels::cpu
