#include "kernels/cpu/ops_common.hpp"

#include <string>

namespace troupe::kernels::ops_detail {

result<void> check_rows(const char* what, const tensor& t) {
  if (t.type() != dtype::f32)
    return make_error(errc::unsupported_dtype,
                      std::string(what) + " must be f32, got " + std::string(to_string(t.type())));
  if (t.ndim() < 1 || t.ndim() > max_dims)
    return make_error(errc::shape_mismatch,
                      std::string(what) + " must have 1 to 4 dims, got " + t.shape().to_string());
  if (t.numel() != 0 && t.empty_view())
    return make_error(errc::invalid_argument, std::string(what) + " has no memory");
  if (!t.is_contiguous())
    return make_error(errc::invalid_argument, std::string(what) + " must be contiguous");
  return {};
}

result<void> check_same(const char* what, const tensor& t, const tensor& like) {
  if (auto r = check_rows(what, t); !r) return r;
  if (!(t.shape() == like.shape()))
    return make_error(errc::shape_mismatch, std::string(what) + " must be " +
                                                like.shape().to_string() + ", got " +
                                                t.shape().to_string());
  return {};
}

result<void> check_vector(const char* what, const tensor& t, std::int64_t n) {
  if (auto r = check_rows(what, t); !r) return r;
  if (t.ndim() != 1 || t.dim(0) != n)
    return make_error(errc::shape_mismatch, std::string(what) + " must be [" + std::to_string(n) +
                                                "], got " + t.shape().to_string());
  return {};
}

}  // namespace troupe::kernels::ops_detail
