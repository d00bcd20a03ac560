#pragma once

#include "kernels/quant.hpp"
#include "kernels/tensor.hpp"

namespace troupe::kernels {

/// Error of an approximation against its reference.
struct quant_error {
  double max_abs_err = 0;  ///< max |approx - reference|
  double rms_err = 0;      ///< sqrt(mean((approx - reference)^2))
  double snr_db = 0;       ///< 10 log10(sum reference^2 / sum error^2); +inf when exact
  std::int64_t count = 0;  ///< elements compared
};

/// quantize → dequantize of an f32 matrix [rows, cols] in `format` (group for
/// int4): the values the quantized model will actually see (fake quantization
/// for QAT and error studies). Returns a new f32 [rows, cols] tensor.
result<tensor> fake_quantize(memory_pool& pool, const tensor& src, weight_format format,
                             int group = 32);

/// Compares two f32 tensors of the same shape (any dims, dense), in double.
/// NaN or infinite inputs are an error.
result<quant_error> quant_error_report(const tensor& reference, const tensor& approx);

/// The error of a stored weight matrix against the f32 matrix it was made
/// from (dequantizes one row at a time; no full copy).
result<quant_error> weight_error_report(const weight_matrix& w, const tensor& source);

}  // namespace troupe::kernels
