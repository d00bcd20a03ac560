#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kernels/half.hpp"
#include "kernels/status.hpp"

namespace troupe::kernels {

/// Element types of tensors. q8_0 and the types after it are GGUF block
/// formats (ggml's byte layouts): 32 elements a block for q8_0, q4_0, q4_1,
/// q5_0, q5_1 and iq4_nl, 256 (a "superblock") for the K-quants and iq4_xs.
/// A tensor of them has its shape in elements and its innermost extent a
/// whole number of blocks.
enum class dtype : std::uint8_t {
  f32,
  f16,
  bf16,
  i8,
  u8,
  i32,
  q8_0,
  q4_0,
  q4_1,
  q5_0,
  q5_1,
  q2_k,
  q3_k,
  q4_k,
  q5_k,
  q6_k,
  iq4_nl,
  iq4_xs,
};
/// The last enumerator (wire checks of a dtype byte).
constexpr dtype last_dtype = dtype::iq4_xs;

/// True for the GGUF block formats (q8_0 .. iq4_xs).
constexpr bool is_block_type(dtype t) {
  return t >= dtype::q8_0;
}

std::string_view to_string(dtype t);
result<dtype> dtype_from_string(std::string_view name);

/// Elements per block (1 for plain types) and bytes per block.
std::int64_t block_elems(dtype t);
std::size_t block_bytes(dtype t);

/// Bytes of `n` consecutive elements; an error when `n` is not a whole
/// number of blocks or the product overflows.
result<std::size_t> row_bytes(dtype t, std::int64_t n);

constexpr int qk = 32;     ///< elements per GGUF Q8_0 / Q4_0 / Q4_1 / Q5_x / IQ4_NL block
constexpr int qk_k = 256;  ///< elements per K-quant / IQ4_XS superblock

/// ggml's block_q8_0: one f16 scale, 32 signed bytes.
struct block_q8_0 {
  f16 d;
  std::int8_t qs[qk];
};
static_assert(sizeof(block_q8_0) == 34);

/// ggml's block_q4_0: one f16 scale, 32 nibbles (element j in the low
/// nibble of byte j, element j+16 in its high nibble), value = (nibble-8)*d.
struct block_q4_0 {
  f16 d;
  std::uint8_t qs[qk / 2];
};
static_assert(sizeof(block_q4_0) == 18);

/// ggml's block_q4_1: value = nibble * d + m (Q4_0's nibble order).
struct block_q4_1 {
  f16 d;
  f16 m;
  std::uint8_t qs[qk / 2];
};
static_assert(sizeof(block_q4_1) == 20);

/// ggml's block_q5_0: 5-bit codes, the low four bits as Q4_0's nibbles, bit
/// 4 of element j in bit j of the little-endian 32-bit qh; value =
/// (code - 16) * d.
struct block_q5_0 {
  f16 d;
  std::uint8_t qh[4];
  std::uint8_t qs[qk / 2];
};
static_assert(sizeof(block_q5_0) == 22);

/// ggml's block_q5_1: Q5_0's codes, value = code * d + m.
struct block_q5_1 {
  f16 d;
  f16 m;
  std::uint8_t qh[4];
  std::uint8_t qs[qk / 2];
};
static_assert(sizeof(block_q5_1) == 24);

/// ggml's block_q2_K: 2-bit codes; 16 sub-blocks of 16, each a 4-bit scale
/// and a 4-bit min: value = d * sc * q - dmin * m.
struct block_q2_k {
  std::uint8_t scales[qk_k / 16];
  std::uint8_t qs[qk_k / 4];
  f16 d;
  f16 dmin;
};
static_assert(sizeof(block_q2_k) == 84);

/// ggml's block_q3_K: 3-bit codes (two low bits in qs, the high bit in
/// hmask, set meaning +0 and clear -4); 16 sub-blocks of 16 with 6-bit
/// scales packed in 12 bytes: value = d * (sc - 32) * q.
struct block_q3_k {
  std::uint8_t hmask[qk_k / 8];
  std::uint8_t qs[qk_k / 4];
  std::uint8_t scales[12];
  f16 d;
};
static_assert(sizeof(block_q3_k) == 110);

/// ggml's block_q4_K: 4-bit codes; 8 sub-blocks of 32 with a 6-bit scale and
/// a 6-bit min each (12 bytes): value = d * sc * q - dmin * m.
struct block_q4_k {
  f16 d;
  f16 dmin;
  std::uint8_t scales[12];
  std::uint8_t qs[qk_k / 2];
};
static_assert(sizeof(block_q4_k) == 144);

/// ggml's block_q5_K: Q4_K with a fifth bit per code in qh.
struct block_q5_k {
  f16 d;
  f16 dmin;
  std::uint8_t scales[12];
  std::uint8_t qh[qk_k / 8];
  std::uint8_t qs[qk_k / 2];
};
static_assert(sizeof(block_q5_k) == 176);

/// ggml's block_q6_K: 6-bit codes (low four bits in ql, two high bits in
/// qh); 16 sub-blocks of 16 with int8 scales: value = d * sc * (q - 32).
struct block_q6_k {
  std::uint8_t ql[qk_k / 2];
  std::uint8_t qh[qk_k / 4];
  std::int8_t scales[qk_k / 16];
  f16 d;
};
static_assert(sizeof(block_q6_k) == 210);

/// ggml's block_iq4_nl: 4-bit indices into a fixed table of 16 int8 values
/// (kvalues_iq4nl), Q4_0's nibble order: value = d * table[nibble].
struct block_iq4_nl {
  f16 d;
  std::uint8_t qs[qk / 2];
};
static_assert(sizeof(block_iq4_nl) == 18);

/// ggml's block_iq4_xs: IQ4_NL's indices in 8 sub-blocks of 32, each with a
/// 6-bit scale (low 4 bits in scales_l, high 2 in scales_h): value =
/// d * (ls - 32) * table[nibble].
struct block_iq4_xs {
  f16 d;
  std::uint16_t scales_h;
  std::uint8_t scales_l[qk_k / 64];
  std::uint8_t qs[qk_k / 2];
};
static_assert(sizeof(block_iq4_xs) == 136);

/// The IQ4_NL / IQ4_XS value table.
inline constexpr std::int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                  1,    13,   25,  38,  53,  69,  89,  113};

}  // namespace troupe::kernels
