#include "kernels/status.hpp"

namespace troupe::kernels {

const char* to_string(errc code) {
  switch (code) {
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::shape_mismatch:
      return "shape_mismatch";
    case errc::unsupported_dtype:
      return "unsupported_dtype";
    case errc::unsupported_op:
      return "unsupported_op";
    case errc::out_of_memory:
      return "out_of_memory";
    case errc::device_unavailable:
      return "device_unavailable";
    case errc::corrupt_data:
      return "corrupt_data";
    case errc::io_error:
      return "io_error";
    case errc::not_found:
      return "not_found";
    case errc::internal:
      return "internal";
  }
  return "unknown";
}

}  // namespace troupe::kernels
