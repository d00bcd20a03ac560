#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "kernels/tensor.hpp"

namespace troupe::kernels {

/// Storage formats of a weight matrix [rows = output features, cols = input
/// features] (the layout of a Hugging Face nn.Linear weight).
enum class weight_format : std::uint8_t {
  f32,
  f16,
  bf16,
  int8_sym,   ///< int8 in [-127, 127], one f32 scale per row: w = s*q
  int8_asym,  ///< uint8, one f32 scale and uint8 zero point per row: w = s*(q - z)
  int4_sym,   ///< 4-bit, one f32 scale per group of `group` columns: w = s*(q - 8)
  int4_asym,  ///< 4-bit, f32 scale + 4-bit zero point per group: w = s*(q - z)
  q8_0,       ///< GGUF Q8_0 blocks (ggml layout)
  q4_0,       ///< GGUF Q4_0 blocks (ggml layout)
  // GGUF's other block formats, read from files as they are (ggml layouts;
  // kernels/dtype.hpp describes each).
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

/// True for the formats quantize() makes: all of them (the GGUF ones with
/// ggml's deterministic reference quantizers, as llama.cpp's quantizer runs
/// them without an importance matrix).
constexpr bool quantizable(weight_format f) {
  return f <= weight_format::iq4_xs;
}
/// weight_format_from_string for a format to convert weights into: a read-
/// only GGUF format is an error that says so.
result<weight_format> quant_target_from_string(std::string_view name);

/// The GGUF block dtype a block format stores its data in (q8_0 .. iq4_xs),
/// or nullopt for the others.
std::optional<dtype> block_dtype(weight_format f);
/// The block format of a GGUF block dtype, or nullopt.
std::optional<weight_format> block_format(dtype t);

std::string_view to_string(weight_format f);
result<weight_format> weight_format_from_string(std::string_view name);
/// Bits of storage per weight, scales included, for a given group size.
double bits_per_weight(weight_format f, int group = 32);
/// Bits per weight of a matrix as the CPU device holds it once prepared
/// (its packed panels: the K-quants' scales widened, Q2_K / Q3_K codes in
/// nibbles, Q4_1 / Q5_1's offsets in f32; docs/models.md has the table),
/// for a row length that is a whole number of 256-blocks (int8 adds a
/// scale, int8_asym a scale and zero point, per row; each panel of 16 or 32
/// rows is aligned to 64 bytes, and rows are padded to whole panels). What
/// placement counts a stage's matrices at.
double held_bits_per_weight(weight_format f, int group = 32);

/// A quantized (or plain) weight matrix in its storage layout, row-major.
///  - f32/f16/bf16: `data` [rows, cols] of that dtype.
///  - int8_sym: `data` i8 [rows, cols], `scales` f32 [rows].
///  - int8_asym: `data` u8 [rows, cols], `scales` f32 [rows], `zeros` u8 [rows].
///  - int4_*: `data` u8 [rows, cols/2]; within each run of 32 columns, column
///    j sits in the low nibble of byte j and column j+16 in its high nibble
///    (Q4_0's order). `scales` f32 [rows, cols/group]; int4_asym adds `zeros`
///    u8 [rows, cols/group] (values 0..15).
///  - q8_0, q4_0 and the other GGUF formats: `data` of the matching dtype
///    [rows, cols] (cols a whole number of its blocks).
struct weight_matrix {
  weight_format format = weight_format::f32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  int group = 0;  ///< int4 group size (32, 64 or 128); 0 otherwise
  tensor data;
  tensor scales;
  tensor zeros;

  /// Bytes of data + scales + zero points.
  std::size_t storage_bytes() const;
  /// Checks that the parts agree with format, rows, cols and group.
  result<void> validate() const;
};

/// Quantizes an f32 matrix [rows, cols] into `format` (group for int4).
/// The GGUF formats reproduce ggml's reference quantizers bit for bit (the
/// bytes llama.cpp's quantizer writes without an importance matrix).
result<weight_matrix> quantize(memory_pool& pool, const tensor& src, weight_format format,
                               int group = 32);

/// Dequantizes back to f32 [rows, cols].
result<tensor> dequantize(memory_pool& pool, const weight_matrix& w);

/// Dequantizes row `r` into `out` (cols floats).
result<void> dequantize_row(const weight_matrix& w, std::int64_t r, std::span<float> out);

// ggml's reference quantizers for one run of k floats (k a multiple of 32).
void quantize_row_q8_0(const float* x, block_q8_0* y, std::int64_t k);
void quantize_row_q4_0(const float* x, block_q4_0* y, std::int64_t k);
void quantize_row_q4_1(const float* x, block_q4_1* y, std::int64_t k);
void quantize_row_q5_0(const float* x, block_q5_0* y, std::int64_t k);
void quantize_row_q5_1(const float* x, block_q5_1* y, std::int64_t k);
// ... and for the K-quants (k a multiple of 256) and IQ4 (IQ4_NL: of 32), as
// llama.cpp quantizes without an importance matrix (kernels/quant_k.cpp).
void quantize_row_q2_k(const float* x, block_q2_k* y, std::int64_t k);
void quantize_row_q3_k(const float* x, block_q3_k* y, std::int64_t k);
void quantize_row_q4_k(const float* x, block_q4_k* y, std::int64_t k);
void quantize_row_q5_k(const float* x, block_q5_k* y, std::int64_t k);
void quantize_row_q6_k(const float* x, block_q6_k* y, std::int64_t k);
void quantize_row_iq4_nl(const float* x, block_iq4_nl* y, std::int64_t k);
void quantize_row_iq4_xs(const float* x, block_iq4_xs* y, std::int64_t k);
void dequantize_row_q8_0(const block_q8_0* x, float* y, std::int64_t k);
void dequantize_row_q4_0(const block_q4_0* x, float* y, std::int64_t k);

/// One run of 32 elements of a GGUF block-format row as integer codes with a
/// scale and an offset per half (16 elements): element j is
/// scale[j / 16] * code[j] (+ offset[j / 16] where has_offset), computed in
/// f32 as a product and then a sum, which is how ggml dequantizes every one
/// of these formats (and so gives its values bit for bit). Codes lie in
/// [-127, 127] (-128 only for Q8_0); Q4_1 and Q4_K codes in [0, 15].
struct block32 {
  std::int8_t code[32];
  float scale[2];
  float offset[2];
  bool has_offset;
};

/// Decodes block `b` (elements 32b .. 32b+31) of a row of `t` (a GGUF block
/// dtype) starting at `row`.
void decode_block32(dtype t, const std::byte* row, std::int64_t b, block32& out);

/// The superblock scale d (and dmin; 0 where the format has none) of
/// superblock `sb` of a row of a K-quant or IQ4_XS; false for the other types.
/// Each 32-block's scale from decode_block32 is d times a small integer, and
/// its offset -(dmin times one).
bool superblock_scales(dtype t, const std::byte* row, std::int64_t sb, float& d, float& dmin);

/// Dequantizes k elements (a whole number of blocks) of a row of any GGUF
/// block dtype, exactly as ggml does.
void dequantize_row_blocks(dtype t, const std::byte* row, float* y, std::int64_t k);

}  // namespace troupe::kernels
