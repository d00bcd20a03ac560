#include "kernels/cpu/onednn_matmul.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <dnnl.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/half.hpp"

namespace troupe::kernels::cpu {

std::string_view to_string(onednn_kind kind) {
  switch (kind) {
    case onednn_kind::f32:
      return "f32";
    case onednn_kind::bf16:
      return "bf16";
    case onednn_kind::u8s8:
      return "u8s8";
  }
  return "unknown";
}

struct onednn_matmul::impl {
  onednn_kind kind = onednn_kind::f32;
  std::int64_t m = 0, n = 0, k = 0;
  dnnl::engine engine;
  dnnl::stream stream;
  dnnl::matmul prim;
  dnnl::memory src, weights, dst_scales;
  std::vector<float> col_scales;        // u8s8: per-output-channel weight scales
  float x_scale = 1.0f;                 // u8s8: per-tensor activation scale of the prepared input
  std::vector<std::uint8_t> src_bytes;  // src buffer (f32, bf16 or u8)
};

onednn_matmul::onednn_matmul(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
onednn_matmul::onednn_matmul(onednn_matmul&&) noexcept = default;
onednn_matmul& onednn_matmul::operator=(onednn_matmul&&) noexcept = default;
onednn_matmul::~onednn_matmul() = default;

std::int64_t onednn_matmul::m() const {
  return impl_->m;
}
std::int64_t onednn_matmul::rows() const {
  return impl_->n;
}
std::int64_t onednn_matmul::cols() const {
  return impl_->k;
}
onednn_kind onednn_matmul::kind() const {
  return impl_->kind;
}

result<onednn_matmul> onednn_matmul::create(context& ctx, const weight_matrix& w, std::int64_t m,
                                            onednn_kind kind) {
  if (auto r = w.validate(); !r) return std::unexpected(r.error());
  if (m < 1) return make_error(errc::invalid_argument, "onednn_matmul needs m >= 1");
  auto p = std::make_unique<impl>();
  p->kind = kind;
  p->m = m;
  p->n = w.rows;
  p->k = w.cols;
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  try {
    ctx.prepare_onednn_thread();
    p->engine = dnnl::engine(dnnl::engine::kind::cpu, 0);
    p->stream = dnnl::stream(p->engine);
    const dnnl::memory::dims src_dims{m, p->k}, wei_dims{p->k, p->n}, dst_dims{m, p->n};
    const dt src_dt = kind == onednn_kind::f32    ? dt::f32
                      : kind == onednn_kind::bf16 ? dt::bf16
                                                  : dt::u8;
    const dt wei_dt = kind == onednn_kind::f32    ? dt::f32
                      : kind == onednn_kind::bf16 ? dt::bf16
                                                  : dt::s8;
    dnnl::memory::desc src_md(src_dims, src_dt, tag::ab);
    dnnl::memory::desc wei_md(wei_dims, wei_dt, tag::any);
    dnnl::memory::desc dst_md(dst_dims, dt::f32, tag::ab);
    dnnl::primitive_attr attr;
    if (kind == onednn_kind::u8s8) {
      attr.set_output_scales(1 << 1, {DNNL_RUNTIME_F32_VAL});
      attr.set_zero_points(DNNL_ARG_SRC, 0, {64});
    }
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), attr, p->engine);
    p->prim = dnnl::matmul(pd);

    // Weights: the user matrix [N, K] row-major is the [K, N] matrix in tag ba.
    p->weights = dnnl::memory(pd.weights_desc(), p->engine);
    if (kind == onednn_kind::u8s8) {
      weight_matrix q8;
      const weight_matrix* src = &w;
      if (w.format != weight_format::int8_sym) {
        auto f = dequantize(ctx.memory(), w);
        if (!f) return std::unexpected(f.error());
        auto q = quantize(ctx.memory(), *f, weight_format::int8_sym);
        if (!q) return std::unexpected(q.error());
        q8 = std::move(*q);
        src = &q8;
      }
      dnnl::memory user({wei_dims, dt::s8, tag::ba}, p->engine, src->data.data());
      dnnl::reorder(user, p->weights).execute(p->stream, user, p->weights);
      p->col_scales.assign(src->scales.data_as<float>(), src->scales.data_as<float>() + p->n);
      p->dst_scales = dnnl::memory({{p->n}, dt::f32, tag::a}, p->engine);
    } else {
      tensor f32w;
      if (w.format == weight_format::f32) {
        f32w = w.data;
      } else {
        auto f = dequantize(ctx.memory(), w);
        if (!f) return std::unexpected(f.error());
        f32w = std::move(*f);
      }
      dnnl::memory user({wei_dims, dt::f32, tag::ba}, p->engine, f32w.data());
      dnnl::reorder(user, p->weights).execute(p->stream, user, p->weights);
    }
    p->stream.wait();
    const std::size_t elem = kind == onednn_kind::f32 ? 4 : kind == onednn_kind::bf16 ? 2 : 1;
    p->src_bytes.assign(static_cast<std::size_t>(m * p->k) * elem, 0);
    p->src = dnnl::memory(src_md, p->engine, p->src_bytes.data());
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_unimplemented)
      return make_error(errc::unsupported_op, "oneDNN has no " + std::string(to_string(kind)) +
                                                  " matmul for this CPU (" + e.what() + ")");
    return make_error(errc::internal, std::string("oneDNN matmul setup failed: ") + e.what());
  }
  return onednn_matmul(std::move(p));
}

