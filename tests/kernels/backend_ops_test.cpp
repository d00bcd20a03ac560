// The conformance test of the compute seam (issue 23), after ggml's
// test-backend-ops: every op and weight format, on every device the registry
// finds (the CPU always; CUDA where a GPU is), against a double-precision
// reference written here from the op's documented definition. The error is
// the normalized mean squared error sum((got - ref)^2) / sum(ref^2): at most
// 1e-7 for float work, at most 5e-4 for matmuls on integer weight formats
// (their activations are quantized to int8 on the way in). A device that
// does not run a case says so through `supports`; the table printed at the
// end lists every such case per device, so a missing kernel is visible and
// never a silent wrong answer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/device.hpp"
#include "kernels/half.hpp"
#include "kernels/kv_layout.hpp"
#include "kernels/quant.hpp"
#include "tests/kernels/gguf_blocks.hpp"
#include "tests/kernels/kv_reference.hpp"
#include "tests/remote_memory_device.hpp"

using namespace troupe::kernels;

using troupe::test::as_stored;
using troupe::test::randn;

namespace {

constexpr double float_limit = 1e-7;
constexpr double quant_limit = 5e-4;

// --- data to and from a device ---------------------------------------------

template <class T>
tensor upload_as(device& dev, dtype t, const std::vector<T>& v, shape_t s) {
  auto x = tensor::empty(dev.memory(), t, s);
  EXPECT_TRUE(x.has_value()) << x.error().message;
  if (!x) return {};
  auto w = dev.write(*x, std::as_bytes(std::span<const T>(v)));
  EXPECT_TRUE(w.has_value()) << w.error().message;
  return *x;
}

tensor upload(device& dev, const std::vector<float>& v, shape_t s) {
  return upload_as(dev, dtype::f32, v, s);
}

// An output tensor, filled with NaN so that an element a kernel does not
// write fails the comparison.
tensor output(device& dev, shape_t s) {
  return upload(dev, std::vector<float>(static_cast<std::size_t>(s.numel()), NAN), s);
}

std::vector<float> download(device& dev, const tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  auto r = dev.read(t, std::as_writable_bytes(std::span<float>(v)));
  EXPECT_TRUE(r.has_value()) << r.error().message;
  return v;
}

// A host tensor (weights, norm parameters: what `prepare` and the ops take
// from host memory).
struct host_tensor {
  std::vector<float> v;
  tensor t;
  host_tensor(std::vector<float> values, shape_t s) : v(std::move(values)) {
    t = *tensor::view(v.data(), dtype::f32, s);
  }
};

// --- the cases ---------------------------------------------------------------

struct outcome {
  bool supported = true;
  std::string why;  // when not supported
  std::vector<float> got;
  std::vector<double> ref;
  double limit = float_limit;
};

struct op_case {
  std::string op;    // "matmul", "rms_norm", ...
  std::string type;  // weight format, KV dtype or variant
  std::function<outcome(device&, std::mt19937&)> run;
};

outcome unsupported(std::string why) {
  outcome o;
  o.supported = false;
  o.why = std::move(why);
  return o;
}

double nmse(const outcome& o) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < o.ref.size(); ++i) {
    const double d = static_cast<double>(o.got[i]) - o.ref[i];
    num += d * d;
    den += o.ref[i] * o.ref[i];
  }
  return den > 0 ? num / den : num;
}

// Dequantized weights as the storage contract in kernels/quant.hpp defines
// them (the reference multiplies by these).
std::vector<double> weights_as_stored(const weight_matrix& w) {
  std::vector<double> out(static_cast<std::size_t>(w.rows * w.cols));
  std::vector<float> row(static_cast<std::size_t>(w.cols));
  for (std::int64_t r = 0; r < w.rows; ++r) {
    auto ok = dequantize_row(w, r, row);
    EXPECT_TRUE(ok.has_value()) << ok.error().message;
    for (std::int64_t c = 0; c < w.cols; ++c)
      out[static_cast<std::size_t>(r * w.cols + c)] = row[static_cast<std::size_t>(c)];
  }
  return out;
}

bool integer_format(weight_format f) {
  return f != weight_format::f32 && f != weight_format::f16 && f != weight_format::bf16;
}

