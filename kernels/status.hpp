#pragma once

#include <cstdint>
#include <expected>
#include <string>
#include <utility>

namespace troupe::kernels {

/// Error codes of the kernels layer.
enum class errc : std::uint8_t {
  invalid_argument = 1,
  shape_mismatch,
  unsupported_dtype,
  unsupported_op,
  out_of_memory,
  device_unavailable,
  corrupt_data,
  io_error,
  not_found,
  internal,
};

const char* to_string(errc code);

/// An error: a code and a message that names what was wrong.
struct error {
  errc code = errc::internal;
  std::string message;
};

template <class T>
using result = std::expected<T, error>;

inline std::unexpected<error> make_error(errc code, std::string message) {
  return std::unexpected<error>(error{code, std::move(message)});
}

}  // namespace troupe::kernels