result<void> onednn_matmul::prepare_input(context&, const tensor& x) {
  impl& p = *impl_;
  if (auto r = expect_tensor(x, dtype::f32, 2, "onednn_matmul input x"); !r) return r;
  if (x.dim(0) != p.m || x.dim(1) != p.k || x.empty_view())
    return make_error(errc::shape_mismatch, "onednn_matmul: x must be [" + std::to_string(p.m) +
                                                ", " + std::to_string(p.k) + "], got " +
                                                x.shape().to_string());
  const float* xs = x.data_as<float>();
  const std::int64_t count = p.m * p.k;
  switch (p.kind) {
    case onednn_kind::f32:
      std::memcpy(p.src_bytes.data(), xs, static_cast<std::size_t>(count) * 4);
      break;
    case onednn_kind::bf16: {
      auto* d = reinterpret_cast<std::uint16_t*>(p.src_bytes.data());
      for (std::int64_t i = 0; i < count; ++i) d[i] = to_bf16(xs[i]).bits;
      break;
    }
    case onednn_kind::u8s8: {
      float amax = 0.0f;
      for (std::int64_t i = 0; i < count; ++i) amax = std::max(amax, std::fabs(xs[i]));
      // 7-bit codes (zero point 64): without VNNI oneDNN multiplies with
      // vpmaddubsw, whose int16 pair sums saturate for u8 > 128 * s8.
      p.x_scale = amax / 63.0f;
      const float id = p.x_scale != 0.0f ? 1.0f / p.x_scale : 0.0f;
      for (std::int64_t i = 0; i < count; ++i) {
        float t = xs[i] * id;
        t = t >= -63.0f ? (t <= 63.0f ? t : 63.0f) : -63.0f;
        p.src_bytes[static_cast<std::size_t>(i)] =
            static_cast<std::uint8_t>(static_cast<int>(std::nearbyint(t)) + 64);
      }
      break;
    }
  }
  return {};
}

result<void> onednn_matmul::execute(context& ctx, tensor& y) {
  impl& p = *impl_;
  if (auto r = expect_tensor(y, dtype::f32, 2, "onednn_matmul output y"); !r) return r;
  if (y.dim(0) != p.m || y.dim(1) != p.n || y.empty_view())
    return make_error(errc::shape_mismatch, "onednn_matmul: y must be [" + std::to_string(p.m) +
                                                ", " + std::to_string(p.n) + "], got " +
                                                y.shape().to_string());
  try {
    ctx.prepare_onednn_thread();
    dnnl::memory dst({{p.m, p.n}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::ab},
                     p.engine, y.data());
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, p.src}, {DNNL_ARG_WEIGHTS, p.weights}, {DNNL_ARG_DST, dst}};
    if (p.kind == onednn_kind::u8s8) {
      auto* s = static_cast<float*>(p.dst_scales.get_data_handle());
      for (std::int64_t i = 0; i < p.n; ++i)
        s[i] = p.x_scale * p.col_scales[static_cast<std::size_t>(i)];
      args.emplace(DNNL_ARG_ATTR_OUTPUT_SCALES, p.dst_scales);
    }
    p.prim.execute(p.stream, args);
    p.stream.wait();
  } catch (const dnnl::error& e) {
    return make_error(errc::internal, std::string("oneDNN matmul failed: ") + e.what());
  }
  return {};
}

result<void> onednn_matmul::run(context& ctx, const tensor& x, tensor& y) {
  if (auto r = prepare_input(ctx, x); !r) return r;
  return execute(ctx, y);
}

}  // namespace troupe::kernels::cpu