op_case matmul_case(weight_format f, int group, std::int64_t m) {
  std::string type = std::string(to_string(f));
  if (group) type += "/g" + std::to_string(group);
  type += " m=" + std::to_string(m);
  return {"matmul", type, [f, group, m](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::matmul, f)) return unsupported("format");
            constexpr std::int64_t n = 48, k = 256;
            host_tensor src(randn(rng, n * k, 0.05f), {n, k});
            auto pool = memory_pool::create();
            auto w = troupe::test::is_random_block_format(f)
                         ? result<weight_matrix>(
                               troupe::test::random_block_weights(*pool, f, n, k, rng()))
                         : quantize(*pool, src.t, f, group ? group : 32);
            EXPECT_TRUE(w.has_value()) << w.error().message;
            if (!w) return unsupported("quantize failed");
            auto prepared = dev.prepare(*w);
            EXPECT_TRUE(prepared.has_value()) << prepared.error().message;
            if (!prepared) return unsupported("prepare failed");
            const auto xv = randn(rng, static_cast<std::size_t>(m * k));
            auto x = upload(dev, xv, {m, k});
            auto y = output(dev, {m, n});
            auto r = dev.matmul(x, *prepared, y);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, y);
            const auto wd = weights_as_stored(*w);
            o.ref.assign(static_cast<std::size_t>(m * n), 0.0);
            for (std::int64_t i = 0; i < m; ++i)
              for (std::int64_t j = 0; j < n; ++j) {
                double acc = 0;
                for (std::int64_t c = 0; c < k; ++c)
                  acc += static_cast<double>(xv[static_cast<std::size_t>(i * k + c)]) *
                         wd[static_cast<std::size_t>(j * k + c)];
                o.ref[static_cast<std::size_t>(i * n + j)] = acc;
              }
            o.limit = integer_format(f) ? quant_limit : float_limit;
            return o;
          }};
}

op_case embedding_case(weight_format f) {
  return {"embedding", std::string(to_string(f)), [f](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::embedding, f)) return unsupported("format");
            constexpr std::int64_t vocab = 40, hidden = 256;
            host_tensor src(randn(rng, vocab * hidden), {vocab, hidden});
            auto pool = memory_pool::create();
            auto w = troupe::test::is_random_block_format(f)
                         ? result<weight_matrix>(
                               troupe::test::random_block_weights(*pool, f, vocab, hidden, rng()))
                         : quantize(*pool, src.t, f, 32);
            EXPECT_TRUE(w.has_value()) << w.error().message;
            if (!w) return unsupported("quantize failed");
            const std::vector<std::int32_t> idv = {3, 0, 39, 3, 17};
            auto ids = upload_as(dev, dtype::i32, idv, {static_cast<std::int64_t>(idv.size())});
            auto out = output(dev, {static_cast<std::int64_t>(idv.size()), hidden});
            auto r = dev.embedding(*w, ids, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            const auto wd = weights_as_stored(*w);
            for (auto id : idv)
              for (std::int64_t c = 0; c < hidden; ++c)
                o.ref.push_back(wd[static_cast<std::size_t>(id * hidden + c)]);
            return o;
          }};
}

// Element-wise and per-row ops on f32 [rows, cols].
using rowwise_ref = std::function<void(const std::vector<float>& x, std::vector<double>& ref,
                                       std::int64_t rows, std::int64_t cols)>;

