#include "kernels/dtype.hpp"

#include <limits>
#include <string>

namespace troupe::kernels {

std::string_view to_string(dtype t) {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
    case dtype::i8:
      return "i8";
    case dtype::u8:
      return "u8";
    case dtype::i32:
      return "i32";
    case dtype::q8_0:
      return "q8_0";
    case dtype::q4_0:
      return "q4_0";
  }
  return "unknown";
}

result<dtype> dtype_from_string(std::string_view name) {
  for (auto t : {dtype::f32, dtype::f16, dtype::bf16, dtype::i8, dtype::u8, dtype::i32, dtype::q8_0,
                 dtype::q4_0})
    if (to_string(t) == name) return t;
  return make_error(errc::unsupported_dtype, "unknown dtype '" + std::string(name) + "'");
}

std::int64_t block_elems(dtype t) {
  return (t == dtype::q8_0 || t == dtype::q4_0) ? qk : 1;
}

std::size_t block_bytes(dtype t) {
  switch (t) {
    case dtype::f32:
      return 4;
    case dtype::f16:
      return 2;
    case dtype::bf16:
      return 2;
    case dtype::i8:
      return 1;
    case dtype::u8:
      return 1;
    case dtype::i32:
      return 4;
    case dtype::q8_0:
      return sizeof(block_q8_0);
    case dtype::q4_0:
      return sizeof(block_q4_0);
  }
  return 0;
}

result<std::size_t> row_bytes(dtype t, std::int64_t n) {
  if (n < 0) return make_error(errc::invalid_argument, "negative element count");
  const std::int64_t be = block_elems(t);
  if (n % be != 0)
    return make_error(errc::shape_mismatch, std::to_string(n) +
                                                " elements is not a whole number of " +
                                                std::string(to_string(t)) + " blocks");
  const auto blocks = static_cast<std::size_t>(n / be);
  if (blocks > std::numeric_limits<std::size_t>::max() / block_bytes(t))
    return make_error(errc::invalid_argument, "size overflow");
  return blocks * block_bytes(t);
}

}  // namespace troupe::kernels
