#pragma once

// Internal interface between the matmul driver and its scalar / AVX2 inner
// loops. Plain functions and structs only (the AVX2 file must not
// instantiate library templates).

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/matmul_layout.hpp"

namespace troupe::kernels::cpu {

/// Prefetch distance ahead of a thread's weight stream.
constexpr std::int64_t mm_prefetch_bytes = 8192;

/// Activation rows quantized to int8 blocks of 32, as the integer kernels
/// read them. Row r of each array starts at r * kp (codes) or r * blocks.
struct mm_int_acts {
  const std::int8_t* q = nullptr;   ///< codes in [-127, 127]
  const std::int8_t* a = nullptr;   ///< |codes|
  const float* d = nullptr;         ///< per-block scale dx_b
  const std::int32_t* s = nullptr;  ///< per-block sum of codes
  /// codes + 128 (the unsigned operand of VNNI's vpdpbusd); only where the
  /// AVX-512 VNNI kernels run.
  const std::uint8_t* u = nullptr;
  std::int64_t kp = 0;
  std::int64_t blocks = 0;
};

/// Quantizes rows [r0, r1) of x (row stride ldx floats, k valid columns,
/// zero padded to kp) into the arrays behind `out` (same row indexing).
void mm_quantize_rows(const float* x, std::int64_t ldx, std::int64_t k, std::int64_t r0,
                      std::int64_t r1, std::int8_t* q, std::int8_t* a, float* d, std::int32_t* s,
                      std::int64_t kp);

void mm_quantize_rows_avx2(const float* x, std::int64_t ldx, std::int64_t k, std::int64_t r0,
                           std::int64_t r1, std::int8_t* q, std::int8_t* a, float* d,
                           std::int32_t* s, std::int64_t kp);
/// u[i] = q[i] + 128 (the top bit flipped): VNNI's unsigned operand.
void mm_flip_codes_avx2(const std::int8_t* q, std::uint8_t* u, std::int64_t n);
/// One block of 32 codes from `valid` (<= 32) floats; the rest count as 0.
void mm_quantize_block(const float* x, std::int64_t valid, std::int8_t* q, std::int8_t* a, float* d,
                       std::int32_t* s);

/// A float kernel as a type, for the ISA files' templates on it.
template <mm_kernel K>
struct float_kernel_tag {
  static constexpr mm_kernel value = K;
};
/// Calls f(float_kernel_tag<k>{}) for a float kernel k (nothing otherwise).
template <class F>
inline void on_float_kernel(mm_kernel k, F&& f) {
  switch (k) {
    case mm_kernel::f32:
      f(float_kernel_tag<mm_kernel::f32>{});
      break;
    case mm_kernel::f16:
      f(float_kernel_tag<mm_kernel::f16>{});
      break;
    case mm_kernel::bf16:
      f(float_kernel_tag<mm_kernel::bf16>{});
      break;
    default:
      break;
  }
}

/// Float kernels: panels [p0, p1) for m rows; x row r at x + r*ldx, y row r
/// at y + r*ldy (columns p*32 .., clipped to layout.n).
void mm_float_scalar(const mm_layout& l, const std::byte* w, const float* x, std::int64_t ldx,
                     std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1);
void mm_float_avx2(const mm_layout& l, const std::byte* w, const float* x, std::int64_t ldx,
                   std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1);
/// The same on zmm (AVX-512 F): the same bits.
void mm_float_avx512(const mm_layout& l, const std::byte* w, const float* x, std::int64_t ldx,
                     std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1);

/// Integer kernels: panels [p0, p1) for m rows of quantized activations.
void mm_int_scalar(const mm_layout& l, const std::byte* w, const mm_int_acts& x, std::int64_t m,
                   float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1);
void mm_int_avx2(const mm_layout& l, const std::byte* w, const mm_int_acts& x, std::int64_t m,
                 float* y, std::int64_t ldy, std::int64_t p0, std::int64_t p1);
/// The same with AVX-512 VNNI (vpdpbusd on zmm): the same bits.
void mm_int_avx512_vnni(const mm_layout& l, const std::byte* w, const mm_int_acts& x,
                        std::int64_t m, float* y, std::int64_t ldy, std::int64_t p0,
                        std::int64_t p1);

}  // namespace troupe::kernels::cpu
