#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kernels/half.hpp"
#include "kernels/status.hpp"

namespace troupe::kernels {

/// Element types of tensors. q8_0 and q4_0 are GGUF block formats (32
/// elements a block, ggml's byte layout); a tensor of them has its shape in
/// elements and its innermost extent a multiple of 32.
enum class dtype : std::uint8_t { f32, f16, bf16, i8, u8, i32, q8_0, q4_0 };

std::string_view to_string(dtype t);
result<dtype> dtype_from_string(std::string_view name);

/// Elements per block (1 for plain types) and bytes per block.
std::int64_t block_elems(dtype t);
std::size_t block_bytes(dtype t);

/// Bytes of `n` consecutive elements; an error when `n` is not a whole
/// number of blocks or the product overflows.
result<std::size_t> row_bytes(dtype t, std::int64_t n);

constexpr int qk = 32;  ///< elements per GGUF Q8_0 / Q4_0 block

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

}  // namespace troupe::kernels
