// Norms, activations, softmax, add and embedding of kernels/ops.hpp: argument
// checks, the scalar reference path and dispatch to the AVX2 row kernels.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cpu/lane_math.hpp"
#include "kernels/cpu/ops_common.hpp"
#include "kernels/cpu/ops_impl.hpp"
#include "kernels/ops.hpp"

// The scalar path computes what the vector path computes, rounding by
// rounding (kernels/cpu/lane_math.hpp): no contraction into FMAs.
#pragma GCC optimize("fp-contract=off")

namespace troupe::kernels {

using cpu::isa;

namespace {

// --- scalar row kernels (the vector kernels' arithmetic, lane by lane) ----

float sigmoid_mul(float x, float k) {
  return cpu::lane::x_sigmoid(x, k);
}

float gelu_scalar(float x, gelu_kind kind) {
  return cpu::lane::gelu(x, static_cast<int>(kind));
}

void rms_norm_row(isa level, const float* x, const float* w, float eps, std::int64_t n, float* y) {
  float ss;
  if (level >= isa::avx512) {
    ss = cpu::sum_squares_avx512(x, n);
  } else if (level >= isa::avx2) {
    ss = cpu::sum_squares_avx2(x, n);
  } else {
    ss = cpu::lane::sum_squares(x, n);
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (level >= isa::avx512) return cpu::scale_mul_avx512(x, w, r, y, n);
  if (level >= isa::avx2) return cpu::scale_mul_avx2(x, w, r, y, n);
  for (std::int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

void layer_norm_row(const float* x, const float* w, const float* b, float eps, std::int64_t n,
                    float* y) {
  double sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += x[i];
  const double mean = sum / static_cast<double>(n);
  double var = 0;
  for (std::int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= static_cast<double>(n);
  const float m = static_cast<float>(mean);
  const float r = static_cast<float>(1.0 / std::sqrt(var + static_cast<double>(eps)));
  for (std::int64_t i = 0; i < n; ++i) y[i] = (x[i] - m) * r * w[i] + b[i];
}

void softmax_row_scalar(const float* x, float* y, std::int64_t n, float scale) {
  cpu::lane::softmax_row(x, y, n, scale);
}

std::int64_t row_grain(std::int64_t cols) {
  return std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(1, cols));
}

// Calls row(i) for every row in [0, rows), split over the context's team in
// contiguous ranges of about 16K elements.
template <class F>
void for_each_row(cpu::context& ctx, std::int64_t rows, std::int64_t cols, const F& row) {
  ctx.pool().parallel_for(rows, row_grain(cols), [&](std::int64_t b, std::int64_t e, int) {
    for (std::int64_t i = b; i < e; ++i) row(i);
  });
}

}  // namespace

result<void> rms_norm(cpu::context& ctx, const tensor& x, const tensor& weight, float eps,
                      const tensor& out) {
  if (auto r = ops_detail::check_rows("rms_norm input", x); !r) return r;
  if (auto r = ops_detail::check_same("rms_norm output", out, x); !r) return r;
  if (auto r = ops_detail::check_vector("rms_norm weight", weight, x.cols()); !r) return r;
  if (!(eps >= 0.0f) || !std::isfinite(eps))
    return make_error(errc::invalid_argument, "rms_norm eps must be finite and >= 0");
  const std::int64_t n = x.cols();
  if (n == 0) return {};
  const isa level = cpu::effective_isa(ctx.level(), isa::avx512);
  const float* w = weight.data_as<float>();
  for_each_row(ctx, x.rows(), n, [&](std::int64_t i) {
    rms_norm_row(level, x.row_as<float>(i), w, eps, n, out.row_as<float>(i));
  });
  return {};
}

result<void> layer_norm(cpu::context& ctx, const tensor& x, const tensor& weight,
                        const tensor& bias, float eps, const tensor& out) {
  if (auto r = ops_detail::check_rows("layer_norm input", x); !r) return r;
  if (auto r = ops_detail::check_same("layer_norm output", out, x); !r) return r;
  if (auto r = ops_detail::check_vector("layer_norm weight", weight, x.cols()); !r) return r;
  if (auto r = ops_detail::check_vector("layer_norm bias", bias, x.cols()); !r) return r;
  if (!(eps >= 0.0f) || !std::isfinite(eps))
    return make_error(errc::invalid_argument, "layer_norm eps must be finite and >= 0");
  const std::int64_t n = x.cols();
  if (n == 0) return {};
  const float* w = weight.data_as<float>();
  const float* bs = bias.data_as<float>();
  for_each_row(ctx, x.rows(), n, [&](std::int64_t i) {
    layer_norm_row(x.row_as<float>(i), w, bs, eps, n, out.row_as<float>(i));
  });
  return {};
}

result<void> silu(cpu::context& ctx, const tensor& x, const tensor& out) {
  if (auto r = ops_detail::check_rows("silu input", x); !r) return r;
  if (auto r = ops_detail::check_same("silu output", out, x); !r) return r;
  const std::int64_t n = x.cols();
  const isa level = cpu::effective_isa(ctx.level(), isa::avx512);
  for_each_row(ctx, x.rows(), n, [&](std::int64_t i) {
    const float* xr = x.row_as<float>(i);
    float* yr = out.row_as<float>(i);
    if (level >= isa::avx512) {
      cpu::silu_row_avx512(xr, yr, n);
    } else if (level >= isa::avx2) {
      cpu::silu_row_avx2(xr, yr, n);
    } else {
      for (std::int64_t j = 0; j < n; ++j) yr[j] = sigmoid_mul(xr[j], 1.0f);
    }
  });
  return {};
}

result<void> gelu(cpu::context& ctx, const tensor& x, gelu_kind kind, const tensor& out) {
  if (auto r = ops_detail::check_rows("gelu input", x); !r) return r;
  if (auto r = ops_detail::check_same("gelu output", out, x); !r) return r;
  if (kind != gelu_kind::tanh && kind != gelu_kind::erf && kind != gelu_kind::quick)
    return make_error(errc::invalid_argument, "unknown gelu kind");
  const std::int64_t n = x.cols();
  const isa level = cpu::effective_isa(ctx.level(), isa::avx512);
  for_each_row(ctx, x.rows(), n, [&](std::int64_t i) {
    const float* xr = x.row_as<float>(i);
    float* yr = out.row_as<float>(i);
    if (level >= isa::avx512) {
      cpu::gelu_row_avx512(xr, yr, n, static_cast<int>(kind));
    } else if (level >= isa::avx2) {
      cpu::gelu_row_avx2(xr, yr, n, static_cast<int>(kind));
    } else {
      for (std::int64_t j = 0; j < n; ++j) yr[j] = gelu_scalar(xr[j], kind);
    }
  });
  return {};
}

namespace {

using gated_row_fn = void (*)(const float*, const float*, float*, std::int64_t);

// out = act(gate) * up, row by row on the ISA level's kernel (`scalar` is
// the portable act(g) * u of one element).
template <class Scalar>
result<void> gated(cpu::context& ctx, const char* name, const tensor& gate, const tensor& up,
                   const tensor& out, gated_row_fn avx512, gated_row_fn avx2, Scalar scalar) {
  const std::string n0 = name;
  if (auto r = ops_detail::check_rows((n0 + " gate").c_str(), gate); !r) return r;
  if (auto r = ops_detail::check_same((n0 + " up").c_str(), up, gate); !r) return r;
  if (auto r = ops_detail::check_same((n0 + " output").c_str(), out, gate); !r) return r;
  const std::int64_t n = gate.cols();
  const isa level = cpu::effective_isa(ctx.level(), isa::avx512);
  for_each_row(ctx, gate.rows(), n, [&](std::int64_t i) {
    const float* g = gate.row_as<float>(i);
    const float* u = up.row_as<float>(i);
    float* y = out.row_as<float>(i);
    if (level >= isa::avx512) {
      avx512(g, u, y, n);
    } else if (level >= isa::avx2) {
      avx2(g, u, y, n);
    } else {
      for (std::int64_t j = 0; j < n; ++j) y[j] = scalar(g[j], u[j]);
    }
  });
  return {};
}

}  // namespace

result<void> swiglu(cpu::context& ctx, const tensor& gate, const tensor& up, const tensor& out) {
  return gated(ctx, "swiglu", gate, up, out, cpu::swiglu_row_avx512, cpu::swiglu_row_avx2,
               [](float g, float u) { return sigmoid_mul(g, 1.0f) * u; });
}

result<void> geglu(cpu::context& ctx, const tensor& gate, const tensor& up, const tensor& out) {
  return gated(ctx, "geglu", gate, up, out, cpu::geglu_row_avx512, cpu::geglu_row_avx2,
               [](float g, float u) { return gelu_scalar(g, gelu_kind::tanh) * u; });
}

result<void> scale(cpu::context& ctx, const tensor& x, float s, const tensor& out) {
  if (auto r = ops_detail::check_rows("scale input", x); !r) return r;
  if (auto r = ops_detail::check_same("scale output", out, x); !r) return r;
  if (!std::isfinite(s)) return make_error(errc::invalid_argument, "scale factor must be finite");
  const std::int64_t n = x.cols();
  // One IEEE multiply per element: the same bits however it is vectorized.
  for_each_row(ctx, x.rows(), n, [&](std::int64_t i) {
    const float* a = x.row_as<float>(i);
    float* y = out.row_as<float>(i);
    for (std::int64_t j = 0; j < n; ++j) y[j] = a[j] * s;
  });
  return {};
}

result<void> softcap(cpu::context& ctx, const tensor& x, float c, const tensor& out) {
  if (auto r = ops_detail::check_rows("softcap input", x); !r) return r;
  if (auto r = ops_detail::check_same("softcap output", out, x); !r) return r;
  if (!std::isfinite(c) || c <= 0.0f)
    return make_error(errc::invalid_argument, "softcap must be finite and > 0");
  const std::int64_t n = x.cols();
  for_each_row(ctx, x.rows(), n, [&](std::int64_t i) {
    const float* a = x.row_as<float>(i);
    float* y = out.row_as<float>(i);
    for (std::int64_t j = 0; j < n; ++j) y[j] = c * std::tanh(a[j] / c);
  });
  return {};
}

result<void> softmax(cpu::context& ctx, const tensor& x, const tensor& out, float scale) {
  if (auto r = ops_detail::check_rows("softmax input", x); !r) return r;
  if (auto r = ops_detail::check_same("softmax output", out, x); !r) return r;
  if (!std::isfinite(scale) || scale <= 0.0f)
    return make_error(errc::invalid_argument, "softmax scale must be finite and > 0");
  const std::int64_t n = x.cols();
  if (n == 0) return {};
  const isa level = cpu::effective_isa(ctx.level(), isa::avx2);
  for_each_row(ctx, x.rows(), n, [&](std::int64_t i) {
    if (level >= isa::avx2)
      cpu::softmax_row_avx2(x.row_as<float>(i), out.row_as<float>(i), n, scale);
    else
      softmax_row_scalar(x.row_as<float>(i), out.row_as<float>(i), n, scale);
  });
  return {};
}

result<void> add(cpu::context& ctx, const tensor& a, const tensor& b, const tensor& out) {
  if (auto r = ops_detail::check_rows("add lhs", a); !r) return r;
  if (auto r = ops_detail::check_same("add output", out, a); !r) return r;
  const std::int64_t n = a.cols();
  // b: a's shape, or one row added to every row (a bias).
  const bool row = b.type() == dtype::f32 && b.is_contiguous() && b.numel() == n &&
                   (b.ndim() == 1 || (b.ndim() == 2 && b.dim(0) == 1));
  if (!row)
    if (auto r = ops_detail::check_same("add rhs", b, a); !r) return r;
  const float* bias = row ? b.data_as<float>() : nullptr;
  const isa level = cpu::effective_isa(ctx.level(), isa::avx512);
  for_each_row(ctx, a.rows(), n, [&](std::int64_t i) {
    const float* x = a.row_as<float>(i);
    const float* y = row ? bias : b.row_as<float>(i);
    float* z = out.row_as<float>(i);
    if (level >= isa::avx512) {
      cpu::add_row_avx512(x, y, z, n);
    } else if (level >= isa::avx2) {
      cpu::add_row_avx2(x, y, z, n);
    } else {
      for (std::int64_t j = 0; j < n; ++j) z[j] = x[j] + y[j];
    }
  });
  return {};
}

result<void> embedding(cpu::context& ctx, const weight_matrix& table, const tensor& ids,
                       const tensor& out) {
  if (auto r = table.validate(); !r)
    return make_error(r.error().code, "embedding table: " + r.error().message);
  if (ids.type() != dtype::i32)
    return make_error(errc::unsupported_dtype,
                      "embedding ids must be i32, got " + std::string(to_string(ids.type())));
  if (ids.ndim() < 1 || (!ids.is_contiguous()) || (ids.empty_view() && ids.numel() != 0))
    return make_error(errc::invalid_argument, "embedding ids must be a dense tensor");
  const std::int64_t n = ids.numel();
  if (auto r = expect_tensor(out, dtype::f32, 2, "embedding output"); !r) return r;
  if (out.dim(0) != n || out.dim(1) != table.cols)
    return make_error(errc::shape_mismatch, "embedding output must be [" + std::to_string(n) +
                                                ", " + std::to_string(table.cols) + "], got " +
                                                out.shape().to_string());
  const auto* id = ids.data_as<std::int32_t>();
  for (std::int64_t i = 0; i < n; ++i)
    if (id[i] < 0 || id[i] >= table.rows)
      return make_error(errc::invalid_argument, "embedding id " + std::to_string(id[i]) + " at " +
                                                    std::to_string(i) + " outside [0, " +
                                                    std::to_string(table.rows) + ")");
  const auto cols = static_cast<std::size_t>(table.cols);
  ctx.pool().parallel_for(n, 1, [&](std::int64_t b, std::int64_t e, int) {
    for (std::int64_t i = b; i < e; ++i)
      // Cannot fail: the table and id were checked above.
      (void)dequantize_row(table, id[i], {out.row_as<float>(i), cols});
  });
  return {};
}

}  // namespace troupe::kernels
