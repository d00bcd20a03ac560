#include "kernels/quant_tools.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace troupe::kernels {

namespace {

struct error_acc {
  double max_abs = 0, err2 = 0, ref2 = 0;
  std::int64_t n = 0;
  bool finite = true;

  void add(const float* ref, const float* got, std::int64_t count) {
    for (std::int64_t i = 0; i < count; ++i) {
      if (!std::isfinite(ref[i]) || !std::isfinite(got[i])) finite = false;
      const double e = static_cast<double>(got[i]) - ref[i];
      max_abs = std::max(max_abs, std::fabs(e));
      err2 += e * e;
      ref2 += static_cast<double>(ref[i]) * ref[i];
    }
    n += count;
  }

  result<quant_error> finish() const {
    if (!finite) return make_error(errc::invalid_argument, "error report inputs must be finite");
    quant_error q;
    q.count = n;
    q.max_abs_err = max_abs;
    q.rms_err = n > 0 ? std::sqrt(err2 / static_cast<double>(n)) : 0.0;
    if (err2 == 0)
      q.snr_db = std::numeric_limits<double>::infinity();
    else if (ref2 == 0)
      q.snr_db = -std::numeric_limits<double>::infinity();
    else
      q.snr_db = 10.0 * std::log10(ref2 / err2);
    return q;
  }
};

result<void> check_f32(const tensor& t, const char* what) {
  if (t.type() != dtype::f32)
    return make_error(errc::unsupported_dtype,
                      std::string(what) + " must be f32, got " + std::string(to_string(t.type())));
  if (!t.is_contiguous() || (t.numel() > 0 && t.empty_view()))
    return make_error(errc::invalid_argument, std::string(what) + " must be a dense tensor");
  return {};
}

}  // namespace

result<tensor> fake_quantize(memory_pool& pool, const tensor& src, weight_format format,
                             int group) {
  auto w = quantize(pool, src, format, group);
  if (!w) return std::unexpected(w.error());
  return dequantize(pool, *w);
}

result<quant_error> quant_error_report(const tensor& reference, const tensor& approx) {
  if (auto r = check_f32(reference, "error report reference"); !r)
    return std::unexpected(r.error());
  if (auto r = check_f32(approx, "error report approximation"); !r)
    return std::unexpected(r.error());
  if (!(reference.shape() == approx.shape()))
    return make_error(errc::shape_mismatch,
                      "error report shapes differ: " + reference.shape().to_string() + " vs " +
                          approx.shape().to_string());
  error_acc acc;
  acc.add(reference.data_as<float>(), approx.data_as<float>(), reference.numel());
  return acc.finish();
}

result<quant_error> weight_error_report(const weight_matrix& w, const tensor& source) {
  if (auto r = w.validate(); !r) return std::unexpected(r.error());
  if (auto r = expect_tensor(source, dtype::f32, 2, "weight error report source"); !r)
    return std::unexpected(r.error());
  if (source.dim(0) != w.rows || source.dim(1) != w.cols)
    return make_error(errc::shape_mismatch,
                      "weight error report source must be [" + std::to_string(w.rows) + ", " +
                          std::to_string(w.cols) + "], got " + source.shape().to_string());
  std::vector<float> row(static_cast<std::size_t>(w.cols));
  error_acc acc;
  for (std::int64_t r = 0; r < w.rows; ++r) {
    if (auto d = dequantize_row(w, r, row); !d) return std::unexpected(d.error());
    acc.add(source.row_as<float>(r), row.data(), w.cols);
  }
  return acc.finish();
}

}  // namespace troupe::kernels
