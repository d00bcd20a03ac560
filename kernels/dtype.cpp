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
    case dtype::q4_1:
      return "q4_1";
    case dtype::q5_0:
      return "q5_0";
    case dtype::q5_1:
      return "q5_1";
    case dtype::q2_k:
      return "q2_k";
    case dtype::q3_k:
      return "q3_k";
    case dtype::q4_k:
      return "q4_k";
    case dtype::q5_k:
      return "q5_k";
    case dtype::q6_k:
      return "q6_k";
    case dtype::iq4_nl:
      return "iq4_nl";
    case dtype::iq4_xs:
      return "iq4_xs";
  }
  return "unknown";
}

result<dtype> dtype_from_string(std::string_view name) {
  for (int i = 0; i <= static_cast<int>(last_dtype); ++i) {
    const auto t = static_cast<dtype>(i);
    if (to_string(t) == name) return t;
  }
  return make_error(errc::unsupported_dtype, "unknown dtype '" + std::string(name) + "'");
}

std::int64_t block_elems(dtype t) {
  switch (t) {
    case dtype::q8_0:
    case dtype::q4_0:
    case dtype::q4_1:
    case dtype::q5_0:
    case dtype::q5_1:
    case dtype::iq4_nl:
      return qk;
    case dtype::q2_k:
    case dtype::q3_k:
    case dtype::q4_k:
    case dtype::q5_k:
    case dtype::q6_k:
    case dtype::iq4_xs:
      return qk_k;
    default:
      return 1;
  }
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
    case dtype::q4_1:
      return sizeof(block_q4_1);
    case dtype::q5_0:
      return sizeof(block_q5_0);
    case dtype::q5_1:
      return sizeof(block_q5_1);
    case dtype::q2_k:
      return sizeof(block_q2_k);
    case dtype::q3_k:
      return sizeof(block_q3_k);
    case dtype::q4_k:
      return sizeof(block_q4_k);
    case dtype::q5_k:
      return sizeof(block_q5_k);
    case dtype::q6_k:
      return sizeof(block_q6_k);
    case dtype::iq4_nl:
      return sizeof(block_iq4_nl);
    case dtype::iq4_xs:
      return sizeof(block_iq4_xs);
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