// cols: a multiple of 32, or a ragged row (a tail past the vector loop).
op_case rms_norm_case(std::int64_t cols) {
  return {"rms_norm", cols == 320 ? "f32" : "f32 n=" + std::to_string(cols),
          [cols](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::rms_norm, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t rows = 7;
            const float eps = 1e-5f;
            // Rows of small values, where eps matters, beside ordinary ones.
            auto xv = randn(rng, rows * cols, 2.0f);
            for (std::int64_t c = 0; c < 2 * cols; ++c) xv[static_cast<std::size_t>(c)] *= 1e-3f;
            host_tensor w(randn(rng, cols), {cols});
            auto x = upload(dev, xv, {rows, cols});
            auto wd = upload(dev, w.v, {cols});
            auto out = output(dev, {rows, cols});
            auto r = dev.rms_norm(x, wd, eps, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (std::int64_t i = 0; i < rows; ++i) {
              double ss = 0;
              for (std::int64_t c = 0; c < cols; ++c) {
                const double v = xv[static_cast<std::size_t>(i * cols + c)];
                ss += v * v;
              }
              const double inv = 1.0 / std::sqrt(ss / cols + eps);
              for (std::int64_t c = 0; c < cols; ++c)
                o.ref.push_back(w.v[static_cast<std::size_t>(c)] *
                                (xv[static_cast<std::size_t>(i * cols + c)] * inv));
            }
            return o;
          }};
}

op_case layer_norm_case() {
  return {"layer_norm", "f32", [](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::layer_norm, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t rows = 5, cols = 192;
            const float eps = 1e-6f;
            auto xv = randn(rng, rows * cols, 3.0f);
            for (auto& v : xv) v += 4.0f;  // a mean far from zero
            // One row of small deviations, where eps matters.
            for (std::int64_t c = 0; c < cols; ++c)
              xv[static_cast<std::size_t>(c)] =
                  4.0f + (xv[static_cast<std::size_t>(c)] - 4.0f) * 1e-4f;
            host_tensor w(randn(rng, cols), {cols});
            host_tensor b(randn(rng, cols), {cols});
            auto x = upload(dev, xv, {rows, cols});
            auto wd = upload(dev, w.v, {cols});
            auto bd = upload(dev, b.v, {cols});
            auto out = output(dev, {rows, cols});
            auto r = dev.layer_norm(x, wd, bd, eps, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (std::int64_t i = 0; i < rows; ++i) {
              double mean = 0, var = 0;
              for (std::int64_t c = 0; c < cols; ++c)
                mean += xv[static_cast<std::size_t>(i * cols + c)];
              mean /= cols;
              for (std::int64_t c = 0; c < cols; ++c) {
                const double d = xv[static_cast<std::size_t>(i * cols + c)] - mean;
                var += d * d;
              }
              var /= cols;
              const double inv = 1.0 / std::sqrt(var + eps);
              for (std::int64_t c = 0; c < cols; ++c)
                o.ref.push_back((xv[static_cast<std::size_t>(i * cols + c)] - mean) * inv *
                                    w.v[static_cast<std::size_t>(c)] +
                                b.v[static_cast<std::size_t>(c)]);
            }
            return o;
          }};
}

op_case unary_case(std::string type,
                   std::function<result<void>(device&, const tensor&, const tensor&)> op,
                   std::function<double(double)> f) {
  return {"activation", type, [op, f](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::activation, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t rows = 6, cols = 200;
            const auto xv = randn(rng, rows * cols, 3.0f);
            auto x = upload(dev, xv, {rows, cols});
            auto out = output(dev, {rows, cols});
            auto r = op(dev, x, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (float v : xv) o.ref.push_back(f(v));
            return o;
          }};
}

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

op_case swiglu_case() {
  return {"activation", "swiglu", [](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::activation, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t rows = 4, cols = 352;
            const auto gv = randn(rng, rows * cols, 3.0f), uv = randn(rng, rows * cols);
            auto g = upload(dev, gv, {rows, cols});
            auto u = upload(dev, uv, {rows, cols});
            auto out = output(dev, {rows, cols});
            auto r = dev.swiglu(g, u, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (std::size_t i = 0; i < gv.size(); ++i)
              o.ref.push_back(gv[i] * sigmoid(gv[i]) * static_cast<double>(uv[i]));
            return o;
          }};
}

// GeGLU (Gemma's FFN): gelu_tanh(gate) * up; 353 columns (a ragged tail).
op_case geglu_case() {
  return {"geglu", "f32", [](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::geglu, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t rows = 4, cols = 353;
            const auto gv = randn(rng, rows * cols, 3.0f), uv = randn(rng, rows * cols);
            auto g = upload(dev, gv, {rows, cols});
            auto u = upload(dev, uv, {rows, cols});
            auto out = output(dev, {rows, cols});
            auto r = dev.geglu(g, u, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (std::size_t i = 0; i < gv.size(); ++i) {
              const double x = gv[i];
              const double gelu =
                  0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
              o.ref.push_back(gelu * static_cast<double>(uv[i]));
            }
            return o;
          }};
}

op_case scale_case() {
  return {"scale", "f32", [](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::scale, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t rows = 3, cols = 101;
            const auto xv = randn(rng, rows * cols);
            auto x = upload(dev, xv, {rows, cols});
            auto out = output(dev, {rows, cols});
            const float s = std::sqrt(640.0f);
            auto r = dev.scale(x, s, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (float v : xv) o.ref.push_back(static_cast<double>(v) * s);
            return o;
          }};
}

// out = a + b, with b of a's shape or (bias) one row added to every row.
op_case add_case(bool bias) {
  return {"add", bias ? "f32, one row added to every row (a bias)" : "f32",
          [bias](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::add, dtype::f32)) return unsupported("f32");
            const std::int64_t rows = bias ? 5 : 3, cols = bias ? 97 : 100;
            const std::int64_t b_rows = bias ? 1 : rows;
            const auto av = randn(rng, rows * cols), bv = randn(rng, b_rows * cols);
            auto a = upload(dev, av, {rows, cols});
            auto b = bias ? upload(dev, bv, {cols}) : upload(dev, bv, {rows, cols});
            auto out = output(dev, {rows, cols});
            auto r = dev.add(a, b, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (std::size_t i = 0; i < av.size(); ++i)
              o.ref.push_back(static_cast<double>(av[i]) + bv[i % bv.size()]);
            return o;
          }};
}

op_case softmax_case() {
  return {"softmax", "f32 scaled, a masked row", [](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::softmax, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t rows = 5, cols = 257;
            const float scale = 0.125f;
            auto xv = randn(rng, rows * cols, 8.0f);
            for (std::int64_t c = 0; c < cols; ++c)
              xv[static_cast<std::size_t>(2 * cols + c)] = -INFINITY;  // all masked: zeros
            for (std::int64_t c = 0; c < cols; c += 3)
              xv[static_cast<std::size_t>(3 * cols + c)] = -INFINITY;  // partly masked
            auto x = upload(dev, xv, {rows, cols});
            auto out = output(dev, {rows, cols});
            auto r = dev.softmax(x, out, scale);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (std::int64_t i = 0; i < rows; ++i) {
              double mx = -INFINITY;
              for (std::int64_t c = 0; c < cols; ++c)
                mx = std::max(
                    mx, static_cast<double>(scale) * xv[static_cast<std::size_t>(i * cols + c)]);
              double sum = 0;
              std::vector<double> e(static_cast<std::size_t>(cols), 0.0);
              if (std::isfinite(mx))
                for (std::int64_t c = 0; c < cols; ++c) {
                  e[static_cast<std::size_t>(c)] = std::exp(
                      static_cast<double>(scale) * xv[static_cast<std::size_t>(i * cols + c)] - mx);
                  sum += e[static_cast<std::size_t>(c)];
                }
              for (std::int64_t c = 0; c < cols; ++c)
                o.ref.push_back(sum > 0 ? e[static_cast<std::size_t>(c)] / sum : 0.0);
            }
            return o;
          }};
}

op_case rope_case(std::string type, rope_params params, int head_dim) {
  return {"rope", type, [params, head_dim](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::rope, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t tokens = 5, heads = 3;
            const auto xv = randn(rng, tokens * heads * head_dim);
            const std::vector<std::int32_t> pos = {0, 1, 17, 1000, 40000};
            auto x = upload(dev, xv, {tokens, heads, head_dim});
            auto out = output(dev, {tokens, heads, head_dim});
            auto r = dev.rope(x, pos, params, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            const int rot = params.rotary_dims ? params.rotary_dims : head_dim;
            // The op under test is the rotation; the frequencies are the
            // transformers rule that rope_inv_freq implements (its own fixture
            // test checks it against transformers).
            std::vector<float> inv(static_cast<std::size_t>(rot / 2));
            EXPECT_TRUE(rope_inv_freq(params, head_dim, inv).has_value());
            o.ref.assign(xv.begin(), xv.end());
            for (std::int64_t t = 0; t < tokens; ++t)
              for (std::int64_t h = 0; h < heads; ++h) {
                const std::size_t base = static_cast<std::size_t>((t * heads + h) * head_dim);
                for (int i = 0; i < rot / 2; ++i) {
                  const float angle = static_cast<float>(pos[static_cast<std::size_t>(t)]) *
                                      inv[static_cast<std::size_t>(i)];
                  const double c = std::cos(static_cast<double>(angle)),
                               s = std::sin(static_cast<double>(angle));
                  const std::size_t a = base + static_cast<std::size_t>(
                                                   params.layout == rope_layout::neox ? i : 2 * i);
                  const std::size_t b = params.layout == rope_layout::neox
                                            ? a + static_cast<std::size_t>(rot / 2)
                                            : a + 1;
                  o.ref[a] = xv[a] * c - xv[b] * s;
                  o.ref[b] = xv[a] * s + xv[b] * c;
                }
              }
            return o;
          }};
}

// The keys a query row at absolute position p sees (kernels/attention.hpp).
bool visible(const attention_options& opt, std::int64_t p, std::int64_t j) {
  if (!opt.causal) return true;
  if (j > p) return false;
  if (opt.window > 0) return j < opt.sinks || j >= p + 1 - opt.window;
  return true;
}

// Reference attention of one sequence in double: q [nq, H, d], k/v as
// stored [nkv, Hkv, d].
void attention_ref(const std::vector<float>& q, const std::vector<float>& k,
                   const std::vector<float>& v, std::int64_t nq, std::int64_t nkv, int heads,
                   int kv_heads, int d, std::int64_t q_start, const attention_options& opt,
                   std::vector<double>& out) {
  const double scale = opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(d));
  const int group = heads / kv_heads;
  for (std::int64_t i = 0; i < nq; ++i)
    for (int h = 0; h < heads; ++h) {
      const int kh = h / group;
      std::vector<double> s(static_cast<std::size_t>(nkv), -INFINITY);
      double mx = -INFINITY;
      for (std::int64_t j = 0; j < nkv; ++j) {
        if (!visible(opt, q_start + i, j)) continue;
        double dot = 0;
        for (int c = 0; c < d; ++c)
          dot += static_cast<double>(q[static_cast<std::size_t>((i * heads + h) * d + c)]) *
                 k[static_cast<std::size_t>((j * kv_heads + kh) * d + c)];
        s[static_cast<std::size_t>(j)] = dot * scale;
        mx = std::max(mx, s[static_cast<std::size_t>(j)]);
      }
      double sum = 0;
      for (auto& x : s) {
        x = std::isfinite(x) ? std::exp(x - mx) : 0.0;
        sum += x;
      }
      for (int c = 0; c < d; ++c) {
        double acc = 0;
        for (std::int64_t j = 0; j < nkv; ++j)
          acc += s[static_cast<std::size_t>(j)] *
                 v[static_cast<std::size_t>((j * kv_heads + kh) * d + c)];
        out.push_back(sum > 0 ? acc / sum : 0.0);
      }
    }
}

op_case attention_case(std::string type, dtype kv, attention_options opt, std::int64_t nq,
                       std::int64_t nkv) {
  return {"attention", type, [kv, opt, nq, nkv](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::attention, kv))
              return unsupported(std::string(to_string(kv)));
            constexpr int heads = 4, kv_heads = 2, d = 64;
            const auto qv = randn(rng, static_cast<std::size_t>(nq * heads * d));
            auto kf = randn(rng, static_cast<std::size_t>(nkv * kv_heads * d));
            auto vf = randn(rng, static_cast<std::size_t>(nkv * kv_heads * d));
            auto q = upload(dev, qv, {nq, heads, d});
            tensor k, v;
            if (kv == dtype::f16) {
              std::vector<f16> kh(kf.size()), vh(vf.size());
              for (std::size_t i = 0; i < kf.size(); ++i) {
                kh[i] = to_f16(kf[i]);
                vh[i] = to_f16(vf[i]);
                kf[i] = to_f32(kh[i]);  // the reference sees what is stored
                vf[i] = to_f32(vh[i]);
              }
              k = upload_as(dev, dtype::f16, kh, {nkv, kv_heads, d});
              v = upload_as(dev, dtype::f16, vh, {nkv, kv_heads, d});
            } else {
              k = upload(dev, kf, {nkv, kv_heads, d});
              v = upload(dev, vf, {nkv, kv_heads, d});
            }
            auto out = output(dev, {nq, heads, d});
            auto r = dev.attention(q, k, v, out, opt);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            attention_ref(qv, kf, vf, nq, nkv, heads, kv_heads, d, opt.causal ? nkv - nq : 0, opt,
                          o.ref);
            return o;
          }};
}

// Two sequences in one call over a paged cache: one decoding a token, one
// prefilling a chunk in the middle of its prompt.
op_case paged_case(dtype kv, attention_options opt) {
  std::string type = std::string(to_string(kv)) + " cache";
  if (opt.window)
    type += ", window " + std::to_string(opt.window) + " sinks " + std::to_string(opt.sinks);
  return {
      "attention_paged", type, [kv, opt](device& dev, std::mt19937& rng) {
        if (!dev.supports(op_kind::attention, kv)) return unsupported(std::string(to_string(kv)));
        constexpr int heads = 4, kv_heads = 2, d = 64, block = 16;
        kv_cache_config cfg;
        cfg.block_size = block;
        cfg.n_kv_heads = kv_heads;
        cfg.head_dim = d;
        cfg.type = kv;
        cfg.n_blocks = 16;
        auto cache = create_paged_kv_cache(dev, cfg);
        EXPECT_TRUE(cache.has_value()) << cache.error().message;
        if (!cache) return unsupported("cache");
        struct seq {
          std::int64_t nkv, nq;
          std::vector<std::int32_t> table;
          std::vector<float> k, v, q;
          tensor qt, out;
        };
        std::vector<seq> seqs = {{37, 1, {9, 2, 14}, {}, {}, {}, {}, {}},
                                 {50, 6, {0, 5, 3, 11}, {}, {}, {}, {}, {}}};
        std::vector<attention_sequence> calls;
        for (auto& s : seqs) {
          s.k = randn(rng, static_cast<std::size_t>(s.nkv * kv_heads * d));
          s.v = randn(rng, static_cast<std::size_t>(s.nkv * kv_heads * d));
          s.q = randn(rng, static_cast<std::size_t>(s.nq * heads * d));
          // Appended in two calls, the second starting mid-block.
          const std::int64_t first = s.nkv / 2 + 3;
          auto k0 = upload(dev, std::vector<float>(s.k.begin(), s.k.begin() + first * kv_heads * d),
                           {first, kv_heads, d});
          auto v0 = upload(dev, std::vector<float>(s.v.begin(), s.v.begin() + first * kv_heads * d),
                           {first, kv_heads, d});
          auto k1 = upload(dev, std::vector<float>(s.k.begin() + first * kv_heads * d, s.k.end()),
                           {s.nkv - first, kv_heads, d});
          auto v1 = upload(dev, std::vector<float>(s.v.begin() + first * kv_heads * d, s.v.end()),
                           {s.nkv - first, kv_heads, d});
          auto a = dev.append_kv(*cache, s.table, 0, k0, v0);
          EXPECT_TRUE(a.has_value()) << a.error().message;
          a = dev.append_kv(*cache, s.table, first, k1, v1);
          EXPECT_TRUE(a.has_value()) << a.error().message;
          s.qt = upload(dev, s.q, {s.nq, heads, d});
          s.out = output(dev, {s.nq, heads, d});
          attention_sequence call;
          call.q = s.qt;
          call.out = s.out;
          call.q_start = s.nkv - s.nq;
          call.kv_len = s.nkv;
          call.block_table = s.table;
          calls.push_back(call);
        }
        auto r = dev.attention_paged(*cache, calls, opt);
        EXPECT_TRUE(r.has_value()) << r.error().message;
        outcome o;
        for (auto& s : seqs) {
          auto got = download(dev, s.out);
          o.got.insert(o.got.end(), got.begin(), got.end());
          attention_ref(s.q, as_stored(s.k, kv, d), as_stored(s.v, kv, d), s.nq, s.nkv, heads,
                        kv_heads, d, s.nkv - s.nq, opt, o.ref);
        }
        return o;
      }};
}

op_case patch_conv_case() {
  return {"conv2d_patch", "f32 14x14 patches", [](device& dev, std::mt19937& rng) {
            if (!dev.supports(op_kind::conv2d_patch, dtype::f32)) return unsupported("f32");
            constexpr std::int64_t batch = 2, ch = 3, hw = 56, p = 14, hidden = 32;
            constexpr std::int64_t side = hw / p, patches = side * side;
            host_tensor w(randn(rng, hidden * ch * p * p, 0.1f), {hidden, ch, p, p});
            host_tensor b(randn(rng, hidden), {hidden});
            auto conv = dev.prepare_patch_conv(w.t, b.t);
            EXPECT_TRUE(conv.has_value()) << conv.error().message;
            if (!conv) return unsupported("prepare failed");
            const auto iv = randn(rng, batch * ch * hw * hw);
            auto in = upload(dev, iv, {batch, ch, hw, hw});
            auto out = output(dev, {batch, patches, hidden});
            auto r = dev.run_patch_conv(*conv, in, out);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            outcome o;
            o.got = download(dev, out);
            for (std::int64_t n = 0; n < batch; ++n)
              for (std::int64_t py = 0; py < side; ++py)
                for (std::int64_t px = 0; px < side; ++px)
                  for (std::int64_t hdx = 0; hdx < hidden; ++hdx) {
                    double acc = b.v[static_cast<std::size_t>(hdx)];
                    for (std::int64_t c = 0; c < ch; ++c)
                      for (std::int64_t y = 0; y < p; ++y)
                        for (std::int64_t x = 0; x < p; ++x)
                          acc +=
                              static_cast<double>(
                                  w.v[static_cast<std::size_t>(((hdx * ch + c) * p + y) * p + x)]) *
                              iv[static_cast<std::size_t>(((n * ch + c) * hw + py * p + y) * hw +
                                                          px * p + x)];
                    o.ref.push_back(acc);
                  }
            return o;
          }};
}

std::vector<op_case> all_cases() {
  std::vector<op_case> v;
  const std::vector<std::pair<weight_format, int>> formats = {
      {weight_format::f32, 0},        {weight_format::f16, 0},        {weight_format::bf16, 0},
      {weight_format::int8_sym, 0},   {weight_format::int8_asym, 0},  {weight_format::int4_sym, 32},
      {weight_format::int4_sym, 128}, {weight_format::int4_asym, 64}, {weight_format::q8_0, 0},
      {weight_format::q4_0, 0},       {weight_format::q4_1, 0},       {weight_format::q5_0, 0},
      {weight_format::q5_1, 0},       {weight_format::q2_k, 0},       {weight_format::q3_k, 0},
      {weight_format::q4_k, 0},       {weight_format::q5_k, 0},       {weight_format::q6_k, 0},
      {weight_format::iq4_nl, 0},     {weight_format::iq4_xs, 0}};
  for (auto [f, g] : formats)
    for (std::int64_t m : {1, 5, 64}) v.push_back(matmul_case(f, g, m));
  for (auto [f, g] : formats)
    if (g <= 32) v.push_back(embedding_case(f));
  v.push_back(rms_norm_case(320));
  v.push_back(rms_norm_case(347));
  v.push_back(layer_norm_case());
  v.push_back(unary_case(
      "silu", [](device& d, const tensor& x, const tensor& o) { return d.silu(x, o); },
      [](double x) { return x * sigmoid(x); }));
  v.push_back(unary_case(
      "gelu tanh",
      [](device& d, const tensor& x, const tensor& o) { return d.gelu(x, gelu_kind::tanh, o); },
      [](double x) {
        return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
      }));
  v.push_back(unary_case(
      "gelu erf",
      [](device& d, const tensor& x, const tensor& o) { return d.gelu(x, gelu_kind::erf, o); },
      [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }));
  v.push_back(unary_case(
      "gelu quick",
      [](device& d, const tensor& x, const tensor& o) { return d.gelu(x, gelu_kind::quick, o); },
      [](double x) { return x * sigmoid(1.702 * x); }));
  v.push_back(swiglu_case());
  v.push_back(geglu_case());
  v.push_back(scale_case());
  v.push_back(add_case(false));
  v.push_back(add_case(true));
  v.push_back(softmax_case());
  {
    rope_params neox;
    v.push_back(rope_case("neox", neox, 64));
    rope_params adj;
    adj.layout = rope_layout::adjacent;
    adj.theta = 500000.0f;
    v.push_back(rope_case("adjacent, theta 5e5", adj, 64));
    rope_params part;
    part.rotary_dims = 32;
    v.push_back(rope_case("neox, 32 of 80 dims", part, 80));
    rope_params l3;
    l3.llama3 = rope_llama3_scaling{};
    l3.theta = 500000.0f;
    v.push_back(rope_case("neox, llama3 scaling", l3, 128));
  }
  for (dtype kv : {dtype::f32, dtype::f16}) {
    attention_options causal;
    v.push_back(attention_case(std::string(to_string(kv)) + " causal prefill", kv, causal, 19, 19));
    v.push_back(attention_case(std::string(to_string(kv)) + " causal decode", kv, causal, 1, 70));
    attention_options bidi;
    bidi.causal = false;
    v.push_back(attention_case(std::string(to_string(kv)) + " bidirectional", kv, bidi, 9, 33));
    attention_options win;
    win.window = 16;
    win.sinks = 4;
    v.push_back(attention_case(std::string(to_string(kv)) + " window 16 sinks 4", kv, win, 24, 60));
  }
  for (dtype kv : {dtype::f32, dtype::f16, dtype::i8}) {
    v.push_back(paged_case(kv, attention_options{}));
    attention_options win;
    win.window = 20;
    win.sinks = 2;
    v.push_back(paged_case(kv, win));
  }
  v.push_back(patch_conv_case());
  return v;
}

// --- running them --------------------------------------------------------------

struct row {
  std::string device, op, type, result;
  double err = 0, limit = 0;
};

std::vector<row>& table() {
  static std::vector<row> t;
  return t;
}

class print_table : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("\n%-10s %-16s %-34s %-12s %-8s %s\n", "device", "op", "type", "nmse", "limit",
                "result");
    std::map<std::string, std::vector<std::string>> missing;
    for (const auto& r : table()) {
      if (r.result == "unsupported") {
        missing[r.device].push_back(r.op + " " + r.type);
        std::printf("%-10s %-16s %-34s %-12s %-8s %s\n", r.device.c_str(), r.op.c_str(),
                    r.type.c_str(), "-", "-", r.result.c_str());
      } else {
        std::printf("%-10s %-16s %-34s %-12.3g %-8.0e %s\n", r.device.c_str(), r.op.c_str(),
                    r.type.c_str(), r.err, r.limit, r.result.c_str());
      }
    }
    for (const auto& [dev, cases] : missing) {
      std::printf("%s does not run %zu cases:", dev.c_str(), cases.size());
      for (const auto& c : cases) std::printf(" [%s]", c.c_str());
      std::printf("\n");
    }
  }
};

const auto* const env = ::testing::AddGlobalTestEnvironment(new print_table);

device_registry& registry() {
  static auto reg = [] {
    auto r = device_registry::discover();
    if (!r) {
      ADD_FAILURE() << r.error().message;
      std::abort();
    }
    return std::move(*r);
  }();
  return *reg;
}

// Every device the registry finds, and a CPU device whose memory host code
// cannot touch (tests/remote_memory_device.hpp): the cases reach a device's
// memory only through the seam, as they must for a GPU.
std::vector<device*> devices() {
  static troupe::test::remote_memory_device remote;
  std::vector<device*> out;
  for (const auto& d : registry().devices()) out.push_back(d.get());
  out.push_back(&remote);
  return out;
}

class Conformance : public ::testing::TestWithParam<std::size_t> {};

// A parametrized case's test name: its index, op and type.
std::string case_name(const ::testing::TestParamInfo<std::size_t>& info) {
  static const auto cases = all_cases();
  std::string n = cases[info.param].op + "_" + cases[info.param].type;
  for (auto& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return std::to_string(info.param) + "_" + n;
}

TEST_P(Conformance, MatchesTheReferenceOnEveryDevice) {
  static const auto cases = all_cases();
  const auto& c = cases[GetParam()];
  SCOPED_TRACE(c.op + " " + c.type);
  for (device* d : devices()) {
    std::mt19937 rng(1234 + static_cast<unsigned>(GetParam()));
    SCOPED_TRACE(d->info().name);
    auto o = c.run(*d, rng);
    row r{d->info().name, c.op, c.type, "", 0, o.limit};
    if (!o.supported) {
      r.result = "unsupported";
    } else {
      ASSERT_EQ(o.got.size(), o.ref.size());
      r.err = nmse(o);
      r.result = r.err <= o.limit ? "ok" : "FAIL";
      EXPECT_LE(r.err, o.limit);
      for (float g : o.got) ASSERT_TRUE(std::isfinite(g)) << "an output element was not written";
    }
    table().push_back(r);
  }
}

INSTANTIATE_TEST_SUITE_P(EveryOp, Conformance, ::testing::Range<std::size_t>(0, all_cases().size()),
                         case_name);

// The CPU device runs every case: the table's "does not run" line for it
// stays empty (a GPU backend may list cases there; the planner places that
// work on a CPU device).
TEST(Conformance, TheCpuRunsEveryCase) {
  auto cpu = registry().find("cpu");
  ASSERT_TRUE(cpu.has_value()) << cpu.error().message;
  for (const auto& c : all_cases()) {
    std::mt19937 rng(7);
    auto o = c.run(**cpu, rng);
    EXPECT_TRUE(o.supported) << c.op << " " << c.type << ": " << o.why;
  }
}

}  // namespace

// Where a GPU is, the CUDA device runs every case of the table within the
// limits, so a backend cannot pass by declaring ops unsupported. Skipped,
// with the probe's reason, where there is no GPU.
TEST(Conformance, TheGpuRunsTheOpsItMustWhereAGpuIs) {
  device* gpu = nullptr;
  for (const auto& d : registry().devices())
    if (d->info().kind == device_kind::cuda) gpu = d.get();
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA device: " << registry().cuda_status();
  std::printf("[ gpu ] %s: %s\n", gpu->info().name.c_str(), gpu->info().detail.c_str());
  int ran = 0;
  // The GGUF formats past Q4_0 have no CUDA kernels yet (their layers run
  // on a CPU device); the GPU must say so rather than run them.
  auto cpu_only = [](const op_case& c) {
    if (c.op == "geglu" || c.op == "scale") return true;
    for (int f = static_cast<int>(weight_format::q4_1);
         f <= static_cast<int>(weight_format::iq4_xs); ++f)
      if (c.type.rfind(std::string(to_string(static_cast<weight_format>(f))) + " ", 0) == 0 ||
          c.type == to_string(static_cast<weight_format>(f)))
        return true;
    return false;
  };
  for (const auto& c : all_cases()) {
    std::mt19937 rng(11);
    auto o = c.run(*gpu, rng);
    if (cpu_only(c)) {
      EXPECT_FALSE(o.supported) << c.op << " " << c.type << " has a CUDA kernel now: test it";
      continue;
    }
    EXPECT_TRUE(o.supported) << c.op << " " << c.type << ": " << o.why;
    if (!o.supported) continue;
    ++ran;
    EXPECT_LE(nmse(o), o.limit) << c.op << " " << c.type;
  }
  EXPECT_GT(ran, 0);
}

namespace {

// One set of bits on every instruction set: each case, run on CPU devices
// capped at every ISA level this machine has, gives the same bytes as the
// scalar path (a migration or failover between an AVX2 and an AVX-512 node
// must stay token-identical).
class SameBits : public ::testing::TestWithParam<std::size_t> {};

TEST_P(SameBits, EveryIsaLevelGivesTheScalarPathsBits) {
  static const auto cases = all_cases();
  const auto& c = cases[GetParam()];
  SCOPED_TRACE(c.op + " " + c.type);
  auto scalar = troupe::kernels::cpu::cpu_device::with_threads(2);
  scalar->ctx().set_level(troupe::kernels::cpu::isa::scalar);
  std::mt19937 rng0(99 + static_cast<unsigned>(GetParam()));
  const auto want = c.run(*scalar, rng0);
  ASSERT_TRUE(want.supported) << want.why;
  const auto top = scalar->ctx().hardware_level();
  for (auto level = troupe::kernels::cpu::isa::avx2; level <= top;
       level = static_cast<troupe::kernels::cpu::isa>(static_cast<int>(level) + 1)) {
    // At the AVX-512 levels, float matmuls on zmm and on ymm (which one a
    // CPU runs by default depends on its FMA width).
    for (const bool wide : {false, true}) {
      if (wide && level < troupe::kernels::cpu::isa::avx512) continue;
      auto dev = troupe::kernels::cpu::cpu_device::with_threads(2);
      dev->ctx().set_level(level);
      dev->ctx().set_wide_float_matmul(wide);
      std::mt19937 rng(99 + static_cast<unsigned>(GetParam()));
      const auto got = c.run(*dev, rng);
      ASSERT_EQ(got.got.size(), want.got.size());
      std::size_t differ = 0, first = got.got.size();
      float worst = 0;
      for (std::size_t i = 0; i < got.got.size(); ++i)
        if (std::memcmp(&got.got[i], &want.got[i], sizeof(float)) != 0) {
          if (differ++ == 0) first = i;
          worst = std::max(worst, std::abs(got.got[i] - want.got[i]));
        }
      EXPECT_EQ(differ, 0u) << to_string(level) << (wide ? " (zmm float matmul)" : "") << ": "
                            << differ << " of " << got.got.size()
                            << " elements differ from the scalar path (first at " << first
                            << ", worst by " << worst << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryOp, SameBits, ::testing::Range<std::size_t>(0, all_cases().size()),
                         case_name);

}  // namespace
