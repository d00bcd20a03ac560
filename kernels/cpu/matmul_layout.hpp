#pragma once

#include <cstddef>
#include <cstdint>

namespace troupe::kernels::cpu {

/// Which inner loop a packed matrix runs.
enum class mm_kernel : std::uint8_t {
  f32,   ///< float panels of 32 columns, k-major
  f16,   ///< same, binary16 elements
  bf16,  ///< same, bfloat16 elements
  s8,    ///< int8 codes in [-127, 127]: maddubs(|x|, sign(w, x))
  s8_m,  ///< int8 codes that may hold -128: maddubs(|w|, sign(x, w))
  u4,    ///< 4-bit codes 0..15: maddubs(nibble, x)
  u5,    ///< 5-bit codes 0..31: u4's nibbles plus one bit plane (Q5_0, Q5_1, Q5_K)
  u6,    ///< 6-bit codes 0..63: u4's nibbles plus two bit planes (Q6_K)
  /// u4's nibbles as indices into the layout's table of 16 int8 values
  /// (IQ4_NL, IQ4_XS); the values then run the s8 arithmetic.
  i4lut,
};

/// The nibble kernels (u4 and those with bit planes above the nibble).
constexpr bool is_nibble(mm_kernel k) {
  return k == mm_kernel::u4 || k == mm_kernel::u5 || k == mm_kernel::u6;
}
/// Whether a kernel's blocks hold u4's nibble layout (256 bytes, and planes).
constexpr bool stores_nibbles(mm_kernel k) {
  return is_nibble(k) || k == mm_kernel::i4lut;
}
/// Bit planes after a nibble block's 256 bytes (64 bytes each).
constexpr int high_planes(mm_kernel k) {
  return k == mm_kernel::u5 ? 1 : k == mm_kernel::u6 ? 2 : 0;
}

/// Where the per-output float scale of an integer kernel lives.
enum class mm_scale : std::uint8_t {
  none,       ///< float kernels
  col_end,    ///< one f32 per column in the panel header, applied after the k loop
  block_f16,  ///< one f16 per column and 32-block in the superblock header
  group_f32,  ///< one f32 per column and group in the superblock header
  /// Two f32 per column and 32-block (its two halves of 16 elements: all 16
  /// columns' first-half scales, then their second-half ones): Q2_K, Q3_K,
  /// Q6_K. The integer dot is then two sums, one per half.
  half_f32,
  /// The K-quant superblock scales, compact (what the files store, and the
  /// same products): per superblock of 8 blocks, 16 f16 scales d (and with
  /// offset_f32, 16 f16 mins dmin), then int8 sub-scales (and int8 sub-mins)
  /// [block][column]; a block's scale is d * sc (exact in f32: an f16 times
  /// an int of at most 8 bits), its offset -(dmin * m). super_f16: one
  /// sub-scale per block (Q4_K, Q5_K, IQ4_XS); super_half: one per half of
  /// a block, [half][column] (Q2_K, Q3_K, Q6_K).
  super_f16,
  super_half,
};

/// Whether a scale kind keeps two integer sums per block (one per half).
constexpr bool is_half_scale(mm_scale s) {
  return s == mm_scale::half_f32 || s == mm_scale::super_half;
}
/// Byte offsets inside a superblock header of the compact (super_*) kinds.
constexpr std::int64_t super_sc_at(bool offset) {
  return offset ? 64 : 32;
}
constexpr std::int64_t super_m_at(bool offset, bool half) {
  return super_sc_at(offset) + (half ? 256 : 128);
}

/// The integer zero point subtracted as zp * sum(x) per 32-block.
enum class mm_zero : std::uint8_t {
  none,
  eight,     ///< constant 8 (Q4_0, int4_sym)
  col_i32,   ///< one int32 per column in the panel header (int8_asym)
  group_u8,  ///< one u8 per column and group in the superblock header (int4_asym)
  /// A float offset per column and group (group_f32 with 32-element groups:
  /// 16 f32 after the scales) or per half (half_f32: 32 f32 after the
  /// scales), added as
  /// offset * dx * sum(x codes) of the block (or half): Q4_1, Q5_1, Q2_K,
  /// Q4_K, Q5_K (w = scale * code + offset).
  offset_f32,
  /// The layout's `center` (16 for Q5_0, 32 for Q6_K, 4 for Q3_K: the codes
  /// are stored unsigned) times sum(x) of the block, or of each half with
  /// the half scales.
  center,
};

/// The packed layout of a weight matrix [n outputs, k inputs].
///
/// Columns (outputs) are grouped into panels of `panel_cols`; panel p is one
/// contiguous region of `panel_bytes` at offset p * panel_bytes.
///  - float kernels: kp rows of 32 elements (k-major): element (k, c) at
///    (k * 32 + c) * elem_bytes.
///  - integer kernels (panel_cols = 16, two sub-panels of 8 columns): a panel
///    header (`panel_header` bytes), then superblocks of `sb_blocks` 32-blocks,
///    each a header (`sb_header` bytes) followed by its blocks'
///    `block_bytes` of codes. In a block, 32-byte vector (v, s) sits at
///    (v * 2 + s) * 32 and holds, for sub-panel s, column c at bytes
///    c*4 .. c*4+3:
///      s8/s8_m: v = quad 0..7, the codes of k = 4v .. 4v+3;
///      u4:      v = 0..3, low nibbles k = 4v .. 4v+3, high nibbles k+16.
///    u5 and u6 add, after those 256 bytes, one or two 64-byte bit planes
///    (bit 4, then bit 5, of each code): in plane p, 64-bit word (v * 2 + h)
///    covers the 64 bytes of vector v (both sub-panels, at v * 64) for the
///    low nibbles (h = 0, k = 4v ..) or the high ones (h = 1, k = 16 + 4v ..):
///    its bit i is the code's bit 4 + p for byte i.
struct mm_layout {
  mm_kernel kernel = mm_kernel::f32;
  mm_scale scale = mm_scale::none;
  mm_zero zero = mm_zero::none;
  std::int64_t n = 0;           ///< logical output features
  std::int64_t k = 0;           ///< logical input features
  std::int64_t panel_cols = 0;  ///< 32 (float) or 16 (integer)
  std::int64_t panels = 0;
  std::int64_t kp = 0;      ///< k padded (a multiple of 32 for integer kernels)
  std::int64_t blocks = 0;  ///< kp / 32 (integer kernels)
  std::int64_t sb_blocks = 1;
  std::int64_t sb_header = 0;
  std::int64_t block_bytes = 0;
  std::int64_t panel_header = 0;
  std::int64_t panel_bytes = 0;
  std::int64_t elem_bytes = 0;  ///< float kernels: 4 or 2
  std::int32_t center = 0;      ///< mm_zero::center's zero point
  std::int8_t lut[16] = {};     ///< i4lut: the value of each nibble

  bool is_float() const {
    return kernel == mm_kernel::f32 || kernel == mm_kernel::f16 || kernel == mm_kernel::bf16;
  }
  /// Offset inside a panel of the header of the superblock holding block b.
  std::int64_t header_offset(std::int64_t b) const {
    return panel_header + (b / sb_blocks) * (sb_header + sb_blocks * block_bytes);
  }
  /// Offset inside a panel of block b's codes.
  std::int64_t block_offset(std::int64_t b) const {
    return header_offset(b) + sb_header + (b % sb_blocks) * block_bytes;
  }
};

}  // namespace troupe::kernels::cpu
