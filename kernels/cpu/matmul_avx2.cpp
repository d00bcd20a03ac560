// AVX2 + FMA + F16C inner loops of the float formats (f32, f16, bf16).
// Each output is one FMA chain over k = 0..K-1 starting from 0, exactly as
// mm_float_scalar computes it with std::fma.
#include <immintrin.h>

#include "kernels/cpu/matmul_impl.hpp"

namespace troupe::kernels::cpu {

namespace {

template <mm_kernel K>
inline __m256 load8(const std::byte* p) {
  if constexpr (K == mm_kernel::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (K == mm_kernel::f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
}

template <mm_kernel K>
constexpr std::int64_t elem_bytes() {
  return K == mm_kernel::f32 ? 4 : 2;
}

// MR rows x the whole 32-column panel; out is MR x 32 (row stride 32).
template <mm_kernel K, int MR>
void tile_full(const std::byte* wp, std::int64_t kp, const float* x, std::int64_t ldx, float* out,
               bool prefetch) {
  constexpr std::int64_t eb = elem_bytes<K>();
  constexpr std::int64_t row_bytes = 32 * eb;
  __m256 acc[MR][4];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < kp; ++k) {
    const std::byte* wk = wp + k * row_bytes;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + mm_prefetch_bytes), _MM_HINT_T0);
      if constexpr (row_bytes > 64)
        _mm_prefetch(reinterpret_cast<const char*>(wk + mm_prefetch_bytes + 64), _MM_HINT_T0);
    }
    const __m256 w0 = load8<K>(wk), w1 = load8<K>(wk + 8 * eb), w2 = load8<K>(wk + 16 * eb),
                 w3 = load8<K>(wk + 24 * eb);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + r * 32 + i * 8, acc[r][i]);
}

// 6 rows x 16 columns (half a panel starting at wp); out row stride 32.
template <mm_kernel K>
void tile_6x16(const std::byte* wp, std::int64_t kp, const float* x, std::int64_t ldx, float* out) {
  constexpr std::int64_t eb = elem_bytes<K>();
  constexpr std::int64_t row_bytes = 32 * eb;
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float* x0 = x;
  const float* x1 = x + ldx;
  const float* x2 = x + 2 * ldx;
  const float* x3 = x + 3 * ldx;
  const float* x4 = x + 4 * ldx;
  const float* x5 = x + 5 * ldx;
  for (std::int64_t k = 0; k < kp; ++k) {
    const std::byte* wk = wp + k * row_bytes;
    const __m256 w0 = load8<K>(wk), w1 = load8<K>(wk + 8 * eb);
    __m256 xb = _mm256_broadcast_ss(x0 + k);
    a00 = _mm256_fmadd_ps(xb, w0, a00);
    a01 = _mm256_fmadd_ps(xb, w1, a01);
    xb = _mm256_broadcast_ss(x1 + k);
    a10 = _mm256_fmadd_ps(xb, w0, a10);
    a11 = _mm256_fmadd_ps(xb, w1, a11);
    xb = _mm256_broadcast_ss(x2 + k);
    a20 = _mm256_fmadd_ps(xb, w0, a20);
    a21 = _mm256_fmadd_ps(xb, w1, a21);
    xb = _mm256_broadcast_ss(x3 + k);
    a30 = _mm256_fmadd_ps(xb, w0, a30);
    a31 = _mm256_fmadd_ps(xb, w1, a31);
    xb = _mm256_broadcast_ss(x4 + k);
    a40 = _mm256_fmadd_ps(xb, w0, a40);
    a41 = _mm256_fmadd_ps(xb, w1, a41);
    xb = _mm256_broadcast_ss(x5 + k);
    a50 = _mm256_fmadd_ps(xb, w0, a50);
    a51 = _mm256_fmadd_ps(xb, w1, a51);
  }
  _mm256_storeu_ps(out + 0 * 32, a00);
  _mm256_storeu_ps(out + 0 * 32 + 8, a01);
  _mm256_storeu_ps(out + 1 * 32, a10);
  _mm256_storeu_ps(out + 1 * 32 + 8, a11);
  _mm256_storeu_ps(out + 2 * 32, a20);
  _mm256_storeu_ps(out + 2 * 32 + 8, a21);
  _mm256_storeu_ps(out + 3 * 32, a30);
  _mm256_storeu_ps(out + 3 * 32 + 8, a31);
  _mm256_storeu_ps(out + 4 * 32, a40);
  _mm256_storeu_ps(out + 4 * 32 + 8, a41);
  _mm256_storeu_ps(out + 5 * 32, a50);
  _mm256_storeu_ps(out + 5 * 32 + 8, a51);
}

template <mm_kernel K>
void run_panels(const mm_layout& l, const std::byte* w, const float* x, std::int64_t ldx,
                std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1) {
  alignas(64) float tile[6 * 32];
  constexpr std::int64_t eb = elem_bytes<K>();
  for (std::int64_t p = p0; p < p1; ++p) {
    const std::byte* wp = w + p * l.panel_bytes;
    const std::int64_t col0 = p * 32;
    const std::int64_t ncols = l.n - col0 < 32 ? l.n - col0 : 32;
    std::int64_t r = 0;
    while (r < m) {
      const std::int64_t left = m - r;
      std::int64_t rows;
      if (left >= 6) {
        tile_6x16<K>(wp, l.kp, x + r * ldx, ldx, tile);
        tile_6x16<K>(wp + 16 * eb, l.kp, x + r * ldx, ldx, tile + 16);
        rows = 6;
      } else {
        const bool pf = r == 0;
        rows = left >= 3 ? 3 : left;
        if (rows == 3)
          tile_full<K, 3>(wp, l.kp, x + r * ldx, ldx, tile, pf);
        else if (rows == 2)
          tile_full<K, 2>(wp, l.kp, x + r * ldx, ldx, tile, pf);
        else
          tile_full<K, 1>(wp, l.kp, x + r * ldx, ldx, tile, pf);
      }
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t c = 0; c < ncols; ++c) y[(r + i) * ldy + col0 + c] = tile[i * 32 + c];
      r += rows;
    }
  }
}

}  // namespace

void mm_float_avx2(const mm_layout& l, const std::byte* w, const float* x, std::int64_t ldx,
                   std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1) {
  on_float_kernel(l.kernel,
                  [&](auto k) { run_panels<decltype(k)::value>(l, w, x, ldx, m, y, ldy, p0, p1); });
}

}  // namespace troupe::kernels::cpu
