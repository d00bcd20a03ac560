#pragma once
// Argument checks shared by the ops of kernels/ops.hpp.

#include <cstdint>

#include "kernels/tensor.hpp"

namespace troupe::kernels::ops_detail {

// f32, 1..4 dims, dense, with memory when non-empty.
result<void> check_rows(const char* what, const tensor& t);
// As check_rows, and the same shape as `like`.
result<void> check_same(const char* what, const tensor& t, const tensor& like);
// f32 [n], dense.
result<void> check_vector(const char* what, const tensor& t, std::int64_t n);

}  // namespace troupe::kernels::ops_detail
